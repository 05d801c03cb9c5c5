"""Prompt layout: [prefix][chunk 0][sep][chunk 1]...[chunk k-1][suffix], assembled from token ids (the package's
own template), or a user's prompt tokenized whole with the stored chunks aligned to its tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher

import torch

_SLOT = "\x00CHUNKS\x00"


@dataclass(frozen=True)
class PromptTemplate:
    """How a RAG request becomes a prompt; rendered through the model's chat template when it has one."""

    system: str = (
        "You are a helpful assistant. Answer the question with a few words, "
        "using only the passages given by the user."
    )
    question: str = "\n\nAnswer the question from the passages above in a few words.\nQuestion: {question}"
    separator: str = "\n\n"

    def render(self, tokenizer, question: str, history: Sequence[dict] = ()) -> tuple[list[int], list[int], list[int]]:
        """Token ids of (prefix, separator, suffix) for `question`, after the earlier turns `history`.

        history: the conversation before `question` as `{"role", "content"}` messages (no system message: that is
        the template's). The chunks sit in the first user turn (with the question template around its text), later
        turns follow as they are, so turn n's prompt plus its answer is the start of turn n + 1's prompt.
        """
        turns = [*history, {"role": "user", "content": question}]
        first = next(i for i, m in enumerate(turns) if m["role"] == "user")
        prefix_text, tail = self._split(tokenizer, turns[:first], turns[first + 1:])
        prefix = tokenizer(prefix_text, add_special_tokens=not getattr(tokenizer, "chat_template", None))
        suffix_text = self.question.format(question=turns[first]["content"]) + tail
        encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
        return list(prefix["input_ids"]), encode(self.separator), encode(suffix_text)

    def prefix_ids(self, tokenizer) -> list[int]:
        """Token ids of the prefix alone (the default chunk lead-in)."""
        return self.render(tokenizer, "")[0]

    def _split(self, tokenizer, before: Sequence[dict] = (), after: Sequence[dict] = ()) -> tuple[str, str]:
        """The text before and after the chunks' slot in the first user turn, with the turns before and after it."""
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": self.system}, *before, {"role": "user", "content": _SLOT},
                        *after]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            head, _, tail = text.partition(_SLOT)
            return head, tail
        # no chat template (a base model): the same turns as plain text, each answer after "Answer:"
        return self.system + "\n\n" + "".join(map(_plain_turn, before)), "\nAnswer:" + "".join(map(_plain_turn, after))


def _plain_turn(message: dict) -> str:
    """One earlier turn in the plain-text template: an answer follows "Answer:", a question asks for the next."""
    if message["role"] == "assistant":
        return " " + message["content"]
    if message["role"] == "user":
        return f"\n\nQuestion: {message['content']}\nAnswer:"
    return f"\n\n{message['role'].capitalize()}: {message['content']}"


@dataclass(frozen=True)
class Layout:
    """Where each segment landed in the fused sequence."""

    token_ids: torch.Tensor  # (N,)
    segment_of_row: torch.Tensor  # (N,): chunk index, or -1
    prefix_len: int
    chunk_starts: tuple[int, ...]  # first row of each chunk


def assemble(prefix: list[int], chunks: list[torch.Tensor], separator: list[int], suffix: list[int]) -> Layout:
    """Concatenate token ids with contiguous positions; separators sit between chunks."""
    pieces: list[torch.Tensor] = [torch.tensor(prefix, dtype=torch.long)]
    segments: list[torch.Tensor] = [torch.full((len(prefix),), -1, dtype=torch.long)]
    starts: list[int] = []
    row = len(prefix)
    sep = torch.tensor(separator, dtype=torch.long)
    for i, ids in enumerate(chunks):
        if i > 0 and sep.numel():
            pieces.append(sep)
            segments.append(torch.full((sep.numel(),), -1, dtype=torch.long))
            row += sep.numel()
        starts.append(row)
        pieces.append(ids.to(torch.long).cpu())
        segments.append(torch.full((ids.numel(),), i, dtype=torch.long))
        row += ids.numel()
    pieces.append(torch.tensor(suffix, dtype=torch.long))
    segments.append(torch.full((len(suffix),), -1, dtype=torch.long))
    return Layout(torch.cat(pieces), torch.cat(segments), len(prefix), tuple(starts))


def align_chunk(prompt_ids: list[int], offsets: list[tuple[int, int]], start: int, end: int,
                chunk_ids: list[int]) -> tuple[int, int, int] | None:
    """Where the prompt's own tokens reproduce a chunk found at characters [start, end) of the prompt.

    `offsets` are the prompt tokens' character spans. Of the tokens inside [start, end), the longest run equal to a
    run of the chunk's own tokens is returned as (first row, first chunk token, past-the-last chunk token); tokens
    at the chunk's edges that merged with the text around it are left out (they are computed). None: no token of
    the chunk survived.
    """
    window = [j for j, (a, b) in enumerate(offsets) if start <= a and b <= end and a < b]
    if not window:
        return None
    lo, hi = window[0], window[-1] + 1
    match = SequenceMatcher(None, prompt_ids[lo:hi], chunk_ids, autojunk=False).find_longest_match(
        0, hi - lo, 0, len(chunk_ids))
    if match.size == 0:
        return None
    return lo + match.a, match.b, match.b + match.size


def prompt_layout(token_ids: list[int], parts: list[tuple[int, int]]) -> Layout:
    """The prompt's own tokens, with chunk i's stored tokens at rows [row_i, row_i + n_i) given as (row_i, n_i).

    Chunks are in row order and do not overlap; the exact prefix is every row before the first chunk (none when
    the prompt carries no chunk: then it is all computed).
    """
    segments = torch.full((len(token_ids),), -1, dtype=torch.long)
    last = 0
    for i, (row, n) in enumerate(parts):
        if row < last or row + n > len(token_ids):
            raise ValueError(f"chunk {i} at rows {row}:{row + n} overlaps another or runs past the prompt")
        segments[row:row + n] = i
        last = row + n
    return Layout(torch.tensor(token_ids, dtype=torch.long), segments, parts[0][0] if parts else 0,
                  tuple(row for row, _ in parts))


def insert_rows(layout: Layout, row: int, token_ids: Sequence[int]) -> Layout:
    """The layout with `token_ids` inserted as uncached rows at `row` (learned links after the last chunk); chunks
    at or after `row` move down by their number."""
    n = len(token_ids)
    ids = torch.cat([layout.token_ids[:row], torch.tensor(list(token_ids), dtype=torch.long), layout.token_ids[row:]])
    segments = torch.cat([layout.segment_of_row[:row], torch.full((n,), -1, dtype=torch.long),
                          layout.segment_of_row[row:]])
    starts = tuple(s + n if s >= row else s for s in layout.chunk_starts)
    return Layout(ids, segments, layout.prefix_len + n if layout.prefix_len > row else layout.prefix_len, starts)


def after_last_chunk(layout: Layout) -> int | None:
    """The row right after the last chunk's last row, or None when the layout holds no chunk."""
    rows = (layout.segment_of_row >= 0).nonzero()
    return int(rows[-1]) + 1 if rows.numel() else None

"""Prompt layout: [prefix][chunk 0][sep][chunk 1]...[chunk k-1][suffix], assembled from token ids."""

from __future__ import annotations

from dataclasses import dataclass

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

    def render(self, tokenizer, question: str) -> tuple[list[int], list[int], list[int]]:
        """Token ids of (prefix, separator, suffix) for `question`."""
        prefix_text, tail = self._split(tokenizer)
        prefix = tokenizer(prefix_text, add_special_tokens=not getattr(tokenizer, "chat_template", None))
        suffix_text = self.question.format(question=question) + tail
        encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
        return list(prefix["input_ids"]), encode(self.separator), encode(suffix_text)

    def prefix_ids(self, tokenizer) -> list[int]:
        """Token ids of the prefix alone (the default chunk lead-in)."""
        return self.render(tokenizer, "")[0]

    def _split(self, tokenizer) -> tuple[str, str]:
        """The text before and after the chunks' slot in the user turn."""
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": self.system}, {"role": "user", "content": _SLOT}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            before, _, after = text.partition(_SLOT)
            return before, after
        return self.system + "\n\n", "\nAnswer:"


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


def assemble_pieces(texts: list[list[int]], chunks: list[torch.Tensor]) -> Layout:
    """[text 0][chunk 0][text 1]...[chunk k-1][text k] with contiguous positions (a prompt the user wrote).

    The exact prefix is text 0 when there are chunks; with none, nothing is a prefix (the prompt is computed).
    """
    if len(texts) != len(chunks) + 1:
        raise ValueError(f"{len(chunks)} chunks need {len(chunks) + 1} text pieces, got {len(texts)}")
    pieces: list[torch.Tensor] = []
    segments: list[torch.Tensor] = []
    starts: list[int] = []
    row = 0
    for i, text in enumerate(texts):
        pieces.append(torch.tensor(text, dtype=torch.long))
        segments.append(torch.full((len(text),), -1, dtype=torch.long))
        row += len(text)
        if i < len(chunks):
            starts.append(row)
            pieces.append(chunks[i].to(torch.long).cpu())
            segments.append(torch.full((chunks[i].numel(),), i, dtype=torch.long))
            row += chunks[i].numel()
    return Layout(torch.cat(pieces), torch.cat(segments), len(texts[0]) if chunks else 0, tuple(starts))

"""Prompt matching: a whole prompt (a string, or chat messages rendered by the chat template) tokenized once, as
the model would tokenize it, and the stored chunks found in it by their text (`ingest/index.py`), each placed where
the prompt's own tokens reproduce its stored tokens (`fuse/layout.py`: edge tokens merged with the text around a
chunk are computed). The engine calls `prompt_request` for a `Request` with a `prompt`."""

from __future__ import annotations

import logging
import threading
import unicodedata
from collections.abc import Callable, Sequence

from ..errors import ConfigError, PromptTooLongError
from ..ingest.chunks import Chunk
from ..ingest.index import ChunkIndex, normalize_prompt_map
from .layout import align_chunk, prompt_layout
from .policy import FusionRequest

logger = logging.getLogger(__name__)

CONTEXT_CHARS = 1500  # a prompt this long with no stored chunk in it probably carries context we missed

__all__ = ["CONTEXT_CHARS", "NoMatchWarning", "prompt_request", "prompt_text"]


class NoMatchWarning:
    """Says once (per engine, under a lock: requests may come from several threads) why a prompt that seems to
    carry retrieved context reused nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.said = False

    def __call__(self, changed: list[str]) -> None:
        with self._lock:
            if self.said:
                return
            self.said = True
        if changed:
            logger.warning("no stored chunk matched this prompt: %d ingested chunk(s) start here but their text then "
                           "differs (edited or truncated after ingestion?), e.g. %s; re-ingest the changed "
                           "documents (said once)", len(changed), changed[0])
        else:
            logger.warning("no stored chunk matched this prompt, which seems to carry retrieved context: no ingested "
                           "chunk's text appears in it verbatim, so no KV is reused: ingest the documents your "
                           "retriever returns (engine.ingest or `cacheblend-rag ingest`) and pass their text "
                           "unchanged (said once)")


def prompt_text(tokenizer, prompt: str | Sequence[dict], tools: Sequence[dict] | None = None, *,
                model_name: str = "the model") -> tuple[str, bool]:
    """(the prompt's text in NFC, whether the tokenizer adds its special tokens: for a string, as
    `tokenizer(prompt)` does; chat messages are rendered by the chat template, which writes its own, and
    lists `tools` when given: a template with its own tool format)."""
    if isinstance(prompt, str):
        return unicodedata.normalize("NFC", prompt), True
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{model_name} has no chat template; pass the prompt as a string")
    text = tokenizer.apply_chat_template(list(prompt), tools=list(tools) if tools else None, tokenize=False,
                                         add_generation_prompt=True)
    return unicodedata.normalize("NFC", text), False


def prompt_request(tokenizer, index: ChunkIndex, resolve: Callable[[str], Chunk], prompt: str | Sequence[dict],
                   tools: Sequence[dict] | None = None, *, context_window: int, model_name: str,
                   no_match: Callable[[list[str]], None] | None = None) -> FusionRequest:
    """The prompt tokenized once and the stored chunks `index` finds in it (`resolve`: a chunk id → its `Chunk`),
    placed where the prompt's tokens reproduce theirs; `no_match(changed)` is told when a long prompt matched none."""
    text, add_special_tokens = prompt_text(tokenizer, prompt, tools, model_name=model_name)
    if not tokenizer.is_fast:
        raise ConfigError(f"{model_name}'s tokenizer is not a fast tokenizer: prompts need its character "
                          "offsets to find stored chunks; load the model's tokenizer.json (use_fast=True)")
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]
    if len(ids) > context_window:
        raise PromptTooLongError(f"prompt of {len(ids)} tokens exceeds the model's context window of "
                                 f"{context_window} tokens; shorten it or retrieve fewer chunks")
    normalized, raw_index = normalize_prompt_map(text)
    scan = index.scan(normalized)
    if not scan.matches and len(text) >= CONTEXT_CHARS and len(index) and no_match is not None:
        no_match(scan.changed)
    chunks, rows = [], []
    for m in scan.matches:
        chunk = resolve(m.chunk_id)
        found = align_chunk(ids, offsets, raw_index[m.start], raw_index[m.end - 1] + 1, chunk.token_ids.tolist())
        if found is not None:
            row, start, stop = found
            chunks.append(chunk.part(start, stop))
            rows.append((row, stop - start))
    return FusionRequest(chunks, prompt_layout(ids, rows))

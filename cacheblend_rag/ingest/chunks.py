"""Chunks: normalized text, content-hash ids, and tokenization on their own."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass

import torch

from ..errors import ChunkError

CHUNK_ID_LEN = 32
_CHUNK_ID_RE = re.compile(rf"^[0-9a-f]{{{CHUNK_ID_LEN}}}$")


def normalize_text(text: str) -> str:
    """NFC, unix newlines, no trailing spaces on lines, stripped ends: equal text → equal id."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return text.strip()


def chunk_id(text: str) -> str:
    """Content hash of the normalized text (32 hex chars); the id a chunk has everywhere."""
    return hashlib.sha256(normalize_text(text).encode("utf-8")).hexdigest()[:CHUNK_ID_LEN]


def looks_like_chunk_id(value: str) -> bool:
    """Whether a string has the shape of a chunk id (it may still be unknown)."""
    return bool(_CHUNK_ID_RE.match(value))


@dataclass(frozen=True)
class Chunk:
    """A chunk of text with its id and its own token ids (no special tokens added).

    A *part* (`chunk.part(start, stop)`) is the run of the chunk's tokens that a prompt's own tokenization
    reproduces, where a boundary token merged with the text around it: `token_ids` are that run, `kv_start`
    where it starts in the stored KV, and `whole` the chunk it came from (what is computed and stored).
    """

    chunk_id: str
    text: str
    token_ids: torch.Tensor  # (num_tokens,) int64
    kv_start: int = 0
    source: "Chunk | None" = None  # the whole chunk, for a part

    @property
    def num_tokens(self) -> int:
        """Number of tokens."""
        return int(self.token_ids.shape[0])

    @property
    def whole(self) -> "Chunk":
        """The whole chunk (itself, unless this is a part)."""
        return self.source if self.source is not None else self

    @property
    def is_part(self) -> bool:
        """Whether this is a strict part of the chunk's tokens."""
        return self.source is not None

    def part(self, start: int, stop: int) -> "Chunk":
        """Tokens [start, stop) of this (whole) chunk; itself when that is all of them."""
        whole = self.whole
        if not 0 <= start < stop <= whole.num_tokens:
            raise ValueError(f"part {start}:{stop} is not inside chunk {whole.chunk_id} of {whole.num_tokens} tokens")
        if (start, stop) == (0, whole.num_tokens):
            return whole
        return Chunk(whole.chunk_id, whole.text, whole.token_ids[start:stop], start, whole)


def make_chunk(text: str, tokenizer) -> Chunk:
    """Normalize, hash and tokenize one chunk; an empty chunk is an error."""
    if not isinstance(text, str):
        raise ChunkError(f"a chunk must be a str, got {type(text).__name__}")
    norm = normalize_text(text)
    if not norm:
        raise ChunkError("empty chunk: a chunk needs at least one non-whitespace character")
    try:
        norm.encode("utf-8")  # a lone surrogate would fail in the hash or the tokenizer with a TypeError
    except UnicodeEncodeError as e:
        raise ChunkError(f"a chunk is not valid text ({e.reason} at position {e.start}); pass UTF-8 text") from None
    ids = tokenizer(norm, add_special_tokens=False)["input_ids"]
    if not ids:  # e.g. "\x16": characters the tokenizer drops leave nothing to compute KV for
        raise ChunkError(f"a chunk of {len(norm)} character(s) the tokenizer drops (control characters?) has no "
                         "tokens; give it some text")
    return Chunk(chunk_id=chunk_id(norm), text=norm, token_ids=torch.tensor(ids, dtype=torch.long))

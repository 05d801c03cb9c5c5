"""The chunks an engine has seen recently: id → text and tokens, least recently used first, bounded.

Each entry belongs to the cache salt of the request (or ingest) that brought it: "" for the shared corpus (the
operator's ingest, unsalted requests), a salt for a client's own documents. A chunk id is found only under its
salt, so a client cannot use an id to learn whether another client sent that document.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from ..errors import ConfigError
from .chunks import Chunk

SHARED = ""  # the salt of the shared corpus


class ChunkRegistry:
    """Up to `max_chunks` chunks by (salt, id); an evicted id is found again through its stored KV."""

    def __init__(self, max_chunks: int = 8192) -> None:
        if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
            raise ConfigError(f"max_known_chunks must be an integer ≥ 1, got {max_chunks!r}")
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[tuple[str, str], Chunk] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, chunk: Chunk, salt: str | None = None) -> Chunk:
        """Remember a chunk under `salt` (None or "": shared), now the most recently used; returns it."""
        key = (salt or SHARED, chunk.chunk_id)
        with self._lock:
            self._chunks[key] = chunk
            self._chunks.move_to_end(key)
            while len(self._chunks) > self.max_chunks:
                self._chunks.popitem(last=False)
        return chunk

    def remove(self, chunk_ids: Iterable[str]) -> None:
        """Forget these chunks, under every salt."""
        drop = set(chunk_ids)
        with self._lock:
            for key in [k for k in self._chunks if k[1] in drop]:
                del self._chunks[key]

    def get(self, chunk_id: str, salt: str | None = None) -> Chunk | None:
        """The chunk if remembered under `salt` (None or "": shared), else None."""
        with self._lock:
            return self._chunks.get((salt or SHARED, chunk_id))

    def __contains__(self, chunk_id: object) -> bool:
        """Whether the id is in the shared corpus."""
        with self._lock:
            return (SHARED, chunk_id) in self._chunks

    def __iter__(self) -> Iterator[str]:
        """Chunk ids of the shared corpus, least recently used first."""
        with self._lock:
            return iter([cid for salt, cid in self._chunks if salt == SHARED])

    def __len__(self) -> int:
        with self._lock:
            return len(self._chunks)

"""The chunks an engine has seen recently: id → text and tokens, least recently used first, bounded."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator

from ..errors import ConfigError
from .chunks import Chunk


class ChunkRegistry:
    """Up to `max_chunks` chunks by id; an evicted id is found again through its stored KV."""

    def __init__(self, max_chunks: int = 8192) -> None:
        if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
            raise ConfigError(f"max_known_chunks must be an integer ≥ 1, got {max_chunks!r}")
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[str, Chunk] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, chunk: Chunk) -> Chunk:
        """Remember a chunk (now the most recently used); returns it."""
        with self._lock:
            self._chunks[chunk.chunk_id] = chunk
            self._chunks.move_to_end(chunk.chunk_id)
            while len(self._chunks) > self.max_chunks:
                self._chunks.popitem(last=False)
        return chunk

    def remove(self, chunk_ids: list[str]) -> None:
        """Forget these chunks."""
        with self._lock:
            for cid in chunk_ids:
                self._chunks.pop(cid, None)

    def get(self, chunk_id: str) -> Chunk | None:
        """The chunk if remembered, else None."""
        with self._lock:
            return self._chunks.get(chunk_id)

    def __contains__(self, chunk_id: object) -> bool:
        with self._lock:
            return chunk_id in self._chunks

    def __iter__(self) -> Iterator[str]:
        """Chunk ids, least recently used first."""
        with self._lock:
            return iter(list(self._chunks))

    def __len__(self) -> int:
        with self._lock:
            return len(self._chunks)

"""Two-tier KV store: an in-memory LRU in front of a disk store."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from ..errors import KVWriteError
from .base import ChunkKV, KVKey, LayerReader
from .disk import DiskReader, DiskStore
from .memory import MemoryStore

logger = logging.getLogger(__name__)


class PromotingReader:
    """A disk reader that, when its request ends, moves the whole entry into the memory tier (LRU)."""

    def __init__(self, reader: DiskReader, memory: MemoryStore) -> None:
        self._reader = reader
        self._memory = memory
        self.key, self.tier, self.token_ids = reader.key, reader.tier, reader.token_ids
        self.num_layers, self.layer_nbytes = reader.num_layers, reader.layer_nbytes

    @property
    def num_tokens(self) -> int:
        """Number of tokens."""
        return self._reader.num_tokens

    @property
    def bytes_read(self) -> int:
        """Stored bytes read by the request (promotion reads are not counted)."""
        return self._reader.bytes_read

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer from disk."""
        return self._reader.layer(layer)

    def close(self) -> None:
        """Promote the entry (reading the layers the request skipped), then release the file."""
        read = self._reader.bytes_read
        kv = self._reader.complete()
        self._reader.bytes_read = read
        self._reader.close()
        if kv is not None:
            self._memory.put(self._reader.key, kv)


class TieredStore:
    """Memory then disk; write-through puts, disk hits promoted, memory evictions spilled."""

    def __init__(self, memory: MemoryStore, disk: DiskStore) -> None:
        self.memory = memory
        self.disk = disk
        # Write-through means the disk usually has evicted entries already; the spill covers
        # the cases where it does not (disk write failed, or disk evicted it first).
        memory.on_evict = self._spill
        self._lock = threading.Lock()
        self._hits = self._misses = 0

    def get(self, key: KVKey) -> ChunkKV | None:
        """From memory, else from disk (then kept in memory), else None."""
        kv = self.memory.get(key)
        if kv is None:
            kv = self.disk.get(key)
            if kv is not None:
                self.memory.put(key, kv)
        self._count(kv is not None)
        return kv

    def reader(self, key: KVKey) -> LayerReader | None:
        """From memory, else a disk reader that promotes the entry when the request ends, else None."""
        reader: LayerReader | None = self.memory.reader(key)
        if reader is None:
            disk = self.disk.reader(key)
            reader = PromotingReader(disk, self.memory) if disk is not None else None
        self._count(reader is not None)
        return reader

    def token_ids(self, key: KVKey) -> torch.Tensor | None:
        """From whichever tier holds the entry."""
        ids = self.memory.token_ids(key)
        return ids if ids is not None else self.disk.token_ids(key)

    def put(self, key: KVKey, kv: ChunkKV) -> None:
        """Write to memory and disk; a failed disk write raises KVWriteError (the memory copy stands)."""
        self.memory.put(key, kv)
        self.disk.put(key, kv)

    def contains(self, key: KVKey) -> bool:
        """Whether either tier has the key (the disk's entry validated)."""
        return self.memory.contains(key) or self.disk.contains(key)

    def delete(self, key: KVKey) -> bool:
        """Remove from both tiers; True if either had it."""
        in_memory = self.memory.delete(key)
        on_disk = self.disk.delete(key)
        return in_memory or on_disk

    def tiers(self) -> dict[str, Path | None]:
        """Memory, then disk."""
        return {**self.memory.tiers(), **self.disk.tiers()}

    def stats(self) -> dict:
        """Overall hits/misses plus each tier's stats."""
        with self._lock:
            hits, misses = self._hits, self._misses
        return {
            "tier": "tiered",
            "hits": hits,
            "misses": misses,
            "memory": self.memory.stats(),
            "disk": self.disk.stats(),
        }

    def _count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self._hits += 1
            else:
                self._misses += 1

    def _spill(self, key: KVKey, kv: ChunkKV) -> None:
        if not self.disk.contains(key):
            logger.debug("spilling %s from memory to disk", key)
            try:
                self.disk.put(key, kv)
            except KVWriteError as e:
                logger.warning("could not spill %s to disk: %s", key, e)

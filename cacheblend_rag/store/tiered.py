"""Two-tier KV store: an in-memory LRU in front of a disk store."""

from __future__ import annotations

import logging
import threading

from .base import ChunkKV, KVKey
from .disk import DiskStore
from .memory import MemoryStore

logger = logging.getLogger(__name__)


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
        with self._lock:
            if kv is None:
                self._misses += 1
            else:
                self._hits += 1
        return kv

    def put(self, key: KVKey, kv: ChunkKV) -> None:
        """Write to disk and memory; a failed disk write only logs (the memory copy stands)."""
        try:
            self.disk.put(key, kv)
        except OSError as e:
            logger.warning("disk write of %s failed: %s", key, e)
        self.memory.put(key, kv)

    def contains(self, key: KVKey) -> bool:
        """Whether either tier has the key."""
        return self.memory.contains(key) or self.disk.contains(key)

    def delete(self, key: KVKey) -> bool:
        """Remove from both tiers; True if either had it."""
        in_memory = self.memory.delete(key)
        on_disk = self.disk.delete(key)
        return in_memory or on_disk

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

    def _spill(self, key: KVKey, kv: ChunkKV) -> None:
        if not self.disk.contains(key):
            logger.debug("spilling %s from memory to disk", key)
            self.disk.put(key, kv)

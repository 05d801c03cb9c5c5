"""In-process LRU KV store with a byte budget."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import torch

from ..errors import ConfigError
from .base import ChunkKV, KVKey, ResidentReader

logger = logging.getLogger(__name__)

EvictCallback = Callable[[KVKey, ChunkKV], None]


class MemoryStore:
    """LRU store of ChunkKV objects kept as-is (same device and dtype as put), bounded by bytes."""

    def __init__(self, max_bytes: int | None = None, on_evict: EvictCallback | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ConfigError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self._entries: OrderedDict[KVKey, ChunkKV] = OrderedDict()
        self._bytes = 0
        self._lock = threading.RLock()
        self._hits = self._misses = self._puts = self._evictions = 0

    def get(self, key: KVKey) -> ChunkKV | None:
        """The entry (now the most recently used), or None."""
        with self._lock:
            kv = self._entries.get(key)
            if kv is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return kv

    def reader(self, key: KVKey) -> ResidentReader | None:
        """A reader over the held entry, or None."""
        kv = self.get(key)
        return ResidentReader(kv, key, "memory") if kv is not None else None

    def token_ids(self, key: KVKey) -> torch.Tensor | None:
        """The held entry's token ids (recency unchanged), or None."""
        with self._lock:
            kv = self._entries.get(key)
        return kv.token_ids if kv is not None else None

    def tiers(self) -> dict[str, Path | None]:
        """One tier, in process memory."""
        return {"memory": None}

    def entry_nbytes(self, key: KVKey) -> int | None:
        """Bytes of the held tensors, or None."""
        with self._lock:
            kv = self._entries.get(key)
        return kv.nbytes if kv is not None else None

    def put(self, key: KVKey, kv: ChunkKV) -> None:
        """Store or replace an entry, evicting least-recently-used ones to stay in budget."""
        size = kv.nbytes
        evicted: list[tuple[KVKey, ChunkKV]] = []
        with self._lock:
            self._puts += 1
            self._remove(key)  # a put replaces: never leave a stale older version behind
            if self.max_bytes is not None and size > self.max_bytes:
                logger.debug("not caching %s in memory: %d bytes > budget %d", key, size, self.max_bytes)
                return
            self._entries[key] = kv
            self._bytes += size
            while self.max_bytes is not None and self._bytes > self.max_bytes:
                old_key, old_kv = self._entries.popitem(last=False)
                self._bytes -= old_kv.nbytes
                self._evictions += 1
                evicted.append((old_key, old_kv))
        # Callbacks run outside the lock: spilling to disk is slow and must not block readers.
        for old_key, old_kv in evicted:
            self._notify_evict(old_key, old_kv)

    def contains(self, key: KVKey) -> bool:
        """Whether the key is held (does not change recency)."""
        with self._lock:
            return key in self._entries

    def delete(self, key: KVKey) -> bool:
        """Remove an entry; True if one was removed."""
        with self._lock:
            return self._remove(key)

    def clear(self) -> None:
        """Drop every entry (without calling on_evict)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> dict:
        """Counters and occupancy of this tier."""
        with self._lock:
            return {
                "tier": "memory",
                "hits": self._hits,
                "misses": self._misses,
                "puts": self._puts,
                "evictions": self._evictions,
                "bytes": self._bytes,
                "entries": len(self._entries),
                "max_bytes": self.max_bytes,
            }

    def _remove(self, key: KVKey) -> bool:
        kv = self._entries.pop(key, None)
        if kv is None:
            return False
        self._bytes -= kv.nbytes
        return True

    def _notify_evict(self, key: KVKey, kv: ChunkKV) -> None:
        if self.on_evict is None:
            return
        try:
            self.on_evict(key, kv)
        except Exception:  # an eviction hook must never break a put
            logger.warning("on_evict failed for %s", key, exc_info=True)

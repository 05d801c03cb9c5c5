"""A chain of KV stores, fastest first (memory → disk → Redis, any subset): reads from the first tier that has
the entry, writes through to all, promotes hits into the faster tiers, spills memory evictions to the next."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from ..errors import ConfigError, KVWriteError
from .base import ChunkKV, KVKey, KVStore, LayerReader, WrappedReader

logger = logging.getLogger(__name__)


def _name(store: KVStore) -> str:
    """A tier's name ("memory", "disk", "redis", ...): the first of its own tiers()."""
    return next(iter(store.tiers()), type(store).__name__)


def _promote(faster: tuple[KVStore, ...], key: KVKey, kv: ChunkKV) -> None:
    """Copy an entry into the faster tiers, best effort (a failed write is logged, never raised)."""
    for store in faster:
        try:
            store.put(key, kv)
        except (KVWriteError, OSError) as e:
            logger.debug("could not promote %s into the %s tier: %s", key, _name(store), e)


class PromotingReader(WrappedReader):
    """A slower tier's reader that, when its request ends, copies the whole entry into the faster tiers (bytes
    read are the request's: promotion reads are not counted)."""

    def __init__(self, reader: LayerReader, faster: tuple[KVStore, ...]) -> None:
        super().__init__(reader)
        self._faster = faster

    def close(self) -> None:
        """Promote the entry (reading the layers the request skipped), then release the reader."""
        read = self._reader.bytes_read
        kv = self._reader.complete()
        self._reader.bytes_read = read
        self._reader.close()
        if kv is not None and self.key is not None:
            _promote(self._faster, self.key, kv)


class TieredStore(KVStore):
    """Tiers fastest first; write-through puts, hits promoted into the faster tiers, memory evictions spilled.

    `TieredStore(memory, disk)` is the classic pair; `TieredStore(memory, disk, redis)` adds a shared tier.
    """

    def __init__(self, *tiers: KVStore) -> None:
        if not tiers:
            raise ConfigError("TieredStore needs at least one tier, fastest first "
                              "(e.g. MemoryStore(), DiskStore(path))")
        self.stores: tuple[KVStore, ...] = tuple(tiers)
        self.names = [_name(s) for s in tiers]
        # Write-through means the next tier usually has evicted entries already; the spill covers the cases
        # where it does not (its write failed, or it evicted the entry first).
        for i, store in enumerate(tiers[:-1]):
            store.set_evict_hook(self._spiller(tiers[i + 1:]))
        self._lock = threading.Lock()
        self._hits = self._misses = 0

    @property
    def memory(self):
        """The memory tier (the first one named "memory"), or None."""
        return self._tier("memory")

    @property
    def disk(self):
        """The disk tier (the first one named "disk"), or None."""
        return self._tier("disk")

    @property
    def redis(self):
        """The Redis tier, or None."""
        return self._tier("redis")

    def get(self, key: KVKey) -> ChunkKV | None:
        """From the first tier that has it (then copied into the faster ones), else None."""
        for i, store in enumerate(self.stores):
            kv = store.get(key)
            if kv is not None:
                _promote(self.stores[:i], key, kv)
                self._count(True)
                return kv
        self._count(False)
        return None

    def reader(self, key: KVKey) -> LayerReader | None:
        """A reader from the first tier that has the entry (promoting it when the request ends), else None."""
        for i, store in enumerate(self.stores):
            reader = store.reader(key)
            if reader is not None:
                self._count(True)
                return PromotingReader(reader, self.stores[:i]) if i else reader
        self._count(False)
        return None

    def token_ids(self, key: KVKey) -> torch.Tensor | None:
        """From the first tier that holds the entry."""
        for store in self.stores:
            ids = store.token_ids(key)
            if ids is not None:
                return ids
        return None

    def put(self, key: KVKey, kv: ChunkKV) -> None:
        """Write to every tier; KVWriteError only if no tier but memory kept it (when there is one)."""
        failures: list[str] = []
        kept_durably = False
        durable = [n != "memory" for n in self.names]
        for store, name, is_durable in zip(self.stores, self.names, durable):
            try:
                store.put(key, kv)
            except (KVWriteError, OSError) as e:
                failures.append(f"{name}: {e}")
                continue
            kept_durably |= is_durable
        if any(durable) and not kept_durably:
            raise KVWriteError(f"no tier beyond memory could keep the KV of {key} ({'; '.join(failures)})")
        if failures:
            logger.debug("KV of %s not written to every tier: %s", key, "; ".join(failures))

    def contains(self, key: KVKey) -> bool:
        """Whether any tier has the key (validated the way that tier validates)."""
        return any(store.contains(key) for store in self.stores)

    def delete(self, key: KVKey) -> bool:
        """Remove from every tier; True if any had it."""
        removed = [store.delete(key) for store in self.stores]
        return any(removed)

    def tiers(self) -> dict[str, Path | None]:
        """Every tier, fastest first."""
        merged: dict[str, Path | None] = {}
        for store in self.stores:
            merged.update(store.tiers())
        return merged

    def side_car_dir(self) -> Path | None:
        """The first tier's folder that has one (the disk tier's, in the usual memory → disk → Redis chain)."""
        for store in self.stores:
            folder = store.side_car_dir()
            if folder is not None:
                return folder
        return None

    def entry_nbytes(self, key: KVKey) -> int | None:
        """As the slowest (most durable) tier stores it; None if that tier does not hold it (a copy kept only in
        a faster tier is not stored)."""
        return self.stores[-1].entry_nbytes(key)

    def stats(self) -> dict:
        """Overall hits/misses plus each tier's stats under its name."""
        with self._lock:
            hits, misses = self._hits, self._misses
        out: dict = {"tier": "tiered", "hits": hits, "misses": misses, "tiers": list(self.names)}
        for name, store in zip(self.names, self.stores):
            out.setdefault(name, store.stats())
        return out

    def _tier(self, name: str):
        for n, store in zip(self.names, self.stores):
            if n == name:
                return store
        return None

    def _count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self._hits += 1
            else:
                self._misses += 1

    @staticmethod
    def _spiller(slower: tuple[KVStore, ...]):
        def spill(key: KVKey, kv: ChunkKV) -> None:
            for store in slower:
                if store.contains(key):
                    return
                try:
                    store.put(key, kv)
                    logger.debug("spilled %s into the %s tier", key, _name(store))
                    return
                except (KVWriteError, OSError) as e:
                    logger.debug("could not spill %s into the %s tier: %s", key, _name(store), e)
        return spill

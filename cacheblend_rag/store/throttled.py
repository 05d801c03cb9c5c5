"""A simulated slow (remote) tier: any store whose reads are paced to a bandwidth, plus a fixed latency per fetch.

`ThrottledStore(DiskStore(root, codec="cachegen"), bytes_per_s=125e6)` behaves like a 1 Gbit/s remote store of
cachegen entries: after each fetch's latency, a reader sleeps until the stored bytes it has returned could have
crossed the link, which every reader of the store shares (transfers queue on one `Link`), so per-layer loading
streams like a network transfer and the fused loop can overlap it with compute. It is a benchmark and test tool
for "where does each codec, and where does recompute, win" (`cacheblend-rag codec-bench --bandwidth`, docs/deploy.md "Codecs"); the bytes paced are
the inner store's stored bytes, i.e. compressed bytes for a coded store.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from ..errors import ConfigError
from .base import ChunkKV, KVKey, KVStore, LayerReader, WrappedReader

GBIT = 1e9 / 8  # bytes per second of 1 Gbit/s
MBIT = 1e6 / 8


class Link:
    """One link shared by every fetch of a store: bytes cross it one transfer after another, so two readers open at
    once share its bandwidth instead of each getting all of it."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self._free_at = 0.0  # when the link finishes what it was asked to carry so far
        self._lock = threading.Lock()

    def carry(self, num_bytes: int) -> None:
        """Sleep until `num_bytes` more have crossed, queued behind every transfer asked for earlier."""
        if num_bytes <= 0:
            return
        with self._lock:
            self._free_at = max(self._free_at, time.perf_counter()) + num_bytes / self.bytes_per_s
            due = self._free_at
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


class ThrottledReader(WrappedReader):
    """A reader whose layers arrive no faster than the link allows (bytes counted from the inner reader: what
    crossed the simulated link)."""

    def __init__(self, reader: LayerReader, link: Link, tier: str) -> None:
        super().__init__(reader, tier)
        self._link = link
        self._carried = 0  # stored bytes already paced over the link

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer, returned once its stored bytes could have arrived."""
        out = self._reader.layer(layer)
        self._carry()
        return out

    def _carry(self) -> None:
        read = self._reader.bytes_read
        self._link.carry(read - self._carried)
        self._carried = read

    def complete(self) -> ChunkKV | None:
        """The whole entry (for promotion into faster tiers), paced like the layers."""
        kv = self._reader.complete()
        self._carry()
        return kv


class ThrottledStore(KVStore):
    """Wraps a store: reads are paced to `bytes_per_s` after `latency_s` per fetch; writes are not slowed.

    It reports itself as the tier `name` ("remote" by default), so a TieredStore and the request stats name it.
    """

    def __init__(self, inner: KVStore, bytes_per_s: float, *, latency_s: float = 0.0, name: str = "remote") -> None:
        if not isinstance(bytes_per_s, (int, float)) or not bytes_per_s > 0:
            raise ConfigError(f"bytes_per_s must be a positive number (e.g. {GBIT:.0f} for 1 Gbit/s), "
                              f"got {bytes_per_s!r}")
        if not isinstance(latency_s, (int, float)) or latency_s < 0:
            raise ConfigError(f"latency_s must be >= 0 seconds, got {latency_s!r}")
        self.inner = inner
        self.bytes_per_s = float(bytes_per_s)
        self.link = Link(self.bytes_per_s)
        self.latency_s = float(latency_s)
        self.name = name

    def _open(self) -> None:
        """A fetch's round-trip latency (slept)."""
        if self.latency_s:
            time.sleep(self.latency_s)

    def get(self, key: KVKey) -> ChunkKV | None:
        """The entry, returned once its stored bytes could have arrived; None on a miss (after the latency)."""
        self._open()
        kv = self.inner.get(key)
        if kv is not None:
            self.link.carry(self.inner.entry_nbytes(key) or kv.nbytes)
        return kv

    def reader(self, key: KVKey) -> ThrottledReader | None:
        """A paced reader over the inner store's reader, or None."""
        self._open()
        reader = self.inner.reader(key)
        return ThrottledReader(reader, self.link, self.name) if reader is not None else None

    def token_ids(self, key: KVKey) -> torch.Tensor | None:
        """The entry's token ids (a small metadata read: latency only)."""
        self._open()
        return self.inner.token_ids(key)

    def put(self, key: KVKey, kv: ChunkKV) -> None:
        """Store in the inner store (writes are not paced: the benchmarks fill the tier before timing reads)."""
        self.inner.put(key, kv)

    def contains(self, key: KVKey) -> bool:
        """Whether the inner store has the key."""
        return self.inner.contains(key)

    def delete(self, key: KVKey) -> bool:
        """Remove from the inner store."""
        return self.inner.delete(key)

    def tiers(self) -> dict[str, Path | None]:
        """One tier, named `name`."""
        return {self.name: None}

    def entry_nbytes(self, key: KVKey) -> int | None:
        """Stored bytes of the entry in the inner store."""
        return self.inner.entry_nbytes(key)

    def stats(self) -> dict:
        """The inner store's stats under this tier's name, with the link's settings."""
        out = dict(self.inner.stats())
        out.update(tier=self.name, bytes_per_s=self.bytes_per_s, latency_s=self.latency_s)
        return out

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

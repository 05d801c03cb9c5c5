"""In-process LRU KV store with a byte budget; entries kept as-is or coded (fp16, int8, cachegen)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from ..errors import ConfigError
from .base import ChunkKV, EvictCallback, KVKey, KVStore, LayerReader, LayerReadError, ResidentReader
from .codecs import CODECS, CodecError, KVCodec, LayerTensors, get_codec, layer_nbytes

logger = logging.getLogger(__name__)


class CodedEntry:
    """One chunk's KV held coded: each layer's codec tensors, plus what decoding needs (dtype, device, shapes)."""

    def __init__(self, kv: ChunkKV, codec: KVCodec) -> None:
        self.codec = codec
        self.token_ids = kv.token_ids
        self.positions_start = kv.positions_start
        self.num_layers = kv.num_layers
        k0, v0 = kv.keys[0], kv.values[0]
        self.dtype, self.device = k0.dtype, k0.device
        self.shape = dict(num_tokens=kv.num_tokens, num_kv_heads=int(k0.shape[1]), head_dim=int(k0.shape[2]),
                          v_head_dim=int(v0.shape[2]), num_layers=kv.num_layers)
        self.layers: list[LayerTensors] = [codec.encode_layer(k, v, i, kv.num_layers)
                                           for i, (k, v) in enumerate(zip(kv.keys, kv.values))]
        self.layer_nbytes = [layer_nbytes(t) for t in self.layers]
        self.nbytes = sum(self.layer_nbytes) + self.token_ids.numel() * self.token_ids.element_size()

    @property
    def num_tokens(self) -> int:
        """Number of tokens."""
        return int(self.token_ids.shape[0])

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer decoded to the dtype and device it was put in (CodecError if the payload is bad)."""
        k, v = self.codec.decode_layer(self.layers[layer], layer=layer, dtype=self.dtype, **self.shape)
        return k.to(self.device), v.to(self.device)

    def decode(self) -> ChunkKV:
        """The whole chunk decoded."""
        layers = [self.layer(i) for i in range(self.num_layers)]
        return ChunkKV(keys=tuple(k for k, _ in layers), values=tuple(v for _, v in layers),
                       token_ids=self.token_ids, positions_start=self.positions_start)


class CodedReader(LayerReader):
    """A LayerReader decoding one layer of a CodedEntry at a time (bytes_read counts coded bytes)."""

    def __init__(self, entry: CodedEntry, key: KVKey | None, tier: str = "memory") -> None:
        self.entry = entry
        self.key = key
        self.tier = tier
        self.token_ids = entry.token_ids
        self.num_layers = entry.num_layers
        self.layer_nbytes = max(entry.layer_nbytes)
        self.codec = entry.codec.name
        self.bytes_read = 0

    @property
    def num_tokens(self) -> int:
        """Number of tokens."""
        return self.entry.num_tokens

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer, decoded; LayerReadError if its payload does not decode."""
        try:
            out = self.entry.layer(layer)
        except CodecError as e:
            raise LayerReadError(self.key, layer, str(e)) from e
        self.bytes_read += self.entry.layer_nbytes[layer]
        return out

    def complete(self) -> ChunkKV:
        """The whole entry decoded (for promotion into faster tiers)."""
        return self.entry.decode()

    def close(self) -> None:
        """Nothing to release."""


def _memory_codec(codec: str | KVCodec | None) -> KVCodec | None:
    """None (keep entries as put) or a codec built from its name."""
    if codec is None or isinstance(codec, KVCodec):
        return codec
    if isinstance(codec, str) and codec in CODECS:
        return get_codec(codec)
    raise ConfigError(f"unknown memory-tier codec {codec!r}; choose one of {sorted(CODECS)} (or None to keep "
                      "the KV as put)")


class MemoryStore(KVStore):
    """LRU store of chunk KV bounded by bytes: kept as put (same device and dtype) when `codec` is None, else
    coded with `codec` ("fp16", "int8", "cachegen" or a KVCodec) and decoded per layer on read. The budget
    counts held bytes, so a denser codec holds more chunks."""

    def __init__(self, max_bytes: int | None = None, on_evict: EvictCallback | None = None,
                 codec: str | KVCodec | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ConfigError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self.codec = _memory_codec(codec)
        self._entries: OrderedDict[KVKey, ChunkKV | CodedEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.RLock()
        self._hits = self._misses = self._puts = self._evictions = 0

    def get(self, key: KVKey) -> ChunkKV | None:
        """The entry (now the most recently used), or None."""
        kv = self._lookup(key)
        if isinstance(kv, CodedEntry):
            try:
                return kv.decode()
            except CodecError as e:
                logger.warning("dropping the memory entry %s: %s", key, e)
                self.delete(key)
                return None
        return kv

    def reader(self, key: KVKey) -> ResidentReader | CodedReader | None:
        """A reader over the held entry (decoding per layer when coded), or None."""
        kv = self._lookup(key)
        if kv is None:
            return None
        return CodedReader(kv, key, "memory") if isinstance(kv, CodedEntry) else ResidentReader(kv, key, "memory")

    def _lookup(self, key: KVKey) -> ChunkKV | CodedEntry | None:
        """The held entry, now the most recently used (a hit), or None (a miss)."""
        with self._lock:
            kv = self._entries.get(key)
            if kv is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
        return kv

    def token_ids(self, key: KVKey) -> torch.Tensor | None:
        """The held entry's token ids (recency unchanged), or None."""
        with self._lock:
            kv = self._entries.get(key)
        return kv.token_ids if kv is not None else None

    def tiers(self) -> dict[str, Path | None]:
        """One tier, in process memory."""
        return {"memory": None}

    def set_evict_hook(self, hook: EvictCallback | None) -> None:
        """Call `hook(key, kv)` with each entry the LRU budget evicts (decoded, if held coded)."""
        self.on_evict = hook

    def entry_nbytes(self, key: KVKey) -> int | None:
        """Bytes of the held tensors, or None."""
        with self._lock:
            kv = self._entries.get(key)
        return kv.nbytes if kv is not None else None

    def put(self, key: KVKey, kv: ChunkKV) -> None:
        """Store or replace an entry (coded first when the tier has a codec), evicting least-recently-used ones to
        stay in budget."""
        held: ChunkKV | CodedEntry = CodedEntry(kv, self.codec) if self.codec is not None else kv
        size = held.nbytes
        evicted: list[tuple[KVKey, ChunkKV | CodedEntry]] = []
        with self._lock:
            self._puts += 1
            self._remove(key)  # a put replaces: never leave a stale older version behind
            if self.max_bytes is not None and size > self.max_bytes:
                logger.debug("not caching %s in memory: %d bytes > budget %d", key, size, self.max_bytes)
                return
            self._entries[key] = held
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

    def keys(self) -> list[KVKey]:
        """The held keys, least recently used first."""
        with self._lock:
            return list(self._entries)

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
                "codec": self.codec.name if self.codec is not None else None,
            }

    def _remove(self, key: KVKey) -> bool:
        kv = self._entries.pop(key, None)
        if kv is None:
            return False
        self._bytes -= kv.nbytes
        return True

    def _notify_evict(self, key: KVKey, kv: ChunkKV | CodedEntry) -> None:
        if self.on_evict is None:
            return
        try:
            self.on_evict(key, kv.decode() if isinstance(kv, CodedEntry) else kv)
        except Exception:  # an eviction hook must never break a put
            logger.warning("on_evict failed for %s", key, exc_info=True)

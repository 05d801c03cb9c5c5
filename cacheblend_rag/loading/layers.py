"""Readers that give one layer of a chunk's cached KV at a time, wherever it lives."""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable

import torch

from ..errors import CacheFormatError
from ..store import ChunkKV, DiskStore, KVKey


class LayerReadError(CacheFormatError):
    """A stored layer could not be read (truncated or corrupt file) in the middle of a request."""

    def __init__(self, key: KVKey, layer: int) -> None:
        super().__init__(f"layer {layer} of {key} could not be read; the chunk will be recomputed")
        self.key = key
        self.layer = layer


@runtime_checkable
class LayerReader(Protocol):
    """One chunk's cached KV, readable layer by layer (ChunkKV is one, resident in memory)."""

    token_ids: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """Number of tokens."""

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys before RoPE, values) of one layer, (num_tokens, kv_heads, d) each."""


class DiskLayers:
    """A chunk's KV on disk, read one layer at a time; once every layer was read it can be promoted."""

    tier = "disk"

    def __init__(self, disk: DiskStore, key: KVKey, token_ids: torch.Tensor, num_layers: int, positions_start: int,
                 layer_nbytes: int = 0) -> None:
        self.disk = disk
        self.layer_nbytes = layer_nbytes  # bytes of one layer's K and V as stored
        self.key = key
        self.token_ids = token_ids
        self.num_layers = num_layers
        self.positions_start = positions_start
        self._read: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    @classmethod
    def open(cls, disk: DiskStore, key: KVKey) -> "DiskLayers | None":
        """A reader for a stored entry (header and token ids validated now), or None on a miss."""
        meta = disk.read_meta(key)
        token_ids = disk.get_token_ids(key) if meta is not None else None
        if meta is None or token_ids is None:
            return None
        itemsize = torch.empty(0, dtype=getattr(torch, meta["dtype"])).element_size()
        heads = int(meta["num_kv_heads"])
        nbytes = len(token_ids) * heads * (int(meta["head_dim"]) + int(meta["v_head_dim"])) * itemsize
        return cls(disk, key, token_ids, int(meta["num_layers"]), int(meta["positions_start"]), nbytes)

    @property
    def num_tokens(self) -> int:
        """Number of tokens."""
        return int(self.token_ids.shape[0])

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Read and validate one layer; a bad read raises LayerReadError (the caller recomputes the chunk)."""
        loaded = self.disk.get_layer(self.key, layer)
        if loaded is None:
            raise LayerReadError(self.key, layer)
        with self._lock:
            self._read[layer] = loaded
            self.bytes_read += sum(t.numel() * t.element_size() for t in loaded)
        return loaded

    def complete(self) -> ChunkKV | None:
        """The whole ChunkKV (to promote into memory), reading the layers the request skipped; None if one fails."""
        with self._lock:
            missing = [i for i in range(self.num_layers) if i not in self._read]
        try:
            for i in missing:
                self.layer(i)
        except LayerReadError:
            return None
        with self._lock:
            layers = [self._read[i] for i in range(self.num_layers)]
        return ChunkKV(tuple(k for k, _ in layers), tuple(v for _, v in layers), self.token_ids, self.positions_start)

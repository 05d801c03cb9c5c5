"""What the KV store holds (ChunkKV), how entries are named (KVKey), and the KVStore protocol."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class KVKey:
    """Names one stored chunk KV.

    `namespace` fingerprints everything the KV depends on besides the chunk's
    text: the model weights, the tokenizer and the lead-in tokens the chunk was
    prefilled after. `chunk_id` is the content hash of the chunk's text.
    """

    namespace: str
    chunk_id: str

    def __post_init__(self) -> None:
        for name in ("namespace", "chunk_id"):
            value = getattr(self, name)
            if not value or not all(c.isalnum() or c in "-_" for c in value):
                raise ValueError(f"KVKey.{name} must be non-empty [A-Za-z0-9_-], got {value!r}")

    def __str__(self) -> str:
        return f"{self.namespace}/{self.chunk_id}"


@dataclass(frozen=True, eq=False)
class ChunkKV:
    """The cached KV of one chunk: per layer, keys *before* RoPE and values.

    keys[layer], values[layer]: (num_tokens, num_kv_heads, head_dim)
    token_ids: (num_tokens,) int64, the chunk's own token ids
    positions_start: the position of the chunk's first token when it was prefilled
        (the lead-in length); informative only, since keys are stored before RoPE.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    token_ids: torch.Tensor
    positions_start: int = 0
    _nbytes: int = field(default=-1, repr=False)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values) or not self.keys:
            raise ValueError("ChunkKV needs the same non-zero number of key and value layers")
        n = self.token_ids.shape[0]
        shape = self.keys[0].shape
        for k, v in zip(self.keys, self.values):
            if k.shape != shape or v.shape[:2] != shape[:2] or k.shape[0] != n:
                raise ValueError(
                    f"ChunkKV tensors disagree: keys {tuple(k.shape)}, values {tuple(v.shape)}, {n} token ids"
                )

    @property
    def num_layers(self) -> int:
        """Number of transformer layers covered."""
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        """Number of tokens of the chunk."""
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors (keys, values, token ids)."""
        total = self.token_ids.numel() * self.token_ids.element_size()
        for k, v in zip(self.keys, self.values):
            total += k.numel() * k.element_size() + v.numel() * v.element_size()
        return total

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's keys and values."""
        k, v = self.keys[0], self.values[0]
        return k.numel() * k.element_size() + v.numel() * v.element_size()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys before RoPE, values) of one layer."""
        return self.keys[layer], self.values[layer]

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "ChunkKV":
        """A copy on `device` with keys/values cast to `dtype` (token ids stay int64)."""
        return ChunkKV(
            keys=tuple(k.to(device=device, dtype=dtype) for k in self.keys),
            values=tuple(v.to(device=device, dtype=dtype) for v in self.values),
            token_ids=self.token_ids.to(device=device),
            positions_start=self.positions_start,
        )


def token_ids_digest(namespace: str, token_ids: torch.Tensor) -> str:
    """Hash binding a KV to its namespace and exact token ids (stored in file headers)."""
    h = hashlib.sha256(namespace.encode())
    h.update(token_ids.to(torch.int64).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@runtime_checkable
class KVStore(Protocol):
    """A store of ChunkKV by KVKey. Implementations are thread-safe."""

    def get(self, key: KVKey) -> ChunkKV | None:
        """The entry, or None on a miss (a corrupt or foreign entry is a miss too)."""

    def put(self, key: KVKey, kv: ChunkKV) -> None:
        """Store (or replace) an entry."""

    def contains(self, key: KVKey) -> bool:
        """Whether a valid-looking entry exists, without loading it."""

    def delete(self, key: KVKey) -> bool:
        """Remove an entry; True if one was removed."""

    def stats(self) -> dict:
        """Counters: hits, misses, puts, evictions, bytes and entries (per tier for composites)."""

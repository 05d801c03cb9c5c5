"""What the KV store holds (ChunkKV), how entries are named (KVKey), the per-request LayerReader and the KVStore
protocol every tier implements (callers never ask which tier they hold).

Every hook a reader or store may implement is declared here with its default (`LayerReader.complete`,
`KVStore.side_car_dir`, `KVStore.set_evict_hook`); the package's readers and stores subclass these protocols, so
callers call the hooks directly instead of probing for them.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

import torch

from ..errors import CacheFormatError


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


class LayerReadError(CacheFormatError):
    """A stored layer could not be read (truncated or corrupt entry) in the middle of a request."""

    def __init__(self, key: KVKey | None, layer: int, reason: str = "") -> None:
        detail = f" ({reason})" if reason else ""
        super().__init__(f"layer {layer} of {key} could not be read{detail}; the chunk will be recomputed")
        self.key = key
        self.layer = layer


@runtime_checkable
class LayerReader(Protocol):
    """One stored chunk KV, opened (and its header validated) once per request, read one layer at a time.

    `tier` names where the bytes come from ("memory", "disk", ...), `layer_nbytes` is what reading one
    layer costs in stored bytes, `bytes_read` what this reader has read so far.
    """

    key: KVKey | None
    tier: str
    token_ids: torch.Tensor  # (num_tokens,) int64
    num_layers: int
    layer_nbytes: int
    bytes_read: int

    @property
    def num_tokens(self) -> int:
        """Number of tokens."""

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys before RoPE, values) of one layer, (num_tokens, kv_heads, d) each; LayerReadError if unreadable."""

    def close(self) -> None:
        """End of the request: release handles (a tier may promote what was read)."""

    def complete(self) -> ChunkKV | None:
        """The whole entry, to promote into faster tiers (None if a layer fails); by default every layer read."""
        try:
            layers = [self.layer(i) for i in range(self.num_layers)]
        except LayerReadError:
            return None
        return ChunkKV(tuple(k for k, _ in layers), tuple(v for _, v in layers), self.token_ids)


EvictCallback = Callable[[KVKey, ChunkKV], None]

STORED_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16,
                                         "float32": torch.float32}
"""The dtypes an entry's header may name for its KV (disk and Redis), by name: a closed list, never getattr on
stored text."""


LOGGED_CHARS = 200  # longest header value or reason a tier echoes into a log line


def short_repr(value: object) -> str:
    """A value for a log line, cut to a bounded length (headers are untrusted input)."""
    text = repr(value)
    return text if len(text) <= LOGGED_CHARS else f"{text[:LOGGED_CHARS]}... ({len(text)} chars)"


def cast_overflows(src: torch.Tensor, cast: torch.Tensor) -> bool:
    """Whether casting `src` turned finite values into inf (one pass over the cast in the usual no-inf case)."""
    return bool(torch.isinf(cast).any()) and bool((torch.isfinite(src.to(cast.device)) & ~torch.isfinite(cast)).any())


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's name as a header writes it (`torch.float16` -> "float16")."""
    return str(dtype).removeprefix("torch.")


def raw_layer_nbytes(meta: dict) -> int:
    """Stored bytes of one raw layer (keys then values in the header's dtype) of a checked header."""
    itemsize = torch.empty(0, dtype=STORED_DTYPES[meta["dtype"]]).element_size()
    return (int(meta["num_tokens"]) * int(meta["num_kv_heads"]) * (int(meta["head_dim"]) + int(meta["v_head_dim"]))
            * itemsize)


class EntryReader(LayerReader):
    """The skeleton of a stored entry's reader (disk, Redis): opened for one request with its checked header
    `meta` and token ids; a subclass reads each layer into `_read` (under `_lock`) and counts `bytes_read`."""

    def __init__(self, key: KVKey, meta: dict, token_ids: torch.Tensor, layer_nbytes: int) -> None:
        self.key = key
        self._meta = meta
        self.token_ids = token_ids
        self.num_layers = int(meta["num_layers"])
        self.layer_nbytes = layer_nbytes
        self.positions_start = int(meta["positions_start"])
        self.bytes_read = 0
        self._read: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        """Number of tokens."""
        return int(self.token_ids.shape[0])

    def _check_index(self, layer: int, where: str) -> None:
        """IndexError for a layer the entry does not have (a caller's bug, not a bad entry)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers {where}")

    def _whole(self) -> ChunkKV:
        """The entry from its layers, every one of them read."""
        layers = [self._read[i] for i in range(self.num_layers)]
        return ChunkKV(tuple(k for k, _ in layers), tuple(v for _, v in layers), self.token_ids, self.positions_start)


class ResidentReader(LayerReader):
    """A LayerReader over a ChunkKV already in memory."""

    def __init__(self, kv: ChunkKV, key: KVKey | None = None, tier: str = "memory") -> None:
        self.kv = kv
        self.key = key
        self.tier = tier
        self.token_ids = kv.token_ids
        self.num_layers = kv.num_layers
        self.layer_nbytes = kv.layer_nbytes
        self.bytes_read = 0

    @property
    def num_tokens(self) -> int:
        """Number of tokens."""
        return self.kv.num_tokens

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's tensors as held."""
        self.bytes_read += self.layer_nbytes
        return self.kv.layer(layer)

    def close(self) -> None:
        """Nothing to release."""


class WrappedReader(LayerReader):
    """Another reader's entry as a tier's wrapper sees it (pacing, promotion): its key, tokens, layers and bytes
    read; a subclass adds what it does around them."""

    def __init__(self, reader: LayerReader, tier: str | None = None) -> None:
        self._reader = reader
        self.key, self.tier, self.token_ids = reader.key, reader.tier if tier is None else tier, reader.token_ids
        self.num_layers, self.layer_nbytes = reader.num_layers, reader.layer_nbytes

    @property
    def num_tokens(self) -> int:
        """Number of tokens."""
        return self._reader.num_tokens

    @property
    def bytes_read(self) -> int:
        """Stored bytes the inner reader read (a wrapper reads none of its own)."""
        return self._reader.bytes_read

    @bytes_read.setter
    def bytes_read(self, value: int) -> None:
        self._reader.bytes_read = value

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer from the inner reader."""
        return self._reader.layer(layer)

    def close(self) -> None:
        """Release the inner reader."""
        self._reader.close()


class SlicedReader(LayerReader):
    """Rows [start, stop) of another reader: the part of a stored chunk that a prompt's own tokenization
    reproduces (its first or last token may have merged with the text around it)."""

    def __init__(self, reader: LayerReader, start: int, stop: int) -> None:
        if not 0 <= start < stop <= reader.num_tokens:
            raise ValueError(f"rows {start}:{stop} are not inside a reader of {reader.num_tokens} tokens")
        self.reader = reader
        self.start, self.stop = start, stop
        self.key = reader.key
        self.tier = reader.tier
        self.token_ids = reader.token_ids[start:stop]
        self.num_layers = reader.num_layers
        self.layer_nbytes = reader.layer_nbytes  # a layer is read (and decoded) whole, then cut

    @property
    def num_tokens(self) -> int:
        """Number of tokens of the part."""
        return self.stop - self.start

    @property
    def bytes_read(self) -> int:
        """Stored bytes read so far (whole layers)."""
        return self.reader.bytes_read

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The part's rows of one layer."""
        k, v = self.reader.layer(layer)
        return k[self.start:self.stop], v[self.start:self.stop]

    def close(self) -> None:
        """Close the whole reader."""
        self.reader.close()

    def complete(self) -> ChunkKV | None:
        """The whole entry behind the part (promotion stores entries, not parts)."""
        return self.reader.complete()


@runtime_checkable
class KVStore(Protocol):
    """A store of ChunkKV by KVKey. Implementations are thread-safe; a failing or corrupt entry is a miss."""

    def get(self, key: KVKey) -> ChunkKV | None:
        """The entry, or None on a miss (a corrupt or foreign entry is a miss too)."""

    def reader(self, key: KVKey) -> LayerReader | None:
        """A per-layer reader of the entry, validated once now, or None on a miss."""

    def token_ids(self, key: KVKey) -> torch.Tensor | None:
        """The entry's token ids alone (cheap: no layer is read), or None."""

    def put(self, key: KVKey, kv: ChunkKV) -> None:
        """Store (or replace) an entry; raises KVWriteError when it could not be kept anywhere durable."""

    def contains(self, key: KVKey) -> bool:
        """Whether a valid-looking entry exists (header and size checked), without loading it."""

    def delete(self, key: KVKey) -> bool:
        """Remove an entry; True if one was removed."""

    def tiers(self) -> dict[str, Path | None]:
        """The tiers behind this store, fastest first, with their folder where they have one."""

    def side_car_dir(self) -> Path | None:
        """The one folder where files that go with this store live (chunk index, Cache-Craft variants), or None.

        By default None: a store without a folder (memory, Redis) gets private temporary side-car files.
        """
        return None

    def set_evict_hook(self, hook: EvictCallback | None) -> None:
        """Have `hook(key, kv)` called with each entry this store evicts (a tiered store spills it to the next
        tier). By default nothing: a store whose evictions need no spill ignores it."""

    def entry_nbytes(self, key: KVKey) -> int | None:
        """Bytes the entry takes in its most durable tier (as stored: a file's size), or None if not stored."""

    def stats(self) -> dict:
        """Counters: hits, misses, puts, evictions, bytes and entries (per tier for composites)."""

"""The fused token sequence and its cached KV, as the layer loop sees them.

    rows:      0 ........ P ............ P+n1 ........ ... ........ N-1
    segments:  [ prefix ][ chunk 0      ][ chunk 1    ] ... [ suffix ]
    cached:     exact KV  approx KV        approx KV         none (always computed)

Rows are positions: the sequence is laid out contiguously from position 0.
Cached keys are stored *before* RoPE and rotated to their row's position per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..store import ChunkKV


@dataclass(frozen=True)
class Placement:
    """A cached KV placed at rows [row_start, row_start + kv.num_tokens)."""

    row_start: int
    kv: ChunkKV  # on the compute device, in the compute dtype
    exact: bool  # True when the KV was computed after exactly the rows before it (a true prefix cache)


@dataclass
class FusedSequence:
    """Token ids of the whole prompt, which rows are cached, and the cached KV of those rows."""

    token_ids: torch.Tensor  # (N,) int64
    segment_of_row: torch.Tensor  # (N,) int64: chunk index, or -1 for prefix / separators / suffix
    placements: list[Placement]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    _layer_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        n = self.num_rows
        self.cached = torch.zeros(n, dtype=torch.bool, device=self.token_ids.device)
        self.exact = torch.zeros(n, dtype=torch.bool, device=self.token_ids.device)
        for p in self.placements:
            end = p.row_start + p.kv.num_tokens
            if end > n or not torch.equal(p.kv.token_ids.to(self.token_ids.device), self.token_ids[p.row_start:end]):
                raise ValueError(f"cached KV at rows {p.row_start}:{end} does not match the sequence's token ids")
            self.cached[p.row_start:end] = True
            self.exact[p.row_start:end] = p.exact

    @property
    def num_rows(self) -> int:
        """N, the number of tokens (= positions) in the sequence."""
        return int(self.token_ids.shape[0])

    @property
    def reused(self) -> torch.Tensor:
        """(N,) bool: rows whose cached KV is approximate (chunks reused out of their context)."""
        return self.cached & ~self.exact

    def cached_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE keys and values of all rows at `layer`, (N, kv_heads, d) each; zeros where not cached."""
        hit = self._layer_cache.get(layer)
        if hit is not None:
            return hit
        self._layer_cache.clear()  # the loop walks layers in order: keep one
        dtype = self.dtype
        shape = (self.num_rows, self.num_kv_heads, self.head_dim)
        keys = torch.zeros(shape, dtype=dtype, device=self.token_ids.device)
        values = torch.zeros(shape, dtype=dtype, device=self.token_ids.device)
        for p in self.placements:
            end = p.row_start + p.kv.num_tokens
            keys[p.row_start:end] = p.kv.keys[layer]
            values[p.row_start:end] = p.kv.values[layer]
        self._layer_cache[layer] = (keys, values)
        return keys, values

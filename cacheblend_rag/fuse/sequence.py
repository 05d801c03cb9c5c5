"""The fused token sequence and its cached KV, as the layer loop sees them.

    rows:      0 ........ P ............ P+n1 ........ ... ........ N-1
    segments:  [ prefix ][ chunk 0      ][ chunk 1    ] ... [ suffix ]
    cached:     exact KV  approx KV        approx KV         none (always computed)

Rows are positions: the sequence is laid out contiguously from position 0.
Cached keys are stored *before* RoPE and rotated to their row's position per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..loading.prefetch import LayerLoader, Placed
from ..store import LayerReader
from .links import Links


@dataclass(frozen=True)
class Placement:
    """A cached KV placed at rows [row_start, row_start + kv.num_tokens)."""

    row_start: int
    kv: LayerReader  # a reader of the cached KV (resident, on disk, ...), layer by layer
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
    prefetch_depth: int = 0  # layers the loader may run ahead of the loop (0: load on demand)
    links: Links | None = None  # learned links whose placeholder ids some uncached rows carry (fuse/links)

    def __post_init__(self) -> None:
        n = self.num_rows
        device = self.token_ids.device
        self.cached = torch.zeros(n, dtype=torch.bool, device=device)
        self.exact = torch.zeros(n, dtype=torch.bool, device=device)
        for p in self.placements:
            end = p.row_start + p.kv.num_tokens
            if end > n or not torch.equal(p.kv.token_ids.to(device), self.token_ids[p.row_start:end]):
                raise ValueError(f"cached KV at rows {p.row_start}:{end} does not match the sequence's token ids")
            self.cached[p.row_start:end] = True
            self.exact[p.row_start:end] = p.exact
        self.loader = LayerLoader([Placed(p.row_start, p.kv) for p in self.placements], n, self.num_layers,
                                  self.num_kv_heads, self.head_dim, device, self.dtype, self.prefetch_depth)

    @property
    def num_rows(self) -> int:
        """N, the number of tokens (= positions) in the sequence."""
        return int(self.token_ids.shape[0])

    @property
    def reused(self) -> torch.Tensor:
        """(N,) bool: rows whose cached KV is approximate (chunks reused out of their context)."""
        return self.cached & ~self.exact

    def cached_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE keys and values of all rows at `layer`, (N, kv_heads, d) each; zeros where not cached.

        Handed over once per layer: the layer loop asks, shows them to the selection, then reuses the buffers.
        """
        return self.loader.get(layer)

    def twin(self) -> "FusedSequence":
        """The same rows over the same stored KV, with a loader of its own (for a probe pass before the loop)."""
        return FusedSequence(self.token_ids, self.segment_of_row, self.placements, self.num_layers,
                             self.num_kv_heads, self.head_dim, self.dtype, links=self.links)

    def close(self) -> None:
        """Stop any prefetching and free layers loaded but not taken (the readers are closed by their owner)."""
        self.loader.close()

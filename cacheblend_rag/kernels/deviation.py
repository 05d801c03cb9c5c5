"""KV deviation between freshly computed and cached K or V, torch reference op."""

from __future__ import annotations

import torch


def kv_deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Squared L2 distance per row, summed over heads and head dim: (M, heads, d) x2 → (M,) float32."""
    diff = fresh.float() - cached.float()
    return diff.square().sum(dim=(-1, -2))

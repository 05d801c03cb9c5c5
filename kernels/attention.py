"""Causal attention for a subset of query rows over the whole fused KV, torch reference op.

Selected rows (HKVD tokens, holes, suffix) are scattered over the sequence; a
dense (M, N) mask would read every key for every query, about twice what
causality needs. Rows are grouped by key block: a group reads only the keys up
to its last row and masks just the tail.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          is_causal: bool = False) -> torch.Tensor:
    """q (m, H, d), k/v (n, KVH, d) → (m, H, d) through torch's SDPA with GQA."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=None if mask is None else mask[None, None], is_causal=is_causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def causal_attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    block_size: int = 512,
) -> torch.Tensor:
    """Attention of queries at sequence `rows` (ascending) over keys 0..N-1, each seeing keys at rows ≤ its own.

    q: (M, heads, d); k, v: (N, kv_heads, d) already at their positions; rows: (M,) int64.
    With `sliding_window` w, a query at row r sees keys in (r - w, r]. Returns (M, heads, d).
    """
    num_keys = k.shape[0]
    num_rows = q.shape[0]
    windowed = sliding_window is not None and sliding_window < num_keys
    if num_rows == num_keys and not windowed:
        return _sdpa(q, k, v, None, scale, is_causal=True)
    out = torch.empty_like(q)
    block_of_row = torch.div(rows, block_size, rounding_mode="floor")
    _, counts = torch.unique_consecutive(block_of_row, return_counts=True)
    start = 0
    for count in counts.tolist():
        group = rows[start : start + count]
        first, last = int(group[0]), int(group[-1])
        key_lo = max(0, first - sliding_window + 1) if windowed else 0
        key_idx = torch.arange(key_lo, last + 1, device=rows.device)
        mask = None
        if count > 1:  # a lone query sees every key in [key_lo, last]
            mask = key_idx[None, :] <= group[:, None]
            if windowed:
                mask &= key_idx[None, :] > group[:, None] - sliding_window
        out[start : start + count] = _sdpa(q[start : start + count], k[key_lo : last + 1], v[key_lo : last + 1], mask, scale)
        start += count
    return out

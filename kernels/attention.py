"""Causal attention for a subset of query rows over the whole fused KV, on torch's SDPA.

Selected rows (HKVD tokens, separators, the question) sit scattered over the
sequence, and each sees only the keys at or before its own row. What makes
this slow on a CPU is not the arithmetic but the calls: every SDPA call has a
fixed cost (~0.2 ms here), and a boolean mask is converted to an additive one
on every call. So the rows are cut into a few groups of about `group_rows`
consecutive rows; each group reads the keys up to its last row with one
additive mask. The grouping and the masks depend only on the rows, which stay
the same for every layer after CacheBlend's selection: `RowAttentionPlan`
builds them once and the loop reuses the plan layer after layer.

    keys:    0 ................................................ N-1
    group 0: rows r0..r1  reads keys 0..r1     (mask: key > row)
    group 1: rows r2..r3  reads keys 0..r3

A contiguous run of rows a..b with a ≤ b - a (CacheBlend's check layers: every
row after the exact prefix) is causal attention offset by a; SDPA's `is_causal`
is aligned top-left, so the queries are padded with a zero rows in front and
the mask-free causal kernel runs instead of masked groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Rows per SDPA call: fewer calls amortise the fixed cost; more rows per call read more masked keys.
# 256 measured best on the 2-core bf16 CPU for ~500 rows over 3.7k keys (docs/benchmarks.md); fp32 is flat.
GROUP_ROWS = 256


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          is_causal: bool = False) -> torch.Tensor:
    """q (m, H, d), k/v (n, KVH, d) → (m, H, d) through torch's SDPA with GQA."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=None if mask is None else mask[None, None], is_causal=is_causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


@dataclass(frozen=True)
class _Group:
    start: int  # first query index (into rows)
    end: int  # one past the last
    key_lo: int  # keys [key_lo, key_hi) are read
    key_hi: int
    mask: torch.Tensor | None  # (end - start, key_hi - key_lo) additive, or None when nothing is masked


class RowAttentionPlan:
    """The grouping and additive masks for one set of query rows; built once, reused by every layer."""

    def __init__(self, rows: torch.Tensor, num_keys: int, dtype: torch.dtype, sliding_window: int | None = None,
                 group_rows: int = GROUP_ROWS) -> None:
        """rows: (M,) ascending int64 row indices, the last < num_keys; masks are made in `dtype`."""
        windowed = sliding_window is not None and sliding_window < num_keys
        num_rows = rows.numel()
        first, last = (int(rows[0]), int(rows[-1])) if num_rows else (0, -1)
        # A contiguous run a..b (a ≤ its length) is causal after padding a zero queries in front.
        self.causal_pad = first if (not windowed and last - first + 1 == num_rows and first <= num_rows) else None
        self.groups: list[_Group] = []
        if self.causal_pad is not None:
            return
        num_groups = max(1, -(-num_rows // group_rows))
        bounds = [round(i * num_rows / num_groups) for i in range(num_groups + 1)]
        for start, end in zip(bounds, bounds[1:]):
            group = rows[start:end]
            first, last = int(group[0]), int(group[-1])
            key_lo = max(0, first - sliding_window + 1) if windowed else 0
            key_idx = torch.arange(key_lo, last + 1, device=rows.device)
            hidden = key_idx[None, :] > group[:, None]
            if windowed:
                hidden |= key_idx[None, :] <= group[:, None] - sliding_window
            mask = None
            if bool(hidden.any()):
                mask = torch.zeros(hidden.shape, dtype=dtype, device=rows.device).masked_fill_(hidden, float("-inf"))
            self.groups.append(_Group(start, end, key_lo, last + 1, mask))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (M, heads, d) at the plan's rows; k, v (N, kv_heads, d) at their positions → (M, heads, d)."""
        if self.causal_pad is not None:
            pad, num_rows = self.causal_pad, q.shape[0]
            if pad:
                q = torch.cat([q.new_zeros(pad, *q.shape[1:]), q])
            return _sdpa(q, k[:pad + num_rows], v[:pad + num_rows], None, scale, is_causal=True)[pad:]
        if len(self.groups) == 1:
            g = self.groups[0]
            return _sdpa(q, k[g.key_lo:g.key_hi], v[g.key_lo:g.key_hi], g.mask, scale)
        out = torch.empty_like(q)
        for g in self.groups:
            out[g.start:g.end] = _sdpa(q[g.start:g.end], k[g.key_lo:g.key_hi], v[g.key_lo:g.key_hi], g.mask, scale)
        return out


def causal_attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    group_rows: int = GROUP_ROWS,
) -> torch.Tensor:
    """Attention of queries at sequence `rows` (ascending) over keys 0..N-1, each seeing keys at rows ≤ its own.

    q: (M, heads, d); k, v: (N, kv_heads, d) already at their positions; rows: (M,) int64.
    With `sliding_window` w, a query at row r sees keys in (r - w, r]. Returns (M, heads, d).
    A one-off call; the layer loop keeps a `RowAttentionPlan` instead.
    """
    plan = RowAttentionPlan(rows, k.shape[0], q.dtype, sliding_window, group_rows)
    return plan.attend(q, k, v, scale)

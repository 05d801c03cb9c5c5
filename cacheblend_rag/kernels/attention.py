"""Causal attention for a subset of query rows over the whole fused KV, on torch's SDPA.

Selected rows (HKVD tokens, separators, the question) sit scattered over the
sequence, and each sees only the keys at or before its own row. SDPA takes one
mask for all its queries, so the rows are cut into a few groups of consecutive
rows; each group reads the keys up to its last row with one additive mask:

    keys:    0 ................................................ N-1
    group 0: rows r0..r1  reads keys 0..r1     (mask: key > row)
    group 1: rows r2..r3  reads keys 0..r3

Where to cut is a trade: finer groups read fewer masked keys, but every call
pays per key it reads (K/V packing, ~0.1 µs here) whatever its number of rows.
Measured on the 2-core CPU, a call over n keys with m rows costs about
n × (m + c) pair-costs, c ≈ 24 rows in bf16 and ≈ 8 in fp32; `_partition` picks
the cuts that minimise that sum. Selected rows crowd towards the question (the
question's attention weights the selection), so the best cuts are uneven.
The grouping and the masks depend only on the rows, which stay the same for every
layer after CacheBlend's selection: `RowAttentionPlan` builds them once and the
loop reuses the plan layer after layer.

A contiguous run of rows a..b with a ≤ b - a (CacheBlend's check layers: every
row after the exact prefix) is causal attention offset by a; SDPA's `is_causal`
is aligned top-left, so the queries are padded with a zero rows in front and
the mask-free causal kernel runs instead of masked groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# c, a call's per-key cost in query rows (n keys, m rows cost ~ n × (m + c)): fitted to SDPA calls of 16–512 rows
# over 0.5k–3.7k keys on the 2-core AVX512-BF16 CPU; it only steers where the rows are cut.
OVERHEAD_ROWS = {torch.float32: 8.0, torch.float64: 8.0}
DEFAULT_OVERHEAD_ROWS = 24.0  # bf16 / fp16
MAX_CUT_POINTS = 64  # the partition cuts at most at this many evenly spaced places (a cheap, exact-enough DP)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          is_causal: bool = False) -> torch.Tensor:
    """q (m, H, d), k/v (n, KVH, d) → (m, H, d) through torch's SDPA with GQA."""
    if mask is not None and q.is_cuda:
        return _sdpa_masked_cuda(q, k, v, mask, scale)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=None if mask is None else mask[None, None], is_causal=is_causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def _sdpa_masked_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """A masked call on CUDA, on the memory-efficient kernel, the G query heads of each KV head folded into rows.

    Masked GQA is not the efficient kernel's (it wants equal head counts) and flash takes no mask, so SDPA would
    pick cuDNN, which builds a plan per new shape (every request's row count is new: 47–64 ms a call on an H200,
    benchmarks/gpu_shapes.py --sdpa), or the math kernel, which materialises the scores. Folding the query groups
    into rows (G·m rows per KV head, the mask repeated G times) reads each K/V head once, with no expanded copy.
    """
    (m, heads, d), kv_heads = q.shape, k.shape[1]
    groups = heads // kv_heads
    folded = q.view(m, kv_heads, groups, d).permute(1, 2, 0, 3).reshape(kv_heads, groups * m, d)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(folded[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             attn_mask=mask.repeat(groups, 1)[None, None], scale=scale)
    return out[0].view(kv_heads, groups, m, -1).permute(2, 0, 1, 3).reshape(m, heads, -1)


@dataclass(frozen=True)
class _Group:
    start: int  # first query index (into rows)
    end: int  # one past the last
    key_lo: int  # keys [key_lo, key_hi) are read
    key_hi: int
    mask: torch.Tensor | None  # (end - start, key_hi - key_lo) additive, or None when nothing is masked


def _partition(rows: list[int], overhead_rows: float, window: int | None) -> list[int]:
    """Group bounds (indices into rows) minimising Σ keys read × (group rows + overhead_rows), by dynamic programming."""
    num_rows = len(rows)
    step = max(1, -(-num_rows // MAX_CUT_POINTS))
    cuts = list(range(0, num_rows, step)) + [num_rows]
    best, prev = [0.0] + [math.inf] * (len(cuts) - 1), [0] * len(cuts)
    for j in range(1, len(cuts)):
        last = rows[cuts[j] - 1]
        for i in range(j):
            key_lo = max(0, rows[cuts[i]] - window + 1) if window else 0
            cost = best[i] + (last + 1 - key_lo) * (cuts[j] - cuts[i] + overhead_rows)
            if cost < best[j]:
                best[j], prev[j] = cost, i
    bounds, j = [num_rows], len(cuts) - 1
    while j:
        j = prev[j]
        bounds.append(cuts[j])
    return bounds[::-1]


class RowAttentionPlan:
    """The grouping and additive masks for one set of query rows; built once, reused by every layer."""

    def __init__(self, rows: torch.Tensor, num_keys: int, dtype: torch.dtype, sliding_window: int | None = None,
                 overhead_rows: float | None = None) -> None:
        """rows: (M,) ascending int64 row indices, the last < num_keys; masks are made in `dtype`."""
        windowed = sliding_window is not None and sliding_window < num_keys
        num_rows = rows.numel()
        first, last = (int(rows[0]), int(rows[-1])) if num_rows else (0, -1)
        # A contiguous run a..b (a ≤ its length) is causal after padding a zero queries in front.
        self.causal_pad = first if (not windowed and last - first + 1 == num_rows and first <= num_rows) else None
        visible = rows + 1 if not windowed else (rows + 1).clamp(max=sliding_window)
        self.num_pairs = int(visible.sum())  # query-key pairs causality lets these rows see (a cost measure)
        self.groups: list[_Group] = []
        if self.causal_pad is not None:
            return
        if overhead_rows is None:
            # a GPU reads masked keys nearly for free next to a kernel launch: one group, one call
            overhead_rows = (math.inf if rows.is_cuda else OVERHEAD_ROWS.get(dtype, DEFAULT_OVERHEAD_ROWS))
        bounds = ([0, num_rows] if math.isinf(overhead_rows)
                  else _partition(rows.tolist(), overhead_rows, sliding_window if windowed else None))
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
    overhead_rows: float | None = None,
) -> torch.Tensor:
    """Attention of queries at sequence `rows` (ascending) over keys 0..N-1, each seeing keys at rows ≤ its own.

    q: (M, heads, d); k, v: (N, kv_heads, d) already at their positions; rows: (M,) int64.
    With `sliding_window` w, a query at row r sees keys in (r - w, r]. `overhead_rows` overrides the measured
    per-key cost of a call (in query rows) that decides the grouping. Returns (M, heads, d).
    A one-off call; the layer loop keeps a `RowAttentionPlan` instead.
    """
    plan = RowAttentionPlan(rows, k.shape[0], q.dtype, sliding_window, overhead_rows)
    return plan.attend(q, k, v, scale)

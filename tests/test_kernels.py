"""Kernel reference ops against plain dense math."""

from __future__ import annotations

import math

import pytest
import torch

from cacheblend_rag.kernels import apply_rope, causal_attention_rows, kv_deviation


def _dense(q, k, v, rows, scale, window=None):
    n = k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q, k) * scale
    keys = torch.arange(n)
    mask = keys[None, :] <= rows[:, None]
    if window is not None:
        mask &= keys[None, :] > rows[:, None] - window
    scores = scores.masked_fill(~mask[None], -math.inf)
    return torch.einsum("hmn,nhd->mhd", scores.softmax(-1), v)


# overhead_rows 0 cuts the rows into as many groups as the partition allows; 1e9 keeps one group.
@pytest.mark.parametrize("n,m,overhead,window", [(1, 1, 24, None), (37, 37, 0, None), (100, 13, 0, None),
                                                 (100, 13, 1e9, None), (300, 50, 8, None), (300, 50, 0, 20),
                                                 (64, 64, 24, 10)])
def test_causal_attention_rows_matches_dense(n, m, overhead, window):
    torch.manual_seed(n + m)
    rows = torch.randperm(n)[:m].sort().values
    rows[-1] = n - 1
    q = torch.randn(m, 4, 8)
    k, v = torch.randn(n, 2, 8), torch.randn(n, 2, 8)
    got = causal_attention_rows(q, k, v, rows, 0.35, sliding_window=window, overhead_rows=overhead)
    torch.testing.assert_close(got, _dense(q, k, v, rows, 0.35, window), atol=1e-5, rtol=1e-5)


def _cos_sin(positions, dim=8, base=10000.0, dtype=torch.float32):
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=dtype) / dim)
    freqs = positions[:, None].to(dtype) * inv
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def test_rope_composes_shift_a_then_delta_equals_b():
    x = torch.randn(10, 3, 8, dtype=torch.float64)
    a, b = torch.arange(10) * 7, torch.arange(10) * 7 + 123
    ca, sa = _cos_sin(a, dtype=torch.float64)
    cd, sd = _cos_sin(b - a, dtype=torch.float64)
    cb, sb = _cos_sin(b, dtype=torch.float64)
    torch.testing.assert_close(apply_rope(apply_rope(x, ca, sa), cd, sd), apply_rope(x, cb, sb))


def test_rope_preserves_norm_and_deviation():
    x, y = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    c, s = _cos_sin(torch.arange(5) + 40)
    torch.testing.assert_close(kv_deviation(apply_rope(x, c, s), apply_rope(y, c, s)), kv_deviation(x, y))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("m,heads,d", [(1, 1, 2), (7, 3, 64), (33, 9, 16)])
def test_apply_rope_matches_reference(dtype, tol, m, heads, d):
    from cacheblend_rag.kernels import apply_rope_reference

    x = torch.randn(m, heads, d, dtype=torch.float64).to(dtype)
    cos, sin = _cos_sin(torch.arange(m) * 5 + 3, dim=d, dtype=torch.float64)
    got = apply_rope(x, cos.to(dtype), sin.to(dtype))
    torch.testing.assert_close(got, apply_rope_reference(x, cos.to(dtype), sin.to(dtype)), atol=tol, rtol=tol)


def test_partition_cuts_where_rows_crowd():
    from cacheblend_rag.kernels.attention import RowAttentionPlan
    # 20 rows spread over the first 1000 keys, 200 crowded at the end: cutting off the sparse head pays
    rows = torch.cat([torch.arange(0, 1000, 50), torch.arange(1800, 2000)])
    plan = RowAttentionPlan(rows, 2000, torch.float32, overhead_rows=8)
    assert len(plan.groups) >= 2
    keys_read = sum((g.key_hi - g.key_lo) * (g.end - g.start) for g in plan.groups)
    assert keys_read < rows.numel() * 2000 * 0.95
    single = RowAttentionPlan(rows, 2000, torch.float32, overhead_rows=1e9)
    assert len(single.groups) == 1
    assert plan.num_pairs == single.num_pairs == int((rows + 1).sum())  # pairs causality needs, however cut


def test_plan_counts_causal_and_windowed_pairs():
    from cacheblend_rag.kernels.attention import RowAttentionPlan
    n = 100
    assert RowAttentionPlan(torch.arange(n), n, torch.float32).num_pairs == n * (n + 1) // 2
    windowed = RowAttentionPlan(torch.tensor([5, 50, 99]), n, torch.float32, sliding_window=10)
    assert windowed.num_pairs == 6 + 10 + 10

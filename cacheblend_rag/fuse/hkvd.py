"""HKVD scoring (CacheBlend §4): how far each reused row's fresh K/V is from its cached K/V, optionally weighted
by the attention the question pays to it, and the top rows by that score. Plain functions over one LayerView."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..kernels import kv_deviation
from ..models.adapter import LlamaFamilyAdapter
from .loop import LayerView, run_layers
from .policy import RowSelection
from .sequence import FusedSequence

DEVIATIONS = ("k", "v", "kv")
WEIGHTS = ("attention", "none")
SELECTIONS = ("global", "per_chunk", "random")


def deviation(kind: str, fresh_k, fresh_v, cached_k, cached_v) -> torch.Tensor:
    """Per-row deviation on K, V, or both (each normalized by its mean so neither dominates)."""
    if kind == "k":
        return kv_deviation(fresh_k, cached_k)
    if kind == "v":
        return kv_deviation(fresh_v, cached_v)
    dk, dv = kv_deviation(fresh_k, cached_k), kv_deviation(fresh_v, cached_v)
    return dk / dk.mean().clamp_min(1e-12) + dv / dv.mean().clamp_min(1e-12)


def question_attention(view: LayerView) -> torch.Tensor:
    """(N,) mean attention weight the trailing uncached rows (the question) give each row in this layer."""
    seq, q, keys = view.seq, view.q, view.keys
    uncached = ~seq.cached
    tail = int(torch.flip(uncached.int(), (0,)).cumprod(0).sum())  # the trailing run of uncached rows
    n = seq.num_rows
    num_kv_heads, head_dim = keys.shape[1], keys.shape[2]
    groups = q.shape[1] // num_kv_heads
    q_tail = q[-tail:].float().view(tail, num_kv_heads, groups, head_dim)  # GQA: each KV head's query group
    logits = torch.einsum("skgd,nkd->kgsn", q_tail, keys.float()) * view.scale
    positions = torch.arange(n, device=q.device)
    causal = positions[None, :] <= positions[n - tail:, None]  # (S, N)
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    return probs.mean(dim=(0, 1, 2))


def hkvd_score(view: LayerView, kind: str = "k", weight: str = "attention") -> torch.Tensor:
    """(N,) deviation of each row's fresh K/V from its cached one (0 where exact), optionally attention-weighted.

    Needs the cached K/V as loaded (`view.cached_k`, `view.cached_v`), which the loop shows before it writes
    the fresh values over them.
    """
    seq = view.seq
    cached_k, cached_v = view.cached_k, view.cached_v
    fresh_k, fresh_v = cached_k.clone(), cached_v.clone()  # exact rows: fresh = cached
    fresh_k[view.rows], fresh_v[view.rows] = view.k, view.v
    score = deviation(kind, fresh_k, fresh_v, cached_k, cached_v)
    score = score / score[seq.reused].mean().clamp_min(1e-12)  # layers weigh alike
    if weight == "attention":
        attention = question_attention(view)
        score = score * attention / attention[seq.reused].mean().clamp_min(1e-12)
    return score


def reuse_budget(seq: FusedSequence, ratio: float) -> tuple[int, int]:
    """(reused rows, how many of them `ratio` recomputes, rounded)."""
    num_reused = int(seq.reused.sum())
    return num_reused, round(ratio * num_reused)


def top_rows(score: torch.Tensor, seq: FusedSequence, ratio: float, selection: str = "global") -> torch.Tensor:
    """(N,) bool: the top `ratio` of reused rows by score (-inf: not eligible), over all chunks or per chunk."""
    score = score.masked_fill(~seq.reused, -math.inf)  # only reused rows compete
    selected = torch.zeros_like(seq.cached)
    if selection == "random":  # an ablation control: as many eligible rows, drawn at random (seeded)
        noise = torch.rand(score.shape, generator=torch.Generator().manual_seed(0)).to(score.device)
        score = noise.masked_fill(score == -math.inf, -math.inf)
    if selection in ("global", "random"):
        selected[score.topk(round(ratio * int(seq.reused.sum()))).indices] = True
    else:
        for chunk in seq.segment_of_row.unique().tolist():
            in_chunk = (seq.segment_of_row == chunk) & seq.reused
            if chunk < 0 or not bool(in_chunk.any()):
                continue
            rows = in_chunk.nonzero().squeeze(1)
            selected[rows[score[rows].topk(round(ratio * rows.numel())).indices]] = True
    return selected & seq.reused & (score > -math.inf)


def chunk_heads(seq: FusedSequence, num_tokens: int) -> torch.Tensor:
    """(N,) bool: the first `num_tokens` rows of each reused chunk."""
    heads = torch.zeros_like(seq.cached)
    if num_tokens <= 0:
        return heads
    seg = seq.segment_of_row
    starts = torch.ones_like(heads)
    starts[1:] = seg[1:] != seg[:-1]
    for s in starts.nonzero().squeeze(1).tolist():
        if seg[s] >= 0:
            heads[s : s + num_tokens] = True
    return heads & (seg >= 0)


@dataclass
class _AttentionProbe(RowSelection):
    """The probe pass: every active row stays; records the trailing rows' attention to every row, per layer."""

    per_layer: list[torch.Tensor] = field(default_factory=list)

    def keep(self, view: LayerView) -> None:
        """Record this layer's attention; keep every row."""
        self.per_layer.append(question_attention(view).float())


def question_relevance(adapter: LlamaFamilyAdapter, seq: FusedSequence, from_layer: int) -> torch.Tensor:
    """(N,) how much the trailing uncached rows (the question) attend to each row over the stale KV, summed over
    layers ≥ `from_layer`, each layer normalized by its mean over the reused rows (so layers weigh alike)."""
    probe = seq.twin()
    recorder = _AttentionProbe(~probe.cached)
    try:
        run_layers(adapter, probe, recorder, num_output_rows=1)
    finally:
        probe.close()
    reused = seq.reused
    score = torch.zeros(seq.num_rows, device=reused.device)
    for attention in recorder.per_layer[from_layer:]:
        score += attention / attention[reused].mean().clamp_min(1e-12)
    return score

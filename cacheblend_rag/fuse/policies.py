"""Token-selection policies over the one layer loop: which rows are computed at each layer.

A policy says which segments it takes from the cache (`reuse`) and, per request
(`start`), which rows start active and which stay active layer by layer (`keep`).
None of them runs a loop of its own: CacheBlend computes every row up to its check
layer inside the same `run_layers`, and narrows to the HKVD rows there.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..kernels import kv_deviation
from ..models.adapter import LlamaFamilyAdapter
from .sequence import FusedSequence


class Reuse(enum.Enum):
    """Which cached KV a policy places into the sequence."""

    NONE = "none"  # nothing cached: compute every row
    PREFIX = "prefix"  # the exact prefix: system prefix + first chunk computed right after it
    ALL = "all"  # the prefix and every chunk's own KV, re-positioned


@dataclass
class RowSelection:
    """One request's row plan: the rows active from layer 0, and per-layer narrowing (a `RowPolicy`)."""

    active: torch.Tensor  # (N,) bool
    full_layers: int = 0  # leading layers computed over every row (CacheBlend's check layers)

    def keep(self, layer: int, rows: torch.Tensor, fresh_q: torch.Tensor, fresh_k: torch.Tensor,
             fresh_v: torch.Tensor, keys: torch.Tensor, seq: FusedSequence) -> torch.Tensor | None:
        """Keep every active row."""
        return None


@dataclass(frozen=True)
class FullPrefill:
    """Every row, every layer: the reference."""

    name: str = field(default="full_prefill", init=False)
    reuse: Reuse = field(default=Reuse.NONE, init=False)

    def start(self, adapter: LlamaFamilyAdapter, seq: FusedSequence) -> RowSelection:
        """All rows."""
        return RowSelection(torch.ones_like(seq.cached))


class _CachedOnly:
    def start(self, adapter: LlamaFamilyAdapter, seq: FusedSequence) -> RowSelection:
        """Rows without cached KV."""
        return RowSelection(~seq.cached)


@dataclass(frozen=True)
class PrefixCache(_CachedOnly):
    """Reuse the KV of the exact prefix (system prefix + first chunk), compute the rest."""

    name: str = field(default="prefix_cache", init=False)
    reuse: Reuse = field(default=Reuse.PREFIX, init=False)


@dataclass(frozen=True)
class FullReuse(_CachedOnly):
    """Reuse every chunk's KV as is (re-positioned); compute only what is not cached."""

    name: str = field(default="full_reuse", init=False)
    reuse: Reuse = field(default=Reuse.ALL, init=False)


DEVIATIONS = ("k", "v", "kv")
SELECTIONS = ("global", "per_chunk", "random")


@dataclass(frozen=True)
class CacheBlend:
    """Selective recompute of the reused tokens with the highest KV deviation (HKVD), CacheBlend §4.

    Every row is computed up to the last check layer, so those layers' KV is fresh
    everywhere. At each check layer the deviation of each reused row's fresh K/V from
    its cached K/V is measured, weighted by the attention the question gives each token
    there (a deviation the question does not read cannot move the answer; `weight="none"`
    is the paper's plain HKVD). After the last check layer the top
    `candidate_factor × recompute_ratio` of reused rows stay active as candidates; at
    `filter_layer` their deviation is measured again, weighted alike, and only the top
    `recompute_ratio` stay for the remaining layers (gradual filtering, §4.3: layer-1
    deviation predicts deep layers poorly on small models). Rows without cache are always
    active; the rest keep their cached KV. `candidate_factor=1` selects once, at the
    check layer. With recompute_ratio=1 this is full prefill (when any row is approximate);
    with 0, full reuse (no check layer is run); with no approximate rows at all (no chunks,
    or only the exact first chunk), at any ratio, it reuses the exact ones as a prefix cache would.
    """

    recompute_ratio: float = 0.15  # share of reused rows recomputed from `filter_layer` on
    check_layers: tuple[int, ...] = (1,)
    candidate_factor: float = 2.5  # candidates kept at the check layer, × recompute_ratio (1: no gradual filtering)
    filter_layer: int = 3  # where the candidates are narrowed to recompute_ratio
    deviation: str = "k"  # measure the deviation on "k", "v" or both ("kv"); K measured best here (docs/benchmarks.md)
    selection: str = "global"  # top tokens over all chunks, "per_chunk" (the same ratio in each), "random" (a control)
    chunk_head_tokens: int = 0  # always recompute the first n tokens of each reused chunk
    weight: str = "attention"  # weight deviations by the question's attention to each token ("none": plain HKVD)
    name: str = field(default="cacheblend", init=False)
    reuse: Reuse = field(default=Reuse.ALL, init=False)

    def __post_init__(self) -> None:
        r = self.recompute_ratio
        if not isinstance(r, (int, float)) or math.isnan(r) or not 0.0 <= r <= 1.0:
            raise ConfigError(f"recompute_ratio must be within [0, 1], got {r}")
        if not self.check_layers or any(layer < 0 for layer in self.check_layers):
            raise ConfigError(f"check_layers must be non-empty and ≥ 0, got {self.check_layers}")
        if self.deviation not in DEVIATIONS:
            raise ConfigError(f"deviation must be one of {DEVIATIONS}, got {self.deviation!r}")
        if self.weight not in ("none", "attention"):
            raise ConfigError(f"weight must be 'none' or 'attention', got {self.weight!r}")
        if self.selection not in SELECTIONS:
            raise ConfigError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        if not isinstance(self.candidate_factor, (int, float)) or not self.candidate_factor >= 1.0:
            raise ConfigError(f"candidate_factor must be ≥ 1, got {self.candidate_factor}")
        if self.candidate_factor > 1.0 and self.filter_layer <= max(self.check_layers):
            raise ConfigError(f"filter_layer ({self.filter_layer}) must come after the check layers {self.check_layers}")

    @property
    def candidate_ratio(self) -> float:
        """Share of reused rows kept at the check layer (narrowed to recompute_ratio at filter_layer)."""
        return min(1.0, self.candidate_factor * self.recompute_ratio)

    def start(self, adapter: LlamaFamilyAdapter, seq: FusedSequence) -> RowSelection:
        """Every row up to the last check layer (or none reused, when the budget is 0 or all of them)."""
        reused = seq.reused
        num_reused = int(reused.sum())
        budget = round(self.recompute_ratio * num_reused)
        if num_reused and budget >= num_reused:
            return RowSelection(torch.ones_like(seq.cached))
        heads = self._chunk_heads(seq)
        if budget == 0:  # nothing to select (or nothing approximate at all): full reuse (plus chunk heads), no check
            return RowSelection(~seq.cached | (heads & reused))
        last_check = max(self.check_layers)
        if last_check >= adapter.num_layers:
            raise ConfigError(f"check layer {last_check} ≥ the model's {adapter.num_layers} layers")
        filters = self.candidate_factor > 1.0 and self.filter_layer < adapter.num_layers
        # every row whose KV is not exact already, up to the last check layer
        return _HKVDSelection(~seq.exact, last_check + 1, policy=self, adapter=adapter, heads=heads,
                              first_ratio=self.candidate_ratio if filters else self.recompute_ratio,
                              filter_layer=self.filter_layer if filters else None)

    def _select(self, score: torch.Tensor, seq: FusedSequence, ratio: float) -> torch.Tensor:
        """The top `ratio` of reused rows by score (-inf: not eligible), over all chunks or per chunk."""
        score = score.masked_fill(~seq.reused, -math.inf)  # only reused rows compete
        selected = torch.zeros_like(seq.cached)
        if self.selection == "random":  # an ablation control: as many eligible rows, drawn at random (seeded)
            noise = torch.rand(score.shape, generator=torch.Generator().manual_seed(0)).to(score.device)
            score = noise.masked_fill(score == -math.inf, -math.inf)
        if self.selection in ("global", "random"):
            selected[score.topk(round(ratio * int(seq.reused.sum()))).indices] = True
        else:
            for chunk in seq.segment_of_row.unique().tolist():
                in_chunk = (seq.segment_of_row == chunk) & seq.reused
                if chunk < 0 or not bool(in_chunk.any()):
                    continue
                rows = in_chunk.nonzero().squeeze(1)
                selected[rows[score[rows].topk(round(ratio * rows.numel())).indices]] = True
        return selected & seq.reused & (score > -math.inf)

    def _chunk_heads(self, seq: FusedSequence) -> torch.Tensor:
        """The first `chunk_head_tokens` rows of each reused chunk."""
        heads = torch.zeros_like(seq.cached)
        if self.chunk_head_tokens <= 0:
            return heads
        seg = seq.segment_of_row
        starts = torch.ones_like(heads)
        starts[1:] = seg[1:] != seg[:-1]
        start_rows = starts.nonzero().squeeze(1)
        for s in start_rows.tolist():
            if seg[s] >= 0:
                heads[s : s + self.chunk_head_tokens] = True
        return heads & (seg >= 0)


@dataclass
class _HKVDSelection(RowSelection):
    """One CacheBlend request: scores reused rows at the check layers, keeps candidates, narrows at the filter layer."""

    policy: CacheBlend | None = None
    adapter: LlamaFamilyAdapter | None = None
    heads: torch.Tensor | None = None  # (N,) rows always recomputed (chunk heads)
    first_ratio: float = 0.0  # share of reused rows kept after the last check layer
    filter_layer: int | None = None  # where they are narrowed to the policy's recompute_ratio
    score: torch.Tensor | None = None

    def keep(self, layer: int, rows: torch.Tensor, fresh_q: torch.Tensor, fresh_k: torch.Tensor,
             fresh_v: torch.Tensor, keys: torch.Tensor, seq: FusedSequence) -> torch.Tensor | None:
        """Accumulate the deviation at check layers; select after the last; narrow at the filter layer."""
        policy = self.policy
        if layer in policy.check_layers:  # every row but the exact ones is active here
            score = self._deviation_score(layer, rows, fresh_q, fresh_k, fresh_v, keys, seq)
            self.score = score if self.score is None else self.score + score
            if layer + 1 == self.full_layers:
                return self._kept(policy._select(self.score, seq, self.first_ratio), rows, seq)
            return None
        if layer != self.filter_layer:
            return None
        # the same score over the candidates only: deviation at this layer × the question's attention here
        score = torch.full(seq.cached.shape, -math.inf, device=rows.device)
        score[rows] = self._deviation_score(layer, rows, fresh_q, fresh_k, fresh_v, keys, seq)[rows]
        return self._kept(policy._select(score, seq, policy.recompute_ratio), rows, seq)

    def _kept(self, selected: torch.Tensor, rows: torch.Tensor, seq: FusedSequence) -> torch.Tensor:
        """Over `rows`: the uncached rows, and the reused rows selected or always recomputed (exact rows keep their cache)."""
        return (~seq.cached | ((selected | self.heads) & seq.reused))[rows]

    def _deviation_score(self, layer: int, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         keys: torch.Tensor, seq: FusedSequence) -> torch.Tensor:
        """(N,) deviation of each row's fresh K/V from its cached one (0 where exact), optionally attention-weighted."""
        cached_k, cached_v = seq.cached_kv(layer)
        fresh_k, fresh_v = cached_k.clone(), cached_v.clone()  # exact rows: fresh = cached
        fresh_k[rows], fresh_v[rows] = k, v
        score = _score(self.policy.deviation, fresh_k, fresh_v, cached_k, cached_v)
        score = score / score[seq.reused].mean().clamp_min(1e-12)  # layers weigh alike
        if self.policy.weight == "attention":
            attention = self._question_attention(layer, q, keys, seq)
            score = score * attention / attention[seq.reused].mean().clamp_min(1e-12)
        return score

    def _question_attention(self, layer: int, q: torch.Tensor, keys: torch.Tensor, seq: FusedSequence) -> torch.Tensor:
        """(N,) mean attention weight the trailing uncached rows (the question) give each row.

        q (M, heads, d) after RoPE, its last rows the question's; keys (N, kv_heads, d) the layer's fused keys.
        """
        uncached = ~seq.cached
        tail = int(torch.flip(uncached.int(), (0,)).cumprod(0).sum())  # the trailing run of uncached rows
        n = seq.num_rows
        num_kv_heads, head_dim = keys.shape[1], keys.shape[2]
        groups = q.shape[1] // num_kv_heads
        q_tail = q[-tail:].float().view(tail, num_kv_heads, groups, head_dim)  # GQA: each KV head's query group
        logits = torch.einsum("skgd,nkd->kgsn", q_tail, keys.float()) * self.adapter.scaling(layer)
        positions = torch.arange(n, device=q.device)
        causal = positions[None, :] <= positions[n - tail:, None]  # (S, N)
        probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
        return probs.mean(dim=(0, 1, 2))


def _score(deviation: str, fresh_k, fresh_v, cached_k, cached_v) -> torch.Tensor:
    """Per-row deviation on K, V, or both (each normalized by its mean so neither dominates)."""
    if deviation == "k":
        return kv_deviation(fresh_k, cached_k)
    if deviation == "v":
        return kv_deviation(fresh_v, cached_v)
    dk, dv = kv_deviation(fresh_k, cached_k), kv_deviation(fresh_v, cached_v)
    return dk / dk.mean().clamp_min(1e-12) + dv / dv.mean().clamp_min(1e-12)


METHODS = ("full_prefill", "prefix_cache", "full_reuse", "cacheblend")


Policy = FullPrefill | PrefixCache | FullReuse | CacheBlend


def make_policy(method: "str | Policy", recompute_ratio: float | None = None, **options) -> "Policy":
    """The policy for a method name (or a policy object, returned as is); CacheBlend options pass through."""
    if not isinstance(method, str):
        if recompute_ratio is not None or options:
            raise ConfigError("pass options to the policy object itself, not beside it")
        return method
    if method == "cacheblend":
        if recompute_ratio is not None:
            options["recompute_ratio"] = recompute_ratio
        return CacheBlend(**options)
    if recompute_ratio is not None and not 0.0 <= recompute_ratio <= 1.0:
        raise ConfigError(f"recompute_ratio must be within [0, 1], got {recompute_ratio}")
    if options:
        raise ConfigError(f"method {method!r} takes no options, got {sorted(options)}")
    if method == "full_prefill":
        return FullPrefill()
    if method == "prefix_cache":
        return PrefixCache()
    if method == "full_reuse":
        return FullReuse()
    raise ConfigError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")

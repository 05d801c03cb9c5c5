"""CacheBlend (§4): reuse every chunk's KV and recompute the reused rows whose KV deviates most (HKVD)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...errors import ConfigError
from ...models.adapter import LlamaFamilyAdapter
from .. import placement
from ..guard import GuardedRows, QualityGuard
from ..hkvd import DEVIATIONS, SELECTIONS, WEIGHTS, chunk_heads, hkvd_score, reuse_budget, top_rows
from ..lookalike import lookalike_rows
from ..loop import LayerView
from ..policy import Policy, RowSelection
from ..sequence import FusedSequence
from .checks import check_guard_options, check_ratio


@dataclass(frozen=True)
class CacheBlend(placement.EveryChunk, Policy):
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
    deviation: str = "k"  # measure the deviation on "k", "v" or both ("kv"); K measured best here (bench methods, deviation=k|v|kv)
    selection: str = "global"  # top tokens over all chunks, "per_chunk" (the same ratio in each), "random" (a control)
    chunk_head_tokens: int = 0  # always recompute the first n tokens of each reused chunk
    weight: str = "attention"  # weight deviations by the question's attention to each token ("none": plain HKVD)
    guard: float | None = None  # quality guard threshold (fuse/guard.py): flag requests whose estimate exceeds it
    guard_ratio: float | None = None  # the recompute ratio a flagged request escalates to (None: flag only)
    # recompute in full every reused page that repeats an earlier page's phrasing with other content, above this
    # look-alike score (fuse/lookalike.py; None: never): among look-alike pages reuse gives a neighbour's facts
    lookalike: float | None = 0.2
    name: ClassVar[str] = "cacheblend"

    def __post_init__(self) -> None:
        check_ratio(self.recompute_ratio)
        layers = (self.check_layers,) if isinstance(self.check_layers, int) else self.check_layers
        if (not isinstance(layers, (tuple, list)) or not layers
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in layers)):
            raise ConfigError(f"check_layers must be a layer index or a non-empty list of them (≥ 0), "
                              f"got {self.check_layers!r}")
        object.__setattr__(self, "check_layers", tuple(layers))
        if self.deviation not in DEVIATIONS:
            raise ConfigError(f"deviation must be one of {DEVIATIONS}, got {self.deviation!r}")
        if self.weight not in WEIGHTS:
            raise ConfigError(f"weight must be one of {WEIGHTS}, got {self.weight!r}")
        if self.selection not in SELECTIONS:
            raise ConfigError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        factor = self.candidate_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1.0:
            raise ConfigError(f"candidate_factor must be a number ≥ 1, got {factor!r}")
        for name in ("filter_layer", "chunk_head_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer ≥ 0, got {value!r}")
        if factor > 1.0 and self.filter_layer <= max(self.check_layers):
            raise ConfigError(f"filter_layer ({self.filter_layer}) must come after the check layers {self.check_layers}")
        check_guard_options(self.guard, self.guard_ratio, self.recompute_ratio)
        if self.lookalike is not None:
            check_ratio(self.lookalike, "lookalike")

    @property
    def candidate_ratio(self) -> float:
        """Share of reused rows kept at the check layer (narrowed to recompute_ratio at filter_layer)."""
        return min(1.0, self.candidate_factor * self.recompute_ratio)

    def start(self, adapter: LlamaFamilyAdapter, seq: FusedSequence,
              placed: placement.Placements) -> RowSelection:
        """Every row up to the last check layer (or none reused, when the budget is 0 or all of them)."""
        reused = seq.reused
        num_reused, budget = reuse_budget(seq, self.recompute_ratio)
        guard = QualityGuard(self.guard, self.guard_ratio) if self.guard is not None else None
        if num_reused and budget >= num_reused:
            if guard is not None:  # every reused row recomputed: nothing stays stale
                guard.settle(0.0)
            return GuardedRows(torch.ones_like(seq.cached), guard=guard)
        heads = chunk_heads(seq, self.chunk_head_tokens)
        if budget == 0:  # nothing to select (or nothing approximate at all): full reuse (plus chunk heads), no check
            if guard is not None:  # nothing reused: exact; else no check layer runs to measure (not estimated)
                guard.settle(0.0 if num_reused == 0 else None)
            return GuardedRows(~seq.cached | (heads & reused), guard=guard)
        last_check = max(self.check_layers)
        if last_check >= adapter.num_layers:
            raise ConfigError(f"check layer {last_check} ≥ the model's {adapter.num_layers} layers")
        filters = self.candidate_factor > 1.0 and self.filter_layer < adapter.num_layers
        # between full reuse and full prefill only: the ratios' ends stay what they are
        lookalike = lookalike_rows(seq, self.lookalike)
        heads = heads | lookalike
        # every row whose KV is not exact already, up to the last check layer
        return HKVDSelection(~seq.exact, last_check + 1, policy=self, heads=heads,
                             first_ratio=self.candidate_ratio if filters else self.recompute_ratio,
                             filter_layer=self.filter_layer if filters else None, guard=guard,
                             lookalike_rows=int(lookalike.sum()))


@dataclass
class HKVDSelection(RowSelection):
    """One CacheBlend request: scores reused rows at the check layers, keeps candidates, narrows at the filter layer."""

    policy: CacheBlend | None = None
    heads: torch.Tensor | None = None  # (N,) rows always recomputed (chunk heads)
    first_ratio: float = 0.0  # share of reused rows kept after the last check layer
    filter_layer: int | None = None  # where they are narrowed to the policy's recompute_ratio
    score: torch.Tensor | None = None
    guard: QualityGuard | None = None  # per request; may escalate the budget at the last check layer
    final_ratio: float | None = None  # share of reused rows kept from the filter layer on (the policy's, or escalated)
    lookalike_rows: int = 0  # reused rows always recomputed because their page looks like an earlier one

    def keep(self, view: LayerView) -> torch.Tensor | None:
        """Accumulate the deviation at check layers; select after the last; narrow at the filter layer."""
        policy, seq, layer = self.policy, view.seq, view.layer
        if layer in policy.check_layers:  # every row but the exact ones is active here
            score = hkvd_score(view, policy.deviation, policy.weight)
            self.score = score if self.score is None else self.score + score
            if self.guard is not None:
                self.guard.observe(view)
            if layer + 1 == self.full_layers:
                self._guard(seq)
                return self._kept(self.select(self.score, seq, self.first_ratio), view)
            return None
        if layer != self.filter_layer:
            return None
        # the same score over the candidates only: deviation at this layer × the question's attention here
        score = torch.full(seq.cached.shape, -math.inf, device=view.rows.device)
        score[view.rows] = hkvd_score(view, policy.deviation, policy.weight)[view.rows]
        ratio = policy.recompute_ratio if self.final_ratio is None else self.final_ratio
        return self._kept(self.select(score, seq, ratio), view)

    def _guard(self, seq: FusedSequence) -> None:
        """Estimate from the rows the policy's ratio would recompute; escalate both budgets when flagged."""
        if self.guard is None:
            return
        ratio = self.guard.decide(self.select(self.score, seq, self.policy.recompute_ratio), seq)
        if ratio is not None:
            self.final_ratio = ratio
            filters = self.filter_layer is not None
            self.first_ratio = min(1.0, self.policy.candidate_factor * ratio) if filters else ratio

    def report(self) -> dict:
        """The guard's reading (empty without a guard) and how many rows were recomputed as look-alike pages."""
        report = self.guard.report() if self.guard is not None else {}
        if self.lookalike_rows:
            report["lookalike_rows"] = self.lookalike_rows
        return report

    def select(self, score: torch.Tensor, seq: FusedSequence, ratio: float) -> torch.Tensor:
        """(N,) bool: the reused rows to keep, the top `ratio` by score (a subclass may choose otherwise)."""
        return top_rows(score, seq, ratio, self.policy.selection)

    def _kept(self, selected: torch.Tensor, view: LayerView) -> torch.Tensor:
        """Over the view's rows: the uncached rows, and the reused rows selected or always recomputed."""
        seq = view.seq
        return (~seq.cached | ((selected | self.heads) & seq.reused))[view.rows]

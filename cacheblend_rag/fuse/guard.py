"""The quality guard: a cheap per-request estimate of how far a fused prefill may be from a full prefill.

At a layer where every reused row is computed (CacheBlend's check layer), each reused row i has a fresh and a
cached K/V; the question's attention a_i to it is known (`hkvd.question_attention`). The guard keeps

    mass_i = a_i · (‖Δk_i‖ / ‖k_i‖ + ‖Δv_i‖ / ‖v_i‖) / 2          (reused rows; 0 elsewhere)

the question's attention that lands on stale KV, weighted by how stale it is (relative, so layers and models
compare), averaged over the check layers. Where the selection decides, the estimate is the mass on the reused
rows it leaves unfixed:

    estimate = Σ_{reused, not recomputed} mass_i          ∈ [0, ~1]; 0 when nothing reused stays stale

Above `threshold` the request is flagged; with `escalate_to` the selection then recomputes that share of the
reused rows instead, in the same pass (no second prefill). One `QualityGuard` per request; any selection that
sees a `LayerView` with the cached K/V can feed it (`observe`) and ask it (`decide`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .hkvd import question_attention
from .loop import LayerView
from .policy import RowSelection
from .sequence import FusedSequence


def _relative(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """(M,) ‖fresh − cached‖ / ‖fresh‖ per row, over heads and head dim."""
    fresh, cached = fresh.float().flatten(1), cached.float().flatten(1)
    return (fresh - cached).norm(dim=1) / fresh.norm(dim=1).clamp_min(1e-12)


def stale_mass(view: LayerView) -> torch.Tensor:
    """(N,) per reused row: the question's attention to it × its relative K/V deviation in this layer (0 elsewhere).

    Needs every reused row active in this layer and the cached K/V as loaded (a check layer).
    """
    seq = view.seq
    mass = torch.zeros(seq.num_rows, dtype=torch.float32, device=view.rows.device)
    reused = seq.reused[view.rows]
    if view.cached_k is None or not bool(reused.any()):
        return mass
    rows = view.rows[reused]
    deviation = 0.5 * (_relative(view.k[reused], view.cached_k[rows]) + _relative(view.v[reused], view.cached_v[rows]))
    mass[rows] = question_attention(view)[rows].float() * deviation
    return mass


@dataclass
class QualityGuard:
    """One request's guard: accumulates stale mass at check layers, then flags (and maybe escalates) at selection."""

    threshold: float
    escalate_to: float | None = None  # the recompute ratio a flagged request escalates to (None: flag only)
    mass: torch.Tensor | None = None  # (N,) mean stale mass over the layers observed
    num_layers: int = 0
    estimate: float | None = None
    flagged: bool = False
    escalated: bool = False

    def observe(self, view: LayerView) -> None:
        """Add this layer's stale mass (call it at layers where every reused row is computed)."""
        mass = stale_mass(view)
        self.mass = mass if self.mass is None else self.mass + mass
        self.num_layers += 1

    def decide(self, recomputed: torch.Tensor, seq: FusedSequence) -> float | None:
        """Estimate from the rows the selection would recompute ((N,) bool); the ratio to escalate to, or None."""
        if self.mass is None:
            raise RuntimeError("the guard decides after observing at least one layer")
        unfixed = seq.reused & ~recomputed
        self.estimate = float(self.mass[unfixed].sum()) / self.num_layers
        self.flagged = self.estimate > self.threshold
        self.escalated = self.flagged and self.escalate_to is not None
        return self.escalate_to if self.escalated else None

    def settle(self, estimate: float | None) -> None:
        """For a request the guard cannot observe (nothing reused, everything recomputed, no check layer run)."""
        self.estimate = estimate
        self.flagged = estimate is not None and estimate > self.threshold
        self.escalated = False

    def report(self) -> dict:
        """{"guard": {estimate, threshold, flagged, escalated, escalate_to}} for the request's stats."""
        return {"guard": {"estimate": self.estimate, "threshold": self.threshold, "flagged": self.flagged,
                          "escalated": self.escalated, "escalate_to": self.escalate_to}}


@dataclass
class GuardedRows(RowSelection):
    """A selection that never narrows, carrying a settled guard into the request's stats."""

    guard: QualityGuard | None = None

    def report(self) -> dict:
        """The guard's reading."""
        return self.guard.report() if self.guard is not None else {}

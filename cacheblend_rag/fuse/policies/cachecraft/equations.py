"""Cache-Craft's equations (§3): β, γ, CFO, the focused chunks, and the calibrated α the policy reads.

    β   prefix overlap (eq. 6)      share of the variant's inter-attention that went to chunks also before it now
    γ   order penalty (eq. 7)       normalized Kendall tau distance between the old and new order of those chunks
    β'  = β · (1 − γ)               (eq. 8)
    CFO = α · CCI · (1 − β')        (eq. 12), clipped to [0, 1]
    focused chunks                  Algorithm 1, lines 4–9: the entropy of the gaps in sorted attention

α (eq. 13) comes from data: `cacheblend_rag/cachecraft_calibration.py` measures it (`cacheblend-rag calibrate
--method cachecraft`) and stores it at `calibration_path`; the policy reads it with `calibrated_alpha`.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from .... import settings

logger = logging.getLogger(__name__)

DEFAULT_ALPHA = 0.5  # without a calibration (`cacheblend-rag calibrate`); see docs/design.md "Cache-Craft"


# ---- the equations ------------------------------------------------------------------------------

def _first_order(ids) -> list[str]:
    seen: dict[str, None] = {}
    for c in ids:
        seen.setdefault(c, None)
    return list(seen)


def prefix_overlap(inter: dict[str, float], old: Sequence[str], new: Sequence[str]) -> float:
    """β (eq. 6): Σ_{j ∈ old ∩ new} inter(C, j) / Σ_{j ∈ old} inter(C, j); 0 when the old prefix drew none."""
    old_set, new_set = set(old), set(new)
    total = sum(inter.get(j, 0.0) for j in old_set)
    if total <= 0:
        return 0.0
    return sum(inter.get(j, 0.0) for j in old_set & new_set) / total


def order_penalty(old: Sequence[str], new: Sequence[str]) -> float:
    """γ (eq. 7): discordant pairs / C(m, 2) between the shared chunks' old and new orders (0 when m < 2)."""
    shared = set(old) & set(new)
    a_old = [c for c in _first_order(old) if c in shared]
    rank_new = {c: i for i, c in enumerate(c for c in _first_order(new) if c in shared)}
    m = len(a_old)
    if m < 2:
        return 0.0
    ranks = [rank_new[c] for c in a_old]
    discordant = sum(1 for i in range(m) for j in range(i + 1, m) if ranks[i] > ranks[j])
    return discordant / (m * (m - 1) / 2)


def cache_fix_overhead(alpha: float, context_impact: float, beta_adjusted: float) -> float:
    """CFO (eq. 12): α · CCI · (1 − β'), clipped to [0, 1] (1: recompute every token)."""
    return min(1.0, max(0.0, alpha * context_impact * (1.0 - beta_adjusted)))


def focused_chunks(cumulative: list[float]) -> set[int]:
    """Algorithm 1, lines 4–9: the high-attention chunks by the entropy of the gaps in sorted attention."""
    k = len(cumulative)
    order = sorted(range(k), key=lambda i: -cumulative[i])
    if k < 3:
        return set(order)
    s = [cumulative[i] for i in order]
    diff = [s[i] - s[i + 1] for i in range(k - 1)]
    total = sum(diff)
    if total <= 0:
        return set(order)
    p = [d / total for d in diff]
    terms = [-x * math.log(x) if x > 0 else 0.0 for x in p]
    # h_i = Σ_{j≤i} terms_j (1-indexed); i* = argmax_{i ∈ [k−2]} h_{i+1} − h_i = argmax terms_{i+1}; F = top i*
    best = max(range(1, k - 1), key=lambda i: (terms[i], -i))  # terms[i] is term i+1 (1-indexed): i* = i
    return set(order[:best])


# ---- calibrated α -------------------------------------------------------------------------------

def calibration_path(fingerprint: str, device_type: str, dtype: torch.dtype,
                     home: str | Path | None = None) -> Path:
    """Where `cacheblend-rag calibrate` keeps α for a model, device and dtype (beside its loading profile)."""
    name = str(dtype).removeprefix("torch.")
    return settings.home_dir(home) / "profiles" / f"{fingerprint}-{device_type}-{name}.cachecraft.json"


def calibrated_alpha(fingerprint: str, device_type: str, dtype: torch.dtype,
                     home: str | Path | None = None) -> float | None:
    """The calibrated α stored for this model, device and dtype, or None (missing or unreadable: logged)."""
    path = calibration_path(fingerprint, device_type, dtype, home)
    if not path.is_file():
        return None
    try:
        alpha = float(json.loads(path.read_text())["alpha"])
        if not math.isfinite(alpha) or alpha < 0:
            raise ValueError(f"alpha {alpha}")
        return alpha
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("the Cache-Craft calibration %s is unreadable (%s); using alpha=%s", path, e, DEFAULT_ALPHA)
        return None

"""Cache-Craft's equations (§3) and their calibration: β, γ, CFO, the focused chunks, and α from data.

    β   prefix overlap (eq. 6)      share of the variant's inter-attention that went to chunks also before it now
    γ   order penalty (eq. 7)       normalized Kendall tau distance between the old and new order of those chunks
    β'  = β · (1 − γ)               (eq. 8)
    CFO = α · CCI · (1 − β')        (eq. 12), clipped to [0, 1]
    focused chunks                  Algorithm 1, lines 4–9: the entropy of the gaps in sorted attention

α (eq. 13) comes from data: the smallest α whose mean first-token KL vs full prefill meets a target.

Per dev question: a first request over a seeded random subset of its passages in random order (a cold store:
every chunk is a hole, computed in context and kept as a variant), then a second request over another subset
and order (every chunk also precomputed alone, so none is a hole), run as full prefill, CacheBlend at 0.15 (for
reference) and Cache-Craft at each α of a grid (not storing new variants, so every α sees the same variants).
α* = min α with mean KL ≤ target; it is stored beside the model's loading profile
(`calibration_path`) and `method="cachecraft"` takes it by default.
`cacheblend-rag calibrate` runs `calibrate` and `store_calibration`; the policy reads `calibrated_alpha`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .... import settings
from ...fidelity import first_token_kl

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


# ---- calibrating α (eq. 13) ---------------------------------------------------------------------

ALPHAS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.4, 2.0)


def _requests(passages: Sequence[str], num_chunks: int, seed: int) -> tuple[list[str], list[str]]:
    """Two seeded random subsets (random order) of a question's passages: the warm-up and the measured one."""
    passages = list(passages)
    rng = random.Random(seed)
    k = min(num_chunks, len(passages))
    return rng.sample(passages, k), rng.sample(passages, k)


def calibrate(engine, items: Sequence[tuple[str, Sequence[str]]], target_kl: float, *,
              alphas: tuple[float, ...] = ALPHAS, num_chunks: int = 6, seed: int = 0, focus_window: int = 3,
              show_progress: bool = True) -> dict:
    """Mean first-token KL and recomputed share per α on `items` ((question, passages) pairs); α* = the smallest
    α meeting `target_kl`."""
    kls: dict[float, list[float]] = {a: [] for a in alphas}
    shares: dict[float, list[float]] = {a: [] for a in alphas}
    blend_kl, blend_share = [], []
    # ≈ 45 s a question on 2 CPU cores (a cold request, a precompute, full prefill, CacheBlend and every α)
    for n, (question, passages) in enumerate(tqdm(items, desc="calibrate", unit="question",
                                                  disable=not show_progress)):
        first, second = _requests(passages, num_chunks, seed + n)
        engine.prefill(first, question, "cachecraft", focus_window=focus_window)  # variants from a live request
        engine.ingest(second, show_progress=False)  # every chunk also precomputed alone: no holes below
        full = engine.prefill(second, question, "full_prefill")
        blend = engine.prefill(second, question, "cacheblend", 0.15)
        blend_kl.append(first_token_kl(full.logits, blend.logits))
        blend_share.append(_share(blend.stats))
        for a in alphas:
            got = engine.prefill(second, question, "cachecraft", alpha=a, focus_window=focus_window,
                                 store_variants=False)
            kls[a].append(first_token_kl(full.logits, got.logits))
            shares[a].append(_share(got.stats))
        logger.info("calibrate: %d/%d questions", n + 1, len(items))
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    table = [{"alpha": a, "mean_kl": mean(kls[a]), "recomputed_share": mean(shares[a])} for a in alphas]
    meeting = [row for row in table if row["mean_kl"] <= target_kl]
    best = meeting[0] if meeting else table[-1]
    return {"alpha": best["alpha"], "met": bool(meeting), "target_kl": target_kl, "questions": len(items),
            "num_chunks": num_chunks, "focus_window": focus_window, "table": table,
            "cacheblend_0.15": {"mean_kl": mean(blend_kl), "recomputed_share": mean(blend_share)}}


def _share(stats) -> float:
    """Share of the chunks' non-exact tokens the request computed: (recomputed rows + holes) / (reused + holes)."""
    chunk_tokens = stats["num_reused"] + stats["num_hole_tokens"]
    return (stats["num_recomputed"] + stats["num_hole_tokens"]) / chunk_tokens if chunk_tokens else 0.0


def store_calibration(engine, result: dict, home: str | os.PathLike[str] | None = None) -> Path:
    """Write the calibration beside the model's profile (atomically); `method="cachecraft"` reads its α."""
    a = engine.adapter
    path = calibration_path(engine.fingerprint, a.device.type, a.dtype, home)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**result, "model": engine.model_name, "created": time.time()}, indent=1))
    os.replace(tmp, path)
    return path

"""Calibrating Cache-Craft's α (eq. 13) from data: the smallest α whose mean first-token KL vs full prefill meets
a target. A harness that runs the engine, beside the fidelity gate (`gate.py`); the equations it calibrates stay in
`fuse/policies/cachecraft/equations.py`, which also reads the stored α back (`calibrated_alpha`).

Per dev question: a first request over a seeded random subset of its passages in random order (a cold store:
every chunk is a hole, computed in context and kept as a variant), then a second request over another subset
and order (every chunk also precomputed alone, so none is a hole), run as full prefill, CacheBlend at 0.15 (for
reference) and Cache-Craft at each α of a grid (not storing new variants, so every α sees the same variants).
α* = min α with mean KL ≤ target; it is stored beside the model's loading profile
(`calibration_path`) and `method="cachecraft"` takes it by default.
`cacheblend-rag calibrate --method cachecraft` runs `calibrate` and `store_calibration`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from .fuse.fidelity import first_token_kl
from .fuse.policies.cachecraft.equations import calibration_path

logger = logging.getLogger(__name__)

__all__ = ["ALPHAS", "calibrate", "store_calibration"]

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

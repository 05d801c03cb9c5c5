"""Measured costs the loading controller needs: recompute time per layer, read throughput per tier.

Measured once per model, device and dtype, cached as JSON under the package home,
re-measured on demand (`cacheblend-rag profile --remeasure`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import settings
from ..errors import ProfileError
from ..store.probe import (  # noqa: F401  (re-exported: the measured tier and codec speeds)
    CONSERVATIVE_DISK,
    CONSERVATIVE_MEMORY,
    PROBE_PREFIX,
    CodecProfile,
    TierProfile,
    drop_page_cache,
    measure_codec_profile,
    measure_codec_profiles,
    measure_disk,
    measure_memory,
    remove_stale_probes,
    synthetic_kv,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ComputeProfile:
    """Time of one layer of the fused loop as a line in its active rows, at a context of `num_tokens`."""

    num_tokens: int
    layer_fixed_s: float  # per layer, whatever the rows (cached-KV placement, RoPE, launch overheads)
    layer_per_row_s: float  # per active row per layer (projections, attention over the context, MLP)
    full_prefill_s: float  # a full prefill of num_tokens tokens, for reference

    def layer_time(self, num_rows: int, num_tokens: int | None = None) -> float:
        """Estimated seconds for one layer computing `num_rows` rows (attention scaled to the context)."""
        scale = 1.0 if not num_tokens else (0.5 + 0.5 * num_tokens / self.num_tokens)  # ~half the row cost is attention
        return self.layer_fixed_s + self.layer_per_row_s * num_rows * scale


def measure_compute(engine, num_tokens: int = 2048, ratios: tuple[float, float] = (0.05, 0.4)) -> ComputeProfile:
    """Fit the per-layer time of the fused loop on synthetic chunks (a throwaway engine of the same class on
    the same model, with a memory store)."""
    probe = type(engine)(engine.model, engine.tokenizer, kv_store=None, lead_in=engine.lead_in,
                             template=engine.template)
    gen = torch.Generator().manual_seed(0)
    vocab = min(len(engine.tokenizer), engine.model.config.vocab_size)
    chunk_len = 256
    texts = [engine.tokenizer.decode(torch.randint(100, vocab, (chunk_len,), generator=gen).tolist())
             for _ in range(max(1, num_tokens // chunk_len))]
    ids = probe.ingest(texts, show_progress=False)
    question = "What is this about?"
    probe.prefill(ids, question, recompute_ratio=ratios[0])  # warm up
    full = probe.prefill(ids, question, method="full_prefill")
    points = []
    for r in ratios:
        pre = probe.prefill(ids, question, recompute_ratio=r)
        rows = sum(pre.stats["rows_per_layer"]) / len(pre.stats["rows_per_layer"])
        points.append((rows, pre.stats["timing"]["layers_s"] / engine.adapter.num_layers))
    (x0, y0), (x1, y1) = points
    per_row = max((y1 - y0) / (x1 - x0), 1e-9)
    return ComputeProfile(full.stats["num_tokens"], max(y0 - per_row * x0, 0.0), per_row, full.stats["ttft_s"])


def profile_path(engine, home: str | os.PathLike[str] | None = None) -> Path:
    """Where the profiles of this model, device and dtype are cached."""
    a = engine.adapter
    dtype = str(a.dtype).removeprefix("torch.")
    return settings.home_dir(home) / "profiles" / f"{engine.fingerprint}-{a.device.type}-{dtype}.json"


def _read_cached(path: Path) -> tuple[ComputeProfile, dict[str, TierProfile]] | None:
    """The profiles cached at `path`; None (and a warning) when the file is damaged."""
    try:
        data = json.loads(path.read_text())
        return ComputeProfile(**data["compute"]), {k: TierProfile(**v) for k, v in data["tiers"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning("the cached profile %s is unreadable (%s); measuring again", path, e)
        return None


def _write_cached(path: Path, compute: ComputeProfile, tiers: dict[str, TierProfile]) -> None:
    """Write the profiles atomically (a temporary file renamed over); never leaves a partial file."""
    data = json.dumps({"compute": asdict(compute), "tiers": {k: asdict(v) for k, v in tiers.items()}}, indent=1)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ProfileError(f"cannot cache the profile in {path}: {e}") from e


def load_or_measure(engine, disk_root: str | Path | None = None, *, remeasure: bool = False,
                    home: str | os.PathLike[str] | None = None,
                    strict: bool = False) -> tuple[ComputeProfile, dict[str, TierProfile]]:
    """The cached profiles, measured first if missing, damaged, or if `remeasure`.

    A storage tier that cannot be measured (a full disk, say) raises ProfileError when `strict` (the `profile`
    command); otherwise it logs a warning and takes a conservative default (a slow tier: "auto" recomputes more),
    and nothing is cached, so the next process measures again. A request never fails over its profile.
    """
    path = profile_path(engine, home)
    if path.is_file() and not remeasure:
        cached = _read_cached(path)
        if cached is not None:
            return cached
    logger.info("measuring compute and storage profiles (once; cached in %s)", path)
    tiers: dict[str, TierProfile] = {}
    fell_back = False
    measures = (("disk", lambda: measure_disk(disk_root or settings.kv_dir(home)), CONSERVATIVE_DISK),
                ("memory", lambda: measure_memory(engine.adapter.device, engine.adapter.dtype), CONSERVATIVE_MEMORY))
    for name, measure, default in measures:  # the disk first: the likeliest to fail, and the cheapest
        try:
            tiers[name] = measure()
        except (ProfileError, RuntimeError, OSError) as e:
            if strict and isinstance(e, ProfileError):
                raise
            if strict:
                raise ProfileError(f"cannot measure the {name} tier: {e}") from e
            logger.warning("%s; assuming %.2f GB/s for the %s tier (not cached)", e, default.read_bytes_per_s / 1e9,
                           name)
            tiers[name], fell_back = default, True
    compute = measure_compute(engine)
    tiers = {"memory": tiers["memory"], "disk": tiers["disk"]}
    if not fell_back:
        try:
            _write_cached(path, compute, tiers)
        except ProfileError as e:
            if strict:
                raise
            logger.warning("%s; it will be measured again next time", e)
    return compute, tiers

"""The loading controller (CacheBlend §5.1): pick a recompute ratio whose recompute hides the KV loading, and
per tier the KV codec (or recompute) with the lowest fetch time (CacheGen's bandwidth adaptation)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .profile import CodecProfile, ComputeProfile, TierProfile

logger = logging.getLogger(__name__)

RECOMPUTE = "recompute"


@dataclass(frozen=True)
class CodecChoice:
    """The codec a tier should store (or "recompute": fetching any is slower than computing) and the estimates:
    seconds per fp16-equivalent MB of KV for every candidate."""

    codec: str
    seconds_per_mb: dict[str, float]

    def as_dict(self) -> dict:
        """For stats and reports."""
        return {"codec": self.codec, "seconds_per_mb": dict(self.seconds_per_mb)}


def choose_codec(tier: TierProfile, codecs: dict[str, CodecProfile], *, allowed: tuple[str, ...] | None = None,
                 recompute_s_per_mb: float | None = None) -> CodecChoice:
    """The allowed codec (the quality floor: by default every one in `codecs`) with the lowest fetch time (read +
    decode) from `tier`; RECOMPUTE when `recompute_s_per_mb` (computing the same KV) beats them all."""
    names = [n for n in codecs if allowed is None or n in allowed]
    if not names:
        raise ConfigError(f"no codec is allowed: allowed={allowed}, measured={sorted(codecs)}")
    per_mb = {n: codecs[n].fetch_time(1e6, tier) for n in names}
    best = min(names, key=per_mb.__getitem__)
    if recompute_s_per_mb is not None:
        per_mb[RECOMPUTE] = recompute_s_per_mb
        if recompute_s_per_mb < per_mb[best]:
            best = RECOMPUTE
    return CodecChoice(best, per_mb)


@functools.lru_cache(maxsize=None)
def _probe_codecs() -> dict[str, CodecProfile]:
    from .profile import measure_codecs

    return measure_codecs()


def auto_codec(tier: str, root: str | Path | None = None) -> str:
    """The codec for a "?codec=auto" tier of open_store: measures the tier (memory copy, or a cold read under
    `root` for disk) and the codecs' decode speed once per process, and returns choose_codec's pick."""
    from .profile import CONSERVATIVE_DISK, CONSERVATIVE_MEMORY, measure_disk, measure_memory
    from ..errors import ProfileError

    import torch

    try:
        if tier == "disk" and root is not None:
            profile = measure_disk(root, 16 * 1024**2, reserve_bytes=64 * 1024**2)
        else:
            profile = measure_memory(torch.device("cpu"), torch.float32, 16 * 1024**2)
    except (ProfileError, OSError, RuntimeError) as e:
        profile = CONSERVATIVE_DISK if tier == "disk" else CONSERVATIVE_MEMORY
        logger.warning("cannot measure the %s tier (%s); assuming %.2f GB/s", tier, e, profile.read_bytes_per_s / 1e9)
    choice = choose_codec(profile, _probe_codecs())
    logger.info("the %s tier codes KV with %s (estimated s per fp16 MB: %s)", tier, choice.codec,
                {k: round(v, 5) for k, v in choice.seconds_per_mb.items()})
    return choice.codec


@dataclass(frozen=True)
class RatioDecision:
    """What the controller chose and the estimates behind it."""

    recompute_ratio: float
    balanced_ratio: float  # the ratio whose recompute time equals the load time of a layer
    est_layer_load_s: float
    est_layer_recompute_s: float
    quality_floor: float

    def as_dict(self) -> dict:
        """For request stats."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class LoadingController:
    """Chooses recompute ratios from measured profiles."""

    compute: ComputeProfile
    tiers: dict[str, TierProfile]
    quality_floor: float = 0.15  # r*: never recompute less than this (quality)

    def __post_init__(self) -> None:
        if not 0.0 <= self.quality_floor <= 1.0:
            raise ConfigError(f"quality_floor must be within [0, 1], got {self.quality_floor}")

    def recompute_s_per_mb(self, fp16_bytes_per_token_layer: int) -> float:
        """Seconds to recompute one fp16-equivalent MB of KV (rows of the fused loop), from the compute profile."""
        return self.compute.layer_per_row_s * 1e6 / fp16_bytes_per_token_layer

    def choose_codec(self, tier: str, codecs: dict[str, CodecProfile], fp16_bytes_per_token_layer: int, *,
                     allowed: tuple[str, ...] | None = None) -> CodecChoice:
        """choose_codec for one of this controller's tiers, with recomputing as a candidate."""
        if tier not in self.tiers:
            raise ConfigError(f"no profile for tier {tier!r}; measured: {sorted(self.tiers)}")
        return choose_codec(self.tiers[tier], codecs, allowed=allowed,
                            recompute_s_per_mb=self.recompute_s_per_mb(fp16_bytes_per_token_layer))

    def layer_load_time(self, bytes_per_layer_by_tier: dict[str, int]) -> float:
        """Seconds to read one layer of every placed chunk, summed over the tiers they live in."""
        return sum(self.tiers[t].load_time(b) for t, b in bytes_per_layer_by_tier.items() if b)

    def choose_ratio(self, num_reused: int, num_uncached: int, num_tokens: int,
                     bytes_per_layer_by_tier: dict[str, int]) -> RatioDecision:
        """The ratio at which a layer's recompute takes as long as the next layer's load, floored at r*."""
        load = self.layer_load_time(bytes_per_layer_by_tier)
        c = self.compute
        scale = 0.5 + 0.5 * num_tokens / c.num_tokens
        per_row = c.layer_per_row_s * scale
        if num_reused == 0:
            balanced = 0.0
        else:
            balanced = (load - c.layer_fixed_s - per_row * num_uncached) / (per_row * num_reused)
        balanced = min(max(balanced, 0.0), 1.0)
        ratio = max(self.quality_floor, balanced)
        recompute = c.layer_time(num_uncached + round(ratio * num_reused), num_tokens)
        return RatioDecision(ratio, balanced, load, recompute, self.quality_floor)

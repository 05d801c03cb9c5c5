"""The loading controller (CacheBlend §5.1): pick a recompute ratio whose recompute hides the KV loading, and
per tier the KV codec (or recompute) with the lowest fetch time (CacheGen's bandwidth adaptation)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..store.probe import RECOMPUTE, CodecChoice, auto_codec, choose_codec  # noqa: F401  (re-exported)
from .profile import CodecProfile, ComputeProfile, TierProfile

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
    quality_floor: float = 0.15  # r*: never recompute less than this (quality); the engine's option, checked there

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

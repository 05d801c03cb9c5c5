"""The range checks the policies share, in one neutral module (no policy imports another): a policy checks its own
options in its constructor with these, and nothing outside the policies checks them again."""

from __future__ import annotations

import math

from ...errors import ConfigError


def check_ratio(value: object, name: str = "recompute_ratio") -> float:
    """A share within [0, 1] (not a bool, not nan), or a ConfigError that says so."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not 0 <= value <= 1:
        raise ConfigError(f"{name} must be a number within [0, 1], got {value!r}")
    return float(value)


def check_guard_options(threshold: object, escalate_to: object, recompute_ratio: float | None = None) -> None:
    """A guard threshold ≥ 0 (or None) and an escalation ratio within [recompute_ratio, 1] (or None), else
    ConfigError (the quality guard's options, `fuse/guard.py`, of the policies that take one)."""
    for name, value in (("guard", threshold), ("guard_ratio", escalate_to)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
            raise ConfigError(f"{name} must be a number ≥ 0 (or None for no guard), got {value!r}")
    if escalate_to is None:
        return
    if threshold is None:
        raise ConfigError("guard_ratio is the ratio a flagged request escalates to; set the guard threshold too "
                          "(e.g. guard=0.05, guard_ratio=0.5)")
    check_ratio(escalate_to, "guard_ratio")
    if recompute_ratio is not None and escalate_to < recompute_ratio:
        raise ConfigError(f"guard_ratio ({escalate_to}) is below recompute_ratio ({recompute_ratio}): escalating "
                          "must recompute more, not less")

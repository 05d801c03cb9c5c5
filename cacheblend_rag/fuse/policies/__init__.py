"""The registry of token-selection policies: method name → policy class. Engine, CLI and bench all read it.

To add a policy: write `fuse/policies/<name>.py` (a frozen dataclass subclassing `fuse.policy.Policy`, with
`name`, `place` and `start`, and `chunk_state` if it keeps state per chunk across requests) and add one line to
`POLICIES` below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ...errors import ConfigError
from ..policy import Policy
from .cacheblend import CacheBlend, HKVDSelection
from .cachecraft import CacheCraft
from .checks import check_ratio
from .full_prefill import FullPrefill
from .full_reuse import FullReuse
from .prefix_cache import PrefixCache
from .relevance import Relevance

POLICIES: dict[str, type] = {
    FullPrefill.name: FullPrefill,
    PrefixCache.name: PrefixCache,
    FullReuse.name: FullReuse,
    CacheBlend.name: CacheBlend,
    CacheCraft.name: CacheCraft,
    Relevance.name: Relevance,
}
METHODS: tuple[str, ...] = tuple(POLICIES)  # the built-in methods; POLICIES also holds registered ones

VARIANT_POLICIES: dict[str, Callable[[], Policy]] = {
    "neighbors": CacheCraft.neighbor_variants,
}
"""What `engine.ingest(variants=kind)` can precompute: kind → the policy a request runs to keep each chunk as
computed after its nearest neighbours (in that policy's own per-chunk state, `Policy.chunk_state`); the request's
`Prefill.kept` counts what it kept."""

DEFAULT_METHOD: str = Relevance.name
"""The method every surface uses when a call names none, defined here alone. Query relevance, not CacheBlend's
deviation ranking: at the same 15 % it keeps the answers on look-alike pages and after an agent's tool, and is
closer to full prefill on distinct documents (docs/benchmarks.md, "Which method for my documents")."""

__all__ = ["DEFAULT_METHOD", "METHODS", "POLICIES", "VARIANT_POLICIES", "CacheBlend", "CacheCraft", "FullPrefill",
           "FullReuse", "HKVDSelection", "Policy", "PrefixCache", "Relevance", "all_option_names", "call_options",
           "check_not_options", "check_ratio", "make_policy", "option_names", "register_policy", "takes_ratio"]


def register_policy(policy_cls: type) -> type:
    """Add a policy class (a frozen dataclass subclassing `fuse.policy.Policy`, with `name`, `place`, `start`) to
    the registry: the engine, the CLI,
    the server and both integrations then take its name as `method` and its fields as options. Usable as a
    class decorator."""
    name = vars(policy_cls).get("name")  # its own name, not one it inherits
    if not isinstance(name, str) or not name or not dataclasses.is_dataclass(policy_cls):
        raise ConfigError(f"a policy is a dataclass with a `name`, got {policy_cls!r}")
    if name in POLICIES and POLICIES[name] is not policy_cls:
        raise ConfigError(f"a policy named {name!r} is already registered ({POLICIES[name].__name__})")
    if not issubclass(policy_cls, Policy):
        raise ConfigError(f"{policy_cls.__name__} must subclass cacheblend_rag.fuse.policy.Policy "
                          "(it declares what the prefill asks of a policy, with defaults)")
    POLICIES[name] = policy_cls
    return policy_cls


def option_names(policy_cls: type) -> tuple[str, ...]:
    """The hyper-parameters a policy class takes."""
    return tuple(f.name for f in dataclasses.fields(policy_cls) if f.init)


def all_option_names() -> set[str]:
    """Every option of every registered policy: a surface accepts these per call, the method checks its own."""
    return {name for cls in POLICIES.values() for name in option_names(cls)}


def check_not_options(owner: str, given: Mapping[str, Any], fields: Iterable[str]) -> None:
    """A surface's constructor arguments that are no field of it but a method's option (`lookalike=0`): a
    ConfigError saying they go in `policy_options`."""
    known = set(fields)
    misplaced = sorted(k for k in given if k not in known and k in all_option_names())
    if misplaced:
        options = ", ".join(f"{k!r}: {given[k]!r}" for k in misplaced)
        raise ConfigError(f"{', '.join(misplaced)} is a method's option, not a field of {owner}: pass "
                          f"policy_options={{{options}}}")


def call_options(method: str, default_method: str, default_options: Mapping[str, Any],
                 call: Mapping[str, Any]) -> dict[str, Any]:
    """One call's policy options, for a surface with defaults (an LLM object): its own options where the call keeps
    its method, under the call's (`recompute_ratio` aside: every surface passes it on its own)."""
    options = dict(default_options) if method == default_method else {}
    options.update((k, v) for k, v in call.items() if k in all_option_names() and k != "recompute_ratio")
    return options


def takes_ratio(policy: object) -> bool:
    """Whether a policy (class or instance) has a `recompute_ratio` (and so accepts `"auto"`)."""
    cls = policy if isinstance(policy, type) else type(policy)
    return "recompute_ratio" in option_names(cls)


def make_policy(method: "str | Policy", recompute_ratio: float | None = None, **options) -> Policy:
    """The policy for a method name (or a policy object, returned as is), with its options checked by name."""
    if not isinstance(method, str):
        if not isinstance(method, Policy):
            raise ConfigError(f"method must be one of {', '.join(POLICIES)} or a policy object, got {method!r}")
        if recompute_ratio is not None or options:
            raise ConfigError("pass options to the policy object itself, not beside it")
        return method
    cls = POLICIES.get(method)
    if cls is None:
        raise ConfigError(f"unknown method {method!r}; use one of {', '.join(POLICIES)}")
    if recompute_ratio is not None:
        if takes_ratio(cls):
            options["recompute_ratio"] = recompute_ratio  # checked by the policy's own constructor
        else:
            check_ratio(recompute_ratio)  # a method with no use for it still refuses a ratio out of range
    unknown = sorted(set(options) - set(option_names(cls)))
    if unknown:
        known = ", ".join(option_names(cls)) or "none"
        raise ConfigError(f"method {method!r} has no option {', '.join(map(repr, unknown))}; its options: {known}")
    return cls(**options)

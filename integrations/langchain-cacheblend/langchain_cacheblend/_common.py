"""What the LangChain LLM and chat model share: per-call settings, stats, the lazily built engine."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.fuse.policies import METHODS

STATS_KEYS = ("method", "chunk_hits", "chunk_misses", "num_tokens", "num_reused", "num_recomputed",
              "recompute_ratio_effective", "ttft_s", "num_generated", "recompute_ratio")
"""Keys of the engine's stats copied into LangChain metadata."""

CALL_SETTINGS = ("method", "recompute_ratio", "max_tokens", "max_new_tokens", "temperature", "top_p", "seed")
"""Keyword arguments every call accepts (besides `stop`)."""


def check_call_kwargs(owner: str, kwargs: dict[str, Any], extra: Iterable[str] = ()) -> None:
    """Reject keyword arguments the model would otherwise silently ignore."""
    allowed = set(CALL_SETTINGS) | set(extra)
    unknown = sorted(k for k in kwargs if k not in allowed)
    if unknown:
        raise ConfigError(
            f"{owner} got unknown keyword argument(s) {', '.join(unknown)}; accepted per call: "
            f"{', '.join(sorted(allowed))} and stop"
        )
    if "max_tokens" in kwargs and "max_new_tokens" in kwargs and kwargs["max_tokens"] != kwargs["max_new_tokens"]:
        raise ConfigError("pass max_tokens or max_new_tokens (the same setting), not two different values")


def call_settings(defaults: Any, max_tokens: int, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Engine keyword arguments for one call: the call's kwargs over the model's fields."""
    method = kwargs.get("method", defaults.method)
    if method not in METHODS:
        raise ConfigError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    ratio = kwargs.get("recompute_ratio", defaults.recompute_ratio)
    if ratio != "auto" and not 0.0 <= float(ratio) <= 1.0:
        raise ConfigError(f"recompute_ratio must be within [0, 1] or 'auto', got {ratio!r}")
    new_tokens = kwargs.get("max_tokens", kwargs.get("max_new_tokens", max_tokens))
    if not isinstance(new_tokens, int) or new_tokens < 1:
        raise ConfigError(f"max_tokens must be a positive int, got {new_tokens!r}")
    return dict(
        method=method,
        recompute_ratio=ratio,
        max_new_tokens=new_tokens,
        temperature=float(kwargs.get("temperature", defaults.temperature) or 0.0),
        top_p=kwargs.get("top_p", defaults.top_p),
        seed=kwargs.get("seed", defaults.seed),
        stop=stop if stop is not None else defaults.stop,
    )


def stats_info(stats: dict) -> dict[str, Any]:
    """The package's stats of one request, as put in LangChain metadata."""
    info = {k: stats[k] for k in STATS_KEYS if k in stats}
    info["recomputed_share"] = stats.get("recompute_ratio_effective", 0.0)
    hits = list(stats.get("chunk_hits", ()))
    ids = hits + [cid for cid in stats.get("chunk_misses", ()) if cid not in hits]
    info["chunk_ids"] = ids
    info["per_chunk"] = {cid: ("hit" if cid in hits else "miss") for cid in ids}
    return info


def usage(stats: dict) -> dict[str, Any]:
    """LangChain `UsageMetadata` from the stats: prompt tokens, generated tokens, tokens read from the KV cache."""
    num_in = int(stats.get("num_tokens", 0))
    num_out = int(stats.get("num_generated", 0))
    return {"input_tokens": num_in, "output_tokens": num_out, "total_tokens": num_in + num_out,
            "input_token_details": {"cache_read": int(stats.get("num_reused", 0))}}


def expand_path(path: str | os.PathLike[str] | None) -> str | None:
    """A user path with `~` expanded (None stays None: an in-memory store)."""
    return None if path is None else os.path.expanduser(os.fspath(path))


def close_stream(pieces: Any) -> None:
    """End an engine stream the consumer stopped reading (its decoding worker stops with it)."""
    close = getattr(pieces, "close", None)
    if close is not None:
        close()

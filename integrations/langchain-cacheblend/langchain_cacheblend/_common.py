"""What the LangChain LLM and chat model share: their engine fields, per-call settings, stats."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any

from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.fuse.policies import all_option_names, check_not_options
from cacheblend_rag.models.loader import DEFAULT_MODEL
from cacheblend_rag.request import DEFAULT_METHOD, call_keywords, default_policy
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from typing_extensions import Self

from . import callbacks  # noqa: F401 (registers the run-wide RetrievedPassages hook that learn_retrieved reads)


CALL_SETTINGS = ("method", "recompute_ratio", "max_tokens", "max_new_tokens", "temperature", "top_p", "seed")
"""Keyword arguments every call accepts (besides `stop`)."""


def check_call_kwargs(owner: str, kwargs: dict[str, Any], extra: Iterable[str] = ()) -> None:
    """Reject keyword arguments the model would otherwise silently ignore."""
    allowed = set(CALL_SETTINGS) | set(extra) | all_option_names()
    unknown = sorted(k for k in kwargs if k not in allowed)
    if unknown:
        raise ConfigError(
            f"{owner} got unknown keyword argument(s) {', '.join(unknown)}; accepted per call: "
            f"{', '.join(sorted(allowed))} and stop"
        )
    if "max_tokens" in kwargs and "max_new_tokens" in kwargs and kwargs["max_tokens"] != kwargs["max_new_tokens"]:
        raise ConfigError("pass max_tokens or max_new_tokens (the same setting), not two different values")


def call_settings(defaults: Any, max_tokens: int, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`Request.of` keywords for one call: the call's kwargs over the model's fields (checked by `Request.of`)."""
    temperature = kwargs.get("temperature", defaults.temperature)
    return call_keywords(
        kwargs, method=defaults.method, recompute_ratio=defaults.recompute_ratio,
        policy_options=defaults.policy_options, max_new_tokens=max_tokens,
        temperature=0.0 if temperature is None else temperature,  # checked by Request.of, as every other one
        top_p=kwargs.get("top_p", defaults.top_p),
        seed=kwargs.get("seed", defaults.seed),
        stop=stop if stop is not None else defaults.stop,
    )


def usage(stats: dict) -> dict[str, Any]:
    """LangChain `UsageMetadata` from the stats: prompt tokens, generated tokens, tokens read from the KV cache
    (reused chunk rows and exact ones: a stored prefix, the lead-in, as the server's `cached_tokens` counts)."""
    num_in = int(stats.get("num_tokens", 0))
    num_out = int(stats.get("num_generated", 0))
    return {"input_tokens": num_in, "output_tokens": num_out, "total_tokens": num_in + num_out,
            "input_token_details": {"cache_read": int(stats.get("num_reused", 0))
                                    + int(stats.get("num_exact_cached", 0))}}


def expand_path(path: str | os.PathLike[str] | None) -> str | None:
    """A user path with `~` expanded (None stays None: an in-memory store)."""
    return None if path is None else os.path.expanduser(os.fspath(path))


def close_stream(pieces: Any) -> None:
    """End an engine stream the consumer stopped reading (its decoding worker stops with it)."""
    close = getattr(pieces, "close", None)
    if close is not None:
        close()


class EngineFields(BaseModel):
    """The fields, the lazily built engine and the tokenizer that `ChatCacheBlend` and `CacheBlendLLM` share.

    A mixin placed before the LangChain base class; each subclass adds its own token budget field
    (`max_tokens` / `max_new_tokens`, aliases of each other).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, use_attribute_docstrings=True, extra="forbid")

    engine: Any = Field(default=None, exclude=True)
    """A ready `CacheBlendEngine`; when None one is built on first use from `model`, `kv_store` and `home`."""
    model: str = DEFAULT_MODEL
    """Packaged model alias, local model folder or Hugging Face hub id (`org/name`, read from the HF cache as
    transformers reads it); with `engine`, the engine's own model name replaces it."""
    revision: str | None = None
    """Branch, tag or commit of a hub id for a lazily built engine (None: main)."""
    trust_remote_code: bool = False
    """Let a lazily built engine run a hub repo's own modelling code (off: it is code from the repo's authors)."""
    kv_store: str | None = None
    """KV store folder for a lazily built engine (None: in memory; `~` is expanded)."""
    home: str | None = None
    """Package home for a lazily built engine (converted models); None: $CACHEBLEND_RAG_HOME or the default."""
    device: str = "auto"
    """Device of a lazily built engine."""
    dtype: str = "auto"
    """Dtype of a lazily built engine."""
    method: str = DEFAULT_METHOD
    """Prefill method, any of the policy registry's (`cacheblend_rag.fuse.policies.POLICIES`): relevance (the
    default), cacheblend, cachecraft, full_reuse, prefix_cache, full_prefill."""
    recompute_ratio: float | None = None
    """Share of reused chunk tokens recomputed (methods that take a ratio); None: the model's calibrated ratio (the
    fidelity gate, `cacheblend-rag calibrate`), else the method's default (0.15)."""
    policy_options: dict[str, Any] = Field(default_factory=dict)
    """The method's own options, for any policy of the registry (`cacheblend_rag.fuse.policies.POLICIES`): e.g.
    {"check_layers": (1, 2), "guard": 0.1} for cacheblend, {"alpha": 0.5} for cachecraft; checked by the policy."""
    learn_retrieved: bool = True
    """Ingest, after the answer (on a background thread), the passages a retriever in the same chain returned
    that the prompt carries: the next run that retrieves them reuses their KV, with no warm step."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (with temperature > 0)."""
    seed: int | None = None
    """Sampling seed."""
    stop: list[str] | None = None
    """Stop strings used when a call passes none (generation ends before the first one)."""

    _build_lock: Any = PrivateAttr(default_factory=threading.Lock)

    @field_validator("engine")
    @classmethod
    def _check_engine(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, CacheBlendEngine):  # TypeError: pydantic passes it on as is
            raise TypeError(f"engine must be a CacheBlendEngine (or None to build one from `model`), got "
                            f"{type(value).__name__}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _point_policy_options(cls, data: Any) -> Any:
        """A policy's option passed as a field (`lookalike=0`) is named with where it goes, not as an extra input."""
        if isinstance(data, dict):
            check_not_options(cls.__name__, data, cls.model_fields)
        return data

    @model_validator(mode="after")
    def _check_policy(self) -> Self:
        default_policy(self.method, self.recompute_ratio, self.policy_options)
        return self

    @model_validator(mode="after")
    def _name_from_engine(self) -> Self:
        if self.engine is not None:
            self.model = self.engine.model_name  # what the engine really holds, never a default alias
        self.kv_store = expand_path(self.kv_store)
        return self

    @classmethod
    def from_model_id(cls, model: str = DEFAULT_MODEL, kv_store: str | None = None, **kwargs: Any) -> Self:
        """Load the model now (instead of on first use) and wrap it."""
        wrapper = cls(model=model, kv_store=kv_store, **kwargs)
        wrapper.get_engine()
        return wrapper

    def get_engine(self) -> CacheBlendEngine:
        """The engine, built on first use when none was given."""
        if self.engine is None:
            with self._build_lock:
                if self.engine is None:
                    self.engine = CacheBlendEngine.from_pretrained(
                        self.model, kv_store=self.kv_store, device=self.device, dtype=self.dtype, home=self.home,
                        revision=self.revision, trust_remote_code=self.trust_remote_code,
                    )
        return self.engine

    @property
    def model_name(self) -> str:
        """The engine's model name (the `model` field until a lazily built engine exists)."""
        return self.engine.model_name if self.engine is not None else self.model

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids from the model's own tokenizer (the default would fetch GPT-2 from a hub)."""
        return self.get_engine().tokenizer(text, add_special_tokens=False)["input_ids"]

    def _identifying_fields(self) -> dict[str, Any]:
        """What identifies a generation's settings (an LLM cache key), besides the token budget."""
        return {"model_name": self.get_engine().model_name, "method": self.method,
                "recompute_ratio": self.recompute_ratio, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed}


def learn_retrieved(model: EngineFields, run_manager: Any, prompt_text: str) -> None:
    """Queue for ingest the passages retrievers of this run's chain returned that `prompt_text` carries: what the
    `RetrievedPassages` handlers on the run's callback manager recorded for its run tree."""
    if not model.learn_retrieved or run_manager is None:
        return
    from .callbacks import RetrievedPassages

    recorders = [h for h in run_manager.handlers if isinstance(h, RetrievedPassages)]
    seen = list(dict.fromkeys(t for h in recorders for t in h.texts_for(run_manager.run_id) if t in prompt_text))
    if seen:
        model.get_engine().learn(seen)

"""Decoding after a fused prefill: HF generate over a cache built from the fused KV."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, StoppingCriteria, StoppingCriteriaList

from ..errors import ConfigError
from .grammar import Grammar

ALIASES = {"max_tokens": "max_new_tokens"}  # the OpenAI / LangChain name for the same setting


def _number(name: str, value: Any, *, integer: bool = False) -> None:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (not integer and isinstance(value, float) and math.isnan(value)):
        raise ConfigError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")


def _finite_float(name: str, value: Any) -> float:
    """`value` (a number, checked by `_number`) as a finite float: an int past float64 or torch's int64 scalars
    (2**64) overflowed where the logits were divided by it (make fuzz, #53)."""
    _number(name, value)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        got = repr(value) if isinstance(value, float) else f"an integer of {value.bit_length()} bits"
        raise ConfigError(f"{name} must be a finite number, got {got}")
    return number


SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
# a temperature at or below this decodes greedily: float32 logits divided by it overflow to inf (9.9e-201 is 0 in
# float32), their softmax is nan, and sampling from it raised RuntimeError (#53); the choice is the argmax anyway
GREEDY_TEMPERATURE = 1e-30


@dataclass(frozen=True)
class SamplingOptions:
    """How to decode, for `generate` and `stream` alike; temperature 0 means greedy.

    `stop` may be one string or several; empty stop strings are ignored (they would stop at once). `grammar`
    constrains the text (a `Grammar`, or a JSON schema dict): each step's logits are masked to the tokens it
    allows, before the greedy or sampled choice; needs the engine's default decoder ("kv").
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "grammar", Grammar.coerce(self.grammar))
        _number("max_new_tokens", self.max_new_tokens, integer=True)
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        object.__setattr__(self, "temperature", _finite_float("temperature", self.temperature))
        if self.temperature < 0:
            raise ConfigError(f"temperature must be ≥ 0, got {self.temperature}")
        object.__setattr__(self, "top_p", _finite_float("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be within (0, 1], got {self.top_p}")
        if self.seed is not None:
            _number("seed", self.seed, integer=True)
            if not SEED_MIN <= self.seed <= SEED_MAX:  # torch's generators take a 64-bit seed, else ValueError
                raise ConfigError(f"seed must be within [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):  # one stop string, never its characters
            stop = (stop,)
        elif not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
            raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}")
        object.__setattr__(self, "stop", tuple(s for s in stop if s))

    @property
    def samples(self) -> bool:
        """Whether tokens are sampled (a temperature above GREEDY_TEMPERATURE), else the argmax."""
        return self.temperature > GREEDY_TEMPERATURE

    @classmethod
    def split(cls, options: dict[str, Any], base: "SamplingOptions | None" = None
              ) -> tuple["SamplingOptions", dict[str, Any]]:
        """(sampling options, the rest) from keyword arguments; `max_tokens` is read as `max_new_tokens`."""
        if base is not None and not isinstance(base, SamplingOptions):
            raise ConfigError(f"sampling must be SamplingOptions (or None), got {type(base).__name__}")
        names = {f.name for f in fields(cls)}
        ours: dict[str, Any] = {}
        rest: dict[str, Any] = {}
        for key, value in options.items():
            name = ALIASES.get(key, key)
            if name in names:
                if name in ours:
                    raise ConfigError(f"{key!r} and {name!r} name the same setting; pass one")
                ours[name] = value
            else:
                rest[key] = value
        return replace(base or cls(), **ours), rest




class _Cancelled(StoppingCriteria):
    """Stops generation at the next step once `event` is set (the consumer went away)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def build_cache(config, keys: list[torch.Tensor], values: list[torch.Tensor], num_rows: int) -> DynamicCache:
    """A DynamicCache holding the first `num_rows` rows of the fused KV ((N, kv_heads, d) per layer)."""
    cache = DynamicCache(config=config)
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k[:num_rows].transpose(0, 1)[None].contiguous(), v[:num_rows].transpose(0, 1)[None].contiguous(), layer)
    return cache


def generation_config(tokenizer, settings: SamplingOptions) -> GenerationConfig:
    """An explicit GenerationConfig, so the model's own defaults never change our sampling."""
    eos = tokenizer.eos_token_id
    sample = settings.samples
    return GenerationConfig(
        max_new_tokens=settings.max_new_tokens,
        do_sample=sample,
        temperature=settings.temperature if sample else None,
        top_p=settings.top_p if sample else None,
        top_k=None,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
        stop_strings=list(settings.stop) or None,
    )


@torch.inference_mode()
def decode(model, tokenizer, token_ids: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
           settings: SamplingOptions, streamer=None, cancel: threading.Event | None = None) -> torch.Tensor:
    """New token ids after the prompt `token_ids` (N,), whose fused KV is given; stops early once `cancel` is set.

    The cache gets the first N-1 rows; generate recomputes the last prompt token
    (its KV is always fresh in the fused prefill, so its logits are the same).
    """
    if settings.seed is not None:
        torch.manual_seed(settings.seed)
    n = token_ids.shape[0]
    cache = build_cache(model.config, keys, values, n - 1)
    input_ids = token_ids[None].to(model.device)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        past_key_values=cache,
        generation_config=generation_config(tokenizer, settings),
        tokenizer=tokenizer,
        streamer=streamer,
        stopping_criteria=StoppingCriteriaList([_Cancelled(cancel)]) if cancel is not None else None,
    )
    return out[0, n:]


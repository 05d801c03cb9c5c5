"""Decoding after a fused prefill: HF generate over a cache built from the fused KV."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, GenerationConfig

from ..errors import ConfigError


@dataclass(frozen=True)
class SamplingSettings:
    """Decoding settings; temperature 0 means greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be ≥ 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be within (0, 1], got {self.top_p}")


def build_cache(config, keys: list[torch.Tensor], values: list[torch.Tensor], num_rows: int) -> DynamicCache:
    """A DynamicCache holding the first `num_rows` rows of the fused KV ((N, kv_heads, d) per layer)."""
    cache = DynamicCache(config=config)
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k[:num_rows].transpose(0, 1)[None].contiguous(), v[:num_rows].transpose(0, 1)[None].contiguous(), layer)
    return cache


def generation_config(tokenizer, settings: SamplingSettings) -> GenerationConfig:
    """An explicit GenerationConfig, so the model's own defaults never change our sampling."""
    eos = tokenizer.eos_token_id
    sample = settings.temperature > 0
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
           settings: SamplingSettings, streamer=None) -> torch.Tensor:
    """New token ids after the prompt `token_ids` (N,), whose fused KV is given.

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
    )
    return out[0, n:]


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """Text up to the first stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)

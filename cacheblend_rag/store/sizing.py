"""How many bytes a model's chunk KV takes, per token and per chunk, for each codec: from its config alone.

A stored chunk holds, per layer, its keys and values, each (num_tokens, num_kv_heads, head_dim), coded by the
store's codec (store/codecs.py), plus its token ids (int64) and a file header. So, per token:

    fp16       layers × kv_heads × (head_dim + v_head_dim) × 2                       exact
    int8       layers × kv_heads × (head_dim + v_head_dim) × 1 + layers × 2 × kv_heads × 2 (fp16 steps)   exact
    cachegen   fp16 / 5.12, the ratio measured on SmolLM2-135M's real KV                an estimate
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TOKEN_ID_BYTES = 8  # the chunk's token ids, stored as int64 beside its KV
# CacheGen's size depends on the KV's statistics; this is its measured ratio on real SmolLM2-135M KV
# (600-token chunks: 5,322 B/token vs 23,040 B/token fp16 with the default bits since issue 30, store/codecs.py).
CACHEGEN_MEASURED_RATIO = 23040 / 5322
CODEC_NOTES = {
    "fp16": "exact",
    "int8": "exact (per-token fp16 steps)",
    "cachegen": f"estimate: fp16 / {CACHEGEN_MEASURED_RATIO:.2f}, the ratio measured on SmolLM2-135M",
}


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's KV: layers × KV heads × head dims (keys and values)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    @classmethod
    def from_config(cls, config) -> "KVLayout":
        """From a transformers config (a multimodal one's text config), as the model adapter reads it."""
        text = config.get_text_config()
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, kv_heads, head_dim, head_dim)

    def values_per_token(self) -> int:
        """K and V elements of one token over all layers."""
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.v_head_dim)


def kv_bytes_per_token(layout: KVLayout, codec: str) -> float:
    """Bytes of one token's KV as `codec` stores it (cachegen: the estimate in CODEC_NOTES)."""
    fp16 = layout.values_per_token() * 2
    if codec == "fp16":
        return float(fp16)
    if codec == "int8":
        return float(layout.values_per_token() + layout.num_layers * 2 * layout.num_kv_heads * 2)
    if codec == "cachegen":
        return fp16 / CACHEGEN_MEASURED_RATIO
    raise ValueError(f"unknown codec {codec!r}; choose one of {sorted(CODEC_NOTES)}")


def chunk_bytes(layout: KVLayout, codec: str, num_tokens: int) -> float:
    """Bytes of a stored chunk of `num_tokens`: its KV and its token ids (the file header comes on top)."""
    return num_tokens * (kv_bytes_per_token(layout, codec) + TOKEN_ID_BYTES)


def chunks_that_fit(budget_bytes: int, per_chunk_bytes: float) -> int:
    """How many chunks of this size a tier's byte budget holds."""
    return math.floor(budget_bytes / per_chunk_bytes) if per_chunk_bytes > 0 else 0

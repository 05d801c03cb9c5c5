"""The per-layer pieces of a decoder that the fusion loop needs, for the Llama family as transformers builds it.

An adapter never runs a layer loop itself: `fuse.loop` does, calling these pieces.
Every piece calls the HF module itself (norms, projections, MLP, rotary), so the
adapter stays faithful to transformers' numerics and honours `rope_scaling`.
"""

from __future__ import annotations

import logging

import torch

from ..errors import UnsupportedModelError
from ..kernels import apply_rope

logger = logging.getLogger(__name__)


class LlamaFamilyAdapter:
    """Llama-style decoder: pre-norm attention + MLP blocks, RoPE, GQA (Llama, Mistral, Qwen2)."""

    def __init__(self, model) -> None:
        self.model = model
        self.decoder = model.model
        config = model.config
        self.config = config
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.max_positions: int = config.max_position_embeddings
        self._layers = self.decoder.layers
        self._check_structure()

    def _check_structure(self) -> None:
        attn = self._layers[0].self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(attn, name):
                raise UnsupportedModelError(f"{type(self.model).__name__}: attention has no {name}")

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.decoder.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the weights."""
        return self.decoder.embed_tokens.weight.dtype

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(M,) token ids → (M, hidden) embeddings."""
        return self.decoder.embed_tokens(token_ids)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (N, head_dim) for arbitrary positions, from the model's own rotary module."""
        dummy = torch.empty(0, device=positions.device, dtype=self.dtype)
        cos, sin = self.decoder.rotary_emb(dummy, positions[None, :])
        return cos[0], sin[0]

    def project_qkv(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm + projections: q (M, heads, d), k and v (M, kv_heads, d); q and k *before* RoPE."""
        block = self._layers[layer]
        x = block.input_layernorm(hidden)
        attn = block.self_attn
        q = attn.q_proj(x).view(-1, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        return q, k, v

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate (M, heads, d) by per-row cos/sin (M, d)."""
        return apply_rope(x, cos, sin)

    def scaling(self, layer: int) -> float:
        """Softmax scale of the layer's attention."""
        return float(self._layers[layer].self_attn.scaling)

    def sliding_window(self, layer: int) -> int | None:
        """Sliding-window size of the layer's attention, or None for full attention."""
        return getattr(self._layers[layer].self_attn, "sliding_window", None)

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """o_proj + residual, then post-attention norm + MLP + residual; attn_out is (M, heads, d)."""
        block = self._layers[layer]
        hidden = hidden + block.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: (M, hidden) → (M, vocab)."""
        return self.model.lm_head(self.decoder.norm(hidden))


class MistralAdapter(LlamaFamilyAdapter):
    """Mistral: like Llama, with an optional sliding window taken from the config."""

    def sliding_window(self, layer: int) -> int | None:
        """Mistral passes config.sliding_window to every layer."""
        return getattr(self.config, "sliding_window", None)


class Qwen3Adapter(LlamaFamilyAdapter):
    """Qwen3: like Llama, plus RMS norms on q and k per head before RoPE."""

    def project_qkv(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As Llama, then q_norm / k_norm on each head."""
        q, k, v = super().project_qkv(layer, hidden)
        attn = self._layers[layer].self_attn
        return attn.q_norm(q), attn.k_norm(k), v


ADAPTERS: dict[str, type[LlamaFamilyAdapter]] = {
    "llama": LlamaFamilyAdapter,
    "mistral": MistralAdapter,
    "qwen2": LlamaFamilyAdapter,
    "qwen3": Qwen3Adapter,
}


def get_adapter(model) -> LlamaFamilyAdapter:
    """The adapter for a loaded HF causal LM; any unsupported architecture is refused here, not mid-request."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        arch = ", ".join(getattr(config, "architectures", None) or [type(model).__name__])
        raise UnsupportedModelError(
            f"architecture {arch} (model_type={model_type!r}) is not supported; "
            f"supported model types: {', '.join(sorted(ADAPTERS))}"
        )
    if not hasattr(model, "model") or not hasattr(model, "lm_head"):
        raise UnsupportedModelError(f"{type(model).__name__} is not a *ForCausalLM with .model and .lm_head")
    adapter = ADAPTERS[model_type](model)
    logger.debug("adapter %s for %s", type(adapter).__name__, model_type)
    return adapter

"""The per-layer pieces of a decoder that the fusion loop needs, for the Llama family as transformers builds it.

An adapter never runs a layer loop itself: `fuse.loop` does, calling these pieces.
Every piece calls the HF module itself (norms, projections, MLP, rotary), so the
adapter stays faithful to transformers' numerics and honours `rope_scaling`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from ..errors import UnsupportedModelError
from ..kernels import apply_rope
from .packed import PackedLayer, PackedLinear, pack_layers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RopeTables:
    """cos and sin (N, d) of N positions for each RoPE a model's layers use, and which table each layer takes.

    Most families have one table for every layer; Gemma 3's sliding-window and global layers have their own bases.
    """

    tables: dict[str, tuple[torch.Tensor, torch.Tensor]]  # by RoPE kind: (cos, sin)
    kinds: tuple[str, ...]  # per layer, its table's kind

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the layer's RoPE."""
        return self.tables[self.kinds[layer]]

    def rows(self, index: torch.Tensor) -> "RopeTables":
        """The tables at these rows (each table indexed once, however many layers share it)."""
        return RopeTables({kind: (cos[index], sin[index]) for kind, (cos, sin) in self.tables.items()}, self.kinds)

    def inverse(self) -> "RopeTables":
        """Tables whose rotation undoes this one's (sin negated): rotated keys back to pre-RoPE keys."""
        return RopeTables({kind: (cos, -sin) for kind, (cos, sin) in self.tables.items()}, self.kinds)

    @classmethod
    def single(cls, cos: torch.Tensor, sin: torch.Tensor, num_layers: int) -> "RopeTables":
        """One table for every layer."""
        return cls({"all": (cos, sin)}, ("all",) * num_layers)


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
        self._packed: tuple[list[PackedLayer], PackedLinear] | None = None
        self._packing_tried = False
        self._packing_lock = threading.Lock()  # decode may start on a server's worker and a caller at once
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

    def rotary(self, positions: torch.Tensor) -> RopeTables:
        """cos, sin of shape (N, head_dim) for arbitrary positions, from the model's own rotary module."""
        dummy = torch.empty(0, device=positions.device, dtype=self.dtype)
        cos, sin = self.decoder.rotary_emb(dummy, positions[None, :])
        return RopeTables.single(cos[0], sin[0], self.num_layers)

    def packed(self) -> bool:
        """Build (once) the oneDNN-packed weights the decode step's `packed=True` calls use; whether they exist.
        They are copies: weights changed in place afterwards are not seen by the packed calls."""
        if self._packing_tried:
            return self._packed is not None
        with self._packing_lock:
            if not self._packing_tried:
                self._packed = pack_layers(self._layers, self.model.lm_head, self.pack_layer)
                self._packing_tried = True
        return self._packed is not None

    pack_layer = staticmethod(PackedLayer.of_llama)  # how `packed()` packs one decoder block

    def project_qkv(self, layer: int, hidden: torch.Tensor,
                    packed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm + projections: q (M, heads, d), k and v (M, kv_heads, d); q and k *before* RoPE.
        packed: one fused q|k|v matmul over the packed weights (call `packed()` first), for decode steps."""
        block = self._layers[layer]
        x = block.input_layernorm(hidden)
        attn = block.self_attn
        if packed:
            q, k, v = self._packed[0][layer].qkv.split(x)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        return q, k, v

    def rope(self, layer: int, x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        """Rotate (M, heads, d) by the layer's per-row cos/sin (M, d) from `tables` (of the same M rows)."""
        cos, sin = tables.layer(layer)
        return apply_rope(x, cos, sin)

    def scaling(self, layer: int) -> float:
        """Softmax scale of the layer's attention."""
        return float(self._layers[layer].self_attn.scaling)

    def sliding_window(self, layer: int) -> int | None:
        """Sliding-window size of the layer's attention, or None for full attention."""
        return getattr(self._layers[layer].self_attn, "sliding_window", None)

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor,
                     packed: bool = False) -> torch.Tensor:
        """o_proj + residual, then post-attention norm + MLP + residual; attn_out is (M, heads, d).
        packed: the packed o, fused gate|up and down weights, for decode steps."""
        block = self._layers[layer]
        flat = attn_out.reshape(attn_out.shape[0], -1)
        if not packed:
            hidden = hidden + block.self_attn.o_proj(flat)
            return hidden + block.mlp(block.post_attention_layernorm(hidden))
        weights = self._packed[0][layer]
        hidden = hidden + weights.o(flat)
        gate, up = weights.gate_up.split(block.post_attention_layernorm(hidden))
        return hidden + weights.down(block.mlp.act_fn(gate) * up)  # LlamaMLP.forward's formula

    def logits(self, hidden: torch.Tensor, packed: bool = False) -> torch.Tensor:
        """Final norm + LM head: (M, hidden) → (M, vocab); packed: the packed LM head."""
        head = self._packed[1] if packed else self.model.lm_head
        return head(self.decoder.norm(hidden))


class MistralAdapter(LlamaFamilyAdapter):
    """Mistral: like Llama, with an optional sliding window taken from the config."""

    def sliding_window(self, layer: int) -> int | None:
        """Mistral passes config.sliding_window to every layer."""
        return getattr(self.config, "sliding_window", None)


class Qwen3Adapter(LlamaFamilyAdapter):
    """Qwen3: like Llama, plus RMS norms on q and k per head before RoPE."""

    def project_qkv(self, layer: int, hidden: torch.Tensor,
                    packed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As Llama, then q_norm / k_norm on each head."""
        q, k, v = super().project_qkv(layer, hidden, packed)
        attn = self._layers[layer].self_attn
        return attn.q_norm(q), attn.k_norm(k), v


class Phi3Adapter(MistralAdapter):
    """Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj, RoPE on the first `partial_rotary_factor` of each head
    (long RoPE is the HF rotary module's), the config's sliding window on every layer as Mistral."""

    pack_layer = staticmethod(PackedLayer.of_fused)

    def _check_structure(self) -> None:
        block = self._layers[0]
        for module, name in ((block.self_attn, "qkv_proj"), (block.self_attn, "o_proj"),
                             (block.mlp, "gate_up_proj"), (block.mlp, "down_proj")):
            if not hasattr(module, name):
                raise UnsupportedModelError(f"{type(self.model).__name__}: {type(module).__name__} has no {name}")

    def project_qkv(self, layer: int, hidden: torch.Tensor,
                    packed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm, then the one fused projection split into q | k | v (Phi3Attention's order)."""
        block = self._layers[layer]
        x = block.input_layernorm(hidden)
        qkv = self._packed[0][layer].qkv(x) if packed else block.self_attn.qkv_proj(x)
        kv_width = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([self.num_heads * self.head_dim, kv_width, kv_width], dim=-1)
        return (q.reshape(-1, self.num_heads, self.head_dim), k.reshape(-1, self.num_kv_heads, self.head_dim),
                v.reshape(-1, self.num_kv_heads, self.head_dim))

    def rope(self, layer: int, x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        """Rotate the first cos.shape[-1] dims of each head, pass the rest through (partial rotary)."""
        cos, sin = tables.layer(layer)
        rotary_dim = cos.shape[-1]
        if rotary_dim == x.shape[-1]:
            return apply_rope(x, cos, sin)
        return torch.cat([apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor,
                     packed: bool = False) -> torch.Tensor:
        """o_proj + residual, then post-attention norm + the fused gate|up MLP + residual (Phi3MLP's formula)."""
        block = self._layers[layer]
        flat = attn_out.reshape(attn_out.shape[0], -1)
        weights = self._packed[0][layer] if packed else None
        hidden = hidden + (weights.o(flat) if packed else block.self_attn.o_proj(flat))
        x = block.post_attention_layernorm(hidden)
        gate, up = (weights.gate_up(x) if packed else block.mlp.gate_up_proj(x)).chunk(2, dim=-1)
        down = weights.down if packed else block.mlp.down_proj
        return hidden + down(up * block.mlp.activation_fn(gate))


class Gemma3Adapter(Qwen3Adapter):
    """Gemma 3 (text): q/k norms as Qwen3, embeddings scaled by sqrt(hidden) and (1 + w) RMS norms (both the HF
    modules'), a norm after attention and around the MLP, and interleaved sliding-window and global layers with
    their own RoPE bases (`rope_local_base_freq` and `rope_theta`)."""

    def _check_structure(self) -> None:
        super()._check_structure()
        name = type(self.model).__name__
        if self.config.attn_logit_softcapping is not None:
            # the fused attention kernels take plain softmax(q·k·scale); a tanh cap inside it is not theirs
            raise UnsupportedModelError(
                f"{name}: attn_logit_softcapping={self.config.attn_logit_softcapping} is not supported (the fused "
                "attention has no logit soft-capping); use a Gemma 3 checkpoint whose config sets it to null")
        if self.config.use_bidirectional_attention:
            raise UnsupportedModelError(
                f"{name}: use_bidirectional_attention=True (an encoder such as EmbeddingGemma) cannot reuse causal "
                "KV; use a causal Gemma 3 language model")

    def rotary(self, positions: torch.Tensor) -> RopeTables:
        """One cos/sin table per layer type ("sliding_attention", "full_attention"), as Gemma3TextModel builds them."""
        dummy = torch.empty(0, device=positions.device, dtype=self.dtype)
        kinds = tuple(self.config.layer_types[: self.num_layers])
        tables = {}
        for kind in sorted(set(kinds)):
            cos, sin = self.decoder.rotary_emb(dummy, positions[None, :], kind)
            tables[kind] = (cos[0], sin[0])
        return RopeTables(tables, kinds)

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor,
                     packed: bool = False) -> torch.Tensor:
        """o_proj, post-attention norm + residual; pre-feedforward norm, MLP, post-feedforward norm + residual
        (Gemma3DecoderLayer's order)."""
        block = self._layers[layer]
        flat = attn_out.reshape(attn_out.shape[0], -1)
        weights = self._packed[0][layer] if packed else None
        hidden = hidden + block.post_attention_layernorm(weights.o(flat) if packed else block.self_attn.o_proj(flat))
        x = block.pre_feedforward_layernorm(hidden)
        if packed:
            gate, up = weights.gate_up.split(x)
            mlp = weights.down(block.mlp.act_fn(gate) * up)  # Gemma3MLP.forward's formula
        else:
            mlp = block.mlp(x)
        return hidden + block.post_feedforward_layernorm(mlp)

    def logits(self, hidden: torch.Tensor, packed: bool = False) -> torch.Tensor:
        """As Llama, then the final logit soft-capping Gemma3ForCausalLM applies when its config sets one."""
        logits = super().logits(hidden, packed)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


ADAPTERS: dict[str, type[LlamaFamilyAdapter]] = {
    "llama": LlamaFamilyAdapter,
    "mistral": MistralAdapter,
    "qwen2": LlamaFamilyAdapter,
    "qwen3": Qwen3Adapter,
    "phi3": Phi3Adapter,
    "gemma3_text": Gemma3Adapter,  # Gemma3ForCausalLM (text only; the multimodal model's type is "gemma3")
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

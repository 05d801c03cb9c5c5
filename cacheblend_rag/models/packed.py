"""oneDNN-prepacked copies of a decoder's linear weights, for the decode step's few-row matmuls.

A decode step multiplies one row per sequence by every weight matrix: a GEMV that only streams the weight.
`F.linear` reorders (packs) the weight for oneDNN on every call; packing once makes the bf16 layers of
SmolLM2-135M ~2x faster per token on an AVX512-BF16 CPU (29 -> 15 ms on one core) and its LM head ~2.5x.
Projections that read the same input are fused into one matrix (q|k|v, gate|up): fewer, longer GEMVs.
Steps of up to 4 rows go through the C GEMV of cacheblend_rag/kernels/decode_step.c instead where it builds (1.5-2x oneDNN's
packed bf16 GEMV on that CPU), which reads the plain weights; the packed copy (one more copy of the weights) is then
built only if a step has more rows.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from ..kernels.decode_step import linear_rows

logger = logging.getLogger(__name__)


def available(dtype: torch.dtype) -> bool:
    """Whether this torch build has oneDNN's packed linear ops (CPU, fp32 or bf16) and this CPU runs them: oneDNN
    refuses to pack bf16 weights on a CPU without AVX512BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only one)."""
    if not (torch.backends.mkldnn.is_available() and dtype in (torch.float32, torch.bfloat16)
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear:
    """One (out, in) weight, packed for oneDNN, with its bias; called like `F.linear(x, weight, bias)`."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> None:
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        self.splits = [w.shape[0] for w in weights]
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([b if b is not None else weight.new_zeros(w.shape[0])
                                   for w, b in zip(weights, biases)]).contiguous()
        self.plain = weight.detach().contiguous()  # what the C GEMV reads (a module's own weight when not fused)
        self._packed: torch.Tensor | None = None
        self._lock = threading.Lock()

    @property
    def weight(self) -> torch.Tensor:
        """The oneDNN-packed copy, built on first use: only steps the C GEMV does not take (no compiler, > 4 rows)."""
        if self._packed is None:
            with self._lock:
                if self._packed is None:
                    # batch_size=1: the layout oneDNN picks for a single-row input, the decode step's case
                    self._packed = torch.ops.mkldnn._reorder_linear_weight(self.plain, 1)
        return self._packed

    @classmethod
    def of(cls, *modules: torch.nn.Linear) -> "PackedLinear":
        """One packed matrix for `modules` that read the same input (their outputs side by side)."""
        return cls([m.weight for m in modules], [m.bias for m in modules])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, in) → (M, out): the C GEMV for a few rows where it is built, else oneDNN's packed matmul."""
        y = linear_rows(x, self.plain, self.bias)
        if y is not None:
            return y
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (M, in) → one (M, out_i) view per fused weight."""
        return torch.split(self(x), self.splits, dim=-1)


class PackedLayer:
    """A decoder layer's attention and MLP weights, packed: qkv (fused), o, gate_up (fused), down."""

    def __init__(self, qkv: PackedLinear, o: PackedLinear, gate_up: PackedLinear, down: PackedLinear) -> None:
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down

    @classmethod
    def of_llama(cls, block) -> "PackedLayer":
        """Llama-style separate q/k/v and gate/up projections, fused here."""
        attn, mlp = block.self_attn, block.mlp
        return cls(PackedLinear.of(attn.q_proj, attn.k_proj, attn.v_proj), PackedLinear.of(attn.o_proj),
                   PackedLinear.of(mlp.gate_proj, mlp.up_proj), PackedLinear.of(mlp.down_proj))

    @classmethod
    def of_fused(cls, block) -> "PackedLayer":
        """Projections the model already fuses (Phi-3's qkv_proj and gate_up_proj): one matrix each."""
        attn, mlp = block.self_attn, block.mlp
        return cls(PackedLinear.of(attn.qkv_proj), PackedLinear.of(attn.o_proj), PackedLinear.of(mlp.gate_up_proj),
                   PackedLinear.of(mlp.down_proj))


def pack_layers(layers, lm_head, pack_layer: Callable[[object], PackedLayer] = PackedLayer.of_llama,
                ) -> tuple[list[PackedLayer], PackedLinear] | None:
    """Packed copies of every layer (`pack_layer` of each block) and the LM head, or None where oneDNN can't pack
    them (then the HF modules run as they are)."""
    dtype = lm_head.weight.dtype
    if lm_head.weight.device.type != "cpu" or not available(dtype):
        return None
    try:
        packed = [pack_layer(block) for block in layers]
        head = PackedLinear.of(lm_head)
    except (RuntimeError, AttributeError) as exc:  # an unusual module or a build without the op
        logger.info("decode runs without packed weights: %s", exc)
        return None
    return packed, head

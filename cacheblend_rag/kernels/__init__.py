"""Tensor ops of the fusion loop: torch reference implementations (fast variants can sit beside them)."""

from .attention import RowAttentionPlan, causal_attention_rows
from .deviation import kv_deviation
from .rope import apply_rope, apply_rope_reference, rotate_half

__all__ = ["RowAttentionPlan", "apply_rope", "apply_rope_reference", "causal_attention_rows", "kv_deviation", "rotate_half"]

"""How close a fused prefill is to full prefill: the first-token KL every method is judged by (and α calibrated on)."""

from __future__ import annotations

import torch


def first_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference ‖ other) of the next-token distributions."""
    ref = reference_logits.float().log_softmax(-1)
    other = logits.float().log_softmax(-1)
    return float((ref.exp() * (ref - other)).sum())

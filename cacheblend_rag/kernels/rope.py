"""Rotary position embedding: a torch reference op and the op the loop uses."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) → (-x2, x1) on the last dim, the HF/Llama RoPE convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (M, heads, d) at the positions whose cos/sin (M, d) are given: x·cos + rotate_half(x)·sin."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """As apply_rope_reference, on half-width cos/sin and without temporaries for rotate_half.

    HF builds cos/sin as two equal halves, so each half of the output is
    x1·c − x2·s and x2·c + x1·s: a third of the memory traffic of the reference,
    which matters because the loop rotates every cached key of every layer.
    """
    if x.requires_grad and torch.is_grad_enabled():  # `out=` takes no gradient: training links
        return apply_rope_reference(x, cos, sin)
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    torch.mul(x1, c, out=out[..., :half]).addcmul_(x2, s, value=-1)
    torch.mul(x2, c, out=out[..., half:]).addcmul_(x1, s)
    return out

"""Implementations that are one fused ATen call (only where such a call exists)."""

from __future__ import annotations

import torch
from torch.nn import functional

__all__ = ["rmsnorm"]


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` (torch>=2.4; a fused kernel on CUDA)."""
    if weight.dtype != x.dtype:
        # The fused kernel takes one dtype and would return x's; the op's result is promoted
        # like the reference's (bfloat16 x, float32 weight: float32).
        return functional.rms_norm(x, (x.shape[-1],), None, eps) * weight
    return functional.rms_norm(x, (x.shape[-1],), weight, eps)

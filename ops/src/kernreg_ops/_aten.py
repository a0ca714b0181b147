"""Implementations that are one fused ATen call (only where such a call exists)."""

from __future__ import annotations

import torch
from torch.nn import functional

from kernreg_ops._out import write

__all__ = ["layernorm", "rmsnorm"]


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` (torch>=2.4; a fused kernel on CUDA)."""
    if weight.dtype != x.dtype:
        # The fused kernel takes one dtype and would return x's; the op's result is promoted
        # like the reference's (bfloat16 x, float32 weight: float32).
        result = torch.rms_norm(x, (x.shape[-1],), None, eps) * weight
    else:
        result = torch.rms_norm(x, (x.shape[-1],), weight, eps)
    if out is None:  # checking out= is a call with keyword arguments: skipped without one
        return result
    return write(out, result, in_place="x", x=x, weight=weight)


def layernorm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` over the last dimension (what ``nn.LayerNorm`` runs)."""
    params = [t for t in (weight, bias) if t is not None]
    if any(t.dtype != x.dtype for t in params):
        # The fused kernel wants one dtype: compute in the wider one, round to x's once.
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        result = functional.layer_norm(
            x.to(acc),
            (x.shape[-1],),
            None if weight is None else weight.to(acc),
            None if bias is None else bias.to(acc),
            eps,
        ).to(x.dtype)
    else:
        result = functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return write(out, result, in_place="x", x=x, weight=weight, bias=bias)

"""Implementations that are one fused ATen call (only where such a call exists)."""

from __future__ import annotations

import torch
from torch.nn import functional

from kernreg_ops._out import write
from kernreg_ops._shapes import check_vector

__all__ = ["layernorm", "rmsnorm"]


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` (torch>=2.4; a fused kernel on CUDA)."""
    if weight.dtype != x.dtype:
        # The fused kernel takes one dtype and would return x's; the op's result is promoted
        # like the reference's (bfloat16 x, float32 weight: float32).
        check_vector("weight", weight, x.shape[-1])  # the product would broadcast a [1]
        result = torch.rms_norm(x, (x.shape[-1],), None, eps) * weight
    else:
        try:
            result = torch.rms_norm(x, (x.shape[-1],), weight, eps)
        except RuntimeError:  # torch's refusal of the weight, in the pack's words
            check_vector("weight", weight, x.shape[-1])
            raise
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
    try:
        result = _layernorm(x, weight, bias, eps)
    except RuntimeError:  # torch's refusal of the weight or bias, in the pack's words
        check_vector("weight", weight, x.shape[-1])
        check_vector("bias", bias, x.shape[-1])
        raise
    return write(out, result, in_place="x", x=x, weight=weight, bias=bias)


def _layernorm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
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
    return result

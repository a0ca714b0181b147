"""``torch.compile`` of the references, created lazily: compiling happens on first call.

Selected only while compilation is allowed (see :mod:`kernreg_ops._policy`).
"""

from __future__ import annotations

import torch

from kernreg_ops import reference
from kernreg_ops.reference import compute_dtype

__all__ = [
    "add_rmsnorm",
    "experts",
    "fused_add_rmsnorm",
    "gelu_and_mul",
    "gelu_tanh_mul",
    "layernorm",
    "rmsnorm",
    "rmsnorm_offset",
    "rotary",
    "rotary_cos_sin",
    "rotary_cos_sin_interleaved",
    "silu_and_mul",
    "silu_mul",
]

rmsnorm = torch.compile(reference.rmsnorm, dynamic=None)


@torch.compile(dynamic=None)
def _add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = compute_dtype(residual)
    summed = (x.to(acc) + residual.to(acc)).to(residual.dtype)
    return reference.rmsnorm(summed, weight, eps), summed


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> None:
    """The compiled part is functional and the writes happen outside it: compiling the
    in-place reference hits an Inductor CPU code-generation error (torch 2.13,
    ``KeyError`` in outer-loop fusion with a local buffer)."""
    normed, summed = _add_rmsnorm(x, residual, weight, eps)
    residual.copy_(summed)
    x.copy_(normed)


silu_and_mul = torch.compile(reference.silu_and_mul, dynamic=None)
gelu_and_mul = torch.compile(reference.gelu_and_mul, dynamic=None)
rotary = torch.compile(reference.rotary, dynamic=None)
silu_mul = torch.compile(reference.silu_mul, dynamic=None)
add_rmsnorm = torch.compile(reference.add_rmsnorm, dynamic=None)
rotary_cos_sin = torch.compile(reference.rotary_cos_sin, dynamic=None)
rmsnorm_offset = torch.compile(reference.rmsnorm_offset, dynamic=None)
layernorm = torch.compile(reference.layernorm, dynamic=None)
gelu_tanh_mul = torch.compile(reference.gelu_tanh_mul, dynamic=None)
rotary_cos_sin_interleaved = torch.compile(reference.rotary_cos_sin_interleaved, dynamic=None)
#: The expert loop is data-dependent (which experts have tokens): each expert's body
#: compiles, the loop runs eagerly between graphs.
experts = torch.compile(reference.experts, dynamic=None)

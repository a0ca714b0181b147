"""``torch.compile`` of the references, created lazily: compiling happens on first call.

Selected only while compilation is allowed (see :mod:`kernreg_ops._policy`).
"""

from __future__ import annotations

import torch

from kernreg_ops import reference
from kernreg_ops._out import write, write_pair
from kernreg_ops._shapes import check_same_shape, check_vector
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

_rmsnorm = torch.compile(reference.rmsnorm, dynamic=None)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    return write(out, _rmsnorm(x, weight, eps), in_place="x", x=x, weight=weight)


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
    check_same_shape("residual", residual, x)
    check_vector("weight", weight, x.shape[-1])
    normed, summed = _add_rmsnorm(x, residual, weight, eps)
    residual.copy_(summed)
    x.copy_(normed)


# The ops that take out= compile the functional reference and write out= outside the
# compiled region, as fused_add_rmsnorm does: the overlap check of out= reads storage
# addresses, which a compiled region cannot.
_silu_and_mul = torch.compile(reference.silu_and_mul, dynamic=None)
_gelu_and_mul = torch.compile(reference.gelu_and_mul, dynamic=None)
_silu_mul = torch.compile(reference.silu_mul, dynamic=None)
_rmsnorm_offset = torch.compile(reference.rmsnorm_offset, dynamic=None)
_layernorm = torch.compile(reference.layernorm, dynamic=None)
_gelu_tanh_mul = torch.compile(reference.gelu_tanh_mul, dynamic=None)
rotary = torch.compile(reference.rotary, dynamic=None)
rotary_cos_sin = torch.compile(reference.rotary_cos_sin, dynamic=None)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    return write(out, _silu_and_mul(x), in_place=None, x=x)


def gelu_and_mul(
    x: torch.Tensor, approximate: str = "none", *, out: torch.Tensor | None = None
) -> torch.Tensor:
    return write(out, _gelu_and_mul(x, approximate), in_place=None, x=x)


def silu_mul(
    gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    return write(out, _silu_mul(gate, up), in_place="gate", gate=gate, up=up)


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    results = _add_rmsnorm(x, residual, weight, eps)
    return write_pair(
        out, results, in_place=("x", "residual"), x=x, residual=residual, weight=weight
    )


def rmsnorm_offset(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    return write(out, _rmsnorm_offset(x, weight, eps), in_place="x", x=x, weight=weight)


def layernorm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    return write(out, _layernorm(x, weight, bias, eps), in_place="x", x=x, weight=weight, bias=bias)


def gelu_tanh_mul(
    gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    return write(out, _gelu_tanh_mul(gate, up), in_place="gate", gate=gate, up=up)


rotary_cos_sin_interleaved = torch.compile(reference.rotary_cos_sin_interleaved, dynamic=None)
#: The expert loop is data-dependent (which experts have tokens): each expert's body
#: compiles, the loop runs eagerly between graphs.
experts = torch.compile(reference.experts, dynamic=None)

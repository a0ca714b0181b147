"""CPU implementations that compute in the input's own dtype (no float32 upcast).

The references upcast to float32 for clarity; on CPU that makes bfloat16 slower than the
plain PyTorch code a model ships with. These do what the model's own layers do, in the
activations' dtype, so routing a layer through kernreg never makes it slower. Results
match the reference within one rounding of the dtype per operation.
"""

from __future__ import annotations

import torch
from torch.nn import functional

__all__ = [
    "add_rmsnorm",
    "fused_add_rmsnorm",
    "gelu_and_mul",
    "rotary_cos_sin",
    "silu_and_mul",
    "silu_mul",
]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalised value rounded to x's dtype, then scaled: the reference's rounding.
    return functional.rms_norm(x, (x.shape[-1],), None, eps) * weight


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return functional.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return functional.silu(x[..., :d]) * x[..., d:]


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    d = x.shape[-1] // 2
    return functional.gelu(x[..., :d], approximate=approximate) * x[..., d:]


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = (x + residual).to(residual.dtype)
    return _rms(summed, weight, eps), summed


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> None:
    residual.copy_(x + residual)
    x.copy_(_rms(residual, weight, eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_cos_sin(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rot_dim = cos.shape[-1]
    if rot_dim == q.shape[-1] and rot_dim == k.shape[-1]:
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    out = []
    for t in (q, k):
        head = t[..., :rot_dim]
        out.append(torch.cat((head * cos + _rotate_half(head) * sin, t[..., rot_dim:]), dim=-1))
    return out[0], out[1]

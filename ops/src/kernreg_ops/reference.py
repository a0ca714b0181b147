"""Pure-torch reference implementations: the correctness oracle of every op in the pack.

They favour clarity over speed and compute in float32 whatever the input dtype, rounding
to the input dtype where a fused kernel would.
"""

from __future__ import annotations

import torch
from torch.nn import functional

__all__ = [
    "add_rmsnorm",
    "fused_add_rmsnorm",
    "gelu_and_mul",
    "rmsnorm",
    "rotary",
    "rotary_cos_sin",
    "silu_and_mul",
    "silu_mul",
]


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMS normalisation over the last dimension, then scaled by ``weight``.

    ``x``: ``[..., hidden]``; ``weight``: ``[hidden]``. The normalised value is rounded
    to ``x.dtype`` before the multiplication by ``weight`` (the ATen and vLLM convention).
    """
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype) * weight


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> None:
    """Residual add then RMSNorm, in place; returns ``None`` (the vLLM/sglang convention).

    Afterwards ``residual`` holds ``x + residual`` (rounded to its dtype) and ``x`` holds
    ``rmsnorm(residual, weight, eps)`` of that updated residual. ``x`` and ``residual``
    have the same shape ``[..., hidden]`` and dtype.
    """
    summed = (x.float() + residual.float()).to(residual.dtype)
    residual.copy_(summed)
    x.copy_(rmsnorm(summed, weight, eps))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``: ``[..., 2d] -> [..., d]``."""
    d = x.shape[-1] // 2
    xf = x.float()
    return (functional.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(x[..., :d], approximate) * x[..., d:]``; ``approximate`` is ``"none"`` or ``"tanh"``."""
    d = x.shape[-1] // 2
    xf = x.float()
    return (functional.gelu(xf[..., :d], approximate=approximate) * xf[..., d:]).to(x.dtype)


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of ``q`` and ``k``; returns new tensors (inputs untouched).

    Layout: ``positions`` ``[tokens]`` (integer); ``q`` ``[tokens, heads, head_dim]``;
    ``k`` ``[tokens, kv_heads, head_dim]``; ``cos_sin_cache`` ``[max_position, rot_dim]``
    holding ``cos`` in its first half and ``sin`` in its second (the vLLM layout). The
    first ``rot_dim`` features of each head are rotated, the rest pass through.
    ``is_neox=True`` pairs feature ``i`` with ``i + rot_dim/2`` (GPT-NeoX style);
    ``False`` pairs ``2i`` with ``2i + 1`` (GPT-J style).
    """
    cos, sin = cos_sin_cache.index_select(0, positions).float().chunk(2, dim=-1)
    return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    xf = x[..., :rot_dim].float()
    if is_neox:
        x1, x2 = xf.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated.to(x.dtype), x[..., rot_dim:]), dim=-1)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of two tensors of one shape (a gated MLP with unfused weights)."""
    return (functional.silu(gate.float()) * up.float()).to(gate.dtype)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm, functional: returns ``(rmsnorm(x + residual), x + residual)``.

    The sum is rounded to ``residual.dtype``, as :func:`fused_add_rmsnorm` stores it; the
    inputs are left untouched (the form ``torch.compile`` handles on every device).
    """
    summed = (x.float() + residual.float()).to(residual.dtype)
    return rmsnorm(summed, weight, eps), summed


def rotary_cos_sin(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding in the transformers layout; returns new ``(q, k)``.

    ``q``: ``[batch, heads, seq, head_dim]``; ``k``: ``[batch, kv_heads, seq, head_dim]``;
    ``cos``/``sin``: ``[batch, seq, rot_dim]``, unsqueezed at ``unsqueeze_dim`` to broadcast
    over heads. The first ``rot_dim`` features are rotated GPT-NeoX style (feature ``i``
    pairs with ``i + rot_dim/2``), the rest pass through.
    """
    cos_f = cos.unsqueeze(unsqueeze_dim).float()
    sin_f = sin.unsqueeze(unsqueeze_dim).float()
    return _rotate_half_form(q, cos_f, sin_f), _rotate_half_form(k, cos_f, sin_f)


def _rotate_half_form(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot_dim = cos.shape[-1]
    xf = x[..., :rot_dim].float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = xf * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated.to(x.dtype), x[..., rot_dim:]), dim=-1)

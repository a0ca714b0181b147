"""Input generators of the pack's ops, for kernreg's parity harness.

Each takes ``(dtype, device, seed)`` and returns ``(args, kwargs)``. The seed picks the
shape (an odd small one, then a larger one) and the random values, so cases are
reproducible; ``dtype`` is the activations' dtype.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["fused_add_rmsnorm", "gelu_and_mul", "rmsnorm", "rotary", "silu_and_mul"]

Inputs = tuple[tuple[Any, ...], dict[str, Any]]

#: (tokens, hidden) per seed; hidden not a power of two on purpose for seed 0.
_ROWS = ((7, 96), (33, 1024))


def _gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, g: torch.Generator
) -> torch.Tensor:
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)


def rmsnorm(dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    tokens, hidden = _ROWS[seed % len(_ROWS)]
    g = _gen(device, seed)
    x = _randn((tokens, hidden), dtype, device, g)
    weight = (1.0 + 0.1 * _randn((hidden,), torch.float32, device, g)).to(dtype)
    return (x, weight), {"eps": 1e-6}


def fused_add_rmsnorm(dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    (x, weight), kwargs = rmsnorm(dtype, device, seed)
    residual = _randn(tuple(x.shape), dtype, device, _gen(device, seed + 1000))
    return (x, residual, weight), kwargs


def silu_and_mul(dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    tokens, hidden = _ROWS[seed % len(_ROWS)]
    return (_randn((tokens, 2 * hidden), dtype, device, _gen(device, seed)),), {}


def gelu_and_mul(dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    (x,), _ = silu_and_mul(dtype, device, seed)
    # Odd seeds check the tanh approximation.
    return (x,), {"approximate": "tanh" if seed % 2 else "none"}


def rotary(dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    tokens, heads, kv_heads, head_dim, max_position = ((5, 4, 2, 64, 64), (33, 8, 2, 128, 4096))[
        seed % 2
    ]
    rot_dim = head_dim if seed % 2 else head_dim // 2  # seed 0: partial rotary
    g = _gen(device, seed)
    positions = torch.randint(0, max_position, (tokens,), generator=g, device=device)
    q = _randn((tokens, heads, head_dim), dtype, device, g)
    k = _randn((tokens, kv_heads, head_dim), dtype, device, g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, device=device).float() / rot_dim))
    angles = torch.arange(max_position, device=device).float()[:, None] * inv_freq[None, :]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    return (positions, q, k, cache), {"is_neox": seed % 2 == 0}

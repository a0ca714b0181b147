"""Input generators of the pack's ops, for kernreg's parity harness and benchmarks.

Each takes ``(dtype, device, seed)`` and returns ``(args, kwargs)``. The seed picks the
shape (an odd small one, then a larger one) and the random values, so cases are
reproducible; ``dtype`` is the activations' dtype.

Keyword arguments (``tokens``, ``hidden``, ...) override the seed's shape: benchmarks use
them for the named representative shapes each generator declares with
:func:`kernreg.torch.bench.bench_shapes` (``small``, ``medium``, ``large``; sized so that
timing every op on all three, in three dtypes, takes well under a minute on two CPU
cores, while ``large`` is a realistic decode batch for a 7-8B model).
"""

from __future__ import annotations

from typing import Any

import torch

from kernreg.torch.bench import bench_shapes

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

Inputs = tuple[tuple[Any, ...], dict[str, Any]]

#: (tokens, hidden) per seed; hidden not a power of two on purpose for seed 0.
_ROWS = ((7, 96), (33, 1024))

#: Named shapes of the row-wise ops: ``hidden`` is the normalised (or output) width.
_ROW_SHAPES: dict[str, dict[str, object]] = {
    "small": {"tokens": 16, "hidden": 1024},
    "medium": {"tokens": 128, "hidden": 4096},
    "large": {"tokens": 512, "hidden": 8192},
}
_ROTARY_SHAPES: dict[str, dict[str, object]] = {
    "small": {"tokens": 16, "heads": 8, "kv_heads": 2, "head_dim": 128, "max_position": 4096},
    "medium": {"tokens": 128, "heads": 32, "kv_heads": 8, "head_dim": 128, "max_position": 4096},
    "large": {"tokens": 512, "heads": 32, "kv_heads": 8, "head_dim": 128, "max_position": 4096},
}


def _gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, g: torch.Generator
) -> torch.Tensor:
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)


def _rows(seed: int, tokens: int | None, hidden: int | None) -> tuple[int, int]:
    seed_tokens, seed_hidden = _ROWS[seed % len(_ROWS)]
    return (seed_tokens if tokens is None else tokens, seed_hidden if hidden is None else hidden)


@bench_shapes(**_ROW_SHAPES)
def rmsnorm(
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    *,
    tokens: int | None = None,
    hidden: int | None = None,
) -> Inputs:
    tokens, hidden = _rows(seed, tokens, hidden)
    g = _gen(device, seed)
    x = _randn((tokens, hidden), dtype, device, g)
    weight = (1.0 + 0.1 * _randn((hidden,), torch.float32, device, g)).to(dtype)
    return (x, weight), {"eps": 1e-6}


@bench_shapes(**_ROW_SHAPES)
def fused_add_rmsnorm(
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    *,
    tokens: int | None = None,
    hidden: int | None = None,
) -> Inputs:
    (x, weight), kwargs = rmsnorm(dtype, device, seed, tokens=tokens, hidden=hidden)
    residual = _randn(tuple(x.shape), dtype, device, _gen(device, seed + 1000))
    return (x, residual, weight), kwargs


@bench_shapes(**_ROW_SHAPES)
def silu_and_mul(
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    *,
    tokens: int | None = None,
    hidden: int | None = None,
) -> Inputs:
    tokens, hidden = _rows(seed, tokens, hidden)
    return (_randn((tokens, 2 * hidden), dtype, device, _gen(device, seed)),), {}


@bench_shapes(**_ROW_SHAPES)
def gelu_and_mul(
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    *,
    tokens: int | None = None,
    hidden: int | None = None,
    approximate: str | None = None,
) -> Inputs:
    (x,), _ = silu_and_mul(dtype, device, seed, tokens=tokens, hidden=hidden)
    if approximate is None:
        # Odd seeds check the tanh approximation.
        approximate = "tanh" if seed % 2 else "none"
    return (x,), {"approximate": approximate}


def _named_or_seeded(given: tuple[int | None, ...], seeded: tuple[int, ...]) -> tuple[int, ...]:
    """Each size as named by the caller, else the seed's."""
    return tuple(s if v is None else v for v, s in zip(given, seeded, strict=True))


def _inv_freq(rot_dim: int, device: torch.device) -> torch.Tensor:
    """Rotary frequencies of ``rot_dim`` rotated channels (base 10000), shape ``(rot_dim // 2,)``."""
    return 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, device=device).float() / rot_dim))


@bench_shapes(**_ROTARY_SHAPES)
def rotary(
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    *,
    tokens: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    max_position: int | None = None,
    is_neox: bool | None = None,
) -> Inputs:
    given = (tokens, heads, kv_heads, head_dim, max_position)
    seeded = ((5, 4, 2, 64, 64), (33, 8, 2, 128, 4096))[seed % 2]
    tokens, heads, kv_heads, head_dim, max_position = _named_or_seeded(given, seeded)
    named = any(v is not None for v in given)
    # seed 0: partial rotary (the seeded shapes only; named shapes rotate whole heads)
    rot_dim = head_dim if seed % 2 or named else head_dim // 2
    if is_neox is None:
        is_neox = seed % 2 == 0
    g = _gen(device, seed)
    positions = torch.randint(0, max_position, (tokens,), generator=g, device=device)
    q = _randn((tokens, heads, head_dim), dtype, device, g)
    k = _randn((tokens, kv_heads, head_dim), dtype, device, g)
    angles = torch.arange(max_position, device=device).float()[:, None] * _inv_freq(rot_dim, device)
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    return (positions, q, k, cache), {"is_neox": is_neox}


@bench_shapes(**_ROW_SHAPES)
def add_rmsnorm(
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    *,
    tokens: int | None = None,
    hidden: int | None = None,
) -> Inputs:
    return fused_add_rmsnorm(dtype, device, seed, tokens=tokens, hidden=hidden)


@bench_shapes(**_ROW_SHAPES)
def silu_mul(
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    *,
    tokens: int | None = None,
    hidden: int | None = None,
) -> Inputs:
    tokens, hidden = _rows(seed, tokens, hidden)
    g = _gen(device, seed)
    return (
        _randn((tokens, hidden), dtype, device, g),
        _randn((tokens, hidden), dtype, device, g),
    ), {}


_ROTARY_COS_SIN_SHAPES: dict[str, dict[str, object]] = {
    "small": {"batch": 1, "tokens": 16, "heads": 8, "kv_heads": 2, "head_dim": 128},
    "medium": {"batch": 4, "tokens": 128, "heads": 32, "kv_heads": 8, "head_dim": 128},
    "large": {"batch": 4, "tokens": 512, "heads": 32, "kv_heads": 8, "head_dim": 128},
}


@bench_shapes(**_ROTARY_COS_SIN_SHAPES)
def rotary_cos_sin(
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    *,
    batch: int | None = None,
    tokens: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    rot_dim: int | None = None,
) -> Inputs:
    given = (batch, tokens, heads, kv_heads, head_dim)
    seeded = ((2, 5, 4, 2, 64), (1, 33, 8, 2, 128))[seed % 2]
    batch, tokens, heads, kv_heads, head_dim = _named_or_seeded(given, seeded)
    if rot_dim is None:
        # seed 0: partial rotary on the seeded shape (the first half of each head rotates)
        partial = seed % 2 == 0 and all(v is None for v in given)
        rot_dim = head_dim // 2 if partial else head_dim
    g = _gen(device, seed)
    q = _randn((batch, heads, tokens, head_dim), dtype, device, g)
    k = _randn((batch, kv_heads, tokens, head_dim), dtype, device, g)
    positions = torch.randint(0, 4096, (batch, tokens), generator=g, device=device).float()
    angles = positions[..., None] * _inv_freq(rot_dim, device)
    emb = torch.cat((angles, angles), dim=-1)
    return (q, k, emb.cos().to(dtype), emb.sin().to(dtype)), {}


@bench_shapes(**_ROW_SHAPES)
def rmsnorm_offset(
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    *,
    tokens: int | None = None,
    hidden: int | None = None,
) -> Inputs:
    tokens, hidden = _rows(seed, tokens, hidden)
    g = _gen(device, seed)
    x = _randn((tokens, hidden), dtype, device, g)
    # Gemma stores the weight as an offset from 1 (zero at initialisation): a zero weight
    # would hide the difference from the plain RMSNorm, so it is perturbed.
    weight = (0.5 * _randn((hidden,), torch.float32, device, g)).to(dtype)
    return (x, weight), {"eps": 1e-6}


@bench_shapes(**_ROW_SHAPES)
def layernorm(
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    *,
    tokens: int | None = None,
    hidden: int | None = None,
    bias: bool | None = None,
) -> Inputs:
    tokens, hidden = _rows(seed, tokens, hidden)
    g = _gen(device, seed)
    # An offset mean, so that a kernel that skips centring fails.
    x = (_randn((tokens, hidden), torch.float32, device, g) + 3.0).to(dtype)
    weight = (1.0 + 0.5 * _randn((hidden,), torch.float32, device, g)).to(dtype)
    if bias is None:
        bias = seed % 2 == 0  # seed 0 with a bias (GPT-NeoX, Phi), seed 1 without (Cohere)
    b = (0.5 * _randn((hidden,), torch.float32, device, g)).to(dtype) if bias else None
    return (x, weight, b), {"eps": 1e-5}


@bench_shapes(**_ROW_SHAPES)
def gelu_tanh_mul(
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    *,
    tokens: int | None = None,
    hidden: int | None = None,
) -> Inputs:
    return silu_mul(dtype, device, seed, tokens=tokens, hidden=hidden)


@bench_shapes(**_ROTARY_COS_SIN_SHAPES)
def rotary_cos_sin_interleaved(
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    *,
    batch: int | None = None,
    tokens: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    rot_dim: int | None = None,
) -> Inputs:
    given = (batch, tokens, heads, kv_heads, head_dim)
    seeded = ((2, 5, 4, 2, 64), (1, 33, 8, 2, 128))[seed % 2]
    batch, tokens, heads, kv_heads, head_dim = _named_or_seeded(given, seeded)
    if rot_dim is None:
        # seed 0: partial rotary on the seeded shape (the first half of each head rotates)
        partial = seed % 2 == 0 and all(v is None for v in given)
        rot_dim = head_dim // 2 if partial else head_dim
    g = _gen(device, seed)
    q = _randn((batch, heads, tokens, head_dim), dtype, device, g)
    k = _randn((batch, kv_heads, tokens, head_dim), dtype, device, g)
    positions = torch.randint(0, 4096, (batch, tokens), generator=g, device=device).float()
    # Cohere's rotary embedding: each frequency repeated for the two features of its pair.
    angles = positions[..., None] * _inv_freq(rot_dim, device)
    emb = torch.repeat_interleave(angles, 2, dim=-1)
    return (q, k, emb.cos().to(dtype), emb.sin().to(dtype)), {}


_EXPERTS_SHAPES: dict[str, dict[str, object]] = {
    "small": {"tokens": 16, "hidden": 512, "intermediate": 256, "experts": 8, "top_k": 2},
    "medium": {"tokens": 128, "hidden": 1024, "intermediate": 512, "experts": 8, "top_k": 2},
    "large": {"tokens": 512, "hidden": 1024, "intermediate": 512, "experts": 16, "top_k": 4},
}


@bench_shapes(**_EXPERTS_SHAPES)
def experts(
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    *,
    tokens: int | None = None,
    hidden: int | None = None,
    intermediate: int | None = None,
    experts: int | None = None,
    top_k: int | None = None,
    act: str | None = None,
) -> Inputs:
    given = (tokens, hidden, intermediate, experts, top_k)
    seeded = ((7, 48, 40, 6, 2), (33, 128, 96, 8, 3))[seed % 2]
    tokens, hidden, intermediate, experts, top_k = _named_or_seeded(given, seeded)
    named = any(v is not None for v in given)
    if act is None:
        act = "gelu_tanh" if seed % 2 else "silu"
    g = _gen(device, seed)
    x = _randn((tokens, hidden), dtype, device, g)
    gate_up = _randn((experts, 2 * intermediate, hidden), torch.float32, device, g) / hidden**0.5
    down = _randn((experts, hidden, intermediate), torch.float32, device, g) / intermediate**0.5
    # Routing as Mixtral's router does it: softmax in float32, top-k, renormalised.
    logits = _randn((tokens, experts), torch.float32, device, g)
    weights, index = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    if seed % 2 and not named:
        # Qwen2-MoE rounds the weights to the activations' dtype; a few slots route to the
        # "no expert" id (expert parallelism's sentinel), which every implementation skips.
        weights = weights.to(dtype)
        index[::5, -1] = experts
    return (x, index, weights, gate_up.to(dtype), down.to(dtype)), {"act": act}

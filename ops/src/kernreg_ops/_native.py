"""Implementations that compute in the input's own dtype (no float32 upcast), any device.

The references upcast to float32 for clarity; that makes bfloat16 slower than the plain
PyTorch code a model ships with. These do what the model's own layers do, in the
activations' dtype and in no more ATen calls than the layer makes, so routing a layer
through kernreg never makes it slower (on a GPU, where each call is a launch, no more
launches either). Results match the reference within one rounding of the dtype per
operation. Where the model's own layer upcasts (Gemma's RMSNorm, Cohere's rotary), so do
these, as the layer does.
"""

from __future__ import annotations

import torch
from torch.nn import functional

from kernreg_ops import reference
from kernreg_ops._out import write, write_pair
from kernreg_ops._shapes import (
    check_cos_sin,
    check_expert_index,
    check_floating,
    check_same_shape,
    check_vector,
    expert_out_of_range,
)
from kernreg_ops.reference import activation, compute_dtype, half_width

__all__ = [
    "add_rmsnorm",
    "experts",
    "fused_add_rmsnorm",
    "gelu_and_mul",
    "gelu_tanh_mul",
    "rmsnorm_offset",
    "rotary_cos_sin",
    "rotary_cos_sin_interleaved",
    "silu_and_mul",
    "silu_mul",
]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalised value rounded to x's dtype, then scaled: the reference's rounding.
    return functional.rms_norm(x, (x.shape[-1],), None, eps) * weight


# Each op returns its result straight away when no ``out=`` is given: checking ``out`` costs
# a call with keyword arguments, a sizeable part of a decode step's norm.
def _no_grad(*tensors: torch.Tensor) -> bool:
    """Whether no autograd graph records ops on ``tensors`` (then an op may overwrite its
    own intermediate results in place)."""
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def _into_activation(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether ``act(gate) * up`` may be written into the activation's own fresh tensor: no
    autograd graph records it, and the product has the activation's dtype and shape (an
    in-place product keeps gate's dtype and cannot broadcast gate to up's shape)."""
    return gate.dtype == up.dtype and gate.shape == up.shape and _no_grad(gate, up)


def silu_mul(
    gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    if out is None and _into_activation(gate, up):
        return functional.silu(gate).mul_(up)
    # The result in gate's dtype, as the reference gives it (up may be wider).
    result = (functional.silu(gate) * up).to(gate.dtype)
    return write(out, result, in_place="gate", gate=gate, up=up)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    d = half_width(x)
    if out is None:
        return functional.silu(x[..., :d]) * x[..., d:]
    return write(out, functional.silu(x[..., :d]) * x[..., d:], in_place=None, x=x)


def gelu_and_mul(
    x: torch.Tensor, approximate: str = "none", *, out: torch.Tensor | None = None
) -> torch.Tensor:
    d = half_width(x)
    return write(
        out, functional.gelu(x[..., :d], approximate=approximate) * x[..., d:], in_place=None, x=x
    )


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_floating(residual=residual)  # x's dtype was the dispatcher's to check
    summed = (x + residual).to(residual.dtype)
    check_vector("weight", weight, summed.shape[-1])  # the product would broadcast a [1]
    results = (_rms(summed, weight, eps), summed)
    return write_pair(
        out, results, in_place=("x", "residual"), x=x, residual=residual, weight=weight
    )


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> None:
    # Checked before anything is written: residual would be updated, then x refused.
    check_floating(residual=residual)
    check_same_shape("residual", residual, x)
    check_vector("weight", weight, x.shape[-1])
    residual.copy_(x + residual)
    x.copy_(_rms(residual, weight, eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _refuse_cos_sin(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int
) -> None:
    """The ``ValueError`` the other implementations raise for these shapes (called once
    torch has refused them: the common path checks nothing)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    check_cos_sin(q, cos, sin)
    check_cos_sin(k, cos, sin)


def rotary_cos_sin(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        return _rotary_cos_sin(q, k, cos, sin, unsqueeze_dim)
    except RuntimeError:
        _refuse_cos_sin(q, k, cos, sin, unsqueeze_dim)
        raise


def _rotary_cos_sin(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if not q.dtype == k.dtype == cos.dtype == sin.dtype:
        # Mixed dtypes promote in the products below; the reference rounds to q's and k's.
        return reference.rotary_cos_sin(q, k, cos, sin, unsqueeze_dim)
    # t * cos + rotate_half(t) * sin with the second product and the sum fused (addcmul_
    # into the fresh t * cos): one pass and one tensor fewer per input, rounded once.
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rot_dim = cos.shape[-1]
    if rot_dim == q.shape[-1] and rot_dim == k.shape[-1]:
        q_embed = (q * cos).addcmul_(_rotate_half(q), sin)
        k_embed = (k * cos).addcmul_(_rotate_half(k), sin)
        if q_embed.shape != q.shape or k_embed.shape != k.shape:
            raise RuntimeError("cos and sin widen q or k")  # refused in the caller's words
        return q_embed, k_embed
    out = []
    for t in (q, k):
        head = t[..., :rot_dim]
        rotated = (head * cos).addcmul_(_rotate_half(head), sin)
        out.append(torch.cat((rotated, t[..., rot_dim:]), dim=-1))
    return out[0], out[1]


def gelu_tanh_mul(
    gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    if out is None and _into_activation(gate, up):
        return functional.gelu(gate, approximate="tanh").mul_(up)
    return write(
        out, functional.gelu(gate, approximate="tanh") * up, in_place="gate", gate=gate, up=up
    )


def rmsnorm_offset(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    # Gemma computes x * rstd * (1 + w) in float32 and rounds once. So does this: ATen's
    # rms_norm, then n + n * w in one addcmul (no tensor 1 + w made per call; within one
    # float32 rounding of Gemma's product, the same after rounding to bfloat16).
    check_vector("weight", weight, x.shape[-1])  # addcmul would broadcast a [1]
    dtype = x.dtype
    if dtype == torch.float32 and weight.dtype == dtype:  # no casts to make (a call each)
        normed = torch.rms_norm(x, (x.shape[-1],), None, eps)
        result = torch.addcmul(normed, normed, weight)
    else:
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        normed = torch.rms_norm(x.to(acc), (x.shape[-1],), None, eps)
        result = torch.addcmul(normed, normed, weight.to(acc)).to(dtype)
    if out is None:
        return result
    return write(out, result, in_place="x", x=x, weight=weight)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotary_cos_sin_interleaved(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        return _rotary_cos_sin_interleaved(q, k, cos, sin, unsqueeze_dim)
    except RuntimeError:
        _refuse_cos_sin(q, k, cos, sin, unsqueeze_dim)
        raise


def _rotary_cos_sin_interleaved(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # Cohere computes in float32 and rounds once; so does this (one copy per tensor fewer
    # than the reference where the whole head rotates).
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rot_dim = cos.shape[-1]
    out = []
    check_floating(k=k)  # q's dtype was the dispatcher's to check
    for t in (q, k):
        acc = compute_dtype(t)
        if rot_dim == t.shape[-1]:
            rotated = t.to(acc)
            rotated = rotated * cos + _rotate_pairs(rotated) * sin
            if rotated.shape != t.shape:
                raise RuntimeError("cos and sin widen q or k")  # refused in the caller's words
            out.append(rotated.to(t.dtype))
            continue
        head = t[..., :rot_dim].to(acc)
        rotated = (head * cos + _rotate_pairs(head) * sin).to(t.dtype)
        out.append(torch.cat((rotated, t[..., rot_dim:]), dim=-1))
    return out[0], out[1]


def experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: str = "silu",
) -> torch.Tensor:
    """Tokens sorted by expert once, then one pair of matmuls per expert that has tokens.

    The reference builds a ``[experts + 1, top_k, tokens]`` one-hot mask and searches it
    per expert (a host sync each); this sorts the routing once and reads the per-expert
    counts with one sync. Each expert sees its rows in the reference's order and adds
    them in the reference's order (in float32, rounded once), so the results are the
    reference's.
    """
    act_fn = activation(act)
    num_experts = gate_up_proj.shape[0]
    num_tokens = top_k_index.shape[0]
    # Slot-major flat index (slot * tokens + token): a stable sort by expert keeps the
    # reference's (slot, token) order within each expert.
    check_expert_index(top_k_index)
    flat = top_k_index.t().reshape(-1)
    order = torch.argsort(flat, stable=True)
    try:
        counts = torch.bincount(flat, minlength=num_experts + 1).tolist()
    except RuntimeError:  # a negative id
        raise expert_out_of_range(int(flat.min()), num_experts) from None
    if len(counts) > num_experts + 1:
        raise expert_out_of_range(len(counts) - 1, num_experts)
    token_of = order % num_tokens if num_tokens else order
    slot_of = order // num_tokens if num_tokens else order
    acc = compute_dtype(hidden_states)
    final_hidden_states = torch.zeros(hidden_states.shape, dtype=acc, device=hidden_states.device)
    start = 0
    for expert_idx, count in enumerate(counts[:num_experts]):
        if count == 0:
            continue
        token_idx = token_of[start : start + count]
        top_k_pos = slot_of[start : start + count]
        start += count
        gate, up = functional.linear(hidden_states[token_idx], gate_up_proj[expert_idx]).chunk(
            2, dim=-1
        )
        current = functional.linear(act_fn(gate) * up, down_proj[expert_idx])
        current = current * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current.to(acc))
    return final_hidden_states.to(hidden_states.dtype)

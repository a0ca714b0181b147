"""Pure-torch reference implementations: the correctness oracle of every op in the pack.

They favour clarity over speed and compute in float32 (float64 for float64 inputs),
rounding to the input dtype where a fused kernel would. The ops that model one
transformers layer (``rmsnorm_offset``, ``layernorm``, ``gelu_tanh_mul``,
``rotary_cos_sin_interleaved``, ``experts``) compute as that layer does, rounding where it
rounds, so they equal the layer on its own inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional

from kernreg_ops._out import write, write_pair
from kernreg_ops._shapes import (
    check_cos_sin,
    check_expert_index,
    check_floating,
    check_rotary,
    check_same_shape,
    check_vector,
    expert_out_of_range,
)

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


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the references compute in: float64 for float64 inputs, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMS normalisation over the last dimension, then scaled by ``weight``.

    ``x``: ``[..., hidden]``; ``weight``: ``[hidden]``. The normalised value is rounded
    to ``x.dtype`` before the multiplication by ``weight`` (the ATen and vLLM convention).
    ``out``: a buffer the result is written into and returned (see :mod:`kernreg_ops._out`).
    """
    check_floating(x=x)
    check_vector("weight", weight, x.shape[-1])
    xf = x.to(compute_dtype(x))
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return write(out, (xf * rstd).to(x.dtype) * weight, in_place="x", x=x, weight=weight)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> None:
    """Residual add then RMSNorm, in place; returns ``None`` (the vLLM/sglang convention).

    Afterwards ``residual`` holds ``x + residual`` (rounded to its dtype) and ``x`` holds
    ``rmsnorm(residual, weight, eps)`` of that updated residual. ``x`` and ``residual``
    have the same shape ``[..., hidden]`` and dtype.
    """
    check_floating(x=x, residual=residual)
    check_same_shape("residual", residual, x)
    check_vector("weight", weight, x.shape[-1])
    acc = compute_dtype(residual)
    summed = (x.to(acc) + residual.to(acc)).to(residual.dtype)
    residual.copy_(summed)
    x.copy_(rmsnorm(summed, weight, eps))


def half_width(x: torch.Tensor) -> int:
    """``d`` of an ``[..., 2d]`` input holding a gate half and an up half; a ``ValueError``
    for an odd last dimension (the halves would differ in width)."""
    width = x.shape[-1]
    if width % 2:
        raise ValueError(
            f"x's last dimension holds the gate and up halves, so it must be even; got {width}"
        )
    return width // 2


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``: ``[..., 2d] -> [..., d]``.

    ``out``: a buffer the result is written into and returned (see :mod:`kernreg_ops._out`).
    """
    check_floating(x=x)
    d = half_width(x)
    xf = x.to(compute_dtype(x))
    return write(out, (functional.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype), in_place=None, x=x)


def gelu_and_mul(
    x: torch.Tensor, approximate: str = "none", *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``gelu(x[..., :d], approximate) * x[..., d:]``; ``approximate`` is ``"none"`` or ``"tanh"``.

    ``out``: a buffer the result is written into and returned (see :mod:`kernreg_ops._out`).
    """
    check_floating(x=x)
    d = half_width(x)
    xf = x.to(compute_dtype(x))
    result = (functional.gelu(xf[..., :d], approximate=approximate) * xf[..., d:]).to(x.dtype)
    return write(out, result, in_place=None, x=x)


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
    check_floating(q=q, k=k)
    check_rotary(positions, q, k, cos_sin_cache)
    acc = compute_dtype(q)
    cos, sin = cos_sin_cache.index_select(0, positions).to(acc).chunk(2, dim=-1)
    return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    xf = x[..., :rot_dim].to(cos.dtype)
    if is_neox:
        x1, x2 = xf.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated.to(x.dtype), x[..., rot_dim:]), dim=-1)


def silu_mul(
    gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``silu(gate) * up`` of two tensors of one shape (a gated MLP with unfused weights).

    ``out``: a buffer the result is written into and returned (see :mod:`kernreg_ops._out`).
    """
    check_floating(gate=gate)
    acc = compute_dtype(gate)
    return write(
        out,
        (functional.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype),
        in_place="gate",
        gate=gate,
        up=up,
    )


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm, functional: returns ``(rmsnorm(x + residual), x + residual)``.

    The sum is rounded to ``residual.dtype``, as :func:`fused_add_rmsnorm` stores it; the
    inputs are left untouched (the form ``torch.compile`` handles on every device).
    ``out``: a pair of buffers, ``(normed, summed)``, the results are written into and
    returned (see :mod:`kernreg_ops._out`); ``out=(x, residual)`` is the in-place form.
    """
    check_floating(x=x, residual=residual)
    acc = compute_dtype(residual)
    summed = (x.to(acc) + residual.to(acc)).to(residual.dtype)
    results = (rmsnorm(summed, weight, eps), summed)
    return write_pair(
        out, results, in_place=("x", "residual"), x=x, residual=residual, weight=weight
    )


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
    pairs with ``i + rot_dim/2``), the rest pass through: partial rotary when
    ``rot_dim < head_dim``, as transformers' GPT-NeoX and Phi3 ``apply_rotary_pos_emb`` do.
    """
    check_floating(q=q, k=k)
    acc = compute_dtype(q)
    cos_f = cos.unsqueeze(unsqueeze_dim).to(acc)
    sin_f = sin.unsqueeze(unsqueeze_dim).to(acc)
    check_cos_sin(q, cos_f, sin_f)
    check_cos_sin(k, cos_f, sin_f)
    return _rotate_half_form(q, cos_f, sin_f), _rotate_half_form(k, cos_f, sin_f)


def _rotate_half_form(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot_dim = cos.shape[-1]
    xf = x[..., :rot_dim].to(cos.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = xf * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated.to(x.dtype), x[..., rot_dim:]), dim=-1)


def rmsnorm_offset(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gemma's RMSNorm: ``x * rsqrt(mean(x**2) + eps) * (1 + weight)``, rounded to ``x.dtype`` once.

    Computed as transformers' ``GemmaRMSNorm`` does: in float32 (float64 for float64
    inputs), the weight applied as ``1 + weight`` before the one rounding (Llama's RMSNorm
    rounds the normalised value first). ``x``: ``[..., hidden]``; ``weight``: ``[hidden]``.
    ``out``: a buffer the result is written into and returned (see :mod:`kernreg_ops._out`).
    """
    check_floating(x=x)
    check_vector("weight", weight, x.shape[-1])
    acc = compute_dtype(x)
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    normed = normed * (1.0 + weight.to(acc))
    return write(out, normed.type_as(x), in_place="x", x=x, weight=weight)


def layernorm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """LayerNorm over the last dimension: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    ``weight`` and ``bias`` are ``[hidden]`` or ``None``; the variance is the biased one.
    Computed in float32 (float64 for float64 inputs) and rounded to ``x.dtype`` once, as
    ``torch.nn.LayerNorm`` and transformers' Cohere and OLMo layer norms do.
    ``out``: a buffer the result is written into and returned (see :mod:`kernreg_ops._out`).
    """
    check_floating(x=x)
    check_vector("weight", weight, x.shape[-1])
    check_vector("bias", bias, x.shape[-1])
    acc = compute_dtype(x)
    xf = x.to(acc)
    mean = xf.mean(-1, keepdim=True)
    centered = xf - mean
    variance = centered.pow(2).mean(-1, keepdim=True)
    normed = centered * torch.rsqrt(variance + eps)
    if weight is not None:
        normed = normed * weight.to(acc)
    if bias is not None:
        normed = normed + bias.to(acc)
    return write(out, normed.to(x.dtype), in_place="x", x=x, weight=weight, bias=bias)


def gelu_tanh_mul(
    gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` of two tensors of one shape (Gemma's gated MLP).

    Rounded where the model's MLP rounds: the activation is computed in float32 (float64
    for float64 inputs) and rounded to ``gate.dtype``, then multiplied by ``up`` in that
    dtype (``act_fn(gate_proj(x)) * up_proj(x)``).
    ``out``: a buffer the result is written into and returned (see :mod:`kernreg_ops._out`).
    """
    check_floating(gate=gate)
    act = functional.gelu(gate.to(compute_dtype(gate)), approximate="tanh").to(gate.dtype)
    return write(out, act * up, in_place="gate", gate=gate, up=up)


def rotary_cos_sin_interleaved(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding on interleaved pairs, as transformers' Cohere ``apply_rotary_pos_emb``.

    Layout as :func:`rotary_cos_sin`; feature ``2i`` pairs with ``2i + 1``, and ``cos``/``sin``
    hold one value per feature (Cohere's rotary embedding repeats each frequency twice,
    ``repeat_interleave(2)``). ``q`` and ``k`` are computed in float32 (float64 for float64)
    and rounded back to their dtype. The first ``rot_dim = cos.shape[-1]`` features rotate,
    the rest pass through.
    """
    check_floating(q=q, k=k)
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    check_cos_sin(q, cos, sin)
    check_cos_sin(k, cos, sin)
    return _rotate_interleaved(q, cos, sin), _rotate_interleaved(k, cos, sin)


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot_dim = cos.shape[-1]
    xf = x[..., :rot_dim].to(compute_dtype(x))
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    rotated = xf * cos + torch.stack((-x2, x1), dim=-1).flatten(-2) * sin
    return torch.cat((rotated.to(x.dtype), x[..., rot_dim:]), dim=-1)


#: ``act`` names of :func:`experts` -> the activation transformers' ``act_fn`` computes.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": functional.silu,
    "gelu": functional.gelu,
    "gelu_tanh": lambda t: functional.gelu(t, approximate="tanh"),
}


def activation(act: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation named ``act`` (``"silu"``, ``"gelu"`` or ``"gelu_tanh"``)."""
    try:
        return ACTIVATIONS[act]
    except (KeyError, TypeError):
        raise ValueError(
            f"act must be one of {', '.join(map(repr, ACTIVATIONS))}, not {act!r}"
        ) from None


def experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: str = "silu",
) -> torch.Tensor:
    """Mixture-of-experts: each token through its ``top_k`` experts' gated MLPs, weighted and summed.

    The loop of transformers' ``MixtralExperts.forward`` (also Qwen2-MoE's and Qwen3-MoE's):
    ``hidden_states`` ``[tokens, hidden]``; ``top_k_index`` ``[tokens, top_k]`` expert ids,
    where ``num_experts`` means no expert; ``top_k_weights`` ``[tokens, top_k]``;
    ``gate_up_proj`` ``[experts, 2 * intermediate, hidden]``; ``down_proj``
    ``[experts, hidden, intermediate]``; ``act`` names the activation of the gate. Experts
    run in ascending order, each on its tokens in (slot, token) order, in
    ``hidden_states``' dtype. Their weighted outputs are summed in float32 (float64 for
    float64) and rounded once, as transformers' default experts implementation
    (``grouped_mm``) does: its eager loop rounds the running sum after each expert, which
    in bfloat16 can differ from the rounded-once sum by more than bfloat16's tolerance.
    """
    check_floating(hidden_states=hidden_states)
    check_expert_index(top_k_index)
    act_fn = activation(act)
    num_experts = gate_up_proj.shape[0]
    if top_k_index.numel():
        for found in (int(top_k_index.min()), int(top_k_index.max())):
            if not 0 <= found <= num_experts:
                raise expert_out_of_range(found, num_experts)
    acc = compute_dtype(hidden_states)
    final_hidden_states = torch.zeros(hidden_states.shape, dtype=acc, device=hidden_states.device)
    with torch.no_grad():
        # one_hot takes int64 ids only; the ids' values are what matter.
        expert_mask = functional.one_hot(top_k_index.long(), num_classes=num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for hit in expert_hit:
        expert_idx = hit[0]
        if expert_idx == num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate, up = functional.linear(current_state, gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = act_fn(gate) * up
        current_hidden_states = functional.linear(current_hidden_states, down_proj[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(acc))
    return final_hidden_states.to(hidden_states.dtype)

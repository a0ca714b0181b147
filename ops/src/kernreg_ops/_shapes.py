"""The shapes every implementation of an op refuses alike, each with one ``ValueError``.

An implementation that computes with torch's broadcasting would take a weight of one
element (``[1]``) as a scale for every feature, or raise torch's own ``RuntimeError``
for a weight of another width; a Triton kernel would read past its end. So each
implementation refuses what the others refuse, with the same message: the reference and
the Triton kernels check up front; the native and ATen ones check where torch's own
call would take the shape silently, and otherwise only once torch's call has raised
(their common path runs no check). An integer activation is refused alike too (the
references would round their float32 result back to it): the native, ATen and Triton
implementations are selected for floating-point dtypes only, and check the inputs the
dispatcher does not look at.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "broadcast",
    "check_cos_sin",
    "check_expert_index",
    "check_floating",
    "check_rotary",
    "check_same_shape",
    "check_vector",
    "expert_out_of_range",
]


def broadcast(*shapes: Sequence[int]) -> tuple[int, ...]:
    """torch.broadcast_shapes of plain shapes (it, while torch.compile traces: symbolic
    sizes need its care); ``RuntimeError`` where they do not broadcast."""
    # torch.broadcast_shapes costs 14 us a call (it builds tensors); this a tenth of that.
    if torch.compiler.is_compiling():
        return tuple(torch.broadcast_shapes(*shapes))  # type: ignore[no-untyped-call]
    if all(shape == shapes[0] for shape in shapes):
        return tuple(shapes[0])
    result = [1] * max(map(len, shapes))
    for shape in shapes:
        for i, size in enumerate(shape, len(result) - len(shape)):
            if size != 1:
                if result[i] != 1 and result[i] != size:
                    raise RuntimeError(
                        f"sizes {result[i]} and {size} at dimension {i} do not broadcast"
                    )
                result[i] = size
    return tuple(result)


def check_floating(**tensors: torch.Tensor) -> None:
    """Each of ``tensors`` (the activations an op computes on) has a floating-point dtype.

    The references compute in float32 and round back to the input's dtype: an integer
    input would come out truncated (rmsnorm of int64 gives zeros and ones), a silent
    wrong number where torch's own ops refuse it.
    """
    for name, t in tensors.items():
        if not t.is_floating_point():
            dtype = str(t.dtype).removeprefix("torch.")
            raise ValueError(f"{name} must be a floating-point tensor; got {dtype}")


def check_expert_index(top_k_index: torch.Tensor) -> None:
    """``top_k_index`` holds integer expert ids (int64 as transformers' routers give them,
    int32 as vLLM's and sglang's do)."""
    if (
        top_k_index.is_floating_point()
        or top_k_index.is_complex()
        or top_k_index.dtype == torch.bool
    ):
        dtype = str(top_k_index.dtype).removeprefix("torch.")
        raise ValueError(f"top_k_index must be an integer tensor of expert ids; got {dtype}")


def expert_out_of_range(found: int, num_experts: int) -> ValueError:
    """The error for an expert id outside ``0..num_experts`` (``num_experts``: no expert)."""
    return ValueError(
        f"top_k_index holds expert {found}, but there are {num_experts} experts "
        f"(ids 0..{num_experts - 1}, and {num_experts} for no expert)"
    )


def check_vector(name: str, t: torch.Tensor | None, width: int) -> None:
    """``t`` (``None`` allowed) has the shape ``(width,)`` of one row of x."""
    if t is not None and t.shape != (width,):
        raise ValueError(
            f"{name} must have shape ({width},), x's last dimension; got {tuple(t.shape)}"
        )


def check_same_shape(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    if t.shape != x.shape:
        raise ValueError(f"{name} must have x's shape {tuple(x.shape)}; got {tuple(t.shape)}")


def check_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor
) -> None:
    """The shapes the vLLM-layout rotary reads: one position per token, ``[tokens, heads,
    head_dim]`` q and k, a ``[max_position, rot_dim]`` cache with an even ``rot_dim`` of at
    most the head size. (The positions' values are not read here: that would wait for the
    device.)"""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"q and k must be [tokens, heads, head_dim]; got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    tokens = q.shape[0]
    if k.shape[0] != tokens or positions.shape != (tokens,):
        raise ValueError(
            f"positions must hold one position per token of q and k: positions "
            f"{tuple(positions.shape)}, q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    rot_dim = cache.shape[-1] if cache.dim() == 2 else -1
    if rot_dim < 0 or rot_dim % 2 or rot_dim > min(q.shape[-1], k.shape[-1]):
        raise ValueError(
            f"cos_sin_cache must be [max_position, rot_dim] with an even rot_dim of at most "
            f"the head size {min(q.shape[-1], k.shape[-1])}; got {tuple(cache.shape)}"
        )


def check_cos_sin(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``cos`` and ``sin`` (unsqueezed already) rotate an even number of ``x``'s features,
    at most all, and broadcast to ``x``'s leading dimensions without widening them (the
    rotated tensor keeps its shape)."""
    rot_dim = cos.shape[-1]
    head_dim = x.shape[-1]
    leading = tuple(x.shape[:-1])
    if rot_dim % 2 or rot_dim > head_dim or sin.shape[-1] != rot_dim:
        raise ValueError(
            f"rotary embedding rotates an even number of features, at most the head size "
            f"{head_dim}: cos and sin have {rot_dim}"
            + ("" if sin.shape[-1] == rot_dim else f" and {sin.shape[-1]}")
        )
    try:
        shape = broadcast((*leading, rot_dim), cos.shape, sin.shape)
    except RuntimeError as exc:
        raise ValueError(
            f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} (after unsqueeze_dim) do not "
            f"broadcast to {tuple(x.shape)}: {exc}"
        ) from None
    if shape != (*leading, rot_dim):
        raise ValueError(
            f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} (after unsqueeze_dim) broadcast "
            f"beyond {tuple(x.shape)}; the rotated tensor keeps its own shape"
        )

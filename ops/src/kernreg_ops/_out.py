"""The ``out=`` contract every implementation of the pack's norm and activation ops keeps.

An op whose reference takes a keyword-only ``out: Tensor | None = None`` writes its result
into the caller's ``out`` and returns that same tensor (CUDA-graph capture needs results
in fixed buffers). ``out`` has the result's shape, dtype and device exactly: anything else
is an :class:`OutError` (a ``ValueError``) naming what was expected, never a new
allocation. Aliasing: ``out`` may be the op's first input itself (``rmsnorm(x, w, out=x)``
normalises in place, as sglang's ``rmsnorm`` does by default; ``add_rmsnorm`` takes
``out=(x, residual)``); otherwise it shares no memory with any input, and an ``out`` that
does is refused. Every implementation, the Triton kernels included, gives the same
result and the same errors. Ops with two results take ``out`` as a pair of buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["OutError", "check", "write", "write_pair"]


class OutError(ValueError):
    """An ``out=`` buffer that cannot hold the result as given."""


def _describe(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> str:
    return f"a {str(dtype).removeprefix('torch.')} tensor of shape {tuple(shape)} on {device}"


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` can touch, as ``[start, end)`` from its storage's first byte."""
    start = t.storage_offset() * t.element_size()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory (their byte ranges in one storage meet)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def check(
    out: object,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    inputs: dict[str, torch.Tensor | None],
    *,
    in_place: str | None,
    name: str = "out",
) -> torch.Tensor:
    """``out``, once it is known to fit a result of ``shape``, ``dtype`` on ``device``.

    ``inputs`` are the op's tensor arguments by name; ``out`` may be the one named
    ``in_place`` itself (``None``: none, as for ops whose result is narrower than their
    input), and shares no memory with any other. (Under ``torch.compile`` the
    memory is not compared: tracing cannot read storage addresses, and the compiled op
    computes its result before writing ``out``.)
    """
    if not isinstance(out, torch.Tensor):
        raise OutError(
            f"{name} must be {_describe(shape, dtype, device)}, got {type(out).__name__}"
        )
    if out.shape != tuple(shape) or out.dtype != dtype or out.device != device:
        raise OutError(
            f"{name} must be {_describe(shape, dtype, device)} (the result of this call), "
            f"got {_describe(out.shape, out.dtype, out.device)}"
        )
    if any(stride == 0 and size > 1 for size, stride in zip(out.shape, out.stride(), strict=True)):
        raise OutError(
            f"{name} has elements that share memory (an expanded view, stride 0): pass a "
            "buffer with one place per element"
        )
    if torch.compiler.is_compiling():
        return out
    for input_name, tensor in inputs.items():
        if tensor is None or (input_name == in_place and _same_view(out, tensor)):
            continue
        if _same_view(out, tensor) or _overlaps(out, tensor):
            allowed = "" if in_place is None else f"{in_place} itself (in place) or "
            raise OutError(
                f"{name} shares memory with {input_name}: pass {allowed}a buffer that shares "
                "no memory with the inputs"
            )
    return out


def write(
    out: object, result: torch.Tensor, /, *, in_place: str | None, **inputs: torch.Tensor | None
) -> torch.Tensor:
    """``result``, or, when the caller passed ``out``, ``out`` holding it (checked first).

    ``inputs`` are the op's tensor arguments by name; ``in_place`` names the one ``out``
    may be.
    """
    if out is None:
        return result
    buffer = check(out, result.shape, result.dtype, result.device, inputs, in_place=in_place)
    return buffer.copy_(result)


def pair(out: object) -> tuple[object, object]:
    """The two buffers of ``out`` for an op with two results."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        got = type(out).__name__
        if isinstance(out, (tuple, list)):
            got = f"a {got} of {len(out)}"
        raise OutError(f"out must be a tuple of 2 tensors, one per result, got {got}")
    return out[0], out[1]


def check_pair(
    out: object,
    results: Sequence[tuple[Sequence[int], torch.dtype]],
    device: torch.device,
    inputs: dict[str, torch.Tensor | None],
    *,
    in_place: tuple[str, str],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`check` for an op with two results: ``out`` is a pair of buffers, which share
    no memory with each other; ``out[i]`` may be the input named ``in_place[i]``."""
    first, second = pair(out)
    (shape0, dtype0), (shape1, dtype1) = results
    buffers = (
        check(first, shape0, dtype0, device, inputs, in_place=in_place[0], name="out[0]"),
        check(second, shape1, dtype1, device, inputs, in_place=in_place[1], name="out[1]"),
    )
    if not torch.compiler.is_compiling() and (_same_view(*buffers) or _overlaps(*buffers)):
        raise OutError("out[0] and out[1] share memory: each result needs its own buffer")
    return buffers


def write_pair(
    out: object,
    results: tuple[torch.Tensor, torch.Tensor],
    /,
    *,
    in_place: tuple[str, str],
    **inputs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`write` for an op with two results, which takes ``out`` as a pair of buffers."""
    if out is None:
        return results
    first, second = check_pair(
        out,
        [(r.shape, r.dtype) for r in results],
        results[0].device,
        inputs,
        in_place=in_place,
    )
    return first.copy_(results[0]), second.copy_(results[1])

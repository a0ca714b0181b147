"""Triton kernels of the pack (CUDA SM 8.0+, float16/bfloat16/float32).

This module imports triton, so kernreg imports it only when a ``triton`` implementation
is selected. Every kernel computes in float32 and rounds where the reference does, so
the results match the reference within one rounding of the output dtype. One program
handles one row (one token and head for rotary; a block of elements for the elementwise
ops); a row's result never depends on the other rows, so the kernels are deterministic
and batch-invariant.
"""

# Triton spells compile-time (constexpr) kernel parameters in upper case.
# ruff: noqa: N803
# Kernel parameters are pointers and constexprs that triton types itself; torch's
# broadcasting helpers are untyped.
# mypy: disable-error-code="untyped-decorator,no-untyped-def,no-untyped-call"

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from kernreg_ops._out import check, check_pair
from kernreg_ops._shapes import (
    broadcast,
    check_cos_sin,
    check_floating,
    check_rotary,
    check_same_shape,
    check_vector,
)
from kernreg_ops.reference import half_width

__all__ = [
    "add_rmsnorm",
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

#: The norm kernels keep a whole row in registers: rows up to this many features.
MAX_HIDDEN = 65536
_ACT_BLOCK = 1024
_SILU, _GELU, _GELU_TANH = 0, 1, 2


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


# Host time matters: a decode step launches these kernels on rows of one token, where the
# launch, not the kernel, sets the pace. triton.next_power_of_2 and triton.cdiv cost 2 us
# a call (and torch.broadcast_shapes 14 us: _shapes.broadcast stands in for it); the two
# below cost a tenth of that or less.


def _pow2(n: int) -> int:
    """triton.next_power_of_2: the smallest power of two >= ``n`` (0 for 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _blocks(n: int) -> int:
    """triton.cdiv(n, _ACT_BLOCK): the element-wise kernels' programs for ``n`` elements."""
    return (n + _ACT_BLOCK - 1) // _ACT_BLOCK


@triton.jit
def _rmsnorm_kernel(
    x_ptr, w_ptr, out_ptr, x_stride, out_stride, n_cols, eps,
    OFFSET: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:  # Gemma: x * rstd * (1 + w), rounded once
        out = x * rstd * (1.0 + w)
    else:  # round to the input dtype before scaling by the weight, as the reference does
        out = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layernorm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, x_stride, out_stride, n_cols, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    centered = tl.where(mask, x - mean, 0.0)
    variance = tl.sum(centered * centered, axis=0) / n_cols
    out = centered * (1.0 / tl.sqrt(variance + eps))
    if HAS_WEIGHT:
        out = out * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        out = out + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    x_stride,
    r_stride,
    out_stride,
    sum_stride,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
):
    # In place when out is x and sum is residual: a program loads its row before storing it.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
    summed = (x + r).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * sum_stride + cols, summed, mask=mask)
    # Normalise the stored (rounded) residual, as the reference does.
    s = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / n_cols + eps)
    normed = (s * rstd).to(sum_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * out_stride + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act = a / (1.0 + tl.exp(-a))
    tl.store(out_ptr + offs, (act * b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_tanh_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = 0.7978845608028654 * (a + 0.044715 * a * a * a)
    act = 0.5 * a * (2.0 / (1.0 + tl.exp(-2.0 * u)))
    # The activation is rounded to gate's dtype before the product, as the model (and the
    # reference) does: with a wider up, the product is computed in up's dtype from it.
    act = act.to(gate_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs, (act * b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, x_stride, out_stride, d, ACT: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    a = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:  # silu(a) = a * sigmoid(a)
        act = a / (1.0 + tl.exp(-a))
    elif ACT == 1:  # exact gelu
        act = 0.5 * a * (1.0 + tl.math.erf(a * 0.7071067811865476))
    else:  # tanh approximation; tanh(u) = 2 / (1 + exp(-2u)) - 1
        u = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        act = 0.5 * a * (2.0 / (1.0 + tl.exp(-2.0 * u)))
    tl.store(out_ptr + row * out_stride + cols, (act * b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    x_ptr,
    out_ptr,
    cache_ptr,
    x_stride_t,
    x_stride_h,
    out_stride_t,
    out_stride_h,
    cache_stride,
    max_position,
    head_dim,
    half_rot,
    IS_NEOX: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    m = i < half_rot
    # A position past the cache is not read (checking it on the host would wait for the
    # device): its token's rotated features come out NaN, never another position's.
    valid = (pos >= 0) & (pos < max_position)
    row = cache_ptr + tl.where(valid, pos, 0) * cache_stride
    cos = tl.load(row + i, mask=m, other=0.0).to(tl.float32)
    sin = tl.load(row + half_rot + i, mask=m, other=0.0).to(tl.float32)
    cos = tl.where(valid, cos, float("nan"))
    sin = tl.where(valid, sin, float("nan"))
    src = x_ptr + token * x_stride_t + head * x_stride_h
    dst = out_ptr + token * out_stride_t + head * out_stride_h
    if IS_NEOX:  # feature i pairs with i + rot_dim / 2
        i1 = i
        i2 = i + half_rot
    else:  # feature 2i pairs with 2i + 1
        i1 = 2 * i
        i2 = 2 * i + 1
    x1 = tl.load(src + i1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2, mask=m, other=0.0).to(tl.float32)
    tl.store(dst + i1, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=m)
    tl.store(dst + i2, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=m)
    # Features past rot_dim pass through unchanged.
    j = tl.arange(0, BLOCK_DIM)
    rest = (j >= 2 * half_rot) & (j < head_dim)
    tl.store(dst + j, tl.load(src + j, mask=rest, other=0.0), mask=rest)


@triton.jit
def _rotate_row(
    src, cos_row, sin_row, dst, head_dim, half_rot,
    INTERLEAVED: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_DIM: tl.constexpr,
):  # fmt: skip
    p = tl.arange(0, BLOCK_HALF)
    m = p < half_rot
    if INTERLEAVED:  # feature 2p pairs with 2p + 1 (Cohere)
        i = 2 * p
        j = 2 * p + 1
    else:  # feature p pairs with p + rot_dim / 2 (GPT-NeoX)
        i = p
        j = p + half_rot
    x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + j, mask=m, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1) on the pairs: each
    # feature has its own cos and sin, as the reference reads them.
    cos1 = tl.load(cos_row + i, mask=m, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + j, mask=m, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row + i, mask=m, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + j, mask=m, other=0.0).to(tl.float32)
    tl.store(dst + i, (x1 * cos1 - x2 * sin1).to(dst.dtype.element_ty), mask=m)
    tl.store(dst + j, (x2 * cos2 + x1 * sin2).to(dst.dtype.element_ty), mask=m)
    # Features past rot_dim pass through unchanged.
    d = tl.arange(0, BLOCK_DIM)
    rest = (d >= 2 * half_rot) & (d < head_dim)
    tl.store(dst + d, tl.load(src + d, mask=rest, other=0.0), mask=rest)


@triton.jit
def _offsets(row, size_b, size_c, x_sa, x_sb, x_sc, c_sa, c_sb, c_sc, s_sa, s_sb, s_sc):
    # Where row ``row`` of leading dimensions (a, size_b, size_c) lies in x, cos and sin.
    a = row // (size_b * size_c)
    b = (row // size_c) % size_b
    c = row % size_c
    return (
        a * x_sa + b * x_sb + c * x_sc,
        a * c_sa + b * c_sb + c * c_sc,
        a * s_sa + b * s_sb + c * s_sc,
    )


@triton.jit
def _rotary_cos_sin_kernel(
    q_ptr, q_out, q_cos, q_sin, q_rows, q_b, q_c, q_sa, q_sb, q_sc, qc_sa, qc_sb, qc_sc,
    qs_sa, qs_sb, qs_sc, q_dim,
    k_ptr, k_out, k_cos, k_sin, k_b, k_c, k_sa, k_sb, k_sc, kc_sa, kc_sb, kc_sc,
    ks_sa, ks_sb, ks_sc, k_dim,
    half_rot,
    INTERLEAVED: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_DIM: tl.constexpr,
):  # fmt: skip
    # One program per row of q, then per row of k (one launch for both); each tensor's
    # leading dimensions are (a, b, c), its cos and sin are broadcast to them (stride 0
    # along broadcast dimensions, so they differ for q and k); out is contiguous.
    # Each branch makes its own call: q and k may differ in dtype, so their pointers
    # cannot merge into one variable after the branch.
    row = tl.program_id(0).to(tl.int64)
    if row < q_rows:
        x, c, s = _offsets(row, q_b, q_c, q_sa, q_sb, q_sc, qc_sa, qc_sb, qc_sc, qs_sa, qs_sb, qs_sc)  # fmt: skip
        _rotate_row(q_ptr + x, q_cos + c, q_sin + s, q_out + row * q_dim, q_dim,
                    half_rot, INTERLEAVED, BLOCK_HALF, BLOCK_DIM)  # fmt: skip
    else:
        r = row - q_rows
        x, c, s = _offsets(r, k_b, k_c, k_sa, k_sb, k_sc, kc_sa, kc_sb, kc_sc, ks_sa, ks_sb, ks_sc)
        _rotate_row(k_ptr + x, k_cos + c, k_sin + s, k_out + r * k_dim, k_dim,
                    half_rot, INTERLEAVED, BLOCK_HALF, BLOCK_DIM)  # fmt: skip


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, features]`` with unit stride along features (a view when possible)."""
    width = t.shape[-1]
    # reshape(-1, 0) cannot infer the row count of a tensor without features.
    t2 = t.reshape(-1, width) if width else t.reshape(math.prod(t.shape[:-1]), 0)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


# The kernels index a weight, a residual or a cache by the positions of x's own rows and
# features, unchecked: a tensor of another shape would be read, or written, past its end
# (kernreg_ops._shapes checks them).


def _check_hidden(n_cols: int) -> int:
    if n_cols > MAX_HIDDEN:
        raise ValueError(
            f"the Triton norm kernels take rows of at most {MAX_HIDDEN} features, got {n_cols}"
        )
    return _pow2(n_cols)


def _row_target(
    out: torch.Tensor | None, n_rows: int, n_cols: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Where a kernel writes its ``[n_rows, n_cols]`` result: a view of the caller's ``out``
    when its rows have unit stride along features, else a new tensor (copied into ``out``
    by :func:`_finish`)."""
    if out is not None:
        try:
            rows = out.view(n_rows, n_cols)
        except RuntimeError:  # rows not evenly strided: no such view
            pass
        else:
            if rows.stride(-1) == 1 or n_cols <= 1:
                return rows
    return torch.empty((n_rows, n_cols), dtype=dtype, device=device)


def _finish(out: torch.Tensor | None, written: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The op's result: ``out`` (holding what the kernel wrote), or the new tensor."""
    if out is None:
        return written.view(shape)  # new and contiguous: a view always
    if written.numel() and written.data_ptr() != out.data_ptr():
        out.copy_(written.view(shape))
    return out


def _rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype,
    offset: bool,
    out: torch.Tensor | None,
) -> torch.Tensor:
    check_floating(x=x)
    check_vector("weight", weight, x.shape[-1])
    if out is not None:
        check(out, x.shape, out_dtype, x.device, {"x": x, "weight": weight}, in_place="x")
    # In place (out is x): each program loads its whole row before storing it.
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    block = _check_hidden(n_cols)
    target = _row_target(out, n_rows, n_cols, out_dtype, x.device)
    if n_rows and n_cols:
        _rmsnorm_kernel[(n_rows,)](
            x2, weight.contiguous(), target, x2.stride(0), target.stride(0), n_cols, eps,
            OFFSET=offset, BLOCK=block, num_warps=_num_warps(block),
        )  # fmt: skip
    return _finish(out, target, x.shape)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    return _rmsnorm(x, weight, eps, torch.result_type(x, weight), offset=False, out=out)


def rmsnorm_offset(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    return _rmsnorm(x, weight, eps, x.dtype, offset=True, out=out)


def layernorm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    check_floating(x=x)
    check_vector("weight", weight, x.shape[-1])
    check_vector("bias", bias, x.shape[-1])
    if out is not None:
        inputs = {"x": x, "weight": weight, "bias": bias}
        check(out, x.shape, x.dtype, x.device, inputs, in_place="x")
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    block = _check_hidden(n_cols)
    target = _row_target(out, n_rows, n_cols, x.dtype, x.device)
    # An absent weight or bias is never read (HAS_WEIGHT / HAS_BIAS): x stands in for it.
    w = x2 if weight is None else weight.contiguous()
    b = x2 if bias is None else bias.contiguous()
    if n_rows and n_cols:
        _layernorm_kernel[(n_rows,)](
            x2, w, b, target, x2.stride(0), target.stride(0), n_cols, eps,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            BLOCK=block, num_warps=_num_warps(block),
        )  # fmt: skip
    return _finish(out, target, x.shape)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> None:
    check_floating(x=x, residual=residual)
    check_same_shape("residual", residual, x)
    check_vector("weight", weight, x.shape[-1])
    if not (x.is_contiguous() and residual.is_contiguous()):
        # The kernel writes rows in place: run on contiguous copies, then copy back.
        xc, rc = x.contiguous(), residual.contiguous()
        fused_add_rmsnorm(xc, rc, weight, eps)
        x.copy_(xc)
        residual.copy_(rc)
        return
    x2, r2 = _rows(x), _rows(residual)  # views: both are contiguous
    _add_rmsnorm(x2, r2, weight, eps, out=x2, summed=r2)


def _add_rmsnorm(
    x2: torch.Tensor,
    r2: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor,
    summed: torch.Tensor,
) -> None:
    """Write ``x2 + r2`` (rows) to ``summed`` and its RMSNorm to ``out``."""
    n_rows, n_cols = x2.shape
    block = _check_hidden(n_cols)
    if n_rows and n_cols:
        _add_rmsnorm_kernel[(n_rows,)](
            x2, r2, weight.contiguous(), out, summed,
            x2.stride(0), r2.stride(0), out.stride(0), summed.stride(0), n_cols, eps,
            BLOCK=block, num_warps=_num_warps(block),
        )  # fmt: skip


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_floating(x=x, residual=residual)
    shape = torch.Size(broadcast(x.shape, residual.shape))
    check_vector("weight", weight, shape[-1])
    out_dtype = torch.result_type(residual, weight)
    normed_out = summed_out = None
    if out is not None:
        normed_out, summed_out = check_pair(
            out,
            [(shape, out_dtype), (shape, residual.dtype)],
            x.device,
            {"x": x, "residual": residual, "weight": weight},
            in_place=("x", "residual"),
        )
    if x.shape != residual.shape:
        x, residual = torch.broadcast_tensors(x, residual)
    # In place (out=(x, residual)): each program loads its rows before storing them.
    x2, r2 = _rows(x), _rows(residual)
    n_rows, n_cols = x2.shape
    summed = _row_target(summed_out, n_rows, n_cols, residual.dtype, x.device)
    normed = _row_target(normed_out, n_rows, n_cols, out_dtype, x.device)
    _add_rmsnorm(x2, r2, weight, eps, out=normed, summed=summed)
    return _finish(normed_out, normed, shape), _finish(summed_out, summed, shape)


def _act_and_mul(x: torch.Tensor, act: int, out: torch.Tensor | None) -> torch.Tensor:
    check_floating(x=x)
    d = half_width(x)
    shape = torch.Size((*x.shape[:-1], d))
    if out is not None:
        check(out, shape, x.dtype, x.device, {"x": x}, in_place=None)
    x2 = _rows(x)
    n_rows = x2.shape[0]
    target = _row_target(out, n_rows, d, x.dtype, x.device)
    if n_rows and d:
        grid = (n_rows, _blocks(d))
        _act_and_mul_kernel[grid](
            x2, target, x2.stride(0), target.stride(0), d, ACT=act, BLOCK=_ACT_BLOCK
        )
    return _finish(out, target, shape)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    return _act_and_mul(x, _SILU, out)


def _gated(
    kernel: Any, gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None
) -> torch.Tensor:
    """An elementwise ``act(gate) * up`` kernel over the broadcast shape of ``gate`` and ``up``."""
    check_floating(gate=gate)
    shape = torch.Size(broadcast(gate.shape, up.shape))
    if out is not None:
        check(out, shape, dtype, gate.device, {"gate": gate, "up": up}, in_place="gate")
    if gate.shape != up.shape:
        gate, up = torch.broadcast_tensors(gate, up)
    # In place (out is gate): each element is loaded before it is stored.
    gate_c, up_c = gate.contiguous(), up.contiguous()
    n = gate_c.numel()
    direct = out is not None and out.is_contiguous()
    target = out if direct else torch.empty(shape, dtype=dtype, device=gate.device)
    if n:
        grid = (_blocks(n),)
        kernel[grid](gate_c, up_c, target, n, BLOCK=_ACT_BLOCK)
    if out is None or direct:
        return target
    return out.copy_(target)


def silu_mul(
    gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    return _gated(_silu_mul_kernel, gate, up, gate.dtype, out)


def gelu_tanh_mul(
    gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    return _gated(_gelu_tanh_mul_kernel, gate, up, torch.result_type(gate, up), out)


def gelu_and_mul(
    x: torch.Tensor, approximate: str = "none", *, out: torch.Tensor | None = None
) -> torch.Tensor:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', not {approximate!r}")
    return _act_and_mul(x, _GELU if approximate == "none" else _GELU_TANH, out)


def _rotate(
    positions: torch.Tensor, x: torch.Tensor, cache: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, heads, head_dim = x.shape
    half_rot = cache.shape[-1] // 2
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if tokens and heads:
        _rotary_kernel[(tokens, heads)](
            positions, x, out, cache,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), cache.stride(0),
            cache.shape[0], head_dim, half_rot,
            IS_NEOX=is_neox,
            BLOCK_HALF=_pow2(half_rot),
            BLOCK_DIM=_pow2(head_dim),
        )  # fmt: skip
    return out


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_floating(q=q, k=k)
    check_rotary(positions, q, k, cos_sin_cache)
    positions = positions.contiguous()
    cache = cos_sin_cache.contiguous()
    return _rotate(positions, q, cache, is_neox), _rotate(positions, k, cache, is_neox)


def _three_leading(t: torch.Tensor) -> torch.Tensor:
    """``t`` with exactly three leading dimensions before its last (size-1 ones added in front)."""
    while t.dim() < 4:
        t = t.unsqueeze(0)
    if t.dim() > 4:
        t = t.reshape(-1, *t.shape[-3:])
    return t


def _rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[Any]:
    """The kernel's arguments for ``x`` rotated by ``cos`` and ``sin`` (broadcast to it),
    checked: ``x`` with unit stride along features, its new contiguous result, cos and
    sin as read for it, its row count, sizes and strides (its own, then cos's and sin's)."""
    check_cos_sin(x, cos, sin)
    head_dim = x.shape[-1]
    leading = tuple(x.shape[:-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    x4 = _three_leading(x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    rows = out.numel() // head_dim if head_dim else 0
    cos3, cos_strides = _broadcast_to(cos, leading)
    sin3, sin_strides = _broadcast_to(sin, leading)
    geometry = [rows, x4.shape[1], x4.shape[2], *x4.stride()[:3], *cos_strides, *sin_strides]
    return [x4, out, cos3, sin3, *geometry]


def _broadcast_to(t: torch.Tensor, leading: tuple[int, ...]) -> tuple[torch.Tensor, list[int]]:
    """``t`` broadcast to ``leading`` as the kernel reads it: a tensor and the strides of
    its three leading dimensions (0 where it broadcasts), as :func:`_three_leading` of the
    expanded view gives them; the expanded view itself is made only past three."""
    if len(leading) > 3:  # merging leading dimensions of an expanded view may copy it
        t3 = _three_leading(t.expand(*leading, t.shape[-1]))
        return t3, list(t3.stride()[:3])
    shape, stride = t.shape[:-1], t.stride()[:-1]
    missing = len(leading) - len(shape)
    return t, [0] * (3 - len(leading)) + [
        stride[i - missing] if i >= missing and shape[i - missing] != 1 else 0
        for i in range(len(leading))
    ]


def _rotate_pair(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` rotated in one launch (a decode step is bound by launches)."""
    check_floating(q=q, k=k)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    q_args, k_args = _rotation(q, cos, sin), _rotation(k, cos, sin)
    rows = q_args[4] + k_args[4]
    if rows:
        rot_dim = cos.shape[-1]
        del k_args[4]  # the kernel takes q's row count alone
        _rotary_cos_sin_kernel[(rows,)](
            *q_args, q.shape[-1], *k_args, k.shape[-1], rot_dim // 2,
            INTERLEAVED=interleaved,
            BLOCK_HALF=_pow2(max(rot_dim // 2, 1)),
            BLOCK_DIM=_pow2(max(q.shape[-1], k.shape[-1])),
        )  # fmt: skip
    return q_args[1], k_args[1]


def rotary_cos_sin(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate_pair(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim), False)


def rotary_cos_sin_interleaved(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate_pair(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim), True)

"""Inputs an op of the pack cannot take are refused alike by every implementation, with a
``ValueError`` that says what was wrong: never a result computed from part of the input."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kernreg_ops")

from kernreg_ops import _aten, _compiled, _native, reference  # noqa: E402

HALVES_OPS = ("silu_and_mul", "gelu_and_mul")
EXPECTED = "x's last dimension holds the gate and up halves, so it must be even; got 7"


@pytest.mark.parametrize("impl", [reference, _native], ids=["reference", "native"])
@pytest.mark.parametrize("name", HALVES_OPS)
def test_an_odd_gate_up_width_is_refused(impl: object, name: str) -> None:
    x = torch.randn(3, 7)
    with pytest.raises(ValueError, match=r"must be even; got 7"):
        getattr(impl, name)(x)


def _shapes_refused() -> list[tuple[str, str, Any, str]]:
    """(case, function name, its arguments, what the message says) of shapes the Triton kernels
    refuse (the test below): every other implementation refuses them alike."""
    x, w = torch.randn(4, 64), torch.randn(64)
    q, k, cache = torch.randn(5, 4, 32), torch.randn(5, 2, 32), torch.randn(16, 32)
    q4, k4 = torch.randn(1, 4, 5, 32), torch.randn(1, 2, 5, 32)
    width = "weight must have shape (64,), x's last dimension; got "
    return [
        ("narrow weight", "rmsnorm", (x, torch.randn(32)), width + "(32,)"),
        ("one-element weight", "rmsnorm", (x, torch.randn(1)), width + "(1,)"),
        ("two-dimensional weight", "rmsnorm", (x, torch.randn(1, 64)), width + "(1, 64)"),
        ("wide weight", "rmsnorm_offset", (x, torch.randn(128)), width + "(128,)"),
        ("one-element weight", "rmsnorm_offset", (x, torch.randn(1)), width + "(1,)"),
        ("narrow bias", "layernorm", (x, w, torch.randn(32)), "bias must have shape (64,)"),
        ("one-element weight", "layernorm", (x, torch.randn(1)), width + "(1,)"),
        ("narrow weight", "add_rmsnorm", (x, x.clone(), torch.randn(32)), width + "(32,)"),
        ("one-element weight", "add_rmsnorm", (x, x.clone(), torch.randn(1)), width + "(1,)"),
        ("narrow weight", "fused_add_rmsnorm", (x.clone(), x.clone(), torch.randn(32)), width),
        ("one-element weight", "fused_add_rmsnorm", (x.clone(), x.clone(), torch.randn(1)), width),
        (
            "residual of other rows",
            "fused_add_rmsnorm",
            (torch.randn(1, 64), torch.randn(4, 64), w),
            "residual must have x's shape (1, 64); got (4, 64)",
        ),
        (
            "positions of other tokens",
            "rotary",
            (torch.arange(3), q, k, cache),
            "positions must hold one position per token",
        ),
        (
            "cache wider than the head",
            "rotary",
            (torch.arange(5), q, k, torch.randn(16, 48)),
            "cos_sin_cache must be",
        ),
        (
            "odd cos and sin",
            "rotary_cos_sin",
            (q4, k4, torch.randn(1, 5, 41), torch.randn(1, 5, 41)),
            "cos and sin have 41",
        ),
        (
            "odd cos and sin",
            "rotary_cos_sin_interleaved",
            (q4, k4, torch.randn(1, 5, 41), torch.randn(1, 5, 41)),
            "cos and sin have 41",
        ),
        (
            "cos and sin of more rows",
            "rotary_cos_sin",
            (q4, k4, torch.randn(2, 6, 5, 32), torch.randn(2, 6, 5, 32), 0),
            "do not broadcast to (1, 4, 5, 32)",
        ),
        (
            "cos and sin of a wider batch",
            "rotary_cos_sin",
            (q4, k4, torch.randn(2, 5, 32), torch.randn(2, 5, 32)),
            "broadcast beyond (1, 4, 5, 32)",
        ),
        (
            "cos and sin of a wider batch",
            "rotary_cos_sin_interleaved",
            (q4, k4, torch.randn(2, 5, 32), torch.randn(2, 5, 32)),
            "broadcast beyond (1, 4, 5, 32)",
        ),
    ]


IMPLEMENTATIONS = {"reference": reference, "native": _native, "aten": _aten}
REFUSED = [
    pytest.param(impl, index, id=f"{case[1]}-{case[0]}-{impl}")
    for index, case in enumerate(_shapes_refused())
    for impl, module in IMPLEMENTATIONS.items()
    if hasattr(module, case[1])
]


@pytest.mark.parametrize(("impl", "index"), REFUSED)
def test_every_implementation_refuses_what_the_triton_kernels_refuse(impl: str, index: int) -> None:
    # The reference took a one-element weight as a scale for every feature, and every
    # implementation but Triton's raised torch's own RuntimeError for the others: an op
    # refused an input on one device and not on another, or with another error type.
    _, name, args, message = _shapes_refused()[index]
    function = getattr(IMPLEMENTATIONS[impl], name)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(ValueError, match=re.escape(message)):
        function(*args)
    for arg, was in zip(args, before, strict=True):  # refused before anything is written
        assert not isinstance(arg, torch.Tensor) or torch.equal(arg, was)


def _integer_calls() -> list[tuple[str, str, Any]]:
    """(case, op object name, its arguments) of calls with an integer activation."""
    xi, wi = torch.arange(12).view(3, 4), torch.ones(4, dtype=torch.long)
    x, w = torch.randn(3, 4), torch.randn(4)
    qi, q, cs = (
        torch.ones(1, 2, 3, 4, dtype=torch.long),
        torch.randn(1, 2, 3, 4),
        torch.ones(1, 3, 4),
    )
    routed = (torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))
    return [
        ("x", "rmsnorm", (xi, wi)),
        ("x", "rmsnorm_offset", (xi, wi)),
        ("x", "layernorm", (xi, wi)),
        ("x", "silu_and_mul", (xi,)),
        ("x", "gelu_and_mul", (xi,)),
        ("gate", "silu_mul", (xi, xi)),
        ("gate", "gelu_tanh_mul", (xi, xi)),
        ("x", "add_rmsnorm", (xi, xi, wi)),
        ("residual", "add_rmsnorm", (x, xi, w)),
        ("residual", "fused_add_rmsnorm", (x.clone(), xi.clone(), w)),
        ("q", "rotary_cos_sin", (qi, qi, cs, cs)),
        ("k", "rotary_cos_sin", (q, qi, cs, cs)),
        ("q", "rotary_cos_sin_interleaved", (qi, qi, cs, cs)),
        ("k", "rotary_cos_sin_interleaved", (q, qi, cs, cs)),
        ("q", "rotary", (torch.arange(3), xi[:, None], xi[:, None], torch.ones(8, 4))),
        ("hidden_states", "experts", (xi, *routed, torch.ones(2, 4, 4), torch.ones(2, 4, 2))),
    ]


@pytest.mark.parametrize(
    "index", range(len(_integer_calls())), ids=[f"{c[1]}-{c[0]}" for c in _integer_calls()]
)
def test_an_integer_activation_is_refused_never_truncated(index: int) -> None:
    # The reference computed in float32 and rounded back to the input's dtype: rmsnorm of
    # an int64 x gave zeros and ones, rotary of an int64 k rotated values truncated; the
    # native fused_add_rmsnorm wrote an int64 residual before torch refused it.
    from kernreg_ops import ops

    name, op, args = _integer_calls()[index]
    before = [a.clone() for a in args]
    with pytest.raises(ValueError, match=rf"^{name} must be a floating-point tensor; got int64$"):
        getattr(ops, op)(*args)
    for arg, was in zip(args, before, strict=True):  # refused before anything is written
        assert torch.equal(arg, was)


def test_the_compiled_fused_add_rmsnorm_refuses_a_residual_of_other_rows() -> None:
    x, residual = torch.randn(1, 64), torch.randn(4, 64)
    kept = residual.clone()
    with pytest.raises(ValueError, match=r"residual must have x's shape \(1, 64\)"):
        _compiled.fused_add_rmsnorm(x, residual, torch.randn(64))
    assert torch.equal(residual, kept)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_triton_kernels_refuse_an_odd_gate_up_width() -> None:
    code = textwrap.dedent(
        """
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch
        from kernreg_ops import _triton
        for name in ("silu_and_mul", "gelu_and_mul"):
            try:
                getattr(_triton, name)(torch.randn(3, 7))
            except ValueError as exc:
                print("refused", exc)
            else:
                print("computed")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines == ["refused " + EXPECTED] * 2


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_triton_kernels_refuse_shapes_they_would_read_past() -> None:
    # Each kernel indexes its weight, residual or cache by x's own rows and features: a
    # tensor of another shape was read (or written) past its end, a result of garbage.
    code = textwrap.dedent(
        """
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch
        from kernreg_ops import _triton
        x, w = torch.randn(4, 64), torch.randn(64)
        q, k, cache = torch.randn(5, 4, 32), torch.randn(5, 2, 32), torch.randn(16, 32)
        cases = [
            lambda: _triton.rmsnorm(x, torch.randn(32)),
            lambda: _triton.rmsnorm(x, torch.randn(1)),
            lambda: _triton.rmsnorm_offset(x, torch.randn(128)),
            lambda: _triton.layernorm(x, w, torch.randn(32)),
            lambda: _triton.add_rmsnorm(x, x.clone(), torch.randn(32)),
            lambda: _triton.fused_add_rmsnorm(x.clone(), torch.randn(2, 64), w),
            lambda: _triton.rotary(torch.arange(3), q, k, cache),
            lambda: _triton.rotary(torch.arange(5), q, k, torch.randn(16, 48)),
            lambda: _triton.rotary(torch.arange(5), q, k, torch.randn(16, 7)),
        ]
        for case in cases:
            try:
                case()
            except ValueError as exc:
                print("refused", exc)
            else:
                print("computed")
        # A position past the cache is not read: that token comes out NaN, the others right.
        q_out, _ = _triton.rotary(torch.tensor([0, 1, 2, 3, 16]), q, k, cache)
        print("nan rows", q_out.isnan().flatten(1).all(1).tolist())
        # Rows without features: an empty result, as the reference gives.
        print("empty", tuple(_triton.rmsnorm(torch.randn(4, 0), torch.randn(0)).shape))
        # An integer input the dispatcher does not look at (it reads x's and q's dtypes).
        xi, q4, cs = torch.ones(4, 64, dtype=torch.long), torch.randn(1, 2, 3, 4), torch.ones(1, 3, 4)
        for case in [
            lambda: _triton.add_rmsnorm(x, xi, w),
            lambda: _triton.fused_add_rmsnorm(x.clone(), xi.clone(), w),
            lambda: _triton.rotary_cos_sin(q4, q4.long(), cs, cs),
            lambda: _triton.rotary(torch.arange(5), q, k.long(), cache),
        ]:
            try:
                case()
            except ValueError as exc:
                print("refused", exc)
            else:
                print("computed")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[:9] == [
        "refused weight must have shape (64,), x's last dimension; got (32,)",
        "refused weight must have shape (64,), x's last dimension; got (1,)",
        "refused weight must have shape (64,), x's last dimension; got (128,)",
        "refused bias must have shape (64,), x's last dimension; got (32,)",
        "refused weight must have shape (64,), x's last dimension; got (32,)",
        "refused residual must have x's shape (4, 64); got (2, 64)",
        "refused positions must hold one position per token of q and k: positions (3,), "
        "q (5, 4, 32), k (5, 2, 32)",
        "refused cos_sin_cache must be [max_position, rot_dim] with an even rot_dim of at "
        "most the head size 32; got (16, 48)",
        "refused cos_sin_cache must be [max_position, rot_dim] with an even rot_dim of at "
        "most the head size 32; got (16, 7)",
    ]
    assert lines[9:11] == ["nan rows [False, False, False, False, True]", "empty (4, 0)"]
    assert lines[11:] == [
        "refused residual must be a floating-point tensor; got int64",
        "refused residual must be a floating-point tensor; got int64",
        "refused k must be a floating-point tensor; got int64",
        "refused k must be a floating-point tensor; got int64",
    ]

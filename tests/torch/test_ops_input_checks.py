"""Inputs an op of the pack cannot take are refused alike by every implementation, with a
``ValueError`` that says what was wrong: never a result computed from part of the input."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kernreg_ops")

from kernreg_ops import _native, reference  # noqa: E402

HALVES_OPS = ("silu_and_mul", "gelu_and_mul")
EXPECTED = "x's last dimension holds the gate and up halves, so it must be even; got 7"


@pytest.mark.parametrize("impl", [reference, _native], ids=["reference", "native"])
@pytest.mark.parametrize("name", HALVES_OPS)
def test_an_odd_gate_up_width_is_refused(impl: object, name: str) -> None:
    x = torch.randn(3, 7)
    with pytest.raises(ValueError, match=r"must be even; got 7"):
        getattr(impl, name)(x)


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
    assert lines[9:] == ["nan rows [False, False, False, False, True]", "empty (4, 0)"]

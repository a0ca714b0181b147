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

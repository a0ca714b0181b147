"""kernreg.torch.testing: one test per implementation, skips that say why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
kernreg_ops = pytest.importorskip("kernreg_ops")

from kernreg import KernelSpec  # noqa: E402
from kernreg._packages import missing_reason  # noqa: E402
from kernreg.torch.testing import (  # noqa: E402
    implementation_params,
    parametrize_implementations,
)
from kernreg_ops import reference  # noqa: E402


def test_params_of_the_pack_on_cpu() -> None:
    params = {p.id: p for p in implementation_params("layernorm.rmsnorm", dtype="bfloat16")}
    assert list(params) == ["aten", "triton", "torch_compile", "torch"]
    (skip,) = params["triton"].marks
    assert skip.name == "skip"
    package = missing_reason("triton>=2.1")  # None where the test install has triton
    assert skip.kwargs[
        "reason"
    ] == "triton cannot run here: needs device cuda>=8.0, platform is cpu" + (
        f"; {package}" if package else ""
    )
    assert all(not params[label].marks for label in ("aten", "torch"))
    # The compile switch is process state, off by default: decided (and skipped) up front.
    (off,) = params["torch_compile"].marks
    assert off.kwargs["reason"].endswith(
        "when predicate is false (process state, checked when deciding)"
    )
    assert all(isinstance(p.values[0], KernelSpec) for p in params.values())


def test_params_for_another_platform() -> None:
    params = {p.id: p for p in implementation_params("layernorm.rmsnorm", platform="cuda:9.0")}
    package = missing_reason("triton>=2.1")
    if package is None:  # triton is installed: on an H100 it would run
        assert not params["triton"].marks
        return
    (skip,) = params["triton"].marks
    assert skip.kwargs["reason"].endswith("package triton is not installed (needs triton>=2.1)")


@parametrize_implementations("activation.silu_and_mul")
def test_silu_and_mul_each_implementation(implementation: KernelSpec) -> None:
    if implementation.backend == "torch_compile":
        pytest.skip("compiled implementations are covered by the parity tests")
    x = torch.randn(3, 8)
    torch.testing.assert_close(implementation.load()(x), reference.silu_and_mul(x))


def test_the_helper_marks_the_test(tmp_path: Path) -> None:
    (tmp_path / "test_rms.py").write_text(
        "from kernreg.torch.testing import parametrize_implementations\n"
        "\n"
        "@parametrize_implementations('layernorm.rmsnorm', dtype='float32')\n"
        "def test_rms(implementation):\n"
        "    assert implementation.op == 'layernorm.rmsnorm'\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider",
         "-k", "not torch_compile", "test_rms.py"],
        cwd=tmp_path, capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out
    assert "test_rms[aten] PASSED" in out
    assert "test_rms[torch] PASSED" in out
    assert "test_rms[triton] SKIPPED" in out
    assert "triton cannot run here: needs device cuda>=8.0, platform is cpu" in out
    assert "2 passed, 1 skipped, 1 deselected" in out

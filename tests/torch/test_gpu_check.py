"""``benchmarks/gpu_check.py`` on a machine without a CUDA device: a message and exit 0, or,
with ``--interpret``, the Triton kernels' parity through Triton's interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kernreg_ops")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CUDA device is here: gpu_check measures it instead"
)


def _gpu_check(*args: str) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KERNREG_") and k != "TRITON_INTERPRET"
    }
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=600,
    )


def test_without_a_gpu_it_says_so_and_succeeds() -> None:
    result = _gpu_check("--quick")
    assert result.returncode == 0, result.stderr
    assert "no CUDA device available" in result.stdout
    assert result.stderr == ""


@pytest.mark.parametrize("value", ["-1", "nan", "soon"])
def test_a_time_limit_that_is_no_number_of_seconds_is_a_usage_error(value: str) -> None:
    result = _gpu_check("--max-seconds", value)
    assert result.returncode == 2
    assert "--max-seconds" in result.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (pip install -c constraints.txt triton)",
)
def test_interpret_checks_every_triton_kernel() -> None:
    result = _gpu_check("--quick", "--interpret")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines()]
    passed = {(row[0], row[2]) for row in rows if len(row) > 3 and row[1:4:2] == ["triton", "pass"]}
    import kernreg_ops

    with_triton = {op for op in kernreg_ops.OPS if op != "moe.experts"}  # it has no Triton kernel
    assert passed == {(op, d) for op in with_triton for d in ("float32", "float16", "bfloat16")}
    assert result.stdout.rstrip().endswith("every Triton kernel agrees with the reference")

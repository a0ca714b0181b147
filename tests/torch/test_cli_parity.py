"""``kernreg parity``: a table, JSON, and exit status 1 on a mismatch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("click")

from _support import kernreg_cli_batch

BROKEN = """
import kernreg, torch
from kernreg.torch import inputs

@kernreg.op("demo.double")
def double(x):
    return x * 2

@double.register("sloppy", priority=1)
def sloppy(x):
    return x * 2.5

@inputs("demo.double", dtypes=["float32"])
def double_inputs(dtype, device, seed):
    return (torch.ones(3, dtype=dtype, device=device),), {}
"""


def _kernreg(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    return subprocess.run(
        [sys.executable, "-m", "kernreg", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        check=False,
    )


def test_all_ops_of_the_pack_pass_as_json() -> None:
    result = _kernreg("parity", "--all", "--dtype", "float32", "--seed", "0", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["ok"] is True
    assert {r["op"] for r in data["reports"]} >= {"layernorm.rmsnorm", "embedding.rotary"}


def test_a_mismatch_fails_with_a_table(tmp_path: Path) -> None:
    (tmp_path / "broken_kernels.py").write_text(BROKEN)
    result = _kernreg("parity", "demo.double", "-m", "broken_kernels", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    (row,) = [line for line in lines if "sloppy" in line]
    assert row.split()[:4] == ["demo.double", "sloppy", "float32", "fail"]
    assert "values outside atol=1e-05, rtol=1e-05" in row
    assert lines[-1] == "1 op(s) checked: 2 failing case(s)"


def test_usage_errors() -> None:
    no_op, bad_op = kernreg_cli_batch(("parity",), ("parity", "Not-An-Op"))
    assert no_op.returncode == 2
    assert "give one OP or --all" in no_op.stderr
    assert bad_op.returncode == 2


GENERATOR_RAISES = """
import kernreg
from kernreg.torch import inputs

@kernreg.op("demo.broken")
def broken(x):
    return x

@inputs("demo.broken", dtypes=["float32"])
def broken_inputs(dtype, device, seed):
    raise RuntimeError("no inputs today")
"""


def test_all_goes_on_past_an_op_whose_generator_raises(tmp_path: Path) -> None:
    (tmp_path / "broken_generator.py").write_text(GENERATOR_RAISES)
    args = ("parity", "--all", "--dtype", "float32", "--seed", "0", "-m", "broken_generator")
    result = _kernreg(*args, "--json", cwd=tmp_path)
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert data["ok"] is False
    assert set(data["errors"]) == {"demo.broken"}
    assert "no inputs today" in data["errors"]["demo.broken"]
    assert {r["op"] for r in data["reports"]} >= {"layernorm.rmsnorm", "embedding.rotary"}
    table = _kernreg(*args, cwd=tmp_path)
    assert table.returncode == 1
    assert "op demo.broken could not be checked" in table.stderr
    assert "layernorm.rmsnorm" in table.stdout

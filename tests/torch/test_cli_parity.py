"""``kernreg parity``: a table, JSON, and exit status 1 on a mismatch."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from typing import Any

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

ALL = ("parity", "--all", "--dtype", "float32", "--seed", "0")
PAST_A_RAISING_GENERATOR = (*ALL, "-m", "broken_generator")
MISMATCH = ("parity", "demo.double", "-m", "broken_kernels")
#: The command lines of the tests below, in this order: a module given with -m adds its op
#: to the inventory of the commands after it.
COMMANDS = (
    ("parity",),
    ("parity", "Not-An-Op"),
    (*ALL, "--json"),
    (*PAST_A_RAISING_GENERATOR, "--json"),
    PAST_A_RAISING_GENERATOR,
    MISMATCH,
)


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, once_per_session: Callable[..., Any]
) -> dict[tuple[str, ...], subprocess.CompletedProcess[str]]:
    """:data:`COMMANDS` in one interpreter, once per test run (each one importing torch
    costs seconds), with the modules they name importable."""

    def run() -> list[list[Any]]:
        folder = tmp_path_factory.mktemp("parity_modules")
        (folder / "broken_kernels.py").write_text(BROKEN)
        (folder / "broken_generator.py").write_text(GENERATOR_RAISES)
        path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
        procs = kernreg_cli_batch(*COMMANDS, env={"PYTHONPATH": path})
        return [[p.returncode, p.stdout, p.stderr] for p in procs]

    results = once_per_session("cli_parity_commands", run)
    return {
        argv: subprocess.CompletedProcess(["kernreg", *argv], code, out, err)
        for argv, (code, out, err) in zip(COMMANDS, results, strict=True)
    }


def test_all_ops_of_the_pack_pass_as_json(
    runs: dict[tuple[str, ...], subprocess.CompletedProcess[str]],
) -> None:
    result = runs[(*ALL, "--json")]
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["ok"] is True
    assert {r["op"] for r in data["reports"]} >= {"layernorm.rmsnorm", "embedding.rotary"}


def test_a_mismatch_fails_with_a_table(
    runs: dict[tuple[str, ...], subprocess.CompletedProcess[str]],
) -> None:
    result = runs[MISMATCH]
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    (row,) = [line for line in lines if "sloppy" in line]
    assert row.split()[:4] == ["demo.double", "sloppy", "float32", "fail"]
    assert "values outside atol=1e-05, rtol=1e-05" in row
    assert lines[-1] == "1 op(s) checked: 2 failing case(s)"


def test_usage_errors(runs: dict[tuple[str, ...], subprocess.CompletedProcess[str]]) -> None:
    no_op, bad_op = runs[("parity",)], runs[("parity", "Not-An-Op")]
    assert no_op.returncode == 2
    assert "give one OP or --all" in no_op.stderr
    assert bad_op.returncode == 2


def test_all_goes_on_past_an_op_whose_generator_raises(
    runs: dict[tuple[str, ...], subprocess.CompletedProcess[str]],
) -> None:
    result = runs[(*PAST_A_RAISING_GENERATOR, "--json")]
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert data["ok"] is False
    assert set(data["errors"]) == {"demo.broken"}
    assert "no inputs today" in data["errors"]["demo.broken"]
    assert {r["op"] for r in data["reports"]} >= {"layernorm.rmsnorm", "embedding.rotary"}
    table = runs[PAST_A_RAISING_GENERATOR]
    assert table.returncode == 1
    assert "op demo.broken could not be checked" in table.stderr
    assert "layernorm.rmsnorm" in table.stdout

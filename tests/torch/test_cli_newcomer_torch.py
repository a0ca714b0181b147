"""`kernreg parity`, `bench` and `tune` as a new user meets them: the opt-in switch for
conditional implementations, warnings about noisy timings, a plot path that cannot be
written, honest labels for what was measured and what was compared."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("click")
pytest.importorskip("kernreg_ops")

from _support import kernreg_cli_batch

NOISY = """
import time

import kernreg, torch
from kernreg.torch import inputs

_calls = [0]

@kernreg.op("demo.jittery")
def jittery(x):
    return x + 1

@jittery.register("uneven", priority=1)
def uneven(x):
    _calls[0] += 1
    if _calls[0] % 2:
        time.sleep(0.004)  # every other call is slow: the interquartile range is wide
    return x + 1

@inputs("demo.jittery", dtypes=["float32"])
def jittery_inputs(dtype, device, seed):
    return (torch.ones(3, dtype=dtype, device=device),), {}
"""


def _kernreg(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    base["COLUMNS"] = "250"
    return subprocess.run(
        [sys.executable, "-m", "kernreg", *args],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        cwd=cwd,
        check=False,
        timeout=600,
    )


def _row(stdout: str, implementation: str) -> str:
    (row,) = [line for line in stdout.splitlines() if f"  {implementation}  " in line]
    return row


PARITY = ("parity", "activation.silu_and_mul", "--dtype", "float32", "--seed", "0")
BENCH = ("bench", "activation.silu_and_mul", "--quick", "--dtype", "float32")
ONE_CASE = ("--dtype", "float32", "--seed", "0")
#: The command lines of the tests below that change nothing a later one sees; those that
#: compile the torch_compile implementation last.
COMMANDS = (
    PARITY,
    BENCH,
    ("parity", "embedding.rotary", *ONE_CASE),
    ("parity", "embedding.rotary", *ONE_CASE, "--json"),
    ("parity", "layernorm.rmsnorm", *ONE_CASE),
    (*PARITY, "--conditional"),
    (*PARITY, "--allow-compile", "--json"),
    (*BENCH, "--conditional"),
)


@pytest.fixture(scope="module")
def runs(
    once_per_session: Callable[..., Any],
) -> dict[tuple[str, ...], subprocess.CompletedProcess[str]]:
    """:data:`COMMANDS` in one interpreter, once per test run (importing torch and compiling
    with inductor cost seconds per interpreter)."""
    results = once_per_session(
        "newcomer_torch_commands",
        lambda: [[p.returncode, p.stdout, p.stderr] for p in _batch(*COMMANDS)],
    )
    return {
        argv: subprocess.CompletedProcess(["kernreg", *argv], code, out, err)
        for argv, (code, out, err) in zip(COMMANDS, results, strict=True)
    }


# --- conditional implementations ------------------------------------------------------------


def test_parity_says_how_to_include_the_opt_in_implementations(
    runs: dict[tuple[str, ...], subprocess.CompletedProcess[str]],
) -> None:
    result = runs[PARITY]
    assert result.returncode == 0, result.stderr
    row = _row(result.stdout, "torch_compile")
    assert "skipped" in row
    assert "when predicate is false" in row
    assert row.endswith("(--conditional runs it anyway)")


def _batch(*argvs: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
    """The command lines in one interpreter (compiling, importing torch: once)."""
    return kernreg_cli_batch(*argvs, env={"COLUMNS": "250"})


def test_parity_with_the_switch_checks_the_torch_compile_implementation(
    runs: dict[tuple[str, ...], subprocess.CompletedProcess[str]],
) -> None:
    result, alias = runs[(*PARITY, "--conditional")], runs[(*PARITY, "--allow-compile", "--json")]
    assert result.returncode == 0, result.stdout + result.stderr
    assert _row(result.stdout, "torch_compile").split()[2:4] == ["float32", "pass"]
    data = json.loads(alias.stdout)
    (report,) = data["reports"]
    statuses = {r["implementation"]: r["status"] for r in report["results"]}
    assert statuses["torch_compile"] == "pass"
    assert data["nothing_compared"] == []


def test_bench_with_the_switch_times_the_torch_compile_implementation(
    runs: dict[tuple[str, ...], subprocess.CompletedProcess[str]],
) -> None:
    without, result = runs[BENCH], runs[(*BENCH, "--conditional")]
    assert result.returncode == 0, result.stderr
    row = _row(result.stdout, "torch_compile")
    assert row.split()[:3] == ["activation.silu_and_mul", "torch_compile", "float32"]
    (skip,) = [
        line
        for line in without.stdout.splitlines()
        if line.startswith("  torch_compile (activation.silu_and_mul): when predicate is false")
    ]
    assert skip.endswith("(--conditional runs it anyway)")


# --- parity: nothing compared ---------------------------------------------------------------


def test_parity_where_only_the_reference_ran_says_nothing_was_compared(
    runs: dict[tuple[str, ...], subprocess.CompletedProcess[str]],
) -> None:
    result, as_json, compared = (
        runs[("parity", "embedding.rotary", *ONE_CASE)],
        runs[("parity", "embedding.rotary", *ONE_CASE, "--json")],
        runs[("parity", "layernorm.rmsnorm", *ONE_CASE)],
    )
    assert result.returncode == 0, result.stderr
    summary = result.stdout.splitlines()[-1]
    assert (
        summary
        == "1 op(s) checked: nothing was compared: only the reference ran (see the skipped rows)"
    )
    assert "agree" not in summary
    data = json.loads(as_json.stdout)
    assert data["nothing_compared"] == ["embedding.rotary"]
    assert compared.stdout.splitlines()[-1] == (
        "1 op(s) checked: all implementations that ran agree with the reference"
    )


# --- bench: noise, rounds, plot path ---------------------------------------------------------


def test_bench_warns_about_a_noisy_timing_and_shows_calls(tmp_path: Path) -> None:
    (tmp_path / "noisy_kernels.py").write_text(NOISY)
    result = _kernreg(
        "bench", "demo.jittery", "-m", "noisy_kernels", "--repeats", "8", "--warmup", "1",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if "  uneven  " in line]
    assert len(rows) == 2  # one per input case
    header = next(line for line in result.stdout.splitlines() if "IMPLEMENTATION" in line)
    calls_at = header.index("CALLS")
    for row in rows:
        assert "(noisy)" in row
        assert int(row[calls_at:].split()[0]) >= 8  # CALLS: at least --repeats
    (warning,) = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert "too noisy to trust (the 95% interval of the median stayed wider than +-5%" in warning
    assert "demo.jittery uneven float32 seed0" in warning
    assert warning.endswith(
        "Give them more time (--max-time), or rerun when the machine is less busy."
    )


def test_bench_plot_into_a_missing_folder_fails_before_timing(tmp_path: Path) -> None:
    path = tmp_path / "no" / "such" / "x.png"
    result = _kernreg("bench", "layernorm.rmsnorm", "--quick", "--plot", str(path))
    assert result.returncode == 1
    assert result.stderr.splitlines()[0] == (
        f"error: cannot write the plot '{path}': folder {path.parent} does not exist"
    )
    assert "done in" not in result.stderr  # nothing was timed
    assert result.stdout == ""


# --- tune: what was measured ----------------------------------------------------------------


def test_tune_labels_fresh_measurements_measured(tmp_path: Path) -> None:
    env = {"KERNREG_CACHE_DIR": str(tmp_path)}
    args = ("tune", "layernorm.rmsnorm", "--quick", "--dtype", "float32")
    first = _kernreg(*args, env=env)
    assert first.returncode == 0, first.stderr
    assert _row(first.stdout, "float32").split()[-1] == "measured"
    # A second process reads what the first stored (and, in the same one, an op with one
    # implementation has nothing to measure).
    again, alone = kernreg_cli_batch(
        args, ("tune", "embedding.rotary", "--quick", "--dtype", "float32"),
        env={**env, "COLUMNS": "250"},
    )  # fmt: skip
    assert _row(again.stdout, "float32").split()[-1] == "stored"
    assert alone.returncode == 0, alone.stderr
    assert _row(alone.stdout, "float32").endswith("nothing to measure")


# --- parity and bench in a real terminal ----------------------------------------------------

TERMINAL_PARITY = ("parity", "layernorm.rmsnorm", "--dtype", "float32", "--seed", "0")
TERMINAL_BENCH = ("bench", "layernorm.rmsnorm", "--quick", "--dtype", "bfloat16")
DUMB_BENCH = ("bench", "layernorm.rmsnorm", "--quick", "--dtype", "float32")
#: ``(columns, command line, environment)`` of the tests below.
TERMINAL_RUNS: tuple[tuple[int, tuple[str, ...], dict[str, str]], ...] = (
    *((columns, TERMINAL_PARITY, {}) for columns in (80, 100, 160)),
    *((columns, TERMINAL_BENCH, {}) for columns in (80, 100, 160)),
    (60, TERMINAL_PARITY, {}),
    (80, DUMB_BENCH, {"TERM": "dumb"}),
)


@pytest.fixture(scope="module")
def terminal(once_per_session: Callable[..., Any]) -> dict[Any, tuple[int, str]]:
    """``(columns, command line) -> (exit status, raw output)`` of :data:`TERMINAL_RUNS` on a
    pseudo-terminal, in one interpreter, once per test run."""
    from tests.test_cli_terminal import in_terminal_batch

    results = once_per_session(
        "newcomer_torch_terminal",
        lambda: in_terminal_batch(*TERMINAL_RUNS, plugins=True, raw=True),
    )
    return {
        (columns, args): (code, text)
        for (columns, args, _), (code, text) in zip(TERMINAL_RUNS, results, strict=True)
    }


@pytest.mark.parametrize("columns", [80, 100, 160])
def test_parity_and_bench_fit_a_real_terminal(
    terminal: dict[Any, tuple[int, str]], columns: int
) -> None:
    from tests.test_cli_terminal import ANSI, assert_fits

    code, text = terminal[(columns, TERMINAL_PARITY)]
    text = ANSI.sub("", text)
    assert code == 0, text
    assert_fits(text, columns)
    rows = [line.split() for line in text.splitlines()]
    # The implementation, dtype and status are whole.
    assert any(r[r.index("aten") :][:3] == ["aten", "float32", "pass"] for r in rows if "aten" in r)
    assert "(reference)  float32  pass" in text, text
    code, text = terminal[(columns, TERMINAL_BENCH)]
    text = ANSI.sub("", text)
    assert code == 0, text
    assert_fits(text, columns)
    assert "0/?" not in text
    assert "\x1b" not in text
    # DIMS is left out below 160 columns; the median keeps its unit and interval.
    (aten,) = [
        line for line in text.splitlines() if re.search(r"\baten\s+bfloat16\s+small\s", line)
    ]
    assert re.search(r"\s\d+(\.\d+)? [mun]?s \+-\d+\.\d%", aten), aten
    assert re.search(r"\d\.\d\dx \[\d+\.\d\d-\d+\.\d\d\]", aten), aten


def test_parity_in_a_narrow_terminal_keeps_the_answer_whole(
    terminal: dict[Any, tuple[int, str]],
) -> None:
    from tests.test_cli_terminal import ANSI, assert_fits

    code, text = terminal[(60, TERMINAL_PARITY)]
    text = ANSI.sub("", text)
    assert code == 0, text
    assert_fits(text, 60)
    # Implementation, dtype, status and error whole; the detail on the lines below.
    assert re.search(r"^  torch \(reference\)  float32  pass +-\n {6}reference", text, re.M), text
    assert re.search(r"^  aten +float32  pass +\S+\n {6}\S", text, re.M), text


def test_bench_in_a_dumb_terminal_writes_no_escape_sequences(
    terminal: dict[Any, tuple[int, str]],
) -> None:
    code, text = terminal[(80, DUMB_BENCH)]
    assert code == 0, text
    assert "\x1b" not in text  # no colours, no line erased in place
    assert "bench layernorm.rmsnorm: done in " in text  # one plain progress line per op
    assert "\r" not in text.replace("\r\n", "\n")

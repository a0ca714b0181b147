"""``kernreg list`` on a 10,000-spec inventory (budget: < 1 s, the whole command).

Method
------
* A module that registers 10,000 specs on import (2,000 ops with five implementations
  each: a torch reference, Triton for CUDA >= 8.0 and two dtypes, a Hopper-only CUDA
  variant, a ROCm build, and a vendor library gated by an installed package) is written
  to a temporary directory.
* ``python -m kernreg -m <module> list --platform cuda:9.0`` (and the same with
  ``--json``) runs in a fresh interpreter with stdout to a pipe (so the plain table, as
  in CI logs and pipes), ``KERNREG_PLUGINS=none`` so installed plugins do not change
  the count. The figure is the median wall time of several runs: interpreter start-up,
  imports, registering the 10,000 specs, one decision per op and the output.
* The baseline is a fresh interpreter that only imports kernreg, the command line's
  modules and the inventory module: what any command costs before it does anything.
* The platform is given on the command line here, so the figure is the listing's own.

Every command on the detected platform (budget: <= 300 ms wall each)
--------------------------------------------------------------------
* ``kernreg list``, ``explain``, ``check``, ``platform``, ``lock -o`` and ``lock --check``
  run as a user runs them: installed plugins (the op pack) loaded, no ``KERNREG_*``
  variable, no ``--platform``, so the platform is detected (through the GPU drivers, never
  by importing torch). The figure is the median wall time of several fresh interpreters;
  the baseline is ``python -c pass``. A separate ``-X importtime`` run of each checks that
  neither torch nor numpy was imported.
* ``parity`` and ``bench`` run kernels, so they import torch by design; they are not
  measured here.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SPECS = 10_000
OPS = SPECS // 5
BUDGET_S = 1.0
COMMAND_BUDGET_S = 0.3
MODULE = "kernreg_bench_cli_inventory"

_SOURCE = f'''\
"""{SPECS:,} specs over {OPS:,} ops, registered on import."""

from kernreg import KernelSpec, register_kernel

for i in range({OPS}):
    op = f"group{{i // 100}}.op{{i}}"
    register_kernel(KernelSpec(op, "torch", "{MODULE}:kernel", reference=True))
    register_kernel(
        KernelSpec(
            op,
            "triton",
            "{MODULE}:kernel",
            requires=["cuda>=8.0"],
            dtypes=["bfloat16", "float16"],
            traits=["cuda_graph_safe", "compile_safe"],
            priority=10,
        )
    )
    register_kernel(
        KernelSpec(op, "cuda", "{MODULE}:kernel", variant="sm90", requires=["cuda==9.0"], priority=20)
    )
    register_kernel(
        KernelSpec(op, "aot", "{MODULE}:kernel", requires=["hip:gfx942"], priority=15)
    )
    register_kernel(
        KernelSpec(
            op,
            "vendor",
            "{MODULE}:kernel",
            requires=["cuda>=9.0"],
            packages=["kernreg-bench-no-such-dist>=1"],
            priority=30,
        )
    )


def kernel(x):
    return x
'''


def _env(directory: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    env["KERNREG_PLUGINS"] = "none"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), env.get("PYTHONPATH")]))
    return env


def _time(command: list[str], env: dict[str, str], repeat: int, rows: int = SPECS) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        times.append(time.perf_counter() - started)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr}")
        if "list" in command and "--json" not in command and proc.stdout.count("\n") < rows:
            raise RuntimeError(f"{' '.join(command)} printed too few rows")
    return statistics.median(times)


def _record(name: str, value: float, baseline: float, note: str) -> dict[str, Any]:
    return {
        "name": name,
        "value": value,
        "unit": "s",
        "budget": f"< {BUDGET_S:g} s",
        "baseline": f"start-up + import the inventory = {baseline:.3f} s",
        "ratio": value / baseline,
        "ok": value < BUDGET_S,
        "note": note,
    }


def run(quick: bool = False) -> list[dict[str, Any]]:
    repeat = 1 if quick else 5
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        (directory / f"{MODULE}.py").write_text(_SOURCE, encoding="utf-8")
        env = _env(directory)
        cli = [sys.executable, "-m", "kernreg", "-m", MODULE, "list", "--platform", "cuda:9.0"]
        # Compile the inventory module once, so no run pays for it.
        _time([sys.executable, "-c", f"import {MODULE}"], env, 1)
        baseline = _time(
            [sys.executable, "-c", f"import kernreg, kernreg.cli._app, {MODULE}"], env, repeat
        )
        table = _time(cli, env, repeat)
        as_json = _time([*cli, "--json"], env, repeat)
    runs = f"median of {repeat} runs, stdout a pipe"
    return [
        *run_commands(quick),
        _record(f"kernreg list, {SPECS:,} specs", table, baseline, f"{runs} (plain table)"),
        _record(
            f"kernreg list --json, {SPECS:,} specs", as_json, baseline, f"{runs} (compact JSON)"
        ),
    ]


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}


def _heavy_imports(command: list[str], env: dict[str, str]) -> list[str]:
    """torch or numpy, if running ``command`` imported them."""
    proc = subprocess.run(
        [command[0], "-X", "importtime", *command[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    names = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    return sorted(names & {"torch", "numpy"})


def run_commands(quick: bool = False) -> list[dict[str, Any]]:
    """Each command on the detected platform, against the 300 ms budget."""
    repeat = 1 if quick else 5
    env = _plain_env()
    baseline = _time([sys.executable, "-c", "pass"], env, repeat)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        plan = str(Path(tmp) / "plan.json")
        commands = [
            ["list"],
            ["explain", "layernorm.rmsnorm", "--dtype", "bfloat16"],
            ["check"],
            ["platform"],
            ["platform", "--json"],
            ["lock", "-o", plan],
            ["lock", "--check", "-o", plan],
        ]
        for args in commands:
            command = [sys.executable, "-m", "kernreg", *args]
            value = _time(command, env, repeat, rows=1)
            heavy = _heavy_imports(command, env)
            records.append(
                {
                    "name": f"kernreg {' '.join(a if a != plan else 'plan.json' for a in args)}",
                    "value": value * 1000,
                    "unit": "ms",
                    "budget": f"<= {COMMAND_BUDGET_S * 1000:g} ms",
                    "baseline": f"python -c pass = {baseline * 1000:.1f} ms",
                    "ratio": value / baseline,
                    "ok": value <= COMMAND_BUDGET_S and not heavy,
                    "note": f"median of {repeat} runs, detected platform, plugins loaded; "
                    + (f"imported {', '.join(heavy)}" if heavy else "no torch or numpy imported"),
                }
            )
    return records


if __name__ == "__main__":
    for record in run():
        print(
            f"{record['name']}: {record['value']:.3f} {record['unit']} "
            f"(budget {record['budget']}; {record['baseline']}; ok={record['ok']})"
        )

"""Defects found by using the integrated kernreg as users, attackers and peer systems do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("kernreg_ops")


def _kernreg(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    base.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "kernreg", *args],
        capture_output=True,
        text=True,
        env=base,
        cwd=cwd,
        timeout=180,
    )


def test_check_names_each_origin_of_a_problem_once() -> None:
    proc = _kernreg(
        "check",
        "--platform",
        "cuda:9.0",
        "--assume-package",
        "triton==3.4",
        "--json",
        env={"KERNREG_STRICT": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    problems = json.loads(proc.stdout)["problems"]
    assert problems, "the op pack's float64 fallbacks are reported under strict mode"
    for problem in problems:
        assert len(problem["origins"]) == len(set(problem["origins"])), problem

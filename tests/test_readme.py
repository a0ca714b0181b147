"""The README's examples run, print what the README says, and its tables stay true."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kernreg.config import ENV_VARS

README = Path(__file__).resolve().parents[1] / "README.md"
TEXT = README.read_text(encoding="utf-8")
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, re.S)


def test_the_readme_has_python_examples() -> None:
    assert len(PYTHON_BLOCKS) >= 3


def test_the_python_examples_run_and_print_what_they_claim() -> None:
    code = "\n".join(PYTHON_BLOCKS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    env["KERNREG_PLATFORM"] = "cpu"  # no torch import for detection: the examples need none
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    printed = {line.rstrip() for line in result.stdout.splitlines()}
    # Comment lines that show output (`# op ...` and the indented table rows under it).
    claimed = [
        line.strip()[2:].rstrip()
        for block in PYTHON_BLOCKS
        for line in block.splitlines()
        if line.strip().startswith(("# op ", "#   "))
    ]
    assert claimed, "the README shows no example output"
    missing = [line for line in claimed if line not in printed]
    assert not missing, f"README claims output that was not printed: {missing}\n{result.stdout}"


def test_the_environment_table_lists_every_variable() -> None:
    rows = dict(re.findall(r"^\| `(KERNREG_[A-Z_]+)` \|\s*(`?[a-z_]*`?)\s*\|", TEXT, re.M))
    assert set(rows) == set(ENV_VARS)
    for var, (toml_key, _) in ENV_VARS.items():
        assert rows[var].strip("`") == toml_key, var


def test_the_error_table_names_every_public_error() -> None:
    import kernreg

    errors = {name for name in kernreg.__all__ if name.endswith("Error") and name != "KernregError"}
    documented = set(re.findall(r"^\| `([A-Za-z]+Error)`", TEXT, re.M))
    assert errors <= documented, errors - documented

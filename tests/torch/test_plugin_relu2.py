"""A plugin for a new op, written from docs/plugins.md alone (tests/plugin_fixtures/relu2):
`activation.relu2` with a reference, a half-precision backend and an input generator with
named bench shapes, installed as a real distribution; and a second distribution that adds
a backend, declares a generator it does not own and ships an op without one.

Every command runs in a subprocess, as users run it (those with the same environment in
one, through ``kernreg.cli.main``: each process imports torch and loads the plugins).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("torch")
pytest.importorskip("click")

from _support import kernreg_cli_batch

FIXTURES = Path(__file__).resolve().parents[1] / "plugin_fixtures"
RELU2 = FIXTURES / "relu2"


def _wheels_helper() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_relu2_wheels", FIXTURES / "wheels.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both distributions built as wheels and pip-installed into one target directory."""
    helper = _wheels_helper()
    root = tmp_path_factory.mktemp("relu2")
    wheels = [
        helper.build_project(RELU2 / name, root / "wheels") for name in ("relu2_ops", "relu2_fork")
    ]
    job = helper.install(wheels, root / "site")
    output, _ = job.communicate()
    assert job.returncode == 0, output.decode()
    assert (root / "site" / "relu2_ops-1.0.0.dist-info" / "entry_points.txt").is_file()
    return root / "site"


def kernreg(
    site: Path, *args: str, env: Mapping[str, str] = ()
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_") and k != "COLUMNS"}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), base.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "kernreg", *args],
        env={**base, **dict(env)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def kernreg_batch(
    site: Path, *argvs: tuple[str, ...], env: Mapping[str, str] = ()
) -> list[subprocess.CompletedProcess[str]]:
    """``kernreg(site, *argv, env=env)`` for each of ``argvs``, in one interpreter."""
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return kernreg_cli_batch(*argvs, env={**dict(env), "PYTHONPATH": path})


ONLY_OPS = {"KERNREG_PLUGINS": "relu2-ops"}


@pytest.fixture(scope="module")
def only_ops(site: Path) -> dict[str, subprocess.CompletedProcess[str]]:
    """The commands of the tests below with relu2-ops alone, in one interpreter."""
    argvs = {
        "list --json": ("list", "activation.relu2", "--platform", "cpu", "--json"),
        "list": ("list", "activation.relu2", "--platform", "cpu"),
        "parity": ("parity", "activation.relu2", "--json"),
        "bench": ("bench", "activation.relu2", "--quick", "--json"),
    }
    # COLUMNS: the table's width; the JSON of the others does not depend on it.
    runs = kernreg_batch(site, *argvs.values(), env={**ONLY_OPS, "COLUMNS": "160"})
    return dict(zip(argvs, runs, strict=True))


def test_list_marks_what_calls_of_each_dtype_run(
    only_ops: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    data = json.loads(only_ops["list --json"].stdout)
    (op,) = data["ops"]
    assert op["chosen"] is None  # it depends on the dtype
    assert op["by_dtype"] == {
        "float32": {"chosen": "torch", "rule": "reference"},
        "float16": {"chosen": "half", "rule": "priority"},
        "bfloat16": {"chosen": "half", "rule": "priority"},
    }
    chosen_for = {i["label"]: i["chosen_for"] for i in op["implementations"]}
    assert chosen_for == {"half": ["float16", "bfloat16"], "torch": ["float32"]}
    table = only_ops["list"]
    assert table.returncode == 0, table.stderr
    rows = {
        line.split()[2]: line for line in table.stdout.splitlines() if "activation.relu2" in line
    }
    assert rows["half"].startswith("*")
    assert rows["half"].endswith("chosen for float16, bfloat16 (priority); rejected for float32")
    assert rows["torch"].startswith("*")
    assert rows["torch"].endswith("chosen for float32 (reference); eligible for float16, bfloat16")


def test_parity_and_bench_use_the_plugin_generator(
    only_ops: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    parity = only_ops["parity"]
    assert parity.returncode == 0, parity.stdout + parity.stderr
    (report,) = json.loads(parity.stdout)["reports"]
    checked = {(r["implementation"], r["dtype"], r["status"]) for r in report["results"]}
    assert ("half", "bfloat16", "pass") in checked
    assert ("half", "float16", "pass") in checked
    bench = only_ops["bench"]
    assert bench.returncode == 0, bench.stderr
    (timed,) = json.loads(bench.stdout)["reports"]
    assert {r["shape"] for r in timed["results"]} == {"small"}  # the first named shape
    assert {r["dims"]["hidden"] for r in timed["results"]} == {1024}


def test_a_second_generator_names_both_distributions_and_the_fix(site: Path) -> None:
    # Plugins load by distribution name: relu2-fork declares its generator first, so the
    # op's own distribution is the one that fails, undone whole, and both are named.
    env = {"KERNREG_PLUGINS": "relu2-ops,relu2-fork"}
    proc = kernreg(site, "list", "activation.*", "--platform", "cpu", env=env)
    assert proc.returncode == 0, proc.stderr
    assert (
        "op 'activation.relu2': input generator 'relu2_ops.inputs:relu2_inputs' from "
        "distribution relu2-ops conflicts with 'relu2_fork.inputs:relu2' from distribution "
        "relu2-fork, which declared it first"
    ) in proc.stderr
    assert (
        "hint: KERNREG_PLUGINS_DENY=relu2-ops keeps relu2-fork's generator "
        "(KERNREG_PLUGINS_DENY=relu2-fork keeps relu2-ops's)"
    ) in proc.stderr
    assert "half" not in proc.stdout.split()  # the failing plugin is undone whole
    # docs/plugins.md shows these lines as they are printed.
    docs = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
    (sample,) = [
        block.partition("\n```")[0]
        for block in docs.split("```text\n")[1:]
        if "op 'activation.relu2': input generator" in block.partition("```")[0]
    ]
    assert set(sample.splitlines()) <= set(proc.stderr.splitlines()), proc.stderr
    fixed = kernreg(
        site,
        "list",
        "activation.*",
        "--platform",
        "cpu",
        env={**env, "KERNREG_PLUGINS_DENY": "relu2-fork"},
    )
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stderr == ""
    assert "half" in fixed.stdout.split()


def test_a_misspelt_deny_name_suggests_the_installed_one(site: Path) -> None:
    env = {"KERNREG_PLUGINS": "relu2-ops,relu2-fork", "KERNREG_PLUGINS_DENY": "relu2-frok"}
    proc, check = kernreg_batch(
        site, ("list", "activation.*", "--platform", "cpu"), ("check", "--json"), env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "KERNREG_PLUGINS_DENY names 'relu2-frok', which ships no installed plugin, so it "
        "denies nothing; did you mean 'relu2-fork'?"
    ) in proc.stderr
    # The typo is not copied into the value that resolves the conflict.
    assert "hint: KERNREG_PLUGINS_DENY=relu2-ops keeps relu2-fork's generator" in proc.stderr
    assert "relu2-frok," not in proc.stderr
    problems = json.loads(check.stdout)["problems"]
    assert any(
        p["kind"] == "config" and "did you mean 'relu2-fork'?" in p["message"] for p in problems
    ), problems


def test_an_op_without_a_generator_escapes_parity_visibly(site: Path) -> None:
    env = {"KERNREG_PLUGINS": "relu2-fork"}
    parity = ("parity", "--all", "--dtype", "float32", "--seed", "0")
    proc, strict, checked = kernreg_batch(
        site, parity, (*parity, "--strict"), ("check", "--json"), env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not checked, no input generator: activation.relu3" in proc.stdout
    assert strict.returncode == 1, strict.stdout + strict.stderr
    check = json.loads(checked.stdout)
    (finding,) = [p for p in check["problems"] if p["kind"] == "no_inputs"]
    assert finding["op"] == "activation.relu3"
    assert finding["severity"] == "warning"
    assert "distribution relu2-fork" in finding["message"]

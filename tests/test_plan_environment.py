"""The environment record of a plan: versions written beside the decisions, drift warned about."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kernreg
from kernreg import KernelRegistry, KernelSpec, Platform
from kernreg._packages import parse_assumed
from kernreg.config import Config
from kernreg.plan import ENVIRONMENT_KEYS, PlanError, SelectionPlan, capture_environment
from kernreg.registry import build_plan


def _registry(config: Config | None = None) -> KernelRegistry:
    registry = KernelRegistry(config=config or Config(), platform=Platform("cpu"))
    registry.register(KernelSpec("demo.op", "torch", "json:dumps", reference=True))
    registry.register(KernelSpec("demo.op", "fast", "json:loads", priority=1))
    return registry


def test_a_built_plan_records_the_environment() -> None:
    config = Config(assume_packages=parse_assumed(["triton==3.4"]))
    plan = build_plan(_registry(config))
    env = plan.environment
    assert env is not None
    assert tuple(env) == ENVIRONMENT_KEYS
    assert env["kernreg"] == kernreg.__version__
    assert env["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    assert env["assumed_packages"] == ["triton==3.4"]
    torch = sys.modules.get("torch")
    if torch is not None:
        assert env["torch"] == torch.__version__
        assert env["cuda"] == torch.version.cuda
        assert env["rocm"] == torch.version.hip


def test_the_record_round_trips_and_stays_out_of_equality_and_fingerprint() -> None:
    plan = build_plan(_registry())
    loaded = SelectionPlan.from_json(plan.to_json())
    assert loaded.environment == plan.environment
    bare = SelectionPlan(plan.entries())
    assert bare == plan
    assert bare.fingerprint() == plan.fingerprint()
    assert '"environment"' not in bare.to_json()


def test_old_plans_without_a_record_still_load() -> None:
    fields = json.dumps(list(kernreg.plan.PlanEntry.__slots__))
    row = ["demo.op", "cpu", None, "fast", "", "priority", "json:loads", None, None, None]
    text = f'{{"kernreg_plan": 1, "fields": {fields}, "entries": [{json.dumps(row)}]}}'
    old = SelectionPlan.from_json(text)
    assert old.environment is None
    current = build_plan(_registry())
    assert old.diff(current) == []
    assert old.environment_drift(current) == []


def test_environment_drift_names_each_version_that_moved() -> None:
    plan = build_plan(_registry())
    assert plan.environment is not None
    env = dict(plan.environment)
    env.update(torch="2.0.0", triton=None, driver="nvidia 535.1", assumed_packages=["triton==3.4"])
    older = SelectionPlan(plan.entries(), environment=env)
    lines = older.environment_drift(plan)
    now = plan.environment
    assert f"torch: 2.0.0 -> {now['torch'] or 'none'}" in lines
    assert f"driver: nvidia 535.1 -> {now['driver'] or 'none'}" in lines
    assert "assumed_packages: triton==3.4 -> none" in lines
    triton_lines = [line for line in lines if line.startswith("triton:")]
    assert triton_lines == ([f"triton: none -> {now['triton']}"] if now["triton"] else [])
    assert plan.environment_drift(plan) == []


@pytest.mark.parametrize(
    "environment",
    ['"torch 2.4"', '{"torch": 2.4}', '{"assumed_packages": [1]}', "[]"],
)
def test_a_malformed_record_is_a_plan_error(environment: str) -> None:
    fields = json.dumps(list(kernreg.plan.PlanEntry.__slots__))
    text = f'{{"kernreg_plan": 1, "environment": {environment}, "fields": {fields}, "entries": []}}'
    with pytest.raises(PlanError, match="'environment' must map names"):
        SelectionPlan.from_json(text)


def test_capture_imports_nothing() -> None:
    code = textwrap.dedent(
        """
        import sys
        from kernreg.plan import capture_environment
        env = capture_environment()
        assert "torch" not in sys.modules and "triton" not in sys.modules, sorted(sys.modules)
        print(env["torch"] is not None)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0, result.stderr
    installed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import importlib.util as u; print(u.find_spec('torch') is not None)",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.stdout == installed.stdout
    assert set(capture_environment()) == set(ENVIRONMENT_KEYS)


MODULE = """
import kernreg
from kernreg import KernelSpec
kernreg.register_kernel(KernelSpec("demo.op", "torch", "json:dumps", reference=True))
kernreg.register_kernel(KernelSpec("demo.op", "fast", "json:loads", priority=1))
"""


def _kernreg(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    environ.update({"KERNREG_PLUGINS": "none", "KERNREG_PLATFORM": "cpu", **env})
    return subprocess.run(
        [sys.executable, "-m", "kernreg", "-m", "env_fixture", *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        check=False,
    )


def test_lock_check_warns_about_version_drift_beside_decision_drift(tmp_path: Path) -> None:
    (tmp_path / "env_fixture.py").write_text(MODULE)
    lock = tmp_path / "kernreg.lock"
    assert _kernreg("lock", "-o", str(lock), cwd=tmp_path).returncode == 0
    document = json.loads(lock.read_text())
    assert set(document["environment"]) == set(ENVIRONMENT_KEYS)
    document["environment"]["torch"] = "1.0.0"
    lock.write_text(json.dumps(document))

    same = _kernreg("lock", "--check", "-o", str(lock), cwd=tmp_path)
    assert same.returncode == 0, same.stderr  # a version drift alone is a warning
    assert "up to date (1 decisions)" in same.stdout
    assert "warning: " in same.stderr
    assert "the environment changed since it was written" in same.stderr
    assert "  torch: 1.0.0 -> " in same.stderr

    moved = _kernreg("lock", "--check", "-o", str(lock), cwd=tmp_path, KERNREG_PIN="demo.op=torch")
    assert moved.returncode == 1
    assert "~ demo.op on cpu, any dtype: fast (priority) -> torch (pin)" in moved.stdout
    assert "  torch: 1.0.0 -> " in moved.stderr

    as_json = json.loads(
        _kernreg("lock", "--check", "-o", str(lock), "--json", cwd=tmp_path).stdout
    )
    assert as_json["ok"] is True
    assert [line.split(" -> ")[0] for line in as_json["environment_drift"]] == ["torch: 1.0.0"]


def test_lock_files_mark_assumed_packages(tmp_path: Path) -> None:
    (tmp_path / "env_fixture.py").write_text(MODULE)
    lock = tmp_path / "kernreg.lock"
    args = ("lock", "-o", str(lock), "--assume-package", "triton==3.4")
    assert _kernreg(*args, cwd=tmp_path).returncode == 0
    assert SelectionPlan.load(lock).environment["assumed_packages"] == ["triton==3.4"]  # type: ignore[index]
    check = _kernreg(
        "lock", "--check", "-o", str(lock), "--assume-package", "triton==3.5", cwd=tmp_path
    )
    assert check.returncode == 0
    assert "assumed_packages: triton==3.4 -> triton==3.5" in check.stderr


GATED = """
import kernreg
from kernreg import KernelSpec
kernreg.register_kernel(KernelSpec("demo.op", "torch", "json:dumps", reference=True))
kernreg.register_kernel(
    KernelSpec("demo.op", "fast", "json:loads", priority=1, packages=["kernreg-absent>=2"])
)
"""


def test_lock_check_compares_under_the_packages_the_plan_assumed(tmp_path: Path) -> None:
    # As the plan's platforms are, its assumed packages are the target's: a plan written for
    # a machine with kernreg-absent 2.0 is up to date on one without it.
    (tmp_path / "env_fixture.py").write_text(GATED)
    lock = tmp_path / "kernreg.lock"
    args = ("lock", "-o", str(lock), "--assume-package", "kernreg-absent==2.0")
    assert _kernreg(*args, cwd=tmp_path).returncode == 0
    check = _kernreg("lock", "--check", str(lock), "--json", cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    assert json.loads(check.stdout)["environment_drift"] == []
    # Assumptions given now are what the plan is compared with.
    older = _kernreg(
        "lock", "--check", str(lock), "--assume-package", "kernreg-absent==1.0", cwd=tmp_path
    )
    assert older.returncode == 1
    assert "~ demo.op on cpu, any dtype: fast (priority) -> torch (reference)" in older.stdout
    # A hand-edited assumption that is no name==version is an invalid plan, not a crash.
    text = lock.read_text().replace('"kernreg-absent==2.0"', '"kernreg-absent"')
    lock.write_text(text)
    broken = _kernreg("lock", "--check", str(lock), cwd=tmp_path)
    assert broken.returncode == 1
    assert f"invalid selection plan {lock}: environment: assumed_packages:" in broken.stderr
    assert "Traceback" not in broken.stderr


def test_check_reports_planned_choices_this_process_cannot_run(tmp_path: Path) -> None:
    # Workers following a plan locked for kernreg-absent 2.0 decide this op afresh: say so.
    (tmp_path / "env_fixture.py").write_text(GATED)
    lock = tmp_path / "kernreg.lock"
    args = ("lock", "-o", str(lock), "--assume-package", "kernreg-absent==2.0")
    assert _kernreg(*args, cwd=tmp_path).returncode == 0
    check = _kernreg("check", "--json", cwd=tmp_path, KERNREG_LOCK=str(lock))
    assert check.returncode == 0, check.stdout + check.stderr
    (miss,) = [p for p in json.loads(check.stdout)["problems"] if p["kind"] == "plan_miss"]
    assert miss["severity"] == "warning"
    assert (miss["op"], miss["backends"], miss["origins"]) == ("demo.op", ["fast"], [str(lock)])
    assert miss["message"] == (
        "op 'demo.op' on cpu: planned fast is not available here "
        "(package kernreg-absent is not installed (needs kernreg-absent>=2))"
    )
    assumed = _kernreg(
        "check", "--json", "--assume-package", "kernreg-absent==2.0", cwd=tmp_path,
        KERNREG_LOCK=str(lock),
    )  # fmt: skip
    assert "plan_miss" not in assumed.stdout

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


def test_fresh_process_fingerprint_and_plan_see_the_plugins_kernels(tmp_path: Path) -> None:
    script = (
        "import json, kernreg\n"
        "plan = kernreg.build_plan()\n"
        "print(json.dumps([kernreg.fingerprint(), len(plan.entries()),"
        " sorted({e.op for e in plan.entries()})]))\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    fresh = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=base, timeout=180
    )
    assert fresh.returncode == 0, fresh.stderr
    fingerprint, entries, ops = json.loads(fresh.stdout)
    assert fingerprint != "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert entries > 0
    assert "layernorm.rmsnorm" in ops
    locked = _kernreg("lock", "-o", str(tmp_path / "plan.json"))
    assert locked.returncode == 0, locked.stderr
    assert fingerprint[:16] in locked.stdout


HOSTILE_JSON = {
    "nested arrays": "[" * 100_000 + "]" * 100_000,
    "nested objects": '{"a":' * 50_000 + "1" + "}" * 50_000,
    "integer over 4300 digits": '{"kernreg_plan": ' + "9" * 5000 + "}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_JSON))
def test_hostile_json_is_a_named_error_in_plans_and_tuning_imports(
    name: str, tmp_path: Path
) -> None:
    from kernreg.plan import PlanError, SelectionPlan
    from kernreg.tuning import TuningDataError, TuningStore

    with pytest.raises(PlanError, match=r"not JSON|nested too deeply"):
        SelectionPlan.from_json(HOSTILE_JSON[name])
    with pytest.raises(TuningDataError, match="invalid tuning JSON"):
        TuningStore(tmp_path / "t.sqlite3").import_json(HOSTILE_JSON[name])


@pytest.mark.parametrize(
    "text",
    [
        "traits = " + "[" * 100_000 + "]" * 100_000,
        "traits = " + "{b = " * 5000 + "1" + "}" * 5000,
        "strict = " + "9" * 5000,
    ],
)
def test_hostile_toml_is_a_config_error(text: str, tmp_path: Path) -> None:
    from kernreg import ConfigError, load_config

    path = tmp_path / "kernreg.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="cannot read TOML"):
        load_config({"KERNREG_CONFIG": str(path)})


def test_huge_numbers_in_measurements_are_a_named_error(tmp_path: Path) -> None:
    from kernreg.tuning import Measurement, TuningDataError, TuningKey, TuningStore

    store = TuningStore(tmp_path / "t.sqlite3")
    key = TuningKey("layernorm.rmsnorm", "cuda:9.0", "aten=a;torch=t", ("bfloat16",), "x=1")
    with pytest.raises(TuningDataError):
        store.put(key, {"aten": Measurement(10**400, 1, 3)})
    exported = (
        '{"format": "kernreg-tuning", "version": 1, "entries": [{"key": {"op": "a.b",'
        ' "platform": "cpu", "implementations": "x", "dtypes": [], "bucket": "b"},'
        ' "results": {"aten": {"median_ns": 1' + "0" * 400 + ', "spread_ns": 1, "repeats": 1}}}]}'
    )
    with pytest.raises(TuningDataError):
        store.import_json(exported)


def test_a_stored_nan_measurement_is_set_aside_not_decided_on(tmp_path: Path) -> None:
    import sqlite3
    import warnings

    from kernreg.tuning import Measurement, TuningKey, TuningStore

    path = tmp_path / "t.sqlite3"
    store = TuningStore(path)
    key = TuningKey("layernorm.rmsnorm", "cuda:9.0", "aten=a;torch=t", ("bfloat16",), "x=1")
    store.put(key, {"aten": Measurement(100, 1, 3), "torch": Measurement(200, 1, 3)})
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE measurements SET median_ns = 'nan'")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.get(key) is None
    assert any("damaged" in str(w.message) for w in caught)
    assert store.entries() == []


@pytest.mark.parametrize("spelling", ["CPU", " cpu", "Cpu "])
def test_a_plan_platform_spelt_differently_still_decides(spelling: str, tmp_path: Path) -> None:
    import kernreg
    from kernreg.plan import SelectionPlan

    registry = kernreg.KernelRegistry(
        config=kernreg.Config(), platform=kernreg.Platform.parse("cpu")
    )
    for backend, priority in (("torch", 0), ("fast", 10)):
        registry.register(
            kernreg.KernelSpec(
                "demo.planned",
                backend,
                "builtins:len",
                priority=priority,
                reference=backend == "torch",
            )
        )

    plan = kernreg.build_plan(registry, platforms=["cpu"])
    document = json.loads(plan.to_json())
    assert {row[1] for row in document["entries"]} == {"cpu"}
    for row in document["entries"]:
        row[1] = spelling
        row[3] = "torch"
        row[5] = "plan"
    edited = SelectionPlan.from_json(json.dumps(document))
    entry = edited.lookup("demo.planned", kernreg.Platform.parse("cpu"), None)
    assert entry is not None
    assert entry.backend == "torch"


def test_list_layers_fits_100_columns_and_wide_keeps_every_detail() -> None:
    narrow = _kernreg("list", "--layers", env={"COLUMNS": "100"})
    assert narrow.returncode == 0, narrow.stderr
    lines = narrow.stdout.splitlines()
    assert any("LlamaRMSNorm" in line for line in lines)
    assert max(len(line) for line in lines) <= 100, narrow.stdout
    wide = _kernreg("list", "--layers", "--wide", env={"COLUMNS": "100"})
    assert "kernreg_ops._layers:rmsnorm_args" in wide.stdout
    assert "_layers.py:" in wide.stdout


def test_check_reports_a_loaded_plan_that_decides_nothing_here(tmp_path: Path) -> None:
    plan = tmp_path / "gpu.json"
    locked = _kernreg("lock", "--platform", "cuda:9.0", "-o", str(plan))
    assert locked.returncode == 0, locked.stderr
    checked = _kernreg(
        "check", "--json", env={"KERNREG_LOCK": str(plan), "KERNREG_PLATFORM": "cpu"}
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    kinds = [p["kind"] for p in json.loads(checked.stdout)["problems"]]
    assert kinds == ["plan_unmatched"]
    on_gpu = _kernreg("check", "--json", "--platform", "cuda:9.0", env={"KERNREG_LOCK": str(plan)})
    assert "plan_unmatched" not in on_gpu.stdout


def test_an_oversized_plan_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    import time

    from kernreg.plan import MAX_PLAN_BYTES, PlanError, SelectionPlan

    row = '["layernorm.rmsnorm", "cpu", null, "torch", "", "reference", "t", "", "", null]'
    count = MAX_PLAN_BYTES // len(row) + 1
    path = tmp_path / "huge.json"
    with open(path, "w") as handle:
        handle.write('{"kernreg_plan": 1, "entries": [')
        handle.write(", ".join([row] * count))
        handle.write("]}")
    started = time.perf_counter()
    with pytest.raises(PlanError, match="more than the"):
        SelectionPlan.load(path)
    assert time.perf_counter() - started < 5

"""Hostile data in every parser: lock files, TOML configs, environment values, tuning exports
and tuning-store rows edited by hand. Each ends in its named error (PlanError,
ConfigError, TuningDataError) or in the documented set-aside-and-rebuild, never in a raw
RecursionError, ValueError, OverflowError or a crashed decision."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from kernreg import Config, KernelRegistry, KernelSpec, Platform
from kernreg.config import ENV_VARS, MAX_CONFIG_BYTES, load_config
from kernreg.errors import ConfigError
from kernreg.plan import (
    MAX_PLAN_BYTES,
    MAX_PLAN_ENTRIES,
    PlanEntry,
    PlanError,
    PlanWarning,
    SelectionPlan,
    build_plan,
)
from kernreg.tuning import (
    Measurement,
    TuningDataError,
    TuningKey,
    TuningStore,
    TuningStoreWarning,
)

DEEP = 100_000
LONG_INT = "9" * 5_000  # over Python's 4,300-digit limit for int(str)
FIELDS = json.dumps(list(PlanEntry.__slots__))
ROW = ["norm.rms", "cpu", None, "fast", "", "priority", "m:f", None, None, None]


def _plan_text(*rows: object, head: str = '"kernreg_plan": 1') -> str:
    return f'{{{head}, "fields": {FIELDS}, "entries": {json.dumps(list(rows))}}}'


def _registry(platform: str = "cpu") -> KernelRegistry:
    registry = KernelRegistry(config=Config(), platform=Platform.parse(platform))
    registry.register(KernelSpec("norm.rms", "torch", "m:ref", reference=True))
    registry.register(KernelSpec("norm.rms", "fast", "m:fast", priority=5))
    registry.register(KernelSpec("norm.rms", "slow", "m:slow", priority=1))
    return registry


# --- lock files ---------------------------------------------------------------------------

HOSTILE_PLANS = {
    "nested arrays": "[" * DEEP + "]" * DEEP,
    "nested objects": '{"a":' * DEEP + "1" + "}" * DEEP,
    "nested entry": _plan_text().replace("[]", "[" * DEEP + "]" * DEEP),
    "format of 5,000 digits": _plan_text(head=f'"kernreg_plan": {LONG_INT}'),
    "huge format number": _plan_text(head='"kernreg_plan": 1e999'),
    "format true": _plan_text(head='"kernreg_plan": true'),
    "integer in a field": _plan_text([*ROW[:5], 10**3000, *ROW[6:]]),
    "long int text in a field": _plan_text().replace("[]", f"[[{LONG_INT}]]"),
    "nan in a field": _plan_text().replace("[]", '[["a.b", NaN]]'),
    "architecture of 5,000 digits": _plan_text([ROW[0], f"cuda:{LONG_INT}.0", *ROW[2:]]),
    "unknown dtype": _plan_text([ROW[0], ROW[1], ["Float16x"], *ROW[3:]]),
    "entries twice": _plan_text(ROW).replace('"entries"', '"entries": [], "entries"', 1),
    "platforms that disagree once spelled alike": _plan_text(
        ROW, [ROW[0], " CPU", None, "slow", *ROW[4:]]
    ),
    "not text": b"{}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_PLANS))
def test_hostile_plan_text_is_a_plan_error(name: str) -> None:
    with pytest.raises(PlanError, match="invalid selection plan"):
        SelectionPlan.from_json(HOSTILE_PLANS[name])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(set(HOSTILE_PLANS) - {"not text"}))
def test_hostile_lock_file_is_a_config_error_naming_the_variable(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "kernreg.lock"
    path.write_text(HOSTILE_PLANS[name], encoding="utf-8")
    monkeypatch.setenv("KERNREG_LOCK", str(path))
    with pytest.raises(ConfigError, match="KERNREG_LOCK"):
        load_config()


def test_a_million_entry_lock_file_is_refused_fast(tmp_path: Path) -> None:
    path = tmp_path / "huge.lock"
    row = json.dumps(ROW)
    path.write_text(_plan_text().replace("[]", "[" + ",".join([row] * 1_000_000) + "]"))
    start = time.perf_counter()
    with pytest.raises(PlanError, match="more than"):
        SelectionPlan.load(path)
    assert time.perf_counter() - start < 1.0


def test_the_entry_limit_holds_below_the_size_limit() -> None:
    short = ["a.b", "cpu", None, "", "", "", "", None, None, None]
    text = _plan_text(*[short] * (MAX_PLAN_ENTRIES + 1))
    assert len(text) < MAX_PLAN_BYTES
    with pytest.raises(PlanError, match=f"more than the {MAX_PLAN_ENTRIES}"):
        SelectionPlan.from_json(text)


def test_a_full_size_plan_loads(tmp_path: Path) -> None:
    rows = [
        [
            f"op{i // 100}.k{i % 100}",
            "cuda:9.0",
            ["bfloat16"],
            "triton",
            "v2",
            "priority",
            "pkg.module:function_name",
            "vendor-kernels",
            "1.2.3",
            f"x={i}",
        ]
        for i in range(MAX_PLAN_ENTRIES)
    ]
    path = tmp_path / "full.lock"
    SelectionPlan(SelectionPlan.from_json(_plan_text(*rows)).entries()).save(path)
    assert path.stat().st_size < MAX_PLAN_BYTES / 2
    assert len(SelectionPlan.load(path)) == MAX_PLAN_ENTRIES


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_as_lock_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="not a regular file"):
        SelectionPlan.load("/dev/zero")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(PlanError, match="not a regular file"):
        SelectionPlan.load(fifo)


def test_a_lock_file_saved_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    path = tmp_path / "bom.lock"
    path.write_text("\ufeff" + _plan_text(ROW), encoding="utf-8")
    assert len(SelectionPlan.load(path)) == 1


def test_save_writes_no_predictable_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "kernreg.lock"
    elsewhere = tmp_path / "elsewhere"
    os.symlink(elsewhere, f"{target}.tmp-{os.getpid()}")  # where the old name would go
    SelectionPlan.from_json(_plan_text(ROW)).save(target)
    assert not elsewhere.exists()
    assert len(SelectionPlan.load(target)) == 1
    assert (target.stat().st_mode & 0o777) == 0o666 & ~_umask()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [target.name, f"{target.name}.tmp-{os.getpid()}"]
    )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- plan platforms spelled differently --------------------------------------------------


@pytest.mark.parametrize(
    ("spelled", "platform"),
    [
        ("CPU", "cpu"),
        (" cpu", "cpu"),
        ("cpu ", "cpu"),
        ("cuda:sm_90", "cuda:9.0"),
        ("CUDA:9.0", "cuda:9.0"),
    ],
)
def test_a_plan_platform_spelled_differently_is_followed(spelled: str, platform: str) -> None:
    plan = SelectionPlan.from_json(
        _plan_text([ROW[0], spelled, None, "slow", "", "priority", "m:slow", None, None, None])
    )
    assert [entry.platform for entry in plan.entries()] == [platform]
    registry = _registry(platform)
    registry.use_plan(plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registry.select("norm.rms").backend == "slow"  # the plan, not the priority


def test_plan_dtypes_are_read_by_their_canonical_names() -> None:
    plan = SelectionPlan.from_json(
        _plan_text([ROW[0], "cpu", ["BF16", "torch.float32"], "slow", *ROW[4:]])
    )
    assert plan.entries()[0].dtypes == ("bfloat16", "float32")


def test_a_plan_for_another_platform_is_a_plan_warning() -> None:
    registry = _registry("cpu")
    registry.use_plan(build_plan(_registry("cuda:9.0")))
    with pytest.warns(PlanWarning, match=r"decides for cuda:9\.0, not for cpu"):
        assert registry.select("norm.rms").backend == "fast"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per plan, not per decision
        registry.select("norm.rms", dtypes=["float32"])


def test_a_plan_for_another_inventory_is_a_plan_warning() -> None:
    other = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    other.register(KernelSpec("act.silu", "torch", "m:silu", reference=True))
    registry = _registry("cpu")
    registry.use_plan(build_plan(other))
    with pytest.warns(PlanWarning, match="names none of the 1 ops registered here"):
        registry.select("norm.rms")


def test_a_matching_plan_raises_no_warning() -> None:
    registry = _registry("cpu")
    registry.use_plan(build_plan(registry))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registry.select("norm.rms").backend == "fast"


def test_kernreg_check_reports_a_plan_that_matches_nothing(tmp_path: Path) -> None:
    lock = tmp_path / "kernreg.lock"
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    done = subprocess.run(
        [sys.executable, "-m", "kernreg", "lock", "-o", str(lock)],
        env={**env, "KERNREG_PLATFORM": "cpu"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    checked = subprocess.run(
        [sys.executable, "-m", "kernreg", "check", "--json"],
        env={**env, "KERNREG_PLATFORM": "cuda:9.0", "KERNREG_LOCK": str(lock)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stderr  # a warning, not an error
    found = [p for p in json.loads(checked.stdout)["problems"] if p["kind"] == "plan_unmatched"]
    assert len(found) == 1
    assert "decides for cpu, not for cuda:9.0" in found[0]["message"]
    assert "PlanWarning" not in checked.stderr  # reported once, as the finding


# --- TOML configuration files and environment values ---------------------------------------

HOSTILE_TOML = {
    "nested arrays": "strict = " + "[" * DEEP + "]" * DEEP,
    "nested inline tables": "x = " + "{a=" * 50_000 + "1" + "}" * 50_000,
    "nested arrays, shallow enough for the parser": "strict = " + "[" * 500 + "]" * 500,
    "deep dotted key": "a" + ".a" * 3_000 + " = 1",
    "integer of 5,000 digits": f"strict = {LONG_INT}",
    "huge float": "strict = 1e999",
    "nan": "strict = nan",
    "duplicate key": 'strict = "a.b"\nstrict = "c.d"',
    "not UTF-8": b"strict = '\xff'",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TOML))
def test_hostile_toml_is_a_config_error(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "kernreg.toml"
    text = HOSTILE_TOML[name]
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    monkeypatch.setenv("KERNREG_CONFIG", str(path))
    with pytest.raises(ConfigError, match="invalid configuration"):
        load_config()


def test_deep_tables_of_other_tools_in_a_pyproject_are_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text("[tool.other]\n" + "a" + ".a" * 500 + ' = 1\n[tool.kernreg]\nstrict = "a.*"\n')
    monkeypatch.setenv("KERNREG_CONFIG", str(path))
    assert load_config().strict == ("a.*",)


def test_an_over_size_or_device_config_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "big.toml"
    path.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    monkeypatch.setenv("KERNREG_CONFIG", str(path))
    with pytest.raises(ConfigError, match="larger than"):
        load_config()
    if os.path.exists("/dev/zero"):
        monkeypatch.setenv("KERNREG_CONFIG", "/dev/zero")
        with pytest.raises(ConfigError, match="not a regular file"):
            load_config()


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("KERNREG_PLATFORM", f"cuda:{LONG_INT}.0"),
        ("KERNREG_PLATFORM", f"cuda:sm_{LONG_INT}"),
        ("KERNREG_STRICT", "a." + "b" * 100_000 + "B"),
        ("KERNREG_PIN", "a.b=" + "t" * 100_000 + "/V"),
        ("KERNREG_TRAITS", "x," * 100_000 + "Y"),
        ("KERNREG_CACHE_DIR", "a\0b"),
    ],
)
def test_hostile_environment_values_are_config_errors(var: str, value: str) -> None:
    with pytest.raises(ConfigError, match=var):
        load_config({var: value})


# --- tuning exports and TuningStore.put ----------------------------------------------------


def _export(median: str = "1.0", spread: str = "0.5", repeats: str = "3") -> str:
    key = {"op": "a.b", "platform": "cpu", "implementations": "x", "dtypes": [], "bucket": "b"}
    return (
        '{"format": "kernreg-tuning", "version": 1, "entries": [{"key": '
        + json.dumps(key)
        + f', "results": {{"aten": {{"median_ns": {median}, "spread_ns": {spread},'
        f' "repeats": {repeats}}}}}}}]}}'
    )


HOSTILE_EXPORTS = {
    "nested arrays": "[" * DEEP + "]" * DEEP,
    "nested key": _export().replace('"dtypes": []', '"dtypes": ' + "[" * DEEP + "]" * DEEP),
    "median of 5,000 digits": _export(median=LONG_INT),
    "median of 4,000 digits": _export(median=LONG_INT[:4000]),
    "huge median": _export(median="1e999"),
    "NaN median": _export(median="NaN"),
    "Infinity spread": _export(spread="Infinity"),
    "negative median": _export(median="-5"),
    "huge repeats": _export(repeats=LONG_INT[:4000]),
    "fractional repeats": _export(repeats="2.5"),
    "boolean median": _export(median="true"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_EXPORTS))
def test_hostile_tuning_export_is_a_tuning_data_error(name: str, tmp_path: Path) -> None:
    with TuningStore(tmp_path / "t.sqlite3") as store:
        with pytest.raises(TuningDataError, match="invalid tuning JSON"):
            store.import_json(HOSTILE_EXPORTS[name])
        assert store.entries() == []


@pytest.mark.parametrize(
    ("median", "spread", "repeats"),
    [
        (float("nan"), 0.0, 1),
        (1.0, float("nan"), 1),
        (float("inf"), 0.0, 1),
        (-1.0, 0.0, 1),
        (10**400, 0.0, 1),
        pytest.param(10**5000, 0.0, 1, id="median-of-5000-digits"),
        (1.0, 0.0, float("nan")),
        (1.0, 0.0, float("inf")),
        (1.0, 0.0, 10**400),
        (1.0, 0.0, -1),
        (1.0, 0.0, 1.5),
        ("1", 0.0, 1),
        (True, 0.0, 1),
        (1.0, 0.0, None),
    ],
)
def test_a_measurement_that_cannot_be_measured_is_a_tuning_data_error(
    median: object, spread: object, repeats: object
) -> None:
    with pytest.raises(TuningDataError, match="Measurement"):
        Measurement(median, spread, repeats)  # type: ignore[arg-type]


# --- tuning-store rows edited by hand -------------------------------------------------------

HAND_EDITS = {
    "median nan as text": "UPDATE measurements SET median_ns = 'nan' WHERE label = 'fast'",
    "spread nan as text": "UPDATE measurements SET spread_ns = 'NaN' WHERE label = 'fast'",
    "median inf": "UPDATE measurements SET median_ns = 9e999 WHERE label = 'fast'",
    "median negative": "UPDATE measurements SET median_ns = -5 WHERE label = 'fast'",
    "median as words": "UPDATE measurements SET median_ns = 'fast' WHERE label = 'fast'",
    "repeats as words": "UPDATE measurements SET repeats = 'many' WHERE label = 'fast'",
    "label empty": "UPDATE measurements SET label = '' WHERE label = 'fast'",
}


@pytest.mark.parametrize("edit", sorted(HAND_EDITS))
def test_a_hand_edited_row_is_set_aside_and_the_decision_goes_on(edit: str, tmp_path: Path) -> None:
    path = tmp_path / "tuning.sqlite3"
    registry = _registry("cpu")
    registry.configure(Config(policy="autotune"), platform=Platform.parse("cpu"))
    registry.use_tuning_store(TuningStore(path))
    measured = {
        "fast": Measurement(900, 10, 20),
        "slow": Measurement(100, 10, 20),
        "torch": Measurement(500, 10, 20),
    }
    plat = registry.platform
    registry.record_measurements("norm.rms", plat, None, "x=8", measured)
    assert registry.explain("norm.rms", bucket="x=8").chosen.backend == "slow"  # type: ignore[union-attr]
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(HAND_EDITS[edit])
    conn.close()
    fresh = _registry("cpu")  # another process: reads the store, not the memory
    fresh.configure(Config(policy="autotune"), platform=Platform.parse("cpu"))
    fresh.use_tuning_store(TuningStore(path))
    with pytest.warns(TuningStoreWarning, match="damaged"):
        decision = fresh.explain("norm.rms", bucket="x=8")
    assert decision.ok
    assert decision.chosen.backend == "fast"  # type: ignore[union-attr]  # measurements gone: priority
    assert list(tmp_path.glob("tuning.sqlite3.corrupt-*"))  # set aside, not deleted


def test_a_hand_edited_dtypes_column_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "tuning.sqlite3"
    with TuningStore(path) as store:
        store.put(TuningKey("a.b", "cpu", "x", ("float16",), "b"), {"x": Measurement(1, 0, 1)})
    for dtypes in ('"float16"', '{"float16": 1}', "[" * 5_000 + "]" * 5_000, "[1]"):
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("UPDATE entries SET dtypes = ?", (dtypes,))
        conn.close()
        with TuningStore(path) as store, pytest.warns(TuningStoreWarning, match="damaged"):
            assert store.entries() == []
        with TuningStore(path) as store:
            store.put(TuningKey("a.b", "cpu", "x", ("float16",), "b"), {"x": Measurement(1, 0, 1)})

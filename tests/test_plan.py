"""Selection plans (lock files): building, the file format, following a plan, drift, fingerprints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from types import CodeType
from typing import Any

import pytest

import kernreg
from _support import BAD_INPUT_OP, BAD_INPUT_TARGET, DEEP, LONG_INT, norm_registry
from kernreg import ConfigError, KernelRegistry, KernelSpec, NoEligibleKernelError, Platform
from kernreg.config import ENV_VARS, Config, Pin, load_config
from kernreg.plan import (
    MAX_PLAN_BYTES,
    MAX_PLAN_ENTRIES,
    PlanEntry,
    PlanError,
    PlanWarning,
    SelectionPlan,
)
from kernreg.registry import build_plan, fingerprint
from kernreg.tuning import (
    TuningDataError,
    TuningStore,
)

RMS = "layernorm.rmsnorm"
SILU = "activation.silu"

SPECS = [
    KernelSpec(RMS, "torch", "pkg.ref:rms", reference=True),
    KernelSpec(
        RMS, "triton", "pkg.tri:rms", requires=["cuda>=8.0"], dtypes=["bf16", "fp16"], priority=10
    ),
    KernelSpec(RMS, "aten", "pkg.aten:rms", dtypes=["fp32", "bf16"], priority=5),
    KernelSpec(SILU, "torch", "pkg.ref:silu", reference=True),
    KernelSpec(SILU, "cpp", "pkg.cpp:silu", requires=["cpu"], priority=3),
]


def make_registry(specs: list[KernelSpec] = SPECS, **config: Any) -> KernelRegistry:
    registry = KernelRegistry(config=Config(**config), platform=Platform.parse("cuda:9.0"))
    for spec in specs:
        registry.register(spec)
    return registry


def test_a_plan_has_one_entry_per_op_platform_and_dtype_set() -> None:
    plan = build_plan(make_registry(), platforms=["cuda:9.0", "cpu"])
    keys = [(e.op, e.platform, e.dtypes) for e in plan.entries()]
    # rmsnorm: unknown dtypes, each dtype a spec names and each set of dtypes some specs
    # accept together (for calls mixing dtypes); silu: only unknown dtypes.
    assert keys == [
        (SILU, "cpu", None),
        (SILU, "cuda:9.0", None),
        (RMS, "cpu", None),
        (RMS, "cpu", ("bfloat16",)),
        (RMS, "cpu", ("bfloat16", "float16")),
        (RMS, "cpu", ("bfloat16", "float32")),
        (RMS, "cpu", ("float16",)),
        (RMS, "cpu", ("float32",)),
        (RMS, "cuda:9.0", None),
        (RMS, "cuda:9.0", ("bfloat16",)),
        (RMS, "cuda:9.0", ("bfloat16", "float16")),
        (RMS, "cuda:9.0", ("bfloat16", "float32")),
        (RMS, "cuda:9.0", ("float16",)),
        (RMS, "cuda:9.0", ("float32",)),
    ]
    chosen = {(e.op, e.platform, e.dtypes): (e.label, e.rule) for e in plan.entries()}
    assert chosen[(RMS, "cuda:9.0", ("bfloat16",))] == ("triton", "priority")
    assert chosen[(RMS, "cpu", ("bfloat16",))] == ("aten", "priority")
    assert chosen[(RMS, "cpu", ("float16",))] == ("torch", "reference")
    assert chosen[(SILU, "cpu", None)] == ("cpp", "priority")
    assert chosen[(SILU, "cuda:9.0", None)] == ("torch", "reference")


def test_a_plan_of_a_mixed_gpu_host_covers_every_device() -> None:
    specs = [
        KernelSpec(RMS, "torch", "pkg.ref:rms", reference=True),
        KernelSpec(RMS, "hopper", "pkg.h:rms", requires=["cuda>=9.0"], priority=10),
    ]
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cuda:8.0,9.0"))
    for spec in specs:
        registry.register(spec)
    plan = build_plan(registry)
    chosen = {e.platform: e.label for e in plan.entries()}
    assert chosen == {"cuda:8.0": "torch", "cuda:9.0": "hopper"}
    # A worker whose call runs on device 1 finds its decision in the plan.
    follower = KernelRegistry(config=Config(), platform=Platform.parse("cuda:8.0,9.0"))
    for spec in specs:
        follower.register(spec)
    follower.use_plan(plan)
    device1 = follower.platform.for_device("cuda:1")
    assert follower.explain(RMS, platform=device1).rule == "plan"


def test_the_plan_text_does_not_depend_on_registration_order() -> None:
    forward = build_plan(make_registry(SPECS), platforms=["cpu", "cuda:9.0"])
    backward = build_plan(make_registry(SPECS[::-1]), platforms=["cuda:9.0", "cpu"])
    assert forward.to_json() == backward.to_json()
    assert forward.fingerprint() == backward.fingerprint()
    text = forward.to_json()
    document = json.loads(text)
    assert document["kernreg_plan"] == 1
    assert document["fields"] == [
        "op",
        "platform",
        "dtypes",
        "backend",
        "variant",
        "rule",
        "target",
        "distribution",
        "version",
        "bucket",
    ]
    assert document["entries"][0] == [
        SILU,
        "cpu",
        None,
        "cpp",
        "",
        "priority",
        "pkg.cpp:silu",
        None,
        None,
        None,
    ]
    # One line per decision, so a diff of two plans shows the decisions that moved.
    lines = text.splitlines()
    assert (
        '    ["activation.silu", "cpu", null, "cpp", "", "priority", "pkg.cpp:silu", null, null, null],'
        in lines
    )
    assert len(lines) == len(forward) + 6


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    plan = build_plan(make_registry(), platforms=["cpu", "cuda:9.0"])
    path = tmp_path / "kernreg.lock"
    plan.save(path)
    loaded = SelectionPlan.load(path)
    assert loaded == plan
    assert loaded.source == str(path)
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left


FIELDS = [
    "op",
    "platform",
    "dtypes",
    "backend",
    "variant",
    "rule",
    "target",
    "distribution",
    "version",
    "bucket",
]


def _row(**changes: Any) -> list[Any]:
    row = dict(
        zip(
            FIELDS,
            [RMS, "cpu", None, "torch", "", "reference", "pkg.ref:rms", None, None, None],
            strict=True,
        )
    )
    row.update(changes)
    return list(row.values())


def _doc(*rows: Any, fields: Any = FIELDS) -> str:
    return json.dumps({"kernreg_plan": 1, "fields": fields, "entries": list(rows)})


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "not JSON"),
        ("{", "not JSON"),
        ("[]", "not a kernreg plan"),
        ('{"entries": []}', "not a kernreg plan"),
        ('{"kernreg_plan": 2, "entries": []}', "format 2, this kernreg reads format 1"),
        (_doc(fields=["op"]), "'fields' must be"),
        (
            json.dumps({"kernreg_plan": 1, "fields": FIELDS, "entries": {}}),
            "'entries' must be a list",
        ),
        (_doc(1), "entry 0 is not a row of 10 fields"),
        (_doc(_row()[:-1]), "entry 0 is not a row of 10 fields"),
        (_doc(_row(op=3)), "field 'op' is 3"),
        (_doc(_row(dtypes="bf16")), "field 'dtypes'"),
        (_doc(_row(dtypes=[1])), "field 'dtypes'"),
        (_doc(_row(version=2)), "field 'version' is 2"),
        (_doc(_row(bucket=["x"])), "field 'bucket' is ['x']"),
        (_doc(_row(platform="cuda:")), "entry 0: invalid platform"),
        (_doc(_row(), _row(backend="aten")), "two entries for layernorm.rmsnorm"),
    ],
)
def test_malformed_plans_are_refused_naming_the_file(
    tmp_path: Path, text: str, fragment: str
) -> None:
    path = tmp_path / "bad.lock"
    path.write_text(text)
    with pytest.raises(PlanError, match=r"invalid selection plan .*bad\.lock") as info:
        SelectionPlan.load(path)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("later", "fragment"),
    [
        (_row(op="Layernorm.Rms"), "entry 1: invalid op 'Layernorm.Rms'"),
        (_row(op=None), "entry 1: field 'op' is None"),
        (_row(dtypes=[["float32"]]), "entry 1: field 'dtypes' is [['float32']]"),
        (_row(dtypes=["float32", 3]), "entry 1: field 'dtypes'"),
        (_row(backend="Torch"), "entry 1: invalid backend 'Torch'"),
        (_row(platform="cuda:90"), "entry 1: invalid platform 'cuda:90'"),
    ],
)
def test_each_row_is_checked_even_beside_rows_that_name_the_same_platform_and_backend(
    later: list[Any], fragment: str
) -> None:
    first = _row(op="layernorm.first", dtypes=["float32"])
    with pytest.raises(PlanError, match="invalid selection plan") as info:
        SelectionPlan.from_json(_doc(first, later))
    assert fragment in str(info.value)


def test_rows_that_spell_a_platform_and_dtypes_differently_read_the_same() -> None:
    rows = [_row(op=f"layernorm.k{i}", platform="CUDA:9.0", dtypes=["bf16"]) for i in range(3)]
    plan = SelectionPlan.from_json(_doc(*rows, _row(platform="cuda:9.0", dtypes=["bfloat16"])))
    assert {(e.platform, e.dtypes) for e in plan.entries()} == {("cuda:9.0", ("bfloat16",))}


def test_a_missing_plan_file_is_a_plan_error(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot read it"):
        SelectionPlan.load(tmp_path / "missing.lock")


def _plan_choosing(
    label: str, *, op: str = RMS, dtypes: tuple[str, ...] | None = ("bfloat16",)
) -> SelectionPlan:
    backend, _, variant = label.partition("/")
    return SelectionPlan([PlanEntry(op, "cuda:9.0", dtypes, backend, variant, "pin", "x:y")])


def test_the_debugging_switch_wins_over_a_plan_where_its_backend_is_eligible() -> None:
    # KERNREG_BACKEND=torch while a lock file is loaded: the switch is what the user is
    # debugging with, so it is not silently outvoted by the plan (as KERNREG_DENY is not).
    registry = make_registry(backend="torch")
    registry.use_plan(_plan_choosing("aten"))
    decision = registry.explain(RMS, dtypes=["bf16"])
    assert decision.chosen is not None
    assert decision.chosen.backend == "torch"
    assert decision.rule == "env_backend"
    assert any("KERNREG_BACKEND=torch wins over the plan" in n for n in decision.notes)
    # Where the switch's backend is not registered, the plan decides.
    registry = make_registry(backend="nosuch")
    registry.use_plan(_plan_choosing("aten"))
    decision = registry.explain(RMS, dtypes=["bf16"])
    assert decision.chosen is not None
    assert decision.chosen.backend == "aten"
    assert decision.rule == "plan"


def test_a_registry_follows_its_plan_over_priority() -> None:
    registry = make_registry()
    assert registry.select(RMS, dtypes=["bf16"]).backend == "triton"
    registry.use_plan(_plan_choosing("aten"))
    decision = registry.explain(RMS, dtypes=["bf16"])
    assert decision.chosen is not None
    assert decision.chosen.backend == "aten"
    assert decision.rule == "plan"
    assert decision.candidate("triton").status == "eligible"
    # Entries the plan lacks are decided normally.
    assert registry.select(RMS, dtypes=["fp16"]).backend == "triton"
    # An explicit request and a scoped pin still win over the plan.
    assert registry.select(RMS, backend="torch", dtypes=["bf16"]).backend == "torch"
    with kernreg.use_backend(RMS, "triton"):
        assert registry.select(RMS, dtypes=["bf16"]).backend == "triton"
    # ... while a configured pin is part of what the plan replays.
    registry.configure(Config(pins=(Pin(RMS, "triton"),)), platform=Platform.parse("cuda:9.0"))
    assert registry.select(RMS, dtypes=["bf16"]).backend == "aten"
    registry.use_plan(None)
    assert registry.select(RMS, dtypes=["bf16"]).backend == "triton"


def test_a_plan_is_followed_by_op_objects() -> None:
    registry = KernelRegistry(config=Config(), platform=Platform("cpu"))
    callers: list[CodeType] = []

    @kernreg.op("demo.scale", registry=registry)
    def scale(x: float) -> str:
        callers.append(sys._getframe(1).f_code)
        return "reference"

    @scale.register("fast", priority=5)
    def fast(x: float) -> str:
        return "fast"

    assert scale(1.0) == "fast"
    registry.use_plan(
        SelectionPlan([PlanEntry("demo.scale", "cpu", None, "torch", "", "reference", "x:y")])
    )
    assert scale(1.0) == "reference"
    assert scale(1.0) == "reference"
    assert callers[-1] is scale.__code__  # still a direct call per call


def test_an_unavailable_planned_implementation_warns_and_decides_normally() -> None:
    registry = make_registry()
    registry.use_plan(_plan_choosing("jit"))
    with pytest.warns(PlanWarning, match="planned jit is not available here"):
        decision = registry.explain(RMS, dtypes=["bf16"])
    assert decision.chosen is not None
    assert decision.chosen.backend == "triton"
    assert decision.plan_miss is not None
    assert "not registered" in decision.plan_miss
    # Warned once per decision, not per call.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.explain(RMS, dtypes=["bf16"])


def test_a_reconfigured_registry_warns_again_about_a_plan_miss() -> None:
    registry = make_registry()
    registry.use_plan(_plan_choosing("jit"))
    with pytest.warns(PlanWarning, match="planned jit is not available here"):
        registry.explain(RMS, dtypes=["bf16"])
    # A new configuration (here: the same platform again) is a new start: a miss that
    # still holds is said again, not swallowed by the first configuration's memory.
    registry.configure(Config(), platform=Platform.parse("cuda:9.0"))
    with pytest.warns(PlanWarning, match="planned jit is not available here"):
        registry.explain(RMS, dtypes=["bf16"])


def test_an_ineligible_planned_implementation_is_named_with_the_reason() -> None:
    registry = make_registry()
    registry.use_plan(_plan_choosing("triton", dtypes=("float32",)))
    with pytest.warns(PlanWarning, match=r"planned triton is not available here \(accepts only"):
        assert registry.select(RMS, dtypes=["fp32"]).backend == "aten"


def test_in_strict_mode_an_unavailable_planned_implementation_is_an_error() -> None:
    registry = make_registry(strict=(RMS,))
    registry.use_plan(_plan_choosing("jit"))
    with pytest.warns(PlanWarning), pytest.raises(NoEligibleKernelError) as info:
        registry.select(RMS, dtypes=["bf16"])
    assert "strict mode forbids choosing anything else" in str(info.value)


def test_drift_lists_every_changed_decision() -> None:
    locked = build_plan(make_registry(), platforms=["cuda:9.0"])
    changed = make_registry([*SPECS[:2], SPECS[2].replace(priority=50), *SPECS[3:]])
    current = build_plan(changed, platforms=["cuda:9.0"])
    drift = locked.diff(current)
    assert drift == [
        "~ layernorm.rmsnorm on cuda:9.0, bfloat16: triton (priority) -> aten (priority)",
    ]
    assert locked.diff(locked) == []
    fewer = build_plan(make_registry(SPECS[:3]), platforms=["cuda:9.0"])
    assert locked.diff(fewer) == ["- activation.silu on cuda:9.0, any dtype: torch (reference)"]
    assert fewer.diff(locked) == ["+ activation.silu on cuda:9.0, any dtype: torch (reference)"]


def test_the_fingerprint_covers_what_runs_not_why() -> None:
    base = make_registry()
    # On cuda:9.0 silu runs its reference anyway: pinning it there changes the rule, not the kernel.
    pinned = make_registry(pins=(Pin(SILU, "torch"),))
    assert build_plan(pinned, platforms=["cuda:9.0"]).lookup(SILU, "cuda:9.0", None).rule == "pin"  # type: ignore[union-attr]
    assert fingerprint(base, platforms=["cuda:9.0"]) == fingerprint(pinned, platforms=["cuda:9.0"])
    other = make_registry(pins=(Pin(SILU, "cpp"),))
    assert fingerprint(base, platforms=["cuda:9.0"]) != fingerprint(other, platforms=["cuda:9.0"])
    # A loaded plan is part of the effective decisions.
    base.use_plan(_plan_choosing("aten"))
    assert fingerprint(base, platforms=["cuda:9.0"]) != fingerprint(pinned, platforms=["cuda:9.0"])


FINGERPRINT_SCRIPT = """
import sys, kernreg
from kernreg import KernelSpec
specs = [
    KernelSpec("layernorm.rmsnorm", "torch", "pkg.ref:rms", reference=True),
    KernelSpec("layernorm.rmsnorm", "triton", "pkg.tri:rms", requires=["cuda>=8.0"], priority=10),
    KernelSpec("activation.silu", "torch", "pkg.ref:silu", reference=True),
    KernelSpec("activation.silu", "cpp", "pkg.cpp:silu", requires=["cpu"], priority=3),
]
if sys.argv[1] == "reversed":
    specs.reverse()
for spec in specs:
    kernreg.register_kernel(spec)
print(kernreg.registry.fingerprint(platforms=["cpu", "cuda:9.0"]))
"""


def _run(
    args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    environ.update({"KERNREG_PLUGINS": "none", "KERNREG_PLATFORM": "cpu"})
    environ.update(env or {})
    return subprocess.run(args, env=environ, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_the_fingerprint_is_stable_across_processes_and_import_orders() -> None:
    prints = {
        _run([sys.executable, "-c", FINGERPRINT_SCRIPT, order]).stdout.strip()
        for order in ("forward", "reversed", "forward")
    }
    assert len(prints) == 1
    (value,) = prints
    assert len(value) == 64


CLI_MODULE = """
import kernreg
from kernreg import KernelSpec
kernreg.register_kernel(KernelSpec("layernorm.rmsnorm", "torch", "json:dumps", reference=True))
kernreg.register_kernel(KernelSpec("layernorm.rmsnorm", "fast", "json:loads", priority=1))
"""


def test_kernreg_lock_writes_checks_and_is_followed(tmp_path: Path) -> None:
    (tmp_path / "plan_fixture.py").write_text(textwrap.dedent(CLI_MODULE))
    (tmp_path / "plan_fixture_pinned.py").write_text(textwrap.dedent(CLI_MODULE))
    kernreg_cli = [sys.executable, "-m", "kernreg", "-m", "plan_fixture"]
    lock = tmp_path / "kernreg.lock"
    written = _run([*kernreg_cli, "lock", "-o", str(lock), "--json"], cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    summary = json.loads(written.stdout)
    assert summary["path"] == str(lock)
    assert summary["entries"] == 1
    assert SelectionPlan.load(lock).entries()[0].backend == "fast"

    check = _run([*kernreg_cli, "lock", "--check", "-o", str(lock)], cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    assert "up to date (1 decisions)" in check.stdout

    drifted = _run(
        [*kernreg_cli, "lock", "--check", "-o", str(lock)],
        env={"KERNREG_PIN": "layernorm.rmsnorm=torch"},
        cwd=tmp_path,
    )
    assert drifted.returncode == 1
    assert "~ layernorm.rmsnorm on cpu, any dtype: fast (priority) -> torch (pin)" in drifted.stdout

    # A worker with KERNREG_LOCK follows the plan even where its own pins say otherwise.
    explained = _run(
        [*kernreg_cli, "explain", "layernorm.rmsnorm", "--json"],
        env={"KERNREG_LOCK": str(lock), "KERNREG_PIN": "layernorm.rmsnorm=torch"},
        cwd=tmp_path,
    )
    assert explained.returncode == 0, explained.stderr
    assert json.loads(explained.stdout)["rule"] == "plan"

    fingerprint_only = _run([*kernreg_cli, "lock", "--fingerprint"], cwd=tmp_path)
    assert fingerprint_only.stdout.strip() == summary["fingerprint"]


def test_a_bad_kernreg_lock_is_a_configuration_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.lock"
    bad.write_text("{")
    result = _run([sys.executable, "-m", "kernreg", "list"], env={"KERNREG_LOCK": str(bad)})
    assert result.returncode == 1
    assert "invalid configuration KERNREG_LOCK=" in result.stderr
    assert "not JSON" in result.stderr
    missing = _run(
        [sys.executable, "-m", "kernreg", "lock", "--check", "-o", str(tmp_path / "none.lock")]
    )
    assert missing.returncode == 1
    assert "no plan at" in missing.stderr


# --- plans read from hostile or foreign files ---------------------------------------------


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

    with pytest.raises(PlanError, match=r"not JSON|nested too deeply"):
        SelectionPlan.from_json(HOSTILE_JSON[name])
    with pytest.raises(TuningDataError, match="invalid tuning JSON"):
        TuningStore(tmp_path / "t.sqlite3").import_json(HOSTILE_JSON[name])


@pytest.mark.parametrize("spelling", ["CPU", " cpu", "Cpu "])
def test_a_plan_platform_spelt_differently_still_decides(spelling: str, tmp_path: Path) -> None:
    import kernreg
    from kernreg.plan import SelectionPlan

    registry = kernreg.KernelRegistry(
        config=kernreg.config.Config(), platform=kernreg.Platform.parse("cpu")
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

    plan = kernreg.registry.build_plan(registry, platforms=["cpu"])
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


def test_an_oversized_plan_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    # How long refusing takes is measured by benchmarks/bench_limits.py.
    from kernreg.plan import MAX_PLAN_BYTES, PlanError, SelectionPlan

    row = '["layernorm.rmsnorm", "cpu", null, "torch", "", "reference", "t", "", "", null]'
    count = MAX_PLAN_BYTES // len(row) + 1
    path = tmp_path / "huge.json"
    with open(path, "w") as handle:
        handle.write('{"kernreg_plan": 1, "entries": [')
        handle.write(", ".join([row] * count))
        handle.write("]}")
    with pytest.raises(PlanError, match="more than the"):
        SelectionPlan.load(path)
    # Not valid JSON past the limit: refused by its size, so never parsed.
    path.write_text('{"kernreg_plan": 1, "entries": [' + "x" * MAX_PLAN_BYTES)
    with pytest.raises(PlanError, match="more than the"):
        SelectionPlan.load(path)


# --- damaged lock files: a PlanError naming the file --------------------------------------


@pytest.fixture
def lock_text(targets: None) -> str:
    reg = KernelRegistry(config=Config(), platform=Platform.parse("cuda:9.0"))
    reg.register(KernelSpec(BAD_INPUT_OP, "torch", "hard_targets:ref", reference=True))
    reg.register(KernelSpec(BAD_INPUT_OP, "triton", BAD_INPUT_TARGET, dtypes=["bf16"], priority=10))
    return kernreg.registry.build_plan(reg, platforms=["cuda:9.0", "cpu"]).to_json()


def _edit(text: str, edit: Callable[[dict[str, Any]], None]) -> str:
    document = json.loads(text)
    edit(document)
    return json.dumps(document)


def _set_field(name: str, value: Any, row: int = 0) -> Callable[[dict[str, Any]], None]:
    def edit(document: dict[str, Any]) -> None:
        document["entries"][row][document["fields"].index(name)] = value

    return edit


LOCK_EDITS: list[tuple[str, Callable[[str], str], str]] = [
    ("truncated-half", lambda t: t[: len(t) // 2], "not JSON"),
    ("truncated-last-byte", lambda t: t.rstrip()[:-1], "not JSON"),
    ("truncated-to-header", lambda t: t[: t.index('"fields"')], "not JSON"),
    ("empty", lambda t: "", "not JSON"),
    ("future-format", lambda t: t.replace('"kernreg_plan": 1', '"kernreg_plan": 2'), "format 2"),
    (
        "format-as-string",
        lambda t: t.replace('"kernreg_plan": 1', '"kernreg_plan": "1"'),
        "format '1'",
    ),
    ("no-format", lambda t: _edit(t, lambda d: d.pop("kernreg_plan")), "not a kernreg plan"),
    ("fields-reordered", lambda t: _edit(t, lambda d: d["fields"].reverse()), "'fields' must be"),
    (
        "entries-not-list",
        lambda t: _edit(t, lambda d: d.update(entries={})),
        "'entries' must be a list",
    ),
    ("row-too-short", lambda t: _edit(t, lambda d: d["entries"][0].pop()), "entry 0 is not a row"),
    (
        "op-not-an-id",
        lambda t: _edit(t, _set_field("op", "Hard.Norm")),
        "entry 0: invalid op 'Hard.Norm'",
    ),
    ("op-int", lambda t: _edit(t, _set_field("op", 3)), "field 'op' is 3"),
    (
        "backend-not-a-name",
        lambda t: _edit(t, _set_field("backend", "Triton")),
        "invalid backend 'Triton'",
    ),
    (
        "variant-not-a-name",
        lambda t: _edit(t, _set_field("variant", "V 2")),
        "invalid variant 'V 2'",
    ),
    (
        "platform-typo",
        lambda t: _edit(t, _set_field("platform", "cuda:90")),
        "invalid platform 'cuda:90'",
    ),
    ("dtypes-string", lambda t: _edit(t, _set_field("dtypes", "bfloat16")), "field 'dtypes'"),
    ("dtypes-int-item", lambda t: _edit(t, _set_field("dtypes", [16])), "field 'dtypes'"),
    ("rule-null", lambda t: _edit(t, _set_field("rule", None)), "field 'rule' is None"),
    (
        "duplicate-entry",
        lambda t: _edit(
            t,
            lambda d: d["entries"].append([*d["entries"][0][:3], "cuda", *d["entries"][0][4:]]),
        ),
        "two entries for hard.norm",
    ),
]


@pytest.mark.parametrize(
    ("edit", "why"), [pytest.param(e, w, id=name) for name, e, w in LOCK_EDITS]
)
def test_a_damaged_lock_file_is_refused_naming_the_file(
    lock_text: str, tmp_path: Path, edit: Callable[[str], str], why: str
) -> None:
    SelectionPlan.from_json(lock_text)  # the unedited file is fine
    path = tmp_path / "kernreg.lock"
    path.write_text(edit(lock_text))
    with pytest.raises(PlanError) as info:
        SelectionPlan.load(path)
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(f"invalid selection plan {path}: ")
    assert why in str(info.value)
    # Through KERNREG_LOCK: a configuration error at start-up, naming the variable and file.
    with pytest.raises(ConfigError) as config_info:
        load_config({"KERNREG_LOCK": str(path)})
    assert config_info.value.key == "KERNREG_LOCK"
    assert str(path) in str(config_info.value)


@pytest.mark.parametrize("content", [b"\xff\xfe{", b"\x00" * 16], ids=["not-utf8", "nul-bytes"])
def test_a_binary_lock_file_is_a_plan_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "kernreg.lock"
    path.write_bytes(content)
    with pytest.raises(PlanError, match="invalid selection plan"):
        SelectionPlan.load(path)


# --- hostile lock files: a PlanError, never a raw RecursionError or OverflowError ---------


FIELDS_JSON = json.dumps(FIELDS)
ROW = ["norm.rms", "cpu", None, "fast", "", "priority", "m:f", None, None, None]


def _plan_text(*rows: object, head: str = '"kernreg_plan": 1') -> str:
    return f'{{{head}, "fields": {FIELDS_JSON}, "entries": {json.dumps(list(rows))}}}'


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


def test_the_entry_limit_holds_below_the_size_limit() -> None:
    short = ["a.b", "cpu", None, "", "", "", "", None, None, None]
    text = _plan_text(*[short] * (MAX_PLAN_ENTRIES + 1))
    assert len(text) < MAX_PLAN_BYTES
    with pytest.raises(PlanError, match=f"more than the {MAX_PLAN_ENTRIES}"):
        SelectionPlan.from_json(text)


def test_a_full_size_plan_loads(tmp_path: Path) -> None:
    entries = [
        PlanEntry(
            f"op{i // 100}.k{i % 100}",
            "cuda:9.0",
            ("bfloat16",),
            "triton",
            "v2",
            "priority",
            "pkg.module:function_name",
            "vendor-kernels",
            "1.2.3",
            f"x={i}",
        )
        for i in range(MAX_PLAN_ENTRIES)
    ]
    path = tmp_path / "full.lock"
    SelectionPlan(entries).save(path)
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
    registry = norm_registry(platform)
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
    registry = norm_registry("cpu")
    registry.use_plan(build_plan(norm_registry("cuda:9.0")))
    with pytest.warns(PlanWarning, match=r"decides for cuda:9\.0, not for cpu"):
        assert registry.select("norm.rms").backend == "fast"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per plan, not per decision
        registry.select("norm.rms", dtypes=["float32"])


def test_a_plan_for_another_inventory_is_a_plan_warning() -> None:
    other = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    other.register(KernelSpec("act.silu", "torch", "m:silu", reference=True))
    registry = norm_registry("cpu")
    registry.use_plan(build_plan(other))
    with pytest.warns(PlanWarning, match="names none of the 1 ops registered here"):
        registry.select("norm.rms")


def test_a_matching_plan_raises_no_warning() -> None:
    registry = norm_registry("cpu")
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


# --- a plan against the deny list ---------------------------------------------------------


def test_a_deny_rule_wins_over_a_plan_and_the_warning_names_both() -> None:
    from kernreg.config import Pin
    from kernreg.plan import PlanEntry, PlanWarning, SelectionPlan

    registry = KernelRegistry(
        config=Config(deny=(Pin("demo.*", "fast", None, source="KERNREG_DENY"),)),
        platform=Platform.parse("cpu"),
    )

    @kernreg.op("demo.denied", registry=registry)
    def denied(x: Any) -> str:
        return "reference"

    denied.register("fast", lambda x: "fast", priority=5)
    registry.use_plan(
        SelectionPlan(
            [PlanEntry("demo.denied", "cpu", None, "fast", "", "priority", "x:y")],
            source="plan.json",
        )
    )
    with pytest.warns(
        PlanWarning,
        match=r"planned fast .*denied by KERNREG_DENY.*demo\.\*.*wins over the plan plan\.json",
    ):
        assert denied(1) == "reference"
    decision = denied.explain()
    assert decision.chosen is not None
    assert decision.chosen.backend == "torch"
    assert decision.plan_miss is not None
    assert "KERNREG_DENY" in decision.plan_miss


# --- ops dispatching on several arguments follow the plan ------------------------------------


def _two_argument_op(registry: KernelRegistry) -> Any:
    @kernreg.op("demo.add", dispatch_args=("x", "y"), registry=registry)
    def add(x: Any, y: Any) -> str:
        return "reference"

    @add.register("fast", dtypes=["bfloat16", "float16"], priority=10)
    def fast(x: Any, y: Any) -> str:
        return "fast"

    @add.register("wide", dtypes=["bfloat16", "float16", "float32"], priority=5)
    def wide(x: Any, y: Any) -> str:
        return "wide"

    return add


@pytest.mark.parametrize(
    ("dtypes", "pinned"),
    [
        (("bfloat16", "bfloat16"), "wide"),
        (("float16", "float16"), "wide"),
        (("bfloat16", "float16"), "wide"),  # a mix both accept
        (("float16", "bfloat16"), "wide"),
        (("float32", "float32"), "torch"),
        (("bfloat16", "float32"), "torch"),  # a mix only "wide" accepts
        (("float64", "float64"), "torch"),  # a dtype no implementation names
        (("bfloat16", "float64"), "torch"),
    ],
)
def test_a_lock_file_is_followed_by_an_op_dispatching_on_two_arguments(
    tmp_path: Path, dtypes: tuple[str, str], pinned: str
) -> None:
    torch = pytest.importorskip("torch")
    # The plan is written where a pin chose, and followed where nothing is pinned.
    locked = KernelRegistry(config=Config(pins=f"demo.add={pinned}"), platform=Platform("cpu"))
    _two_argument_op(locked)
    build_plan(locked).save(tmp_path / "plan.json")
    registry = KernelRegistry(config=Config(), platform=Platform("cpu"))
    add = _two_argument_op(registry)
    x, y = (torch.ones(2, dtype=getattr(torch, name)) for name in dtypes)
    free = add(x, y)
    registry.use_plan(SelectionPlan.load(tmp_path / "plan.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no PlanWarning: the plan has this decision
        ran = add(x, y)
    # What runs is what the plan says for these dtypes (the pinned choice), not priority.
    planned = SelectionPlan.load(tmp_path / "plan.json").lookup("demo.add", "cpu", dtypes)
    assert planned is not None
    assert planned.backend == pinned
    assert ran == ("reference" if pinned == "torch" else pinned)
    assert add.explain_call(x, y).rule == "plan"
    if "float64" not in dtypes:
        assert free != ran  # priority alone would have run another kernel


# --- site pins are part of what runs ---------------------------------------------------------

SITE_PIN = "layernorm.rmsnorm@model.layers.0.*=torch"


def test_a_site_pin_changes_the_fingerprint_of_a_process() -> None:
    plain = _run([sys.executable, "-c", FINGERPRINT_SCRIPT, "forward"])
    pinned = _run([sys.executable, "-c", FINGERPRINT_SCRIPT, "forward"], {"KERNREG_PIN": SITE_PIN})
    other = _run(
        [sys.executable, "-c", FINGERPRINT_SCRIPT, "reversed"],
        {"KERNREG_PIN": f"  {SITE_PIN} "},
    )
    assert plain.returncode == pinned.returncode == other.returncode == 0, pinned.stderr
    assert plain.stdout != pinned.stdout
    assert pinned.stdout == other.stdout  # the same pin, spelt with spaces, in another order


def test_a_lock_file_records_site_pins_and_check_reports_their_drift(tmp_path: Path) -> None:
    (tmp_path / "plan_fixture.py").write_text(textwrap.dedent(CLI_MODULE))
    kernreg_cli = [sys.executable, "-m", "kernreg", "-m", "plan_fixture"]
    lock = tmp_path / "kernreg.lock"
    env = {"KERNREG_PIN": f"{SITE_PIN},activation.*@mlp=torch"}
    written = _run([*kernreg_cli, "lock", "-o", str(lock)], env=env, cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    plan = SelectionPlan.load(lock)
    assert plan.site_pins == ("activation.*@mlp=torch", SITE_PIN)
    assert SelectionPlan.from_json(plan.to_json()) == plan
    assert plan != SelectionPlan(plan.entries())  # the same decisions, no site pins
    assert plan.fingerprint() != SelectionPlan(plan.entries()).fingerprint()
    same = _run([*kernreg_cli, "lock", "--check", "-o", str(lock)], env=env, cwd=tmp_path)
    assert same.returncode == 0, same.stdout + same.stderr
    drifted = _run([*kernreg_cli, "lock", "--check", "-o", str(lock)], cwd=tmp_path)
    assert drifted.returncode == 1
    assert f"- site pin {SITE_PIN}" in drifted.stdout


def test_a_process_following_a_lock_fingerprints_the_site_pins_kernelize_binds_from_it() -> None:
    lock = build_plan(make_registry(pins=SITE_PIN))
    follows = make_registry()
    follows.use_plan(lock)
    without_pins = make_registry()
    without_pins.use_plan(SelectionPlan(lock.entries()))
    also_configured = make_registry(pins=SITE_PIN)
    also_configured.use_plan(lock)
    assert build_plan(follows, follow_plan=True).site_pins == (SITE_PIN,)
    assert fingerprint(follows) == fingerprint(also_configured) == lock.fingerprint()
    # Ranks that bind different kernels at a site do not share a fingerprint.
    assert fingerprint(without_pins) != fingerprint(follows)


@pytest.mark.parametrize(
    "site_pins", ['"layernorm.rmsnorm=torch"', '["a.b=torch"]', '["a.b@=torch"]', "[1]", "{}"]
)
def test_a_plan_with_malformed_site_pins_is_refused(site_pins: str) -> None:
    text = (
        SelectionPlan()
        .to_json()
        .replace('"kernreg_plan": 1', f'"kernreg_plan": 1, "site_pins": {site_pins}')
    )
    with pytest.raises(PlanError, match="site"):
        SelectionPlan.from_json(text)


# --- kernreg writes no plan that KERNREG_LOCK refuses ---------------------------------------


def test_a_plan_over_the_entry_cap_is_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kernreg.plan

    monkeypatch.setattr(kernreg.plan, "MAX_PLAN_ENTRIES", 3)
    registry = make_registry()
    plan = build_plan(registry, platforms=["cpu"])
    assert len(plan) > 3
    with pytest.raises(PlanError, match=r"more than the 3 a plan may have: not written"):
        plan.save(tmp_path / "plan.json")
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary file left


def test_a_plan_with_an_entry_load_refuses_is_not_written(tmp_path: Path) -> None:
    entry = PlanEntry("Not An Op", "cpu", None, "torch", "", "reference", "m:f")
    with pytest.raises(PlanError, match="not written: entry 0"):
        SelectionPlan([entry]).save(tmp_path / "plan.json")
    assert list(tmp_path.iterdir()) == []


LOCK_CAP_MODULE = """
import kernreg
from kernreg import KernelSpec
for i in range({ops}):
    kernreg.register_kernel(KernelSpec(f"cap.op{{i}}", "torch", "json:dumps", reference=True))
    kernreg.register_kernel(
        KernelSpec(f"cap.op{{i}}", "fast", "json:loads", dtypes=["fp16", "bf16", "fp32"])
    )
"""


def test_kernreg_lock_refuses_to_write_what_kernreg_lock_refuses_to_read(tmp_path: Path) -> None:
    (tmp_path / "cap_fixture.py").write_text(LOCK_CAP_MODULE.format(ops=11))
    lock = tmp_path / "kernreg.lock"
    # The real cap is 100,000 entries; 50 here, so 11 ops x 5 dtype sets (unknown, each of
    # three dtypes, all three together) are over it without deciding 100,000 times.
    script = (
        "import sys, kernreg.plan; kernreg.plan.MAX_PLAN_ENTRIES = 50\n"
        "from kernreg.cli import main\n"
        f"sys.exit(main(['-m', 'cap_fixture', 'lock', '-o', {str(lock)!r}]))\n"
    )
    written = _run([sys.executable, "-c", script], cwd=tmp_path)
    assert written.returncode == 1, written.stdout
    assert "55 entries, more than the 50 a plan may have" in written.stderr
    assert "unexpected" not in written.stderr
    assert not lock.exists()
    read = _run([sys.executable, "-c", script.replace("50", "55")], cwd=tmp_path)
    assert read.returncode == 0, read.stderr
    assert len(SelectionPlan.load(lock)) == 55


# --- a plan keeps the per-call `when` choices it was written with -----------------------------


def test_a_plan_written_here_keeps_the_when_predicates_choosing_per_call() -> None:
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))

    @kernreg.op("demo.decode", registry=registry)
    def decode(x: Any) -> str:
        return "reference"

    decode.register("fused", lambda x: "fused", priority=10, when=lambda x: len(x) == 1)
    decode.register("plain", lambda x: "plain", priority=5)
    unplanned = (decode([1]), decode([1, 2]))
    assert unplanned == ("fused", "plain")
    plan = build_plan(registry)
    registry.use_plan(plan)
    assert (decode([1]), decode([1, 2])) == unplanned
    decision = decode.explain()
    assert decision.rule == "plan"
    assert decision.candidate("fused").status == "conditional"
    assert decode.explain_call([1]).chosen == registry.get_backend("demo.decode", "fused")
    assert decode.explain_call([1, 2]).chosen == registry.get_backend("demo.decode", "plain")
    assert build_plan(registry, follow_plan=True).fingerprint() == plan.fingerprint()


def test_a_plan_that_chose_the_reference_keeps_a_when_predicate_of_equal_priority() -> None:
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))

    @kernreg.op("demo.decode", registry=registry)
    def decode(x: Any) -> str:
        return "reference"

    decode.register("fused", lambda x: "fused", when=lambda x: len(x) == 1)
    registry.use_plan(build_plan(registry))
    assert (decode([1]), decode([1, 2])) == ("fused", "reference")
    assert decode.explain_call([1]).chosen == registry.get_backend("demo.decode", "fused")


def test_a_call_without_dtypes_finds_no_dtype_set_in_a_plan() -> None:
    # An empty set of dtypes is in every planned set: none of them was decided for it.
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    registry.register(KernelSpec("demo.any", "torch", "math:fabs", reference=True))
    registry.register(KernelSpec("demo.any", "bf", "math:fabs", dtypes=["bf16"], priority=10))
    registry.register(KernelSpec("demo.any", "wide", "math:fabs", dtypes=["f32"], priority=20))
    unplanned = registry.explain("demo.any", dtypes=[]).chosen
    registry.use_plan(build_plan(registry))
    assert registry.explain("demo.any", dtypes=[]).chosen == unplanned
    assert registry.plan is not None
    assert registry.plan.lookup("demo.any", "cpu", ()) is None

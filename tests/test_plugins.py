"""Plugins from real installed distributions: discovery order, attribution, isolation, config.

The fixture projects in ``plugin_fixtures/`` are built as wheels and installed with pip
once per session. Checks that involve the process-wide registry or environment variables
run in a fresh interpreter with the install directories on ``PYTHONPATH``; checks on a
private :class:`KernelRegistry` put the install directory on ``sys.path`` in-process.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

import sys
import time

import kernreg
from kernreg import KernelConflictError, KernelRegistry, KernelSpec, Platform
from kernreg.config import Config
from kernreg.errors import PluginLoadError, RegistryFrozenError
from kernreg.plugins import (
    PLUGIN_API_VERSION,
    PluginInfo,
    PluginReport,
    PluginWarning,
    discover,
    load_plugins,
)

FIXTURES = Path(__file__).parent / "plugin_fixtures"

FUNC = "kernreg-fixture-func"
MODULE = "kernreg-fixture-module"
CONFLICT_A = "kernreg-fixture-conflict-a"
CONFLICT_B = "kernreg-fixture-conflict-b"
DUP_A = "kernreg-fixture-dup-a"
DUP_B = "kernreg-fixture-dup-b"
BROKEN = "kernreg-fixture-broken"
WRONG_API = "kernreg-fixture-wrong-api"
EXIT = "kernreg-fixture-exit"

#: Install directories: everything, and two halves that the order tests put on the path
#: both ways round (each half holds one of the conflicting and one of the duplicate pair).
FIRST_HALF = ("func", "conflict_a", "dup_a", "broken")
SECOND_HALF = ("module", "conflict_b", "dup_b", "wrong_api", "exit")


def _load_wheels_helper() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_kernreg_fixture_wheels", FIXTURES / "wheels.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Installed:
    def __init__(self, root: Path) -> None:
        self.all = root / "all"
        self.first = root / "first"
        self.second = root / "second"
        self.docs = root / "docs"


DOCS = Path(__file__).parent.parent / "docs" / "plugins.md"


def docs_example(wheels_helper: ModuleType, out_dir: Path) -> Path:
    """The wheel of the registration-function example in docs/plugins.md, as written there."""
    blocks = re.findall(r"```(\w+)\n(.*?)```", DOCS.read_text(), re.DOTALL)
    pyproject = next(text for lang, text in blocks if lang == "toml" and "[project]" in text)
    module = next(text for lang, text in blocks if lang == "python" and "def register(" in text)
    meta = tomllib.loads(pyproject)["project"]
    (entry_point,) = meta["entry-points"]["kernreg.kernels"].values()
    path = entry_point.partition(":")[0].replace(".", "/") + ".py"
    files = {f"{path.split('/')[0]}/__init__.py": "", path: module}
    return wheels_helper.write_wheel(  # type: ignore[no-any-return]
        out_dir, meta["name"], meta["version"], files, meta["entry-points"]["kernreg.kernels"]
    )


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """Every fixture project built as a wheel and pip-installed into target directories."""
    wheels_helper = _load_wheels_helper()
    root = tmp_path_factory.mktemp("plugins")
    assert sorted(wheels_helper.projects()) == sorted(FIRST_HALF + SECOND_HALF)
    wheels = {
        name: wheels_helper.build_project(name, root / "wheels")
        for name in FIRST_HALF + SECOND_HALF
    }
    result = Installed(root)
    jobs = [
        wheels_helper.install([docs_example(wheels_helper, root / "wheels")], result.docs),
        wheels_helper.install(wheels.values(), result.all),
        wheels_helper.install([wheels[n] for n in FIRST_HALF], result.first),
        wheels_helper.install([wheels[n] for n in SECOND_HALF], result.second),
    ]
    for job in jobs:
        output, _ = job.communicate()
        assert job.returncode == 0, output.decode()
    assert (result.all / "kernreg_fixture_func-1.0.dist-info" / "entry_points.txt").is_file()
    return result


@pytest.fixture
def on_path(installed: Installed, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The full install directory on ``sys.path``; fixture modules are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(installed.all))
    yield installed.all
    for name in [m for m in sys.modules if m.startswith("kernreg_fixture_")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def private_registry(
    *allowed: str, deny: Sequence[str] = (), strict: bool = False
) -> KernelRegistry:
    config = Config(
        plugins=tuple(allowed) or "auto", plugins_deny=tuple(deny), strict_plugins=strict
    )
    return KernelRegistry(config=config, platform=Platform.parse("cpu"))


def fixture_infos(infos: Sequence[PluginInfo]) -> list[PluginInfo]:
    return [info for info in infos if info.distribution.startswith("kernreg-fixture-")]


def fixture_modules() -> list[str]:
    return sorted(m for m in sys.modules if m.startswith("kernreg_fixture_"))


# --- discovery ------------------------------------------------------------------------------


def test_discovery_is_sorted_by_distribution_then_name_and_imports_nothing(on_path: Path) -> None:
    infos = fixture_infos(discover())
    assert [(i.distribution, i.name) for i in infos] == [
        (BROKEN, "broken_on_import"),
        (BROKEN, "broken_register"),
        (CONFLICT_A, "conflict_a"),
        (CONFLICT_B, "conflict_b"),
        (DUP_A, "dup_kernels"),
        (DUP_B, "dup_kernels"),
        (EXIT, "exit_kernels"),
        (FUNC, "scale_kernels"),
        (MODULE, "gelu_kernels"),
        (WRONG_API, "future_function"),
        (WRONG_API, "future_module"),
    ]
    func = next(i for i in infos if i.distribution == FUNC)
    assert (func.version, func.value, func.is_module) == (
        "1.0",
        "kernreg_fixture_func.kernels:register",
        False,
    )
    assert fixture_modules() == []


def test_discovery_takes_explicit_entry_points(on_path: Path) -> None:
    import importlib.metadata

    eps = [
        ep
        for dist in importlib.metadata.distributions(path=[str(on_path)])
        for ep in dist.entry_points
        if ep.group == "kernreg.kernels" and dist.metadata["Name"] in (MODULE, FUNC)
    ]
    eps.append(importlib.metadata.EntryPoint("loose", "loose_pkg:register", "kernreg.kernels"))
    assert [(i.distribution, i.name) for i in discover(reversed(eps))] == [
        ("<unknown>", "loose"),
        (FUNC, "scale_kernels"),
        (MODULE, "gelu_kernels"),
    ]


# --- loading into a private registry ------------------------------------------------------


def test_function_plugin_registers_specs_attributed_to_its_distribution(on_path: Path) -> None:
    reg = private_registry(FUNC)
    report = load_plugins(registry=reg)
    assert [(info.distribution, info.name, count) for info, count in report.loaded] == [
        (FUNC, "scale_kernels", 2)
    ]
    assert report.ok
    assert (MODULE, "not in KERNREG_PLUGINS") in [(i.distribution, r) for i, r in report.skipped]
    for spec in reg.get("fixture.scale"):
        assert spec.origin is not None
        assert (spec.origin.distribution, spec.origin.version) == (FUNC, "1.0")
        assert spec.origin.file.endswith(os.path.join("kernreg_fixture_func", "kernels.py"))
        assert f"(distribution {FUNC} 1.0)" in str(spec.origin)
    assert reg.select("fixture.scale").label == "triton"
    assert reg.get_kernel("fixture.scale")([1, 2]) == [2, 4]


def test_loading_twice_is_a_no_op(on_path: Path) -> None:
    reg = private_registry(FUNC)
    first = load_plugins(registry=reg)
    generation = reg.generation
    assert load_plugins(registry=reg) is first
    assert reg.generation == generation
    again = load_plugins(registry=reg, reload=True)
    assert [(i.distribution, n) for i, n in again.loaded] == [(FUNC, 0)]  # already registered
    assert len(reg) == 2


def test_allow_list_matches_normalized_distribution_names(on_path: Path) -> None:
    reg = private_registry("Kernreg_Fixture.Func")
    report = load_plugins(registry=reg)
    assert [info.distribution for info, _ in report.loaded] == [FUNC]
    reasons = {info.distribution: reason for info, reason in report.skipped}
    assert reasons[BROKEN] == "not in KERNREG_PLUGINS"
    assert fixture_modules() == ["kernreg_fixture_func", "kernreg_fixture_func.kernels"]


def test_module_entry_points_are_skipped_for_a_private_registry(on_path: Path) -> None:
    reg = private_registry(MODULE)
    report = load_plugins(registry=reg)
    assert report.loaded == ()
    assert report.ok
    assert [
        (i.distribution, reason) for i, reason in report.skipped if i.distribution == MODULE
    ] == [(MODULE, "module entry point: it registers into the process-wide registry")]
    assert fixture_modules() == []
    assert len(reg) == 0


CONFLICT_START = (
    "Conflicting kernel registration for op 'fixture.conflict', backend 'triton': "
    "'kernreg_fixture_conflict_a.impl:kernel' != 'kernreg_fixture_conflict_b.impl:kernel'"
)


def test_conflict_between_plugins_withdraws_both_sides_and_keeps_the_rest(
    on_path: Path,
) -> None:
    reg = private_registry(CONFLICT_B, CONFLICT_A)
    with pytest.warns(PluginWarning, match=f"{CONFLICT_START}.*{CONFLICT_A}.*{CONFLICT_B}") as rec:
        report = load_plugins(registry=reg)
    assert len(rec) == 1
    assert rec[0].filename == __file__  # points at the caller, not at kernreg
    assert f"KERNREG_PLUGINS_DENY={CONFLICT_B} keeps {CONFLICT_A}'s" in str(rec[0].message)
    assert f"KERNREG_PLUGINS_DENY={CONFLICT_A} keeps {CONFLICT_B}'s" in str(rec[0].message)
    assert not report.ok
    assert report.failed == ()
    # Each side keeps everything but the disputed spec: its reference and other ops.
    assert [(i.distribution, n) for i, n in report.loaded] == [(CONFLICT_A, 1), (CONFLICT_B, 1)]
    (conflict,) = report.conflicts
    assert [i.distribution for i in conflict.plugins] == [CONFLICT_A, CONFLICT_B]
    assert conflict.error.startswith(CONFLICT_START)
    assert reg.ops() == ("fixture.conflict", "fixture.extra")
    assert [s.label for s in reg.get("fixture.conflict")] == ["torch"]
    assert reg.select("fixture.conflict").target == "kernreg_fixture_conflict_a.impl:kernel"
    assert report.describe()["conflicts"] == [conflict.describe()]
    assert conflict.describe()["backends"] == ["triton"]


def test_conflict_in_strict_mode_raises_naming_the_distribution(on_path: Path) -> None:
    reg = private_registry(CONFLICT_A, CONFLICT_B, strict=True)
    with pytest.raises(PluginLoadError, match=f"{CONFLICT_B}.*failed to load") as info:
        load_plugins(registry=reg)
    assert info.value.distribution == CONFLICT_B
    assert info.value.entry_point == "conflict_b"
    assert isinstance(info.value.__cause__, KernelConflictError)
    assert str(info.value.__cause__).startswith(CONFLICT_START)
    assert reg.plugin_report is None  # strict failures are raised again on the next attempt
    assert reg.ops() == ("fixture.conflict",)


def test_conflict_with_the_host_program_names_the_distribution_and_the_host_file(
    on_path: Path,
) -> None:
    reg = private_registry(CONFLICT_A)
    reg.register(KernelSpec("fixture.conflict", "triton", "host_program.kernels:conflict"))
    with pytest.warns(PluginWarning, match=CONFLICT_A):
        report = load_plugins(registry=reg)
    exception = report.failed[0].exception
    assert isinstance(exception, KernelConflictError)
    message = str(exception)
    assert message.startswith(
        "Conflicting kernel registration for op 'fixture.conflict', backend 'triton': "
        "'host_program.kernels:conflict' != 'kernreg_fixture_conflict_a.impl:kernel'"
    )
    assert f"registered first at: {__file__}:" in message
    assert f"(distribution {CONFLICT_A} 1.0)" in message
    # The plugin's reference for the op (registered before the conflict) is undone too.
    assert [s.target for s in reg.get("fixture.conflict")] == ["host_program.kernels:conflict"]


def test_host_registering_after_a_plugin_gets_the_conflict_naming_the_plugin(
    on_path: Path,
) -> None:
    reg = private_registry(CONFLICT_A)
    load_plugins(registry=reg)
    with pytest.raises(KernelConflictError) as info:
        reg.register(KernelSpec("fixture.conflict", "triton", "host_program.kernels:conflict"))
    message = str(info.value)
    assert message.startswith(
        "Conflicting kernel registration for op 'fixture.conflict', backend 'triton': "
        "'kernreg_fixture_conflict_a.impl:kernel' != 'host_program.kernels:conflict'"
    )
    assert f"(distribution {CONFLICT_A} 1.0)" in message


DUPLICATE_START = f"Multiple distributions register kernel plugin 'dup_kernels': {DUP_A}, {DUP_B}"


def test_duplicate_entry_point_names_fail_both_and_say_how_to_resolve(on_path: Path) -> None:
    reg = private_registry(DUP_B, DUP_A, FUNC)
    with pytest.warns(PluginWarning, match="Multiple distributions") as rec:
        report = load_plugins(registry=reg)
    assert len(rec) == 2
    assert [(f.plugin.distribution, f.plugin.name) for f in report.failed] == [
        (DUP_A, "dup_kernels"),
        (DUP_B, "dup_kernels"),
    ]
    for failure in report.failed:
        assert failure.error.startswith(DUPLICATE_START)
        assert "KERNREG_PLUGINS_DENY" in failure.error
        assert "uninstall" in failure.error
        assert isinstance(failure.exception, PluginLoadError)
    assert [i.distribution for i, _ in report.loaded] == [FUNC]
    assert reg.ops() == ("fixture.scale",)
    assert "kernreg_fixture_dup_a" not in sys.modules
    assert "kernreg_fixture_dup_b" not in sys.modules


def test_duplicate_entry_point_names_in_strict_mode_fail_before_any_plugin_runs(
    on_path: Path,
) -> None:
    reg = private_registry(CONFLICT_A, DUP_A, DUP_B, FUNC, strict=True)
    with pytest.raises(PluginLoadError, match=DUPLICATE_START) as info:
        load_plugins(registry=reg)
    assert info.value.entry_point == "dup_kernels"
    assert len(reg) == 0
    assert fixture_modules() == []


def test_denying_one_of_a_duplicate_pair_resolves_it(on_path: Path) -> None:
    reg = private_registry(DUP_A, DUP_B, deny=["kernreg_fixture_dup_b"])
    report = load_plugins(registry=reg)
    assert report.ok
    assert [(i.distribution, n) for i, n in report.loaded] == [(DUP_A, 1)]
    assert [(i.distribution, r) for i, r in report.skipped if i.name == "dup_kernels"] == [
        (DUP_B, "denied by KERNREG_PLUGINS_DENY")
    ]
    assert "kernreg_fixture_dup_b" not in sys.modules


@pytest.mark.parametrize("spelling", ["Kernreg__Fixture.-Func", "KERNREG_FIXTURE_FUNC"])
def test_allow_and_deny_lists_match_names_as_pep_503_normalizes_them(
    on_path: Path, spelling: str
) -> None:
    allowed = load_plugins(registry=private_registry(spelling))
    assert [i.distribution for i, _ in allowed.loaded] == [FUNC]
    assert allowed.unmatched_allowed((spelling,)) == []
    denied = load_plugins(registry=private_registry(FUNC, deny=[spelling]))
    assert denied.loaded == ()
    assert denied.unmatched_denials([spelling]) == []


def test_an_allow_list_naming_no_installed_plugin_is_reported(on_path: Path) -> None:
    # A misspelt KERNREG_PLUGINS loads nothing at all: that must not pass in silence.
    reg = private_registry("kernreg-fixture-fnuc")
    with pytest.warns(PluginWarning) as caught:
        report = load_plugins(registry=reg)
    assert report.loaded == ()
    assert [str(w.message) for w in caught] == [
        "KERNREG_PLUGINS names 'kernreg-fixture-fnuc', which ships no installed plugin, "
        f"so it allows nothing; did you mean '{FUNC}'?"
    ]


def test_failing_plugin_leaves_no_half_registered_specs_or_overrides(on_path: Path) -> None:
    reg = private_registry(BROKEN)
    host = reg.register(KernelSpec("fixture.half", "triton", "host_program.kernels:half"))
    generation = reg.generation
    config, platform, plan = reg.config, reg.platform, reg.plan
    with pytest.warns(PluginWarning, match=f"{BROKEN}.*fails half-way"):
        report = load_plugins(registry=reg)
    (failure,) = report.failed
    assert (failure.plugin.name, type(failure.exception)) == ("broken_register", ValueError)
    assert reg.all_specs() == (host,)
    assert reg.get_backend("fixture.half", "triton").origin == host.origin
    assert reg.reference("fixture.half") is None
    assert reg.overrides() == ()
    assert reg.generation > generation  # cached decisions were invalidated by the undo
    # Its freeze(), configure() and use_plan() were undone as well.
    assert not reg.frozen
    assert (reg.config, reg.platform, reg.plan) == (config, platform, plan)
    assert reg.config is config
    reg.register(KernelSpec("fixture.after", "torch", "host_program.kernels:after"))


def test_failing_plugin_in_strict_mode_raises_and_leaves_nothing(on_path: Path) -> None:
    reg = private_registry(BROKEN, strict=True)
    with pytest.raises(PluginLoadError, match=f"distribution {BROKEN} 0.1 failed to load") as info:
        load_plugins(registry=reg)
    assert info.value.distribution == BROKEN
    assert isinstance(info.value.__cause__, ValueError)
    assert len(reg) == 0


def test_strict_argument_overrides_the_configuration(on_path: Path) -> None:
    with pytest.raises(PluginLoadError):
        load_plugins(registry=private_registry(BROKEN), strict=True)
    lenient = private_registry(BROKEN, strict=True)
    with pytest.warns(PluginWarning):
        assert not load_plugins(registry=lenient, strict=False).ok


def test_wrong_plugin_api_is_an_error_naming_the_distribution(on_path: Path) -> None:
    reg = private_registry(WRONG_API)
    with pytest.warns(PluginWarning, match=WRONG_API):
        report = load_plugins(registry=reg)
    (failure,) = report.failed
    assert failure.plugin.name == "future_function"
    assert isinstance(failure.exception, PluginLoadError)
    assert failure.exception.distribution == WRONG_API
    assert f"declares kernreg plugin API 2, but this kernreg supports API {PLUGIN_API_VERSION}" in (
        failure.error
    )
    assert len(reg) == 0  # its registration function was never called

    with pytest.raises(PluginLoadError, match=f"{WRONG_API} 3.0 declares kernreg plugin API 2"):
        load_plugins(registry=private_registry(WRONG_API, strict=True))


def test_a_private_registry_that_autoloads_warns_at_the_selecting_call(on_path: Path) -> None:
    reg = private_registry(FUNC, BROKEN)
    reg.autoload_plugins = True
    with pytest.warns(PluginWarning, match=BROKEN) as rec:
        assert reg.select("fixture.scale").origin.distribution == FUNC  # type: ignore[union-attr]
    assert rec[0].filename == __file__
    assert reg.select("fixture.scale").label == "triton"  # no second warning, no reload


def test_a_replacement_registered_before_plugins_load_replaces_the_plugins_spec(
    on_path: Path,
) -> None:
    reg = private_registry(FUNC)
    reg.autoload_plugins = True

    def mine(x: Any) -> Any:
        return x

    reg.register(KernelSpec("fixture.scale", "triton", mine, priority=10), replace=True)
    assert reg.select("fixture.scale").target is mine  # type: ignore[union-attr]
    assert reg.plugin_report.failed == ()  # the plugin is loaded, not failed for it
    assert [(i.distribution, n) for i, n in reg.plugin_report.loaded] == [(FUNC, 2)]
    assert [(o.kind, o.old.origin.distribution) for o in reg.overrides()] == [("replace", FUNC)]


def test_concurrent_first_selections_load_plugins_once(on_path: Path) -> None:
    reg = private_registry(FUNC)
    reg.autoload_plugins = True
    barrier = threading.Barrier(8)

    def select() -> str:
        barrier.wait()
        return reg.select("fixture.scale").label

    with ThreadPoolExecutor(8) as pool:
        labels = list(pool.map(lambda _: select(), range(8)))
    assert labels == ["triton"] * 8
    assert [(i.distribution, n) for i, n in reg.plugin_report.loaded] == [(FUNC, 2)]


def test_plugins_none_discovers_nothing(on_path: Path) -> None:
    reg = KernelRegistry(config=Config(plugins="none"), platform=Platform.parse("cpu"))
    report = load_plugins(registry=reg)
    assert report == PluginReport(disabled="KERNREG_PLUGINS=none")
    assert str(report) == "plugins disabled: KERNREG_PLUGINS=none"


# --- the process-wide registry, in a fresh interpreter ------------------------------------

SUMMARY = """
import json, sys, warnings
import kernreg

def summary(caught=()):
    report = kernreg.default_registry().plugin_report
    fixture = lambda info: info.distribution.startswith("kernreg-fixture-")
    return {
        "loaded": [[i.distribution, i.version, i.name, n] for i, n in report.loaded if fixture(i)],
        "failed": [
            [f.plugin.distribution, f.plugin.name, type(f.exception).__name__, f.error]
            for f in report.failed if fixture(f.plugin)
        ],
        "skipped": [[i.distribution, i.name, r] for i, r in report.skipped if fixture(i)],
        "disabled": report.disabled,
        "conflicts": [[i.distribution for i in c.plugins] for c in report.conflicts],
        "specs": [
            [s.op, s.label, s.target, s.origin.distribution, s.origin.version]
            for s in kernreg.default_registry().all_specs() if s.op.startswith("fixture.")
        ],
        "modules": sorted(m for m in sys.modules if m.startswith("kernreg_fixture_")),
        "warnings": [[w.category.__name__, str(w.message)] for w in caught],
    }
"""


def run_python(
    code: str, path: Sequence[Path], env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``code`` after SUMMARY in a fresh interpreter; return what it printed as JSON."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    environ["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    environ["KERNREG_PLATFORM"] = "cpu"  # detection would import torch: a second per process
    environ.update(env or {})
    result = subprocess.run(
        [sys.executable, "-c", SUMMARY + textwrap.dedent(code)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    output: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return output


SELECT_ALL = """
assert kernreg.default_registry().plugin_report is None
assert not [m for m in sys.modules if m.startswith("kernreg_fixture_")]  # import kernreg loads none
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    spec = kernreg.select_kernel("fixture.scale")
    kernreg.select_kernel("fixture.gelu")
out = summary(caught)
out["chosen"] = [spec.label, spec.origin.distribution]
print(json.dumps(out))
"""


def test_first_selection_loads_plugins_with_their_distributions(installed: Installed) -> None:
    out = run_python(SELECT_ALL, [installed.all], {"KERNREG_PLUGINS": f"{FUNC},{MODULE}"})
    assert out["chosen"] == ["triton", FUNC]
    assert out["loaded"] == [[FUNC, "1.0", "scale_kernels", 2], [MODULE, "2.1", "gelu_kernels", 2]]
    assert out["failed"] == []
    assert out["warnings"] == []
    assert out["specs"] == [
        ["fixture.gelu", "aot", "kernreg_fixture_module.impl:gelu_aot", MODULE, "2.1"],
        ["fixture.gelu", "torch", "kernreg_fixture_module.impl:gelu_reference", MODULE, "2.1"],
        ["fixture.scale", "triton", "kernreg_fixture_func.impl:scale_fast", FUNC, "1.0"],
        ["fixture.scale", "torch", "kernreg_fixture_func.impl:scale_reference", FUNC, "1.0"],
    ]


def test_every_failure_is_isolated_reported_and_warned_once(
    installed: Installed, tmp_path: Path
) -> None:
    code = SELECT_ALL.replace("print(", "kernreg.select_kernel('fixture.scale')\nprint(")
    out = run_python(code, [installed.all], {"FIXTURE_MARKER_DIR": str(tmp_path)})
    # The process survived a plugin calling sys.exit, and the good plugins loaded.
    assert out["chosen"] == ["triton", FUNC]
    assert [row[0] for row in out["loaded"]] == [CONFLICT_A, CONFLICT_B, FUNC, MODULE]
    assert out["conflicts"] == [[CONFLICT_A, CONFLICT_B]]
    failed = {(dist, name): (kind, error) for dist, name, kind, error in out["failed"]}
    assert sorted(failed) == [
        (BROKEN, "broken_on_import"),
        (BROKEN, "broken_register"),
        (DUP_A, "dup_kernels"),
        (DUP_B, "dup_kernels"),
        (EXIT, "exit_kernels"),
        (WRONG_API, "future_function"),
        (WRONG_API, "future_module"),
    ]
    assert failed[BROKEN, "broken_on_import"] == (
        "RuntimeError",
        "RuntimeError: kernreg_fixture_broken.on_import fails on import",
    )
    assert failed[EXIT, "exit_kernels"] == ("SystemExit", "SystemExit: 3")
    # One warning per failure and conflict, at the first selection only.
    assert len(out["warnings"]) == len(out["failed"]) + 1
    assert all(category == "PluginWarning" for category, _ in out["warnings"])
    # Nothing of a failed plugin is left: the module-level registration of broken_on_import
    # and of the wrong-API module were undone; the conflicting plugins keep all but the dispute.
    assert {row[3] for row in out["specs"]} == {CONFLICT_A, CONFLICT_B, FUNC, MODULE}
    assert not [row for row in out["specs"] if row[:2] == ["fixture.conflict", "triton"]]
    # The markers prove the broken modules did run (so the deny test below means something).
    assert sorted(os.listdir(tmp_path)) == ["half", "on_import"]


@pytest.mark.parametrize(
    "env",
    [
        {"KERNREG_PLUGINS_DENY": f"{BROKEN},{EXIT}"},
        {"KERNREG_PLUGINS": f"{FUNC},{MODULE}"},
        {"KERNREG_PLUGINS": "none"},
    ],
    ids=["deny", "allow", "none"],
)
def test_allow_and_deny_lists_apply_before_any_plugin_code_runs(
    installed: Installed, tmp_path: Path, env: dict[str, str]
) -> None:
    code = """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = kernreg.plugins.load_plugins(strict=False)
        try:
            kernreg.select_kernel("fixture.half")
        except KeyError as exc:
            missing = type(exc).__name__
    out = summary(caught)
    out["missing"] = missing
    print(json.dumps(out))
    """
    out = run_python(code, [installed.all], {"FIXTURE_MARKER_DIR": str(tmp_path), **env})
    assert os.listdir(tmp_path) == []
    assert out["missing"] == "OpNotFoundError"
    assert not [
        m
        for m in out["modules"]
        if m.startswith(("kernreg_fixture_broken", "kernreg_fixture_exit"))
    ]
    assert not [row for row in out["failed"] if row[0] in (BROKEN, EXIT)]
    if env.get("KERNREG_PLUGINS") == "none":
        assert out["disabled"] == "KERNREG_PLUGINS=none"
        assert out["modules"] == []
        assert out["skipped"] == []
    elif "KERNREG_PLUGINS_DENY" in env:
        assert [row for row in out["skipped"] if row[0] == BROKEN] == [
            [BROKEN, "broken_on_import", "denied by KERNREG_PLUGINS_DENY"],
            [BROKEN, "broken_register", "denied by KERNREG_PLUGINS_DENY"],
        ]
    else:
        assert [row[0] for row in out["loaded"]] == [FUNC, MODULE]
        assert out["warnings"] == []


def test_strict_plugins_from_the_environment_raise_but_import_never_fails(
    installed: Installed,
) -> None:
    code = """
    out = {"report": kernreg.default_registry().plugin_report}
    for attempt in range(2):
        try:
            kernreg.select_kernel("fixture.scale")
        except kernreg.errors.PluginLoadError as exc:
            out.setdefault("errors", []).append(
                [exc.distribution, exc.entry_point, type(exc.__cause__).__name__, str(exc)]
            )
    try:  # every reader of the inventory loads the plugins first, so it raises the same
        out["scale"] = kernreg.default_registry().has("fixture.scale")
    except kernreg.errors.PluginLoadError as exc:
        out["scale"] = type(exc).__name__
    out["seen"] = "kernreg_fixture_func" in sys.modules
    print(json.dumps(out))
    """
    env = {"KERNREG_STRICT_PLUGINS": "1", "KERNREG_PLUGINS": f"{EXIT},{FUNC}"}
    out = run_python(code, [installed.all], env)
    assert out["report"] is None
    # Raised on every attempt: a strict failure is never recorded as a loaded state.
    assert (
        out["errors"]
        == [
            [
                EXIT,
                "exit_kernels",
                "SystemExit",
                f"plugin 'exit_kernels' (kernreg_fixture_exit.kernels) from distribution "
                f"{EXIT} 1.0 failed to load: SystemExit: 3",
            ]
        ]
        * 2
    )
    assert out["scale"] == "PluginLoadError"
    assert out["seen"] is False  # kernreg-fixture-func sorts after the failure: never imported


def test_module_plugin_specs_come_back_after_a_scoped_block(installed: Installed) -> None:
    code = """
    with kernreg.default_registry().scoped():
        inside = kernreg.select_kernel("fixture.gelu").label
    assert kernreg.default_registry().plugin_report is None
    outside = kernreg.select_kernel("fixture.gelu")
    out = summary()
    out["labels"] = [inside, outside.label, outside.origin.distribution]
    print(json.dumps(out))
    """
    out = run_python(code, [installed.all], {"KERNREG_PLUGINS": MODULE})
    assert out["labels"] == ["aot", "aot", MODULE]
    assert out["loaded"] == [[MODULE, "2.1", "gelu_kernels", 2]]


def test_result_does_not_depend_on_installation_or_sys_path_order(installed: Installed) -> None:
    code = """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernreg.plugins.load_plugins()
    print(json.dumps(summary(caught)))
    """
    forward = run_python(code, [installed.first, installed.second])
    backward = run_python(code, [installed.second, installed.first])
    assert forward == backward
    assert [row[0] for row in forward["loaded"]] == [CONFLICT_A, CONFLICT_B, FUNC, MODULE]
    assert forward["conflicts"] == [[CONFLICT_A, CONFLICT_B]]


def test_the_documented_example_is_a_working_plugin(installed: Installed) -> None:
    code = """
    report = kernreg.plugins.load_plugins(strict=True)
    (spec,) = kernreg.default_registry().get("layernorm.rmsnorm")
    print(json.dumps({
        "loaded": [[i.distribution, i.version, i.name, n] for i, n in report.loaded],
        "spec": [spec.backend, spec.target, spec.origin.distribution, spec.origin.version],
        "file": spec.origin.file,
    }))
    """
    # Only the example: other installed plugins (the op pack) register layernorm.rmsnorm too.
    out = run_python(code, [installed.docs], env={"KERNREG_PLUGINS": "my-kernels"})
    assert out["loaded"] == [["my-kernels", "1.2.0", "my_kernels", 1]]
    assert out["spec"] == ["my_triton", "my_kernels.triton_rmsnorm:rmsnorm", "my-kernels", "1.2.0"]
    assert out["file"].endswith(os.path.join("my_kernels", "kernreg_plugin.py"))


def test_public_names() -> None:

    assert kernreg.plugins.load_plugins is load_plugins
    assert kernreg.plugins.PluginReport is PluginReport
    assert PLUGIN_API_VERSION == 1


# --- plugins that hang or crash on import, and plugins that touch each other's specs ------


HANG = "hard-plugin-hang"
CRASH = "hard-plugin-crash"
GOOD = "hard-plugin-good"
THIEF = "hard-plugin-thief"
SOURCES = {
    "hard_plugin_hang": """
        import time
        time.sleep(3600)
        def register(registry):
            pass
    """,
    "hard_plugin_crash": """
        import os
        os._exit(7)
    """,
    "hard_plugin_good": """
        from kernreg import KernelSpec
        def register(registry):
            registry.register(KernelSpec("hardplug.op", "torch", "math:fabs", reference=True))
            registry.register(KernelSpec("hardplug.op", "fast", "math:floor", priority=5))
    """,
    "hard_plugin_thief": """
        def register(registry):
            registry.unregister("hardplug.op", "fast")
    """,
}


ENTRY_POINTS = {
    HANG: "hangs = hard_plugin_hang:register",
    CRASH: "crashes = hard_plugin_crash",
    GOOD: "good = hard_plugin_good:register",
    THIEF: "zz_thief = hard_plugin_thief:register",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory on PYTHONPATH holding the plugin modules and their .dist-info metadata."""
    root = tmp_path_factory.mktemp("plugins")
    for name, source in SOURCES.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    for dist, entry_point in ENTRY_POINTS.items():
        info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[kernreg.kernels]\n{entry_point}\n")
    return root


def run(
    site: Path, args: tuple[str, ...], env: dict[str, str], timeout: float = 60
) -> tuple[subprocess.CompletedProcess[str], float]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environ.get("PYTHONPATH")]))
    environ["KERNREG_PLATFORM"] = "cpu"
    environ.update(env)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, *args], env=environ, capture_output=True, text=True, timeout=timeout
    )
    return proc, time.monotonic() - start


def check_json(
    site: Path, plugins: str, *extra: str, expect: int = 1
) -> tuple[dict[str, Any], float]:
    proc, seconds = run(
        site,
        ("-m", "kernreg", "check", "--json", *extra),
        {"KERNREG_PLUGINS": plugins},
    )
    assert proc.returncode == expect, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    return data, seconds


def test_check_import_targets_does_not_wait_for_a_plugin_that_hangs_on_import(site: Path) -> None:
    data, seconds = check_json(site, f"{HANG},{GOOD}", "--import-targets", "--import-timeout", "2")
    assert seconds < 30  # the plugin sleeps for an hour
    (hung,) = [p for p in data["problems"] if p["kind"] == "plugin"]
    assert HANG in hung["message"]
    assert "'hangs'" in hung["message"]
    assert "did not finish importing within 2 s" in hung["message"]
    assert hung["origins"] == [
        f"entry point 'hangs' = hard_plugin_hang:register (distribution {HANG} 1.0)"
    ]
    # The other plugin loaded as usual, and its targets were checked.
    assert [p["distribution"] for p in data["plugins"]["loaded"]] == [GOOD]
    assert data["checked"]["implementations"] == 2
    assert data["errors"] == 1


def test_check_reports_an_allow_list_naming_no_installed_plugin(site: Path) -> None:
    data, _ = check_json(
        site, f"{HANG},hard-plugin-godo", "--import-targets", "--import-timeout", "1"
    )
    (unmatched,) = [p for p in data["problems"] if p["kind"] == "config"]
    assert unmatched["message"] == (
        "KERNREG_PLUGINS names 'hard-plugin-godo', which ships no installed plugin, "
        f"so it allows nothing; did you mean '{GOOD}'?"
    )
    assert unmatched["severity"] == "error"


def test_check_import_targets_survives_a_plugin_that_kills_the_interpreter(site: Path) -> None:
    data, _ = check_json(site, f"{CRASH},{GOOD}", "--import-targets", "--import-timeout", "10")
    (crashed,) = [p for p in data["problems"] if p["kind"] == "plugin"]
    assert CRASH in crashed["message"]
    assert "crashed the interpreter while importing (exit status 7)" in crashed["message"]
    assert [p["distribution"] for p in data["plugins"]["loaded"]] == [GOOD]


def test_a_denied_plugin_that_would_hang_never_runs(site: Path) -> None:
    # Without --import-targets the check loads plugins in this process: the deny list
    # decides before any plugin code runs, so a hanging plugin that is denied costs nothing.
    proc, seconds = run(
        site,
        ("-m", "kernreg", "check", "--json"),
        {"KERNREG_PLUGINS_DENY": f"{HANG},{CRASH},{THIEF}"},
        timeout=60,
    )
    data = json.loads(proc.stdout)
    assert seconds < 30
    skipped = {(p["distribution"], p["reason"]) for p in data["plugins"]["skipped"]}
    assert (HANG, "denied by KERNREG_PLUGINS_DENY") in skipped
    assert (CRASH, "denied by KERNREG_PLUGINS_DENY") in skipped


def test_a_plugin_removing_another_plugins_spec_is_recorded_naming_both(site: Path) -> None:
    data, _ = check_json(site, f"{GOOD},{THIEF}", expect=0)
    (override,) = data["problems"]
    assert (override["kind"], override["severity"]) == ("override", "warning")
    assert "unregistered" in override["message"]
    assert f"(distribution {GOOD} 1.0)" in override["message"]
    assert f"(distribution {THIEF} 1.0)" in override["message"]


# --- conflicts between distributions are never settled by name order ----------------------


def _dist(root: Path, name: str, module: str, code: str) -> None:
    """A distribution installed in ``root`` (its dist-info and its module), as pip leaves it."""
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[kernreg.kernels]\n{module} = {module}:register\n")
    (info / "RECORD").write_text("")
    (root / f"{module}.py").write_text(textwrap.dedent(code))


ESTABLISHED = """
from kernreg import KernelSpec

def reference(x):
    return "reference"

def fast(x):
    return "established fast"

def register(registry):
    registry.register(KernelSpec("plug.scale", "torch", f"{__name__}:reference", reference=True))
    registry.register(KernelSpec("plug.scale", "triton", f"{__name__}:fast", priority=10))
"""

NEWCOMER = """
from kernreg import KernelSpec

def fast(x):
    return "newcomer fast"

def other(x):
    return "other"

def register(registry):
    registry.register(KernelSpec("plug.other", "torch", f"{__name__}:other", reference=True))
    registry.register(KernelSpec("plug.scale", "triton", f"{__name__}:fast", priority=20))
"""

RUN_SCALE = """
import json, warnings
import kernreg
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result = kernreg.get_kernel("plug.scale")(1)
report = kernreg.default_registry().plugin_report
print(json.dumps({
    "result": result,
    "labels": [s.label for s in kernreg.default_registry().get("plug.scale")],
    "other": [s.label for s in kernreg.default_registry().all_specs() if s.op == "plug.other"],
    "conflicts": [[i.distribution for i in c.plugins] for c in report.conflicts],
    "failed": [f.plugin.distribution for f in report.failed],
    "warnings": [str(w.message) for w in caught],
}))
"""


def _run(root: Path, code: str, env: dict[str, str] | None = None) -> Any:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    environ.update({"PYTHONPATH": str(root), "KERNREG_PLATFORM": "cpu", **(env or {})})
    proc = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("newcomer", ["aaa-kernels", "zzz-kernels"])
def test_a_conflicting_newcomer_runs_neither_side_whatever_its_name(
    tmp_path: Path, newcomer: str
) -> None:
    _dist(tmp_path, "mmm-kernels", "mmm_kernels", ESTABLISHED)
    _dist(tmp_path, newcomer, newcomer.replace("-", "_"), NEWCOMER)
    out = _run(tmp_path, RUN_SCALE)
    # The established plugin keeps its reference; neither disputed triton kernel runs.
    assert out["result"] == "reference"
    assert out["labels"] == ["torch"]
    assert out["other"] == ["torch"]  # the newcomer keeps what nobody disputes
    assert out["failed"] == []
    assert out["conflicts"] == [sorted(["mmm-kernels", newcomer])]
    (warning,) = out["warnings"]
    assert warning.startswith("kernreg plugin conflict: Conflicting kernel registration")
    assert f"KERNREG_PLUGINS_DENY={newcomer} keeps mmm-kernels's" in warning
    # The user chooses: the value the warning gives settles it, with no warning left.
    chosen = _run(tmp_path, RUN_SCALE, {"KERNREG_PLUGINS_DENY": newcomer})
    assert (chosen["result"], chosen["warnings"], chosen["conflicts"]) == (
        "established fast",
        [],
        [],
    )
    chosen = _run(tmp_path, RUN_SCALE, {"KERNREG_PLUGINS_DENY": "mmm-kernels"})
    assert chosen["result"] == "newcomer fast"


def test_a_third_distribution_at_a_disputed_place_is_in_the_dispute(tmp_path: Path) -> None:
    _dist(tmp_path, "mmm-kernels", "mmm_kernels", ESTABLISHED)
    _dist(tmp_path, "aaa-kernels", "aaa_kernels", NEWCOMER)
    _dist(tmp_path, "zzz-kernels", "zzz_kernels", NEWCOMER.replace('"plug.other"', '"plug.zzz"'))
    out = _run(tmp_path, RUN_SCALE)
    assert out["result"] == "reference"
    assert out["labels"] == ["torch"]
    assert out["conflicts"] == [["aaa-kernels", "mmm-kernels"], ["aaa-kernels", "zzz-kernels"]]
    assert len(out["warnings"]) == 2


def test_two_distributions_giving_an_op_a_reference_keep_neither(tmp_path: Path) -> None:
    second = ESTABLISHED.replace('"torch"', '"aten"').replace(", priority=10", "")
    _dist(tmp_path, "aaa-kernels", "aaa_kernels", ESTABLISHED.replace('"triton"', '"jit"'))
    _dist(tmp_path, "bbb-kernels", "bbb_kernels", second.replace('"triton"', '"cuda"'))
    code = RUN_SCALE.replace(
        'result = kernreg.get_kernel("plug.scale")(1)',
        'result = [s.label for s in kernreg.default_registry().get("plug.scale") if s.reference]',
    )
    out = _run(tmp_path, code)
    assert out["result"] == []  # no reference: neither distribution's is chosen for the user
    assert out["labels"] == ["jit", "cuda"]
    assert out["conflicts"] == [["aaa-kernels", "bbb-kernels"]]


def test_check_fails_on_a_plugin_conflict_and_list_warns(tmp_path: Path) -> None:
    _dist(tmp_path, "mmm-kernels", "mmm_kernels", ESTABLISHED)
    _dist(tmp_path, "aaa-kernels", "aaa_kernels", NEWCOMER)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    environ.update({"PYTHONPATH": str(tmp_path), "KERNREG_PLATFORM": "cpu"})

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "kernreg", *args]
        return subprocess.run(command, env=environ, capture_output=True, text=True, timeout=60)

    check = cli("check", "--json")
    assert check.returncode == 1, check.stdout
    kinds = [p["kind"] for p in json.loads(check.stdout)["problems"]]
    assert kinds == ["plugin_conflict"]
    for args in (("list",), ("explain", "plug.scale"), ("lock", "-o", str(tmp_path / "p.json"))):
        proc = cli(*args)
        assert proc.returncode == 0, proc.stderr
        assert "KERNREG_PLUGINS_DENY=aaa-kernels keeps mmm-kernels's" in proc.stderr
    explained = cli("explain", "plug.scale").stdout
    assert "newcomer" not in explained
    assert "aaa_kernels:fast" not in explained
    assert "mmm_kernels:fast" not in explained


INPUTS_FAILING = """
from kernreg.torch import register_inputs

def register(registry):
    register_inputs("plug.scale", "aaa_kernels:inputs", mutates=("x",))
    raise RuntimeError("set-up failed after declaring inputs")
"""

INPUTS_GOOD = (
    ESTABLISHED
    + """
    from kernreg.torch import register_inputs
    register_inputs("plug.scale", f"{__name__}:inputs")
"""
)


def test_a_failed_plugins_input_generators_are_undone(tmp_path: Path) -> None:
    _dist(tmp_path, "aaa-kernels", "aaa_kernels", INPUTS_FAILING)
    _dist(tmp_path, "mmm-kernels", "mmm_kernels", INPUTS_GOOD)
    code = RUN_SCALE.replace(
        'result = kernreg.get_kernel("plug.scale")(1)',
        'kernreg.get_kernel("plug.scale")\n'
        "    from kernreg.torch import input_spec\n"
        '    result = input_spec("plug.scale").describe()',
    )
    out = _run(tmp_path, code)
    assert out["failed"] == ["aaa-kernels"]
    assert out["result"]["generator"] == "mmm_kernels:inputs"
    assert out["result"]["mutates"] == []
    (warning,) = out["warnings"]
    assert "set-up failed after declaring inputs" in warning


def test_repr_of_a_registry_whose_strict_plugins_fail_does_not_raise(on_path: Path) -> None:
    # A debugger, a log line or pytest's own assertion message calls repr(): the failure
    # belongs to the selecting call, which still raises it.
    reg = private_registry(FUNC, BROKEN, strict=True)
    reg.autoload_plugins = True
    reg.register(KernelSpec("host.op", "torch", "host_program.kernels:after"))
    assert repr(reg) == "<KernelRegistry 1 ops, 1 implementations (plugins failed to load)>"
    with pytest.raises(PluginLoadError, match=BROKEN):
        len(reg)


def test_freezing_before_the_first_read_loads_the_plugins_first(on_path: Path) -> None:
    # freeze() "after start-up" is typically called before any selection: the plugins
    # belong to start-up, not refused as mutations of a frozen registry.
    reg = private_registry(FUNC)
    reg.autoload_plugins = True
    reg.freeze()
    assert reg.plugin_report.ok
    assert reg.select("fixture.scale").origin.distribution == FUNC  # type: ignore[union-attr]
    with pytest.raises(RegistryFrozenError):
        reg.register(KernelSpec("host.op", "torch", "host_program.kernels:after"))

"""The benchmark runner works end to end; no timing is asserted here."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_PY = ROOT / "benchmarks" / "run.py"

CORE_NAMES = (
    "import kernreg",
    "import kernreg, in-process (-X importtime)",
    "import kernreg: torch/numpy/triton/click/rich not imported",
    "register 100,000 specs: construct + register",
    "register 100,000 specs: registration only",
    "get_kernel returns the implementation itself",
    "get_kernel(op), cached",
    "call: direct impl(x)",
    "op object, static decision, f(x)",
    "op object, static decision, f(x, weight)",
    "op object, dtype+device gate, f(x)",
    "op object, dtype+device gate, f(x, weight)",
    "explain every op of a 10,000-op inventory (cold)",
)


@pytest.fixture(scope="module")
def runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kernreg_benchmarks_run", RUN_PY)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Every benchmark module.
BENCHMARKS = sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py"))
#: The modules that import torch: they run quick in one process, as ``run.py --quick``
#: runs them all (importing torch and transformers costs seconds per interpreter).
TORCH_BENCHMARKS = ("bench_kernelize.py", "bench_model.py", "bench_ops.py")
#: The quick runs of the tests below: the torch modules together, each other module in a
#: run of its own (so they spread over the workers), bench_core through ``quick_report``.
QUICK_GROUPS = [TORCH_BENCHMARKS] + [
    (m,) for m in BENCHMARKS if m not in TORCH_BENCHMARKS and m != "bench_core.py"
]

#: ``run.py --quick --json PATH`` over the modules named (its main, as users run it).
QUICK_RUN = """
import os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import run
run.discover = lambda directory=run.HERE: [Path(p) for p in sys.argv[2].split(os.pathsep)]
sys.exit(run.main(["--quick", "--json", sys.argv[3]]))
"""


def quick_run(modules: tuple[str, ...], out: Path) -> dict[str, Any]:
    benchmarks = ROOT / "benchmarks"
    paths = os.pathsep.join(str(benchmarks / module) for module in modules)
    proc = subprocess.run(
        [sys.executable, "-c", QUICK_RUN, str(benchmarks), paths, str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    assert report["quick"] is True
    assert report["errors"] == []
    return report


def assert_well_formed(record: dict[str, Any]) -> None:
    assert isinstance(record["name"], str)
    assert record["name"]
    assert isinstance(record["value"], float)
    assert math.isfinite(record["value"])
    assert isinstance(record["unit"], str)
    assert record["unit"]
    assert record["budget"] is None or isinstance(record["budget"], str)
    assert record["baseline"] is None or isinstance(record["baseline"], str)
    assert record["ratio"] is None or isinstance(record["ratio"], float)
    assert record["ok"] is None or isinstance(record["ok"], bool)
    if record["budget"] is not None:
        assert record["ok"] is not None, record
    if record["ratio"] is not None:
        assert record["baseline"] is not None, record


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    report = quick_run(("bench_core.py",), tmp_path_factory.mktemp("bench") / "report.json")
    assert any(r["name"].startswith("op object, static decision") for r in report["results"])
    return report


def test_the_quick_runs_cover_every_benchmark() -> None:
    assert set(TORCH_BENCHMARKS) <= set(BENCHMARKS)
    assert sorted(m for group in QUICK_GROUPS for m in group) == sorted(
        m for m in BENCHMARKS if m != "bench_core.py"
    )


@pytest.mark.parametrize("modules", QUICK_GROUPS, ids="+".join)
def test_every_benchmark_runs_quick_and_reports_well_formed_records(
    modules: tuple[str, ...], tmp_path: Path
) -> None:
    """A module is run or reported as skipped with its reason; never an error."""
    report = quick_run(modules, tmp_path / "report.json")
    ran = [r["module"] for r in report["results"]]
    skipped = [s["module"] for s in report["skipped"]]
    assert set(ran) | set(skipped) == {module.removesuffix(".py") for module in modules}
    for record in report["results"]:
        assert_well_formed(record)


def test_quick_run_reports_every_core_figure(quick_report: dict[str, Any]) -> None:
    core = [r for r in quick_report["results"] if r["module"] == "bench_core"]
    names = [r["name"] for r in core]
    assert len(names) == len(set(names))
    for name in CORE_NAMES:
        assert name in names


def test_core_records_are_well_formed(quick_report: dict[str, Any]) -> None:
    for record in (r for r in quick_report["results"] if r["module"] == "bench_core"):
        assert_well_formed(record)


def test_core_contract_checks_hold(quick_report: dict[str, Any]) -> None:
    by_name = {r["name"]: r for r in quick_report["results"] if r["module"] == "bench_core"}
    assert by_name["get_kernel returns the implementation itself"]["ok"] is True
    assert by_name["import kernreg: torch/numpy/triton/click/rich not imported"]["ok"] is True


def test_markdown_table(runner: ModuleType) -> None:
    report = {
        "python": "3.11.0",
        "implementation": "CPython",
        "system": "Linux",
        "machine": "x86_64",
        "quick": False,
        "results": [
            {
                "module": "bench_x",
                "name": "a | b",
                "value": 12.345,
                "unit": "ns",
                "budget": "≤ 40 ns",
                "baseline": "direct = 20 ns",
                "ratio": 1.5,
                "ok": True,
            }
        ],
        "skipped": [{"module": "bench_torch", "reason": "ModuleNotFoundError: torch"}],
        "errors": [],
    }
    text = runner.render_markdown(report)
    assert "| a \\| b | 12.3 | ns | ≤ 40 ns | direct = 20 ns | 1.50x | yes |" in text
    assert "* skipped bench_torch: ModuleNotFoundError: torch" in text


@pytest.mark.parametrize(
    "record",
    [
        [],
        {"value": 1.0, "unit": "s"},
        {"name": "x", "value": "1", "unit": "s"},
        {"name": "x", "value": True, "unit": "s"},
        {"name": "x", "value": 1.0, "unit": "s", "ok": "yes"},
        {"name": "x", "value": 1.0, "unit": "s", "ratio": "2x"},
    ],
)
def test_malformed_records_are_rejected(runner: ModuleType, record: object) -> None:
    with pytest.raises(ValueError, match="record"):
        runner.check_record(record)


def test_modules_are_run_or_skipped(
    runner: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    record = '{"name": "n", "value": 1, "unit": "s"}'
    (tmp_path / "bench_smoke_a.py").write_text("import kernreg_no_such_module\n")
    (tmp_path / "bench_smoke_b.py").write_text(f"def run():\n    return [{record}]\n")
    (tmp_path / "bench_smoke_c.py").write_text(
        f"def run(quick):\n    assert quick is True\n    return [{record}]\n"
    )
    (tmp_path / "bench_smoke_d.py").write_text(
        f"def run(*, quick=False):\n    assert quick is True\n    return [{record}]\n"
    )
    (tmp_path / "bench_smoke_e.py").write_text("def run():\n    raise RuntimeError('boom')\n")
    try:
        report = runner.run_all(runner.discover(tmp_path), quick=True)
    finally:
        for name in "abcde":
            sys.modules.pop(f"bench_smoke_{name}", None)
    assert [s["module"] for s in report["skipped"]] == ["bench_smoke_a"]
    assert "kernreg_no_such_module" in report["skipped"][0]["reason"]
    assert [r["module"] for r in report["results"]] == [
        "bench_smoke_b",
        "bench_smoke_c",
        "bench_smoke_d",
    ]
    assert report["results"][0]["ok"] is None
    assert report["results"][0]["value"] == 1.0
    assert [e["module"] for e in report["errors"]] == ["bench_smoke_e"]
    assert "boom" in report["errors"][0]["error"]


# --- the side-by-side comparison with sglang ---------------------------------------------------

SGLANG_PY = ROOT / "benchmarks" / "bench_sglang.py"


def _unpack_fake_peer(cache: Path) -> None:
    """Empty files where the peer's registry modules are unpacked."""
    kernels = cache / "sglang-0.5.23" / "sglang" / "kernels"
    (kernels / "ops").mkdir(parents=True)
    for name in ("spec", "registry", "selector", "kernel_api_logging", "fused_op"):
        (kernels / f"{name}.py").write_text("")
    (kernels / "ops" / "__init__.py").write_text("")


@pytest.mark.parametrize("unpacked", [False, True], ids=["not fetched", "msgspec missing"])
def test_sglang_comparison_is_skipped_until_fetched(
    runner: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unpacked: bool
) -> None:
    # run.py never downloads: without the peer in the cache, or without the one package its
    # modules import, the module is reported as skipped, never as an error.
    if unpacked:
        if importlib.util.find_spec("msgspec") is not None:
            pytest.skip("msgspec is installed here")
        _unpack_fake_peer(tmp_path)
    monkeypatch.setenv("KERNREG_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        report = runner.run_all([SGLANG_PY], quick=True)
    finally:
        sys.modules.pop("bench_sglang", None)
    assert report["results"] == []
    assert report["errors"] == []
    (skipped,) = report["skipped"]
    assert skipped["module"] == "bench_sglang"
    assert "python benchmarks/bench_sglang.py" in skipped["reason"]


def test_sglang_comparison_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The module imports only when the peer's files are in the cache (empty ones do here).
    _unpack_fake_peer(tmp_path)
    (tmp_path / "sglang-0.5.23" / "site" / "msgspec").mkdir(parents=True)  # its one dependency
    monkeypatch.setenv("KERNREG_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("kernreg_bench_sglang_table", SGLANG_PY)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [
        module._row("warm get_kernel(op)", 100.0, 80.0, "ns", target=1.0),
        module._row("memory", 100.0, 150.0, "B", target=1.0),
        module._row("op call", 1500.0, 60.0, "ns"),
    ]
    assert [r["ok"] for r in rows] == [True, False, None]
    assert rows[0]["ratio"] == pytest.approx(0.8)
    text = module.render(rows)
    assert "warm get_kernel(op)" in text
    assert "0.80x" in text
    assert "1.50x" in text
    markdown = module.render(rows, markdown=True)
    assert markdown.splitlines()[0].startswith("| path | sglang | kernreg |")


@pytest.mark.skipif(
    not os.environ.get("KERNREG_BENCH_CACHE"),
    reason="set KERNREG_BENCH_CACHE to a folder holding the fetched sglang wheel to run this",
)
def test_sglang_comparison_runs_when_fetched() -> None:
    proc = subprocess.run(
        [sys.executable, str(SGLANG_PY), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warm get_kernel(op)" in proc.stdout

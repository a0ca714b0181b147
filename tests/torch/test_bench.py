"""Benchmarks: time_callable, benchmark() over the op pack and demo ops, `kernreg bench`."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
kernreg_ops = pytest.importorskip("kernreg_ops")

import kernreg  # noqa: E402
from _support import kernreg_cli_batch  # noqa: E402
from kernreg import KernelRegistry  # noqa: E402
from kernreg.errors import InvalidSpecError, OpNotFoundError  # noqa: E402
from kernreg.torch import register_inputs, unregister_inputs  # noqa: E402
from kernreg.torch.bench import (  # noqa: E402
    DEFAULT_REPEATS,
    DEFAULT_WARMUP,
    NOISY_FRACTION,
    QUICK_REPEATS,
    QUICK_WARMUP,
    BenchError,
    BenchResult,
    bench_shapes,
    benchmark,
    format_ns,
    measure_interleaved,
    median_interval,
    op_shapes,
    plot_figure,
    plot_reports,
    time_callable,
)
from kernreg.tuning import Measurement  # noqa: E402

PACK = sorted(kernreg_ops.OPS)
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DTYPES = ("float32", "float16", "bfloat16")
TINY = {"tiny": {"tokens": 2, "hidden": 8}, "wide": {"tokens": 3, "hidden": 64}}


# --- time_callable --------------------------------------------------------------------------


def test_time_callable_measures_a_sleep() -> None:
    measured = time_callable(time.sleep, (0.002,), {}, warmup=1, repeats=5, device="cpu")
    assert isinstance(measured, Measurement)
    assert measured.repeats == 5
    assert 2e6 <= measured.median_ns < 2e8
    assert 0 <= measured.spread_ns < 2e8  # a busy machine may stretch one sleep: no ratio


def test_time_callable_on_a_torch_op_and_its_defaults() -> None:
    x = torch.randn(64, 64)
    measured = time_callable(torch.matmul, (x, x), None)  # device: that of x
    assert measured.median_ns > 0
    assert measured.repeats == DEFAULT_REPEATS


def test_warmup_calls_are_not_timed() -> None:
    calls: list[int] = []
    measured = time_callable(calls.append, (1,), {}, warmup=3, repeats=4, device="cpu")
    assert len(calls) == 7
    assert measured.repeats == 4


@pytest.mark.parametrize(
    ("durations", "median", "spread"),
    [
        ([10, 20, 30, 40, 50], 30, 20),
        ([5, 1, 3], 3, 2),
        ([100, 100, 100, 100], 100, 0),
        ([7], 7, 0),
    ],
)
def test_median_and_interquartile_range(
    monkeypatch: pytest.MonkeyPatch, durations: list[int], median: float, spread: float
) -> None:
    ticks = iter([t for d in [0, *durations] for t in (0, d)])  # one warm-up call
    monkeypatch.setattr(time, "perf_counter_ns", lambda: next(ticks))
    measured = time_callable(lambda: None, (), {}, warmup=1, repeats=len(durations), device="cpu")
    assert measured == Measurement(median, spread, len(durations))


@pytest.mark.parametrize(("warmup", "repeats"), [(-1, 3), (0, 0)])
def test_bad_counts_are_rejected(warmup: int, repeats: int) -> None:
    with pytest.raises(ValueError, match="need warmup >= 0 and repeats >= 1"):
        time_callable(lambda: None, (), {}, warmup=warmup, repeats=repeats, device="cpu")


def _add_one_(x: Any, y: Any, *, out: Any = None) -> None:
    """Writes ``x`` (and ``out``) in place; records what it saw first."""
    SEEN.append((float(x[0]), None if out is None else float(out[0]), id(x), id(y)))
    x.add_(1)
    if out is not None:
        out.add_(1)


SEEN: list[tuple[float, float | None, int, int]] = []


def test_mutated_inputs_are_cloned_before_every_call() -> None:
    SEEN.clear()
    x, y, out = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    time_callable(
        _add_one_, (x, y), {"out": out}, warmup=2, repeats=5, device="cpu", mutates=("x", "out")
    )
    assert len(SEEN) == 7
    assert all(seen_x == 0.0 and seen_out == 0.0 for seen_x, seen_out, _, _ in SEEN)
    assert all(seen_id != id(x) for _, _, seen_id, _ in SEEN)  # a fresh clone each call
    assert {seen_y for _, _, _, seen_y in SEEN} == {id(y)}  # not mutated: passed as is
    assert torch.equal(x, torch.zeros(3))
    assert torch.equal(out, torch.zeros(3))


def test_without_mutates_the_same_inputs_are_reused() -> None:
    SEEN.clear()
    x = torch.zeros(3)
    time_callable(_add_one_, (x, x), {}, warmup=0, repeats=3, device="cpu")
    assert [seen_x for seen_x, *_ in SEEN] == [0.0, 1.0, 2.0]


def test_an_unknown_mutated_name_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"mutates names \['z'\]"):
        time_callable(_add_one_, (torch.zeros(1), torch.zeros(1)), {}, device="cpu", mutates="z")


def test_a_callable_without_signature_gets_every_tensor_cloned() -> None:
    x = torch.zeros(2)
    time_callable(torch.Tensor.add_, (x, 1), {}, warmup=1, repeats=2, device="cpu", mutates="x")
    assert torch.equal(x, torch.zeros(2))


@pytest.mark.parametrize(
    ("ns", "text"),
    [(850, "850 ns"), (12_345, "12.3 us"), (4_560_000, "4.56 ms"), (123_400_000, "123 ms")],
)
def test_format_ns(ns: float, text: str) -> None:
    assert format_ns(ns) == text


# --- shapes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("op", PACK)
def test_pack_ops_declare_small_medium_large(op: str) -> None:
    shapes = op_shapes(op)
    assert list(shapes) == ["small", "medium", "large"]
    tokens = [dims["tokens"] for dims in shapes.values()]
    assert tokens == sorted(tokens)


def test_pack_generators_keep_their_seeded_cases() -> None:
    from kernreg_ops import _inputs

    (x, _), _ = _inputs.rmsnorm(torch.float32, torch.device("cpu"), 0)
    assert tuple(x.shape) == (7, 96)
    (x, _), _ = _inputs.rmsnorm(torch.float32, torch.device("cpu"), 0, tokens=4, hidden=8)
    assert tuple(x.shape) == (4, 8)


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        ({}, "declare at least one named shape"),
        ({"bad name": {"n": 1}}, "a shape name is letters"),
        ({"small": {"n": [1, 2]}}, "must be a number, string or bool"),
    ],
)
def test_bad_shape_declarations(shapes: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidSpecError, match=match):
        bench_shapes(**shapes)


# --- benchmark() over the op pack -------------------------------------------------------------


def test_rmsnorm_on_tiny_shapes() -> None:
    steps: list[tuple[int, int]] = []
    report = benchmark(
        "layernorm.rmsnorm",
        shapes=TINY,
        dtypes=["float32", "bf16"],
        warmup=1,
        repeats=3,
        progress=lambda done, total, what: steps.append((done, total)),
    )
    assert report.reference == "torch"
    assert report.timed == ("aten", "torch")
    keys = [(r.implementation, r.dtype, r.shape) for r in report.results]
    assert keys == [
        ("torch", "float32", "tiny"),
        ("aten", "float32", "tiny"),
        ("torch", "float32", "wide"),
        ("aten", "float32", "wide"),
        ("torch", "bfloat16", "tiny"),
        ("aten", "bfloat16", "tiny"),
        ("torch", "bfloat16", "wide"),
        ("aten", "bfloat16", "wide"),
    ]
    for r in report.results:
        assert r.measurement.repeats >= 3  # at least; more while the interval is wide
        assert r.measurement.median_ns > 0
        assert r.speedup is not None
        low, high = r.interval
        assert low <= r.measurement.median_ns <= high
    ref = report.result("torch", "float32", "wide")
    aten = report.result("aten", "float32", "wide")
    assert ref is not None
    assert aten is not None
    assert ref.reference
    assert ref.speedup == 1.0
    assert ref.speedup_interval is None
    assert aten.speedup == pytest.approx(ref.measurement.median_ns / aten.measurement.median_ns)
    assert aten.speedup_interval is not None
    low, high = aten.speedup_interval
    assert low <= aten.speedup <= high
    assert aten.dims_text == "tokens=3 hidden=64"
    skipped = {
        (s.implementation, s.shape): s.reason for s in report.skipped if s.dtype == "float32"
    }
    assert "needs device cuda>=8.0" in skipped["triton", None]
    # The compile switch is process state: decided once per dtype, not per shape.
    assert skipped["torch_compile", None] == (
        "when predicate is false (process state, checked when deciding)"
    )
    assert steps[-1] == (8, 8)  # 2 dtypes x 2 shapes x (torch, aten)
    data = json.loads(json.dumps(report.describe()))
    assert data["results"][0]["dims"] == {"tokens": 2, "hidden": 8}
    assert "torch" in str(report)


def test_the_in_place_op_is_timed_on_fresh_inputs() -> None:
    report = benchmark(
        "layernorm.fused_add_rmsnorm", shapes=TINY, dtypes=["float32"], warmup=0, repeats=2
    )
    assert report.timed == ("native", "torch")


def test_quick_takes_the_first_shape() -> None:
    report = benchmark("activation.silu_and_mul", quick=True, dtypes=["float32"])
    assert {r.shape for r in report.results} == {"small"}
    assert all(r.measurement.repeats >= QUICK_REPEATS for r in report.results)
    assert (report.warmup, report.repeats) == (QUICK_WARMUP, QUICK_REPEATS)


def test_named_shapes_are_chosen_by_name() -> None:
    report = benchmark("embedding.rotary", shapes=["small"], dtypes=["float32"], repeats=2)
    assert [r.dims_text for r in report.results] == [
        "tokens=16 heads=8 kv_heads=2 head_dim=128 max_position=4096"
    ]
    with pytest.raises(BenchError, match="has no shape 'huge'; its shapes: small, medium, large"):
        benchmark("embedding.rotary", shapes=["huge"])


def test_unknown_op_and_missing_generator(cpu_registry: KernelRegistry) -> None:
    with pytest.raises(OpNotFoundError):
        benchmark("nope.op")
    cpu_registry.register(kernreg.KernelSpec("demo.nogen", "torch", len, reference=True))
    with pytest.raises(BenchError, match=r"no input generator registered for op 'demo\.nogen'"):
        benchmark("demo.nogen", registry=cpu_registry)


# --- benchmark() on demo ops ----------------------------------------------------------------


def _scale_inputs(dtype: Any, device: Any, seed: int, *, n: int = 4) -> Any:
    return (torch.ones(n, dtype=dtype, device=device),), {}


@pytest.fixture
def demo_inputs() -> Iterator[None]:
    register_inputs("demo.scale", _scale_inputs, dtypes=["float32"])
    yield
    unregister_inputs("demo.scale")


@pytest.mark.usefixtures("demo_inputs")
def test_when_gated_and_failing_implementations(cpu_registry: KernelRegistry) -> None:
    @kernreg.op("demo.scale", registry=cpu_registry)
    def scale(x: Any) -> Any:
        return x * 2

    @scale.register("big_only", priority=2, when=lambda x: x.numel() > 8)
    def big_only(x: Any) -> Any:
        return x + x

    @scale.register("broken", priority=1)
    def broken(x: Any) -> Any:
        raise RuntimeError("no luck\nsecond line")

    report = benchmark(scale, shapes={"few": {"n": 4}, "many": {"n": 64}}, repeats=2)
    assert [(r.implementation, r.shape) for r in report.results] == [
        ("torch", "few"),
        ("torch", "many"),
        ("big_only", "many"),
    ]
    reasons = {(s.implementation, s.shape): s.reason for s in report.skipped}
    assert reasons == {
        ("big_only", "few"): "when predicate is false for this call",
        ("broken", "few"): "raised RuntimeError: no luck",
        ("broken", "many"): "raised RuntimeError: no luck",
    }


@pytest.mark.usefixtures("demo_inputs")
def test_without_a_reference_there_is_no_speedup(cpu_registry: KernelRegistry) -> None:
    cpu_registry.register(kernreg.KernelSpec("demo.scale", "fast", lambda x: x * 2))
    report = benchmark("demo.scale", registry=cpu_registry, repeats=2)
    assert report.reference is None
    assert [(r.implementation, r.shape, r.speedup) for r in report.results] == [
        ("fast", "seed0", None),
        ("fast", "seed1", None),
    ]


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_plot_reports_writes_a_png(tmp_path: Path) -> None:
    report = benchmark("layernorm.rmsnorm", shapes=TINY, dtypes=["float32"], repeats=2)
    path = tmp_path / "bench.png"
    plot_reports([report, report], path)
    assert path.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_the_plot_shows_speedups_with_intervals_per_op_and_dtype() -> None:
    report = benchmark("layernorm.rmsnorm", shapes=TINY, dtypes=["float32", "bf16"], repeats=3)
    alone = benchmark("embedding.rotary", shapes=["small"], dtypes=["float32"], repeats=3)
    figure = plot_figure([report, alone])
    title = figure.get_suptitle()
    assert "cpu" in title
    assert f"2 op(s), {len(report.results) + len(alone.results)} timing(s)" in title
    assert f"{report.warmup} warm-up + at least 3 timed calls each, interleaved" in title
    (ax,) = figure.axes
    # One row per op, implementation and dtype; the reference is the line at 1x.
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert rows == ["layernorm.rmsnorm  aten  float32", "layernorm.rmsnorm  aten  bfloat16"]
    assert ax.get_xscale() == "log"
    assert "speed-up over the reference" in ax.get_xlabel()
    assert "95% intervals" in ax.get_xlabel()
    assert "only the reference ran): embedding.rotary" in ax.get_xlabel()
    # The legend is the figure's, outside the axes: it covers no data.
    (legend,) = figure.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "shape tiny",
        "shape wide",
        "not significant",
    ]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)  # what savefig draws with
    canvas.draw()
    renderer = canvas.get_renderer()
    assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    # Tick labels never overlap one another.
    boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
    assert all(not a.overlaps(b) for a, b in itertools.pairwise(boxes))


def test_a_timing_is_noisy_when_its_interval_is_wider_than_five_percent() -> None:
    def result(low: float, high: float) -> BenchResult:
        measured = Measurement(1000.0, 10.0, 10)
        return BenchResult("x.y", "a", "float32", "small", {}, measured, interval=(low, high))

    assert NOISY_FRACTION == 0.05
    assert not result(950.0, 1050.0).noisy
    assert result(940.0, 1050.0).noisy
    assert result(940.0, 1050.0).describe()["noisy"] is True


@pytest.mark.parametrize(
    ("interval", "text", "significant"),
    [
        ((1.18, 1.29), "1.23x [1.18-1.29]", True),
        ((0.97, 1.08), "1.23x [0.97-1.08] n.s.", False),
        ((0.5, 0.9), "1.23x [0.50-0.90]", True),
        (None, "1.23x", False),
    ],
)
def test_a_speedup_comes_with_its_interval(
    interval: tuple[float, float] | None, text: str, significant: bool
) -> None:
    measured = Measurement(1000.0, 10.0, 10)
    result = BenchResult(
        "x.y", "a", "float32", "small", {}, measured, 1.23, speedup_interval=interval
    )
    assert result.speedup_text == text
    assert result.significant is significant


@pytest.mark.parametrize(
    ("n", "ranks"), [(1, (1, 1)), (2, (1, 2)), (10, (1, 10)), (100, (40, 61)), (1000, (469, 532))]
)
def test_median_interval_uses_order_statistics(n: int, ranks: tuple[int, int]) -> None:
    samples = [float(i) for i in range(n, 0, -1)]  # any order
    assert median_interval(samples) == (float(ranks[0]), float(ranks[1]))


def test_interleaved_timing_stops_once_the_medians_are_known() -> None:
    calls = {"a": 0, "b": 0}

    def a() -> None:
        calls["a"] += 1

    def b() -> None:
        calls["b"] += 1

    (ta, tb) = measure_interleaved([a, b], warmup=2, repeats=20, max_time=5.0, device="cpu")
    assert isinstance(ta, list)
    assert isinstance(tb, list)
    assert len(ta) == len(tb) >= 20  # one call of each per round
    assert calls == {"a": len(ta) + 2, "b": len(tb) + 2}


def test_interleaved_timing_reports_a_callable_that_raises() -> None:
    def broken() -> None:
        raise RuntimeError("no luck")

    ok, failed = measure_interleaved(
        [lambda: None, broken], warmup=1, repeats=3, max_time=0.0, device="cpu"
    )
    assert isinstance(ok, list)
    assert len(ok) >= 3
    assert failed == "raised RuntimeError: no luck"


# --- kernreg bench ----------------------------------------------------------------------------


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_") and k != "COLUMNS"}
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, cwd=cwd, check=False
    )


ALL_QUICK = ("bench", "--all", "--quick", "--dtype", "float32")


@pytest.fixture(scope="module")
def bench_cli(
    tmp_path_factory: pytest.TempPathFactory, once_per_session: Callable[..., Any]
) -> dict[str, Any]:
    """``kernreg bench`` as JSON, as a table, with a plot, over every op, and each command
    line of ``CLI_ERRORS``: in one interpreter (each imports torch), once per test run."""

    def run() -> dict[str, Any]:
        plot = tmp_path_factory.mktemp("plot") / "chart.png"
        argvs = [
            ("bench", "layernorm.rmsnorm", "--quick", "--json"),
            ("bench", "layernorm.rmsnorm", "--dtype", "fp32", "--shape", "small", "--repeats", "3"),
            ("bench", "layernorm.rmsnorm", "--quick", "--plot", str(plot)),
            ALL_QUICK,
            *(("bench", *args) for args, _, _ in CLI_ERRORS),
        ]
        runs = [[p.returncode, p.stdout, p.stderr] for p in kernreg_cli_batch(*argvs)]
        return {"plot_path": str(plot), "runs": runs}

    done = once_per_session("bench_cli", run)
    runs = [subprocess.CompletedProcess(["kernreg"], *run) for run in done["runs"]]
    json_run, table, plotted, all_quick, *errors = runs
    return {
        "json": json_run,
        "table": table,
        "plot": plotted,
        "plot_path": Path(done["plot_path"]),
        "all": all_quick,
        "errors": {args: run for (args, _, _), run in zip(CLI_ERRORS, errors, strict=True)},
    }


@pytest.fixture(scope="module")
def bench_runs(bench_cli: dict[str, Any]) -> dict[str, Any]:
    """``kernreg bench`` as JSON, as a table and with a plot."""
    return bench_cli


def test_cli_json(bench_runs: dict[str, Any]) -> None:
    result = bench_runs["json"]
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    (report,) = data["reports"]
    assert report["op"] == "layernorm.rmsnorm"
    rows = {(r["implementation"], r["dtype"], r["shape"]) for r in report["results"]}
    assert rows == {(impl, d, "small") for impl in ("torch", "aten") for d in DTYPES}
    assert all(r["median_ns"] > 0 and r["repeats"] >= QUICK_REPEATS for r in report["results"])
    aten = next(r for r in report["results"] if r["implementation"] == "aten")
    assert aten["speedup_interval"][0] <= aten["speedup"] <= aten["speedup_interval"][1]
    assert isinstance(aten["significant"], bool)
    assert result.stderr.startswith("bench layernorm.rmsnorm: done in")


def test_cli_table(bench_runs: dict[str, Any]) -> None:
    result = bench_runs["table"]
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("bench on cpu")
    assert lines[0].endswith(
        f"({DEFAULT_WARMUP} warm-up + at least 3 timed calls each, interleaved, "
        "up to 0.5 s per shape)"
    )
    assert lines[2].split() == [
        "OP", "IMPLEMENTATION", "DTYPE", "SHAPE", "DIMS", "MEDIAN", "IQR", "CALLS", "SPEED-UP"
    ]  # fmt: skip
    (ref,) = [line for line in lines if "(reference)" in line]
    assert ref.split()[:5] == ["layernorm.rmsnorm", "torch", "(reference)", "float32", "small"]
    assert ref.endswith("1.00x")
    (aten,) = [line for line in lines if "  aten  " in line]
    # The speed-up always comes with its interval: "1.23x [1.18-1.29]", "n.s." when it
    # includes 1x.
    assert re.search(r"\d\.\d\dx \[\d+\.\d\d-\d+\.\d\d\]( n\.s\.)?$", aten), aten
    assert re.search(r"\d+(\.\d+)? us \+-\d+\.\d%", aten), aten  # the median with its unit
    assert any(line.startswith("  triton (layernorm.rmsnorm): needs device") for line in lines)
    assert lines[-1] == "1 op(s) benchmarked, 2 timing(s)"


def test_cli_all_quick(bench_cli: dict[str, Any]) -> None:
    result = bench_cli["all"]
    assert result.returncode == 0, result.stderr
    ops = {line.split()[0] for line in result.stdout.splitlines() if "(reference)" in line}
    assert ops == set(PACK)
    off = "when predicate is false (process state, checked when deciding)"
    assert f"torch_compile (every op): {off}" in result.stdout
    # every op's reference (13), aten for rmsnorm and layernorm (2), native for all but
    # rmsnorm, layernorm and rotary (10)
    assert result.stdout.splitlines()[-1] == "13 op(s) benchmarked, 25 timing(s)"


CLI_ERRORS = [
    ((), 2, "give one OP or --all"),
    (("Not-An-Op",), 2, "Invalid value for '[OP]'"),
    (("--all", "layernorm.rmsnorm"), 2, "give one OP or --all"),
    (("layernorm.rmsnorm", "--repeats", "0"), 2, "Invalid value for '--repeats'"),
    (("layernorm.rmsnorm", "--dtype", "fp7"), 2, "unknown dtype 'fp7'"),
    (("nope.op",), 1, "error: No kernels registered for op 'nope.op'"),
    (
        ("--all", "--shape", "huge"),
        1,
        "error: op 'activation.gelu_and_mul' has no shape 'huge'; its shapes: small, medium",
    ),
]


@pytest.fixture(scope="module")
def cli_errors(
    bench_cli: dict[str, Any],
) -> dict[tuple[str, ...], subprocess.CompletedProcess[str]]:
    """Every command line of ``CLI_ERRORS``."""
    errors: dict[tuple[str, ...], subprocess.CompletedProcess[str]] = bench_cli["errors"]
    return errors


@pytest.mark.parametrize(("args", "code", "message"), CLI_ERRORS)
def test_cli_errors(
    cli_errors: dict[tuple[str, ...], subprocess.CompletedProcess[str]],
    args: tuple[str, ...],
    code: int,
    message: str,
) -> None:
    result = cli_errors[args]
    assert result.returncode == code, result.stdout + result.stderr
    assert message in result.stderr
    assert result.stdout == ""


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_cli_plot(bench_runs: dict[str, Any]) -> None:
    path, result = bench_runs["plot_path"], bench_runs["plot"]
    assert result.returncode == 0, result.stderr
    assert path.read_bytes().startswith(PNG_MAGIC)
    assert result.stdout.splitlines()[-1].endswith(f"plot written to {path}")


def test_cli_plot_without_matplotlib(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from kernreg.cli import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n"
    )
    path = tmp_path / "chart.png"
    result = _run("-c", code, "bench", "layernorm.rmsnorm", "--quick", "--plot", str(path))
    assert result.returncode == 1
    first, hint = result.stderr.splitlines()[:2]
    assert first.startswith("error: --plot needs matplotlib")
    assert hint.startswith("hint: pip install 'kernreg[plot]'")
    assert result.stdout == ""
    assert not path.exists()

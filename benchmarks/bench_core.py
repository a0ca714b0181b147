"""The core budgets of docs/design.md, each measured next to baselines taken in the same run.

Method
------
* **Per-call figures** (op objects, ``get_kernel``): each statement runs under
  :class:`timeit.Timer` (garbage collector off) in loops of ``number`` calls; the
  statements of one figure are measured *interleaved*, round after round, together with
  an empty statement (``pass``), and each keeps its best loop. The best empty loop is
  subtracted from every best loop, so a figure is the cost of the call alone, in ns.
  "Over direct" is a call's cost minus the direct call's cost; ``ratio`` is the call's
  cost divided by the direct call's. The callee is the same trivial function everywhere
  (``return x``), so the figures are dispatch overhead, not work.
* **Import**: ``python -c "import kernreg"`` and ``python -c pass`` run as subprocesses,
  alternately, and the figure is the difference of their medians. kernreg's bytecode is
  compiled first (``compileall``) and ``PYTHONDONTWRITEBYTECODE`` is unset in every
  subprocess, as in an installed package (an editable install with that variable set
  would recompile kernreg on every start).
* **Bulk figures** (registration, explain): wall-clock (``perf_counter``) of one pass,
  best of a few passes, each on a fresh registry.

``--quick`` keeps the sizes (100,000 specs, 10,000 ops) and cuts repetitions, so its
figures are noisier but comparable.
"""

from __future__ import annotations

import functools
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import kernreg
from kernreg import KernelRegistry, KernelSpec, Platform, Requirement
from kernreg.config import Config

HEAVY_MODULES = ("torch", "numpy", "triton", "click", "rich")

PLATFORM = Platform.parse("cuda:9.0", source="benchmark")
DTYPES = ("bfloat16",)


def _record(
    name: str,
    value: float,
    unit: str,
    *,
    budget: str | None = None,
    limit: float | None = None,
    inclusive: bool = True,
    baseline: str | None = None,
    baseline_value: float | None = None,
    ratio_value: float | None = None,
    note: str | None = None,
) -> dict[str, Any]:
    """One result; ``limit`` turns ``budget`` into the ``ok`` verdict (``inclusive``: ≤)."""
    ok = None
    if limit is not None:
        ok = value <= limit if inclusive else value < limit
    ratio = None
    if baseline_value:
        ratio = (value if ratio_value is None else ratio_value) / baseline_value
    record: dict[str, Any] = {
        "name": name,
        "value": float(value),
        "unit": unit,
        "budget": budget,
        "baseline": baseline,
        "ratio": ratio,
        "ok": ok,
    }
    if note:
        record["note"] = note
    return record


@contextmanager
def _gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# --- per-call timing ------------------------------------------------------------------------


def per_call_ns(
    statements: dict[str, str], namespace: dict[str, Any], *, number: int, rounds: int
) -> dict[str, float]:
    """ns per execution of each statement, empty-loop overhead subtracted (see module doc)."""
    timers = {"": timeit.Timer("pass", globals=namespace)}
    timers.update(
        {name: timeit.Timer(stmt, globals=namespace) for name, stmt in statements.items()}
    )
    for timer in timers.values():  # warm up: resolve op objects, fill caches
        timer.timeit(min(number, 1000))
    best = dict.fromkeys(timers, float("inf"))
    for _ in range(rounds):
        for name, timer in timers.items():
            best[name] = min(best[name], timer.timeit(number) / number * 1e9)
    loop = best.pop("")
    return {name: value - loop for name, value in best.items()}


def _impl1(x: Any) -> Any:
    return x


def _impl3(x: Any, weight: Any, eps: float = 1e-6) -> Any:
    return x


class DType:
    """A dtype object like ``torch.bfloat16``: hashed by identity, named by ``str``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name


class Device:
    """A device object like ``torch.device("cuda", 0)``."""

    __slots__ = ("type", "index")

    def __init__(self, type: str, index: int | None = None) -> None:
        self.type = type
        self.index = index


class Tensor:
    """The two attributes a gated op reads from its dispatch argument."""

    __slots__ = ("dtype", "device")

    def __init__(self, dtype: DType, device: Device) -> None:
        self.dtype = dtype
        self.device = device


def _fresh_registry() -> KernelRegistry:
    return KernelRegistry(config=Config(), platform=PLATFORM)


def _static_ops(registry: KernelRegistry) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """1-arg and 3-arg ops whose decision is static: a fast path beats the reference."""

    @kernreg.op("bench.static1", registry=registry)
    def static1(x: Any) -> Any:
        return x

    @kernreg.op("bench.static3", registry=registry)
    def static3(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        return x

    static1.register("fast", _impl1, priority=10)
    static3.register("fast", _impl3, priority=10)
    return static1, static3


def _gated_ops(registry: KernelRegistry) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """1-arg and 3-arg ops gated per call by the first argument's dtype and device."""

    @kernreg.op("bench.gated1", registry=registry)
    def gated1(x: Any) -> Any:
        return x

    @kernreg.op("bench.gated3", registry=registry)
    def gated3(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        return x

    gated1.register(
        "triton", _impl1, requires=["cuda>=8.0"], dtypes=["bfloat16", "float16"], priority=10
    )
    gated3.register(
        "triton", _impl3, requires=["cuda>=8.0"], dtypes=["bfloat16", "float16"], priority=10
    )
    return gated1, gated3


def _chosen(op_object: Any, *args: Any) -> Callable[..., Any]:
    decision = op_object.explain_call(*args)
    assert decision.chosen is not None, decision
    return decision.chosen.load()  # type: ignore[no-any-return]


def bench_static_calls(quick: bool) -> list[dict[str, Any]]:
    number, rounds = (20_000, 5) if quick else (200_000, 15)
    registry = _fresh_registry()
    static1, static3 = _static_ops(registry)
    assert _chosen(static1, object()) is _impl1
    assert _chosen(static3, 1, 2) is _impl3

    box = [_impl1]

    def fixed_arity(x: Any) -> Any:
        return box[0](x)

    table = {"bench.static1": _impl1}

    @functools.cache  # lru_cache(maxsize=None)
    def resolve(op_id: str) -> Callable[..., Any]:
        return table[op_id]

    ns: dict[str, Any] = {
        "impl1": _impl1,
        "impl3": _impl3,
        "op1": static1,
        "op3": static3,
        "wrapper": fixed_arity,
        "table": table,
        "resolve": resolve,
        "x": object(),
        "w": object(),
    }
    t = per_call_ns(
        {
            "direct1": "impl1(x)",
            "wrapper": "wrapper(x)",
            "dict": "table['bench.static1'](x)",
            "lru": "resolve('bench.static1')(x)",
            "op1": "op1(x)",
            "direct3": "impl3(x, w)",
            "op3": "op3(x, w)",
            "direct3_kw": "impl3(x, w, eps=1e-5)",
            "op3_kw": "op3(x, w, eps=1e-5)",
        },
        ns,
        number=number,
        rounds=rounds,
    )
    d1, d3, d3k = t["direct1"], t["direct3"], t["direct3_kw"]

    def over(
        name: str, label: str, direct: float, direct_label: str, budget: bool
    ) -> dict[str, Any]:
        return _record(
            label,
            t[name] - direct,
            "ns over direct",
            budget="≤ 40 ns" if budget else None,
            limit=40.0 if budget else None,
            baseline=f"{direct_label} = {direct:.1f} ns",
            baseline_value=direct,
            ratio_value=t[name],
        )

    direct1 = "direct impl(x)"
    return [
        _record("call: direct impl(x)", d1, "ns/call"),
        over("wrapper", "call: fixed-arity wrapper box[0](x) (baseline)", d1, direct1, False),
        over("dict", "call: dict lookup + call (baseline)", d1, direct1, False),
        over("lru", "call: lru_cache resolver per call (baseline)", d1, direct1, False),
        over("op1", "op object, static decision, f(x)", d1, direct1, True),
        over("op3", "op object, static decision, f(x, weight)", d3, "direct impl(x, w)", True),
        over(
            "op3_kw",
            "op object, static decision, f(x, weight, eps=1e-5)",
            d3k,
            "direct impl(x, w, eps=)",
            True,
        ),
    ]


def bench_gated_calls(quick: bool) -> list[dict[str, Any]]:
    number, rounds = (20_000, 5) if quick else (200_000, 15)
    registry = _fresh_registry()
    gated1, gated3 = _gated_ops(registry)
    x = Tensor(DType("bfloat16"), Device("cuda", 0))
    w = Tensor(DType("bfloat16"), Device("cuda", 0))
    assert _chosen(gated1, x) is _impl1
    assert _chosen(gated3, x, w) is _impl3

    by_key = {(x.dtype, x.device): _impl1}

    def hand_gate(x: Any) -> Any:
        return by_key[(x.dtype, x.device)](x)

    ns: dict[str, Any] = {
        "impl1": _impl1,
        "impl3": _impl3,
        "op1": gated1,
        "op3": gated3,
        "hand_gate": hand_gate,
        "x": x,
        "w": w,
    }
    statements = {
        "direct1": "impl1(x)",
        "hand": "hand_gate(x)",
        "op1": "op1(x)",
        "direct3": "impl3(x, w)",
        "op3": "op3(x, w)",
    }
    numpy_note = "numpy is not installed: numpy arrays not measured"
    try:
        import numpy
    except ImportError:
        numpy = None
    if numpy is not None:
        array = numpy.zeros(4, dtype=numpy.float16)
        ns["array"] = array
        ns["impl_np"] = _chosen(gated1, array)
        statements["direct_np"] = "impl_np(array)"
        statements["op_np"] = "op1(array)"
        numpy_note = ""
    t = per_call_ns(statements, ns, number=number, rounds=rounds)
    d1, d3 = t["direct1"], t["direct3"]
    direct1 = f"direct impl(x) = {d1:.1f} ns"

    def over(name: str, label: str, direct: float, baseline: str, budget: bool) -> dict[str, Any]:
        return _record(
            label,
            t[name] - direct,
            "ns over direct",
            budget="≤ 250 ns" if budget else None,
            limit=250.0 if budget else None,
            baseline=baseline,
            baseline_value=direct,
            ratio_value=t[name],
        )

    records = [
        over(
            "hand",
            "gated: hand-written table[(x.dtype, x.device)](x) (baseline)",
            d1,
            direct1,
            False,
        ),
        over("op1", "op object, dtype+device gate, f(x)", d1, direct1, True),
        over(
            "op3",
            "op object, dtype+device gate, f(x, weight)",
            d3,
            f"direct impl(x, w) = {d3:.1f} ns",
            True,
        ),
    ]
    if numpy is not None:
        dn = t["direct_np"]
        records.append(
            over(
                "op_np",
                "op object, dtype+device gate, f(numpy array)",
                dn,
                f"direct impl(array) = {dn:.1f} ns",
                True,
            )
        )
    else:
        records[-1]["note"] = numpy_note
    return records


def bench_fallbacks(quick: bool) -> list[dict[str, Any]]:
    """What the decision counters and the demotion policy (docs/fallbacks.md) add to a
    call: a gated op object whose route was decided with counting on, against one decided
    with counting off (counters count decisions, so the two should be level), and op
    objects under ``KERNREG_DEMOTE`` (their chosen implementation behind a guard)."""
    import kernreg.dispatch
    from kernreg.tracing import count_decision

    number, rounds = (20_000, 5) if quick else (200_000, 15)
    x = Tensor(DType("bfloat16"), Device("cuda", 0))
    counted, _ = _gated_ops(_fresh_registry())
    uncounted, _ = _gated_ops(_fresh_registry())
    saved = kernreg.dispatch.count_decision
    kernreg.dispatch.count_decision = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        uncounted(x)  # its route is decided (and cached) without counting
    finally:
        kernreg.dispatch.count_decision = saved
    policy = KernelRegistry(config=Config(demote="bench.*"), platform=PLATFORM)
    guarded_gated, _ = _gated_ops(policy)
    guarded_static, _ = _static_ops(policy)
    # Demoted in one shape bucket: the op's calls read their bucket (x here has none: "-").
    bucketed = KernelRegistry(
        config=Config(demote="bench.*", cache_dir=tempfile.mkdtemp()), platform=PLATFORM
    )
    bucket_static, _ = _static_ops(bucketed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bucketed.demote(bucket_static.explain(), RuntimeError("bench"), "x=4096")
    decision = counted.explain_call(x)
    ns: dict[str, Any] = {
        "impl1": _impl1,
        "counted": counted,
        "uncounted": uncounted,
        "gated": guarded_gated,
        "static": guarded_static,
        "bucketed": bucket_static,
        "count_decision": count_decision,
        "decision": decision,
        "x": x,
    }
    t = per_call_ns(
        {
            "direct": "impl1(x)",
            "counted": "counted(x)",
            "uncounted": "uncounted(x)",
            "gated": "gated(x)",
            "static": "static(x)",
            "bucketed": "bucketed(x)",
            "count": "count_decision(decision)",
        },
        ns,
        number=number,
        rounds=rounds,
    )
    direct = t["direct"]
    baseline = f"direct impl(x) = {direct:.1f} ns"
    return [
        _record(
            "counters: added to a gated op call, f(x)",
            t["counted"] - t["uncounted"],
            "ns",
            budget="≤ 20 ns",
            limit=20.0,
            baseline=f"same call, route decided without counting = {t['uncounted'] - direct:.1f} "
            "ns over direct",
            note="decisions are counted, not calls: a cached call runs no counting code",
        ),
        _record("counters: counting one decision", t["count"], "ns/decision"),
        _record(
            "op object, dtype+device gate, f(x), under KERNREG_DEMOTE",
            t["gated"] - direct,
            "ns over direct",
            budget="≤ 250 ns",
            limit=250.0,
            baseline=baseline,
            baseline_value=direct,
            ratio_value=t["gated"],
        ),
        _record(
            "op object, static decision, f(x), under KERNREG_DEMOTE",
            t["static"] - direct,
            "ns over direct",
            baseline=baseline,
            baseline_value=direct,
            ratio_value=t["static"],
            note="opt-in: the implementation runs behind a guard (without the policy it is "
            "called directly)",
        ),
        _record(
            "op object, static decision, f(x), demoted in another shape bucket",
            t["bucketed"] - direct,
            "ns over direct",
            baseline=baseline,
            baseline_value=direct,
            ratio_value=t["bucketed"],
            note="only an op with a demotion for its platform and dtypes: each call reads "
            "its shape bucket",
        ),
    ]


def bench_get_kernel(quick: bool) -> list[dict[str, Any]]:
    number, rounds = (20_000, 5) if quick else (200_000, 9)
    registry = _fresh_registry()
    registry.register(KernelSpec("bench.lookup", "torch", _impl3, reference=True))
    registry.register(KernelSpec("bench.lookup", "fast", _impl1, priority=10))
    registry.register(KernelSpec("bench.lookup", "slow", _impl1, variant="v2", priority=1))
    kernel = kernreg.get_kernel("bench.lookup", registry=registry)
    explicit = kernreg.get_kernel("bench.lookup", "slow", variant="v2", registry=registry)
    identical = kernel is _impl1 and explicit is _impl1

    table = {"bench.lookup": _impl1}

    @functools.cache  # lru_cache(maxsize=None)
    def resolve(op_id: str) -> Callable[..., Any]:
        return table[op_id]

    ns = {"get_kernel": kernreg.get_kernel, "registry": registry, "resolve": resolve}
    t = per_call_ns(
        {
            "lru": "resolve('bench.lookup')",
            "get": "get_kernel('bench.lookup', registry=registry)",
            "method": "registry.get_kernel('bench.lookup')",
        },
        ns,
        number=number,
        rounds=rounds,
    )
    lru = f"lru_cache resolver = {t['lru']:.1f} ns"
    return [
        _record(
            "get_kernel returns the implementation itself",
            float(identical),
            "bool",
            budget="identical object",
            limit=None,
        )
        | {"ok": identical},
        _record(
            "get_kernel(op), cached",
            t["get"],
            "ns/call",
            baseline=lru,
            baseline_value=t["lru"],
        ),
        _record(
            "registry.get_kernel(op), cached",
            t["method"],
            "ns/call",
            baseline=lru,
            baseline_value=t["lru"],
        ),
    ]


# --- import -------------------------------------------------------------------------------


def _bytecode_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _importtime_ms(env: dict[str, str]) -> float:
    """Cumulative import time of the ``kernreg`` package, as ``-X importtime`` reports it."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import kernreg"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    for line in reversed(proc.stderr.splitlines()):
        fields = [field.strip() for field in line.split("|")]
        if len(fields) == 3 and fields[2] == "kernreg":
            return int(fields[1]) / 1e3
    raise RuntimeError(f"no kernreg line in -X importtime output:\n{proc.stderr}")


def bench_import(quick: bool) -> list[dict[str, Any]]:
    runs = 5 if quick else 21
    env = _bytecode_env()
    package_dir = os.path.dirname(os.path.abspath(kernreg.__file__))
    subprocess.run([sys.executable, "-m", "compileall", "-q", package_dir], env=env, check=True)

    def wall(code: str) -> float:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        return time.perf_counter() - started

    wall("import kernreg")  # warm the file system cache
    wall("pass")
    bare: list[float] = []
    full: list[float] = []
    for _ in range(runs):
        bare.append(wall("pass"))
        full.append(wall("import kernreg"))
    bare_ms = statistics.median(bare) * 1e3
    full_ms = statistics.median(full) * 1e3
    net_ms = full_ms - bare_ms

    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, kernreg; "
            f"print(','.join(m for m in {HEAVY_MODULES!r} if m in sys.modules)); "
            "print(len(sys.modules))",
        ],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    heavy_line, count_line = probe.stdout.splitlines()
    self_reported = statistics.median(_importtime_ms(env) for _ in range(runs))
    heavy = [m for m in heavy_line.split(",") if m]
    method = (
        f"median of {runs} subprocess runs minus `python -c pass`; bytecode compiled, "
        "PYTHONDONTWRITEBYTECODE unset"
    )
    return [
        _record(
            "import kernreg",
            net_ms,
            "ms",
            baseline=f"python -c pass = {bare_ms:.1f} ms",
            baseline_value=bare_ms,
            ratio_value=full_ms,
            note=method,
        ),
        _record(
            "import kernreg, in-process (-X importtime)",
            self_reported,
            "ms",
            note=f"median of {runs}; cumulative time of the kernreg package as Python reports it",
        ),
        _record(
            "import kernreg: torch/numpy/triton/click/rich not imported",
            float(not heavy),
            "bool",
            budget="none of them",
            note=(
                f"imported: {', '.join(heavy)}" if heavy else f"{count_line} modules in sys.modules"
            ),
        )
        | {"ok": not heavy},
    ]


# --- bulk: registration and explain -------------------------------------------------------

_CUDA80 = Requirement.parse("cuda>=8.0")
_SM90A = Requirement.parse("cuda:sm_90a")
_CPU = Requirement.parse("cpu")


def _spec_names(count: int) -> list[tuple[str, str, str]]:
    """Op ids and target strings for ``count`` specs (built before the clock starts)."""
    return [
        (f"bench.op_{i}", f"bench_kernels.triton_ops:op_{i}", f"bench_kernels.aot_ops:op_{i}")
        for i in range(count // 4)
    ]


def _make_specs(names: list[tuple[str, str, str]]) -> list[KernelSpec]:
    """Four specs per op: a reference, a gated Triton one, a Hopper build, a CPU one."""
    specs = []
    for op_id, triton_target, aot_target in names:
        specs.append(KernelSpec(op_id, "torch", _impl1, reference=True))
        specs.append(
            KernelSpec(
                op_id,
                "triton",
                triton_target,
                requires=(_CUDA80,),
                dtypes=("bfloat16", "float16"),
                priority=10,
            )
        )
        specs.append(
            KernelSpec(
                op_id,
                "aot",
                aot_target,
                variant="sm90a",
                requires=(_SM90A,),
                dtypes=("bfloat16",),
                traits=("cuda_graph_safe",),
                priority=20,
            )
        )
        specs.append(KernelSpec(op_id, "cpu_ext", _impl1, requires=(_CPU,), priority=5))
    return specs


def bench_register(quick: bool) -> list[dict[str, Any]]:
    count, passes = 100_000, (1 if quick else 3)
    both: list[float] = []
    register_only: list[float] = []
    construct_only: list[float] = []
    names = _spec_names(count)
    for _ in range(passes):
        with _gc_paused():
            started = time.perf_counter()
            specs = _make_specs(names)
            built = time.perf_counter()
            registry = _fresh_registry()
            for spec in specs:
                registry.register(spec)
            done = time.perf_counter()
        assert len(registry) == count
        construct_only.append(built - started)
        register_only.append(done - built)
        both.append(done - started)
        del specs, registry
    with _gc_paused():
        keys = [(f"bench.op_{i // 4}", str(i % 4), "") for i in range(count)]
        started = time.perf_counter()
        plain: dict[tuple[str, str, str], int] = {}
        for key in keys:
            plain[key] = 1
        dict_s = time.perf_counter() - started
    note = f"best of {passes}; 25,000 ops x 4 specs (requires, dtypes, string targets); GC paused"
    return [
        _record(
            "register 100,000 specs: construct + register",
            min(both),
            "s",
            note=note + "; not a budget (docs/design.md, Budgets)",
        ),
        _record("register 100,000 specs: KernelSpec construction only", min(construct_only), "s"),
        _record(
            "register 100,000 specs: registration only",
            min(register_only),
            "s",
            baseline=f"100,000 plain dict inserts = {dict_s * 1e3:.1f} ms",
            baseline_value=dict_s,
        ),
    ]


def bench_explain(quick: bool) -> list[dict[str, Any]]:
    ops_count, passes = 10_000, (1 if quick else 3)
    specs = _make_specs(_spec_names(4 * ops_count))
    # Every other op lacks its CPU spec: 3 or 4 specs per op.
    specs = [s for i, s in enumerate(specs) if not (s.backend == "cpu_ext" and (i // 4) % 2)]
    ops = sorted({s.op for s in specs})
    timings: list[float] = []
    chosen: set[str] = set()
    for _ in range(passes):
        registry = _fresh_registry()
        for spec in specs:
            registry.register(spec)
        with _gc_paused():
            started = time.perf_counter()
            decisions = [registry.explain(op, platform=PLATFORM, dtypes=DTYPES) for op in ops]
            timings.append(time.perf_counter() - started)
        chosen = {d.chosen.label for d in decisions if d.chosen is not None}
    assert len(decisions) == ops_count
    assert all(d.ok for d in decisions), chosen
    return [
        _record(
            "explain every op of a 10,000-op inventory (cold)",
            min(timings),
            "s",
            budget="< 0.5 s",
            limit=0.5,
            inclusive=False,
            baseline=None,
            note=(
                f"best of {passes}, fresh registry each; {len(specs):,} specs; platform "
                f"{PLATFORM}, dtypes {DTYPES[0]}; chosen: {', '.join(sorted(chosen))}"
            ),
        )
    ]


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Every core figure; see the module docstring for the method."""
    return [
        *bench_import(quick),
        *bench_register(quick),
        *bench_get_kernel(quick),
        *bench_static_calls(quick),
        *bench_gated_calls(quick),
        *bench_fallbacks(quick),
        *bench_explain(quick),
    ]

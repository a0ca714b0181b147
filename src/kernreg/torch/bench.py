"""Benchmarks: how long each implementation of an op takes here, on representative shapes.

* :func:`time_callable` times one callable on one set of inputs: warm-up calls, then
  ``repeats`` timed calls, reported as a :class:`~kernreg.tuning.Measurement` (median and
  interquartile range). CUDA (and ROCm) devices are timed with CUDA events, other
  devices with ``time.perf_counter_ns`` around a synchronised call. The autotune policy
  measures candidates with it too.
* :func:`benchmark` times every implementation of an op that can run here, the
  reference included, on the named shapes its input generator declares
  (:func:`bench_shapes`), for each dtype, and reports the speed-up of each over the
  reference.
* :func:`plot_reports` draws reports as a PNG chart (needs matplotlib: ``kernreg[plot]``).

Which implementations run is the decision kernreg makes for the platform and dtype
(:func:`kernreg.explain`), as in the parity harness: rejected ones are reported as
skipped with the reasons, and one behind a ``when`` predicate runs on the shapes where
the predicate holds for the generated call.
"""

from __future__ import annotations

import gc
import inspect
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from os import PathLike
from typing import Any

import torch

from kernreg._frozen import Frozen
from kernreg._names import display_label
from kernreg.arguments import PlatformLike, platform_argument, registry_argument
from kernreg.dtypes import normalize_dtype
from kernreg.errors import KernregError
from kernreg.measurement import Measurement
from kernreg.platform import Platform
from kernreg.registry import KernelRegistry
from kernreg.selection import Candidate
from kernreg.spec import KernelSpec
from kernreg.torch._inputs import bench_shapes, check_shape, input_spec
from kernreg.torch.calls import clone_value, device_available, error_text
from kernreg.torch.parity import torch_device, torch_dtype

__all__ = [
    "DEFAULT_REPEATS",
    "DEFAULT_WARMUP",
    "NOISY_IQR_FRACTION",
    "QUICK_REPEATS",
    "QUICK_WARMUP",
    "BenchError",
    "BenchReport",
    "BenchResult",
    "BenchSkip",
    "Progress",
    "bench_shapes",
    "benchmark",
    "format_ns",
    "op_shapes",
    "plot_figure",
    "plot_reports",
    "time_callable",
]

#: Untimed calls before the timed ones (the first call may compile, allocate or fill caches).
DEFAULT_WARMUP = 5
#: Timed calls per implementation, dtype and shape.
DEFAULT_REPEATS = 25
#: The ``quick`` preset: the first (smallest) declared shape, fewer calls.
QUICK_WARMUP = 2
QUICK_REPEATS = 10

#: A timing whose interquartile range exceeds this fraction of its median is too noisy to
#: trust (another process ran, the clock was throttled): reports flag it as ``noisy``.
NOISY_IQR_FRACTION = 0.10

#: ``progress(done, total, what)``: called after each timing (or skip) that
#: :func:`benchmark` planned, ``what`` naming the implementation, dtype and shape.
Progress = Callable[[int, int, str], None]


class BenchError(KernregError, ValueError):
    """An op cannot be benchmarked at all (no input generator, unknown shape, no device)."""


# --- timing one callable ----------------------------------------------------------------------


def time_callable(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    warmup: int = DEFAULT_WARMUP,
    repeats: int = DEFAULT_REPEATS,
    device: str | torch.device | None = None,
    mutates: Collection[str] = (),
) -> Measurement:
    """Time ``fn(*args, **kwargs)``: ``warmup`` untimed calls, then ``repeats`` timed ones.

    Each timed call is one call of ``fn``; the result is the median over the repeats and
    their interquartile range as the spread (0 for fewer than two repeats), in
    nanoseconds.

    ``device`` is where the work runs (default: the device of the first tensor argument,
    else ``cpu``). On a ``cuda`` device (ROCm included) a pair of CUDA events brackets
    each call on the current stream and the device is synchronised once at the end, so
    the time is the device's; elsewhere ``time.perf_counter_ns`` brackets the call, with
    the device synchronised before and after it when torch can (``mps``, ``xpu``, ...).

    ``mutates`` names the parameters ``fn`` writes in place (as the op's input spec
    declares them): those arguments are cloned afresh before every call, outside the
    timed region, so each call sees the original values. Names are matched against
    ``kwargs`` and, through ``fn``'s signature, the positional ``args``; when ``fn`` has
    no inspectable signature every positional tensor argument is cloned.

    The garbage collector is paused while timing. Raises ``ValueError`` for a negative
    ``warmup``, fewer than one repeat or a ``mutates`` name ``fn`` does not take, and
    whatever ``fn`` raises.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    args = tuple(args)
    kwargs = dict(kwargs or {})
    target = torch.device(device) if device is not None else _device_of(args, kwargs)
    prepare = _preparer(fn, args, kwargs, mutates)
    if target.type == "cuda":
        times = _time_cuda(fn, prepare, warmup, repeats, target)
    else:
        times = _time_host(fn, prepare, warmup, repeats, _synchronizer(target))
    return _measurement(times)


Prepare = Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _preparer(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mutates: Collection[str],
) -> Prepare:
    """What each call gets: the same arguments, or fresh clones of the mutated ones."""
    if not mutates:
        return lambda: (args, kwargs)
    names = set(mutates)
    keys = [key for key in kwargs if key in names]
    positions = _mutated_positions(fn, len(args), names)
    if positions is None:  # no signature: clone every positional tensor argument
        positions = [i for i, a in enumerate(args) if isinstance(a, (torch.Tensor, list, tuple))]

    def fresh() -> tuple[tuple[Any, ...], dict[str, Any]]:
        call_args = list(args)
        for i in positions:
            call_args[i] = clone_value(args[i])
        call_kwargs = dict(kwargs)
        for key in keys:
            call_kwargs[key] = clone_value(kwargs[key])
        return tuple(call_args), call_kwargs

    return fresh


def _mutated_positions(fn: Callable[..., Any], count: int, names: set[str]) -> list[int] | None:
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    unknown = names - {p.name for p in parameters}
    if unknown and not accepts_any:
        raise ValueError(
            f"mutates names {sorted(unknown)} that {getattr(fn, '__name__', fn)!r} does not take"
        )
    positions = []
    for i, parameter in enumerate(parameters[:count]):
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            break
        if parameter.name in names:
            positions.append(i)
    return positions


def _synchronizer(device: torch.device) -> Callable[[], None] | None:
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    synchronize = getattr(module, "synchronize", None)
    return synchronize if callable(synchronize) else None


def _time_host(
    fn: Callable[..., Any],
    prepare: Prepare,
    warmup: int,
    repeats: int,
    synchronize: Callable[[], None] | None,
) -> list[float]:
    clock = time.perf_counter_ns
    times: list[float] = []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(warmup + repeats):
            call_args, call_kwargs = prepare()
            if synchronize is not None:
                synchronize()
            start = clock()
            fn(*call_args, **call_kwargs)
            if synchronize is not None:
                synchronize()
            end = clock()
            if i >= warmup:
                times.append(float(end - start))
    finally:
        if gc_was_enabled:
            gc.enable()
    return times


def _time_cuda(
    fn: Callable[..., Any], prepare: Prepare, warmup: int, repeats: int, device: torch.device
) -> list[float]:
    events: list[tuple[Any, Any]] = []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.device(device):
            for _ in range(warmup):
                call_args, call_kwargs = prepare()
                fn(*call_args, **call_kwargs)
            torch.cuda.synchronize()
            for _ in range(repeats):
                call_args, call_kwargs = prepare()  # queued before `start`: not timed
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
                fn(*call_args, **call_kwargs)
                end.record()
                events.append((start, end))
            torch.cuda.synchronize()
    finally:
        if gc_was_enabled:
            gc.enable()
    return [float(start.elapsed_time(end)) * 1e6 for start, end in events]  # ms -> ns


def _measurement(times: list[float]) -> Measurement:
    median = statistics.median(times)
    if len(times) < 2:
        return Measurement(median, 0.0, len(times))
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return Measurement(median, q3 - q1, len(times))


def format_ns(ns: float) -> str:
    """A duration for people: ``850 ns``, ``12.3 us``, ``4.56 ms``, ``1.20 s``."""
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if ns >= scale:
            value = ns / scale
            digits = 2 if value < 10 else 1 if value < 100 else 0
            return f"{value:.{digits}f} {unit}"
    return f"{ns:.0f} ns"


# --- results ----------------------------------------------------------------------------------


class BenchResult(Frozen):
    """One implementation timed on one dtype and named shape.

    ``dims`` are the generator's keyword arguments for the shape (name, value pairs);
    ``speedup`` is the reference's median over this one's (``None`` when the reference
    was not timed on the same dtype and shape).
    """

    __slots__ = (
        "op",
        "implementation",
        "dtype",
        "shape",
        "dims",
        "measurement",
        "speedup",
        "reference",
    )
    op: str
    implementation: str
    dtype: str
    shape: str
    dims: tuple[tuple[str, object], ...]
    measurement: Measurement
    speedup: float | None
    reference: bool

    def __init__(
        self,
        op: str,
        implementation: str,
        dtype: str,
        shape: str,
        dims: Mapping[str, object],
        measurement: Measurement,
        speedup: float | None = None,
        *,
        reference: bool = False,
    ) -> None:
        self._set("op", op)
        self._set("implementation", implementation)
        self._set("dtype", dtype)
        self._set("shape", shape)
        self._set("dims", tuple(dims.items()))
        self._set("measurement", measurement)
        self._set("speedup", speedup)
        self._set("reference", reference)

    @property
    def dims_text(self) -> str:
        """``tokens=16 hidden=1024``."""
        return " ".join(f"{key}={value}" for key, value in self.dims)

    @property
    def noisy(self) -> bool:
        """Whether the interquartile range exceeds :data:`NOISY_IQR_FRACTION` of the median."""
        return self.measurement.spread_ns > NOISY_IQR_FRACTION * self.measurement.median_ns

    def describe(self) -> dict[str, object]:
        return {
            "op": self.op,
            "implementation": self.implementation,
            "reference": self.reference,
            "dtype": self.dtype,
            "shape": self.shape,
            "dims": dict(self.dims),
            **self.measurement.describe(),
            "noisy": self.noisy,
            "speedup": self.speedup,
        }


class BenchSkip(Frozen):
    """An implementation that was not timed on a dtype (and shape, when it depends on the
    call), and why."""

    __slots__ = ("implementation", "dtype", "shape", "reason")
    implementation: str
    dtype: str
    shape: str | None
    reason: str

    def __init__(self, implementation: str, dtype: str, shape: str | None, reason: str) -> None:
        self._set("implementation", implementation)
        self._set("dtype", dtype)
        self._set("shape", shape)
        self._set("reason", reason)

    def describe(self) -> dict[str, object]:
        return {
            "implementation": self.implementation,
            "dtype": self.dtype,
            "shape": self.shape,
            "reason": self.reason,
        }


class BenchReport(Frozen):
    """Every timing of :func:`benchmark` for one op, in a fixed order (dtype, shape, then
    the reference and the others by priority)."""

    __slots__ = ("op", "platform", "reference", "results", "skipped", "warmup", "repeats")
    op: str
    platform: Platform
    reference: str | None
    results: tuple[BenchResult, ...]
    skipped: tuple[BenchSkip, ...]
    warmup: int
    repeats: int

    def __init__(
        self,
        op: str,
        platform: Platform,
        reference: str | None,
        results: tuple[BenchResult, ...],
        skipped: tuple[BenchSkip, ...] = (),
        *,
        warmup: int = DEFAULT_WARMUP,
        repeats: int = DEFAULT_REPEATS,
    ) -> None:
        self._set("op", op)
        self._set("platform", platform)
        self._set("reference", reference)
        self._set("results", results)
        self._set("skipped", skipped)
        self._set("warmup", warmup)
        self._set("repeats", repeats)

    @property
    def timed(self) -> tuple[str, ...]:
        """Implementations timed at least once, sorted."""
        return tuple(sorted({r.implementation for r in self.results}))

    def result(self, implementation: str, dtype: str, shape: str) -> BenchResult | None:
        """The timing of ``implementation`` on ``dtype`` and ``shape``, if there is one."""
        for r in self.results:
            if (r.implementation, r.dtype, r.shape) == (implementation, dtype, shape):
                return r
        return None

    def describe(self) -> dict[str, object]:
        return {
            "op": self.op,
            "platform": str(self.platform),
            "reference": self.reference,
            "warmup": self.warmup,
            "repeats": self.repeats,
            "results": [r.describe() for r in self.results],
            "skipped": [s.describe() for s in self.skipped],
        }

    def __str__(self) -> str:
        reference = self.reference or "none"
        lines = [f"benchmark of {self.op} on {self.platform} (reference {reference})"]
        for r in self.results:
            speedup = "-" if r.speedup is None else f"{r.speedup:.2f}x"
            lines.append(
                f"  {r.implementation:<16} {r.dtype:<9} {r.shape:<8} "
                f"{format_ns(r.measurement.median_ns):>9} "
                f"(IQR {format_ns(r.measurement.spread_ns)}) {speedup:>7}"
            )
        for s in self.skipped:
            where = s.dtype if s.shape is None else f"{s.dtype} {s.shape}"
            lines.append(f"  skipped {s.implementation} ({where}): {s.reason}")
        return "\n".join(lines)


# --- benchmarking an op ---------------------------------------------------------------------


class _Shape:
    """A named shape: the generator's keyword arguments and the seed of its values."""

    def __init__(self, name: str, dims: dict[str, object], seed: int = 0) -> None:
        self.name = name
        self.dims = dims
        self.seed = seed


def op_shapes(op: str, *, registry: KernelRegistry | None = None) -> dict[str, dict[str, object]]:
    """The named shapes :func:`benchmark` uses for ``op`` by default, in order.

    Those its input generator declares with :func:`bench_shapes`; for a generator that
    declares none, its seeded cases ``seed0`` and ``seed1`` (no keyword arguments).
    ``registry`` (default: the process-wide one) loads the plugins that declare them.
    """
    registry_argument(registry).explain(op)  # loads plugins; unknown ops raise OpNotFoundError
    return {s.name: s.dims for s in _available_shapes(op)}


def _available_shapes(op: str) -> list[_Shape]:
    declared = input_spec(op)
    if declared is None:
        raise BenchError(
            f"no input generator registered for op '{op}': declare one with "
            "@kernreg.torch.inputs(op_id) (and named shapes with bench_shapes)"
        )
    named = declared.shapes()
    if named:
        return [_Shape(name, dims) for name, dims in named.items()]
    return [_Shape(f"seed{seed}", {}, seed) for seed in (0, 1)]


def choose_shapes(
    op: str, shapes: Sequence[str] | Mapping[str, Mapping[str, object]] | None, quick: bool
) -> list[_Shape]:
    if isinstance(shapes, Mapping):
        if not shapes:
            raise BenchError(f"no shapes given for op '{op}'")
        return [_Shape(name, check_shape(name, dims)) for name, dims in shapes.items()]
    available = _available_shapes(op)
    if shapes is None:
        return available[:1] if quick else available
    by_name = {s.name: s for s in available}
    unknown = [name for name in shapes if name not in by_name]
    if unknown:
        raise BenchError(
            f"op '{op}' has no shape {', '.join(map(repr, unknown))}; "
            f"its shapes: {', '.join(by_name)}"
        )
    return [by_name[name] for name in dict.fromkeys(shapes)]


def benchmark(
    op: Any,
    *,
    shapes: Sequence[str] | Mapping[str, Mapping[str, object]] | None = None,
    dtypes: Sequence[str] | None = None,
    platform: PlatformLike = None,
    registry: KernelRegistry | None = None,
    warmup: int | None = None,
    repeats: int | None = None,
    quick: bool = False,
    progress: Progress | None = None,
) -> BenchReport:
    """Time every implementation of ``op`` that can run here, on representative shapes.

    ``op`` is an op id or an op object. ``shapes`` are names of the shapes the op's input
    generator declares (default: all of them; see :func:`op_shapes`), or a mapping of
    new names to generator keyword arguments. ``dtypes`` default to the generator's.
    ``platform`` decides eligibility and the device (default: this machine).
    ``quick`` takes only the first declared shape and defaults ``warmup``/``repeats`` to
    :data:`QUICK_WARMUP`/:data:`QUICK_REPEATS` (else :data:`DEFAULT_WARMUP`/
    :data:`DEFAULT_REPEATS`). ``progress(done, total, what)`` is called after each
    planned timing.

    Implementations the decision rejects for a dtype, those whose ``when`` predicate is
    false for a shape's call, and those that raise are reported in ``skipped``.
    Raises :class:`BenchError` when the op has no input generator, a shape name is
    unknown or the platform's device is not here; ``KeyError`` subclasses for an
    unknown op.
    """
    op_id: str = op if isinstance(op, str) else op.op_id
    reg = getattr(op, "registry", None) if registry is None and not isinstance(op, str) else None
    reg = reg if isinstance(reg, KernelRegistry) else registry_argument(registry)
    plat = platform_argument(platform) or reg.platform
    reg.explain(op_id, platform=plat)  # loads plugins; unknown ops raise OpNotFoundError
    chosen_shapes = choose_shapes(op_id, shapes, quick)
    declared = input_spec(op_id)
    assert declared is not None  # choose_shapes checked
    device = torch_device(plat)
    if not device_available(device):
        raise BenchError(
            f"cannot benchmark op '{op_id}' for platform {plat}: torch has no {device.type} "
            "device here"
        )
    warmup = (QUICK_WARMUP if quick else DEFAULT_WARMUP) if warmup is None else warmup
    repeats = (QUICK_REPEATS if quick else DEFAULT_REPEATS) if repeats is None else repeats
    names = tuple(normalize_dtype(d) for d in dtypes) if dtypes else declared.dtypes
    reference = reg.reference(op_id)
    generate = declared.load()

    plans: list[tuple[str, list[Candidate]]] = []
    skipped: list[BenchSkip] = []
    for dtype in names:
        decision = reg.explain(op_id, platform=plat, dtypes=(dtype,))
        runnable = []
        for candidate in decision.candidates:
            if candidate.eligible:
                runnable.append(candidate)
            else:
                why = "; ".join(candidate.reasons)
                skipped.append(BenchSkip(candidate.spec.label, dtype, None, why))
        # The reference first, so every other speed-up is known when its row is made.
        runnable.sort(key=lambda c: not c.spec.reference)
        plans.append((dtype, runnable))

    total = sum(len(runnable) for _, runnable in plans) * len(chosen_shapes)
    done = 0
    loaded: dict[KernelSpec, Callable[..., Any] | str] = {}
    results: list[BenchResult] = []
    for dtype, runnable in plans:
        td = torch_dtype(dtype)
        for shape in chosen_shapes:
            try:
                args, kwargs = generate(td, device, shape.seed, **shape.dims)
            except Exception as exc:
                raise BenchError(
                    f"the input generator of op '{op_id}' {error_text(exc)} "
                    f"(dtype {dtype}, shape {shape.name})"
                ) from exc
            reference_ns: float | None = None
            for candidate in runnable:
                spec = candidate.spec
                reason = _why_not(reg, op_id, plat, dtype, spec, (args, kwargs), loaded)
                if reason is None:
                    impl = loaded[spec]
                    assert callable(impl)
                    try:
                        measured = time_callable(
                            impl,
                            args,
                            kwargs,
                            warmup=warmup,
                            repeats=repeats,
                            device=device,
                            mutates=declared.mutates,
                        )
                    except Exception as exc:
                        reason = error_text(exc)
                if reason is not None:
                    skipped.append(BenchSkip(spec.label, dtype, shape.name, reason))
                else:
                    if spec.reference:
                        reference_ns = measured.median_ns
                    speedup = (
                        reference_ns / measured.median_ns
                        if reference_ns is not None and measured.median_ns > 0
                        else None
                    )
                    results.append(
                        BenchResult(
                            op_id,
                            spec.label,
                            dtype,
                            shape.name,
                            shape.dims,
                            measured,
                            speedup,
                            reference=spec.reference,
                        )
                    )
                done += 1
                if progress is not None:
                    progress(done, total, f"{op_id} {spec.label} {dtype} {shape.name}")
            del args, kwargs
    return BenchReport(
        op_id,
        plat,
        None if reference is None else reference.label,
        tuple(results),
        tuple(skipped),
        warmup=warmup,
        repeats=repeats,
    )


def _why_not(
    reg: KernelRegistry,
    op_id: str,
    platform: Platform,
    dtype: str,
    spec: KernelSpec,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    loaded: dict[KernelSpec, Callable[..., Any] | str],
) -> str | None:
    """Why ``spec`` cannot be timed on this call (``None``: it can, and is loaded)."""
    if spec.when is not None:
        verdict = reg.explain(op_id, platform=platform, dtypes=(dtype,), call=call).candidate(
            spec.backend, spec.variant
        )
        if not verdict.eligible:
            return "; ".join(verdict.reasons)
    if spec not in loaded:  # imported once, when some call may run it
        try:
            loaded[spec] = spec.load()
        except Exception as exc:
            loaded[spec] = error_text(exc)
    impl = loaded[spec]
    return impl if isinstance(impl, str) else None


# --- plotting ---------------------------------------------------------------------------------


def plot_reports(reports: Sequence[BenchReport], path: str | PathLike[str]) -> None:
    """Write a PNG chart of ``reports``: one subplot per op and dtype, the median time of
    each implementation across the shapes (log scale). The x axis names the shapes and
    their dimensions; the error bars are as wide as the interquartile range over the
    timed calls (a note under the chart says so); the title names the platform and the
    counts (ops, timings, warm-up and timed calls).

    Needs matplotlib (``pip install 'kernreg[plot]'``); ``ImportError`` without it.
    """
    figure = plot_figure(reports)
    figure.savefig(path, format="png", dpi=110)


def plot_figure(reports: Sequence[BenchReport]) -> Any:
    """The ``matplotlib.figure.Figure`` :func:`plot_reports` writes (for tests and notebooks)."""
    import importlib

    # Imported by name: matplotlib is optional, and the Agg canvas needs no display.
    figure_module = importlib.import_module("matplotlib.figure")
    panels: list[tuple[str, str, list[BenchResult]]] = []
    for report in reports:
        by_dtype: dict[str, list[BenchResult]] = {}
        for result in report.results:
            by_dtype.setdefault(result.dtype, []).append(result)
        panels.extend((report.op, dtype, rows) for dtype, rows in by_dtype.items())
    columns = min(3, max(1, len(panels)))
    rows_count = max(1, -(-len(panels) // columns))
    figure = figure_module.Figure(
        figsize=(max(6.0, 5.0 * columns), 3.6 * rows_count + 1.0), layout="constrained"
    )
    axes = figure.subplots(rows_count, columns, squeeze=False)
    for index, (op, dtype, rows) in enumerate(panels):
        ax = axes[index // columns][index % columns]
        shapes = list(dict.fromkeys(r.shape for r in rows))
        dims = {r.shape: r.dims_text for r in rows}
        implementations = list(dict.fromkeys(r.implementation for r in rows))
        for implementation in implementations:
            points = [r for r in rows if r.implementation == implementation]
            xs = [shapes.index(r.shape) for r in points]
            ys = [r.measurement.median_ns / 1e3 for r in points]
            half = [r.measurement.spread_ns / 2e3 for r in points]
            # The bar spans the interquartile range's width around the median, kept above 0
            # on the log axis.
            below = [min(h, 0.9 * y) for h, y in zip(half, ys, strict=True)]
            label = display_label(implementation, points[0].reference)
            ax.errorbar(xs, ys, yerr=[below, half], marker="o", capsize=3, label=label)
        ax.set_xticks(
            range(len(shapes)), [f"{s}\n{dims[s]}" if dims[s] else s for s in shapes], fontsize=7
        )
        keys = list(dict.fromkeys(key for r in rows for key, _ in r.dims))
        ax.set_xlabel(f"shape ({', '.join(keys)})" if keys else "shape")
        ax.set_yscale("log")
        ax.set_ylabel("median time (us)")
        ax.set_title(f"{op} {dtype}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for index in range(len(panels), rows_count * columns):
        axes[index // columns][index % columns].set_visible(False)
    if not panels:
        axes[0][0].set_visible(True)
        axes[0][0].text(0.5, 0.5, "nothing timed", ha="center", va="center")
    figure.suptitle(_plot_title(reports), fontsize=11)
    repeats = sorted({r.repeats for r in reports})
    calls = "/".join(str(n) for n in repeats) or "0"
    figure.supxlabel(
        f"points: median of {calls} timed calls; error bars: interquartile range (IQR) "
        "of those calls",
        fontsize=8,
    )
    return figure


def _plot_title(reports: Sequence[BenchReport]) -> str:
    platforms = ", ".join(dict.fromkeys(str(r.platform) for r in reports)) or "no platform"
    timings = sum(len(r.results) for r in reports)
    calls = ", ".join(dict.fromkeys(f"{r.warmup} warm-up + {r.repeats} timed" for r in reports))
    text = f"kernreg bench on {platforms}\n{len(reports)} op(s), {timings} timing(s)"
    return text + (f", {calls} calls each" if calls else "")

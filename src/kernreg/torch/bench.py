"""Benchmarks: how long each implementation of an op takes here, on representative shapes.

* :func:`time_callable` times one callable on one set of inputs: warm-up calls, then
  ``repeats`` timed calls, reported as a :class:`~kernreg.tuning.Measurement` (median and
  interquartile range). CUDA (and ROCm) devices are timed with CUDA events, other
  devices with ``time.perf_counter_ns`` around a synchronised call. The autotune policy
  measures candidates with it too.
* :func:`benchmark` times every implementation of an op that can run here, the
  reference included, on the named shapes its input generator declares
  (:func:`bench_shapes`), for each dtype, and reports the speed-up of each over the
  reference with its 95% interval. The implementations are timed interleaved (one call
  of each in turn, so a slow phase of the machine hits them alike), at least
  ``repeats`` calls each and then until the 95% interval of every median is within
  :data:`TARGET_PRECISION` of it or ``max_time`` runs out (as pyperf and
  pytest-benchmark calibrate rounds).
* :func:`plot_reports` draws reports as a PNG chart (needs matplotlib: ``kernreg[plot]``).

Which implementations run is the decision kernreg makes for the platform and dtype
(:func:`kernreg.explain`), as in the parity harness: rejected ones are reported as
skipped with the reasons, and one behind a ``when`` predicate runs on the shapes where
the predicate holds for the generated call.
"""

from __future__ import annotations

import gc
import inspect
import math
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from os import PathLike
from typing import Any

import torch

from kernreg._frozen import Frozen
from kernreg._names import display_label
from kernreg.dtypes import normalize_dtype
from kernreg.errors import KernregError
from kernreg.measurement import Measurement
from kernreg.platform import Platform
from kernreg.registry import KernelRegistry
from kernreg.selection import Candidate
from kernreg.spec import KernelSpec
from kernreg.torch._inputs import bench_shapes, check_shape, input_spec
from kernreg.torch.arguments import PlatformLike, platform_argument, registry_argument
from kernreg.torch.calls import clone_value, device_available, error_text
from kernreg.torch.parity import torch_device, torch_dtype

__all__ = [
    "DEFAULT_MAX_TIME",
    "DEFAULT_REPEATS",
    "DEFAULT_WARMUP",
    "NOISY_FRACTION",
    "QUICK_MAX_TIME",
    "QUICK_REPEATS",
    "QUICK_WARMUP",
    "TARGET_PRECISION",
    "BenchError",
    "BenchReport",
    "BenchResult",
    "BenchSkip",
    "Progress",
    "bench_shapes",
    "benchmark",
    "format_ns",
    "median_interval",
    "op_shapes",
    "plot_figure",
    "plot_reports",
    "time_callable",
]

#: Untimed calls before the timed ones (the first call may compile, allocate or fill caches).
DEFAULT_WARMUP = 5
#: Timed calls per implementation, dtype and shape: :func:`time_callable` makes exactly
#: this many, :func:`benchmark` at least this many.
DEFAULT_REPEATS = 25
#: How long :func:`benchmark` may go on timing the implementations of one dtype and shape
#: together, in seconds, once each has its ``repeats`` calls, while an interval is wide.
DEFAULT_MAX_TIME = 0.5
#: The ``quick`` preset: the first (smallest) declared shape, fewer calls, less time.
QUICK_WARMUP = 2
QUICK_REPEATS = 10
QUICK_MAX_TIME = 0.1

#: :func:`benchmark` stops timing a dtype and shape once the 95% interval of every median
#: is within this fraction of the median (either side).
TARGET_PRECISION = 0.02
#: A timing whose 95% interval still spans more than this fraction of its median (either
#: side) when the time ran out is too noisy to trust (another process ran, the clock was
#: throttled): reports flag it as ``noisy``.
NOISY_FRACTION = 0.05
#: The most timed calls of one implementation on one dtype and shape.
MAX_SAMPLES = 100_000

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


def median_interval(times: Sequence[float]) -> tuple[float, float]:
    """A 95% confidence interval of the median of ``times``, from their order statistics
    (distribution-free: no normality assumed, as timings rarely are normal).

    The ranks are ``n/2 -+ 0.98 sqrt(n)`` (the normal approximation of the binomial); with
    few samples the interval is the whole range. ``(m, m)`` for a single sample.
    """
    ordered = sorted(times)
    n = len(ordered)
    if n < 2:
        return (ordered[0], ordered[0]) if ordered else (0.0, 0.0)
    half = 0.98 * math.sqrt(n)
    low = max(1, math.floor(n / 2 - half))
    high = min(n, math.ceil(1 + n / 2 + half))
    return ordered[low - 1], ordered[high - 1]


def _settled(times: Sequence[float]) -> bool:
    low, high = median_interval(times)
    return (high - low) / 2 <= TARGET_PRECISION * statistics.median(times)


def _measurement(times: list[float]) -> Measurement:
    median = statistics.median(times)
    if len(times) < 2:
        return Measurement(median, 0.0, len(times))
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return Measurement(median, q3 - q1, len(times))


def measure_interleaved(
    fns: Sequence[Callable[..., Any]],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    warmup: int = DEFAULT_WARMUP,
    repeats: int = DEFAULT_REPEATS,
    max_time: float = DEFAULT_MAX_TIME,
    device: str | torch.device | None = None,
    mutates: Collection[str] = (),
) -> list[list[float] | str]:
    """Time several callables on the same inputs, interleaved; per callable, its call
    times in nanoseconds, or the error text of the call that raised.

    Each callable gets ``warmup`` untimed calls; then rounds of one timed call each, in
    turn (the first one rotating, so none always follows the same neighbour), at least
    ``repeats`` rounds, and more until the 95% interval of every median
    (:func:`median_interval`) is within :data:`TARGET_PRECISION` of it or ``max_time``
    seconds have passed since the timing began. Devices and ``mutates`` are handled as
    :func:`time_callable` handles them.
    """
    if warmup < 0 or repeats < 1 or max_time < 0:
        raise ValueError(
            f"need warmup >= 0, repeats >= 1 and max_time >= 0, got {warmup}, {repeats} "
            f"and {max_time}"
        )
    args = tuple(args)
    call_kwargs = dict(kwargs or {})
    target = torch.device(device) if device is not None else _device_of(args, call_kwargs)
    synchronize = _synchronizer(target)
    results: list[list[float] | str] = []
    prepares: list[Prepare | None] = []
    for fn in fns:
        try:
            prepare = _preparer(fn, args, call_kwargs, mutates)
            for _ in range(warmup):
                a, k = prepare()
                fn(*a, **k)
        except Exception as exc:
            results.append(error_text(exc))
            prepares.append(None)
        else:
            results.append([])
            prepares.append(prepare)
    active = [i for i, p in enumerate(prepares) if p is not None]
    if synchronize is not None:
        synchronize()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    started = time.perf_counter()
    rounds = 0
    try:
        while active:
            shift = rounds % len(active)
            for i in active[shift:] + active[:shift]:
                prepared = prepares[i]
                assert prepared is not None
                try:
                    elapsed = _time_once(fns[i], prepared, target, synchronize)
                except Exception as exc:
                    results[i] = error_text(exc)
                    continue
                times = results[i]
                assert isinstance(times, list)
                times.append(elapsed)
            active = [i for i in active if isinstance(results[i], list)]
            rounds += 1
            if rounds < repeats:
                continue
            if rounds >= MAX_SAMPLES or time.perf_counter() - started >= max_time:
                break
            # Sorting every sample list costs more than a fast call: check every 10 rounds.
            if (rounds - repeats) % 10 == 0 and all(_settled(results[i]) for i in active):  # type: ignore[arg-type]
                break
    finally:
        if gc_was_enabled:
            gc.enable()
    return results


def _time_once(
    fn: Callable[..., Any],
    prepare: Prepare,
    device: torch.device,
    synchronize: Callable[[], None] | None,
) -> float:
    """One timed call of ``fn`` in nanoseconds: CUDA events on a CUDA device, else the
    monotonic clock around a synchronised call."""
    call_args, call_kwargs = prepare()
    if device.type == "cuda":
        with torch.cuda.device(device):
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn(*call_args, **call_kwargs)
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) * 1e6  # ms -> ns
    if synchronize is not None:
        synchronize()
    begin = time.perf_counter_ns()
    fn(*call_args, **call_kwargs)
    if synchronize is not None:
        synchronize()
    return float(time.perf_counter_ns() - begin)


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
    ``interval`` is the 95% interval of the median (:func:`median_interval`);
    ``speedup`` is the reference's median over this one's (``None`` when the reference
    was not timed on the same dtype and shape) and ``speedup_interval`` its 95% interval
    (the reference's interval over this one's, ends crossed: wide rather than too narrow;
    ``None`` for the reference itself and without a reference).
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
        "interval",
        "speedup_interval",
    )
    op: str
    implementation: str
    dtype: str
    shape: str
    dims: tuple[tuple[str, object], ...]
    measurement: Measurement
    speedup: float | None
    reference: bool
    interval: tuple[float, float]
    speedup_interval: tuple[float, float] | None

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
        interval: tuple[float, float] | None = None,
        speedup_interval: tuple[float, float] | None = None,
    ) -> None:
        self._set("op", op)
        self._set("implementation", implementation)
        self._set("dtype", dtype)
        self._set("shape", shape)
        self._set("dims", tuple(dims.items()))
        self._set("measurement", measurement)
        self._set("speedup", speedup)
        self._set("reference", reference)
        median = measurement.median_ns
        self._set("interval", (median, median) if interval is None else tuple(interval))
        self._set("speedup_interval", None if speedup_interval is None else tuple(speedup_interval))

    @property
    def dims_text(self) -> str:
        """``tokens=16 hidden=1024``."""
        return " ".join(f"{key}={value}" for key, value in self.dims)

    @property
    def noisy(self) -> bool:
        """Whether the 95% interval of the median spans more than :data:`NOISY_FRACTION` of
        the median on either side (more time or a quieter machine would narrow it)."""
        low, high = self.interval
        return (high - low) / 2 > NOISY_FRACTION * self.measurement.median_ns

    @property
    def significant(self) -> bool:
        """Whether the speed-up's 95% interval excludes 1.0 (``False`` without one)."""
        if self.speedup_interval is None:
            return False
        low, high = self.speedup_interval
        return not low <= 1.0 <= high

    @property
    def speedup_text(self) -> str:
        """``2.31x [2.20-2.45]``; ``1.01x [0.97-1.05] n.s.`` when the interval includes 1.0
        (not significant); ``1.00x`` for the reference; ``-`` without a reference."""
        if self.speedup is None:
            return "-"
        if self.speedup_interval is None:
            return f"{self.speedup:.2f}x"
        low, high = self.speedup_interval
        text = f"{self.speedup:.2f}x [{low:.2f}-{high:.2f}]"
        return text if self.significant else text + " n.s."

    def describe(self) -> dict[str, object]:
        return {
            "op": self.op,
            "implementation": self.implementation,
            "reference": self.reference,
            "dtype": self.dtype,
            "shape": self.shape,
            "dims": dict(self.dims),
            **self.measurement.describe(),
            "interval_ns": list(self.interval),
            "noisy": self.noisy,
            "speedup": self.speedup,
            "speedup_interval": (
                None if self.speedup_interval is None else list(self.speedup_interval)
            ),
            "significant": self.significant,
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

    __slots__ = (
        "op",
        "platform",
        "reference",
        "results",
        "skipped",
        "warmup",
        "repeats",
        "max_time",
    )
    op: str
    platform: Platform
    reference: str | None
    results: tuple[BenchResult, ...]
    skipped: tuple[BenchSkip, ...]
    warmup: int
    repeats: int
    max_time: float

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
        max_time: float = DEFAULT_MAX_TIME,
    ) -> None:
        self._set("op", op)
        self._set("platform", platform)
        self._set("reference", reference)
        self._set("results", results)
        self._set("skipped", skipped)
        self._set("warmup", warmup)
        self._set("repeats", repeats)
        self._set("max_time", max_time)

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
            "max_time": self.max_time,
            "results": [r.describe() for r in self.results],
            "skipped": [s.describe() for s in self.skipped],
        }

    def __str__(self) -> str:
        reference = self.reference or "none"
        lines = [f"benchmark of {self.op} on {self.platform} (reference {reference})"]
        lines.extend(
            f"  {r.implementation:<16} {r.dtype:<9} {r.shape:<8} "
            f"{format_ns(r.measurement.median_ns):>9} "
            f"(IQR {format_ns(r.measurement.spread_ns)}) {r.speedup_text}"
            for r in self.results
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
    max_time: float | None = None,
    quick: bool = False,
    progress: Progress | None = None,
) -> BenchReport:
    """Time every implementation of ``op`` that can run here, on representative shapes.

    ``op`` is an op id or an op object. ``shapes`` are names of the shapes the op's input
    generator declares (default: all of them; see :func:`op_shapes`), or a mapping of
    new names to generator keyword arguments. ``dtypes`` default to the generator's.
    ``platform`` decides eligibility and the device (default: this machine).
    The implementations of one dtype and shape are timed together, interleaved
    (:func:`measure_interleaved`): ``warmup`` calls each, at least ``repeats`` timed calls
    each, then more until every median's 95% interval is within
    :data:`TARGET_PRECISION` or ``max_time`` seconds have passed.
    ``quick`` takes only the first declared shape and defaults ``warmup``/``repeats``/
    ``max_time`` to :data:`QUICK_WARMUP`/:data:`QUICK_REPEATS`/:data:`QUICK_MAX_TIME`
    (else :data:`DEFAULT_WARMUP`/:data:`DEFAULT_REPEATS`/:data:`DEFAULT_MAX_TIME`).
    ``progress(done, total, what)`` is called after each planned timing.

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
    if max_time is None:
        max_time = QUICK_MAX_TIME if quick else DEFAULT_MAX_TIME
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
            timed: list[KernelSpec] = []
            for candidate in runnable:
                spec = candidate.spec
                reason = _why_not(reg, op_id, plat, dtype, spec, (args, kwargs), loaded)
                if reason is None:
                    timed.append(spec)
                else:
                    skipped.append(BenchSkip(spec.label, dtype, shape.name, reason))
                    done += 1
                    if progress is not None:
                        progress(done, total, f"{op_id} {spec.label} {dtype} {shape.name}")
            measured = measure_interleaved(
                [loaded[spec] for spec in timed],  # type: ignore[misc]
                args,
                kwargs,
                warmup=warmup,
                repeats=repeats,
                max_time=max_time,
                device=device,
                mutates=declared.mutates,
            )
            reference_times: list[float] | None = None
            for spec, times in zip(timed, measured, strict=True):
                if spec.reference and isinstance(times, list):
                    reference_times = times
            for spec, times in zip(timed, measured, strict=True):
                done += 1
                if progress is not None:
                    progress(done, total, f"{op_id} {spec.label} {dtype} {shape.name}")
                if isinstance(times, str):
                    skipped.append(BenchSkip(spec.label, dtype, shape.name, times))
                    continue
                results.append(_result(op_id, spec, dtype, shape, times, reference_times))
            del args, kwargs
    return BenchReport(
        op_id,
        plat,
        None if reference is None else reference.label,
        tuple(results),
        tuple(skipped),
        warmup=warmup,
        repeats=repeats,
        max_time=max_time,
    )


def _result(
    op_id: str,
    spec: KernelSpec,
    dtype: str,
    shape: _Shape,
    times: list[float],
    reference_times: list[float] | None,
) -> BenchResult:
    """One timing, with its speed-up over the reference's times (when there are some)."""
    measurement = _measurement(times)
    low, high = median_interval(times)
    speedup: float | None = None
    speedup_interval: tuple[float, float] | None = None
    if spec.reference:
        speedup = 1.0
    elif reference_times is not None and measurement.median_ns > 0 and low > 0:
        ref_low, ref_high = median_interval(reference_times)
        speedup = statistics.median(reference_times) / measurement.median_ns
        speedup_interval = (ref_low / high, ref_high / low)
    return BenchResult(
        op_id,
        spec.label,
        dtype,
        shape.name,
        shape.dims,
        measurement,
        speedup,
        reference=spec.reference,
        interval=(low, high),
        speedup_interval=speedup_interval,
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
    """Write a PNG chart of ``reports``: the speed-up of each implementation over the
    reference (see :func:`plot_figure`).

    Needs matplotlib (``pip install 'kernreg[plot]'``); ``ImportError`` without it.
    """
    figure = plot_figure(reports)
    figure.savefig(path, format="png", dpi=110)


def plot_figure(reports: Sequence[BenchReport]) -> Any:
    """The ``matplotlib.figure.Figure`` :func:`plot_reports` writes (for tests and notebooks).

    One chart: a row per op, implementation and dtype (the reference is the line at 1x),
    a marker per shape at the speed-up over the reference, with its 95% interval as a
    bar; a hollow marker is not significant (its interval includes 1x). The speed-up axis
    is logarithmic, the legend (the shapes) sits under the chart, off the data.
    """
    import importlib

    # Imported by name: matplotlib is optional, and the Agg canvas needs no display.
    figure_module = importlib.import_module("matplotlib.figure")
    ticker = importlib.import_module("matplotlib.ticker")
    entries: list[tuple[str, str, str, list[BenchResult]]] = []
    for report in reports:
        groups: dict[tuple[str, str], list[BenchResult]] = {}
        for result in report.results:
            if not result.reference and result.speedup is not None:
                groups.setdefault((result.implementation, result.dtype), []).append(result)
        entries.extend((report.op, impl, dtype, rows) for (impl, dtype), rows in groups.items())
    shapes = list(dict.fromkeys(r.shape for *_, rows in entries for r in rows))
    figure = figure_module.Figure(
        figsize=(9.0, 1.9 + 0.3 * max(len(entries), 2)), layout="constrained"
    )
    ax = figure.subplots()
    figure.suptitle(_plot_title(reports), fontsize=10)
    if not entries:
        ax.set_axis_off()
        ax.text(
            0.5, 0.5, "nothing to compare: only the reference was timed", ha="center", va="center"
        )
        return figure
    markers = "osD^v<>ph*"
    step = 0.6 / max(len(shapes), 1)
    values: list[float] = [1.0]
    for k, shape in enumerate(shapes):
        color = f"C{k % 10}"
        offset = (k - (len(shapes) - 1) / 2) * step
        for significant in (True, False):
            xs, ys, below, above = [], [], [], []
            for row, (*_, rows) in enumerate(entries):
                for r in rows:
                    if r.shape != shape or r.significant != significant or r.speedup is None:
                        continue
                    low, high = r.speedup_interval or (r.speedup, r.speedup)
                    xs.append(r.speedup)
                    ys.append(row + offset)
                    below.append(max(r.speedup - low, 0.0))
                    above.append(max(high - r.speedup, 0.0))
                    values.extend((low, high))
            if not xs:
                continue
            ax.errorbar(
                xs,
                ys,
                xerr=[below, above],
                fmt=markers[k % len(markers)],
                color=color,
                markerfacecolor=color if significant else "white",
                capsize=2,
                markersize=5,
                linewidth=1,
            )
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    low = min(v for v in values if v > 0)
    high = max(values)
    ax.set_xlim(low / 1.3, high * 1.3)
    # Denser ticks on a narrower range; powers of ten beyond two decades: labels never
    # overlap (a log axis's own minor labels do when the range is under a decade).
    if high / low < 10:
        ticks: tuple[float, ...] = (0.1, 0.2, 0.5, 0.8, 1, 1.25, 2, 5, 10)
    elif high / low < 100:
        ticks = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)
    else:
        ticks = (0.0001, 0.001, 0.01, 0.1, 1, 10, 100, 1000, 10000)
    ax.xaxis.set_major_locator(
        ticker.FixedLocator([t for t in ticks if low / 1.3 <= t <= high * 1.3])
    )
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_yticks(
        range(len(entries)),
        [f"{op}  {display_label(impl, False)}  {dtype}" for op, impl, dtype, _ in entries],
        fontsize=8,
    )
    ax.set_ylim(len(entries) - 0.5, -0.5)  # the first op on top
    for row in range(1, len(entries)):
        if entries[row][0] != entries[row - 1][0]:
            ax.axhline(row - 0.5, color="0.8", linewidth=0.8)
    ax.grid(True, axis="x", alpha=0.3)
    alone = [r.op for r in reports if not any(e[0] == r.op for e in entries)]
    ax.set_xlabel(
        "speed-up over the reference (log scale; the reference is 1x)\n"
        "bars: 95% intervals; hollow markers: not significant (the interval includes 1x)"
        + (f"\nnothing to compare (only the reference ran): {', '.join(alone)}" if alone else ""),
        fontsize=8,
    )
    lines = importlib.import_module("matplotlib.lines")
    handles = [
        lines.Line2D(
            [],
            [],
            marker=markers[k % len(markers)],
            color=f"C{k % 10}",
            linestyle="none",
            label=f"shape {shape}",
        )
        for k, shape in enumerate(shapes)
    ]
    handles.append(
        lines.Line2D(
            [],
            [],
            marker="o",
            color="0.3",
            markerfacecolor="white",
            linestyle="none",
            label="not significant",
        )
    )
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    return figure


def _plot_title(reports: Sequence[BenchReport]) -> str:
    platforms = ", ".join(dict.fromkeys(str(r.platform) for r in reports)) or "no platform"
    timings = sum(len(r.results) for r in reports)
    calls = ", ".join(
        dict.fromkeys(f"{r.warmup} warm-up + at least {r.repeats} timed" for r in reports)
    )
    text = f"kernreg bench on {platforms}: {len(reports)} op(s), {timings} timing(s)"
    return text + (f", {calls} calls each, interleaved" if calls else "")

"""Recording which implementation each op call ran (:func:`trace`), and counting the
decisions op objects make (:func:`stats`, docs/fallbacks.md#counters).

While no trace is open, op objects run their cached targets directly: opening the first
trace has them take a route that records each call (decided again, so the trace counts
the decisions), closing the last puts the targets back. Compiled graphs never take it.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from kernreg._compile import run_while_tracing
from kernreg._fork import Lock
from kernreg._frozen import Frozen
from kernreg.dtypes import dtype_name
from kernreg.plan import write_atomically
from kernreg.selection import Decision

__all__ = ["CallRecord", "Stats", "Trace", "count", "count_decision", "stats", "trace"]


@dataclasses.dataclass(frozen=True, slots=True)
class CallRecord:
    """One dispatched call: the op, the implementation that ran, how it was chosen, the
    dtypes and shapes of the dispatch arguments, and the site (the module path of a
    kernelized layer; ``None`` for a direct op call). ``compiled`` marks a decision recorded
    once while torch.compile traced a graph (``shapes`` is empty: the graph may serve several).
    """

    op: str
    implementation: str
    rule: str
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...] | None, ...]
    site: str | None = None
    compiled: bool = False

    def replace(self, **changes: Any) -> CallRecord:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> dict[str, Any]:
        """JSON-ready form; ``site`` only for calls made by a kernelized layer, ``compiled``
        only for decisions recorded while a graph was traced."""
        described: dict[str, Any] = {
            "op": self.op,
            "implementation": self.implementation,
            "rule": self.rule,
            "dtypes": list(self.dtypes),
            "shapes": [None if s is None else list(s) for s in self.shapes],
        }
        if self.site is not None:
            described["site"] = self.site
        if self.compiled:
            described["compiled"] = True
        return described


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


class Trace:
    """The calls recorded while a :func:`trace` block was open (``keep_calls=False``: only
    the counts, for long runs)."""

    def __init__(self, *, keep_calls: bool = True) -> None:
        self.keep_calls = keep_calls
        self.calls: list[CallRecord] = []
        self.counts: Counter[tuple[str, str]] = Counter()
        #: The decisions counted while the trace was open (see :func:`stats`).
        self.decisions: Counter[tuple[str, str, str, str]] = Counter()
        self._lock = Lock()

    @property
    def stats(self) -> Stats:
        """The decisions counted while the trace was open, as :func:`stats` counts them."""
        return _snapshot(self.decisions)

    def record(self, call: CallRecord) -> None:
        with self._lock:
            self.counts[(call.op, call.implementation)] += 1
            if self.keep_calls:
                self.calls.append(call)

    def implementations(self, op: str) -> dict[str, int]:
        """How many calls of ``op`` each implementation served."""
        return {impl: n for (name, impl), n in sorted(self.counts.items()) if name == op}

    def summary(self) -> list[dict[str, Any]]:
        """Aggregated counts per (op, implementation), sorted."""
        counts = sorted(self.counts.items())
        return [{"op": op, "implementation": impl, "calls": n} for (op, impl), n in counts]

    def to_json(self, *, indent: int | None = 2) -> str:
        decisions = self.stats.to_dict()["counts"]
        calls = [c.describe() for c in self.calls]
        document = {"summary": self.summary(), "decisions": decisions, "calls": calls}
        return json.dumps(document, indent=indent, sort_keys=True)

    def export(self, path: str) -> None:
        write_atomically(path, self.to_json() + "\n")

    def __len__(self) -> int:
        return sum(self.counts.values())

    def __repr__(self) -> str:
        """``<Trace: 3 calls of 2 ops; layernorm.rmsnorm: aten x2; ...>``."""
        with self._lock:
            counts = sorted(self.counts.items())
        per_op: dict[str, list[str]] = {}
        for (op, impl), n in counts:
            per_op.setdefault(op, []).append(f"{impl} x{n}")
        total = sum(n for _, n in counts)
        text = f"<Trace: {_plural(total, 'call')} of {_plural(len(per_op), 'op')}"
        text += "".join(f"; {op}: {', '.join(impls)}" for op, impls in per_op.items())
        return text + ("" if self.keep_calls else " (counts only)") + ">"

    def __str__(self) -> str:
        """The summary as a small table: one line per op and implementation."""
        with self._lock:
            counts = sorted(self.counts.items())
        total = sum(n for _, n in counts)
        lines = [f"trace: {_plural(total, 'call')}" if counts else "trace: no calls recorded"]
        width = max((len(op) for (op, _), _ in counts), default=0)
        lines.extend(f"  {op:<{width}}  {impl}: {n}" for (op, impl), n in counts)
        decided = self.stats
        if decided.counts:
            lines.append(str(decided))
        return "\n".join(lines)


#: The fields of a row of :class:`Stats`, in order.
STATS_FIELDS = ("op", "rule", "implementation", "cause", "count")
STATS_FORMAT = "kernreg-stats"


class Stats(Frozen):
    """The decisions counted in a process (:func:`stats`): one row per op, rule (``when``: a
    choice by predicate, ``strict``: a fallback strict mode refused, ``demoted``: a demotion
    recorded), implementation and, for a fallback to the reference, why the best other
    candidate was rejected (``no eligible implementation``, ``denied``, ``dtype``,
    ``predicate false`` or ``demoted``). ``to_dict()`` is JSON, as ``save``/``load`` write it.
    """

    __slots__ = ("counts",)
    counts: tuple[tuple[str, str, str, str, int], ...]

    def __init__(self, counts: Iterable[Sequence[Any]] = ()) -> None:
        self._set("counts", tuple(sorted(tuple(row) for row in counts)))

    def to_dict(self) -> dict[str, Any]:
        rows = [dict(zip(STATS_FIELDS, row, strict=True)) for row in self.counts]
        return {"format": STATS_FORMAT, "version": 1, "counts": rows}

    @classmethod
    def from_dict(cls, data: Any) -> Stats:
        """The value :meth:`to_dict` described (``ValueError`` for anything else)."""
        rows = data.get("counts") if isinstance(data, dict) else None
        if not isinstance(rows, list) or data.get("format") != STATS_FORMAT:
            raise ValueError("not a kernreg stats snapshot (written by kernreg.stats().save())")
        if data.get("version") != 1:
            raise ValueError(f"kernreg stats snapshot version {data.get('version')!r}, not 1")
        kinds = (str, str, str, str, int)
        rows = [[row.get(f) for f in STATS_FIELDS] if isinstance(row, dict) else () for row in rows]
        for row in rows:
            if len(row) != 5 or not all(map(isinstance, row, kinds)) or isinstance(row[4], bool):
                raise ValueError(f"not a kernreg stats snapshot: a row is not {STATS_FIELDS}")
        return cls(rows)

    def save(self, path: str) -> str:
        """Write :meth:`to_dict` as JSON to ``path`` (``{pid}``: this process's id), atomically
        (a reader never sees half a file); return the path."""
        path = path.replace("{pid}", str(os.getpid()))
        write_atomically(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str) -> Stats:
        with open(path, encoding="utf-8") as handle:
            try:
                return cls.from_dict(json.load(handle))
            except ValueError as exc:  # JSONDecodeError included
                raise ValueError(f"{path}: {exc}") from None

    def __add__(self, other: Stats) -> Stats:
        """The counts of both (two processes' counters, say)."""
        total: Counter[tuple[Any, ...]] = Counter()
        for *key, n in (*self.counts, *other.counts):
            total[tuple(key)] += n
        return Stats((*key, n) for key, n in total.items())

    def __str__(self) -> str:
        if not self.counts:
            return "kernreg stats: no decisions counted"
        decisions = sum(row[4] for row in self.counts if row[1] != "demoted")
        fallbacks = sum(n for _, rule, _, cause, n in self.counts if rule == "reference" and cause)
        ops = len({row[0] for row in self.counts})
        counted = f"{_plural(decisions, 'decision')} of {_plural(ops, 'op')}"
        lines = [f"kernreg stats: {counted}, {_plural(fallbacks, 'fallback')} to the reference"]
        width = max(len(row[0]) for row in self.counts)
        for op, rule, impl, cause, n in self.counts:
            what = f"{impl} ({cause})" if cause else impl or "-"
            lines.append(f"  {op:<{width}}  {rule:<11} {what}: {n}")
        return "\n".join(lines)


class _State:
    """The open traces (a tuple, replaced, never mutated: readers need no lock), who hears
    when the first opens and the last closes, and the decision counters."""

    def __init__(self) -> None:
        self.lock = Lock()
        self.traces: tuple[Trace, ...] = ()
        self.listeners: list[Callable[[], None]] = []
        self.counts: Counter[tuple[str, str, str, str]] = Counter()
        #: Counted since last read: (pid, key or (decision, rule), the traces open then).
        #: (pid, what, traces, times) per count not yet added up
        self.pending: deque[tuple[int, tuple[Any, ...], tuple[Trace, ...], int]] = deque()
        self.exported: set[str] = set()
        self.pid = os.getpid()


_state = _State()


def active_traces() -> tuple[Trace, ...]:
    return _state.traces


def on_trace_change(listener: Callable[[], None]) -> None:
    """Have ``listener()`` called when tracing starts or stops."""
    _state.listeners.append(listener)


def record_call(
    op: str, implementation: str, rule: str, values: Sequence[Any], site: str | None = None
) -> None:
    """Record one call in every open trace (``values``: the call's dispatch arguments)."""
    dtypes = tuple(dtype_name(v.dtype) for v in values if getattr(v, "dtype", None) is not None)
    call = CallRecord(op, implementation, rule, dtypes, tuple(map(_shape, values)), site)
    for current in _state.traces:
        current.record(call)


def record_decision(
    op: str, implementation: str, rule: str, dtypes: Sequence[str], site: str | None = None
) -> None:
    """Record, in every open trace, a decision made while torch.compile traced a graph
    (``site``: the kernelized layer's module path)."""
    call = CallRecord(op, implementation, rule, tuple(dtypes), (), site, compiled=True)
    for current in _state.traces:
        current.record(call)


def _shape(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    try:
        return None if shape is None else tuple(int(n) for n in shape)
    except (TypeError, ValueError):
        return None


def _add_pending() -> None:
    """Count what was counted since the last read (a forked child: its own decisions only)."""
    with _state.lock:
        if _state.pid != os.getpid():
            _state.pid = os.getpid()
            _state.counts.clear()
        pending = _state.pending
        while pending:
            pid, what, traces, times = pending.popleft()
            if pid != _state.pid:
                continue
            if len(what) == 2:  # a fallback to the reference (count_decision): its cause now
                decision, rule = what
                what = (decision.op, rule, decision.chosen.label, _cause(decision))
            _state.counts[what] += times
            for current in traces:
                current.decisions[what] += times


def _snapshot(counts: Counter[tuple[str, str, str, str]]) -> Stats:
    _add_pending()
    with _state.lock:
        return Stats((*key, n) for key, n in counts.items())


def stats() -> Stats:
    """The decisions op objects have made in this process (docs/fallbacks.md#counters)."""
    return _snapshot(_state.counts)


# Counting appends to a deque (atomic, no lock) and the counts are added up when read: a
# decision costs about 0.5 us more, not 2 us (benchmarks/bench_sglang.py --startup).
_MAX_PENDING = 1024  # bounded where nobody reads the counters


@run_while_tracing  # while torch.compile traces: counted once, when the graph is traced
def count(op: str, rule: str, implementation: str, cause: str = "", times: int = 1) -> None:
    """Count a decision ``times`` times (in :func:`stats` and in every open trace)."""
    what = (op, rule, implementation, cause)
    _state.pending.append((os.getpid(), what, _state.traces, times))
    if len(_state.pending) > _MAX_PENDING:
        _add_pending()


def count_decision(decision: Decision, cause: str | None = None, times: int = 1) -> None:
    """Count ``decision`` (``times`` times) by its rule; a fallback to the reference by
    ``cause``, else by why the best other candidate was rejected (worked out when the
    counters are read)."""
    chosen = decision.chosen
    rule = "strict" if decision.strict_error else decision.rule
    if cause is None and decision.rule == "reference" and chosen is not None:
        _state.pending.append((os.getpid(), (decision, rule), _state.traces, times))
        if len(_state.pending) > _MAX_PENDING:
            _add_pending()
        return
    label = chosen.label if chosen is not None else ""
    count(decision.op, rule, label, cause or "", times)


def _cause(decision: Decision) -> str:
    """Why ``decision`` fell back to the reference (``""``: it is the only implementation)."""
    best = next((c for c in decision.candidates if not c.spec.reference), None)
    if best is None:
        return ""
    for prefix, cause in (("demoted", "demoted"), ("denied by", "denied")):
        if any(reason.startswith(prefix) for reason in best.reasons):
            return cause
    first = best.reasons[0] if best.reasons else ""
    if first.startswith("accepts only"):
        return "dtype"
    if first.startswith("when predicate is false"):
        return "predicate false"
    return "no eligible implementation"


def export_at_exit(path: str) -> None:
    """Have :func:`stats` saved to ``path`` at exit (``KERNREG_STATS_FILE``) unless nothing
    was counted (a relative path: from the working directory of the first decision)."""
    path = os.path.abspath(path)
    with _state.lock:
        if path in _state.exported:
            return
        _state.exported.add(path)
    owner, started = os.getpid(), time.time()

    def export() -> None:  # a process that decided nothing (a CLI command) writes nothing
        snapshot = stats()
        if not snapshot.counts or ("{pid}" not in path and os.getpid() != owner):
            return  # a forked child never writes over its parent's file
        try:
            if "{pid}" in path:
                snapshot.save(path)
                return
            # One file for several processes (the ranks of a job): each adds its counts to
            # those written since it started, one at a time; an older file is replaced.
            with _file_lock(path + ".lock"):
                with contextlib.suppress(OSError, ValueError):
                    if os.stat(path).st_mtime >= started:
                        snapshot += Stats.load(path)
                snapshot.save(path)
        except OSError as exc:
            sys.stderr.write(f"kernreg: cannot write KERNREG_STATS_FILE {path}: {exc}\n")

    atexit.register(export)
    if "{pid}" in path:
        # A multiprocessing child forked from here ends past atexit (os._exit), through
        # multiprocessing's own exit hook: each child exports from there.
        from multiprocessing import util

        util.register_after_fork(export, lambda _: util.Finalize(None, export, exitpriority=0))


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    """Hold the lock file ``path`` (waiting for another process holding it)."""
    if sys.platform == "win32":  # pragma: no cover - no fcntl
        yield
        return
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def trace(*, keep_calls: bool = True) -> Iterator[Trace]:
    """Record every op call made (in any thread) while the block is open."""
    current = Trace(keep_calls=keep_calls)
    with _state.lock:
        _state.traces = (*_state.traces, current)
        first = len(_state.traces) == 1
    if first:
        _notify()
    try:
        yield current
    finally:
        with _state.lock:
            _state.traces = tuple(t for t in _state.traces if t is not current)
            last = not _state.traces
        if last:
            _notify()


def _notify() -> None:
    for listener in _state.listeners:
        listener()

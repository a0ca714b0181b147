"""Recording which implementation each op call ran: ``with kernreg.trace() as t: ...``.

While no trace is open, op objects run their cached targets directly: tracing costs
nothing. Opening the first trace re-resolves every op with a recording wrapper;
closing the last one resolves them back. Graphs torch.compile traces while a trace is
open record each decision once, when traced (``CallRecord.compiled``).
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kernreg._fork import Lock
from kernreg._frozen import Frozen
from kernreg.dtypes import dtype_name

__all__ = ["CallRecord", "Trace", "trace"]


class CallRecord(Frozen):
    """One dispatched call: the op, the implementation that ran, how it was chosen, the
    dtypes and shapes of the dispatch arguments, and the site (the module path of a
    kernelized layer; ``None`` for a direct op call).

    ``compiled`` marks a decision made while torch.compile traced a graph: recorded once,
    when the graph was traced, and run by every later call of that graph (``shapes`` is
    empty: the graph may serve several).
    """

    __slots__ = ("op", "implementation", "rule", "dtypes", "shapes", "site", "compiled")
    op: str
    implementation: str
    rule: str
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...] | None, ...]
    site: str | None
    compiled: bool

    def __init__(
        self,
        op: str,
        implementation: str,
        rule: str,
        dtypes: tuple[str, ...],
        shapes: tuple[tuple[int, ...] | None, ...],
        site: str | None = None,
        compiled: bool = False,
    ) -> None:
        self._set("op", op)
        self._set("implementation", implementation)
        self._set("rule", rule)
        self._set("dtypes", dtypes)
        self._set("shapes", shapes)
        self._set("site", site)
        self._set("compiled", compiled)

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


class Trace:
    """The calls recorded while a :func:`trace` block was open.

    ``keep_calls=False`` keeps only the counts, for long runs.
    """

    def __init__(self, *, keep_calls: bool = True) -> None:
        self.keep_calls = keep_calls
        self.calls: list[CallRecord] = []
        self.counts: Counter[tuple[str, str]] = Counter()
        self._lock = Lock()

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
        return [
            {"op": op, "implementation": impl, "calls": n}
            for (op, impl), n in sorted(self.counts.items())
        ]

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(
            {"summary": self.summary(), "calls": [c.describe() for c in self.calls]},
            indent=indent,
            sort_keys=True,
        )

    def export(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(self.to_json())
            handle.write("\n")

    def __len__(self) -> int:
        return sum(self.counts.values())

    def __repr__(self) -> str:
        """``<Trace: 3 calls of 2 ops; layernorm.rmsnorm: aten x2; ...>``."""
        with self._lock:
            counts = sorted(self.counts.items())
        ops = {op for (op, _), _ in counts}
        total = sum(n for _, n in counts)
        text = f"<Trace: {total} call{'' if total == 1 else 's'} of {len(ops)} op"
        text += "" if len(ops) == 1 else "s"
        per_op: dict[str, list[str]] = {}
        for (op, impl), n in counts:
            per_op.setdefault(op, []).append(f"{impl} x{n}")
        if per_op:
            text += "; " + "; ".join(f"{op}: {', '.join(v)}" for op, v in per_op.items())
        if not self.keep_calls:
            text += " (counts only)"
        return text + ">"

    def __str__(self) -> str:
        """The summary as a small table: one line per op and implementation."""
        with self._lock:
            counts = sorted(self.counts.items())
        if not counts:
            return "trace: no calls recorded"
        total = sum(n for _, n in counts)
        width = max(len(op) for (op, _), _ in counts)
        lines = [f"trace: {total} call{'' if total == 1 else 's'}"]
        lines.extend(f"  {op:<{width}}  {impl}: {n}" for (op, impl), n in counts)
        return "\n".join(lines)


class _Traces:
    """The open traces (a tuple, replaced and never mutated, so readers need no lock) and
    who hears when the first opens and the last closes: op objects resolve again, and
    bindings made outside op objects (kernelized layers) record calls too."""

    def __init__(self) -> None:
        self.lock = Lock()
        self.active: tuple[Trace, ...] = ()
        self.listeners: list[Callable[[], None]] = []


_traces = _Traces()


def active_traces() -> tuple[Trace, ...]:
    return _traces.active


def on_trace_change(listener: Callable[[], None]) -> None:
    """Have ``listener()`` called when tracing starts or stops."""
    _traces.listeners.append(listener)


def record_call(
    op: str, implementation: str, rule: str, values: Sequence[Any], site: str | None = None
) -> None:
    """Record one call in every open trace (``values``: the call's dispatch arguments)."""
    dtypes = tuple(dtype_name(v.dtype) for v in values if getattr(v, "dtype", None) is not None)
    shapes = tuple(_shape(v) for v in values)
    call = CallRecord(op, implementation, rule, dtypes, shapes, site)
    for current in _traces.active:
        current.record(call)


def record_decision(op: str, implementation: str, rule: str, dtypes: Sequence[str]) -> None:
    """Record, in every open trace, a decision made while torch.compile traced a graph."""
    call = CallRecord(op, implementation, rule, tuple(dtypes), (), compiled=True)
    for current in _traces.active:
        current.record(call)


def _shape(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    if shape is None:
        return None
    try:
        return tuple(int(n) for n in shape)
    except (TypeError, ValueError):
        return None


@contextlib.contextmanager
def trace(*, keep_calls: bool = True) -> Iterator[Trace]:
    """Record every op call made (in any thread) while the block is open."""
    current = Trace(keep_calls=keep_calls)
    with _traces.lock:
        _traces.active = (*_traces.active, current)
        first = len(_traces.active) == 1
    if first:
        _notify()
    try:
        yield current
    finally:
        with _traces.lock:
            _traces.active = tuple(t for t in _traces.active if t is not current)
            last = not _traces.active
        if last:
            _notify()


def _notify() -> None:
    for listener in _traces.listeners:
        listener()

"""How long an implementation took (:class:`Measurement`), and who measures: the
:class:`Measurer` the torch layer registers (the core never imports it)."""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Mapping, Sequence
from contextlib import suppress
from typing import Any, Protocol

from kernreg._frozen import Frozen
from kernreg.errors import KernregError

__all__ = [
    "MAX_REPEATS",
    "MEASURER_GROUP",
    "Measurement",
    "Measurer",
    "TuningDataError",
    "measurer",
    "short_repr",
    "use_measurer",
]


class TuningDataError(KernregError, ValueError):
    """Input to :meth:`TuningStore.import_json` (or a measurement to store) is malformed."""


#: The most repeats a measurement can report (no real benchmark comes near it).
MAX_REPEATS = 2**53


class Measurement(Frozen):
    """How long one implementation took on one input: median and spread over ``repeats`` runs."""

    __slots__ = ("median_ns", "spread_ns", "repeats")
    median_ns: float
    spread_ns: float
    repeats: int

    def __init__(self, median_ns: float, spread_ns: float, repeats: int) -> None:
        self._set("median_ns", _duration("median_ns", median_ns))
        self._set("spread_ns", _duration("spread_ns", spread_ns))
        self._set("repeats", _count("repeats", repeats))

    def describe(self) -> dict[str, float | int]:
        return {"median_ns": self.median_ns, "spread_ns": self.spread_ns, "repeats": self.repeats}


def _duration(name: str, value: object) -> float:
    """A duration in nanoseconds: a finite number, not negative, or ``TuningDataError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TuningDataError(f"Measurement.{name}: expected a number, got {short_repr(value)}")
    try:
        number = float(value)
    except OverflowError:
        raise TuningDataError(f"Measurement.{name}: {short_repr(value)} is too large") from None
    if not math.isfinite(number) or number < 0:
        wanted = "expected a finite, non-negative number"
        raise TuningDataError(f"Measurement.{name}: {wanted}, got {number!r}")
    return number


def _count(name: str, value: object) -> int:
    """A repeat count: a whole number from 0 to :data:`MAX_REPEATS`, or ``TuningDataError``."""
    try:
        number = _duration(name, value)
    except TuningDataError:
        number = math.nan
    if not (number.is_integer() and number <= MAX_REPEATS):
        raise TuningDataError(f"Measurement.{name}: expected a count, got {short_repr(value)}")
    return int(number)


def short_repr(value: object) -> str:
    """``repr(value)`` cut to a readable length (also for integers too long to print)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    return reprlib.repr(value)


class Measurer(Protocol):
    """Times the candidate implementations of a call: ``{label: Measurement}`` (empty when
    nothing could be measured)."""

    def __call__(
        self,
        op_id: str,
        candidates: Sequence[Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        /,
        *,
        params: Sequence[str],
    ) -> Mapping[str, Measurement]: ...


#: Entry-point group naming the measurer to load when none was registered.
MEASURER_GROUP = "kernreg.measurers"

#: The measurer, once registered or looked up (empty: look it up on first use).
_measurer: list[Measurer | None] = []


def use_measurer(measurer: Measurer | None) -> None:
    """Measure with ``measurer`` from now on (``None``: load one from :data:`MEASURER_GROUP`)."""
    _measurer[:] = [] if measurer is None else [measurer]


def measurer() -> Measurer | None:
    """The registered measurer, else the first (by name) of the :data:`MEASURER_GROUP` entry
    points that loads, else ``None`` (priority decides then)."""
    if not _measurer:
        from importlib.metadata import entry_points

        found: Measurer | None = None
        for point in sorted(entry_points(group=MEASURER_GROUP), key=lambda p: p.name):
            with suppress(ImportError):  # its layer's dependencies are missing (no torch)
                found = point.load()
                break
        if not _measurer:  # loading it may have registered one already
            _measurer.append(found)
    return _measurer[0]

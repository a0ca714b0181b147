"""How long an implementation took (:class:`Measurement`), and who measures: the
:class:`Measurer` the torch layer registers (the core never imports it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kernreg._frozen import Frozen

__all__ = ["MEASURER_GROUP", "Measurement", "Measurer", "measurer", "use_measurer"]


class Measurement(Frozen):
    """How long one implementation took on one input: median and spread over ``repeats`` runs."""

    __slots__ = ("median_ns", "spread_ns", "repeats")
    median_ns: float
    spread_ns: float
    repeats: int

    def __init__(self, median_ns: float, spread_ns: float, repeats: int) -> None:
        self._set("median_ns", float(median_ns))
        self._set("spread_ns", float(spread_ns))
        self._set("repeats", int(repeats))

    def describe(self) -> dict[str, float | int]:
        return {"median_ns": self.median_ns, "spread_ns": self.spread_ns, "repeats": self.repeats}


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

_measurer: list[Measurer | None] = [None]
_looked_up: list[bool] = [False]


def use_measurer(measurer: Measurer | None) -> None:
    """Measure with ``measurer`` from now on (``None``: load one from :data:`MEASURER_GROUP`)."""
    _measurer[0] = measurer
    _looked_up[0] = measurer is not None


def measurer() -> Measurer | None:
    """The registered measurer; else the first of the ``kernreg.measurers`` entry points
    (by name) that loads; ``None`` when there is none (priority decides then)."""
    if _measurer[0] is None and not _looked_up[0]:
        _looked_up[0] = True
        from importlib.metadata import entry_points

        for point in sorted(entry_points(group=MEASURER_GROUP), key=lambda p: p.name):
            try:
                loaded = point.load()
            except ImportError:  # its layer's dependencies are missing (no torch)
                continue
            if _measurer[0] is None:  # loading it may have registered one already
                _measurer[0] = loaded
            break
    return _measurer[0]

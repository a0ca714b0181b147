"""Measured speed of implementations, and the persistent store the autotune policy reads.

Nothing here imports torch: measurements are plain numbers, produced by the torch layer
(:mod:`kernreg.torch.bench`) and kept in an embedded SQLite database.
"""

from __future__ import annotations

from kernreg._frozen import Frozen

__all__ = ["Measurement"]


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

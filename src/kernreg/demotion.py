"""Sticky demotion's table (docs/fallbacks.md#sticky-demotion): which implementation raised
for which op, platform, dtypes and shape bucket, and the reasons a decision gives for it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from fnmatch import fnmatchcase

from kernreg._fork import Lock
from kernreg.autotune import implementations_key, platform_key
from kernreg.platform import Platform
from kernreg.spec import KernelSpec
from kernreg.tuning import Demotion, TuningStore

__all__ = ["DemotionTable"]


def _key(demotion: Demotion) -> tuple[object, ...]:
    return (demotion.where, demotion.implementation, demotion.bucket)


def _order(demotion: Demotion) -> tuple[object, ...]:
    return (demotion.where, demotion.bucket, demotion.implementation)


class DemotionTable:
    """The demotions of one registry. ``store()`` gives the tuning store to read, or
    ``None`` where none exists yet (reading never creates one)."""

    def __init__(self, store: Callable[[], TuningStore | None]) -> None:
        self._lock = Lock()
        self._store = store
        self._table: dict[tuple[object, ...], Demotion] = {}
        self._read = False

    def _read_store(self) -> None:
        self._read = True
        store = self._store()
        for demotion in store.demotions() if store is not None else ():
            with self._lock:
                self._table.setdefault(_key(demotion), demotion)

    def add(self, demotion: Demotion) -> bool:
        """Record ``demotion``; ``False`` when another thread recorded it first."""
        with self._lock:
            if _key(demotion) in self._table:
                return False
            self._table[_key(demotion)] = demotion
            return True

    def here(
        self, op: str, platform: Platform, dtypes: tuple[str, ...] | None
    ) -> dict[str, dict[str, Demotion]]:
        """The demotions of ``op`` here (those for any dtype too), by implementation, bucket."""
        if not self._read:
            self._read_store()
        plat = platform_key(platform)
        here: dict[str, dict[str, Demotion]] = {}
        for exact in ((), dtypes or ()):  # the call's own dtypes last: their demotions win
            for demotion in self._table.copy().values():
                if demotion.where == (op, plat, exact):
                    here.setdefault(demotion.implementation, {})[demotion.bucket] = demotion
        return here

    def reasons(
        self,
        op: str,
        platform: Platform,
        dtypes: tuple[str, ...] | None,
        specs: Iterable[KernelSpec],
        bucket: str | None,
        hint: str,
    ) -> dict[str, str] | None:
        """Why each demoted implementation is rejected (in ``bucket``) or noted (in other
        buckets), by label, ending with ``hint`` (how to clear it); ``None`` when there are
        none."""
        here = self.here(op, platform, dtypes)
        if not here:  # the quick path of a first decision stays open (selection.decide)
            return None
        reasons = {}
        for spec in specs:
            found = here.get(implementations_key((spec,)), {})
            if bucket in found:
                reasons[spec.label] = f"demoted: raised {found[bucket].error}; {hint}"
            elif found:
                each = "; ".join(f"{b} (raised {d.error})" for b, d in sorted(found.items()))
                reasons[spec.label] = f"is demoted in shape bucket {each}; {hint}"
        return reasons or None

    def matching(self, pattern: str) -> tuple[Demotion, ...]:
        """The demotions of ops matching ``pattern`` (an op id or glob), the store's included."""
        self._read_store()
        with self._lock:
            found = [d for d in self._table.values() if fnmatchcase(d.op, pattern)]
        return tuple(sorted(found, key=_order))

    def clear(self, pattern: str, also: Iterable[Demotion] = ()) -> tuple[Demotion, ...]:
        """Forget the demotions of ops matching ``pattern``; return them and ``also``."""
        gone = {*self.matching(pattern), *also}
        with self._lock:
            self._table = {k: d for k, d in self._table.items() if not fnmatchcase(d.op, pattern)}
        return tuple(sorted(gone, key=_order))

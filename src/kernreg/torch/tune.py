"""Measuring candidates for the autotune policy (:mod:`kernreg.autotune`), on real inputs.

:func:`measure` times each candidate on the arguments of the call being decided (the
first call of a shape bucket) or on generated inputs (``kernreg tune``). Arguments an
op writes in place (declared by its input spec, or every tensor argument of an
``inplace`` implementation) are cloned before each timed call, so measuring never
changes the caller's tensors. :data:`counter` counts the measurements this process made:
a warm tuning store means zero.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from kernreg.spec import KernelSpec
from kernreg.torch._inputs import input_spec
from kernreg.torch.bench import time_callable
from kernreg.tuning import Measurement

__all__ = ["AUTOTUNE_REPEATS", "AUTOTUNE_WARMUP", "counter", "measure"]

AUTOTUNE_WARMUP = 3
AUTOTUNE_REPEATS = 15


class _Counter:
    """How many candidates this process has measured (a warm store keeps this at zero)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n


counter = _Counter()


def _mutated(op: str, spec: KernelSpec, params: Sequence[str]) -> tuple[str, ...]:
    declared = input_spec(op)
    if declared is not None and declared.mutates:
        return declared.mutates
    if "inplace" in spec.traits:
        return tuple(params)
    return ()


def measure(
    op: str,
    candidates: Sequence[KernelSpec],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    params: Sequence[str] = (),
    warmup: int = AUTOTUNE_WARMUP,
    repeats: int = AUTOTUNE_REPEATS,
) -> dict[str, Measurement]:
    """Time every candidate on ``args``/``kwargs``; label -> Measurement.

    ``params`` are the op's parameter names (for in-place implementations without an
    input spec, all are cloned). A candidate that raises is left out: it cannot win.
    """
    results: dict[str, Measurement] = {}
    for spec in candidates:
        impl = spec.load()
        try:
            results[spec.label] = time_callable(
                impl,
                args,
                kwargs,
                warmup=warmup,
                repeats=repeats,
                mutates=_mutated(op, spec, params),
            )
        except Exception:  # a candidate failing on these inputs is not a candidate for them
            continue
        finally:
            counter.add(1)
    return results

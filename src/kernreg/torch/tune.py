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

from kernreg._frozen import Frozen
from kernreg.measurement import Measurement
from kernreg.registry import KernelRegistry
from kernreg.spec import KernelSpec
from kernreg.torch._inputs import input_spec
from kernreg.torch.bench import time_callable

__all__ = ["AUTOTUNE_REPEATS", "AUTOTUNE_WARMUP", "TuneRow", "counter", "measure", "tune_op"]

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


class TuneRow(Frozen):
    """One tuned call signature: what was chosen for it, and whether it was measured now."""

    __slots__ = ("op", "dtype", "shape", "bucket", "chosen", "rule", "measured_now", "results")
    op: str
    dtype: str
    shape: str
    bucket: str
    chosen: str | None
    rule: str
    measured_now: bool
    results: dict[str, Measurement]

    def __init__(
        self,
        op: str,
        dtype: str,
        shape: str,
        bucket: str,
        chosen: str | None,
        rule: str,
        measured_now: bool,
        results: dict[str, Measurement],
    ) -> None:
        for name, value in zip(
            self._fields,
            (op, dtype, shape, bucket, chosen, rule, measured_now, results),
            strict=True,
        ):
            self._set(name, value)

    def __hash__(self) -> int:
        return hash((self.op, self.dtype, self.shape, self.bucket))

    def describe(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "dtype": self.dtype,
            "shape": self.shape,
            "bucket": self.bucket,
            "chosen": self.chosen,
            "rule": self.rule,
            "measured_now": self.measured_now,
            "results": {label: m.describe() for label, m in sorted(self.results.items())},
        }


def tune_op(
    op: str,
    *,
    shapes: Sequence[str] | None = None,
    dtypes: Sequence[str] | None = None,
    registry: KernelRegistry | None = None,
    quick: bool = False,
) -> list[TuneRow]:
    """Fill the tuning store for ``op`` ahead of time, on its generator's named shapes.

    Each (dtype, shape) is bucketed as an op object would bucket the call, decided under
    the autotune policy, and measured only when the store has no result for it yet.
    """
    import inspect

    from kernreg.autotune import shape_bucket
    from kernreg.dtypes import normalize_dtype
    from kernreg.registry import default_registry
    from kernreg.torch.bench import BenchError, choose_shapes
    from kernreg.torch.parity import torch_device, torch_dtype

    reg = default_registry() if registry is None else registry
    reg.explain(op)  # loads plugins; an unknown op raises OpNotFoundError
    declared = input_spec(op)
    reference = reg.reference(op)
    if declared is None or reference is None:
        raise BenchError(f"op '{op}' needs an input generator and a reference to be tuned")
    signature = inspect.signature(reference.load())
    params = list(signature.parameters)
    # Bucketed on what the op's op object dispatches on (its first parameter by default).
    dispatch = declared.dispatch_args or tuple(params[:1])
    plat = reg.platform
    device = torch_device(plat)
    generate = declared.load()
    names = tuple(normalize_dtype(d) for d in dtypes) if dtypes else declared.dtypes
    rows = []
    for dtype in names:
        for shape in choose_shapes(op, shapes, quick):
            args, kwargs = generate(torch_dtype(dtype), device, shape.seed, **shape.dims)
            bound = signature.bind(*args, **kwargs)
            bucket = shape_bucket(dispatch, [bound.arguments[name] for name in dispatch])
            decision = reg.explain(op, dtypes=(dtype,), bucket=bucket, autotune=True)
            measured_now = bool(decision.tuning)
            if measured_now:
                results = measure(op, decision.tuning, args, kwargs, params=params)
                if results:
                    reg.record_measurements(op, plat, (dtype,), bucket, results)
                decision = reg.explain(op, dtypes=(dtype,), bucket=bucket, autotune=True)
            stored = reg.measurements(op, plat, (dtype,), bucket) or {}
            chosen = decision.chosen.label if decision.ok and decision.chosen else None
            rows.append(
                TuneRow(op, dtype, shape.name, bucket, chosen, decision.rule, measured_now, stored)
            )
    return rows

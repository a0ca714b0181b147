"""What hostile or large inputs cost: refusing over-size lock files, and the memory a
registered spec retains.

* **Refusing a lock file**: ``SelectionPlan.load`` of a file over ``MAX_PLAN_BYTES`` (a
  valid plan of too many rows, and a 1,000,000-entry file) raises ``PlanError`` from the
  file's size, before parsing; best of several loads (wall clock, ``perf_counter``).
  tests/test_plan.py checks that both are refused.
* **Bytes per registered spec**: ``tracemalloc``'s traced memory before and after
  registering 4 specs for each of 2,500 ops into a fresh registry (after one warm-up
  registration: the modules imported, the shared fields built), divided by the spec count.
  Measured at 92 bytes (64 the spec, 18 its share of the op's tuple, the rest the op's
  entry in the inventory); a dict per op and all 13 fields per spec retained over 200.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
import time
import tracemalloc
from typing import Any

from bench_core import _record
from kernreg import KernelRegistry, KernelSpec, Platform, Requirement
from kernreg.config import Config
from kernreg.plan import MAX_PLAN_BYTES, PlanError, SelectionPlan

OVERSIZE_BUDGET_S = 5.0
MILLION_BUDGET_S = 1.0


def _oversized_plan(path: str) -> None:
    row = '["layernorm.rmsnorm", "cpu", null, "torch", "", "reference", "t", "", "", null]'
    count = MAX_PLAN_BYTES // len(row) + 1
    with open(path, "w") as handle:
        handle.write('{"kernreg_plan": 1, "entries": [')
        handle.write(", ".join([row] * count))
        handle.write("]}")


def _million_entry_plan(path: str) -> None:
    fields = ["op", "platform", "dtypes", "backend", "variant", "rule", "target"]
    fields += ["distribution", "version", "bucket"]
    row = json.dumps(["norm.rms", "cpu", None, "fast", "", "priority", "m:f", None, None, None])
    with open(path, "w") as handle:
        handle.write(f'{{"kernreg_plan": 1, "fields": {json.dumps(fields)}, "entries": [')
        handle.write(",".join([row] * 1_000_000))
        handle.write("]}")


def _names(ops: int) -> list[tuple[str, list[str]]]:
    backends = ("torch", "triton", "aot", "jit")
    return [(f"storage.op_{i}", [f"kernels.{b}_ops:op_{i}" for b in backends]) for i in range(ops)]


def _four_backend_specs(names: list[tuple[str, list[str]]]) -> list[KernelSpec]:
    """A reference and three restricted implementations per op, as a plugin registers them."""
    cuda = (Requirement.parse("cuda"),)
    hopper = (Requirement.parse("cuda>=9.0"),)
    either = (Requirement.parse("cuda"), Requirement.parse("rocm"))
    specs = []
    for op, (t0, t1, t2, t3) in names:
        specs.append(KernelSpec(op, "torch", t0, reference=True))
        specs.append(KernelSpec(op, "triton", t1, requires=cuda))
        specs.append(KernelSpec(op, "aot", t2, requires=hopper, priority=2))
        specs.append(KernelSpec(op, "jit", t3, requires=either, priority=1))
    return specs


def _bytes_per_spec(ops: int) -> float:
    # The names exist before, as they do in a plugin's module: only what registering
    # creates and keeps is counted.
    names = _names(ops)
    warm = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    for spec in _four_backend_specs(names[:1]):
        warm.register(spec)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
        for spec in _four_backend_specs(names):
            registry.register(spec)
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(registry) == 4 * ops
    return retained / (4 * ops)


def _refusal_seconds(path: str, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            SelectionPlan.load(path)
        except PlanError as exc:
            if "more than" not in str(exc):
                raise
        else:
            raise AssertionError(f"{path} was not refused")
        best = min(best, time.perf_counter() - start)
    return best


def run(quick: bool = False) -> list[dict[str, Any]]:
    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory() as tmp:
        oversized = os.path.join(tmp, "oversized.lock")
        _oversized_plan(oversized)
        oversized_s = _refusal_seconds(oversized, repeats)
        os.remove(oversized)
        million = os.path.join(tmp, "million.lock")
        _million_entry_plan(million)
        million_s = _refusal_seconds(million, repeats)
    per_spec = _bytes_per_spec(500 if quick else 2_500)
    return [
        _record(
            f"refuse a lock file over {MAX_PLAN_BYTES:,} bytes",
            oversized_s,
            "s",
            budget=f"< {OVERSIZE_BUDGET_S:g} s",
            limit=OVERSIZE_BUDGET_S,
            inclusive=False,
        ),
        _record(
            "refuse a 1,000,000-entry lock file",
            million_s,
            "s",
            budget=f"< {MILLION_BUDGET_S:g} s",
            limit=MILLION_BUDGET_S,
            inclusive=False,
        ),
        _record(
            "memory retained per registered spec",
            per_spec,
            "B",
            note="tracemalloc, 4 specs per op into a fresh registry; the budget is the "
            "sglang row (retained memory per spec, at most 1.5x)",
        ),
    ]

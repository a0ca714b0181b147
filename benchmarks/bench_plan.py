"""Selection plans: loading a 10,000-entry plan, and what following a plan costs per call.

* **Load**: ``SelectionPlan.load`` of a plan written by ``SelectionPlan.save`` with
  10,000 entries; median of several loads (wall clock, ``perf_counter``).
* **Per call**: the same gated op object called with and without a loaded plan, by the
  interleaved best-loop method of ``bench_core`` (empty loop subtracted). A plan is
  consulted when a decision is made, so a call under a plan costs what any cached call
  costs.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import kernreg
from bench_core import _record, per_call_ns
from kernreg import KernelRegistry, Platform
from kernreg.config import Config
from kernreg.plan import PlanEntry, SelectionPlan

PLAN_ENTRIES = 10_000
LOAD_BUDGET_MS = 100.0


class _Tensor:
    __slots__ = ("device", "dtype")

    def __init__(self, dtype: str, device: str) -> None:
        self.dtype = dtype
        self.device = device


def _big_plan() -> SelectionPlan:
    entries = [
        PlanEntry(
            f"group{i // 4}.op{i % 4}",
            "cuda:9.0",
            ("bfloat16",),
            "triton",
            "",
            "priority",
            f"vendor.kernels{i % 7}:op{i}",
            "vendor-kernels",
            "1.0",
        )
        for i in range(PLAN_ENTRIES)
    ]
    return SelectionPlan(entries)


def _gated_op(registry: KernelRegistry) -> Any:
    @kernreg.op("bench.plan", registry=registry)
    def reference(x: Any) -> Any:
        return x

    reference.register("fast", lambda x: x, requires=["cpu"], dtypes=["float32"], priority=5)
    return reference


def run(quick: bool = False) -> list[dict[str, Any]]:
    loads = 5 if quick else 15
    plan = _big_plan()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernreg.lock")
        plan.save(path)
        size_kib = os.path.getsize(path) / 1024
        times = []
        for _ in range(loads):
            start = time.perf_counter()
            loaded = SelectionPlan.load(path)
            times.append((time.perf_counter() - start) * 1e3)
        assert len(loaded) == PLAN_ENTRIES
    load_ms = statistics.median(times)

    free = KernelRegistry(config=Config(), platform=Platform("cpu"))
    planned = KernelRegistry(config=Config(), platform=Platform("cpu"))
    planned.use_plan(
        SelectionPlan([PlanEntry("bench.plan", "cpu", ("float32",), "fast", "", "priority", "x:y")])
    )
    namespace = {
        "free": _gated_op(free),
        "planned": _gated_op(planned),
        "x": _Tensor("float32", "cpu"),
    }
    assert planned.explain("bench.plan", dtypes=["float32"]).rule == "plan"
    number, rounds = (20_000, 3) if quick else (200_000, 7)
    calls = per_call_ns(
        {"free": "free(x)", "planned": "planned(x)"}, namespace, number=number, rounds=rounds
    )
    return [
        _record(
            f"load a selection plan of {PLAN_ENTRIES:,} entries",
            load_ms,
            "ms",
            budget=f"< {LOAD_BUDGET_MS:g} ms",
            limit=LOAD_BUDGET_MS,
            inclusive=False,
            note=f"median of {loads} loads of a {size_kib:,.0f} KiB file",
        ),
        _record(
            "gated op call following a plan",
            calls["planned"],
            "ns/call",
            baseline=f"same call without a plan = {calls['free']:.1f} ns",
            baseline_value=calls["free"],
            note="a plan is read when a decision is made; calls use the same cached path",
        ),
    ]

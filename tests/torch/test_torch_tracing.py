"""kernreg.trace() with torch tensors: dtypes and shapes as torch names them, JSON export."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import CodeType
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import kernreg  # noqa: E402
from kernreg import KernelRegistry  # noqa: E402


def _op(registry: KernelRegistry) -> Any:
    @kernreg.op("demo.norm", registry=registry)
    def norm(x: Any, weight: Any) -> Any:
        return x * weight

    @norm.register("half_only", dtypes=["float16", "bfloat16"], priority=5)
    def half_only(x: Any, weight: Any) -> Any:
        return x * weight

    return norm


def test_trace_records_torch_dtypes_and_shapes(
    cpu_registry: KernelRegistry, tmp_path: Path
) -> None:
    norm = _op(cpu_registry)
    with kernreg.trace() as trace:
        norm(torch.ones(2, 3), torch.ones(3))
        norm(torch.ones(4, 5, dtype=torch.bfloat16), torch.ones(5, dtype=torch.bfloat16))
    first, second = trace.calls
    assert (first.implementation, first.rule, first.dtypes, first.shapes) == (
        "torch",
        "reference",
        ("float32",),
        ((2, 3),),
    )
    assert (second.implementation, second.rule, second.dtypes, second.shapes) == (
        "half_only",
        "priority",
        ("bfloat16",),
        ((4, 5),),
    )
    assert trace.implementations("demo.norm") == {"half_only": 1, "torch": 1}
    path = tmp_path / "trace.json"
    trace.export(str(path))
    exported = json.loads(path.read_text())
    assert exported["calls"][1] == {
        "op": "demo.norm",
        "implementation": "half_only",
        "rule": "priority",
        "dtypes": ["bfloat16"],
        "shapes": [[4, 5]],
    }
    assert exported["summary"] == [
        {"op": "demo.norm", "implementation": "half_only", "calls": 1},
        {"op": "demo.norm", "implementation": "torch", "calls": 1},
    ]


def test_tracing_off_leaves_the_implementation_itself_in_the_call_path(
    cpu_registry: KernelRegistry,
) -> None:
    callers: list[CodeType] = []

    @kernreg.op("demo.static", registry=cpu_registry)
    def static(x: Any) -> Any:
        callers.append(sys._getframe(1).f_code)
        return x + 1

    static(torch.ones(1))
    static(torch.ones(1))
    assert callers[-1] is static.__code__  # the op object calls the reference itself
    with kernreg.trace() as trace:
        static(torch.ones(1))
        assert callers[-1] is not static.__code__  # wrapped to record the call
    assert len(trace) == 1
    static(torch.ones(1))
    static(torch.ones(1))
    assert callers[-1] is static.__code__

"""Call tracing: what ran, how it was chosen, and nothing left behind after the block."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

import kernreg
from _support import recording_impl
from kernreg import KernelRegistry, trace
from kernreg.tracing import CallRecord

RMS = "layernorm.rmsnorm"


class Tensor:
    def __init__(self, dtype: str, shape: Any) -> None:
        self.dtype = dtype
        self.shape = shape
        self.device = "cuda:0"


def fast(x: Any, y: Any = None) -> str:
    return "fast"


def bf16_only(x: Any, y: Any = None) -> str:
    return "bf16"


def big(x: Any, y: Any = None) -> str:
    return "big"


@pytest.fixture
def ops(registry: KernelRegistry) -> tuple[Any, Any]:
    @kernreg.op(RMS, registry=registry, dispatch_args=("x", "y"))
    def rms(x: Any, y: Any = None) -> str:
        return "ref"

    rms.register("triton", bf16_only, dtypes=["bf16"])

    @kernreg.op("activation.silu", registry=registry)
    def silu(x: Any, y: Any = None) -> str:
        return "ref"

    silu.register("triton", fast)
    silu.register("big", big, when=lambda x, y=None: x == "big", priority=5)
    return rms, silu


def test_trace_records_calls(ops: tuple[Any, Any]) -> None:
    rms, silu = ops
    a, b = Tensor("bfloat16", (4, 8)), Tensor("float32", [2])
    with trace() as t:
        assert rms(a, a) == "bf16"
        assert rms(b, a) == "ref"
        assert rms(a, y=a) == "bf16"
        assert silu(1) == "fast"
        assert silu("big") == "big"
        assert silu(2) == "fast"
    assert t.calls == [
        CallRecord(RMS, "triton", "priority", ("bfloat16", "bfloat16"), ((4, 8), (4, 8))),
        CallRecord(RMS, "torch", "reference", ("float32", "bfloat16"), ((2,), (4, 8))),
        CallRecord(RMS, "triton", "priority", ("bfloat16", "bfloat16"), ((4, 8), (4, 8))),
        CallRecord("activation.silu", "triton", "priority", (), (None,)),
        CallRecord("activation.silu", "big", "when", (), (None,)),
        CallRecord("activation.silu", "triton", "priority", (), (None,)),
    ]
    assert len(t) == 6
    assert t.implementations(RMS) == {"torch": 1, "triton": 2}
    assert t.implementations("activation.silu") == {"big": 1, "triton": 2}
    assert t.summary() == [
        {"op": "activation.silu", "implementation": "big", "calls": 1},
        {"op": "activation.silu", "implementation": "triton", "calls": 2},
        {"op": RMS, "implementation": "torch", "calls": 1},
        {"op": RMS, "implementation": "triton", "calls": 2},
    ]


def test_to_json_and_export(ops: tuple[Any, Any], tmp_path: Path) -> None:
    rms, _ = ops
    with trace() as t:
        rms(Tensor("bf16", (3,)))
    data = json.loads(t.to_json())
    assert data["summary"] == [{"op": RMS, "implementation": "triton", "calls": 1}]
    assert data["calls"] == [
        {
            "op": RMS,
            "implementation": "triton",
            "rule": "priority",
            "dtypes": ["bfloat16"],
            "shapes": [[3], None],
        }
    ]
    path = tmp_path / "trace.json"
    t.export(str(path))
    assert json.loads(path.read_text()) == data
    assert path.read_text().endswith("\n")


def test_keep_calls_false_keeps_counts_only(ops: tuple[Any, Any]) -> None:
    _, silu = ops
    with trace(keep_calls=False) as t:
        for _ in range(5):
            silu(1)
    assert t.calls == []
    assert t.implementations("activation.silu") == {"triton": 5}


def test_errors_are_traced_and_raised(registry: KernelRegistry) -> None:
    @kernreg.op(RMS, registry=registry)
    def rms(x: Any) -> str:
        return "ref"

    rms.register("a", fast)
    rms.register("b", big)
    with trace() as t, pytest.raises(kernreg.AmbiguousKernelError):
        rms(1)
    assert [c.implementation for c in t.calls] == ["<error>"]


def test_after_the_block_calls_are_not_wrapped(ops: tuple[Any, Any]) -> None:
    _, silu = ops
    silu.registry.unregister("activation.silu", "big")  # a static decision from now on
    impl, callers = recording_impl("fast")
    silu.register("triton", impl, replace=True)
    assert [silu(1), silu(1)] == ["fast", "fast"]
    assert callers[-1] is silu.__code__  # the op object calls the implementation itself
    with trace() as t:
        assert silu(1) == "fast"
        assert callers[-1] is not silu.__code__  # wrapped to record while tracing
    assert [silu(1), silu(1)] == ["fast", "fast"]
    assert callers[-1] is silu.__code__
    assert len(t) == 1


def test_nested_and_concurrent_traces(ops: tuple[Any, Any]) -> None:
    _, silu = ops
    with trace() as outer:
        silu(1)
        with trace() as inner:
            silu(2)
        silu(3)
        worker = threading.Thread(target=silu, args=(4,))
        worker.start()
        worker.join(10)
    assert len(outer) == 4
    assert len(inner) == 1


def test_no_trace_records_nothing(ops: tuple[Any, Any]) -> None:
    _, silu = ops
    with trace() as t:
        pass
    silu(1)
    assert len(t) == 0

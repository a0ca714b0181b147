"""Demotion and decision counters with real tensors and under torch.compile(fullgraph=True)
(docs/fallbacks.md): a demotion recorded before compiling holds in the graph; a failure
while dynamo traces is not caught (as sglang's fast paths re-raise while compiling);
decisions made while tracing are counted once, outside the graph."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import kernreg  # noqa: E402
from kernreg import KernelRegistry, Platform  # noqa: E402
from kernreg.config import Config  # noqa: E402
from kernreg.errors import DemotionWarning  # noqa: E402


@pytest.fixture
def registry(tmp_path: Path) -> KernelRegistry:
    return KernelRegistry(
        config=Config(demote="fallbacks.*", cache_dir=str(tmp_path)), platform=Platform.parse("cpu")
    )


def _norm(registry: KernelRegistry, op_id: str, tried: list[Any], **register: Any) -> Any:
    @kernreg.op(op_id, registry=registry)
    def norm(x: Any) -> Any:
        return x * 2

    @norm.register("fast", priority=10, **register)
    def norm_fast(x: Any) -> Any:
        tried.append(x.dtype)
        if x.dtype == torch.float32:
            raise RuntimeError("float32 is not supported by this kernel build")
        return x * 2

    return norm


def _rows(op_id: str) -> list[tuple[str, str, str, int]]:
    return [(r, i, c, n) for op, r, i, c, n in kernreg.stats().counts if op == op_id]


def test_a_gated_op_demotes_per_dtype_with_real_tensors(registry: KernelRegistry) -> None:
    tried: list[Any] = []
    norm = _norm(registry, "fallbacks.gated", tried, dtypes=["float32", "bfloat16"])
    x = torch.ones(4)
    with pytest.warns(DemotionWarning, match="float32 is not supported"):
        torch.testing.assert_close(norm(x), x * 2)
    torch.testing.assert_close(norm(x), x * 2)
    torch.testing.assert_close(norm(x.bfloat16()), x.bfloat16() * 2)
    assert tried == [torch.float32, torch.bfloat16]  # float32 never again; bfloat16 runs
    assert norm.explain(dtypes=["float32"]).candidate("fast").status == "rejected"
    assert norm.explain(dtypes=["bfloat16"]).chosen.label == "fast"


def test_a_demotion_made_eagerly_holds_in_a_fullgraph_region(registry: KernelRegistry) -> None:
    tried: list[Any] = []
    norm = _norm(registry, "fallbacks.compiled", tried)
    x = torch.ones(4)
    with pytest.warns(DemotionWarning):
        norm(x)

    def f(x: Any) -> Any:
        return norm(x) + 1

    assert torch._dynamo.explain(f)(x).graph_break_count == 0
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    for _ in range(3):
        torch.testing.assert_close(compiled(x), x * 2 + 1)
    assert tried == [torch.float32]


def test_a_failure_while_dynamo_traces_is_not_demoted(registry: KernelRegistry) -> None:
    @kernreg.op("fallbacks.traced", registry=registry)
    def norm(x: Any) -> Any:
        return x * 2

    @norm.register("fast", priority=10)
    def norm_fast(x: Any) -> Any:
        raise RuntimeError("cannot be traced")

    compiled = torch.compile(lambda x: norm(x) + 1, fullgraph=True, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DemotionWarning)
        with pytest.raises(Exception, match="cannot be traced"):
            compiled(torch.ones(2))
    assert registry.demotions() == ()


def test_decisions_in_a_compiled_region_are_counted_once(registry: KernelRegistry) -> None:
    @kernreg.op("fallbacks.counted_compiled", registry=registry)
    def norm(x: Any) -> Any:
        return x * 2

    norm.register("gpu", lambda x: x * 2, requires=["cuda"], priority=10)
    norm.register("decode", lambda x: x * 3, priority=20, when=lambda x: x.shape[0] == 1)

    @kernreg.op("fallbacks.counted_gated", registry=registry)
    def gated(x: Any) -> Any:
        return x * 2

    gated.register("fast", lambda x: x * 2, priority=10, dtypes=["bfloat16"])
    compiled = torch.compile(
        lambda x: norm(x) + gated(x.bfloat16()), fullgraph=True, backend="eager"
    )
    for _ in range(4):
        torch.testing.assert_close(compiled(torch.ones(8)), torch.full((8,), 4.0))
    # Decided once, while traced; the graph's calls count nothing.
    assert _rows("fallbacks.counted_compiled") == [("reference", "torch", "predicate false", 1)]
    assert _rows("fallbacks.counted_gated") == [("priority", "fast", "", 1)]

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
    assert norm.explain_call(x).candidate("fast").status == "rejected"
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


def test_a_bucket_demoted_eagerly_holds_in_a_fullgraph_region(registry: KernelRegistry) -> None:
    tried: list[int] = []

    @kernreg.op("fallbacks.compiled_bucket", registry=registry)
    def norm(x: Any) -> Any:
        return x * 2

    @norm.register("fast", priority=10)
    def norm_fast(x: Any) -> Any:
        tried.append(x.shape[0])
        if x.shape[0] > 64:
            raise RuntimeError("grid too large")
        return x * 2

    small, large = torch.ones(4), torch.ones(100)
    with pytest.warns(DemotionWarning):
        norm(large)

    def f(x: Any) -> Any:
        return norm(x) + 1

    assert torch._dynamo.explain(f)(large).graph_break_count == 0
    assert torch._dynamo.explain(f)(small).graph_break_count == 0
    compiled = torch.compile(f, fullgraph=True, backend="eager", dynamic=False)
    tried.clear()
    for _ in range(2):
        torch.testing.assert_close(compiled(large), large * 2 + 1)
        torch.testing.assert_close(compiled(small), small * 2 + 1)
    assert 100 not in tried  # the demoted bucket never runs the kernel, compiled or not
    assert 4 in tried  # the small bucket's graph runs it


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


# --- a kernelized model (kernreg.torch.kernelize binds through kernreg.dispatch.guarded) ---


class Norm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(16))

    def forward(self, x: Any) -> Any:
        return _rms(x, self.weight)


def _rms(x: Any, weight: Any) -> Any:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = Norm()
        self.proj = torch.nn.Linear(16, 16)
        self.norm2 = Norm()

    def forward(self, x: Any) -> Any:
        return self.norm2(self.proj(self.norm1(x)))


def _norm_args(module: Any, x: Any) -> tuple[Any, ...]:
    return (x, module.weight)


def test_a_kernelized_layer_whose_kernel_raises_on_large_inputs_falls_back(
    registry: KernelRegistry,
) -> None:
    from kernreg.torch import kernelize, register_layer, unregister_layer

    tried: list[int] = []

    @kernreg.op("fallbacks.rmsnorm", registry=registry)
    def rmsnorm(x: Any, weight: Any) -> Any:
        return _rms(x, weight)

    @rmsnorm.register("fast", priority=10)
    def rmsnorm_fast(x: Any, weight: Any) -> Any:
        tried.append(x.shape[0])
        if x.shape[0] > 32:  # passes verification (up to 16 rows), fails on a large batch
            raise RuntimeError("too many blocks for this kernel's launch grid")
        return _rms(x, weight)  # the kernel's result (the layer's own, bit for bit)

    register_layer(f"{__name__}:Norm", op="fallbacks.rmsnorm", args=_norm_args)
    try:
        model = TinyModel()
        small, large = torch.randn(4, 16), torch.randn(64, 16)
        expected_small, expected_large = model(small), model(large)
        report = kernelize(model, registry=registry)
        assert report.routed == ("norm1", "norm2")
        tried.clear()
        with pytest.warns(DemotionWarning, match="too many blocks") as caught:
            torch.testing.assert_close(model(large), expected_large, rtol=0, atol=0)
        assert len(caught) == 1  # one demotion: norm2 runs without trying it in that bucket
        assert tried == [64]
        torch.testing.assert_close(model(large), expected_large, rtol=0, atol=0)
        torch.testing.assert_close(model(small), expected_small, rtol=0, atol=0)
        assert tried == [64, 4, 4]  # the large bucket never again; small inputs keep it
        [demotion] = registry.demotions()
        assert (demotion.label, demotion.bucket) == ("fast", "x=64x16")
        rows = _rows("fallbacks.rmsnorm")
        assert ("demoted", "fast", "RuntimeError", 1) in rows
        assert any(rule == "priority" and impl == "fast" for rule, impl, _, _ in rows)
    finally:
        unregister_layer(f"{__name__}:Norm")


def test_a_kernel_that_fails_after_writing_out_leaves_the_callers_buffer_right(
    registry: KernelRegistry,
) -> None:
    @kernreg.op("fallbacks.out", registry=registry)
    def scale(x: Any, *, out: Any = None) -> Any:
        return torch.mul(x, 2, out=out)

    @scale.register("fast", priority=10)
    def scale_fast(x: Any, *, out: Any = None) -> Any:
        out = torch.empty_like(x) if out is None else out
        out[: len(out) // 2] = 99  # half written, then the launch fails
        raise RuntimeError("launch failed")

    x, buffer = torch.ones(4), torch.zeros(4)
    with pytest.warns(DemotionWarning):
        assert scale(x, out=buffer) is buffer
    torch.testing.assert_close(buffer, x * 2)  # the fallback wrote all of it
    # In place (out= is the input): the kernel's half write corrupted the input, so no
    # fallback can answer; the call raises, the demotion holds for the next calls.
    y = torch.ones(8)
    with pytest.warns(DemotionWarning), pytest.raises(RuntimeError, match="launch failed"):
        scale(y, out=y)
    z = torch.ones(8)
    torch.testing.assert_close(scale(z, out=z), torch.full((8,), 2.0))


@pytest.mark.parametrize("block", ["use_backend", "compile_region"])
def test_a_bucket_demoted_inside_a_block_falls_back_by_the_rules_outside_it(
    registry: KernelRegistry, block: str
) -> None:
    from kernreg.pins import compile_region
    from kernreg.torch import kernelize, register_layer, unregister_layer

    ran: list[str] = []

    @kernreg.op("fallbacks.blocked", registry=registry)
    def rmsnorm(x: Any, weight: Any) -> Any:
        ran.append("reference")
        return _rms(x, weight)

    @rmsnorm.register("fast", priority=10)
    def rmsnorm_fast(x: Any, weight: Any) -> Any:
        if x.shape[0] > 32:
            raise RuntimeError("too many blocks for this kernel's launch grid")
        return _rms(x, weight)

    @rmsnorm.register("mid", priority=5)
    def rmsnorm_mid(x: Any, weight: Any) -> Any:
        ran.append("mid")
        return _rms(x, weight)

    register_layer(f"{__name__}:Norm", op="fallbacks.blocked", args=_norm_args)
    try:
        model, large = TinyModel(), torch.randn(64, 16)
        kernelize(model, registry=registry)
        opened = (
            kernreg.use_backend("fallbacks.blocked", "torch")
            if block == "use_backend"
            else compile_region()
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DemotionWarning)
            with opened:  # the first failure in the bucket happens inside the block
                model(large)
        ran.clear()
        model(large)
        assert ran == ["mid", "mid"]  # outside it, the rules' next choice for the bucket
    finally:
        unregister_layer(f"{__name__}:Norm")

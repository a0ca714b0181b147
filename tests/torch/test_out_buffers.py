"""``out=`` buffers of the op pack's norm and activation ops: sglang's rmsnorm family writes
into a caller's preallocated tensor (CUDA-graph capture needs fixed buffers), restated
against every implementation that runs here. (Parity with the Triton kernels, through the
interpreter, is ``kernreg parity --interpret``: test_triton_interpreted.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
kernreg_ops = pytest.importorskip("kernreg_ops")

import kernreg  # noqa: E402
from kernreg_ops import ops, reference  # noqa: E402


def _rows(*shape: int, seed: int = 0) -> Any:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


#: op id -> the call's arguments (float32, CPU)
_CALLS: dict[str, Callable[[], tuple[Any, ...]]] = {
    "layernorm.rmsnorm": lambda: (_rows(4, 64), _rows(64, seed=1), 1e-6),
    "layernorm.rmsnorm_offset": lambda: (_rows(4, 64), _rows(64, seed=1), 1e-6),
    "layernorm.layernorm": lambda: (_rows(4, 64), _rows(64, seed=1), _rows(64, seed=2), 1e-5),
    "layernorm.add_rmsnorm": lambda: (_rows(4, 64), _rows(4, 64, seed=1), _rows(64, seed=2)),
    "activation.silu_and_mul": lambda: (_rows(4, 128),),
    "activation.gelu_and_mul": lambda: (_rows(4, 128),),
    "activation.silu_mul": lambda: (_rows(4, 64), _rows(4, 64, seed=1)),
    "activation.gelu_tanh_mul": lambda: (_rows(4, 64), _rows(4, 64, seed=1)),
}


def _runnable(op: str) -> list[kernreg.KernelSpec]:
    """The implementations of ``op`` that can run here on float32 (the opt-in compiled one
    is exercised by parity)."""
    decision = kernreg.explain(op, dtypes=["float32"])
    return [c.spec for c in decision.candidates if c.status != "rejected"]


def _empty_like(result: Any) -> Any:
    if isinstance(result, tuple):
        return tuple(torch.full_like(r, float("nan")) for r in result)
    return torch.full_like(result, float("nan"))


@pytest.mark.parametrize("op", sorted(_CALLS))
def test_every_implementation_writes_into_the_callers_buffer_and_returns_it(op: str) -> None:
    args = _CALLS[op]()
    expected = kernreg.get_kernel(op, "torch")(*args)
    implementations = _runnable(op)
    assert {s.backend for s in implementations} >= {"torch"}
    for spec in implementations:
        buffer = _empty_like(expected)
        result = spec.load()(*args, out=buffer)
        if isinstance(buffer, tuple):  # two results: the pair of buffers given
            assert all(r is b for r, b in zip(result, buffer, strict=True)), spec.label
        else:
            assert result is buffer, spec.label
        torch.testing.assert_close(buffer, expected, msg=lambda m, s=spec: f"{s.label}: {m}")


def test_out_may_be_the_input_itself_normalising_in_place() -> None:
    """sglang's rmsnorm writes into its input unless given another buffer."""
    x, weight = _rows(4, 64), _rows(64, seed=1)
    expected = reference.rmsnorm(x, weight)
    for spec in _runnable("layernorm.rmsnorm"):
        y = x.clone()
        assert spec.load()(y, weight, out=y) is y
        torch.testing.assert_close(y, expected)
    x, residual, weight = _CALLS["layernorm.add_rmsnorm"]()
    normed, summed = reference.add_rmsnorm(x, residual, weight)
    for spec in _runnable("layernorm.add_rmsnorm"):
        a, b = x.clone(), residual.clone()
        first, second = spec.load()(a, b, weight, out=(a, b))
        assert first is a
        assert second is b
        torch.testing.assert_close((a, b), (normed, summed))


def test_a_fixed_buffer_serves_every_call_as_a_captured_graph_replays_it() -> None:
    buffer = torch.empty(4, 64)
    address = buffer.data_ptr()
    weight = _rows(64, seed=1)
    for seed in range(3):
        x = _rows(4, 64, seed=seed + 10)
        assert ops.rmsnorm(x, weight, out=buffer) is buffer
        torch.testing.assert_close(buffer, reference.rmsnorm(x, weight))
    assert buffer.data_ptr() == address


@pytest.mark.parametrize(
    ("make_out", "message"),
    [
        (lambda x, w: torch.empty(4, 32), r"must be a float32 tensor of shape \(4, 64\)"),
        (lambda x, w: torch.empty(4, 64, dtype=torch.float16), "must be a float32 tensor"),
        (lambda x, w: torch.empty(64).expand(4, 64), "stride 0"),
        (lambda x, w: torch.empty(0, 64), "must be a float32 tensor"),
        (lambda x, w: torch.empty(64, 4).t(), None),
    ],
    ids=["shape", "dtype", "expanded", "empty", "transposed-ok"],
)
def test_a_buffer_that_does_not_fit_is_refused_never_replaced(
    make_out: Callable[[Any, Any], Any], message: str | None
) -> None:
    x, weight = _rows(4, 64), _rows(64, seed=1)
    for spec in _runnable("layernorm.rmsnorm"):
        out = make_out(x, weight)
        if message is None:  # a buffer of its own, strided differently: accepted
            assert spec.load()(x, weight, out=out) is out
            continue
        with pytest.raises(ValueError, match=message):
            spec.load()(x, weight, out=out)


def test_a_buffer_sharing_memory_with_another_input_is_refused() -> None:
    x, residual, weight = _CALLS["layernorm.add_rmsnorm"]()
    for spec in _runnable("layernorm.add_rmsnorm"):
        with pytest.raises(ValueError, match="shares memory with"):
            spec.load()(x, residual, weight, out=(residual.clone(), x))
    gate, up = _CALLS["activation.silu_mul"]()
    for spec in _runnable("activation.silu_mul"):
        with pytest.raises(ValueError, match="shares memory with up"):
            spec.load()(gate, up, out=up)


def test_out_inside_a_fullgraph_compile_writes_the_callers_buffer() -> None:
    def step(x: Any, weight: Any, buffer: Any) -> Any:
        return ops.silu_and_mul(ops.rmsnorm(x, weight), out=buffer)

    x, weight, buffer = _rows(4, 128), _rows(128, seed=1), torch.empty(4, 64)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(x, weight, buffer)
    torch.testing.assert_close(
        buffer, reference.silu_and_mul(reference.rmsnorm(x, weight)), rtol=1e-5, atol=1e-5
    )
    torch._dynamo.reset()

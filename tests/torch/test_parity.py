"""The parity harness, on the op pack and on deliberately broken implementations."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
kernreg_ops = pytest.importorskip("kernreg_ops")

import kernreg  # noqa: E402
from kernreg import KernelRegistry  # noqa: E402
from kernreg.torch import (  # noqa: E402
    ParityError,
    Tolerance,
    check_parity,
    input_spec,
    inputs,
    register_inputs,
    unregister_inputs,
)
from kernreg_ops import reference  # noqa: E402

PACK = sorted(kernreg_ops.OPS)
_TRITON = {s.op for s in kernreg.registry.all_specs() if s.backend == "triton"}


@pytest.mark.parametrize("op", PACK)
def test_pack_agrees_with_its_reference_on_cpu(op: str) -> None:
    report = check_parity(op)
    assert report.ok, str(report)
    assert report.reference == "torch"
    checked = set(report.checked)
    assert checked >= {"torch"}
    if op in ("layernorm.rmsnorm", "layernorm.layernorm"):
        assert "aten" in checked
    elif op != "embedding.rotary":
        assert "native" in checked  # the native-dtype CPU implementation, within tolerance
    if op in _TRITON:
        assert "triton" in report.skipped
        assert "needs device cuda>=8.0" in report.skipped["triton"]
    assert {r.dtype for r in report.results} == {"float32", "float16", "bfloat16"}


def test_torch_compile_runs_when_allowed() -> None:
    with kernreg_ops.allow_compile():
        report = check_parity("layernorm.fused_add_rmsnorm", dtypes=["float32"], seeds=[0])
    assert report.ok, str(report)
    assert "torch_compile" in report.checked


def test_torch_compile_is_skipped_with_the_reason_when_not_allowed() -> None:
    report = check_parity("activation.silu_and_mul", dtypes=["float32"], seeds=[0])
    (result,) = [r for r in report.results if r.implementation == "torch_compile"]
    assert result.status == "skipped"
    assert result.message == "when predicate is false (process state, checked when deciding)"


def _rms_inputs(dtype: Any, device: Any, seed: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 16, generator=g).to(dtype)
    return (x, torch.ones(16, dtype=dtype)), {}


def _demo_op(registry: KernelRegistry, op_id: str) -> Any:
    @kernreg.op(op_id, registry=registry)
    def demo(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        return reference.rmsnorm(x, weight, eps)

    return demo


@pytest.fixture
def demo_inputs() -> Any:
    register_inputs("demo.rms", _rms_inputs, dtypes=["float32", "bfloat16"])
    yield
    unregister_inputs("demo.rms")


@pytest.mark.usefixtures("demo_inputs")
def test_detects_a_wrong_implementation(cpu_registry: KernelRegistry) -> None:
    demo = _demo_op(cpu_registry, "demo.rms")

    @demo.register("broken", priority=5)
    def broken(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        return reference.rmsnorm(x, weight, eps) * 1.05

    report = check_parity(demo)
    assert not report.ok
    assert {f.implementation for f in report.failures} == {"broken"}
    assert {f.dtype for f in report.failures} == {"float32", "bfloat16"}
    failure = report.failures[0]
    assert "values outside" in failure.message
    assert failure.message.startswith("output:")
    assert failure.max_abs_error is not None
    assert failure.max_abs_error > 0
    assert "fail    broken" in str(report)


@pytest.mark.usefixtures("demo_inputs")
def test_detects_a_stray_write_and_an_exception(cpu_registry: KernelRegistry) -> None:
    demo = _demo_op(cpu_registry, "demo.rms")

    @demo.register("scribbler", dtypes=["float32"], priority=5)
    def scribbler(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        out = reference.rmsnorm(x, weight, eps)
        weight.mul_(2)
        return out

    @demo.register("crashes", dtypes=["bfloat16"], priority=5)
    def crashes(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        raise RuntimeError("no kernel image")

    report = check_parity(demo)
    by_status = {(r.implementation, r.dtype): r for r in report.results}
    scribbled = by_status["scribbler", "float32"]
    assert scribbled.status == "fail"
    assert "weight was modified but the op does not declare it mutated" in scribbled.message
    crashed = [r for r in report.results if r.implementation == "crashes" and r.case is not None]
    assert crashed
    assert all(r.status == "error" for r in crashed)
    assert "RuntimeError: no kernel image" in crashed[0].message
    # Each one only runs where kernreg would choose it: the dtype gate skips the other.
    assert by_status["scribbler", "bfloat16"].status == "skipped"
    assert "accepts only float32" in by_status["scribbler", "bfloat16"].message


def test_compares_in_place_writes(cpu_registry: KernelRegistry) -> None:
    @kernreg.op("demo.add_into", registry=cpu_registry)
    def add_into(out: Any, x: Any) -> None:
        out.add_(x)

    @add_into.register("forgets")
    def forgets(out: Any, x: Any) -> None:
        pass

    args = (torch.zeros(3), torch.ones(3))
    report = check_parity(add_into, inputs=(args, {}), mutates=["out"])
    (failure,) = report.failures
    assert failure.implementation == "forgets"
    assert failure.message.startswith("out: 3 of 3 values outside")
    assert torch.equal(args[0], torch.zeros(3))  # the harness works on copies


def test_decorator_and_tolerances(cpu_registry: KernelRegistry) -> None:
    @kernreg.op("demo.scaled", registry=cpu_registry)
    def scaled(x: Any) -> Any:
        return x * 2

    @scaled.register("close", priority=1)
    def close(x: Any) -> Any:
        return x * 2 + 1e-4

    @inputs("demo.scaled", dtypes=["float32"])
    def scaled_inputs(dtype: Any, device: Any, seed: int) -> Any:
        return (torch.ones(4, dtype=dtype, device=device),), {}

    try:
        assert input_spec("demo.scaled") is not None
        assert not check_parity(scaled).ok
        loose = check_parity(scaled, tolerances={"float32": Tolerance(1e-3, 0)})
        assert loose.ok, str(loose)
    finally:
        unregister_inputs("demo.scaled")


def test_errors(cpu_registry: KernelRegistry) -> None:
    @kernreg.op("demo.nothing", registry=cpu_registry)
    def nothing(x: Any) -> Any:
        return x

    with pytest.raises(ParityError, match=r"no input generator registered for op 'demo\.nothing'"):
        check_parity(nothing)
    with pytest.raises(ParityError, match="torch has no cuda device here"):
        check_parity(nothing, inputs=((torch.ones(1),), {}), platform="cuda:9.0")
    with pytest.raises(
        ValueError, match=r"Conflicting input generator for op 'layernorm\.rmsnorm'"
    ):
        register_inputs("layernorm.rmsnorm", _rms_inputs)


def test_a_reference_that_raises_is_reported_not_raised(cpu_registry: KernelRegistry) -> None:
    @kernreg.op("demo.picky", registry=cpu_registry)
    def picky(x: Any) -> Any:
        if x.shape[0] > 3:
            raise RuntimeError("too long")
        return x * 2

    @picky.register("fast", priority=1)
    def fast(x: Any) -> Any:
        return x + x

    def grows(dtype: Any, device: Any, seed: int) -> Any:
        return (torch.ones(2 + 3 * seed, dtype=dtype, device=device),), {}

    report = check_parity(picky, inputs=grows, dtypes=["float32"])
    results = {(r.implementation, r.case): r for r in report.results}
    assert results["fast", 0].status == "pass"
    assert results["fast", 1].status == "skipped"
    assert results["fast", 1].message == (
        "nothing to compare with: the reference raised RuntimeError: too long"
    )
    (failure,) = report.failures
    assert (failure.implementation, failure.case, failure.status) == (report.reference, 1, "error")


def test_inputs_that_cannot_be_made_or_taken_are_a_parity_error(
    cpu_registry: KernelRegistry,
) -> None:
    @kernreg.op("demo.unary", registry=cpu_registry)
    def unary(x: Any) -> Any:
        return x

    def broken(dtype: Any, device: Any, seed: int) -> Any:
        raise ZeroDivisionError("shape table is empty")

    with pytest.raises(
        ParityError,
        match=r"^the input generator of op 'demo\.unary' raised ZeroDivisionError: "
        r"shape table is empty \(dtype float32, seed 0\)$",
    ):
        check_parity(unary, inputs=broken, dtypes=["float32"])
    with pytest.raises(ParityError, match=r"^the inputs for op 'demo\.unary' do not fit"):
        check_parity(unary, inputs=((torch.ones(1), torch.ones(1)), {}))


def test_a_nan_the_reference_does_not_have_is_no_zero_error(cpu_registry: KernelRegistry) -> None:
    @kernreg.op("demo.halve", registry=cpu_registry)
    def halve(x: Any) -> Any:
        return x / 2

    @halve.register("nan", priority=1)
    def nan(x: Any) -> Any:
        out = x / 2
        out[1] = float("nan")
        return out

    report = check_parity(halve, inputs=((torch.ones(3),), {}))
    (failure,) = report.failures
    assert failure.implementation == "nan"
    assert failure.max_abs_error is None  # not finite, and above all not 0
    assert failure.message == (
        "output: 1 of 3 values outside atol=1e-05, rtol=1e-05 "
        "(max abs error inf, max rel error inf; worst at (1,): got nan, expected 0.5, "
        "abs error inf, rel error inf)"
    )


def test_a_failure_shows_the_difference_with_enough_digits(cpu_registry: KernelRegistry) -> None:
    # Two float64 values that agree to six digits used to print as "-0.629493 vs -0.629493".
    @kernreg.op("demo.shift", registry=cpu_registry)
    def shift(x: Any) -> Any:
        return x.clone()

    @shift.register("off", priority=1)
    def off(x: Any) -> Any:
        out = x.clone()
        out[2] += 3e-7
        out[0] += 1e-7
        return out

    x = torch.tensor([0.5, -0.25, -0.6294931234567891, 1.0], dtype=torch.float64)
    report = check_parity(shift, inputs=((x,), {}))
    (failure,) = report.failures
    assert failure.message == (
        "output: 2 of 4 values outside atol=1e-10, rtol=1e-07 "
        "(max abs error 3e-07, max rel error 4.77e-07; worst at (2,): "
        "got -0.62949282345678914, expected -0.62949312345678909, "
        "abs error 3e-07, rel error 4.77e-07)"
    )
    assert failure.max_rel_error == pytest.approx(3e-7 / 0.6294931234567891)
    assert "max abs 3e-07 max rel 4.77e-07" in str(report)
    # float32 values are shown with the 9 digits that tell any two apart.
    exact = {"float32": Tolerance(0, 0)}
    report = check_parity(shift, inputs=((torch.tensor([10.0, 0.0, 1.0]),), {}), tolerances=exact)
    (failure,) = report.failures
    assert "worst at (2,): got 1.00000036, expected 1, abs error 3.58e-07" in failure.message


def test_the_pack_passes_its_own_parity_in_float64() -> None:
    # The references compute float64 in float64, so the CPU implementations (which compute
    # in the input's dtype) are held to float64's tolerance and pass.
    for op in PACK:
        report = check_parity(op, dtypes=["float64"])
        assert report.ok, str(report)
        if op != "embedding.rotary":  # its only other implementations are triton, compile
            assert len(report.checked) >= 2, str(report)

"""``as_custom_op`` trains through the reference; in-place ops are inference-only."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kernreg_ops")

from kernreg.torch import as_custom_op  # noqa: E402
from kernreg.torch._custom_op import InferenceOnlyError  # noqa: E402
from kernreg_ops import reference  # noqa: E402


def test_gradients_match_the_reference() -> None:
    custom = as_custom_op("activation.silu_mul", name="silu_mul_grad")
    gate = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    up = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    custom(gate, up).sum().backward()
    expected_gate, expected_up = torch.autograd.grad(reference.silu_mul(gate, up).sum(), (gate, up))
    torch.testing.assert_close(gate.grad, expected_gate)
    torch.testing.assert_close(up.grad, expected_up)
    assert torch.autograd.gradcheck(custom, (gate.detach().requires_grad_(), up.detach()))


def test_tuple_output_and_non_tensor_arguments() -> None:
    custom = as_custom_op("layernorm.add_rmsnorm", name="add_rmsnorm_grad")
    x = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    r = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    out, summed = custom(x, r, w, 1e-6)
    (out.sum() + 2 * summed.sum()).backward()
    ref_out, ref_summed = reference.add_rmsnorm(x, r, w, 1e-6)
    ex, er, ew = torch.autograd.grad(ref_out.sum() + 2 * ref_summed.sum(), (x, r, w))
    torch.testing.assert_close(x.grad, ex)
    torch.testing.assert_close(r.grad, er)
    torch.testing.assert_close(w.grad, ew)


def test_in_place_op_is_inference_only_when_created() -> None:
    with pytest.raises(InferenceOnlyError, match="inference-only") as info:
        as_custom_op("layernorm.fused_add_rmsnorm", name="fused_grad", backward=True)
    assert "mutates x, residual in place" in str(info.value)
    assert isinstance(info.value, ValueError)


def _smooth_op(op_id: str) -> object:
    """An op whose reference computes in the input's own dtype (float64 stays float64),
    with a faster implementation registered beside it."""
    import kernreg

    @kernreg.op(op_id)
    def smooth(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(x) * w, x * x * w

    @smooth.register("fused", priority=1)
    def fused(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(x).mul(w), x.square().mul(w)

    return smooth


def test_a_gradient_penalty_matches_the_reference() -> None:
    op = _smooth_op("doublegrad.penalty")
    custom = as_custom_op(op)
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(4, 16, dtype=torch.float64)

    def penalty(fn: object) -> torch.Tensor:
        out, squares = fn(x, w)  # type: ignore[operator]
        gx, gw = torch.autograd.grad((out * probe + squares).sum(), (x, w), create_graph=True)
        return (gx**2).sum() + (gw**2).sum()

    got = torch.autograd.grad(penalty(custom), (x, w))
    expected = torch.autograd.grad(penalty(op.reference), (x, w))  # type: ignore[attr-defined]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    inputs = (x.detach().requires_grad_(), w.detach().requires_grad_())
    assert torch.autograd.gradgradcheck(custom, inputs)


def test_a_first_derivative_is_unchanged_by_double_backward_support() -> None:
    custom = as_custom_op(_smooth_op("doublegrad.first"))
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64)
    out, squares = custom(x, w)
    (gx,) = torch.autograd.grad((out + squares).sum(), (x,))
    assert not gx.requires_grad  # no graph kept when none was asked for
    torch.testing.assert_close(gx, (1 - torch.tanh(x) ** 2) * w + 2 * x * w)

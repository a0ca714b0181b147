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

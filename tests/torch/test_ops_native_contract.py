"""The pack's native implementations keep the reference's contract: the result's
dtype and shape depend on the inputs alone, never on whether autograd records the call."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kernreg_ops")

from kernreg_ops import _native, reference  # noqa: E402

GATED = ("silu_mul", "gelu_tanh_mul")


def _call(name: str, gate: torch.Tensor, up: torch.Tensor, *, grad: bool) -> torch.Tensor:
    gate = gate.clone().requires_grad_(grad)
    return getattr(_native, name)(gate, up).detach()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", GATED)
def test_gated_activation_with_a_float32_up_has_the_references_dtype(name: str, grad: bool) -> None:
    gate = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
    up = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    expected = getattr(reference, name)(gate, up)
    result = _call(name, gate, up, grad=grad)
    assert result.dtype == expected.dtype
    torch.testing.assert_close(result, expected, atol=0.1, rtol=0.02)


@pytest.mark.parametrize("name", GATED)
def test_gated_activation_with_a_float32_up_fills_the_references_out_buffer(name: str) -> None:
    gate = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
    up = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    expected = getattr(reference, name)(gate, up)
    out = torch.empty_like(expected)
    assert getattr(_native, name)(gate, up, out=out) is out
    torch.testing.assert_close(out, expected, atol=0.1, rtol=0.02)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", GATED)
def test_gated_activation_broadcasts_a_gate_smaller_than_up(name: str, grad: bool) -> None:
    gate = torch.randn(1, 8, generator=torch.Generator().manual_seed(0))
    up = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    expected = getattr(reference, name)(gate, up)
    result = _call(name, gate, up, grad=grad)
    assert result.shape == (4, 8)
    torch.testing.assert_close(result, expected)


@pytest.mark.parametrize("rot_dim", [8, 4], ids=["whole_head", "partial"])
def test_rotary_with_float32_cos_sin_keeps_q_and_k_dtypes(rot_dim: int) -> None:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=generator).bfloat16()
    k = torch.randn(2, 2, 5, 8, generator=generator).bfloat16()
    cos = torch.randn(2, 5, rot_dim, generator=generator)
    sin = torch.randn(2, 5, rot_dim, generator=generator)
    expected = reference.rotary_cos_sin(q, k, cos, sin)
    result = _native.rotary_cos_sin(q, k, cos, sin)
    for got, want in zip(result, expected, strict=True):
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got, want)

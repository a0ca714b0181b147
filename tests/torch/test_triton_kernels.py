"""The Triton kernels against the reference (needs a CUDA GPU of SM 8.0+ and triton)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
kernreg_ops = pytest.importorskip("kernreg_ops")

from kernreg.torch import check_parity  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest --gpu)"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0),
        reason="the Triton kernels require SM 8.0+",
    ),
]


#: Every op of the pack with a Triton kernel (moe.experts has none).
TRITON_OPS = sorted(op for op in kernreg_ops.OPS if op != "moe.experts")


@pytest.mark.parametrize("op", TRITON_OPS)
def test_triton_matches_the_reference(op: str) -> None:
    pytest.importorskip("triton")
    report = check_parity(op, seeds=(0, 1, 2, 3))
    assert report.ok, str(report)
    assert "triton" in report.checked

"""Platform.detect() with torch installed, on this machine.

The CUDA and ROCm branches of detection need a GPU to be exercised honestly (faking
torch.cuda would only test the fake); benchmarks/gpu_check.py prints the detected
platform on a GPU machine, and test_triton_kernels.py checks it there.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kernreg import Platform  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_detects_cpu_with_the_torch_version() -> None:
    platform = Platform.detect()
    assert platform.device == "cpu"
    assert platform.arch is None
    assert platform.torch_version == torch.__version__
    assert platform.source == "torch (no accelerator available)"
    assert platform.describe()["torch_version"] == torch.__version__


def test_environment_override_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNREG_PLATFORM", "hip:gfx942")
    platform = Platform.detect()
    assert (platform.device, platform.arch_name, platform.source) == (
        "hip",
        "gfx942",
        "KERNREG_PLATFORM",
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU (pytest --gpu)")
def test_detects_the_gpu() -> None:
    platform = Platform.detect()
    if torch.version.hip:
        assert platform.device == "hip"
        assert platform.runtime_version == str(torch.version.hip)
    else:
        assert platform.device == "cuda"
        assert platform.arch == torch.cuda.get_device_capability()
        assert platform.runtime_version == str(torch.version.cuda)
    assert platform.torch_version == torch.__version__

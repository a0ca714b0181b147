"""Fixtures of the torch-layer tests: a registry deciding for this CPU machine."""

from __future__ import annotations

import warnings

import pytest

from kernreg import KernelRegistry, Platform
from kernreg.config import Config


@pytest.fixture
def cpu_registry() -> KernelRegistry:
    """An empty registry with the default configuration, deciding for ``cpu``."""
    return KernelRegistry(config=Config(), platform=Platform.parse("cpu"))


def _import_compiler_quietly() -> None:
    # torch.compile's first use imports torch.utils.mkldnn, which raises a
    # DeprecationWarning (torch.jit.script_method) that the suite's
    # `filterwarnings = error` would turn into a failure of whichever test compiles first.
    try:
        import torch
    except ImportError:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import torch._inductor.compile_fx  # noqa: F401


_import_compiler_quietly()

"""Fixtures of the torch-layer tests: a registry deciding for this CPU machine."""

from __future__ import annotations

import pytest

from kernreg import Config, KernelRegistry, Platform


@pytest.fixture
def cpu_registry() -> KernelRegistry:
    """An empty registry with the default configuration, deciding for ``cpu``."""
    return KernelRegistry(config=Config(), platform=Platform.parse("cpu"))

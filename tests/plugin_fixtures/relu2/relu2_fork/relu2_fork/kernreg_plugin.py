"""A backend for an op another distribution ships, a generator it should not declare, and
a new op without a generator."""

from kernreg import KernelRegistry, KernelSpec
from kernreg.torch import register_inputs

KERNREG_PLUGIN_API = 1


def register(registry: KernelRegistry) -> None:
    registry.register(
        KernelSpec("activation.relu2", "fork", "relu2_fork.kernels:relu2", priority=5)
    )
    register_inputs("activation.relu2", "relu2_fork.inputs:relu2")  # not the owner's
    registry.register(
        KernelSpec("activation.relu3", "torch", "relu2_fork.kernels:relu3", reference=True)
    )
    registry.register(KernelSpec("activation.relu3", "fork", "relu2_fork.kernels:relu3"))

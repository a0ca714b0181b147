"""Two plugins that each bring a reference for the same op."""

from kernreg import KernelSpec


def register_first(registry):
    registry.register(KernelSpec("refs.op", "torch", "clifx_targets:good", reference=True))


def register_second(registry):
    registry.register(KernelSpec("refs.op", "numpy", "clifx_targets:good", reference=True))

"""Registration functions named by the fixture distributions the CLI tests write."""

from kernreg import KernelSpec


def register_a(registry):
    registry.register(KernelSpec("plug.op", "torch", "clifx_targets:good", reference=True))


def register_b(registry):
    registry.register(KernelSpec("plug.op", "torch", "clifx_targets:good_after", reference=True))


def register_broken(registry):
    raise RuntimeError("plugin set-up failed")

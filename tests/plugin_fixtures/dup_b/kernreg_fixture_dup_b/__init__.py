"""One of two distributions exposing the entry point 'dup_kernels'."""

from kernreg import KernelSpec


def kernel(x):
    return x


def register(registry):
    registry.register(
        KernelSpec("fixture.dup_b", "torch", "kernreg_fixture_dup_b:kernel", reference=True)
    )

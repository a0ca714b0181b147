"""One of two distributions exposing the entry point 'dup_kernels'."""

from kernreg import KernelSpec


def kernel(x):
    return x


def register(registry):
    registry.register(
        KernelSpec("fixture.dup_a", "torch", "kernreg_fixture_dup_a:kernel", reference=True)
    )

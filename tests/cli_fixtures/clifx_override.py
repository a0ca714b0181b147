"""A deliberate replacement, recorded as an override."""

from kernreg import KernelSpec, register_kernel

register_kernel(KernelSpec("over.op", "torch", "clifx_targets:good", reference=True))
register_kernel(KernelSpec("over.op", "triton", "clifx_targets:good", priority=1))
register_kernel(
    KernelSpec("over.op", "triton", "clifx_targets:good_after", priority=1), replace=True
)

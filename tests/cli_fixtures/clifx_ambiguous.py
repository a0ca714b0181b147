"""Two CUDA implementations of one op at the same priority: ambiguous on cuda."""

from kernreg import KernelSpec, register_kernel

register_kernel(KernelSpec("amb.op", "torch", "clifx_targets:good", reference=True))
register_kernel(
    KernelSpec("amb.op", "triton", "clifx_targets:good", requires=["cuda>=8.0"], priority=5)
)
register_kernel(KernelSpec("amb.op", "cuda", "clifx_targets:good", requires=["cuda"], priority=5))

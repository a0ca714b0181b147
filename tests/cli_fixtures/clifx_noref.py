"""An op without a reference implementation, runnable only on CUDA."""

from kernreg import KernelSpec, register_kernel

register_kernel(
    KernelSpec("noref.op", "triton", "clifx_targets:good", requires=["cuda>=8.0"], priority=1)
)

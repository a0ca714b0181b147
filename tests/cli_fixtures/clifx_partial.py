"""The reference covers float32 and bfloat16 only; float16 runs only on CUDA."""

from kernreg import KernelSpec, register_kernel

register_kernel(
    KernelSpec(
        "part.op", "torch", "clifx_targets:good", reference=True, dtypes=["float32", "bfloat16"]
    )
)
register_kernel(
    KernelSpec("part.op", "triton", "clifx_targets:good", requires=["cuda"], dtypes=["float16"])
)

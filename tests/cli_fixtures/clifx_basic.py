"""A clean inventory: two ops, each with a reference and a gated fast implementation."""

from kernreg import KernelSpec, register_kernel

register_kernel(
    KernelSpec(
        "demo.rmsnorm", "torch", "clifx_targets:rms_ref", reference=True, traits=["deterministic"]
    )
)
register_kernel(
    KernelSpec(
        "demo.rmsnorm",
        "triton",
        "clifx_targets:rms_triton",
        requires=["cuda>=8.0"],
        dtypes=["bfloat16", "float16"],
        traits=["cuda_graph_safe"],
        priority=10,
    )
)
register_kernel(
    KernelSpec(
        "demo.rmsnorm",
        "cuda",
        "clifx_targets:rms_cuda",
        variant="sm90",
        requires=["cuda==9.0"],
        priority=20,
    )
)
register_kernel(KernelSpec("demo.gelu", "torch", "clifx_targets:gelu_ref", reference=True))

"""Long op ids and a dtype-restricted implementation: what `kernreg list` must fit."""

from kernreg import KernelSpec, register_kernel

for op in ("layernorm.rmsnorm", "layernorm.fused_add_rmsnorm", "attention.paged_decode_grouped"):
    register_kernel(KernelSpec(op, "torch", "clifx_targets:good", reference=True))
    register_kernel(
        KernelSpec(
            op,
            "triton",
            "clifx_targets:good",
            variant="persistent_v2",
            requires=["cuda>=8.0"],
            dtypes=["bfloat16", "float16", "float32"],
            traits=["batch_invariant", "cuda_graph_safe", "deterministic"],
            priority=30,
        )
    )
    register_kernel(
        KernelSpec(
            op,
            "aten",
            "clifx_targets:good",
            dtypes=["bfloat16", "float16", "float32", "float64"],
            traits=["compile_safe"],
            priority=20,
        )
    )

"""The registration function: metadata only, no torch import."""

from kernreg import KernelRegistry, KernelSpec
from kernreg.torch import register_inputs  # imports no torch

KERNREG_PLUGIN_API = 1


def register(registry: KernelRegistry) -> None:
    registry.register(
        KernelSpec("activation.relu2", "torch", "relu2_ops.kernels:relu2_reference", reference=True)
    )
    registry.register(
        KernelSpec(
            "activation.relu2",
            "half",
            "relu2_ops.kernels:relu2_half",
            dtypes=["float16", "bfloat16"],
            priority=10,
        )
    )
    register_inputs(
        "activation.relu2",
        "relu2_ops.inputs:relu2_inputs",
        dtypes=("float32", "float16", "bfloat16"),
        mutates=(),
    )

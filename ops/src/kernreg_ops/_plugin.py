"""The op pack's registration: metadata only, no torch import.

Loaded by kernreg through the ``kernreg.kernels`` entry point ``ops =
"kernreg_ops._plugin:register"``. Every target is a ``"module:attr"`` string, imported
the first time kernreg selects it. Input generators for the parity harness go to the
torch layer's side table the same way (as target strings, see
:func:`kernreg.torch.register_inputs`).

Priorities (higher wins among eligible implementations):

=============  ========  ====================================================
backend        priority  when it is eligible
=============  ========  ====================================================
triton         30        CUDA SM 8.0+, float16/bfloat16/float32, ``triton>=2.1``
aten           20        a fused ATen call exists (``layernorm.rmsnorm`` only)
native         15        CPU, in the input's dtype (not rmsnorm, rotary)
torch_compile  10        only while compilation is allowed (``when`` predicate)
torch           0        the reference: the fallback, and the parity oracle
=============  ========  ====================================================
"""

from __future__ import annotations

from kernreg import KernelRegistry, KernelSpec

__all__ = ["KERNREG_PLUGIN_API", "OPS", "register", "specs"]

KERNREG_PLUGIN_API = 1

RMSNORM = "layernorm.rmsnorm"
FUSED_ADD_RMSNORM = "layernorm.fused_add_rmsnorm"
ADD_RMSNORM = "layernorm.add_rmsnorm"
SILU_AND_MUL = "activation.silu_and_mul"
SILU_MUL = "activation.silu_mul"
GELU_AND_MUL = "activation.gelu_and_mul"
ROTARY = "embedding.rotary"
ROTARY_COS_SIN = "embedding.rotary_cos_sin"

#: op id -> (function name in each implementation module, parameters mutated in place)
_OPS: dict[str, tuple[str, tuple[str, ...]]] = {
    RMSNORM: ("rmsnorm", ()),
    FUSED_ADD_RMSNORM: ("fused_add_rmsnorm", ("x", "residual")),
    ADD_RMSNORM: ("add_rmsnorm", ()),
    SILU_AND_MUL: ("silu_and_mul", ()),
    SILU_MUL: ("silu_mul", ()),
    GELU_AND_MUL: ("gelu_and_mul", ()),
    ROTARY: ("rotary", ()),
    ROTARY_COS_SIN: ("rotary_cos_sin", ()),
}
OPS: tuple[str, ...] = tuple(_OPS)

_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_TRITON_DTYPES = ("float16", "bfloat16", "float32")
#: Ops with a real fused ATen call (torch.nn.functional.rms_norm, torch>=2.4).
_ATEN = frozenset({RMSNORM})
#: Ops with a native-dtype CPU implementation (kernreg_ops._native); RMSNorm has ATen's.
#: The vLLM-layout rotary has none: a float16 cos/sin cache loses the reference's accuracy.
_NATIVE = frozenset(set(_OPS) - {RMSNORM, ROTARY})
#: Ops with a Triton kernel (kernreg_ops._triton).
_TRITON = frozenset(
    {
        RMSNORM,
        FUSED_ADD_RMSNORM,
        ADD_RMSNORM,
        SILU_AND_MUL,
        SILU_MUL,
        GELU_AND_MUL,
        ROTARY,
        ROTARY_COS_SIN,
    }
)
#: Ops whose in-place form Inductor cannot compile on CPU (torch 2.13): not compile-safe;
#: under torch.compile use the functional form (``layernorm.add_rmsnorm``).
_NOT_COMPILE_SAFE = frozenset({FUSED_ADD_RMSNORM})


def specs() -> list[KernelSpec]:
    """Every implementation of the pack, as specs (no torch import)."""
    result = []
    for op, (name, mutates) in _OPS.items():
        inplace = ("inplace",) if mutates else ()
        # Autograd differentiates the pure-torch implementations of the functional ops.
        backward = () if mutates else ("backward",)
        compile_safe = () if op in _NOT_COMPILE_SAFE else ("compile_safe",)
        result.append(
            KernelSpec(
                op,
                "torch",
                f"kernreg_ops.reference:{name}",
                reference=True,
                traits=(*compile_safe, "deterministic", *inplace, *backward),
                description="pure-torch reference (computes in float32)",
            )
        )
        if op in _ATEN:
            result.append(
                KernelSpec(
                    op,
                    "aten",
                    f"kernreg_ops._aten:{name}",
                    dtypes=_FLOAT_DTYPES,
                    traits=(*compile_safe, *inplace, *backward),
                    priority=20,
                    description="torch.nn.functional.rms_norm (a fused kernel on CUDA)",
                )
            )
        if op in _NATIVE:
            result.append(
                KernelSpec(
                    op,
                    "native",
                    f"kernreg_ops._native:{name}",
                    requires=("cpu",),
                    dtypes=_FLOAT_DTYPES,
                    traits=(*compile_safe, "deterministic", *inplace, *backward),
                    priority=15,
                    description="PyTorch ops in the input's dtype (no float32 upcast), CPU",
                )
            )
        result.append(
            KernelSpec(
                op,
                "torch_compile",
                f"kernreg_ops._compiled:{name}",
                when="kernreg_ops._policy:compile_allowed",
                traits=("compiled", *inplace),
                priority=10,
                description="torch.compile of the reference; opt-in: "
                "kernreg_ops.set_compile_allowed(True) or `with kernreg_ops.allow_compile():`",
            )
        )
        if op in _TRITON:
            result.append(
                KernelSpec(
                    op,
                    "triton",
                    f"kernreg_ops._triton:{name}",
                    requires=("cuda>=8.0",),
                    dtypes=_TRITON_DTYPES,
                    packages=("triton>=2.1",),
                    traits=("cuda_graph_safe", "deterministic", "batch_invariant", *inplace),
                    priority=30,
                    description="Triton kernel, one program per row (per token for rotary)",
                )
            )
    return result


def register(registry: KernelRegistry) -> None:
    """Register every implementation and input generator of the pack into ``registry``."""
    for spec in specs():
        registry.register(spec)
    # kernreg.torch's registration API imports no torch either.
    from kernreg.torch import register_inputs

    for op, (name, mutates) in _OPS.items():
        register_inputs(op, f"kernreg_ops._inputs:{name}", mutates=mutates)
    # Layer mappings for transformers models (target strings: transformers is never imported).
    from kernreg_ops._layers import register_layers

    register_layers()

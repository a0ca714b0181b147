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
triton         30        CUDA SM 8.0+, float16/bfloat16/float32, ``triton>=2.1``;
                         12 for the ops with a path of one or two ATen calls
aten           20        a fused ATen call exists (``rmsnorm``, ``layernorm``)
native         15        any device, computing as the model's own layer does
torch_compile  10        only while compilation is allowed (``when`` predicate)
torch           0        the reference: the fallback, and the parity oracle
=============  ========  ====================================================

On a GPU, host time sets the pace of a decode step: a Triton launch cost 25 us of host
time on an H200 host (triton 3.6), and the pack's wrapper around it more, against 12-17 us
for one ATen call. So a Triton kernel ranks first only where it replaces three or more
ATen launches (the rotary embeddings, Gemma's offset RMSNorm, the added-residual norms);
where ATen computes the op in one or two calls (RMSNorm, LayerNorm, the gated
activations), the ATen or native path ranks first and the Triton kernel is a pin away
(``pin={"layernorm.rmsnorm@*": "triton"}``), faster on large inputs where the GPU, not
the host, sets the pace.

Each spec is declared by its own ``registry.register(...)`` line, so its origin
(``kernreg list``, ``kernreg explain``, conflict messages) names that line.
"""

from __future__ import annotations

from kernreg import KernelRegistry, KernelSpec, Platform

__all__ = ["KERNREG_PLUGIN_API", "OPS", "register", "specs"]

KERNREG_PLUGIN_API = 1

RMSNORM = "layernorm.rmsnorm"
FUSED_ADD_RMSNORM = "layernorm.fused_add_rmsnorm"
ADD_RMSNORM = "layernorm.add_rmsnorm"
RMSNORM_OFFSET = "layernorm.rmsnorm_offset"
LAYERNORM = "layernorm.layernorm"
SILU_AND_MUL = "activation.silu_and_mul"
SILU_MUL = "activation.silu_mul"
GELU_AND_MUL = "activation.gelu_and_mul"
GELU_TANH_MUL = "activation.gelu_tanh_mul"
ROTARY = "embedding.rotary"
ROTARY_COS_SIN = "embedding.rotary_cos_sin"
ROTARY_COS_SIN_INTERLEAVED = "embedding.rotary_cos_sin_interleaved"
EXPERTS = "moe.experts"

#: op id -> (function name in each implementation module, parameters mutated in place)
_OPS: dict[str, tuple[str, tuple[str, ...]]] = {
    RMSNORM: ("rmsnorm", ()),
    FUSED_ADD_RMSNORM: ("fused_add_rmsnorm", ("x", "residual")),
    ADD_RMSNORM: ("add_rmsnorm", ()),
    RMSNORM_OFFSET: ("rmsnorm_offset", ()),
    LAYERNORM: ("layernorm", ()),
    SILU_AND_MUL: ("silu_and_mul", ()),
    SILU_MUL: ("silu_mul", ()),
    GELU_AND_MUL: ("gelu_and_mul", ()),
    GELU_TANH_MUL: ("gelu_tanh_mul", ()),
    ROTARY: ("rotary", ()),
    ROTARY_COS_SIN: ("rotary_cos_sin", ()),
    ROTARY_COS_SIN_INTERLEAVED: ("rotary_cos_sin_interleaved", ()),
    EXPERTS: ("experts", ()),
}
OPS: tuple[str, ...] = tuple(_OPS)
#: op id -> the parameters its calls dispatch on, where not the first (kernreg_ops.ops)
_DISPATCH_ARGS: dict[str, tuple[str, ...]] = {ROTARY: ("q",)}

_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_TRITON_DTYPES = ("float16", "bfloat16", "float32")

#: Traits of the pure-torch implementations of a functional op: autograd differentiates them.
_FUNCTIONAL = ("compile_safe", "backward")
_TRITON_TRAITS = ("cuda_graph_safe", "deterministic", "batch_invariant")
_NATIVE_DESCRIPTION = "PyTorch ops in the input's dtype (no float32 upcast)"
_TRITON_DESCRIPTION = "Triton kernel, one program per row (per token for rotary)"
#: The Triton kernels' priority where one or two ATen calls compute the op: behind those
#: (native 15, aten 20), whose launches cost less host time (module docstring).
_TRITON_BEHIND = 12


def _reference(
    op: str, *, traits: tuple[str, ...] = (*_FUNCTIONAL, "deterministic"), description: str = ""
) -> KernelSpec:
    """The pure-torch reference of ``op``: the fallback and the parity oracle."""
    return KernelSpec(
        op,
        "torch",
        f"kernreg_ops.reference:{_OPS[op][0]}",
        reference=True,
        traits=traits,
        description=description or "pure-torch reference (computes in float32)",
    )


def _native(
    op: str,
    *,
    traits: tuple[str, ...] = (*_FUNCTIONAL, "deterministic"),
    description: str = "",
) -> KernelSpec:
    """An implementation computing as the model's own layer does (kernreg_ops._native), on
    any device."""
    return KernelSpec(
        op,
        "native",
        f"kernreg_ops._native:{_OPS[op][0]}",
        dtypes=_FLOAT_DTYPES,
        traits=traits,
        priority=15,
        description=description or _NATIVE_DESCRIPTION,
    )


def _aten(op: str, *, description: str) -> KernelSpec:
    """One fused ATen call (kernreg_ops._aten)."""
    return KernelSpec(
        op,
        "aten",
        f"kernreg_ops._aten:{_OPS[op][0]}",
        dtypes=_FLOAT_DTYPES,
        traits=_FUNCTIONAL,
        priority=20,
        description=description,
    )


def _compiled(op: str, *, traits: tuple[str, ...] = ()) -> KernelSpec:
    """``torch.compile`` of the reference, opt-in (kernreg_ops._compiled)."""
    return KernelSpec(
        op,
        "torch_compile",
        f"kernreg_ops._compiled:{_OPS[op][0]}",
        when="kernreg_ops._policy:compile_allowed",
        traits=("compiled", *traits),
        priority=10,
        description="torch.compile of the reference; opt-in: "
        "kernreg_ops.set_compile_allowed(True) or `with kernreg_ops.allow_compile():`",
    )


def _triton(
    op: str, *, traits: tuple[str, ...] = (), description: str = "", priority: int = 30
) -> KernelSpec:
    """A Triton kernel for CUDA SM 8.0+ (kernreg_ops._triton)."""
    return KernelSpec(
        op,
        "triton",
        f"kernreg_ops._triton:{_OPS[op][0]}",
        requires=("cuda>=8.0",),
        dtypes=_TRITON_DTYPES,
        packages=("triton>=2.1",),
        traits=(*_TRITON_TRAITS, *traits),
        priority=priority,
        description=description or _TRITON_DESCRIPTION,
    )


def _register_specs(registry: KernelRegistry) -> None:
    """Every implementation of the pack, one line each (the line is the spec's origin)."""
    add = registry.register

    add(_reference(RMSNORM))
    add(_aten(RMSNORM, description="torch.nn.functional.rms_norm (a fused kernel on CUDA)"))
    add(_compiled(RMSNORM))
    add(_triton(RMSNORM, priority=_TRITON_BEHIND))

    # Inductor cannot compile the in-place form on CPU (torch 2.13): not compile_safe;
    # under torch.compile use the functional layernorm.add_rmsnorm.
    add(_reference(FUSED_ADD_RMSNORM, traits=("deterministic", "inplace")))
    add(_native(FUSED_ADD_RMSNORM, traits=("deterministic", "inplace")))
    add(_compiled(FUSED_ADD_RMSNORM, traits=("inplace",)))
    add(_triton(FUSED_ADD_RMSNORM, traits=("inplace",)))

    add(_reference(ADD_RMSNORM))
    add(_native(ADD_RMSNORM))
    add(_compiled(ADD_RMSNORM))
    add(_triton(ADD_RMSNORM))

    gemma = "as transformers' GemmaRMSNorm: float32, x * rstd * (1 + weight), rounded once"
    add(_reference(RMSNORM_OFFSET, description=f"pure-torch reference, {gemma}"))
    add(
        _native(
            RMSNORM_OFFSET,
            description=f"ATen rms_norm, {gemma}",
        )
    )
    add(_compiled(RMSNORM_OFFSET))
    add(_triton(RMSNORM_OFFSET))

    layer_norm = "computes in float32, rounds once (as nn.LayerNorm)"
    add(_reference(LAYERNORM, description=f"pure-torch reference, {layer_norm}"))
    add(_aten(LAYERNORM, description="torch.nn.functional.layer_norm (what nn.LayerNorm runs)"))
    add(_compiled(LAYERNORM))
    add(_triton(LAYERNORM, priority=_TRITON_BEHIND))

    add(_reference(SILU_AND_MUL))
    add(_native(SILU_AND_MUL))
    add(_compiled(SILU_AND_MUL))
    add(_triton(SILU_AND_MUL, priority=_TRITON_BEHIND))

    add(_reference(SILU_MUL))
    add(_native(SILU_MUL))
    add(_compiled(SILU_MUL))
    add(_triton(SILU_MUL, priority=_TRITON_BEHIND))

    add(_reference(GELU_AND_MUL))
    add(_native(GELU_AND_MUL))
    add(_compiled(GELU_AND_MUL))
    add(_triton(GELU_AND_MUL, priority=_TRITON_BEHIND))

    gelu_mlp = "the activation rounded before the product, as Gemma's MLP"
    add(_reference(GELU_TANH_MUL, description=f"pure-torch reference, {gelu_mlp}"))
    add(_native(GELU_TANH_MUL))
    add(_compiled(GELU_TANH_MUL))
    add(_triton(GELU_TANH_MUL, priority=_TRITON_BEHIND))

    # The vLLM-layout rotary has no native implementation: a float16 cos/sin cache loses
    # the reference's accuracy.
    add(_reference(ROTARY))
    add(_compiled(ROTARY))
    add(_triton(ROTARY))

    add(_reference(ROTARY_COS_SIN))
    add(_native(ROTARY_COS_SIN))
    add(_compiled(ROTARY_COS_SIN))
    add(_triton(ROTARY_COS_SIN))

    cohere = "as transformers' Cohere rotary: float32, rounded once"
    add(
        _reference(
            ROTARY_COS_SIN_INTERLEAVED,
            description=f"pure-torch reference, {cohere}",
        )
    )
    add(
        _native(
            ROTARY_COS_SIN_INTERLEAVED,
            description=f"PyTorch ops {cohere}",
        )
    )
    add(_compiled(ROTARY_COS_SIN_INTERLEAVED))
    add(_triton(ROTARY_COS_SIN_INTERLEAVED))

    # The expert loop reads which experts have tokens (data-dependent control flow): no
    # compile_safe; index_add_ of several experts into one row is not deterministic on CUDA.
    # No Triton kernel: on GPUs the grouped-GEMM kernels of the MoE libraries are the ones
    # to register.
    mixtral = "the expert loop of transformers' MixtralExperts"
    add(_reference(EXPERTS, traits=("backward",), description=f"pure-torch reference, {mixtral}"))
    add(
        _native(
            EXPERTS,
            traits=("backward",),
            description="tokens sorted by expert once, one matmul pair per expert, "
            "in the input's dtype",
        )
    )
    add(_compiled(EXPERTS))


def specs() -> list[KernelSpec]:
    """Every implementation of the pack, as specs with their origins (no torch import)."""
    scratch = KernelRegistry(platform=Platform("cpu"))
    _register_specs(scratch)
    return [spec for op in OPS for spec in scratch.get(op)]


def register(registry: KernelRegistry) -> None:
    """Register every implementation and input generator of the pack into ``registry``."""
    _register_specs(registry)
    # kernreg.torch's registration API imports no torch either.
    from kernreg.torch import register_inputs

    for op, (name, mutates) in _OPS.items():
        dispatch = _DISPATCH_ARGS.get(op, ())
        register_inputs(op, f"kernreg_ops._inputs:{name}", mutates=mutates, dispatch_args=dispatch)
    # Layer mappings for transformers models (target strings: transformers is never imported).
    from kernreg_ops._layers import register_layers

    register_layers()

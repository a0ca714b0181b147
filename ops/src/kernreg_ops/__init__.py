"""kernreg-ops: a small pack of real operators, registered with kernreg as a plugin.

Importing this package (or loading its plugin) imports no torch: every implementation
is a lazily imported ``"module:attr"`` target. The op objects users call live in
:mod:`kernreg_ops.ops`, which imports torch.

Ops: ``layernorm.rmsnorm``, ``layernorm.fused_add_rmsnorm``, ``layernorm.add_rmsnorm``
(functional, returns ``(out, residual)``), ``activation.silu_and_mul``,
``activation.silu_mul`` (two inputs: ``silu(gate) * up``), ``activation.gelu_and_mul``,
``embedding.rotary`` (vLLM layout), ``embedding.rotary_cos_sin`` (transformers layout,
partial rotary included), ``embedding.rotary_cos_sin_interleaved`` (Cohere's pairs),
``layernorm.rmsnorm_offset`` (Gemma's ``1 + weight``), ``layernorm.layernorm``,
``activation.gelu_tanh_mul`` (Gemma's gated MLP) and ``moe.experts`` (Mixtral/Qwen-MoE
experts). Backends: ``torch`` (the reference), ``aten`` (a fused ATen call, only where
one exists), ``native`` (any device, as the model's layer computes), ``torch_compile``
(opt-in, see :func:`allow_compile`) and ``triton`` (CUDA SM 8.0+, needs the ``triton``
package; on a GPU ranked first only where it replaces three or more ATen launches).

Layer mappings for transformers' Llama, Qwen2 and Mistral (RMSNorm, gated MLP) ship
with the pack: ``kernreg.torch.kernelize(model)`` routes those layers (see
:mod:`kernreg_ops._layers`).
"""

from kernreg_ops._plugin import OPS
from kernreg_ops._policy import allow_compile, compile_allowed, set_compile_allowed

__version__ = "0.1.0"

__all__ = ["OPS", "__version__", "allow_compile", "compile_allowed", "set_compile_allowed"]

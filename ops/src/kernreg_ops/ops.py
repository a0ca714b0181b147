"""The op objects of the pack: call them, and kernreg picks the implementation.

>>> from kernreg_ops.ops import rmsnorm
>>> y = rmsnorm(x, weight)                     # doctest: +SKIP
>>> rmsnorm.explain(dtypes=["bfloat16"])      # why that implementation  # doctest: +SKIP

Each is built with :func:`kernreg.dispatcher` on the reference's signature and dispatches
on its first tensor argument's dtype and device (``q`` for ``rotary``: ``positions`` is
an integer tensor).
"""

from __future__ import annotations

import kernreg
from kernreg_ops import reference

__all__ = [
    "add_rmsnorm",
    "experts",
    "fused_add_rmsnorm",
    "gelu_and_mul",
    "gelu_tanh_mul",
    "layernorm",
    "rmsnorm",
    "rmsnorm_offset",
    "rotary",
    "rotary_cos_sin",
    "rotary_cos_sin_interleaved",
    "silu_and_mul",
    "silu_mul",
]

rmsnorm = kernreg.dispatcher("layernorm.rmsnorm", like=reference.rmsnorm)
fused_add_rmsnorm = kernreg.dispatcher(
    "layernorm.fused_add_rmsnorm", like=reference.fused_add_rmsnorm
)
silu_and_mul = kernreg.dispatcher("activation.silu_and_mul", like=reference.silu_and_mul)
gelu_and_mul = kernreg.dispatcher("activation.gelu_and_mul", like=reference.gelu_and_mul)
rotary = kernreg.dispatcher("embedding.rotary", like=reference.rotary, dispatch_args=("q",))
add_rmsnorm = kernreg.dispatcher("layernorm.add_rmsnorm", like=reference.add_rmsnorm)
silu_mul = kernreg.dispatcher("activation.silu_mul", like=reference.silu_mul)
rotary_cos_sin = kernreg.dispatcher("embedding.rotary_cos_sin", like=reference.rotary_cos_sin)
rmsnorm_offset = kernreg.dispatcher("layernorm.rmsnorm_offset", like=reference.rmsnorm_offset)
layernorm = kernreg.dispatcher("layernorm.layernorm", like=reference.layernorm)
gelu_tanh_mul = kernreg.dispatcher("activation.gelu_tanh_mul", like=reference.gelu_tanh_mul)
rotary_cos_sin_interleaved = kernreg.dispatcher(
    "embedding.rotary_cos_sin_interleaved", like=reference.rotary_cos_sin_interleaved
)
experts = kernreg.dispatcher("moe.experts", like=reference.experts)

"""kernreg-ops: a small pack of real operators, registered with kernreg as a plugin.

Importing this package (or loading its plugin) imports no torch: every implementation
is a lazily imported ``"module:attr"`` target. The op objects users call live in
:mod:`kernreg_ops.ops`, which imports torch.

Ops: ``layernorm.rmsnorm``, ``layernorm.fused_add_rmsnorm``, ``activation.silu_and_mul``,
``activation.gelu_and_mul``, ``embedding.rotary``. Backends: ``torch`` (the reference),
``aten`` (a fused ATen call, only where one exists), ``torch_compile`` (opt-in, see
:func:`allow_compile`) and ``triton`` (CUDA SM 8.0+, needs the ``triton`` package).
"""

from kernreg_ops._plugin import OPS
from kernreg_ops._policy import allow_compile, compile_allowed, set_compile_allowed

__version__ = "0.1.0"

__all__ = ["OPS", "__version__", "allow_compile", "compile_allowed", "set_compile_allowed"]

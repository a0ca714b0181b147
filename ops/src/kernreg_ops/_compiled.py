"""``torch.compile`` of the references, created lazily: compiling happens on first call.

Selected only while compilation is allowed (see :mod:`kernreg_ops._policy`).
"""

from __future__ import annotations

import torch
from kernreg_ops import reference

__all__ = ["fused_add_rmsnorm", "gelu_and_mul", "rmsnorm", "rotary", "silu_and_mul"]

rmsnorm = torch.compile(reference.rmsnorm, dynamic=None)
fused_add_rmsnorm = torch.compile(reference.fused_add_rmsnorm, dynamic=None)
silu_and_mul = torch.compile(reference.silu_and_mul, dynamic=None)
gelu_and_mul = torch.compile(reference.gelu_and_mul, dynamic=None)
rotary = torch.compile(reference.rotary, dynamic=None)

"""Registers a different spec for a key clifx_basic already holds."""

from kernreg import KernelSpec, register_kernel

register_kernel(KernelSpec("demo.gelu", "torch", "clifx_targets:good", reference=True))

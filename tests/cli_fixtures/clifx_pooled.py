"""An implementation whose module keeps the interpreter from exiting, and one sorted after it."""

from kernreg import KernelSpec, register_kernel

register_kernel(KernelSpec("pool.op", "torch", "clifx_targets:good", reference=True))
register_kernel(KernelSpec("pool.op", "pooled", "clifx_exit_hang:fn"))

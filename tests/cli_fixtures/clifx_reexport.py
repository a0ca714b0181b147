"""One function registered under two names (b re-exports a's function)."""

from kernreg import KernelSpec, register_kernel

register_kernel(KernelSpec("re.op", "torch", "clifx_targets:good", reference=True))
register_kernel(KernelSpec("re.op", "triton", "clifx_pkg.a:fn", priority=1))
register_kernel(KernelSpec("re.op", "triton", "clifx_pkg.b:fn", variant="v2", priority=2))

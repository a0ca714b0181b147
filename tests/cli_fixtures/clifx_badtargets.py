"""Targets that do not import: missing module, missing attribute, not callable, a crash,
a hang, a bad when predicate, and a good target after the crash and the hang."""

from kernreg import KernelSpec, register_kernel

register_kernel(KernelSpec("bad.op", "torch", "clifx_targets:good", reference=True))
register_kernel(KernelSpec("bad.op", "missing", "clifx_no_such_module:fn"))
register_kernel(KernelSpec("bad.op", "noattr", "clifx_targets:no_such_fn", priority=-1))
register_kernel(KernelSpec("bad.op", "notcallable", "clifx_targets:NOT_CALLABLE", priority=-2))
register_kernel(KernelSpec("bad.op", "crash", "clifx_crash:fn", priority=-3))
register_kernel(KernelSpec("bad.op", "hang", "clifx_hang:fn", priority=-4))
register_kernel(
    KernelSpec(
        "bad.op", "gated", "clifx_targets:good", when="clifx_no_such_module:pred", priority=-5
    )
)
register_kernel(KernelSpec("bad.op", "zlast", "clifx_zlast:fn", priority=-6))
register_kernel(
    KernelSpec(
        "bad.op",
        "vendor",
        "clifx_no_such_vendor_module:fn",
        packages=["clifx-no-such-distribution>=1"],
        priority=-7,
    )
)

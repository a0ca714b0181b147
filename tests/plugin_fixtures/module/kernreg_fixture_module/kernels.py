import kernreg

KERNREG_PLUGIN_API = 1

kernreg.register_kernel(
    kernreg.KernelSpec(
        "fixture.gelu", "torch", "kernreg_fixture_module.impl:gelu_reference", reference=True
    )
)
kernreg.register_kernel(
    kernreg.KernelSpec("fixture.gelu", "aot", "kernreg_fixture_module.impl:gelu_aot", priority=5)
)

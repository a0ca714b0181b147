import kernreg

KERNREG_PLUGIN_API = 2

kernreg.register_kernel(
    kernreg.KernelSpec(
        "fixture.future_module", "torch", "kernreg_fixture_wrong_api:kernel", reference=True
    )
)

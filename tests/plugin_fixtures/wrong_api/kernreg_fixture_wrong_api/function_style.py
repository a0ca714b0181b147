from kernreg import KernelSpec

KERNREG_PLUGIN_API = 2


def register(registry):
    registry.register(
        KernelSpec("fixture.future", "torch", "kernreg_fixture_wrong_api:kernel", reference=True)
    )

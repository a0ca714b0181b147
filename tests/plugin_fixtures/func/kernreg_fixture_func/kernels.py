from kernreg import KernelSpec

KERNREG_PLUGIN_API = 1


def register(registry):
    registry.register(
        KernelSpec(
            "fixture.scale", "torch", "kernreg_fixture_func.impl:scale_reference", reference=True
        )
    )
    registry.register(
        KernelSpec("fixture.scale", "triton", "kernreg_fixture_func.impl:scale_fast", priority=10)
    )

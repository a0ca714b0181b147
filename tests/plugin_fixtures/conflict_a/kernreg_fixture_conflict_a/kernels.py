from kernreg import KernelSpec


def register(registry):
    registry.register(
        KernelSpec(
            "fixture.conflict", "torch", "kernreg_fixture_conflict_a.impl:kernel", reference=True
        )
    )
    registry.register(
        KernelSpec("fixture.conflict", "triton", "kernreg_fixture_conflict_a.impl:kernel")
    )

from kernreg import KernelSpec


def register(registry):
    # Registered before the conflicting one: a failed load must take it away again.
    registry.register(
        KernelSpec(
            "fixture.extra", "torch", "kernreg_fixture_conflict_b.impl:extra", reference=True
        )
    )
    registry.register(
        KernelSpec("fixture.conflict", "triton", "kernreg_fixture_conflict_b.impl:kernel")
    )

from kernreg import KernelSpec
from kernreg_fixture_broken import leave_marker

leave_marker("half")


def register(registry):
    registry.register(
        KernelSpec("fixture.half", "torch", "kernreg_fixture_broken:kernel", reference=True)
    )
    # A deliberate override of whatever the host registered: undone with the rest.
    registry.register(
        KernelSpec("fixture.half", "triton", "kernreg_fixture_broken:kernel"), replace=True
    )
    # Settings it changes are undone too: the host must still be able to register.
    registry.configure(None)
    registry.use_plan(None)
    registry.freeze()
    raise ValueError("kernreg_fixture_broken.half fails half-way through registering")

import kernreg
from kernreg_fixture_broken import leave_marker

leave_marker("on_import")
kernreg.register_kernel(
    kernreg.KernelSpec("fixture.broken", "torch", "kernreg_fixture_broken:kernel", reference=True)
)
raise RuntimeError("kernreg_fixture_broken.on_import fails on import")

"""Pins: `use_backend` blocks (context-local: threads, asyncio tasks, copied contexts), the
patterns they match and how they nest; each context decides by its own pins alone. Also
compile-safe regions, the blocks that narrow every decision to compile-safe
implementations."""

from __future__ import annotations

import asyncio
import contextvars
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kernreg
from _support import FakeTensor, cuda_registry, recording_impl, shape_changing_op
from kernreg import KernelRegistry, KernelSpec, NoEligibleKernelError, use_backend
from kernreg.config import ConfigWarning
from kernreg.pins import compile_region

# --- use_backend vets its pattern ---------------------------------------------------------


def _double(x: int) -> int:
    return 2 * x


def _triple(x: int) -> int:
    return 3 * x


def test_use_backend_around_a_scoped_registry_that_it_pinned_does_not_warn() -> None:
    registry = kernreg.default_registry()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with kernreg.use_backend("round.scopedpin", "slow"), registry.scoped():
            registry.register(KernelSpec("round.scopedpin", "fast", _double, priority=1))
            registry.register(KernelSpec("round.scopedpin", "slow", _triple))
            assert kernreg.get_kernel("round.scopedpin")(1) == 3
    assert "round.scopedpin" not in registry.ops()


def test_use_backend_that_matched_nothing_still_warns_after_a_used_block() -> None:
    registry = kernreg.default_registry()
    with registry.scoped():
        registry.register(KernelSpec("round.usedonce", "slow", _triple))
        with kernreg.use_backend("round.usedonce", "slow"):
            kernreg.get_kernel("round.usedonce")
    # A later block of another pattern is not taken for the used one.
    with (
        pytest.warns(ConfigWarning, match="pinned nothing"),
        kernreg.use_backend("round.neverregistered", "slow"),
    ):
        pass


def test_use_backend_loads_no_plugin_to_vet_a_pattern_a_registry_has(tmp_path: Path) -> None:
    # An installed plugin that leaves a mark when it is loaded.
    (tmp_path / "pins_marker_plugin.py").write_text(
        "import pathlib\n"
        "pathlib.Path(__file__).with_name('loaded').touch()\n"
        "def register(registry):\n"
        "    pass\n"
    )
    info = tmp_path / "pins_marker_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: pins-marker-plugin\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[kernreg.kernels]\nmarker = pins_marker_plugin:register\n"
    )
    program = textwrap.dedent(
        """
        import pathlib, sys, warnings
        import kernreg
        from kernreg import KernelSpec
        loaded = pathlib.Path(sys.argv[1]) / "loaded"
        kernreg.default_registry().register(KernelSpec("round.haveit", "torch", "math:fabs"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with kernreg.use_backend("round.haveit", "torch"):
                pass  # nothing decided: the pattern is vetted against the registries
        print("during", loaded.exists())
        kernreg.select_kernel("round.haveit")  # a decision does load the plugins
        print("after", loaded.exists())
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    env["KERNREG_PLATFORM"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", program, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["during", "False", "after", "True"]


# --- pins in other threads and tasks ------------------------------------------------------


def test_a_block_open_in_another_thread_leaves_this_threads_path_alone() -> None:
    registry = cuda_registry()
    bf16, callers = recording_impl("bf16")
    scale = shape_changing_op(registry, bf16)
    x = FakeTensor("bfloat16")
    assert [scale(x), scale(x)] == ["bf16", "bf16"]
    assert callers[-1] is scale.__code__
    opened, release = threading.Event(), threading.Event()
    seen: list[str] = []

    def pinned() -> None:
        with kernreg.use_backend("stress.scale", "torch"):
            seen.append(scale(x))
            opened.set()
            release.wait(10)
            seen.append(scale(x))

    thread = threading.Thread(target=pinned)
    thread.start()
    try:
        assert opened.wait(10)
        assert scale(x) == "bf16"  # not the other thread's pin
        assert scale.explain_call(x).chosen.backend == "bf16"
    finally:
        release.set()
        thread.join(10)
    assert seen == ["reference", "reference"]
    assert [scale(x), scale(x)] == ["bf16", "bf16"]
    assert callers[-1] is scale.__code__


def test_a_block_closed_in_another_task_leaves_no_op_on_the_slow_path() -> None:
    registry = cuda_registry()
    bf16, callers = recording_impl("bf16")
    scale = shape_changing_op(registry, bf16)
    x = FakeTensor("bfloat16")

    async def pinned() -> AsyncIterator[str]:
        with kernreg.use_backend("stress.scale", "torch"):
            yield scale(x)

    async def main() -> list[str]:
        generator = pinned()
        first = await generator.__anext__()
        # Finalised by another task than the one that opened the block.
        await asyncio.get_running_loop().create_task(generator.aclose())
        return [first, scale(x)]

    assert asyncio.run(main()) == ["reference", "bf16"]
    assert [scale(x), scale(x)] == ["bf16", "bf16"]
    assert callers[-1] is scale.__code__  # off the slow path: called directly again


def test_a_pin_in_one_task_does_not_reach_a_concurrent_task() -> None:
    registry = cuda_registry()
    scale = shape_changing_op(registry)
    x = FakeTensor("bfloat16")

    async def pinned(ready: asyncio.Event, done: asyncio.Event) -> str:
        with kernreg.use_backend("stress.scale", "torch"):
            ready.set()
            await done.wait()
            return scale(x)

    async def free(ready: asyncio.Event, done: asyncio.Event) -> str:
        await ready.wait()
        result = scale(x)
        done.set()
        return result

    async def main() -> list[str]:
        ready, done = asyncio.Event(), asyncio.Event()
        return list(await asyncio.gather(pinned(ready, done), free(ready, done)))

    assert asyncio.run(main()) == ["reference", "bf16"]


def test_a_call_that_re_dispatches_under_a_pin_never_publishes_the_pinned_choice() -> None:
    registry = cuda_registry()
    bf16, callers = recording_impl("bf16")
    scale = shape_changing_op(registry, bf16)
    x = FakeTensor("bfloat16")
    outside: list[str] = []
    with kernreg.use_backend("stress.scale", "torch"):
        # The op's first call is decided inside the block: the pinned choice.
        assert scale(x) == "reference"
        # Another thread, outside the block, never gets it.
        thread = threading.Thread(target=lambda: outside.append(scale(x)))
        thread.start()
        thread.join(10)
    assert outside == ["bf16"]
    assert [scale(x), scale(x)] == ["bf16", "bf16"]
    assert callers[-1] is scale.__code__


def test_pinned_decisions_stay_bounded_when_every_request_opens_a_block() -> None:
    registry = cuda_registry()
    scale = shape_changing_op(registry)
    x = FakeTensor("bfloat16")
    # More blocks than the op keeps pinned decisions for (256); what they retain is measured
    # by benchmarks/bench_stress.py.
    for _ in range(300):
        with kernreg.use_backend("stress.scale", "torch"):
            assert scale(x) == "reference"
    assert scale(x) == "bf16"


# --- each context decides by its own pins ----------------------------------------------------


def _scale_op(registry: KernelRegistry) -> Any:
    """``demo.scale``: the reference (torch) doubles, ``fast`` (priority 10) adds 100."""

    @kernreg.op("demo.scale", registry=registry)
    def scale(x: float) -> float:
        return x * 2

    @scale.register("fast", priority=10)
    def fast(x: float) -> float:
        return x * 2 + 100

    return scale


@pytest.fixture
def scale(make_registry: Callable[..., KernelRegistry]) -> Any:
    return _scale_op(make_registry("cpu"))


class _BlockElsewhere:
    """A use_backend block held open in another thread."""

    def __init__(self, pattern: str, backend: str) -> None:
        self.pattern, self.backend = pattern, backend
        self.opened, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._hold)

    def _hold(self) -> None:
        with use_backend(self.pattern, self.backend):
            self.opened.set()
            self.release.wait(30)

    def __enter__(self) -> _BlockElsewhere:
        self.thread.start()
        assert self.opened.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.thread.join(30)


def test_blocks_of_generators_consumed_interleaved_leave_no_pin_behind(scale: Any) -> None:
    def stream(backend: str) -> Iterator[float]:
        with use_backend("demo.scale", backend):
            yield scale(1.0)
            yield scale(1.0)

    first, second = stream("torch"), stream("fast")
    assert next(first) == 2.0
    assert next(second) == 102.0
    assert next(first) == 102.0  # the innermost block open in this context is second's
    assert next(second) == 102.0
    for gen in (first, second):  # first ends before second: out of order
        assert next(gen, None) is None
    assert scale(1.0) == 102.0
    assert scale.select().backend == "fast"
    with _BlockElsewhere("demo.*", "torch"):  # the survivor would wake up here
        assert scale(1.0) == 102.0
        assert kernreg.select_kernel("demo.scale", registry=scale.registry).backend == "fast"


def test_generators_closed_in_reverse_order_restore_each_enclosing_pin(scale: Any) -> None:
    def stream(backend: str) -> Iterator[float]:
        with use_backend("demo.scale", backend):
            while True:
                yield scale(1.0)

    outer, inner = stream("torch"), stream("fast")
    next(outer)
    next(inner)
    outer.close()  # the outer block ends first: the inner one still pins
    assert scale(1.0) == 102.0
    assert next(inner) == 102.0
    inner.close()
    with use_backend("demo.scale", "torch"):
        assert scale(1.0) == 2.0
    assert scale(1.0) == 102.0


@pytest.mark.parametrize("elsewhere", [False, True], ids=["alone", "block-elsewhere"])
def test_a_context_copied_inside_a_block_decides_by_its_own_pins(
    scale: Any, elsewhere: bool
) -> None:
    with use_backend("demo.scale", "torch"):
        copied = contextvars.copy_context()
    assert scale(1.0) == 102.0  # the block has ended here
    blocks = _BlockElsewhere("demo.*", "torch") if elsewhere else None
    if blocks is not None:
        blocks.__enter__()
    try:
        # The copy holds the pin whatever other threads have open.
        assert copied.run(scale, 1.0) == 2.0
        assert copied.run(scale.select).backend == "torch"
        assert copied.run(kernreg.get_kernel, "demo.scale", registry=scale.registry)(1.0) == 2.0
        assert scale(1.0) == 102.0
    finally:
        if blocks is not None:
            blocks.__exit__(None, None, None)


@pytest.mark.parametrize("elsewhere", [False, True], ids=["alone", "block-elsewhere"])
def test_tasks_created_inside_a_block_keep_its_pin_after_it_ends(
    scale: Any, elsewhere: bool
) -> None:
    async def main() -> tuple[float, float, float]:
        started = asyncio.Event()

        async def later() -> float:
            await started.wait()
            return float(scale(1.0))

        with use_backend("demo.scale", "torch"):
            task = asyncio.create_task(later())
            in_thread = asyncio.ensure_future(asyncio.to_thread(lambda: started.wait))
        outside = float(scale(1.0))
        await in_thread
        started.set()
        return await task, outside, float(await asyncio.to_thread(scale, 1.0))

    blocks = _BlockElsewhere("demo.*", "torch") if elsewhere else None
    if blocks is not None:
        blocks.__enter__()
    try:
        in_task, outside, after = asyncio.run(main())
    finally:
        if blocks is not None:
            blocks.__exit__(None, None, None)
    assert (in_task, outside, after) == (2.0, 102.0, 102.0)


def test_a_thread_decides_by_its_own_pins_while_another_holds_a_block(scale: Any) -> None:
    with _BlockElsewhere("demo.scale", "torch"):
        assert scale(1.0) == 102.0
        assert kernreg.select_kernel("demo.scale", registry=scale.registry).backend == "fast"
        with use_backend("demo.*", "torch"):
            assert scale(1.0) == 2.0
        assert scale(1.0) == 102.0


def test_an_inner_glob_without_the_backend_leaves_the_enclosing_exact_pin(scale: Any) -> None:
    registry = scale.registry

    @kernreg.op("demo.other", registry=registry)
    def other(x: float) -> float:
        return x

    @other.register("special")
    def special(x: float) -> float:
        return x + 7

    with use_backend("demo.scale", "torch"), use_backend("demo.*", "special"):
        assert scale(1.0) == 2.0  # demo.scale has no 'special': the exact pin holds
        assert scale.select().backend == "torch"
        assert kernreg.get_kernel("demo.scale", registry=registry)(1.0) == 2.0
        decision = kernreg.explain("demo.scale", registry=registry)
        assert decision.rule == "scoped_pin"
        assert any("does not apply" in note for note in decision.notes)
        assert other(1.0) == 8.0  # the glob pins the op that has the backend
    with use_backend("demo.*", "special"), use_backend("demo.scale", "fast"):
        assert scale(1.0) == 102.0


def test_an_inner_exact_pin_wins_over_an_enclosing_glob(scale: Any) -> None:
    with use_backend("demo.*", "torch"), use_backend("demo.scale", "fast"):
        assert scale(1.0) == 102.0
    with use_backend("demo.scale", "fast"), use_backend("demo.*", "torch"):
        assert scale(1.0) == 2.0  # the innermost pin that applies wins


def test_a_backend_typo_in_use_backend_names_the_registered_ones_and_suggests(
    scale: Any,
) -> None:
    registry = scale.registry
    for call in (
        lambda: scale(1.0),
        scale.select,
        lambda: kernreg.select_kernel("demo.scale", registry=registry),
        lambda: kernreg.get_kernel("demo.scale", registry=registry),
    ):
        with use_backend("demo.scale", "fsat"), pytest.raises(NoEligibleKernelError) as info:
            call()
        first_line = str(info.value).splitlines()[0]
        assert "no implementation of op 'demo.scale' has backend 'fsat'" in first_line
        assert "registered: fast, torch" in first_line
        assert "did you mean 'fast'?" in first_line
        statuses = {c.status for c in info.value.decision.candidates}
        assert statuses == {"eligible"}  # eligible, but not selected: the pin names none
        assert all(
            "not selected: pin demo.scale=fsat" in " ".join(c.reasons)
            for c in info.value.decision.candidates
        )


def test_a_variant_typo_in_use_backend_names_the_registered_implementations(
    scale: Any,
) -> None:
    with use_backend("demo.scale", "fast", "v2"), pytest.raises(NoEligibleKernelError) as info:
        scale(1.0)
    assert "has backend 'fast/v2' (registered: fast, torch)" in str(info.value)


def test_an_explicit_backend_typo_suggests_the_closest_backend(scale: Any) -> None:
    with pytest.raises(kernreg.BackendNotFoundError, match=r"did you mean 'fast'\?"):
        kernreg.select_kernel("demo.scale", "fsat", registry=scale.registry)


def test_a_block_of_an_async_generator_closed_by_another_task_ends_its_pin(scale: Any) -> None:
    async def pinned() -> Any:
        with use_backend("demo.scale", "torch"):
            yield scale(1.0)

    async def main() -> list[float]:
        generator = pinned()
        first = await generator.__anext__()
        # Finalised by another task than the one that opened the block.
        await asyncio.get_running_loop().create_task(generator.aclose())
        return [first, scale(1.0), scale.select().backend == "fast"]

    assert asyncio.run(main()) == [2.0, 102.0, True]


def test_an_op_defined_after_its_block_ended_follows_a_copied_context_that_holds_it(
    scale: Any,
) -> None:
    import gc

    with use_backend("demo.*", "torch"):
        copied = contextvars.copy_context()

    @kernreg.op("demo.late", registry=scale.registry)
    def late(x: float) -> float:
        return x * 2

    @late.register("fast", priority=10)
    def late_fast(x: float) -> float:
        return x * 2 + 100

    assert copied.run(late, 1.0) == 2.0  # the copy still holds the block
    assert late(1.0) == 102.0
    del copied
    gc.collect()
    assert late(1.0) == 102.0
    with use_backend("demo.late", "torch"):
        assert late(1.0) == 2.0
    assert late(1.0) == 102.0


# --- compile-safe regions ------------------------------------------------------------------


def _region_op(registry: KernelRegistry) -> tuple[Any, list[Any]]:
    """``demo.norm``: the plain-torch reference doubles; ``fused`` (priority 10, not
    compile-safe) returns 102.0; ``traced`` (priority 5, ``compile_safe``) adds 10. Also
    the callers of ``fused``, to see that the op object calls it directly."""
    fused, callers = recording_impl(102.0)

    @kernreg.op("demo.norm", registry=registry)
    def norm(x: float) -> float:
        return x * 2

    norm.register("fused", fused, priority=10)

    @norm.register("traced", priority=5, traits=["compile_safe"])
    def traced(x: float) -> float:
        return x * 2 + 10

    return norm, callers


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_region_chooses_compile_safe_implementations_and_its_end_restores(
    make_registry: Callable[..., KernelRegistry], warm: bool
) -> None:
    """sglang's ``enter_torch_compile()`` / ``leave_torch_compile()``, restated: inside the
    region every lookup takes the compile-safe path, and the op's own choice returns after."""
    registry = make_registry("cpu")
    norm, callers = _region_op(registry)
    if warm:
        assert norm(1.0) == 102.0
    with compile_region():
        assert norm(1.0) == 12.0
        assert kernreg.get_kernel("demo.norm", registry=registry)(1.0) == 12.0
        assert kernreg.select_kernel("demo.norm", registry=registry).backend == "traced"
        assert norm.select().backend == "traced"
        decision = norm.explain()
        rows = {c.spec.label: (c.status, c.reasons) for c in decision.candidates}
        assert rows["fused"] == ("rejected", ("not compile_safe: inside a compile-safe region",))
        assert rows["traced"][0] == "chosen"
        assert any("compile-safe region" in note for note in decision.notes)
    assert [norm(1.0), norm(1.0)] == [102.0, 102.0]  # (a cold op decides on the first)
    assert callers[-1] is norm.__code__
    assert kernreg.get_kernel("demo.norm", registry=registry)(1.0) == 102.0
    assert "compile-safe region" not in str(norm.explain())


def test_regions_nest_and_entering_one_again_changes_nothing(
    make_registry: Callable[..., KernelRegistry],
) -> None:
    """sglang's enter is idempotent (one op serves many layers); here a region entered
    again inside one decides alike, and only the outermost end restores."""
    norm, callers = _region_op(make_registry("cpu"))
    assert norm(1.0) == 102.0
    with compile_region() as outer:
        assert norm(1.0) == 12.0
        with compile_region() as inner:
            assert norm(1.0) == 12.0
            assert sum("compile-safe region" in n for n in norm.explain().notes) == 1
        assert inner == outer
        assert norm(1.0) == 12.0
    assert norm(1.0) == 102.0
    assert callers[-1] is norm.__code__  # called directly again: no region is live
    assert norm.select().backend == "fused"


def test_the_plain_torch_reference_counts_as_compile_safe_and_another_does_not(
    make_registry: Callable[..., KernelRegistry],
) -> None:
    registry = make_registry("cpu")

    @kernreg.op("demo.plain", registry=registry)
    def plain(x: float) -> float:
        return x * 2

    plain.register("fused", lambda x: x * 2 + 100, priority=10)

    @kernreg.op("demo.opaque", backend="aten", registry=registry)
    def opaque(x: float) -> float:
        return x * 2

    opaque.register("fused", lambda x: x * 2 + 100, priority=10)
    with compile_region():
        assert plain(1.0) == 2.0
        assert plain.explain().rule == "reference"
        with pytest.raises(NoEligibleKernelError, match="not compile_safe: inside a compile"):
            opaque(1.0)
    assert (plain(1.0), opaque(1.0)) == (102.0, 102.0)


def test_an_explicit_backend_or_a_pin_inside_a_region_must_be_compile_safe(
    make_registry: Callable[..., KernelRegistry],
) -> None:
    registry = make_registry("cpu")
    norm, _ = _region_op(registry)
    with compile_region():
        with pytest.raises(NoEligibleKernelError, match="not compile_safe: inside a compile"):
            kernreg.get_kernel("demo.norm", "fused", registry=registry)
        with use_backend("demo.norm", "torch"):
            assert norm(1.0) == 2.0
        with use_backend("demo.norm", "fused"), pytest.raises(NoEligibleKernelError):
            norm(1.0)
    with use_backend("demo.norm", "fused"):
        assert norm(1.0) == 102.0


def test_a_thread_and_a_task_outside_a_region_keep_the_fast_kernel(
    make_registry: Callable[..., KernelRegistry],
) -> None:
    norm, _ = _region_op(make_registry("cpu"))
    opened, release = threading.Event(), threading.Event()
    inside: list[float] = []

    def hold() -> None:
        with compile_region():
            inside.append(norm(1.0))
            opened.set()
            release.wait(30)
            inside.append(norm(1.0))

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert opened.wait(30)
        assert norm(1.0) == 102.0
        assert norm.explain_call(1.0).chosen.backend == "fused"
    finally:
        release.set()
        thread.join(30)
    assert inside == [12.0, 12.0]

    async def in_region(ready: asyncio.Event, done: asyncio.Event) -> float:
        with compile_region():
            ready.set()
            await done.wait()
            return float(norm(1.0))

    async def outside(ready: asyncio.Event, done: asyncio.Event) -> float:
        await ready.wait()
        result = float(norm(1.0))
        done.set()
        return result

    async def main() -> list[float]:
        ready, done = asyncio.Event(), asyncio.Event()
        return list(await asyncio.gather(in_region(ready, done), outside(ready, done)))

    assert asyncio.run(main()) == [12.0, 102.0]


def test_a_selection_plan_does_not_apply_inside_a_region(
    make_registry: Callable[..., KernelRegistry],
) -> None:
    from kernreg.registry import build_plan

    registry = make_registry("cpu")
    norm, _ = _region_op(registry)
    registry.use_plan(build_plan(registry))
    assert norm(1.0) == 102.0
    assert norm.explain().rule == "plan"
    with compile_region():  # no PlanWarning (warnings are errors here): the plan is eager's
        assert norm(1.0) == 12.0
        assert norm.explain().rule == "priority"
    assert norm.explain().rule == "plan"

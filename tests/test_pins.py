"""Scoped pins (``use_backend``): each context decides by its own pins alone."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import kernreg
from kernreg import KernelRegistry, NoEligibleKernelError, use_backend


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

"""Pins: `use_backend` blocks (context-local: threads, asyncio tasks) and the patterns they
match."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import kernreg
from _support import FakeTensor, cuda_registry, recording_impl, shape_changing_op
from kernreg import ConfigWarning, KernelSpec

# --- use_backend vets its pattern ---------------------------------------------------------


def _double(x: int) -> int:
    return 2 * x


def _triple(x: int) -> int:
    return 3 * x


def test_use_backend_around_a_scoped_registry_that_it_pinned_does_not_warn() -> None:
    registry = kernreg.registry
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with kernreg.use_backend("round.scopedpin", "slow"), registry.scoped():
            registry.register(KernelSpec("round.scopedpin", "fast", _double, priority=1))
            registry.register(KernelSpec("round.scopedpin", "slow", _triple))
            assert kernreg.get_kernel("round.scopedpin")(1) == 3
    assert "round.scopedpin" not in registry.ops()


def test_use_backend_that_matched_nothing_still_warns_after_a_used_block() -> None:
    registry = kernreg.registry
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
        kernreg.registry.register(KernelSpec("round.haveit", "torch", "math:fabs"))
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

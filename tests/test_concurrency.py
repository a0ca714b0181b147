"""Thread safety: concurrent registration loses nothing, and no call sees a stale decision."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import kernreg
from kernreg import KernelRegistry, KernelSpec

WRITERS = 8
PER_WRITER = 150
REPLACEMENTS = 300


@pytest.fixture(autouse=True)
def _frequent_thread_switches() -> Iterator[None]:
    """Switch threads far more often than usual, so interleavings actually happen."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


class Tensor:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self.device = "cuda:0"


def _run(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()


def _versioned(n: int) -> Callable[..., int]:
    def impl(*args: Any, **kwargs: Any) -> int:
        return n

    return impl


def test_concurrent_registration_loses_nothing(registry: KernelRegistry) -> None:
    @kernreg.op("conc.rms", registry=registry)
    def rms(x: Any) -> str:
        return "ref"

    rms.register("fast", lambda x: "fast", dtypes=["bf16"])
    done = threading.Event()
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for j in range(PER_WRITER):
                op = f"conc.op{j % 5}"
                registry.register(KernelSpec(op, f"w{w}", _versioned(j), variant=f"v{j}"))
        except BaseException as exc:
            errors.append(exc)

    def reader() -> None:
        try:
            while not done.is_set():
                assert rms(Tensor("bfloat16")) == "fast"
                assert rms(Tensor("float32")) == "ref"
                assert registry.get_kernel("conc.rms", dtypes=["bf16"])("x") == "fast"
                for op in registry.ops():
                    registry.explain(op)
                registry.all_specs()
        except BaseException as exc:
            errors.append(exc)

    readers = [threading.Thread(target=reader) for _ in range(3)]
    writers = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
    for thread in readers:
        thread.start()
    _run(writers)
    done.set()
    for thread in readers:
        thread.join(60)
    assert errors == []
    assert len(registry) == 2 + WRITERS * PER_WRITER
    for w in range(WRITERS):
        for j in range(PER_WRITER):
            assert registry.get_backend(f"conc.op{j % 5}", f"w{w}", f"v{j}").target(0) == j
    assert registry.ops() == (
        "conc.op0",
        "conc.op1",
        "conc.op2",
        "conc.op3",
        "conc.op4",
        "conc.rms",
    )


@pytest.mark.parametrize("gated", [False, True])
def test_no_call_sees_a_replaced_implementation(registry: KernelRegistry, gated: bool) -> None:
    """Once ``register(replace=True)`` has returned, every call started later runs the new one."""

    @kernreg.op("conc.rms", registry=registry)
    def rms(x: Any) -> int:
        return -1

    gate: dict[str, Any] = {"dtypes": ["bf16"]} if gated else {}
    rms.register("triton", _versioned(0), **gate)
    published = [0]
    done = threading.Event()
    stale: list[tuple[str, int, int]] = []
    errors: list[BaseException] = []

    def replacer() -> None:
        try:
            for n in range(1, REPLACEMENTS + 1):
                registry.register(
                    KernelSpec("conc.rms", "triton", _versioned(n), **gate), replace=True
                )
                published[0] = n
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    def caller(how: str) -> None:
        arg = Tensor("bfloat16")
        try:
            while not done.is_set():
                before = published[0]
                if how == "op":
                    seen = rms(arg)
                else:
                    seen = registry.get_kernel("conc.rms", dtypes=["bf16"])(arg)
                if seen < before:
                    stale.append((how, before, seen))
        except BaseException as exc:
            errors.append(exc)

    callers = [
        threading.Thread(target=caller, args=(how,)) for how in ("op", "op", "op", "get_kernel")
    ]
    _run([threading.Thread(target=replacer), *callers])
    assert errors == []
    assert stale == []
    assert rms(Tensor("bfloat16")) == REPLACEMENTS
    assert registry.get_kernel("conc.rms", dtypes=["bf16"])() == REPLACEMENTS


def test_unregister_racing_lookups(registry: KernelRegistry) -> None:
    """A lookup racing an unregister returns the old or the new answer, and never keeps the old."""

    @kernreg.op("conc.rms", registry=registry)
    def rms(x: Any) -> str:
        return "ref"

    fast = lambda x: "fast"  # noqa: E731
    removed = [False]
    errors: list[BaseException] = []
    done = threading.Event()

    def toggler() -> None:
        try:
            for _ in range(200):
                rms.register("triton", fast)
                removed[0] = False
                registry.unregister("conc.rms", "triton")
                removed[0] = True
        finally:
            done.set()

    def caller() -> None:
        try:
            while not done.is_set():
                rms(1)
                registry.get_kernel("conc.rms")
        except BaseException as exc:
            errors.append(exc)

    _run([threading.Thread(target=toggler), *(threading.Thread(target=caller) for _ in range(3))])
    assert errors == []
    assert removed[0]
    assert rms(1) == "ref"
    assert registry.get_kernel("conc.rms") is rms.reference

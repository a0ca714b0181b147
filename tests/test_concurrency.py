"""Thread safety: concurrent registration loses nothing, and no call sees a stale decision."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import kernreg
from _support import FakeDevice, FakeTensor, cuda_registry, run_python, shape_changing_op
from kernreg import KernelRegistry, KernelSpec, Platform
from kernreg.config import Config

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


def _slow_false() -> bool:
    time.sleep(0.0002)
    return False


@pytest.mark.parametrize("what", ["platform", "config"])
def test_lookups_racing_a_reconfiguration_never_keep_the_old_answer(what: str) -> None:
    """The decision caches take no lock: a lookup that read the old platform or
    configuration while another thread reconfigured must not leave its answer for later
    lookups."""
    registry = cuda_registry()
    registry.register(KernelSpec("conc.act", "torch", _versioned(0), reference=True))
    registry.register(KernelSpec("conc.act", "cuda", _versioned(1), requires=["cuda"]))
    # A process-state predicate runs inside every decision: it holds each one open long
    # enough for the reconfiguration to land in the middle of it.
    slow = KernelSpec("conc.act", "slow", _versioned(2), priority=-1, when=_slow_false)
    registry.register(slow)
    cuda = Platform.parse("cuda:9.0")
    settings = {
        "platform": [(Config(), Platform.parse("cpu")), (Config(), cuda)],
        "config": [(Config(deny=["conc.act=cuda"]), cuda), (Config(), cuda)],
    }[what]
    errors: list[BaseException] = []
    done = threading.Event()

    def toggler() -> None:
        try:
            for i in range(300):
                config, platform = settings[i % 2]
                registry.configure(config, platform=platform)
                time.sleep(0.0001 * (i % 3))
        finally:
            registry.configure(*settings[0][:1], platform=settings[0][1])
            done.set()

    def caller() -> None:
        try:
            while not done.is_set():
                kernreg.select_kernel("conc.act", registry=registry)
                registry.get_kernel("conc.act")
                registry.explain("conc.act")
        except BaseException as exc:
            errors.append(exc)

    _run([threading.Thread(target=toggler), *(threading.Thread(target=caller) for _ in range(3))])
    assert errors == []
    assert kernreg.select_kernel("conc.act", registry=registry).backend == "torch"
    assert registry.get_kernel("conc.act")() == 0
    assert registry.explain("conc.act").chosen.backend == "torch"


@pytest.mark.parametrize("lookup", ["select_kernel", "get_kernel", "explain"])
@pytest.mark.parametrize("what", ["platform", "config"])
def test_a_change_made_during_a_decision_is_not_cached_over(what: str, lookup: str) -> None:
    """A decision that read the old state while the registry changed answers its own call,
    and the next call decides again (the change lands inside the decision, from its
    process-state predicate: no timing involved)."""
    registry = cuda_registry()
    registry.register(KernelSpec("conc.act", "torch", _versioned(0), reference=True))
    registry.register(KernelSpec("conc.act", "cuda", _versioned(1), requires=["cuda"]))
    change: list[tuple[Config, Platform]] = []

    def predicate() -> bool:
        if change:
            config, platform = change.pop()
            registry.configure(config, platform=platform)
        return False

    registry.register(KernelSpec("conc.act", "probe", _versioned(2), priority=-1, when=predicate))
    cuda = Platform.parse("cuda:9.0")
    later = {
        "platform": (Config(), Platform.parse("cpu")),
        "config": (Config(deny=["conc.act=cuda"]), cuda),
    }
    change.append(later[what])

    def backend() -> str:
        if lookup == "select_kernel":
            return kernreg.select_kernel("conc.act", registry=registry).backend
        if lookup == "get_kernel":
            return ["torch", "cuda"][registry.get_kernel("conc.act")()]
        return registry.explain("conc.act").chosen.backend

    assert backend() == "cuda"  # decided on the state it read
    assert not change
    assert backend() == "torch"
    assert backend() == "torch"


# --- registries that change shape under running calls, threads importing torch, forks -----


@contextlib.contextmanager
def _switch_often() -> Iterator[None]:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def test_eight_callers_and_a_mutating_thread_never_break_an_op() -> None:
    """12 trials: 8 threads call while one implementation is removed (what the op object
    reads of a call changes: dtype+device -> dtype); afterwards every call of the op must
    still work, and none may have failed meanwhile. benchmarks/bench_stress.py runs the
    longer load."""
    inputs = [FakeTensor("float32", FakeDevice("cuda")), FakeTensor("bfloat16", FakeDevice("cpu"))]
    errors: list[BaseException] = []
    trials = calls = 0
    with _switch_often():
        while trials < 12 and not errors:
            trials += 1
            registry = cuda_registry()
            scale = shape_changing_op(registry)
            removed = ("gpu", "bf16")[trials % 2]
            start = threading.Barrier(9)

            def caller(scale: Any = scale, start: threading.Barrier = start) -> None:
                start.wait()
                for _ in range(150):
                    for x in inputs:
                        try:
                            scale(x)
                        except BaseException as exc:  # the defect: 'dict' object is not callable
                            errors.append(exc)
                            return

            threads = [threading.Thread(target=caller) for _ in range(8)]
            for thread in threads:
                thread.start()
            start.wait()
            registry.unregister("stress.scale", removed)
            if trials % 3 == 0:
                with registry.scoped():  # a scoped() exit changes the shape back and forth
                    registry.unregister("stress.scale", "gpu" if removed == "bf16" else "bf16")
            for thread in threads:
                thread.join(30)
            for x in inputs * 3:  # broken for good is the worst outcome: check after the storm
                try:
                    scale(x)
                    calls += 1
                except BaseException as exc:
                    errors.append(exc)
    assert errors == [], f"{len(errors)} failed calls in {trials} trials: {errors[0]!r}"
    assert calls == trials * 6


def test_calls_work_while_another_thread_imports_torch() -> None:
    pytest.importorskip("torch")
    result = run_python(
        """
        import sys, threading
        import kernreg
        from kernreg import KernelRegistry, Platform
        from kernreg.config import Config

        registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))

        @kernreg.op("demo.twice", registry=registry)
        def twice(x):
            return x * 2

        importer = threading.Thread(target=lambda: __import__("torch"))
        sys.setswitchinterval(1e-6)
        importer.start()
        calls = 0
        while importer.is_alive() or calls < 100:
            # Every registration sends the next call through the "is torch.compile
            # tracing?" check, while torch is half imported in the other thread.
            twice.register("fast", lambda x: x * 2, priority=1, replace=True)
            assert twice(calls) == calls * 2
            calls += 1
        importer.join()
        print("ok", calls)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_during_another_threads_first_selection_does_not_hang_the_child() -> None:
    pytest.importorskip("torch")
    result = run_python(
        """
        import os, sys, threading, time
        import kernreg

        @kernreg.op("demo.forked")
        def forked(x):
            return x + 1

        # The first selection detects the platform, which imports torch (~1.5 s).
        first = threading.Thread(target=lambda: forked(1))
        first.start()
        time.sleep(0.3)
        pid = os.fork()
        if pid == 0:
            os.write(1, f"child {forked(41)}\\n".encode())
            os._exit(0)
        deadline = time.time() + 30
        while time.time() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                print("exit", status)
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            print("hung")
        first.join()
        print("parent", forked(1))
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "child 42" in result.stdout, result.stdout
    assert "exit 0" in result.stdout, result.stdout
    assert "parent 2" in result.stdout


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_while_another_thread_holds_the_registry_lock() -> None:
    result = run_python(
        """
        import os, threading, time
        import kernreg
        from kernreg import KernelRegistry, Platform
        from kernreg.config import Config

        registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))

        @kernreg.op("demo.locked", registry=registry)
        def locked(x):
            return x + 1

        held, release = threading.Event(), threading.Event()

        def hold():
            with registry._lock:
                held.set()
                release.wait(10)

        thread = threading.Thread(target=hold)
        thread.start()
        held.wait(10)
        pid = os.fork()
        if pid == 0:
            locked.register("again", lambda x: x + 1, priority=1)
            os.write(1, f"child {locked(41)}\\n".encode())
            os._exit(0)
        release.set()
        for _ in range(400):  # 20 s, then the hung child is killed (never left behind)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            status = "hung"
        thread.join()
        print("exit", status)
        """,
        timeout=60,
    )
    assert "child 42" in result.stdout, result.stderr[-3000:]
    assert "exit 0" in result.stdout, result.stdout


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_while_another_thread_loads_plugins() -> None:
    result = run_python(
        """
        import os, threading, time
        import kernreg
        from kernreg import plugins

        held, release = threading.Event(), threading.Event()

        def slow_plugin_load():  # what a plugin importing torch looks like from outside
            with plugins._loading.lock:
                held.set()
                release.wait(10)

        thread = threading.Thread(target=slow_plugin_load)
        thread.start()
        held.wait(10)
        pid = os.fork()
        if pid == 0:
            report = kernreg.plugins.load_plugins()
            os.write(1, f"child loaded {report is not None}\\n".encode())
            os._exit(0)
        release.set()
        for _ in range(400):  # 20 s, then the hung child is killed (never left behind)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            status = "hung"
        thread.join()
        print("exit", status)
        """,
        timeout=60,
    )
    assert "child loaded True" in result.stdout, result.stderr[-3000:]
    assert "exit 0" in result.stdout, result.stdout


def test_a_scope_open_in_another_thread_refuses_a_second_one_instead_of_leaking() -> None:
    # Overlapping scopes of two threads cannot both be undone: the one that closes last
    # would put back the other's registrations for good.
    registry = KernelRegistry(platform=Platform.parse("cpu"))
    opened, refused = threading.Event(), []

    def other_thread() -> None:
        opened.wait()
        try:
            with registry.scoped():
                registry.register(KernelSpec("b.op", "torch", "m:f"))
        except RuntimeError as exc:
            refused.append(str(exc))

    worker = threading.Thread(target=other_thread)
    worker.start()
    with registry.scoped():
        registry.register(KernelSpec("a.op", "torch", "m:f"))
        with registry.scoped():  # nesting in one thread stays allowed
            pass
        opened.set()
        worker.join()
    assert registry.ops() == ()
    (message,) = refused
    assert "another thread" in message
    with registry.scoped():  # closed everywhere: a scope opens again
        pass


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_another_thread_holds_a_scope_can_open_its_own() -> None:
    # The thread holding the parent's scope does not exist in the child: it blocks nothing.
    result = run_python(
        """
        import os, threading
        from kernreg import KernelRegistry, KernelSpec
        registry = KernelRegistry()
        inside, release = threading.Event(), threading.Event()

        def hold():
            with registry.scoped():
                inside.set()
                release.wait(30)

        thread = threading.Thread(target=hold)
        thread.start()
        inside.wait(30)
        pid = os.fork()
        if pid == 0:
            with registry.scoped():
                registry.register(KernelSpec("a.op", "torch", "math:fabs", reference=True))
            os.write(1, f"child ops {registry.ops()}\\n".encode())
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        try:
            with registry.scoped():
                pass
        except RuntimeError:
            print("parent refused")
        release.set()
        thread.join()
        print("child exit", os.waitstatus_to_exitcode(status))
        """,
        timeout=60,
    )
    assert "child ops ()" in result.stdout, result.stderr[-3000:]
    assert "child exit 0" in result.stdout, result.stdout
    assert "parent refused" in result.stdout

"""Thread safety: concurrent registration loses nothing, and no call sees a stale decision."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import kernreg
from _support import FakeDevice, FakeTensor, cuda_registry, run_python, shape_changing_op
from kernreg import Config, KernelRegistry, KernelSpec, OpNotFoundError, Platform

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


# --- sustained load: 16 threads call op objects while writers replace and remove their ----
# implementations; no undocumented exception, no stale decision, no deadlock.
#
# Every implementation returns the version it was registered as. A writer announces the
# result a mutation leads to before making it, and publishes it once the mutation has
# returned; a call is correct when its result is one of those announced between the last
# mutation published before the call started and the last one announced after it ended


THREADS = 16
SECONDS = 5.0
WATCHDOG = 60.0


class Arg:
    """The first argument of a call: what the per-call gate reads."""

    dtype = "float32"
    device = "cpu"


def _version(v: int) -> Callable[[Any], int]:
    def impl(x: Any) -> int:
        return v

    return impl


class Track:
    """What one op's writer has announced and published, in order."""

    def __init__(self, initial: object) -> None:
        self.results: list[object] = [initial]  # index: mutation number
        self.published = 0
        self.lock = threading.Lock()

    def announce(self, result: object) -> None:
        with self.lock:
            self.results.append(result)

    def publish(self) -> None:
        with self.lock:
            self.published = len(self.results) - 1

    def window(self) -> tuple[int, int]:
        with self.lock:
            return self.published, len(self.results) - 1


@pytest.fixture
def fast_switching() -> Iterator[None]:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # many more thread switches: many more interleavings
    yield
    sys.setswitchinterval(interval)


def test_calls_under_concurrent_mutation(fast_switching: None) -> None:
    reg = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))

    @kernreg.op("load.static", registry=reg)
    def static(x: Any) -> object:
        return "ref"

    @kernreg.op("load.gated", registry=reg)
    def gated(x: Any) -> object:
        return "ref"

    @kernreg.op("load.volatile", registry=reg)
    def volatile(x: Any) -> object:
        return "ref"

    static.register("fast", _version(0), priority=10)
    gated.register("fast", _version(0), priority=10, dtypes=["float32"], requires=["cpu"])
    volatile.register("fast", _version(0), priority=10)
    tracks = {"load.static": Track(0), "load.gated": Track(0), "load.volatile": Track(0)}
    ops = {"load.static": static, "load.gated": gated, "load.volatile": volatile}

    stop = threading.Event()
    failures: list[str] = []
    calls: Counter[str] = Counter()
    documented: Counter[str] = Counter()
    mutations: Counter[str] = Counter()
    counts_lock = threading.Lock()

    def caller(index: int) -> None:
        names = list(ops)
        local: Counter[str] = Counter()
        local_documented: Counter[str] = Counter()
        arg = Arg()
        try:
            n = 0
            while not stop.is_set():
                name = names[(index + n) % len(names)]
                n += 1
                track = tracks[name]
                first, _ = track.window()
                try:
                    result: object = ops[name](arg)
                except OpNotFoundError:
                    # Documented: the op has no implementation at all at this moment.
                    result = OpNotFoundError
                    local_documented[name] += 1
                _, last = track.window()
                allowed = track.results[first : last + 1]
                if result not in allowed:
                    failures.append(f"{name}: got {result!r}, allowed {allowed!r}")
                    stop.set()
                local[name] += 1
        except BaseException as exc:  # anything else is a failure, reported below
            failures.append(f"caller {index}: {type(exc).__name__}: {exc}")
            stop.set()
        with counts_lock:
            calls.update(local)
            documented.update(local_documented)

    def writer(name: str) -> None:
        op = ops[name]
        track = tracks[name]
        version = 0
        extra: dict[str, object] = {"gated": {"dtypes": ["float32"], "requires": ["cpu"]}}
        kwargs: Any = extra.get(name.split(".")[1], {})
        local: Counter[str] = Counter()
        try:
            while not stop.is_set():
                version += 1
                step = version % 4
                if step in (1, 2):  # replace the fast implementation with a new version
                    track.announce(version)
                    op.register("fast", _version(version), priority=10, replace=True, **kwargs)
                    local["replace"] += 1
                elif name == "load.volatile":  # remove everything, then bring it back
                    track.announce("ref")
                    reg.unregister(name, "fast")
                    track.announce(OpNotFoundError)
                    reg.unregister(name, "torch")
                    track.publish()
                    local["unregister"] += 2
                    time.sleep(0.0005)
                    track.announce("ref")
                    reg.register(kernreg.KernelSpec(name, "torch", op.reference, reference=True))
                    track.publish()
                    track.announce(version)
                    op.register("fast", _version(version), priority=10, **kwargs)
                    local["register"] += 2
                else:  # remove the fast one (the reference runs), then register it again
                    track.announce("ref")
                    reg.unregister(name, "fast")
                    track.publish()
                    local["unregister"] += 1
                    time.sleep(0.0005)
                    track.announce(version)
                    op.register("fast", _version(version), priority=10, **kwargs)
                    local["register"] += 1
                track.publish()
                time.sleep(0.0002)
        except BaseException as exc:
            failures.append(f"writer {name}: {type(exc).__name__}: {exc}")
            stop.set()
        with counts_lock:
            mutations.update(local)

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(THREADS)]
    threads += [threading.Thread(target=writer, args=(name,), daemon=True) for name in ops]
    for thread in threads:
        thread.start()
    stop.wait(SECONDS)
    stop.set()
    deadline = time.monotonic() + WATCHDOG
    for thread in threads:
        thread.join(timeout=max(deadline - time.monotonic(), 0.1))
    stuck = [t.name for t in threads if t.is_alive()]
    figures = (
        f"{THREADS} caller threads + {len(ops)} writer threads for {SECONDS:g} s: "
        f"{sum(calls.values())} calls {dict(calls)}, {sum(mutations.values())} mutations "
        f"{dict(mutations)}, documented OpNotFoundError {dict(documented)}"
    )
    assert not stuck, f"deadlock or hang: {stuck} still running; {figures}"
    assert not failures, f"{failures[:5]}; {figures}"
    assert sum(mutations.values()) > 100, figures
    assert all(calls[name] > 100 for name in ops), figures
    # Writers stopped: every op answers with the last version, through every path.
    for name, op in ops.items():
        assert op(Arg()) == tracks[name].results[-1], figures
    print(figures)


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
    """Trials until the time is up: 8 threads call while one implementation is removed
    (the per-call table changes shape: dtype+device -> dtype); afterwards every call of
    the op must still work, and none may have failed meanwhile."""
    inputs = [FakeTensor("float32", FakeDevice("cuda")), FakeTensor("bfloat16", FakeDevice("cpu"))]
    errors: list[BaseException] = []
    trials = calls = 0
    deadline = time.monotonic() + 4.0
    with _switch_often():
        while time.monotonic() < deadline and not errors:
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
    assert trials >= 5
    assert calls == trials * 6


def test_calls_work_while_another_thread_imports_torch() -> None:
    pytest.importorskip("torch")
    result = run_python(
        """
        import sys, threading
        import kernreg
        from kernreg import Config, KernelRegistry, Platform

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
        from kernreg import Config, KernelRegistry, Platform

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
            report = kernreg.load_plugins()
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

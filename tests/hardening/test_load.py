"""Sustained load: 16 threads call op objects while writers replace and remove their
implementations. No undocumented exception, no stale decision, no deadlock.

Every implementation returns the version it was registered as. A writer announces the
result a mutation leads to before making it, and publishes it once the mutation has
returned; a call is correct when its result is one of those announced between the last
mutation published before the call started and the last one announced after it ended.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import kernreg
from kernreg import Config, KernelRegistry, OpNotFoundError, Platform

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

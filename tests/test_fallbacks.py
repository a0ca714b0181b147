"""Sticky demotion of a failing implementation, and the counters of every decision
(docs/fallbacks.md).

The demotion scenarios restate what sglang 0.5.23's fast paths with a fallback do
(``residual_gate_add2``'s ``_FAILED_RUNTIME_KEYS``, ``BitExactFusionGate.on_exception``):
the first failure of a kernel for a key disables it for that key with one warning, the
call is answered by the reference, the kernel is not tried again for that key, other keys
still try it, and nothing is swallowed while compiling (tests/torch/test_fallbacks_torch.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kernreg
from kernreg import KernelRegistry, Platform
from kernreg.config import Config
from kernreg.errors import DemotionError, DemotionWarning
from kernreg.tracing import Stats

np = pytest.importorskip("numpy")


@pytest.fixture(autouse=True)
def _own_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's registries keep their demotions in a store of the test's own."""
    monkeypatch.setenv("KERNREG_CACHE_DIR", str(tmp_path / "store"))


def _registry(**config: Any) -> KernelRegistry:
    config.setdefault("cache_dir", os.environ["KERNREG_CACHE_DIR"])
    return KernelRegistry(config=Config(**config), platform=Platform.parse("cpu"))


class Flaky:
    """An implementation that raises ``error`` on every call while ``failing``."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error if error is not None else RuntimeError("kernel launch failed")
        self.calls = 0
        self.failing = True

    def __call__(self, x: Any) -> Any:
        self.calls += 1
        if self.failing:
            raise self.error
        return ("fast", x)


def _op(registry: KernelRegistry, op_id: str, flaky: Flaky, **register: Any) -> Callable[..., Any]:
    @kernreg.op(op_id, registry=registry)
    def reference(x: Any) -> Any:
        return ("reference", x)

    reference.register("fast", flaky, priority=10, **register)
    return reference


def _rows(op_id: str, stats: Stats | None = None) -> list[tuple[str, str, str, int]]:
    """The counters of ``op_id``: (rule, implementation, cause, count)."""
    snapshot = kernreg.stats() if stats is None else stats
    return [(rule, impl, cause, n) for op, rule, impl, cause, n in snapshot.counts if op == op_id]


# --- sticky demotion -------------------------------------------------------------------------


def test_a_failing_kernel_is_demoted_once_and_the_call_gets_the_reference() -> None:
    registry = _registry(demote="fallbacks.*")
    flaky = Flaky()
    op = _op(registry, "fallbacks.first", flaky)
    with pytest.warns(DemotionWarning) as caught:
        assert op(1) == ("reference", 1)  # the same call answers, no exception
    assert op(2) == ("reference", 2)
    assert op(3) == ("reference", 3)
    assert flaky.calls == 1  # never probed again
    assert len(caught) == 1
    message = str(caught[0].message)
    for part in ("fallbacks.first", "fast", "RuntimeError", "kernel launch failed"):
        assert part in message
    assert "registry.clear_demotions('fallbacks.first') on the KernelRegistry" in message
    assert caught[0].filename == __file__  # the warning points at the call
    [demotion] = registry.demotions()
    assert (demotion.op, demotion.label, demotion.dtypes) == ("fallbacks.first", "fast", ())
    assert demotion.error == "RuntimeError: kernel launch failed"


def test_a_demotion_warning_says_how_to_clear_it_on_the_registry_that_demoted() -> None:
    private = _registry(demote="fallbacks.*")
    with kernreg.default_registry().scoped() as default:
        default.configure(private.config, platform=private.platform)
        for registry in (private, default):
            op = _op(registry, "fallbacks.cleared", Flaky())
            with pytest.warns(DemotionWarning) as caught:
                op(x=1)  # by keyword too, the warning points at the call
            assert caught[0].filename == __file__
            message = str(caught[0].message)
            clear = message.partition("clear it with ")[2]
            assert len(registry.clear_demotions("fallbacks.cleared")) == 1
            if registry is private:
                assert "default_registry" not in clear
                assert "kernreg tune" not in clear
            else:
                assert "kernreg tune --clear-demotions fallbacks.cleared, or " in clear
                assert "kernreg.default_registry().clear_demotions('fallbacks.cleared')" in clear


def test_explain_says_how_to_clear_a_demotion_on_the_registry_that_demoted() -> None:
    private = _registry(demote="fallbacks.*")
    with kernreg.default_registry().scoped() as default:
        default.configure(private.config, platform=private.platform)
        for registry in (private, default):
            op = _op(registry, "fallbacks.explained", Flaky())
            with pytest.warns(DemotionWarning):
                op(1)
            [reason] = op.explain_call(1).candidate("fast").reasons
            if registry is private:
                assert "kernreg tune" not in reason
                assert "registry.clear_demotions('fallbacks.explained') on this" in reason
            else:
                assert "kernreg tune --clear-demotions fallbacks.explained clears it" in reason
            registry.clear_demotions("fallbacks.explained")


def test_without_the_policy_the_exception_propagates_on_every_call() -> None:
    registry = _registry(demote="other.*")
    flaky = Flaky()
    op = _op(registry, "fallbacks.off", flaky)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="kernel launch failed"):
            op(1)
    assert flaky.calls == 2
    assert registry.demotions() == ()


def test_the_next_eligible_implementation_answers_before_the_reference() -> None:
    registry = _registry(demote="1")
    flaky = Flaky()
    op = _op(registry, "fallbacks.next", flaky)
    op.register("slower", lambda x: ("slower", x), priority=5)
    with pytest.warns(DemotionWarning):
        assert op(1) == ("slower", 1)
    assert op(2) == ("slower", 2)
    assert op.explain_call(2).chosen.label == "slower"


def test_a_demotion_holds_for_its_dtypes_only() -> None:
    registry = _registry(demote="fallbacks.*")
    flaky = Flaky()
    op = _op(registry, "fallbacks.dtypes", flaky, dtypes=["float32", "float64"])
    x32, x64 = np.ones(2, dtype=np.float32), np.ones(2, dtype=np.float64)
    with pytest.warns(DemotionWarning, match="float32"):
        assert op(x32)[0] == "reference"
    flaky.failing = False
    assert op(x64)[0] == "fast"  # another key still tries the kernel
    assert op(x32)[0] == "reference"
    assert flaky.calls == 2
    assert [d.dtypes for d in registry.demotions()] == [("float32",)]


def test_an_exception_of_the_reference_is_never_swallowed() -> None:
    registry = _registry(demote="1")

    @kernreg.op("fallbacks.broken_reference", registry=registry)
    def op(x: Any) -> Any:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        op(1)
    flaky = Flaky(ValueError("bad input"))
    op.register("fast", flaky, priority=1)
    with pytest.warns(DemotionWarning), pytest.raises(ValueError, match="bad input"):
        op(1)  # the kernel is demoted, and the reference's own error reaches the caller


@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(3)])
def test_keyboard_interrupt_and_system_exit_are_never_demoted(error: BaseException) -> None:
    registry = _registry(demote="1")
    op = _op(registry, "fallbacks.interrupt", Flaky(error))
    with pytest.raises(type(error)):
        op(1)
    assert registry.demotions() == ()


@pytest.mark.parametrize("strict", ["config", "op"])
def test_strict_mode_turns_a_demotion_into_an_error(strict: str) -> None:
    registry = _registry(demote="1", strict="fallbacks.*" if strict == "config" else ())
    flaky = Flaky()

    @kernreg.op("fallbacks.strict", registry=registry, strict=strict == "op" or None)
    def op(x: Any) -> Any:
        return ("reference", x)

    op.register("fast", flaky, priority=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DemotionWarning)
        for _ in range(2):
            with pytest.raises(DemotionError, match="strict mode") as raised:
                op(1)
            assert isinstance(raised.value.__cause__, RuntimeError)
            assert isinstance(raised.value, kernreg.KernregError)
    assert flaky.calls == 2
    assert registry.demotions() == ()


def test_requests_and_pins_are_not_demoted() -> None:
    registry = _registry(demote="1")
    flaky = Flaky()
    op = _op(registry, "fallbacks.pinned", flaky)
    with kernreg.use_backend("fallbacks.pinned", "fast"), pytest.raises(RuntimeError):
        op(1)
    assert registry.demotions() == ()


def test_explain_shows_the_demotion_and_clearing_it_tries_the_kernel_again() -> None:
    registry = _registry(demote="fallbacks.*")
    flaky = Flaky()
    op = _op(registry, "fallbacks.explained", flaky)
    with pytest.warns(DemotionWarning):
        op(1)
    decision = op.explain_call(1)  # this call's bucket: "-" (an int has no shape)
    assert decision.rule == "reference"
    fast = decision.candidate("fast")
    assert fast.status == "rejected"
    assert any("demoted" in r and "RuntimeError: kernel launch failed" in r for r in fast.reasons)
    assert "demoted" in str(decision)
    without_call = op.explain()  # chosen for other buckets; a note lists the demoted ones
    assert without_call.chosen.label == "fast"
    assert any("demoted in shape bucket - (raised RuntimeError" in n for n in without_call.notes)
    assert [d.label for d in registry.clear_demotions("fallbacks.*")] == ["fast"]
    assert registry.demotions() == ()
    flaky.failing = False
    assert op(2) == ("fast", 2)
    assert op.explain().chosen.label == "fast"


def test_two_threads_failing_at_once_record_one_demotion_and_warn_once() -> None:
    registry = _registry(demote="1")
    barrier = threading.Barrier(2, timeout=10)
    calls: list[int] = []

    def fails_together(x: Any) -> Any:
        calls.append(x)
        barrier.wait()  # both calls are inside the kernel before either fails
        raise RuntimeError("device-side assert")

    op = _op(registry, "fallbacks.threads", Flaky())
    op.register("fast", fails_together, priority=10, replace=True)
    results: list[Any] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=lambda i=i: results.append(op(i))) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert sorted(results) == [("reference", 0), ("reference", 1)]
    assert len(calls) == 2
    assert [w.category for w in caught] == [DemotionWarning]
    assert len(registry.demotions()) == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_keeps_the_demotions_and_records_its_own(tmp_path: Path) -> None:
    registry = _registry(demote="1")
    flaky = Flaky()
    op = _op(registry, "fallbacks.fork", flaky, dtypes=["float32", "float64"])
    with pytest.warns(DemotionWarning):
        op(np.ones(1, dtype=np.float32))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child process
        code = 1
        try:
            warnings.simplefilter("ignore")
            kept = op(np.ones(1, dtype=np.float32))[0] == "reference" and flaky.calls == 1
            own = op(np.ones(1, dtype=np.float64))[0] == "reference" and flaky.calls == 2
            code = 0 if kept and own and len(registry.demotions()) == 2 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(registry.demotions()) == 2  # the child's went to the shared store


# --- shape buckets: sglang keys a failed backend by (op, backend, arch, shape bucket) ------


class FailsAbove:
    """A kernel that raises on inputs with more than ``rows`` rows (a launch grid limit)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.tried: list[int] = []

    def __call__(self, x: Any) -> Any:
        self.tried.append(len(x))
        if len(x) > self.rows:
            raise RuntimeError(f"grid too large for {len(x)} rows")
        return ("fast", len(x))


def _sized(registry: KernelRegistry, op_id: str, kernel: Any, **register: Any) -> Any:
    @kernreg.op(op_id, registry=registry)
    def reference(x: Any) -> Any:
        return ("reference", len(x))

    reference.register("fast", kernel, priority=10, **register)
    return reference


def test_a_kernel_failing_above_a_size_keeps_serving_small_sizes() -> None:
    registry = _registry(demote="fallbacks.*")
    kernel = FailsAbove(1000)
    op = _sized(registry, "fallbacks.sized", kernel)
    assert op(np.ones(8)) == ("fast", 8)
    with pytest.warns(DemotionWarning, match="shape bucket x=4096") as caught:
        assert op(np.ones(4000)) == ("reference", 4000)
    assert len(caught) == 1
    assert op(np.ones(4096)) == ("reference", 4096)  # the same bucket: not tried again
    assert op(np.ones(8)) == ("fast", 8)  # another bucket still runs it
    assert op(np.ones(500)) == ("fast", 500)
    assert kernel.tried == [8, 4000, 8, 500]
    [demotion] = registry.demotions()
    assert demotion.bucket == "x=4096"
    assert "shape bucket x=4096" in str(demotion)
    rejected = op.explain_call(np.ones(3000)).candidate("fast")
    assert rejected.status == "rejected"
    assert rejected.reasons[0].startswith("demoted: raised RuntimeError: grid too large")
    assert op.explain_call(np.ones(8)).chosen.label == "fast"
    decision = op.explain()
    assert decision.chosen.label == "fast"
    assert any("fast is demoted in shape bucket x=4096 (raised" in n for n in decision.notes)


def test_two_buckets_are_demoted_separately_and_cleared_together() -> None:
    registry = _registry(demote="fallbacks.*")
    kernel = FailsAbove(1000)
    op = _sized(registry, "fallbacks.two", kernel, dtypes=["float64"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert op(np.ones(2000))[0] == "reference"
        assert op(np.ones(5000))[0] == "reference"
        assert op(np.ones(2000))[0] == "reference"
    assert [w.category for w in caught] == [DemotionWarning, DemotionWarning]
    assert [d.bucket for d in registry.demotions()] == ["x=2048", "x=8192"]
    assert [d.dtypes for d in registry.demotions()] == [("float64",)] * 2
    assert op(np.ones(16))[0] == "fast"
    note = next(n for n in op.explain(dtypes=["float64"]).notes if "demoted" in n)
    assert "x=2048 (raised RuntimeError: grid too large for 2000 rows)" in note
    assert "x=8192 (raised RuntimeError: grid too large for 5000 rows)" in note
    assert len(registry.clear_demotions("fallbacks.two")) == 2
    assert registry.demotions() == ()
    kernel.rows = 10_000  # fixed: both buckets run it again
    assert op(np.ones(2000)) == ("fast", 2000)
    assert op(np.ones(5000)) == ("fast", 5000)


def test_strict_mode_refuses_a_demotion_in_one_bucket_and_keeps_the_others() -> None:
    registry = _registry(demote="fallbacks.*", strict="fallbacks.*")
    kernel = FailsAbove(1000)
    op = _sized(registry, "fallbacks.strict_bucket", kernel)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DemotionWarning)
        for _ in range(2):
            with pytest.raises(DemotionError, match="shape bucket x=2048") as raised:
                op(np.ones(2000))
            assert isinstance(raised.value.__cause__, RuntimeError)
        assert op(np.ones(8)) == ("fast", 8)
    assert registry.demotions() == ()
    assert kernel.tried == [2000, 2000, 8]


def test_threads_in_one_bucket_demote_once_while_others_keep_the_kernel() -> None:
    registry = _registry(demote="1")
    kernel = FailsAbove(1000)
    op = _sized(registry, "fallbacks.bucket_threads", kernel)
    start = threading.Barrier(8, timeout=10)
    results: list[Any] = []

    def work(rows: int) -> None:
        start.wait()
        results.extend(op(np.ones(rows)) for _ in range(50))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=work, args=(2000 if i % 2 else 8,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert [w.category for w in caught] == [DemotionWarning]
    assert results.count(("fast", 8)) == 200
    assert results.count(("reference", 2000)) == 200
    assert kernel.tried.count(2000) <= 4  # only calls in flight before the demotion tried it
    assert [d.bucket for d in registry.demotions()] == ["x=2048"]


def test_a_when_chosen_kernel_is_demoted_for_its_bucket_and_the_rules_answer() -> None:
    registry = _registry(demote="fallbacks.*")
    kernel = FailsAbove(1000)

    @kernreg.op("fallbacks.when", registry=registry)
    def op(x: Any) -> Any:
        return ("reference", len(x))

    op.register("prefill", kernel, priority=20, when=lambda x: len(x) > 4)
    op.register("general", lambda x: ("general", len(x)), priority=10)
    with pytest.warns(DemotionWarning, match="prefill raised RuntimeError"):
        assert op(np.ones(2000)) == ("general", 2000)  # the next rule: the firm choice
    assert op(np.ones(1500)) == ("general", 1500)  # the demoted bucket: not tried
    assert op(np.ones(100)) == ("fast", 100)  # another bucket: the predicate's choice runs
    assert op(np.ones(2)) == ("general", 2)  # predicate false
    assert kernel.tried == [2000, 100]
    [demotion] = registry.demotions()
    assert (demotion.label, demotion.bucket) == ("prefill", "x=2048")
    assert op.explain_call(np.ones(2000)).candidate("prefill").status == "rejected"
    assert ("demoted", "prefill", "RuntimeError", 1) in _rows("fallbacks.when")


def test_without_the_policy_a_when_chosen_kernel_raises() -> None:
    registry = _registry()
    kernel = FailsAbove(1000)

    @kernreg.op("fallbacks.when_off", registry=registry)
    def op(x: Any) -> Any:
        return ("reference", len(x))

    op.register("prefill", kernel, priority=20, when=lambda x: len(x) > 4)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="grid too large"):
            op(np.ones(2000))
    assert kernel.tried == [2000, 2000]


# --- demotions across processes: the tuning store and the command line -------------------

ENGINE = """
import sys, kernreg

@kernreg.op("fallbacks.engine")
def norm(x):
    return "reference"

tried = []

@norm.register("fast", priority=10)
def norm_fast(x):
    tried.append(x)
    raise RuntimeError("no kernel image for this device")

print(norm(1), len(tried))
"""


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_a_new_process_with_the_same_store_starts_with_the_demotions(tmp_path: Path) -> None:
    (tmp_path / "engine.py").write_text(textwrap.dedent(ENGINE))
    env = {
        **os.environ,
        "KERNREG_CACHE_DIR": str(tmp_path / "cache"),
        "KERNREG_DEMOTE": "fallbacks.*",
        "KERNREG_PLUGINS": "none",
        "KERNREG_PLATFORM": "cpu",
    }
    first = _run(["-c", "import engine"], env, tmp_path)
    assert first.stdout.split() == ["reference", "1"], first.stderr
    assert "DemotionWarning" in first.stderr
    second = _run(["-c", "import engine"], env, tmp_path)
    assert second.stdout.split() == ["reference", "0"], second.stderr  # never tried
    assert "DemotionWarning" not in second.stderr
    assert (tmp_path / "cache" / "tuning.sqlite3").is_file()

    explained = _run(
        ["-m", "kernreg", "-m", "engine", "explain", "fallbacks.engine"], env, tmp_path
    )
    assert "DemotionWarning" not in explained.stderr  # importing engine tried nothing
    assert "fast is demoted in shape bucket - (raised RuntimeError: no kernel image" in (
        " ".join(explained.stdout.split())
    )
    shown = json.loads(_run(["-m", "kernreg", "tune", "--show", "--json"], env, tmp_path).stdout)
    assert [(d["op"], d["implementation"]) for d in shown["demotions"]] == [
        ("fallbacks.engine", "fast")
    ]
    checked = _run(["-m", "kernreg", "check", "--json"], env, tmp_path)
    found = [p for p in json.loads(checked.stdout)["problems"] if p["kind"] == "demoted"]
    assert [(p["op"], p["severity"]) for p in found] == [("fallbacks.engine", "warning")]
    cleared = _run(["-m", "kernreg", "tune", "--clear-demotions", "fallbacks.*"], env, tmp_path)
    assert "1 demotion cleared" in cleared.stdout, cleared.stderr
    third = _run(["-c", "import engine"], env, tmp_path)
    assert third.stdout.split() == ["reference", "1"]  # tried again, and demoted again


SIZED_ENGINE = """
import numpy as np, kernreg

@kernreg.op("fallbacks.sized_engine")
def norm(x):
    return "reference"

tried = []

@norm.register("fast", priority=10)
def norm_fast(x):
    tried.append(len(x))
    if len(x) > 1000:
        raise RuntimeError("grid too large")
    return "fast"

print(norm(np.ones(8)), norm(np.ones(3000)), norm(np.ones(8)), *tried)
"""


def test_a_demoted_bucket_persists_across_processes_and_is_cleared(tmp_path: Path) -> None:
    (tmp_path / "engine.py").write_text(textwrap.dedent(SIZED_ENGINE))
    env = {
        **os.environ,
        "KERNREG_CACHE_DIR": str(tmp_path / "cache"),
        "KERNREG_DEMOTE": "fallbacks.*",
        "KERNREG_PLUGINS": "none",
        "KERNREG_PLATFORM": "cpu",
    }
    first = _run(["-c", "import engine"], env, tmp_path)
    assert first.stdout.split() == ["fast", "reference", "fast", "8", "3000", "8"], first.stderr
    assert first.stderr.count("DemotionWarning") == 1
    second = _run(["-c", "import engine"], env, tmp_path)
    assert second.stdout.split() == ["fast", "reference", "fast", "8", "8"], second.stderr
    assert "DemotionWarning" not in second.stderr
    shown = json.loads(_run(["-m", "kernreg", "tune", "--show", "--json"], env, tmp_path).stdout)
    assert [(d["implementation"], d["bucket"]) for d in shown["demotions"]] == [("fast", "x=4096")]
    table = _run(["-m", "kernreg", "tune", "--show"], env, tmp_path).stdout
    assert "BUCKET" in table
    assert "x=4096" in table
    checked = _run(["-m", "kernreg", "check", "--json"], env, tmp_path)
    found = [p for p in json.loads(checked.stdout)["problems"] if p["kind"] == "demoted"]
    [problem] = found
    assert "shape bucket x=4096" in problem["message"]
    cleared = _run(["-m", "kernreg", "tune", "--clear-demotions", "fallbacks.*"], env, tmp_path)
    assert "shape bucket x=4096" in cleared.stdout
    assert "1 demotion cleared" in cleared.stdout
    third = _run(["-c", "import engine"], env, tmp_path)
    assert third.stdout.split() == first.stdout.split()  # tried again in that bucket


# --- counters ------------------------------------------------------------------------------


def test_counters_name_the_rule_and_the_cause_of_each_fallback() -> None:
    registry = _registry(demote="fallbacks.causes_demoted", deny="fallbacks.causes_denied=fast")
    for name in ("no_eligible", "denied", "dtype", "demoted", "chosen"):

        @kernreg.op(f"fallbacks.causes_{name}", registry=registry)
        def op(x: Any) -> Any:
            return "reference"

        requires = ["cuda>=8.0"] if name == "no_eligible" else []
        dtypes = ["bfloat16"] if name == "dtype" else []
        flaky = Flaky()
        flaky.failing = name == "demoted"
        op.register("fast", flaky, priority=10, requires=requires, dtypes=dtypes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DemotionWarning)
            for _ in range(3):  # a cached call makes no decision
                op(np.ones(1, dtype=np.float32))
    assert _rows("fallbacks.causes_no_eligible") == [
        ("reference", "torch", "no eligible implementation", 1)
    ]
    assert _rows("fallbacks.causes_denied") == [("reference", "torch", "denied", 1)]
    assert _rows("fallbacks.causes_dtype") == [("reference", "torch", "dtype", 1)]
    assert _rows("fallbacks.causes_chosen") == [("priority", "fast", "", 1)]
    demoted = _rows("fallbacks.causes_demoted")
    assert ("demoted", "fast", "RuntimeError", 1) in demoted
    assert ("priority", "fast", "", 2) in demoted  # demoted in one bucket: chosen for others
    assert ("reference", "torch", "demoted", 2) in demoted  # the failing call, then the bucket


def test_counters_count_pins_predicates_and_lookups() -> None:
    registry = _registry()

    @kernreg.op("fallbacks.counted", registry=registry)
    def op(x: Any) -> Any:
        return "reference"

    op.register("small", lambda x: "small", priority=10, when=lambda x: x < 10)
    op.register("other", lambda x: "other", priority=1)
    assert [op(1), op(2), op(50)] == ["small", "small", "other"]
    with kernreg.use_backend("fallbacks.counted", "torch"):
        assert op(1) == "reference"
    assert registry.get_kernel("fallbacks.counted", "other")(0) == "other"
    rows = _rows("fallbacks.counted")
    assert ("when", "small", "", 2) in rows  # a choice by predicate: counted per call
    assert ("priority", "other", "", 1) in rows  # predicates false: the firm choice
    assert ("scoped_pin", "torch", "", 1) in rows
    assert ("explicit", "other", "", 1) in rows


def test_a_fallback_by_predicate_counts_predicate_false() -> None:
    registry = _registry()

    @kernreg.op("fallbacks.predicate", registry=registry)
    def op(x: Any) -> Any:
        return "reference"

    op.register("decode", lambda x: "decode", priority=10, when=lambda x: x == 1)
    assert [op(1), op(7), op(9)] == ["decode", "reference", "reference"]
    assert _rows("fallbacks.predicate") == [
        ("reference", "torch", "predicate false", 2),
        ("when", "decode", "", 1),
    ]


def test_counters_are_exact_under_threads() -> None:
    registry = _registry()

    @kernreg.op("fallbacks.threaded", registry=registry)
    def op(x: Any) -> Any:
        return "reference"

    op.register("even", lambda x: "even", priority=10, when=lambda x: x % 2 == 0)
    start = threading.Barrier(8, timeout=10)

    def work() -> None:
        start.wait()
        for i in range(500):
            op(i)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert _rows("fallbacks.threaded") == [
        ("reference", "torch", "predicate false", 2000),
        ("when", "even", "", 2000),
    ]


def test_stats_is_json_readable_and_saved(tmp_path: Path) -> None:
    registry = _registry()
    op = _op(registry, "fallbacks.saved", Flaky(), requires=["cuda"])
    op(1)
    snapshot = kernreg.stats()
    data = snapshot.to_dict()
    assert Stats.from_dict(json.loads(json.dumps(data))) == snapshot
    row = next(r for r in data["counts"] if r["op"] == "fallbacks.saved")
    assert row == {
        "op": "fallbacks.saved",
        "rule": "reference",
        "implementation": "torch",
        "cause": "no eligible implementation",
        "count": 1,
    }
    text = str(snapshot)
    assert text.startswith("kernreg stats: ")
    lines = [" ".join(line.split()) for line in text.splitlines()]
    assert "fallbacks.saved reference torch (no eligible implementation): 1" in lines
    path = snapshot.save(str(tmp_path / "stats-{pid}.json"))
    assert path == str(tmp_path / f"stats-{os.getpid()}.json")
    assert Stats.load(path) == snapshot
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a kernreg stats snapshot"):
        Stats.load(str(tmp_path / "bad.json"))


def test_saving_stats_replaces_the_file_whole_or_leaves_it_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "stats.json"
    old = Stats([("fallbacks.old", "priority", "fast", "", 1)])
    new = Stats([("fallbacks.new", "reference", "torch", "dtype", 2)])
    old.save(str(path))
    with open(path, encoding="utf-8") as reader:  # a reader that opened the file before
        new.save(str(path))
        assert Stats.from_dict(json.load(reader)) == old  # never a truncated file
    assert Stats.load(str(path)) == new

    # A save that fails half-way (a crash, a full disk) leaves the old file and no other.
    def fail(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        old.save(str(path))
    assert Stats.load(str(path)) == new
    assert os.listdir(tmp_path) == ["stats.json"]


def test_trace_summaries_include_the_counts() -> None:
    registry = _registry()
    op = _op(registry, "fallbacks.traced", Flaky(), dtypes=["bfloat16"])
    with kernreg.trace() as recorded:
        op(np.ones(1, dtype=np.float32))
        op(np.ones(1, dtype=np.float32))
    assert _rows("fallbacks.traced", recorded.stats) == [("reference", "torch", "dtype", 1)]
    assert {
        "op": "fallbacks.traced",
        "rule": "reference",
        "implementation": "torch",
        "cause": "dtype",
        "count": 1,
    } in json.loads(recorded.to_json())["decisions"]
    assert "torch (dtype): 1" in str(recorded)


STATS_ENGINE = """
import kernreg

@kernreg.op("fallbacks.exported")
def op(x):
    return x

op.register("gpu", lambda x: x, requires=["cuda"], priority=10)
op(1)
"""


def test_the_stats_file_is_written_at_exit_and_kernreg_stats_shows_it(tmp_path: Path) -> None:
    (tmp_path / "engine.py").write_text(textwrap.dedent(STATS_ENGINE))
    env = {
        **os.environ,
        "KERNREG_STATS_FILE": str(tmp_path / "stats-{pid}.json"),
        "KERNREG_PLUGINS": "none",
        "KERNREG_PLATFORM": "cpu",
    }
    assert _run(["engine.py"], env, tmp_path).returncode == 0
    [written] = tmp_path.glob("stats-*.json")
    shown = _run(["-m", "kernreg", "stats"], env, tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "fallbacks.exported  reference   torch (no eligible implementation): 1" in shown.stdout
    assert shown.stdout.startswith(f"{written}:\nkernreg stats: 1 decision of 1 op, 1 fallback")
    as_json = json.loads(
        _run(["-m", "kernreg", "stats", str(written), "--json"], env, tmp_path).stdout
    )
    assert as_json[str(written)]["counts"][0]["cause"] == "no eligible implementation"
    assert list(tmp_path.glob("stats-*.json")) == [written]  # the commands wrote none
    missing = _run(["-m", "kernreg", "stats", str(tmp_path / "none.json")], env, tmp_path)
    assert missing.returncode == 1
    assert "cannot read stats" in missing.stderr


FORKING_ENGINE = """
import atexit, os, sys, time

atexit.register(lambda: open(f"done-{os.getpid()}", "w").close())  # runs after kernreg's
import kernreg

@kernreg.op("fallbacks.forked")
def op(x):
    return x

op.register("parent", lambda x: x, priority=5)
op(1)
parent = os.getpid()
if os.fork() == 0:  # the child exits after its parent wrote its file
    while os.getppid() == parent:
        time.sleep(0.01)
    op.register("child", lambda x: x, priority=9)
    op(2)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("name", ["stats-{pid}.json", "stats.json"])
def test_a_forked_child_exports_its_own_counts_and_never_the_parents_file(
    tmp_path: Path, name: str
) -> None:
    (tmp_path / "engine.py").write_text(textwrap.dedent(FORKING_ENGINE))
    env = {**os.environ, "KERNREG_STATS_FILE": str(tmp_path / name), "KERNREG_PLUGINS": "none"}
    assert _run(["engine.py"], env, tmp_path).returncode == 0
    for _ in range(6000):  # both processes have exited
        if len(list(tmp_path.glob("done-*"))) == 2:
            break
        threading.Event().wait(0.01)
    written = {
        tuple(_rows("fallbacks.forked", Stats.load(str(p)))) for p in tmp_path.glob("stats*.json")
    }
    parent = (("priority", "parent", "", 1),)
    # {pid}: one file each, the child's without the parent's count; else the parent's file.
    assert written == ({parent, (("priority", "child", "", 1),)} if "{pid}" in name else {parent})


MULTIPROCESSING_ENGINE = """
import multiprocessing
import kernreg

@kernreg.op("fallbacks.in_parent")
def in_parent(x):
    return x

@kernreg.op("fallbacks.in_worker")
def in_worker(x):
    return x

if __name__ == "__main__":
    in_parent(1)
    worker = multiprocessing.get_context("fork").Process(target=in_worker, args=(1,))
    worker.start()
    worker.join()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_multiprocessing_worker_exports_its_own_counts(tmp_path: Path) -> None:
    (tmp_path / "engine.py").write_text(textwrap.dedent(MULTIPROCESSING_ENGINE))
    env = {
        **os.environ,
        "KERNREG_STATS_FILE": str(tmp_path / "stats-{pid}.json"),
        "KERNREG_PLUGINS": "none",
    }
    assert _run(["engine.py"], env, tmp_path).returncode == 0
    written = sorted(
        [row[0] for row in Stats.load(str(p)).counts] for p in tmp_path.glob("stats-*.json")
    )
    assert written == [["fallbacks.in_parent"], ["fallbacks.in_worker"]]


SHARING_ENGINE = """
import os, sys, time
import kernreg

@kernreg.op("fallbacks.shared")
def op(x):
    return x

op.register("fast", lambda x: x, priority=5)
op(1)
open(f"ready-{os.getpid()}", "w").close()
deadline = time.monotonic() + 60
while len([f for f in os.listdir(".") if f.startswith("ready-")]) < int(sys.argv[1]):
    if time.monotonic() > deadline:
        sys.exit("the other processes never got ready")
    time.sleep(0.01)
"""


def test_processes_sharing_a_stats_file_add_their_counts(tmp_path: Path) -> None:
    """The ranks of one job writing one ``KERNREG_STATS_FILE`` (no ``{pid}``): the file
    holds the counts of all of them, not the last one's; a file from before they started
    is replaced, not added to."""
    (tmp_path / "engine.py").write_text(textwrap.dedent(SHARING_ENGINE))
    target = tmp_path / "stats.json"
    Stats([("fallbacks.shared", "priority", "fast", "", 7)]).save(str(target))
    os.utime(target, (0, 0))  # written by a run long over
    env = {**os.environ, "KERNREG_STATS_FILE": str(target), "KERNREG_PLUGINS": "none"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "engine.py", "3"], env=env, cwd=tmp_path, stderr=subprocess.PIPE
        )
        for _ in range(3)
    ]
    errors = [rank.communicate(timeout=120)[1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0, 0], errors
    assert _rows("fallbacks.shared", Stats.load(str(target))) == [("priority", "fast", "", 3)]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"format": "kernreg-stats", "version": 2, "counts": []}, "version 2, not 1"),
        ({"format": "kernreg-stats", "version": 1, "counts": [1]}, "a row is not"),
        (
            {
                "format": "kernreg-stats",
                "version": 1,
                "counts": [
                    {"op": "a", "rule": "b", "implementation": "c", "cause": "", "count": "3"}
                ],
            },
            "a row is not",
        ),
    ],
)
def test_kernreg_stats_on_another_version_or_a_damaged_file_is_one_error(
    tmp_path: Path, data: Any, message: str
) -> None:
    (tmp_path / "stats.json").write_text(json.dumps(data))
    shown = _run(
        ["-m", "kernreg", "stats", str(tmp_path / "stats.json")], dict(os.environ), tmp_path
    )
    assert shown.returncode == 1
    assert message in shown.stderr
    assert "Traceback" not in shown.stderr
    assert shown.stderr.startswith("error: cannot read stats: ")


def test_demoted_buckets_are_in_the_plan_and_the_fingerprint() -> None:
    from kernreg.registry import build_plan, fingerprint

    registry = _registry(demote="fallbacks.*")

    @kernreg.op("fallbacks.ranked", registry=registry)
    def op(x: Any) -> str:
        return "reference"

    @op.register("fast", priority=10)
    def fast(x: Any) -> str:
        if len(x) > 1024:
            raise RuntimeError("too many blocks")
        return "fast"

    before = fingerprint(registry)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DemotionWarning)
        assert op(np.ones(3000)) == "reference"
    # Two ranks that demoted differently run different kernels: their fingerprints differ.
    assert fingerprint(registry) != before
    entries = {(e.bucket, e.backend, e.rule) for e in build_plan(registry).entries()}
    assert entries == {(None, "fast", "priority"), ("x=4096", "torch", "reference")}
    registry.clear_demotions()
    assert fingerprint(registry) == before


def test_a_multi_line_exception_is_one_bounded_line_in_check_and_explain() -> None:
    log = "triton compilation failed:\n  at 12:4: def kernel(X):\n" + "x " * 2000
    registry = _registry(demote="fallbacks.*")
    op = _op(registry, "fallbacks.long", Flaky(RuntimeError(log)))
    with pytest.warns(DemotionWarning, match="x x x x"):  # the warning has all of it
        op(1)
    [demotion] = registry.demotions()
    reason = op.explain_call(1).candidate("fast").reasons[0]
    for text in (str(demotion), reason):  # what kernreg check and kernreg explain print
        assert "\n" not in text
        assert "failed: at 12:4: def kernel(X): x x" in text
        assert len(text) < 600


@pytest.mark.parametrize("value", ["[", "layernorm.[", "layer[norm.*", "*=x", "a]"])
def test_a_demote_glob_that_can_match_no_op_is_a_config_error(value: str) -> None:
    from kernreg.config import load_config
    from kernreg.errors import ConfigError

    with pytest.raises(ConfigError, match="KERNREG_DEMOTE"):
        load_config({"KERNREG_DEMOTE": value})


@pytest.mark.parametrize(
    ("value", "globs"),
    [("", ()), (" , ", ()), ("0", ()), ("1", ("*",)), ("[lr]*.x?,layernorm.*", None)],
)
def test_empty_and_bracketed_demote_values_read_as_written(
    value: str, globs: tuple[str, ...] | None
) -> None:
    from kernreg.config import load_config

    read = load_config({"KERNREG_DEMOTE": value}).demote
    assert read == (tuple(g.strip() for g in value.split(",")) if globs is None else globs)


def test_a_relative_stats_file_is_written_where_the_process_started(tmp_path: Path) -> None:
    engine = "import os, kernreg\n" + textwrap.dedent(STATS_ENGINE) + "os.chdir('elsewhere')\n"
    (tmp_path / "engine.py").write_text(engine)
    (tmp_path / "elsewhere").mkdir()
    env = {**os.environ, "KERNREG_STATS_FILE": "stats.json", "KERNREG_PLUGINS": "none"}
    assert _run(["engine.py"], env, tmp_path).returncode == 0
    shown = _run(["-m", "kernreg", "stats"], env, tmp_path)  # from where the engine started
    assert shown.returncode == 0, shown.stderr
    assert "fallbacks.exported" in shown.stdout

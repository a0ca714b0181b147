"""Helpers several test modules share: a snapshot of everything a registry holds (so a failed
call can be shown to have changed nothing), the bad-input corpus's target module, fake
tensors and devices, and fresh interpreters running kernreg."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import CodeType
from typing import Any

import pytest

import kernreg
from kernreg import KernelRegistry, KernelSpec, KernregError, Platform
from kernreg.config import Config


def registry_state(registry: KernelRegistry) -> tuple[Any, ...]:
    """Specs (with their origins), references, overrides, frozenness and every decision."""
    specs = registry.all_specs()
    return (
        [(spec, spec.origin) for spec in specs],
        {op: registry.reference(op) for op in registry.ops()},
        [(o.kind, o.old, o.new, o.origin) for o in registry.overrides()],
        registry.frozen,
        {op: _outcome(registry, op) for op in registry.ops()},
    )


def _outcome(registry: KernelRegistry, op: str) -> tuple[Any, ...]:
    decision = registry.explain(op)
    return (
        decision.rule,
        decision.chosen,
        tuple((c.spec.key, c.status, c.reasons) for c in decision.candidates),
    )


def assert_fails_cleanly(
    registry: KernelRegistry,
    call: Callable[[], object],
    error: type[KernregError],
    builtin: type[Exception],
    *named: str,
) -> KernregError:
    """``call`` raises ``error`` (a ``builtin``), its message names every string in
    ``named``, and the registry is exactly as it was before."""
    before = registry_state(registry)
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert isinstance(info.value, builtin)
    message = str(info.value)
    for text in named:
        assert text in message, f"{text!r} not named in: {message}"
    assert registry_state(registry) == before
    return info.value


def kernreg_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    base.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "kernreg", *args],
        capture_output=True,
        text=True,
        env=base,
        cwd=cwd,
        timeout=180,
    )


#: Runs each command line of ``argv[1]`` (JSON) in turn through ``kernreg.cli.main``.
_CLI_BATCH = """
import contextlib, io, json, sys
from kernreg.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, out.getvalue(), err.getvalue()])
sys.stdout.write(json.dumps(results))
"""


def kernreg_cli_batch(
    *argvs: tuple[str, ...], env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """``kernreg_cli(*argv)`` for each of ``argvs``, in one fresh interpreter: for commands
    that change nothing a later one sees (usage errors, say), where starting an
    interpreter that imports torch per command would cost seconds each."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KERNREG_") and k not in ("COLUMNS", "LINES")
    }
    base.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", _CLI_BATCH, json.dumps(argvs)],
        capture_output=True,
        text=True,
        env=base,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    return [
        subprocess.CompletedProcess(["kernreg", *argv], code, out, err)
        for argv, (code, out, err) in zip(argvs, json.loads(proc.stdout), strict=True)
    ]


BAD_INPUT_OP = "hard.norm"


BAD_INPUT_TARGET = "hard_targets:impl"


BAD_INPUT_MODULE = """
class Box:
    pass

box = Box()
number = 3

def impl(x):
    return "impl"

def ref(x):
    return "ref"

def predicate(x):
    return True
"""


#: Examples per property; the figures RELIABILITY.md quotes.
PARSER_EXAMPLES = 400


DEEP = 100_000


LONG_INT = "9" * 5_000  # over Python's 4,300-digit limit for int(str)


def norm_registry(platform: str = "cpu") -> KernelRegistry:
    registry = KernelRegistry(config=Config(), platform=Platform.parse(platform))
    registry.register(KernelSpec("norm.rms", "torch", "m:ref", reference=True))
    registry.register(KernelSpec("norm.rms", "fast", "m:fast", priority=5))
    registry.register(KernelSpec("norm.rms", "slow", "m:slow", priority=1))
    return registry


class FakeDevice:
    def __init__(self, type: str) -> None:
        self.type = type


class FakeTensor:
    """The two attributes a gated op reads, with a hashable device like torch's."""

    def __init__(self, dtype: str = "float32", device: object = None) -> None:
        self.dtype = dtype
        self.device = FakeDevice("cpu") if device is None else device


def cuda_registry() -> KernelRegistry:
    return KernelRegistry(config=Config(), platform=Platform.parse("cuda:9.0"))


def shape_changing_op(registry: KernelRegistry, bf16: Callable[..., Any] | None = None) -> Any:
    """One dtype-restricted (``bf16``, returning "bf16" unless given) and one device-restricted
    implementation: removing either changes which call attributes the op object reads."""

    @kernreg.op("stress.scale", registry=registry)
    def scale(x: Any) -> str:
        return "reference"

    scale.register("bf16", bf16 or (lambda x: "bf16"), dtypes=["bfloat16"], priority=5)
    scale.register("gpu", lambda x: "gpu", requires=["cuda"], priority=3)
    return scale


def run_python(
    code: str, timeout: float = 120, plugins: str = "none"
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KERNREG_PLUGINS": plugins}
    env.pop("KERNREG_PLATFORM", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def recording_impl(result: object) -> tuple[Callable[..., Any], list[CodeType]]:
    """An implementation returning ``result`` and the list of its callers' code objects.

    ``callers[-1] is op.__code__`` shows that the op object called it from its own frame,
    with no layer in between but, for a gated op, its generated per-call lookup (which
    is skipped here)."""
    callers: list[CodeType] = []

    def impl(*args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        if frame.f_code.co_filename.startswith("<kernreg gated_") and frame.f_back is not None:
            frame = frame.f_back
        callers.append(frame.f_code)
        return result

    return impl, callers


def routed_forward(module: Any) -> Any:
    """The forward kernelize routes ``module`` through: the one set on the instance, else
    (a settled module, which runs it from its class) its class's; ``None`` where neither
    is kernreg's."""
    found = vars(module).get("forward")
    if found is not None:
        return found
    if type(type(module)).__name__ == "Settled":
        return type(module).forward.__get__(module)
    return None

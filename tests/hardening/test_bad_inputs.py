"""A corpus of bad inputs, each refused with a specific kernreg error naming the input.

Every entry is one small call; for each, the test asserts the exception class (a
kernreg error and the documented builtin), that the message names the offending input,
and that the registry is exactly as before the call: specs with their origins,
references, overrides and every decision.
"""

from __future__ import annotations

import json
import os
import sqlite3
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hardening_support import assert_fails_cleanly, registry_state

import kernreg
from kernreg import (
    BackendNotFoundError,
    Config,
    ConfigError,
    DuplicateReferenceError,
    InvalidSpecError,
    KernelConflictError,
    KernelLoadError,
    KernelRegistry,
    KernelSpec,
    NoEligibleKernelError,
    OpNotFoundError,
    PlanError,
    Platform,
    RegistryFrozenError,
    Requirement,
    SelectionPlan,
    load_config,
)
from kernreg.config import ENV_VARS
from kernreg.tuning import Measurement, TuningKey, TuningStore, TuningStoreWarning

OP = "hard.norm"
GOOD = "hard_targets:impl"

TARGETS = """
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


@pytest.fixture
def targets(write_module: Callable[[str, str], str]) -> None:
    write_module("hard_targets", TARGETS)
    write_module("hard_raises", "raise RuntimeError('hard_raises fails on import')\n")
    write_module("hard_exits", "import sys\nsys.exit(4)\n")


@pytest.fixture
def populated(targets: None) -> KernelRegistry:
    """A registry with a reference, a gated fast path, an override and a decision cached."""
    reg = KernelRegistry(config=Config(), platform=Platform.parse("cuda:9.0"))
    reg.register(KernelSpec(OP, "torch", "hard_targets:ref", reference=True))
    reg.register(KernelSpec(OP, "triton", GOOD, requires=["cuda>=8.0"], priority=10))
    reg.register(KernelSpec(OP, "triton", GOOD, requires=["cuda>=8.0"], priority=20), replace=True)
    reg.register(KernelSpec("hard.other", "torch", "hard_targets:ref", reference=True))
    reg.select(OP)
    return reg


# --- specs: every field, malformed ------------------------------------------------------------

SPEC_FIELDS: list[tuple[str, dict[str, Any], str, str]] = [
    # (id, the bad keyword arguments, the field the error names, how the value is quoted)
    ("op-none", {"op": None}, "op", "None"),
    ("op-empty", {"op": ""}, "op", "''"),
    ("op-one-segment", {"op": "layernorm"}, "op", "'layernorm'"),
    ("op-upper", {"op": "LayerNorm.rms"}, "op", "'LayerNorm.rms'"),
    ("op-trailing-dot", {"op": "a.b."}, "op", "'a.b.'"),
    ("op-space", {"op": "a. b"}, "op", "'a. b'"),
    ("op-digit-first", {"op": "1a.b"}, "op", "'1a.b'"),
    ("op-bytes", {"op": b"a.b"}, "op", "b'a.b'"),
    ("op-unicode", {"op": "a.b\u00e9"}, "op", "'a.b\u00e9'"),
    ("op-list", {"op": ["a.b"]}, "op", "['a.b']"),
    ("backend-empty", {"backend": ""}, "backend", "''"),
    ("backend-upper", {"backend": "Triton"}, "backend", "'Triton'"),
    ("backend-dash", {"backend": "my-backend"}, "backend", "'my-backend'"),
    ("backend-slash", {"backend": "triton/v2"}, "backend", "'triton/v2'"),
    ("backend-int", {"backend": 3}, "backend", "3"),
    ("backend-none", {"backend": None}, "backend", "None"),
    ("variant-none", {"variant": None}, "variant", "None"),
    ("variant-upper", {"variant": "V2"}, "variant", "'V2'"),
    ("variant-space", {"variant": "v 2"}, "variant", "'v 2'"),
    ("variant-leading-dash", {"variant": "-v2"}, "variant", "'-v2'"),
    ("variant-int", {"variant": 2}, "variant", "2"),
    ("target-no-colon", {"target": "hard_targets.impl"}, "target", "'hard_targets.impl'"),
    ("target-no-module", {"target": ":impl"}, "target", "':impl'"),
    ("target-no-attr", {"target": "hard_targets:"}, "target", "'hard_targets:'"),
    ("target-two-colons", {"target": "a:b:c"}, "target", "'a:b:c'"),
    ("target-dash", {"target": "my-pkg.k:f"}, "target", "'my-pkg.k:f'"),
    ("target-trailing-dot", {"target": "a.b:c."}, "target", "'a.b:c.'"),
    ("target-space", {"target": "a.b: c"}, "target", "'a.b: c'"),
    ("target-empty", {"target": ""}, "target", "''"),
    ("target-int", {"target": 3}, "target", "3"),
    ("target-none", {"target": None}, "target", "None"),
    ("when-no-colon", {"when": "pred"}, "when", "'pred'"),
    ("when-int", {"when": 1}, "when", "1"),
    ("requires-str", {"requires": "cuda"}, "requires", "'cuda'"),
    ("requires-int", {"requires": 3}, "requires", "3"),
    ("requires-bad-string", {"requires": ["cuda>=eight"]}, "requirement", "'cuda>=eight'"),
    ("requires-none-item", {"requires": [None]}, "requirement", "None"),
    ("requires-window-reversed", {"requires": ["cuda>=9.0,<=8.0"]}, "requirement", "9.0"),
    ("requires-bound-twice", {"requires": ["cuda>=8.0,>=9.0"]}, "requirement", "'cuda>=8.0,>=9.0'"),
    ("requires-device-upper", {"requires": ["CUDA"]}, "requirement", "'CUDA'"),
    ("dtypes-str", {"dtypes": "bfloat16"}, "dtypes", "'bfloat16'"),
    ("dtypes-unknown", {"dtypes": ["bfloat17"]}, "dtypes", "'bfloat17'"),
    ("dtypes-int", {"dtypes": [16]}, "dtypes", "16"),
    ("dtypes-nested", {"dtypes": [["bf16"]]}, "dtypes", "['bf16']"),
    ("dtypes-empty-name", {"dtypes": [""]}, "dtypes", "''"),
    ("dtypes-none", {"dtypes": None}, "dtypes", "None"),
    ("packages-str", {"packages": "triton"}, "packages", "'triton'"),
    ("packages-not-pep508", {"packages": ["triton>>2"]}, "packages", "'triton>>2'"),
    ("packages-int", {"packages": [2]}, "packages", "2"),
    ("traits-upper", {"traits": ["Deterministic"]}, "traits", "'Deterministic'"),
    ("traits-str", {"traits": "deterministic"}, "traits", "'deterministic'"),
    ("priority-float", {"priority": 1.5}, "priority", "1.5"),
    ("priority-str", {"priority": "10"}, "priority", "'10'"),
    ("priority-bool", {"priority": True}, "priority", "True"),
    ("priority-none", {"priority": None}, "priority", "None"),
    ("reference-int", {"reference": 1}, "reference", "1"),
    ("reference-str", {"reference": "yes"}, "reference", "'yes'"),
    ("description-int", {"description": 3}, "description", "3"),
    ("origin-str", {"origin": "file.py:3"}, "origin", "'file.py:3'"),
]


@pytest.mark.parametrize(
    ("bad", "field", "quoted"),
    [pytest.param(bad, field, quoted, id=name) for name, bad, field, quoted in SPEC_FIELDS],
)
def test_a_malformed_spec_field_is_refused_naming_field_and_value(
    populated: KernelRegistry, bad: dict[str, Any], field: str, quoted: str
) -> None:
    fields: dict[str, Any] = {"op": OP, "backend": "cuda", "target": GOOD, **bad}

    def register() -> None:
        populated.register(KernelSpec(**fields))

    error = assert_fails_cleanly(
        populated, register, InvalidSpecError, ValueError, f"invalid {field} ", quoted
    )
    assert isinstance(error, InvalidSpecError)
    assert error.field == field


OP_OBJECT_REGISTRATIONS: list[tuple[str, dict[str, Any], str]] = [
    ("backend", {"backend": "Bad"}, "'Bad'"),
    ("variant", {"backend": "fast", "variant": "V"}, "'V'"),
    ("requires", {"backend": "fast", "requires": ["cuda>>8"]}, "'cuda>>8'"),
    ("dtypes", {"backend": "fast", "dtypes": ["halfish"]}, "'halfish'"),
    ("priority", {"backend": "fast", "priority": "high"}, "'high'"),
    ("target", {"backend": "fast", "target": "no_colon"}, "'no_colon'"),
    ("when", {"backend": "fast", "when": 3}, "3"),
]


@pytest.mark.parametrize(
    ("kwargs", "quoted"),
    [pytest.param(kwargs, quoted, id=name) for name, kwargs, quoted in OP_OBJECT_REGISTRATIONS],
)
def test_op_object_register_refuses_bad_arguments_before_changing_anything(
    registry: KernelRegistry, kwargs: dict[str, Any], quoted: str
) -> None:
    @kernreg.op("hard.scale", registry=registry)
    def scale(x: Any) -> str:
        return "ref"

    def register() -> None:
        target = kwargs.pop("target", None)
        registration = scale.register(**kwargs) if target is None else None
        if target is not None:
            scale.register(target=target, **kwargs)
        elif callable(registration):
            registration(lambda x: "fast")

    assert_fails_cleanly(registry, register, InvalidSpecError, ValueError, quoted)
    assert scale(1) == "ref"


# --- the registry: calls that must fail and change nothing -------------------------------------


def _spec(backend: str, target: str = GOOD, **kw: Any) -> KernelSpec:
    return KernelSpec(OP, backend, target, **kw)


REGISTRY_CALLS: list[
    tuple[str, Callable[[KernelRegistry], object], type[Any], type, tuple[str, ...]]
] = [
    # (id, the call, the kernreg error, its builtin, what the message names)
    (
        "conflict-target",
        lambda r: r.register(
            _spec("triton", "hard_targets:ref", requires=["cuda>=8.0"], priority=20)
        ),
        KernelConflictError,
        ValueError,
        (
            "Conflicting kernel registration for op 'hard.norm', backend 'triton'",
            "'hard_targets:ref'",
        ),
    ),
    (
        "conflict-priority",
        lambda r: r.register(_spec("triton", requires=["cuda>=8.0"], priority=21)),
        KernelConflictError,
        ValueError,
        ("backend 'triton'", "priority 20 != 21"),
    ),
    (
        "second-reference",
        lambda r: r.register(_spec("aten", reference=True)),
        DuplicateReferenceError,
        ValueError,
        ("'hard.norm'", "'aten'", "'torch'"),
    ),
    (
        "second-reference-by-replace",
        lambda r: r.register(_spec("triton", reference=True), replace=True),
        DuplicateReferenceError,
        ValueError,
        ("'hard.norm'", "'triton'"),
    ),
    (
        "register-not-a-spec",
        lambda r: r.register("hard.norm"),
        InvalidSpecError,
        ValueError,
        ("'hard.norm'",),
    ),
    ("register-none", lambda r: r.register(None), InvalidSpecError, ValueError, ("None",)),
    (
        "unregister-unknown-op",
        lambda r: r.unregister("hard.nope", "torch"),
        OpNotFoundError,
        KeyError,
        ("'hard.nope'",),
    ),
    (
        "unregister-bad-op",
        lambda r: r.unregister("Hard", "torch"),
        InvalidSpecError,
        ValueError,
        ("'Hard'",),
    ),
    (
        "unregister-op-list",
        lambda r: r.unregister(["hard.norm"], "torch"),
        InvalidSpecError,
        ValueError,
        ("['hard.norm']",),
    ),
    (
        "unregister-missing-backend",
        lambda r: r.unregister(OP, "cuda"),
        BackendNotFoundError,
        KeyError,
        ("'cuda'", "'hard.norm'"),
    ),
    (
        "unregister-missing-variant",
        lambda r: r.unregister(OP, "triton", "v9"),
        BackendNotFoundError,
        KeyError,
        ("'triton/v9'",),
    ),
    (
        "unregister-bad-backend",
        lambda r: r.unregister(OP, "Triton"),
        InvalidSpecError,
        ValueError,
        ("'Triton'",),
    ),
    (
        "unregister-backend-list",
        lambda r: r.unregister(OP, ["triton"]),
        InvalidSpecError,
        ValueError,
        ("['triton']",),
    ),
    (
        "unregister-variant-none",
        lambda r: r.unregister(OP, "triton", None),
        InvalidSpecError,
        ValueError,
        ("None",),
    ),
    ("get-unknown", lambda r: r.get("hard.nope"), OpNotFoundError, KeyError, ("'hard.nope'",)),
    ("get-bad-op", lambda r: r.get("hard"), InvalidSpecError, ValueError, ("'hard'",)),
    (
        "get-op-list",
        lambda r: r.get(["hard.norm"]),
        InvalidSpecError,
        ValueError,
        ("['hard.norm']",),
    ),
    ("get-op-dict", lambda r: r.get({}), InvalidSpecError, ValueError, ("{}",)),
    (
        "get-backend-op-list",
        lambda r: r.get_backend([1], "torch"),
        InvalidSpecError,
        ValueError,
        ("[1]",),
    ),
    ("get-backend-list", lambda r: r.get_backend(OP, [1]), InvalidSpecError, ValueError, ("[1]",)),
    ("reference-bad-op", lambda r: r.reference("x"), InvalidSpecError, ValueError, ("'x'",)),
    (
        "explain-unknown",
        lambda r: r.explain("hard.nope"),
        OpNotFoundError,
        KeyError,
        ("'hard.nope'",),
    ),
    ("explain-op-none", lambda r: r.explain(None), InvalidSpecError, ValueError, ("None",)),
    (
        "explain-op-list",
        lambda r: r.explain(["hard.norm"]),
        InvalidSpecError,
        ValueError,
        ("['hard.norm']",),
    ),
    (
        "explain-backend-missing",
        lambda r: r.explain(OP, backend="cuda"),
        BackendNotFoundError,
        KeyError,
        ("'cuda'",),
    ),
    (
        "explain-backend-bad",
        lambda r: r.explain(OP, backend="Cuda"),
        InvalidSpecError,
        ValueError,
        ("'Cuda'",),
    ),
    (
        "explain-backend-list",
        lambda r: r.explain(OP, backend=["triton"]),
        InvalidSpecError,
        ValueError,
        ("['triton']",),
    ),
    (
        "explain-variant-list",
        lambda r: r.explain(OP, variant=["v"]),
        InvalidSpecError,
        ValueError,
        ("['v']",),
    ),
    (
        "explain-variant-bad",
        lambda r: r.explain(OP, backend="triton", variant="V"),
        InvalidSpecError,
        ValueError,
        ("'V'",),
    ),
    (
        "explain-dtype-unknown",
        lambda r: r.explain(OP, dtypes=["bfloat17"]),
        InvalidSpecError,
        ValueError,
        ("'bfloat17'",),
    ),
    (
        "explain-dtype-int",
        lambda r: r.explain(OP, dtypes=[16]),
        InvalidSpecError,
        ValueError,
        ("16",),
    ),
    (
        "explain-dtypes-int",
        lambda r: r.explain(OP, dtypes=16),
        InvalidSpecError,
        ValueError,
        ("16",),
    ),
    (
        "explain-dtype-nested",
        lambda r: r.explain(OP, dtypes=[["bf16"]]),
        InvalidSpecError,
        ValueError,
        ("['bf16']",),
    ),
    (
        "explain-trait-bad",
        lambda r: r.explain(OP, traits=["Fast"]),
        InvalidSpecError,
        ValueError,
        ("'Fast'",),
    ),
    (
        "explain-trait-nested",
        lambda r: r.explain(OP, traits=[["x"]]),
        InvalidSpecError,
        ValueError,
        ("['x']",),
    ),
    (
        "explain-platform-bad",
        lambda r: r.explain(OP, platform="cuda:"),
        InvalidSpecError,
        ValueError,
        ("'cuda:'",),
    ),
    (
        "explain-platform-int",
        lambda r: r.explain(OP, platform=9),
        InvalidSpecError,
        ValueError,
        ("9",),
    ),
    (
        "select-platform-typo",
        lambda r: kernreg.select_kernel(OP, platform="cuda:90", registry=r),
        InvalidSpecError,
        ValueError,
        ("'cuda:90'",),
    ),
    (
        "select-platform-hip",
        lambda r: kernreg.select_kernel(OP, platform="hip:942", registry=r),
        InvalidSpecError,
        ValueError,
        ("'hip:942'",),
    ),
    (
        "select-strict-fallback",
        lambda r: r.select("hard.norm", platform=Platform.parse("cpu"), strict=True),
        kernreg.StrictFallbackError,
        LookupError,
        ("'hard.norm'", "'torch'"),
    ),
    (
        "select-traits-nothing",
        lambda r: r.select(OP, traits=["inplace"]),
        NoEligibleKernelError,
        LookupError,
        ("'hard.norm'", "inplace"),
    ),
    (
        "get-kernel-backend-list",
        lambda r: r.get_kernel(OP, backend=["triton"]),
        InvalidSpecError,
        ValueError,
        ("['triton']",),
    ),
    (
        "get-kernel-dtypes-nested",
        lambda r: r.get_kernel(OP, dtypes=[["bf16"]]),
        InvalidSpecError,
        ValueError,
        ("['bf16']",),
    ),
    (
        "get-kernel-dtypes-int",
        lambda r: r.get_kernel(OP, dtypes=3),
        InvalidSpecError,
        ValueError,
        ("3",),
    ),
    (
        "get-kernel-traits-nested",
        lambda r: r.get_kernel(OP, traits=[["x"]]),
        InvalidSpecError,
        ValueError,
        ("['x']",),
    ),
    (
        "get-kernel-op-list",
        lambda r: r.get_kernel(["hard.norm"]),
        InvalidSpecError,
        ValueError,
        ("['hard.norm']",),
    ),
    (
        "use-backend-bad-glob",
        lambda r: kernreg.use_backend("Hard.*", "torch").__enter__(),
        InvalidSpecError,
        ValueError,
        ("'Hard.*'",),
    ),
    (
        "use-backend-bad-backend",
        lambda r: kernreg.use_backend("hard.*", "Torch").__enter__(),
        InvalidSpecError,
        ValueError,
        ("'Torch'",),
    ),
    (
        "use-backend-bare-word",
        lambda r: kernreg.use_backend("hard", "torch").__enter__(),
        InvalidSpecError,
        ValueError,
        ("'hard'",),
    ),
    (
        "op-bad-id",
        lambda r: kernreg.op("Hard.x", registry=r),
        InvalidSpecError,
        ValueError,
        ("'Hard.x'",),
    ),
    (
        "op-bad-backend",
        lambda r: kernreg.op("hard.x", backend="T", registry=r),
        InvalidSpecError,
        ValueError,
        ("'T'",),
    ),
    (
        "op-bad-dispatch-arg",
        lambda r: kernreg.op("hard.x", dispatch_args=["y"], registry=r)(lambda x: x),
        InvalidSpecError,
        ValueError,
        ("'y'",),
    ),
    (
        "op-reserved-parameter",
        lambda r: kernreg.op("hard.x", registry=r)(lambda _kr_box: 1),
        InvalidSpecError,
        ValueError,
        ("'_kr_box'",),
    ),
    (
        "op-second-reference",
        lambda r: kernreg.op(OP, backend="aten", registry=r)(lambda x: x),
        DuplicateReferenceError,
        ValueError,
        ("'hard.norm'",),
    ),
    (
        "dispatcher-unknown-op",
        lambda r: kernreg.dispatcher("hard.nope", registry=r),
        OpNotFoundError,
        KeyError,
        ("'hard.nope'",),
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "builtin", "named"),
    [pytest.param(c, e, b, n, id=name) for name, c, e, b, n in REGISTRY_CALLS],
)
def test_a_bad_registry_call_fails_with_its_error_and_changes_nothing(
    populated: KernelRegistry,
    call: Callable[[KernelRegistry], object],
    error: type[Any],
    builtin: type[Exception],
    named: tuple[str, ...],
) -> None:
    assert_fails_cleanly(populated, lambda: call(populated), error, builtin, *named)


def test_a_frozen_registry_refuses_every_mutation_and_changes_nothing(
    populated: KernelRegistry,
) -> None:
    populated.freeze()
    mutations: list[Callable[[], object]] = [
        lambda: populated.register(_spec("cuda")),
        lambda: populated.register(_spec("triton", priority=1), replace=True),
        lambda: populated.unregister(OP, "triton"),
        lambda: kernreg.op("hard.new", registry=populated)(lambda x: x),
    ]
    for mutate in mutations:
        assert_fails_cleanly(populated, mutate, RegistryFrozenError, RuntimeError, "frozen")
    # Registering an equal spec stays a no-op, also when frozen (module reloads).
    before = registry_state(populated)
    populated.register(populated.get_backend(OP, "triton"))
    assert registry_state(populated) == before


# --- targets that fail when they are loaded ---------------------------------------------------

LOAD_FAILURES: list[tuple[str, str, str]] = [
    # (id, target, the cause the message reports)
    ("missing-module", "hard_no_such_module:impl", "ModuleNotFoundError"),
    ("missing-package", "hard_no_such_pkg.sub:impl", "ModuleNotFoundError"),
    ("missing-attr", "hard_targets:nope", "AttributeError"),
    ("attr-chain-fails", "hard_targets:box.missing.deeper", "AttributeError"),
    ("attr-chain-through-int", "hard_targets:number.real.nope", "AttributeError"),
    ("raises-on-import", "hard_raises:impl", "RuntimeError: hard_raises fails on import"),
    ("exits-on-import", "hard_exits:impl", "SystemExit"),
    ("not-callable-instance", "hard_targets:box", "TypeError: Box object is not callable"),
    ("not-callable-int", "hard_targets:number", "TypeError: int object is not callable"),
]


@pytest.mark.parametrize(
    ("target", "cause"), [pytest.param(t, c, id=name) for name, t, c in LOAD_FAILURES]
)
def test_a_target_that_cannot_load_is_a_kernel_load_error_naming_it(
    populated: KernelRegistry, target: str, cause: str
) -> None:
    populated.register(_spec("cuda", target, priority=30))
    populated.select(OP)  # deciding imports nothing
    named = ("'hard.norm'", "'cuda'", repr(target), cause)
    if cause == "SystemExit":
        # An import that calls sys.exit is a BaseException: kernreg does not turn it into
        # an ImportError (see RELIABILITY.md, known limits), but it must not half-change anything.
        before = registry_state(populated)
        with pytest.raises(SystemExit):
            populated.get_kernel(OP)
        assert registry_state(populated) == before
        return
    assert_fails_cleanly(
        populated, lambda: populated.get_kernel(OP), KernelLoadError, ImportError, *named
    )
    # The op object raises the same error at the call, and keeps raising it (never a stale target).
    with pytest.raises(KernelLoadError, match=repr(target).replace(".", r"\.")):
        populated.get_kernel(OP)


@pytest.mark.parametrize(
    ("when", "cause"),
    [
        ("hard_no_such_module:pred", "ModuleNotFoundError"),
        ("hard_targets:number", "is not callable"),
        ("hard_raises:pred", "RuntimeError"),
    ],
)
def test_a_when_predicate_that_cannot_load_fails_the_call_naming_it(
    registry: KernelRegistry, targets: None, when: str, cause: str
) -> None:
    @kernreg.op("hard.gated", registry=registry)
    def gated(x: Any) -> str:
        return "ref"

    gated.register("fast", GOOD, when=when, priority=5)
    before = registry_state(registry)
    for _ in range(2):  # the second call must not find a half-built chooser cached
        with pytest.raises(KernelLoadError) as info:
            gated(1)
        assert cause in str(info.value)
        assert "'hard.gated'" in str(info.value)
        assert "'fast'" in str(info.value)
    assert registry_state(registry) == before


def test_an_op_object_whose_target_fails_raises_on_every_call_and_recovers(
    registry: KernelRegistry, targets: None
) -> None:
    @kernreg.op("hard.calls", registry=registry)
    def calls(x: Any) -> str:
        return "ref"

    calls.register("cuda", "hard_no_such_module:impl", priority=5)
    for _ in range(3):
        with pytest.raises(KernelLoadError, match="hard_no_such_module"):
            calls(1)
    calls.register("cuda", GOOD, priority=5, replace=True)
    assert calls(1) == "impl"


# --- strings parsed by kernreg --------------------------------------------------------------

BAD_REQUIREMENTS = [
    "",
    " ",
    "cuda>=",
    "cuda>=8",
    "cuda>=8.0,",
    "cuda>=8.0,>=9.0",
    "cuda==9.0,<=9.0",
    "cuda<=8.0,>=9.0",
    "cuda>8.0",
    "cuda=>8.0",
    "cuda:",
    "cuda:sm_90|",
    "cuda:|sm_90",
    "cuda:SM_90",
    "hip:gfx-942",
    "CUDA",
    "cu da",
    "1cuda",
    "cuda>=8.0:sm_90",
    "cuda>=a.b",
    "cuda\n>=8.0x",
]


@pytest.mark.parametrize("text", BAD_REQUIREMENTS)
def test_bad_requirement_strings(text: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        Requirement.parse(text)
    assert isinstance(info.value, ValueError)
    assert info.value.field == "requirement"
    assert repr(text) in str(info.value) or "min_arch is above max_arch" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"device": None}, "requirement device"),
        ({"device": "Cuda"}, "requirement device"),
        ({"device": "cuda", "min_arch": (9,)}, "requirement min_arch"),
        ({"device": "cuda", "min_arch": (-1, 0)}, "requirement min_arch"),
        ({"device": "cuda", "min_arch": [9, 0]}, "requirement min_arch"),
        ({"device": "cuda", "max_arch": "nine"}, "requirement max_arch"),
        ({"device": "cuda", "min_arch": (9, 0), "max_arch": (8, 0)}, "requirement"),
        ({"device": "cuda", "archs": "sm_90"}, "requirement archs"),
        ({"device": "cuda", "archs": [3]}, "requirement archs"),
        ({"device": "cuda", "archs": [["sm_90"]]}, "requirement archs"),
        ({"device": "cuda", "archs": ["SM_90"]}, "requirement archs"),
    ],
)
def test_bad_requirement_objects(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        Requirement(**kwargs)
    assert info.value.field == field


BAD_PLATFORMS = [
    "",
    " ",
    ":",
    "cuda:",
    ":9.0",
    "cuda:9",
    "cuda:9.",
    "cuda:nine",
    "cuda:sm90",
    "cuda:sm_9",
    "cuda:gfx942",
    "hip:942",
    "hip:sm_90",
    "hip:gfx-942",
    "x:1:2",
    "cu da",
    "1cuda",
    "cuda:9.0:1",
    "cud\u0430:9.0",  # a Cyrillic a
    "cuda:9.0\x00",
]


@pytest.mark.parametrize("text", BAD_PLATFORMS)
def test_bad_platform_strings(text: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        Platform.parse(text)
    assert isinstance(info.value, ValueError)
    assert info.value.field == "platform"
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("value", [None, 9, b"cuda", ["cuda"]])
def test_platform_parse_of_a_non_string(value: object) -> None:
    with pytest.raises(InvalidSpecError, match="invalid platform"):
        Platform.parse(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name",
    ["", " ", "bfloat17", "bf", "torch.", "float8", "Float33", "int128", "fp4", None, 16, ["bf16"]],
)
def test_bad_dtype_names(name: object) -> None:
    with pytest.raises(InvalidSpecError) as info:
        kernreg.normalize_dtype(name)
    assert info.value.field == "dtype"
    assert repr(name) in str(info.value)


# --- configuration: every variable, wrong ----------------------------------------------------

BAD_ENV: list[tuple[str, str]] = [
    ("KERNREG_PLATFORM", "cuda:"),
    ("KERNREG_PLATFORM", "cuda:90"),
    ("KERNREG_PLATFORM", "gpu:9.0:x"),
    ("KERNREG_BACKEND", "Triton"),
    ("KERNREG_BACKEND", "triton/v2"),
    ("KERNREG_PIN", "layernorm.rmsnorm"),
    ("KERNREG_PIN", "=torch"),
    ("KERNREG_PIN", "layernorm=torch"),
    ("KERNREG_PIN", "layernorm.*=Torch"),
    ("KERNREG_PIN", "layernorm.*=torch/V2"),
    ("KERNREG_PIN", "a.b=torch,a.b=triton"),
    ("KERNREG_DENY", "Triton"),
    ("KERNREG_DENY", "layernorm=jit"),
    ("KERNREG_DENY", "a.*=jit/V"),
    ("KERNREG_STRICT", "2"),
    ("KERNREG_STRICT", "maybe"),
    ("KERNREG_STRICT", "Layernorm.*"),
    ("KERNREG_TRAITS", "Deterministic"),
    ("KERNREG_TRAITS", "batch-invariant"),
    ("KERNREG_PLUGINS", "my plugin"),
    ("KERNREG_PLUGINS", "-bad"),
    ("KERNREG_PLUGINS", ","),
    ("KERNREG_PLUGINS_DENY", "bad name!"),
    ("KERNREG_STRICT_PLUGINS", "2"),
    ("KERNREG_STRICT_PLUGINS", "sometimes"),
    ("KERNREG_LOCK", "/nonexistent/kernreg.lock"),
    ("KERNREG_LOCK", "/"),
    ("KERNREG_LOCK", "plan\x00.lock"),
    ("KERNREG_POLICY", "fastest"),
    ("KERNREG_POLICY", "Layernorm.*"),
    ("KERNREG_CACHE_DIR", "   "),
    ("KERNREG_CACHE_DIR", "cache\x00dir"),
    ("KERNREG_CONFIG", "/nonexistent/kernreg.toml"),
    ("KERNREG_CONFIG", "/"),
    ("KERNREG_CONFIG", "conf\x00.toml"),
    ("KERNREG_ASSUME_PACKAGES", "triton"),
    ("KERNREG_ASSUME_PACKAGES", "triton>=3.4"),
    ("KERNREG_ASSUME_PACKAGES", "triton==3.4,triton==3.5"),
    ("KERNREG_ASSUME_PACKAGES", "triton==3.4\x00"),
]


def test_the_env_corpus_covers_every_variable() -> None:
    assert {var for var, _ in BAD_ENV} == set(ENV_VARS)


@pytest.mark.parametrize(("var", "value"), BAD_ENV)
def test_a_bad_environment_value_is_a_config_error_naming_the_variable(
    var: str, value: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config({var: value})
    assert isinstance(info.value, ValueError)
    assert info.value.key == var
    assert str(info.value).startswith(f"invalid configuration {var}={value!r}")
    if "\x00" in value:
        return  # the process environment itself cannot hold a NUL byte
    # The registry reports it at first use, and keeps reporting it: never a half-read config.
    monkeypatch.setenv(var, value)
    reg = KernelRegistry()
    for _ in range(2):
        with pytest.raises(ConfigError, match=var):
            reg.config  # noqa: B018
        with pytest.raises(ConfigError, match=var):
            reg.select("hard.anything")


BAD_TOML: list[tuple[str, str, str]] = [
    # (id, the file's text, the key the error names)
    ("platform-type", "platform = 3", "platform"),
    ("platform-value", 'platform = "cuda:"', "platform"),
    ("backend-type", "backend = 1", "backend"),
    ("backend-value", 'backend = "B"', "backend"),
    ("pin-type", "pin = 3", "pin"),
    ("pin-list-of-int", "pin = [1]", "pin"),
    ("pin-table-value", 'pin = {"a.b" = 3}', "pin.a.b"),
    ("pin-table-glob", 'pin = {"A" = "torch"}', "pin"),
    ("pin-bare-op", 'pin = ["a.b"]', "pin"),
    ("pin-twice", 'pin = "a.b=t,a.b=u"', "pin"),
    ("deny-type", "deny = 3", "deny"),
    ("deny-table", 'deny = {"a.b" = "x"}', "deny"),
    ("strict-type", "strict = 3", "strict"),
    ("strict-glob", 'strict = ["A"]', "strict"),
    ("traits-type", "traits = 3", "traits"),
    ("traits-name", 'traits = ["A"]', "traits"),
    ("plugins-type", "plugins = 3", "plugins"),
    ("plugins-empty-list", "plugins = []", "plugins"),
    ("plugins-name", 'plugins = ["a b"]', "plugins"),
    ("plugins-deny-type", "plugins_deny = 3", "plugins_deny"),
    ("strict-plugins-type", "strict_plugins = 3", "strict_plugins"),
    ("strict-plugins-value", 'strict_plugins = "maybe"', "strict_plugins"),
    ("lock-type", "lock = 3", "lock"),
    ("lock-missing", 'lock = "/nonexistent.lock"', "lock"),
    ("policy-type", "policy = 3", "policy"),
    ("policy-glob", 'policy = ["A"]', "policy"),
    ("cache-dir-type", "cache_dir = 3", "cache_dir"),
    ("cache-dir-empty", 'cache_dir = ""', "cache_dir"),
    ("assume-packages-type", "assume_packages = 3", "assume_packages"),
    ("assume-packages-item", 'assume_packages = ["triton>=3.4"]', "assume_packages"),
    ("unknown-key", "plaform = 'cpu'", "plaform"),
    ("tool-kernreg-not-a-table", "[tool]\nkernreg = 3", "tool.kernreg"),
    ("pyproject-bad-value", "[tool.kernreg]\nstrict = 3", "strict"),
]


def test_the_toml_corpus_covers_every_key() -> None:
    keys = {key for toml_key, _ in ENV_VARS.values() if (key := toml_key)}
    assert keys <= {key.partition(".")[0] for _, _, key in BAD_TOML}


@pytest.mark.parametrize(
    ("text", "key"), [pytest.param(text, key, id=name) for name, text, key in BAD_TOML]
)
def test_a_bad_toml_value_is_a_config_error_naming_file_and_key(
    tmp_path: Path, text: str, key: str
) -> None:
    path = tmp_path / "kernreg.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as info:
        load_config({"KERNREG_CONFIG": str(path)})
    assert info.value.key == f"{path}: {key}"
    assert str(info.value).startswith(f"invalid configuration {path}: {key}=")


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"platform = ", "cannot read TOML"),
        (b"x = [", "cannot read TOML"),
        (b"platform = 'cpu'\nplatform = 'cpu'\n", "cannot read TOML"),
        (b"\xff\xfe\x00garbage", "cannot read TOML"),
        (b"\x7fELF\x02\x01\x01\x00\x00", "cannot read TOML"),
    ],
    ids=["truncated", "unclosed", "duplicate-key", "not-utf8", "binary"],
)
def test_an_unreadable_toml_file_is_a_config_error_naming_kernreg_config(
    tmp_path: Path, content: bytes, why: str
) -> None:
    path = tmp_path / "kernreg.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config({"KERNREG_CONFIG": str(path)})
    assert info.value.key == "KERNREG_CONFIG"
    assert str(path) in str(info.value)
    assert why in str(info.value)


# --- lock files: truncated, from the future, hand-edited ------------------------------------


@pytest.fixture
def lock_text(targets: None) -> str:
    reg = KernelRegistry(config=Config(), platform=Platform.parse("cuda:9.0"))
    reg.register(KernelSpec(OP, "torch", "hard_targets:ref", reference=True))
    reg.register(KernelSpec(OP, "triton", GOOD, dtypes=["bf16"], priority=10))
    return kernreg.build_plan(reg, platforms=["cuda:9.0", "cpu"]).to_json()


def _edit(text: str, edit: Callable[[dict[str, Any]], None]) -> str:
    document = json.loads(text)
    edit(document)
    return json.dumps(document)


def _set_field(name: str, value: Any, row: int = 0) -> Callable[[dict[str, Any]], None]:
    def edit(document: dict[str, Any]) -> None:
        document["entries"][row][document["fields"].index(name)] = value

    return edit


LOCK_EDITS: list[tuple[str, Callable[[str], str], str]] = [
    ("truncated-half", lambda t: t[: len(t) // 2], "not JSON"),
    ("truncated-last-byte", lambda t: t.rstrip()[:-1], "not JSON"),
    ("truncated-to-header", lambda t: t[: t.index('"fields"')], "not JSON"),
    ("empty", lambda t: "", "not JSON"),
    ("future-format", lambda t: t.replace('"kernreg_plan": 1', '"kernreg_plan": 2'), "format 2"),
    (
        "format-as-string",
        lambda t: t.replace('"kernreg_plan": 1', '"kernreg_plan": "1"'),
        "format '1'",
    ),
    ("no-format", lambda t: _edit(t, lambda d: d.pop("kernreg_plan")), "not a kernreg plan"),
    ("fields-reordered", lambda t: _edit(t, lambda d: d["fields"].reverse()), "'fields' must be"),
    (
        "entries-not-list",
        lambda t: _edit(t, lambda d: d.update(entries={})),
        "'entries' must be a list",
    ),
    ("row-too-short", lambda t: _edit(t, lambda d: d["entries"][0].pop()), "entry 0 is not a row"),
    (
        "op-not-an-id",
        lambda t: _edit(t, _set_field("op", "Hard.Norm")),
        "entry 0: invalid op 'Hard.Norm'",
    ),
    ("op-int", lambda t: _edit(t, _set_field("op", 3)), "field 'op' is 3"),
    (
        "backend-not-a-name",
        lambda t: _edit(t, _set_field("backend", "Triton")),
        "invalid backend 'Triton'",
    ),
    (
        "variant-not-a-name",
        lambda t: _edit(t, _set_field("variant", "V 2")),
        "invalid variant 'V 2'",
    ),
    (
        "platform-typo",
        lambda t: _edit(t, _set_field("platform", "cuda:90")),
        "invalid platform 'cuda:90'",
    ),
    ("dtypes-string", lambda t: _edit(t, _set_field("dtypes", "bfloat16")), "field 'dtypes'"),
    ("dtypes-int-item", lambda t: _edit(t, _set_field("dtypes", [16])), "field 'dtypes'"),
    ("rule-null", lambda t: _edit(t, _set_field("rule", None)), "field 'rule' is None"),
    (
        "duplicate-entry",
        lambda t: _edit(
            t,
            lambda d: d["entries"].append([*d["entries"][0][:3], "cuda", *d["entries"][0][4:]]),
        ),
        "two entries for hard.norm",
    ),
]


@pytest.mark.parametrize(
    ("edit", "why"), [pytest.param(e, w, id=name) for name, e, w in LOCK_EDITS]
)
def test_a_damaged_lock_file_is_refused_naming_the_file(
    lock_text: str, tmp_path: Path, edit: Callable[[str], str], why: str
) -> None:
    SelectionPlan.from_json(lock_text)  # the unedited file is fine
    path = tmp_path / "kernreg.lock"
    path.write_text(edit(lock_text))
    with pytest.raises(PlanError) as info:
        SelectionPlan.load(path)
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(f"invalid selection plan {path}: ")
    assert why in str(info.value)
    # Through KERNREG_LOCK: a configuration error at start-up, naming the variable and file.
    with pytest.raises(ConfigError) as config_info:
        load_config({"KERNREG_LOCK": str(path)})
    assert config_info.value.key == "KERNREG_LOCK"
    assert str(path) in str(config_info.value)


@pytest.mark.parametrize("content", [b"\xff\xfe{", b"\x00" * 16], ids=["not-utf8", "nul-bytes"])
def test_a_binary_lock_file_is_a_plan_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "kernreg.lock"
    path.write_bytes(content)
    with pytest.raises(PlanError, match="invalid selection plan"):
        SelectionPlan.load(path)


# --- tuning stores: truncated, from the future, hand-edited ---------------------------------

KEY = TuningKey(OP, "cuda:9.0|torch=-|runtime=-", "torch=a:b", ("bfloat16",), "x=1024")
RESULT = {"torch": Measurement(100.0, 1.0, 5), "triton": Measurement(50.0, 1.0, 5)}


def _sql(path: Path, *statements: str) -> None:
    conn = sqlite3.connect(path)
    try:
        for statement in statements:
            conn.execute(statement)
        conn.commit()
    finally:
        conn.close()


def _truncate(fraction: float) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * fraction)])

    return damage


STORE_DAMAGE: list[tuple[str, Callable[[Path], None], str]] = [
    ("truncated-to-header", _truncate(0.02), "corrupt"),
    ("truncated-half", _truncate(0.5), "corrupt"),
    ("garbage", lambda p: p.write_bytes(b"not a database at all" * 100), "corrupt"),
    ("future-schema", lambda p: _sql(p, "PRAGMA user_version = 2"), "foreign-v2"),
    ("foreign-application", lambda p: _sql(p, "PRAGMA application_id = 7"), "foreign-v1"),
    ("table-dropped", lambda p: _sql(p, "DROP TABLE measurements"), "corrupt"),
    (
        "column-renamed",
        lambda p: _sql(p, "ALTER TABLE entries RENAME COLUMN bucket TO shape"),
        "corrupt",
    ),
    (
        "median-edited-to-text",
        lambda p: _sql(p, "UPDATE measurements SET median_ns = 'fast'"),
        "corrupt",
    ),
    (
        "repeats-edited-to-text",
        lambda p: _sql(p, "UPDATE measurements SET repeats = 'many'"),
        "corrupt",
    ),
    ("dtypes-edited-not-json", lambda p: _sql(p, "UPDATE entries SET dtypes = 'bf16'"), "corrupt"),
    ("dtypes-edited-to-number", lambda p: _sql(p, "UPDATE entries SET dtypes = '3'"), "corrupt"),
]


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    path = tmp_path / "cache" / "tuning.sqlite3"
    with TuningStore(path) as store:
        store.put(KEY, RESULT)
        store.put(TuningKey(OP, "cpu|torch=-|runtime=-", "torch=a:b", (), "-"), RESULT)
    return path


@pytest.mark.parametrize(
    ("damage", "aside"), [pytest.param(d, a, id=name) for name, d, a in STORE_DAMAGE]
)
@pytest.mark.parametrize("read", ["get", "entries", "put"])
def test_a_damaged_tuning_store_is_set_aside_and_rebuilt_never_a_crash(
    store_path: Path, damage: Callable[[Path], None], aside: str, read: str
) -> None:
    damage(store_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = TuningStore(store_path)
        try:
            other = TuningKey(OP, "cpu|torch=-|runtime=-", "torch=a:b", ("float32",), "-")
            if read == "get":
                found = store.get(KEY)
                assert found in (None, RESULT)
            elif read == "entries":
                assert all(results == RESULT for _, results in store.entries())
            else:
                assert store.put(other, RESULT) == RESULT
            # Whatever happened, the store works afterwards, to the last row.
            assert store.put(other, RESULT) == RESULT
            assert store.get(other) == RESULT
            assert all(results == RESULT for _, results in store.entries())
        finally:
            store.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, TuningStoreWarning)]
    assert [w for w in caught if not issubclass(w.category, TuningStoreWarning)] == []
    assert len(messages) == 1, messages
    assert str(store_path) in messages[0]
    assert any(
        name.startswith(f"tuning.sqlite3.{aside}-") for name in os.listdir(store_path.parent)
    )


def test_a_registry_whose_store_was_hand_edited_decides_instead_of_crashing(
    tmp_path: Path, targets: None
) -> None:
    reg = KernelRegistry(config=Config(policy=("*",)), platform=Platform.parse("cpu"))
    reg.register(KernelSpec(OP, "torch", "hard_targets:ref", reference=True))
    reg.register(KernelSpec(OP, "fast", GOOD, priority=1))
    reg.register(KernelSpec(OP, "faster", GOOD, priority=1, variant="v2"))
    store = TuningStore(tmp_path / "tuning.sqlite3")
    reg.use_tuning_store(store)
    plat = reg.platform
    reg.record_measurements(
        OP, plat, None, "x=8", {"fast": Measurement(10, 0, 3), "faster/v2": Measurement(5, 0, 3)}
    )
    _sql(tmp_path / "tuning.sqlite3", "UPDATE measurements SET median_ns = 'quick'")
    fresh = KernelRegistry(config=Config(policy=("*",)), platform=Platform.parse("cpu"))
    for spec in reg.all_specs():
        fresh.register(spec)
    fresh.use_tuning_store(TuningStore(tmp_path / "tuning.sqlite3"))
    with pytest.warns(TuningStoreWarning, match="is damaged"):
        decision = fresh.explain(OP, bucket="x=8", autotune=True)
    assert decision.tuning  # nothing recorded any more: measure again
    store.close()

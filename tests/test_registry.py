"""KernelRegistry: conflicts, overrides, lookups, references, freezing, scoping, ordering."""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kernreg
from _support import BAD_INPUT_OP, BAD_INPUT_TARGET, assert_fails_cleanly, registry_state
from kernreg import (
    BackendNotFoundError,
    InvalidSpecError,
    KernelConflictError,
    KernelLoadError,
    KernelRegistry,
    KernelSpec,
    NoEligibleKernelError,
    OpNotFoundError,
    Platform,
)
from kernreg.config import Config, ConfigWarning
from kernreg.errors import DuplicateReferenceError, RegistryFrozenError
from kernreg.spec import Origin

RMS = "layernorm.rmsnorm"


def spec(
    backend: str = "triton", target: Any = "pkg_a.k:rms", op: str = RMS, **kw: Any
) -> KernelSpec:
    return KernelSpec(op, backend, target, **kw)


def test_register_returns_stored_spec_with_origin(registry: KernelRegistry) -> None:
    stored = registry.register(spec())
    assert stored == spec()
    assert stored.origin is not None
    assert registry.get(RMS) == (stored,)
    assert registry.get_backend(RMS, "triton") is stored
    assert registry.has(RMS)
    assert RMS in registry
    assert len(registry) == 1


def test_identical_reregistration_is_a_no_op(registry: KernelRegistry) -> None:
    first = registry.register(spec(dtypes=["bf16"]))
    generation = registry.generation
    again = registry.register(spec(dtypes=["bfloat16"]))
    assert again is first
    assert registry.get(RMS) == (first,)
    assert registry.overrides() == ()
    assert registry.generation == generation  # nothing cached was thrown away


def test_conflict_message(registry: KernelRegistry) -> None:
    first = registry.register(spec(target="pkg_a.k:rms"))
    second = spec(target="pkg_b.k:rms", origin=Origin("pkg_b/k.py", 12, "pkg-b", "2.0"))
    with pytest.raises(KernelConflictError) as info:
        registry.register(second)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert message.startswith(
        "Conflicting kernel registration for op 'layernorm.rmsnorm', backend 'triton': "
        "'pkg_a.k:rms' != 'pkg_b.k:rms'"
    )
    assert f"registered first at: {first.origin}" in message
    assert "registered again at: pkg_b/k.py:12 (distribution pkg-b 2.0)" in message
    assert "replace=True" in message
    assert info.value.old is first
    assert info.value.new is second
    assert registry.get(RMS) == (first,)


def test_conflict_message_with_variant_and_callables(registry: KernelRegistry) -> None:
    def one(x: Any) -> Any:
        return x

    def two(x: Any) -> Any:
        return x

    registry.register(spec(target=one, variant="v2"))
    with pytest.raises(KernelConflictError) as info:
        registry.register(spec(target=two, variant="v2"))
    assert str(info.value).startswith(
        f"Conflicting kernel registration for op '{RMS}', backend 'triton/v2': "
        f"'{__name__}:test_conflict_message_with_variant_and_callables.<locals>.one' != "
        f"'{__name__}:test_conflict_message_with_variant_and_callables.<locals>.two'"
    )


@pytest.mark.parametrize(
    ("old", "new", "shown"),
    [
        ({"priority": 1}, {"priority": 2}, "priority 1 != 2"),
        ({"dtypes": ["bf16"]}, {"dtypes": ["fp16"]}, "dtypes ['bfloat16'] != ['float16']"),
        (
            {"requires": ["cuda>=8.0"]},
            {"requires": ["cuda>=9.0"]},
            "requires ['cuda>=8.0'] != ['cuda>=9.0']",
        ),
        ({}, {"traits": ["inplace"]}, "traits [] != ['inplace']"),
        ({}, {"packages": ["pytest"]}, "packages [] != ['pytest']"),
        ({}, {"description": "fast"}, "description '' != 'fast'"),
        ({}, {"when": "pkg.k:big"}, "when None != 'pkg.k:big'"),
        (
            {"priority": 1},
            {"priority": 2, "description": "x"},
            "priority 1 != 2, description '' != 'x'",
        ),
    ],
)
def test_conflict_with_equal_targets_shows_differing_fields(
    registry: KernelRegistry, old: dict[str, Any], new: dict[str, Any], shown: str
) -> None:
    registry.register(spec(**old))
    with pytest.raises(KernelConflictError) as info:
        registry.register(spec(**new))
    assert str(info.value).startswith(
        f"Conflicting kernel registration for op '{RMS}', backend 'triton': {shown}\n"
    )


def test_replace_is_recorded_with_both_origins(registry: KernelRegistry) -> None:
    old = registry.register(spec(target="pkg_a.k:rms"))
    new = registry.register(
        spec(target="pkg_b.k:rms", origin=Origin("pkg_b/k.py", 3)), replace=True
    )
    assert registry.get_backend(RMS, "triton") is new
    (override,) = registry.overrides()
    assert (override.kind, override.old, override.new) == ("replace", old, new)
    assert override.key == (RMS, "triton", "")
    text = str(override)
    assert "pkg_a.k:rms" in text
    assert "pkg_b.k:rms" in text
    assert str(old.origin) in text
    assert "pkg_b/k.py:3" in text


def test_replace_of_nothing_is_a_plain_registration(registry: KernelRegistry) -> None:
    registry.register(spec(), replace=True)
    assert registry.overrides() == ()


def test_unregister_is_recorded(registry: KernelRegistry) -> None:
    old = registry.register(spec())
    other = registry.register(spec("torch", "pkg.ref:rms", reference=True))
    removed = registry.unregister(RMS, "triton")
    assert removed is old
    assert registry.get(RMS) == (other,)
    (override,) = registry.overrides()
    assert (override.kind, override.old, override.new) == ("unregister", old, None)
    assert "unregistered at" in str(override)
    assert str(old.origin) in str(override)
    registry.register(spec(target="pkg_b.k:rms"))  # the key is free again: no conflict
    registry.unregister(RMS, "triton")
    registry.unregister(RMS, "torch")
    assert not registry.has(RMS)
    assert registry.ops() == ()
    assert [o.kind for o in registry.overrides()] == ["unregister"] * 3


def test_unregister_missing(registry: KernelRegistry) -> None:
    registry.register(spec())
    with pytest.raises(BackendNotFoundError, match="No 'torch' backend registered"):
        registry.unregister(RMS, "torch")
    with pytest.raises(BackendNotFoundError, match="No 'triton/v2' backend registered"):
        registry.unregister(RMS, "triton", "v2")
    with pytest.raises(OpNotFoundError):
        registry.unregister("x.y", "triton")
    assert registry.overrides() == ()


@pytest.mark.parametrize(
    ("backend", "variant", "message"),
    [
        ("triton", "", "No 'triton' backend registered for op 'layernorm.rmsnorm'"),
        ("triton", "v3", "No 'triton/v3' backend registered for op 'layernorm.rmsnorm'"),
        ("cuda", "", "No 'cuda' backend registered for op 'layernorm.rmsnorm'"),
    ],
)
def test_missing_backend_is_a_key_error_with_a_readable_message(
    registry: KernelRegistry, backend: str, variant: str, message: str
) -> None:
    registry.register(spec("torch", "pkg.ref:rms", reference=True))
    registry.register(spec("triton", "pkg.k:rms2", variant="v2"))
    with pytest.raises(KeyError) as info:
        registry.get_backend(RMS, backend, variant)
    assert isinstance(info.value, BackendNotFoundError)
    assert str(info.value) == f"{message}; registered: torch, triton/v2"
    assert not str(info.value).startswith(("'", '"'))
    assert (info.value.op, info.value.backend) == (RMS, backend)


def test_backend_not_found_message_without_known() -> None:
    assert str(BackendNotFoundError(RMS, "triton")) == (
        "No 'triton' backend registered for op 'layernorm.rmsnorm'"
    )


@pytest.mark.parametrize("lookup", ["get", "get_backend", "reference", "unregister"])
def test_unknown_op(registry: KernelRegistry, lookup: str) -> None:
    registry.register(spec())
    args = ("x.y", "triton") if lookup in ("get_backend", "unregister") else ("x.y",)
    with pytest.raises(KeyError) as info:
        getattr(registry, lookup)(*args)
    assert isinstance(info.value, OpNotFoundError)
    assert str(info.value) == "No kernels registered for op 'x.y'"
    assert info.value.op == "x.y"


@pytest.mark.parametrize("bad", ["X.y", "xy", "", "x..y"])
def test_lookup_of_malformed_op_id(registry: KernelRegistry, bad: str) -> None:
    with pytest.raises(InvalidSpecError):
        registry.get(bad)
    assert not registry.has(bad)


def test_register_rejects_non_specs(registry: KernelRegistry) -> None:
    with pytest.raises(InvalidSpecError, match="expected a KernelSpec"):
        registry.register((RMS, "triton", "pkg.k:rms"))  # type: ignore[arg-type]


# --- references ------------------------------------------------------------------------------


def test_at_most_one_reference_per_op(registry: KernelRegistry) -> None:
    ref = registry.register(spec("torch", "pkg.ref:rms", reference=True))
    second = spec("aten", "pkg.ref:rms2", reference=True)
    with pytest.raises(DuplicateReferenceError) as info:
        registry.register(second)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "already has a reference implementation 'torch'" in message
    assert "'aten'" in message
    assert str(ref.origin) in message
    assert (info.value.old, info.value.new) == (ref, second)
    assert registry.get(RMS) == (ref,)
    assert registry.reference(RMS) is ref
    # Another op may have its own reference.
    registry.register(spec("torch", "pkg.ref:silu", op="activation.silu", reference=True))


def test_replace_cannot_add_a_second_reference(registry: KernelRegistry) -> None:
    registry.register(spec("torch", "pkg.ref:rms", reference=True))
    registry.register(spec("aten", "pkg.ref:rms2"))
    with pytest.raises(DuplicateReferenceError):
        registry.register(spec("aten", "pkg.ref:rms2", reference=True), replace=True)


@pytest.mark.parametrize("how", ["replace", "unregister"])
def test_reference_can_move(registry: KernelRegistry, how: str) -> None:
    registry.register(spec("torch", "pkg.ref:rms", reference=True))
    if how == "replace":
        registry.register(spec("torch", "pkg.ref:rms"), replace=True)  # no longer a reference
    else:
        registry.unregister(RMS, "torch")
    assert (registry.reference(RMS) if registry.has(RMS) else None) is None
    new_ref = registry.register(spec("aten", "pkg.ref:rms2", reference=True))
    assert registry.reference(RMS) is new_ref


def test_replacing_the_reference_keeps_it_unique(registry: KernelRegistry) -> None:
    registry.register(spec("torch", "pkg.ref:rms", reference=True))
    new = registry.register(spec("torch", "pkg.ref:rms_v2", reference=True), replace=True)
    assert registry.reference(RMS) is new


# --- freezing and scoping --------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutation",
    [
        lambda r: r.register(spec("cuda", "pkg.k:rms")),
        lambda r: r.register(spec("triton", "pkg.k:rms2"), replace=True),
        lambda r: r.unregister(RMS, "triton"),
    ],
)
def test_frozen_registry_refuses_mutation(registry: KernelRegistry, mutation: Any) -> None:
    registry.register(spec())
    registry.freeze()
    assert registry.frozen
    with pytest.raises(RegistryFrozenError, match="frozen"):
        mutation(registry)
    assert registry.get(RMS) == (spec(),)
    assert registry.overrides() == ()
    # An identical re-registration writes nothing, so module reloads stay safe after freeze().
    assert registry.register(spec()) is registry.get(RMS)[0]
    with pytest.raises(RegistryFrozenError):
        registry.register(spec("triton", "pkg.k:other"), replace=True)


def _state(registry: KernelRegistry) -> tuple[Any, ...]:
    return (
        registry.ops(),
        tuple((s, s.origin) for s in registry.all_specs()),
        registry.overrides(),
        {op: registry.reference(op) for op in registry.ops()},
        registry.frozen,
        registry.config,
        registry.platform,
    )


def _mutate_everything(registry: KernelRegistry) -> None:
    from kernreg import Platform
    from kernreg.config import Config

    registry.register(spec("cuda", "pkg.k:rms"))
    registry.register(spec("triton", "pkg_b.k:rms"), replace=True)
    registry.unregister(RMS, "torch")
    registry.register(spec("aten", "pkg.ref:rms2", reference=True))
    registry.register(spec("torch", "pkg.ref:silu", op="activation.silu"))
    registry.configure(Config(strict=("*",)), platform=Platform.parse("hip:gfx942"))
    registry.freeze()


@pytest.mark.parametrize("fail", [False, True])
def test_scoped_restores_the_exact_prior_state(registry: KernelRegistry, fail: bool) -> None:
    registry.register(spec())
    registry.register(spec("torch", "pkg.ref:rms", reference=True))
    registry.register(spec("jit", "pkg.k:rms_jit"))
    registry.unregister(RMS, "jit")
    before = _state(registry)
    selected = registry.select(RMS)
    with (
        pytest.raises(RuntimeError) if fail else contextlib.nullcontext(),
        registry.scoped() as scoped,
    ):
        assert scoped is registry
        _mutate_everything(registry)
        assert _state(registry) != before
        if fail:
            raise RuntimeError("test failed inside the block")
    assert _state(registry) == before
    assert registry.select(RMS) == selected
    registry.register(spec("cuda", "pkg.k:rms"))  # not frozen any more


def test_scoped_blocks_nest(registry: KernelRegistry) -> None:
    registry.register(spec())
    with registry.scoped():
        registry.register(spec("cuda", "pkg.k:rms"))
        with registry.scoped():
            registry.unregister(RMS, "cuda")
            registry.unregister(RMS, "triton")
            assert registry.ops() == ()
        assert [s.backend for s in registry.get(RMS)] == ["cuda", "triton"]
    assert [s.backend for s in registry.get(RMS)] == ["triton"]


def test_scoped_allows_changes_to_a_frozen_registry(registry: KernelRegistry) -> None:
    # The frozen-registry error tells people to use scoped() in tests: that has to work.
    registry.register(spec())
    registry.freeze()
    with registry.scoped():
        registry.register(spec("cuda", "pkg.k:rms"))
        assert registry.select(RMS, backend="cuda").backend == "cuda"
    assert registry.frozen
    assert registry.get(RMS) == (spec(),)
    with pytest.raises(RegistryFrozenError):
        registry.register(spec("cuda", "pkg.k:rms"))


def test_kernreg_registry_is_the_module_and_its_old_spelling_warns() -> None:
    import kernreg.registry as module

    assert module is sys.modules["kernreg.registry"]
    assert kernreg.registry is module
    assert module.KernelRegistry is kernreg.KernelRegistry
    with pytest.warns(DeprecationWarning, match=r"kernreg.default_registry\(\).scoped"):
        scoped = kernreg.registry.scoped
    with scoped() as reg:
        assert reg is kernreg.default_registry()
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        kernreg.registry.no_such_thing  # noqa: B018


def test_process_wide_registry_and_register_kernel() -> None:
    assert isinstance(kernreg.default_registry(), kernreg.KernelRegistry)
    with kernreg.default_registry().scoped():
        stored = kernreg.register_kernel(spec(op="kr_test.process_wide"))
        assert kernreg.default_registry().get("kr_test.process_wide") == (stored,)
        with pytest.raises(KernelConflictError):
            kernreg.register_kernel(spec(target="pkg_b.k:rms", op="kr_test.process_wide"))
        kernreg.register_kernel(spec(target="pkg_b.k:rms", op="kr_test.process_wide"), replace=True)
    assert not kernreg.default_registry().has("kr_test.process_wide")


# --- ordering --------------------------------------------------------------------------------

INVENTORY = [
    spec("torch", "pkg.ref:rms", reference=True),
    spec("triton", "pkg.k:rms", priority=10),
    spec("triton", "pkg.k:rms_v2", variant="v2", priority=10),
    spec("cuda", "pkg.k:rms_cuda", priority=20),
    spec("aot", "pkg.k:rms_aot", variant="sm90a", priority=20),
    spec("jit", "pkg.k:rms_jit", priority=-1),
    spec("torch", "pkg.ref:silu", op="activation.silu_and_mul", reference=True),
    spec("triton", "pkg.k:silu", op="activation.silu_and_mul"),
    spec("torch", "pkg.ref:rope", op="attention.rope", reference=True),
]


def _inventory(order: tuple[KernelSpec, ...]) -> KernelRegistry:
    registry = KernelRegistry()
    for s in order:
        registry.register(s)
    return registry


def test_ordering_is_independent_of_registration_order() -> None:
    expected = _inventory(tuple(INVENTORY))
    assert expected.ops() == ("activation.silu_and_mul", "attention.rope", "layernorm.rmsnorm")
    assert [s.label for s in expected.get(RMS)] == [
        "aot/sm90a",
        "cuda",
        "triton",
        "triton/v2",
        "torch",
        "jit",
    ]
    orders = list(itertools.islice(itertools.permutations(INVENTORY), 0, None, 997))
    orders.append(tuple(reversed(INVENTORY)))
    assert len(orders) > 100
    for order in orders:
        registry = _inventory(order)
        assert registry.ops() == expected.ops()
        assert registry.all_specs() == expected.all_specs()
        for op in expected.ops():
            assert registry.get(op) == expected.get(op)


def test_all_specs_is_sorted_by_op_then_priority(registry: KernelRegistry) -> None:
    for s in reversed(INVENTORY):
        registry.register(s)
    ops = [s.op for s in registry.all_specs()]
    assert ops == sorted(ops)
    assert len(registry) == len(INVENTORY) == len(registry.all_specs())
    assert repr(registry) == "<KernelRegistry 3 ops, 9 implementations>"


RELOAD_REGISTRY = """
import kernreg

registry = kernreg.KernelRegistry(config=kernreg.config.Config(), platform=kernreg.Platform("cpu"))
"""

RELOADABLE = """
import kernreg
from reload_registry import registry

@kernreg.op("demo.reload", registry=registry)
def reference(x):
    return ("reference", VERSION)

@reference.register("fast", priority=1)
def fast(x):
    return ("fast", VERSION)

VERSION = 1
"""


def test_reloading_a_module_that_defines_an_op_is_safe(tmp_path: Any, monkeypatch: Any) -> None:
    import importlib
    import sys

    (tmp_path / "reload_registry.py").write_text(RELOAD_REGISTRY)
    (tmp_path / "reloadable_kernels.py").write_text(RELOADABLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("reloadable_kernels")
    try:
        registry = module.registry
        assert module.reference(0) == ("fast", 1)
        source = tmp_path / "reloadable_kernels.py"
        source.write_text(RELOADABLE.replace("VERSION = 1", "VERSION = 2"))
        # Same size, same second: where byte code is written, its cache would look current.
        later = source.stat().st_mtime + 2
        os.utime(source, (later, later))
        importlib.invalidate_caches()
        reloaded = importlib.reload(module)
        # The new function objects replace the old ones: no conflict, no override recorded.
        assert registry.get_backend("demo.reload", "fast").target is reloaded.fast
        assert registry.overrides() == ()
        assert reloaded.fast(0) == ("fast", 2)
        # A different function at the same key is still a conflict.
        with pytest.raises(KernelConflictError):
            reloaded.reference.register("fast", priority=1)(lambda x: x)
    finally:
        sys.modules.pop("reloadable_kernels", None)
        sys.modules.pop("reload_registry", None)


def _register_scaled(registry: KernelRegistry, scale: float) -> KernelSpec:
    """A helper registering a new closure per call: one source line, different functions."""

    def scaled(x: Any) -> Any:
        return x * scale

    return registry.register(KernelSpec(RMS, "triton", scaled))  # origin: helper


def test_closures_registered_from_one_line_conflict(registry: KernelRegistry) -> None:
    first = _register_scaled(registry, 2.0)
    with pytest.raises(KernelConflictError) as info:
        _register_scaled(registry, 3.0)
    assert info.value.old is first
    stored = registry.get_backend(RMS, "triton")
    assert stored is first
    assert stored.target(1.0) == 2.0
    assert registry.overrides() == ()


def test_closures_registered_through_an_op_object_conflict(registry: KernelRegistry) -> None:
    @kernreg.op("demo.closure", registry=registry)
    def reference(x: Any) -> Any:
        return x

    def add_variant(scale: float) -> None:
        reference.register("fast", priority=1)(lambda x: x * scale)

    add_variant(2.0)
    with pytest.raises(KernelConflictError):
        add_variant(3.0)
    assert registry.get_backend("demo.closure", "fast").target(1.0) == 2.0
    # Replacing on purpose still works, and is recorded.
    reference.register("fast", priority=1, replace=True)(lambda x: x * 4.0)
    assert registry.get_backend("demo.closure", "fast").target(1.0) == 4.0
    assert [o.kind for o in registry.overrides()] == ["replace"]


def test_reloading_an_unchanged_module_is_silent(tmp_path: Any, monkeypatch: Any) -> None:
    import importlib
    import sys

    (tmp_path / "reload_registry.py").write_text(RELOAD_REGISTRY)
    (tmp_path / "reloadable_kernels.py").write_text(RELOADABLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("reloadable_kernels")
    try:
        old_fast = module.fast
        reloaded = importlib.reload(module)
        assert reloaded.fast is not old_fast
        assert module.registry.get_backend("demo.reload", "fast").target is reloaded.fast
        assert module.registry.overrides() == ()
    finally:
        sys.modules.pop("reloadable_kernels", None)
        sys.modules.pop("reload_registry", None)


# --- warm lookups ----------------------------------------------------------------------------


def _first(x: Any) -> Any:
    return ("first", x)


def _second(x: Any) -> Any:
    return ("second", x)


@pytest.fixture
def process_registry() -> Any:
    """The process-wide registry, deciding for cuda:9.0, restored after the test."""
    with kernreg.default_registry().scoped() as reg:
        reg.configure(kernreg.config.Config(), platform=kernreg.Platform.parse("cuda:9.0"))
        yield reg


@pytest.mark.parametrize("through", ["function", "method"])
def test_warm_get_kernel_follows_every_mutation(process_registry: Any, through: str) -> None:
    reg = process_registry
    get = kernreg.get_kernel if through == "function" else reg.get_kernel
    select = kernreg.select_kernel if through == "function" else reg.select
    reg.register(KernelSpec("warm.op", "torch", _first, reference=True))
    for _ in range(3):  # cold, then warm
        assert get("warm.op") is _first
        assert get("warm.op", "torch") is _first
        assert select("warm.op").target is _first
    reg.register(KernelSpec("warm.op", "fast", _second, priority=5))
    assert get("warm.op") is _second
    assert get("warm.op", "torch") is _first
    assert get("warm.op", "fast") is _second
    kw = {"backend": "fast"} if through == "method" else {}
    assert (select("warm.op", **kw) if kw else select("warm.op", "fast")).target is _second
    reg.unregister("warm.op", "fast")
    assert get("warm.op") is _first
    with pytest.raises(kernreg.BackendNotFoundError):
        get("warm.op", "fast")
    reg.register(KernelSpec("warm.op", "gpu", _second, requires=["cuda"], priority=5))
    assert get("warm.op") is _second
    reg.configure(kernreg.config.Config(), platform=kernreg.Platform.parse("cpu"))
    assert get("warm.op") is _first
    with pytest.raises(kernreg.NoEligibleKernelError):
        get("warm.op", "gpu")


def test_warm_lookups_honour_use_backend(process_registry: Any) -> None:
    reg = process_registry
    reg.register(KernelSpec("warm.pin", "torch", _first, reference=True))
    reg.register(KernelSpec("warm.pin", "fast", _second, priority=5))
    assert kernreg.get_kernel("warm.pin") is _second
    assert reg.get_kernel("warm.pin") is _second
    assert kernreg.select_kernel("warm.pin").backend == "fast"
    with kernreg.use_backend("warm.*", "torch"):
        assert kernreg.get_kernel("warm.pin") is _first
        assert reg.get_kernel("warm.pin") is _first
        assert kernreg.select_kernel("warm.pin").backend == "torch"
        assert reg.select("warm.pin").backend == "torch"
    assert kernreg.get_kernel("warm.pin") is _second
    assert kernreg.select_kernel("warm.pin").backend == "fast"


def test_warm_lookups_still_check_their_arguments(process_registry: Any) -> None:
    reg = process_registry
    reg.register(KernelSpec("warm.args", "torch", _first, reference=True))
    for _ in range(2):  # the first call may load plugins, which is a mutation
        assert kernreg.get_kernel("warm.args", "torch") is _first
        assert kernreg.select_kernel("warm.args", "torch").target is _first
        assert reg.get_kernel("warm.args", "torch") is _first
    # An op id spelled as the (op, backend) pair a warm entry is kept under is still invalid.
    for bad_op in (("warm.args", "torch"), ("warm.args", "torch", object())):
        with pytest.raises(InvalidSpecError):
            kernreg.get_kernel(bad_op)  # type: ignore[arg-type]
        with pytest.raises(InvalidSpecError):
            reg.get_kernel(bad_op)  # type: ignore[arg-type]
        with pytest.raises(InvalidSpecError):
            kernreg.select_kernel(bad_op)  # type: ignore[arg-type]
    with pytest.raises(InvalidSpecError):
        kernreg.get_kernel("warm.args", ["torch"])  # type: ignore[arg-type]
    for unhashable in (["warm.args"], {"warm.args": 1}):  # a TypeError in the warm lookup
        with pytest.raises(InvalidSpecError):
            kernreg.get_kernel(unhashable)  # type: ignore[arg-type]
        with pytest.raises(InvalidSpecError):
            kernreg.get_kernel(unhashable, "torch")  # type: ignore[arg-type]
        with pytest.raises(InvalidSpecError):
            kernreg.select_kernel(unhashable, "torch")  # type: ignore[arg-type]
    # A backend (or op) kept warm is never taken for an op (or backend) of the same name.
    with pytest.raises(InvalidSpecError):
        kernreg.get_kernel("torch", "warm.args")
    with pytest.raises(OpNotFoundError):
        kernreg.get_kernel("warm.missing")
    with pytest.raises(TypeError, match="unexpected keyword argument 'nope'"):
        kernreg.get_kernel("warm.args", nope=1)  # type: ignore[call-arg]
    # Other arguments take the full path, and are honoured.
    assert kernreg.get_kernel("warm.args", dtypes=["bf16"]) is _first
    other = KernelRegistry(config=kernreg.config.Config(), platform=kernreg.Platform.parse("cpu"))
    other.register(KernelSpec("warm.args", "torch", _second, reference=True))
    assert kernreg.get_kernel("warm.args", registry=other) is _second
    assert kernreg.select_kernel("warm.args", registry=other).target is _second


def test_warm_lookups_of_an_explicit_registry_follow_its_mutations() -> None:
    reg = KernelRegistry(
        config=kernreg.config.Config(), platform=kernreg.Platform.parse("cuda:9.0")
    )
    reg.register(KernelSpec("warm.own", "torch", _first, reference=True))
    for _ in range(2):
        assert kernreg.get_kernel("warm.own", registry=reg) is _first
        assert kernreg.get_kernel("warm.own", "torch", registry=reg) is _first
        assert kernreg.select_kernel("warm.own", registry=reg).target is _first
    reg.register(KernelSpec("warm.own", "fast", _second, priority=3))
    assert kernreg.get_kernel("warm.own", registry=reg) is _second
    assert kernreg.select_kernel("warm.own", registry=reg).target is _second
    assert kernreg.get_kernel("warm.own", "torch", registry=reg) is _first
    with pytest.raises(OpNotFoundError):
        kernreg.get_kernel("warm.own", registry=None)  # the process-wide registry


def test_a_malformed_op_id_names_the_registered_op_it_probably_meant() -> None:
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    registry.register(KernelSpec("layernorm.rmsnorm", "torch", "m:f", reference=True))
    with pytest.raises(InvalidSpecError, match=r"did you mean 'layernorm\.rmsnorm'\?$"):
        registry.select("rmsnorm")
    with pytest.raises(InvalidSpecError) as caught:
        registry.get("Not An Id")
    assert "did you mean" not in str(caught.value)


# --- use_backend patterns that pin nothing ---------------------------------------------------


def _impl(x: Any) -> Any:
    return x


def test_use_backend_on_a_misspelt_op_warns_naming_the_op_meant(registry: KernelRegistry) -> None:
    registry.register(KernelSpec("pinned.rmsnorm", "torch", _impl, reference=True))
    with (
        pytest.warns(
            ConfigWarning, match=r"use_backend\('pinned.rmsnrom', 'torch'\) pinned nothing"
        ) as caught,
        kernreg.use_backend("pinned.rmsnrom", "torch"),
    ):
        pass
    assert "did you mean 'pinned.rmsnorm'?" in str(caught[0].message)
    assert caught[0].filename == __file__  # the user's `with` line, not kernreg's


def test_use_backend_says_nothing_of_an_op_registered_inside_the_block(
    registry: KernelRegistry,
) -> None:
    with kernreg.use_backend("late.registered", "torch"):
        registry.register(KernelSpec("late.registered", "torch", _impl, reference=True))


def test_use_backend_ending_with_an_error_keeps_that_error() -> None:
    with pytest.raises(KeyError), kernreg.use_backend("never.registered", "torch"):
        raise KeyError("the block's own error")


def test_use_backend_on_a_glob_matching_nothing_warns() -> None:
    with (
        pytest.warns(ConfigWarning, match="matches no registered op$"),
        kernreg.use_backend("nowhere.*", "torch"),
    ):
        pass


@pytest.mark.parametrize("pattern", ["privately.pinned", "privately.*", "privately.pin?ed"])
def test_use_backend_on_an_op_of_any_registry_says_nothing(
    registry: KernelRegistry, pattern: str
) -> None:
    # Only this test's own registry has the op: use_backend applies to every registry.
    registry.register(KernelSpec("privately.pinned", "torch", _impl, reference=True))
    with kernreg.use_backend(pattern, "torch"):
        assert kernreg.get_kernel("privately.pinned", registry=registry) is _impl


# --- bad registry calls: each fails with its error and changes nothing --------------------


def _spec(backend: str, target: str = BAD_INPUT_TARGET, **kw: Any) -> KernelSpec:
    return KernelSpec(BAD_INPUT_OP, backend, target, **kw)


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
        lambda r: r.unregister(BAD_INPUT_OP, "cuda"),
        BackendNotFoundError,
        KeyError,
        ("'cuda'", "'hard.norm'"),
    ),
    (
        "unregister-missing-variant",
        lambda r: r.unregister(BAD_INPUT_OP, "triton", "v9"),
        BackendNotFoundError,
        KeyError,
        ("'triton/v9'",),
    ),
    (
        "unregister-bad-backend",
        lambda r: r.unregister(BAD_INPUT_OP, "Triton"),
        InvalidSpecError,
        ValueError,
        ("'Triton'",),
    ),
    (
        "unregister-backend-list",
        lambda r: r.unregister(BAD_INPUT_OP, ["triton"]),
        InvalidSpecError,
        ValueError,
        ("['triton']",),
    ),
    (
        "unregister-variant-none",
        lambda r: r.unregister(BAD_INPUT_OP, "triton", None),
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
    (
        "get-backend-list",
        lambda r: r.get_backend(BAD_INPUT_OP, [1]),
        InvalidSpecError,
        ValueError,
        ("[1]",),
    ),
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
        lambda r: r.explain(BAD_INPUT_OP, backend="cuda"),
        BackendNotFoundError,
        KeyError,
        ("'cuda'",),
    ),
    (
        "explain-backend-bad",
        lambda r: r.explain(BAD_INPUT_OP, backend="Cuda"),
        InvalidSpecError,
        ValueError,
        ("'Cuda'",),
    ),
    (
        "explain-backend-list",
        lambda r: r.explain(BAD_INPUT_OP, backend=["triton"]),
        InvalidSpecError,
        ValueError,
        ("['triton']",),
    ),
    (
        "explain-variant-list",
        lambda r: r.explain(BAD_INPUT_OP, variant=["v"]),
        InvalidSpecError,
        ValueError,
        ("['v']",),
    ),
    (
        "explain-variant-bad",
        lambda r: r.explain(BAD_INPUT_OP, backend="triton", variant="V"),
        InvalidSpecError,
        ValueError,
        ("'V'",),
    ),
    (
        "explain-dtype-unknown",
        lambda r: r.explain(BAD_INPUT_OP, dtypes=["bfloat17"]),
        InvalidSpecError,
        ValueError,
        ("'bfloat17'",),
    ),
    (
        "explain-dtype-int",
        lambda r: r.explain(BAD_INPUT_OP, dtypes=[16]),
        InvalidSpecError,
        ValueError,
        ("16",),
    ),
    (
        "explain-dtypes-int",
        lambda r: r.explain(BAD_INPUT_OP, dtypes=16),
        InvalidSpecError,
        ValueError,
        ("16",),
    ),
    (
        "explain-dtype-nested",
        lambda r: r.explain(BAD_INPUT_OP, dtypes=[["bf16"]]),
        InvalidSpecError,
        ValueError,
        ("['bf16']",),
    ),
    (
        "explain-trait-bad",
        lambda r: r.explain(BAD_INPUT_OP, traits=["Fast"]),
        InvalidSpecError,
        ValueError,
        ("'Fast'",),
    ),
    (
        "explain-trait-nested",
        lambda r: r.explain(BAD_INPUT_OP, traits=[["x"]]),
        InvalidSpecError,
        ValueError,
        ("['x']",),
    ),
    (
        "explain-platform-bad",
        lambda r: r.explain(BAD_INPUT_OP, platform="cuda:"),
        InvalidSpecError,
        ValueError,
        ("'cuda:'",),
    ),
    (
        "explain-platform-int",
        lambda r: r.explain(BAD_INPUT_OP, platform=9),
        InvalidSpecError,
        ValueError,
        ("9",),
    ),
    (
        "select-platform-typo",
        lambda r: kernreg.select_kernel(BAD_INPUT_OP, platform="cuda:90", registry=r),
        InvalidSpecError,
        ValueError,
        ("'cuda:90'",),
    ),
    (
        "select-platform-hip",
        lambda r: kernreg.select_kernel(BAD_INPUT_OP, platform="hip:942", registry=r),
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
        lambda r: r.select(BAD_INPUT_OP, traits=["inplace"]),
        NoEligibleKernelError,
        LookupError,
        ("'hard.norm'", "inplace"),
    ),
    (
        "get-kernel-backend-list",
        lambda r: r.get_kernel(BAD_INPUT_OP, backend=["triton"]),
        InvalidSpecError,
        ValueError,
        ("['triton']",),
    ),
    (
        "get-kernel-dtypes-nested",
        lambda r: r.get_kernel(BAD_INPUT_OP, dtypes=[["bf16"]]),
        InvalidSpecError,
        ValueError,
        ("['bf16']",),
    ),
    (
        "get-kernel-dtypes-int",
        lambda r: r.get_kernel(BAD_INPUT_OP, dtypes=3),
        InvalidSpecError,
        ValueError,
        ("3",),
    ),
    (
        "get-kernel-traits-nested",
        lambda r: r.get_kernel(BAD_INPUT_OP, traits=[["x"]]),
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
        lambda r: kernreg.op(BAD_INPUT_OP, backend="aten", registry=r)(lambda x: x),
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
        lambda: populated.unregister(BAD_INPUT_OP, "triton"),
        lambda: kernreg.op("hard.new", registry=populated)(lambda x: x),
        lambda: populated.restore((BAD_INPUT_OP, "triton", ""), None),
    ]
    for mutate in mutations:
        assert_fails_cleanly(populated, mutate, RegistryFrozenError, RuntimeError, "frozen")
    # Registering an equal spec stays a no-op, also when frozen (module reloads).
    before = registry_state(populated)
    populated.register(populated.get_backend(BAD_INPUT_OP, "triton"))
    assert registry_state(populated) == before


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
    populated.select(BAD_INPUT_OP)  # deciding imports nothing
    named = ("'hard.norm'", "'cuda'", repr(target), cause)
    if cause == "SystemExit":
        # An import that calls sys.exit is a BaseException: kernreg does not turn it into
        # an ImportError (see RELIABILITY.md, known limits), but it must not half-change anything.
        before = registry_state(populated)
        with pytest.raises(SystemExit):
            populated.get_kernel(BAD_INPUT_OP)
        assert registry_state(populated) == before
        return
    assert_fails_cleanly(
        populated, lambda: populated.get_kernel(BAD_INPUT_OP), KernelLoadError, ImportError, *named
    )
    # The op object raises the same error at the call, and keeps raising it (never a stale target).
    with pytest.raises(KernelLoadError, match=repr(target).replace(".", r"\.")):
        populated.get_kernel(BAD_INPUT_OP)


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

    gated.register("fast", BAD_INPUT_TARGET, when=when, priority=5)
    before = registry_state(registry)
    for _ in range(2):  # the second call must not find a half-built chooser cached
        with pytest.raises(KernelLoadError) as info:
            gated(1)
        assert cause in str(info.value)
        assert "'hard.gated'" in str(info.value)
        assert "'fast'" in str(info.value)
    assert registry_state(registry) == before


# --- the registry follows a plain model through any sequence of registrations, ------------
# replacements, removals, scoped blocks (some ending in an exception) and freezes


MACHINE_EXAMPLES = 60
MACHINE_STEPS = 40


def _named_impl(name: str) -> Callable[..., Any]:
    def impl(*args: Any) -> str:
        return name

    impl.__name__ = impl.__qualname__ = name
    return impl


IMPLS = [_named_impl(f"impl{i}") for i in range(4)]
OPS = ("fz.a", "fz.b")
BACKENDS = ("torch", "fast", "faster")
VARIANTS = ("", "v2")
PLATFORMS = [Platform.parse(p) for p in ("cuda:9.0", "cuda:7.0", "cpu")]
specs = st.builds(
    lambda op, backend, variant, impl, requires, priority, reference: KernelSpec(
        op,
        backend,
        impl,
        variant=variant,
        requires=requires,
        priority=priority,
        reference=reference,
    ),
    st.sampled_from(OPS),
    st.sampled_from(BACKENDS),
    st.sampled_from(VARIANTS),
    st.sampled_from(IMPLS),
    st.sampled_from([(), ("cuda>=8.0",), ("cpu",), ("cuda>=8.0", "cpu")]),
    st.integers(0, 2),
    st.booleans(),
)


keys = st.tuples(st.sampled_from(OPS), st.sampled_from(BACKENDS), st.sampled_from(VARIANTS))


class Model:
    """What the registry should hold: spec per key, and the overrides in order."""

    def __init__(self) -> None:
        self.specs: dict[tuple[str, str, str], KernelSpec] = {}
        self.overrides: list[tuple[str, KernelSpec, KernelSpec | None]] = []
        self.frozen = False

    def copy(self) -> Model:
        other = Model()
        other.specs = dict(self.specs)
        other.overrides = list(self.overrides)
        other.frozen = self.frozen
        return other

    def reference(self, op: str) -> KernelSpec | None:
        found = [s for s in self.specs.values() if s.op == op and s.reference]
        assert len(found) <= 1
        return found[0] if found else None

    def register(self, spec: KernelSpec, replace: bool) -> type[Exception] | None:
        """Apply ``register``; return the error it must raise (and then change nothing)."""
        old = self.specs.get(spec.key)
        if old is not None and old == spec:
            return None
        if self.frozen:
            return RegistryFrozenError
        if old is not None and not replace:
            return KernelConflictError
        ref = self.reference(spec.op)
        if spec.reference and ref is not None and ref.key != spec.key:
            return DuplicateReferenceError
        self.specs[spec.key] = spec
        if old is not None:
            self.overrides.append(("replace", old, spec))
        return None

    def unregister(self, key: tuple[str, str, str]) -> type[Exception] | None:
        if self.frozen:
            return RegistryFrozenError
        if key not in self.specs:
            return OpNotFoundError if not any(k[0] == key[0] for k in self.specs) else KeyError
        self.overrides.append(("unregister", self.specs.pop(key), None))
        return None


class _BoomError(Exception):
    pass


def _decisions(registry: KernelRegistry) -> dict[Any, Any]:
    out = {}
    for op in registry.ops():
        for platform in PLATFORMS:
            d = registry.explain(op, platform=platform)
            out[op, platform] = (
                d.rule,
                None if d.chosen is None else d.chosen.key,
                tuple((c.spec.key, c.status, c.reasons) for c in d.candidates),
                tuple(c.spec.key for c in d.tied),
            )
    return out


class RegistryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.registry = KernelRegistry(config=Config(), platform=PLATFORMS[0])
        self.model = Model()

    def _apply(self, action: Callable[[], object], expected: type[Exception] | None) -> None:
        if expected is None:
            action()
        else:
            with pytest.raises(expected):
                action()

    def _register(self, spec: KernelSpec, replace: bool) -> None:
        expected = self.model.register(spec, replace)
        self._apply(lambda: self.registry.register(spec, replace=replace), expected)

    def _unregister(self, key: tuple[str, str, str]) -> None:
        expected = self.model.unregister(key)
        self._apply(lambda: self.registry.unregister(*key), expected)

    @rule(spec=specs)
    def register(self, spec: KernelSpec) -> None:
        self._register(spec, replace=False)

    @rule(spec=specs)
    def register_replace(self, spec: KernelSpec) -> None:
        self._register(spec, replace=True)

    @rule(key=keys)
    def unregister(self, key: tuple[str, str, str]) -> None:
        self._unregister(key)

    @rule(data=st.data())
    def register_existing_again(self, data: st.DataObject) -> None:
        """Registering an equal spec is a no-op, even frozen (module reloads)."""
        if self.model.specs:
            spec = data.draw(
                st.sampled_from(sorted(self.model.specs.values(), key=lambda s: s.key))
            )
            self._register(KernelSpec(**{f: getattr(spec, f) for f in KernelSpec._compare}), False)

    @rule(
        steps=st.lists(st.tuples(st.sampled_from(["reg", "replace", "unreg"]), specs), max_size=6),
        fail=st.booleans(),
    )
    def scoped_block(self, steps: list[tuple[str, KernelSpec]], fail: bool) -> None:
        saved = self.model.copy()
        try:
            with self.registry.scoped():
                self.model.frozen = False  # a scoped block accepts changes on a frozen registry
                for kind, spec in steps:
                    if kind == "unreg":
                        self._unregister(spec.key)
                    else:
                        self._register(spec, replace=kind == "replace")
                    self.check_equal()
                if fail:
                    raise _BoomError
        except _BoomError:
            pass
        self.model = saved

    @precondition(lambda self: not self.model.frozen)
    @rule()
    def freeze(self) -> None:
        self.registry.freeze()
        self.model.frozen = True

    @invariant()
    def check_equal(self) -> None:
        reg, model = self.registry, self.model
        held = {spec.key: spec for spec in reg.all_specs()}
        assert held == model.specs
        assert len(reg) == len(model.specs)
        assert reg.frozen == model.frozen
        assert list(reg.ops()) == sorted({k[0] for k in model.specs})
        for op in reg.ops():
            assert reg.reference(op) == model.reference(op)
            assert list(reg.get(op)) == sorted(
                (s for s in model.specs.values() if s.op == op), key=KernelSpec.sort_key
            )
        assert [(o.kind, o.old, o.new) for o in reg.overrides()] == model.overrides

    @invariant()
    def decisions_match_a_fresh_registry(self) -> None:
        fresh = KernelRegistry(config=Config(), platform=PLATFORMS[0])
        for spec in sorted(self.model.specs.values(), key=lambda s: s.key, reverse=True):
            fresh.register(spec)
        assert _decisions(self.registry) == _decisions(fresh)


TestRegistryMachine = RegistryMachine.TestCase


TestRegistryMachine.settings = settings(
    max_examples=MACHINE_EXAMPLES,
    stateful_step_count=MACHINE_STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_the_model_checks_run_in_a_clean_environment() -> None:
    # Only the cache folder is set (tests/conftest.py): it steers no decision.
    assert [v for v in os.environ if v.startswith("KERNREG_")] == ["KERNREG_CACHE_DIR"]


def test_a_variant_without_a_backend_is_an_error_not_ignored() -> None:
    registry = KernelRegistry(platform=Platform.parse("cpu"))
    registry.register(KernelSpec("a.op", "torch", "m:ref", reference=True))
    registry.register(KernelSpec("a.op", "triton", "m:v2", variant="v2"))
    for ask in (registry.select, registry.get_kernel, registry.explain):
        with pytest.raises(InvalidSpecError, match=r"variant 'v2'.*backend="):
            ask("a.op", variant="v2")  # type: ignore[operator]

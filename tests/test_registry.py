"""KernelRegistry: conflicts, overrides, lookups, references, freezing, scoping, ordering."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import pytest

import kernreg
from kernreg import (
    BackendNotFoundError,
    Config,
    ConfigWarning,
    DuplicateReferenceError,
    InvalidSpecError,
    KernelConflictError,
    KernelRegistry,
    KernelSpec,
    OpNotFoundError,
    Origin,
    Platform,
    RegistryFrozenError,
)

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
    from kernreg import Config, Platform

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


def test_process_wide_registry_and_register_kernel() -> None:
    assert kernreg.default_registry() is kernreg.registry
    with kernreg.registry.scoped():
        stored = kernreg.register_kernel(spec(op="kr_test.process_wide"))
        assert kernreg.registry.get("kr_test.process_wide") == (stored,)
        with pytest.raises(KernelConflictError):
            kernreg.register_kernel(spec(target="pkg_b.k:rms", op="kr_test.process_wide"))
        kernreg.register_kernel(spec(target="pkg_b.k:rms", op="kr_test.process_wide"), replace=True)
    assert not kernreg.registry.has("kr_test.process_wide")


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

registry = kernreg.KernelRegistry(config=kernreg.Config(), platform=kernreg.Platform("cpu"))
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
        (tmp_path / "reloadable_kernels.py").write_text(
            RELOADABLE.replace("VERSION = 1", "VERSION = 2")
        )
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
    with kernreg.registry.scoped() as reg:
        reg.configure(kernreg.Config(), platform=kernreg.Platform.parse("cuda:9.0"))
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
    reg.configure(kernreg.Config(), platform=kernreg.Platform.parse("cpu"))
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
    other = KernelRegistry(config=kernreg.Config(), platform=kernreg.Platform.parse("cpu"))
    other.register(KernelSpec("warm.args", "torch", _second, reference=True))
    assert kernreg.get_kernel("warm.args", registry=other) is _second
    assert kernreg.select_kernel("warm.args", registry=other).target is _second


def test_warm_lookups_of_an_explicit_registry_follow_its_mutations() -> None:
    reg = KernelRegistry(config=kernreg.Config(), platform=kernreg.Platform.parse("cuda:9.0"))
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

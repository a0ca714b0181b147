"""Properties: registration order never changes the inventory, the decisions or the conflicts."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernreg import KernelConflictError, KernelRegistry, KernelSpec, Platform, Requirement
from kernreg.config import Config
from kernreg.errors import InvalidSpecError
from kernreg.registry import find_ambiguities

OPS = ("layernorm.rmsnorm", "activation.silu_and_mul", "attention.rope")
BACKENDS = ("torch", "triton", "cuda", "jit")
VARIANTS = ("", "v2")
TARGETS = ("pkg_a.k:impl", "pkg_b.k:impl")
REQUIREMENTS = (
    "cuda",
    "cuda>=8.0",
    "cuda>=8.0,<=8.9",
    "cuda==9.0",
    "cuda:sm_90a",
    "hip:gfx942|gfx950",
    "cpu",
)
DTYPES = ("bf16", "fp16", "fp32")
PACKAGES = ("pytest>=1", "pytest>=999", "kr-surely-not-installed")
PLATFORMS = tuple(
    Platform.parse(p) for p in ("cuda:9.0", "cuda:8.6", "cuda:sm_90a", "hip:gfx942", "cpu")
)
CALL_DTYPES: tuple[tuple[str, ...] | None, ...] = (None, ("bfloat16",), ("float32",))


def small(n: int) -> bool:
    return n < 10


def large(n: int) -> bool:
    return n > 100


@st.composite
def specs(draw: st.DrawFn) -> KernelSpec:
    backend = draw(st.sampled_from(BACKENDS))
    variant = draw(st.sampled_from(VARIANTS))
    return KernelSpec(
        draw(st.sampled_from(OPS)),
        backend,
        draw(st.sampled_from(TARGETS)),
        variant=variant,
        requires=draw(st.sets(st.sampled_from(REQUIREMENTS), max_size=2)),
        dtypes=draw(st.sets(st.sampled_from(DTYPES), max_size=2)),
        packages=draw(st.sets(st.sampled_from(PACKAGES), max_size=1)),
        traits=draw(st.sets(st.sampled_from(("deterministic", "inplace")), max_size=1)),
        when=draw(st.sampled_from((None, None, None, small, large))),
        priority=draw(st.integers(0, 2)),
        # At most one key per op can hold the reference: (op, "torch", "").
        reference=draw(st.booleans()) if (backend, variant) == ("torch", "") else False,
    )


def register_all(
    order: list[KernelSpec],
) -> tuple[KernelRegistry, set[tuple[str, tuple[str, str, str]]]]:
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cuda:9.0"))
    conflicts = set()
    for spec in order:
        try:
            registry.register(spec)
        except KernelConflictError as exc:  # any other error fails the test
            conflicts.add((type(exc).__name__, exc.new.key))
    return registry, conflicts


def expected_conflicts(inventory: list[KernelSpec]) -> set[tuple[str, tuple[str, str, str]]]:
    by_key: dict[tuple[str, str, str], set[KernelSpec]] = defaultdict(set)
    for spec in inventory:
        by_key[spec.key].add(spec)
    return {("KernelConflictError", key) for key, group in by_key.items() if len(group) > 1}


def without_origin(described: Any) -> Any:
    if isinstance(described, dict):
        return {k: without_origin(v) for k, v in described.items() if k != "origin"}
    if isinstance(described, list):
        return [without_origin(v) for v in described]
    return described


def observe(registry: KernelRegistry) -> list[Any]:
    """Everything order could influence: the inventory, every decision and every ambiguity."""
    seen: list[Any] = [without_origin([s.describe() for s in registry.all_specs()])]
    for op in registry.ops():
        for platform in PLATFORMS:
            for dtypes in CALL_DTYPES:
                decision = registry.explain(op, platform=platform, dtypes=dtypes)
                seen.append(str(decision))
                seen.append(without_origin(decision.describe()))
        seen.append(str(registry.explain(op, traits=["deterministic"], call=((50,), {}))))
    seen.append([(a.op, a.first.key, a.second.key, a.reason) for a in find_ambiguities(registry)])
    return seen


@settings(max_examples=60, deadline=None)
@given(inventory=st.lists(specs(), max_size=8), data=st.data())
def test_registration_order_is_irrelevant(inventory: list[KernelSpec], data: st.DataObject) -> None:
    registry, conflicts = register_all(inventory)
    assert conflicts == expected_conflicts(inventory)
    baseline = observe(registry) if not conflicts else None
    for _ in range(3):
        order = data.draw(st.permutations(inventory))
        other, other_conflicts = register_all(order)
        assert other_conflicts == conflicts
        if baseline is not None:
            assert observe(other) == baseline


@settings(max_examples=60, deadline=None)
@given(inventory=st.lists(specs(), max_size=8, unique_by=lambda s: s.key), data=st.data())
def test_unregistering_restores_the_same_decisions(
    inventory: list[KernelSpec], data: st.DataObject
) -> None:
    """Adding specs and removing them again leaves decisions as if they never existed."""
    keep = data.draw(st.sets(st.sampled_from(range(len(inventory))))) if inventory else set()
    kept = [s for i, s in enumerate(inventory) if i in keep]
    registry, _ = register_all(inventory)
    for i, spec in enumerate(inventory):
        if i not in keep:
            registry.unregister(*spec.key)
    fresh, _ = register_all(kept)
    assert observe(registry) == observe(fresh)


ARCHS = st.tuples(st.integers(0, 12), st.integers(0, 9))


@given(device=st.sampled_from(("cuda", "xpu")), low=st.none() | ARCHS, high=st.none() | ARCHS)
def test_requirement_window_round_trips(
    device: str, low: tuple[int, int] | None, high: tuple[int, int] | None
) -> None:
    if low is not None and high is not None and low > high:
        low, high = high, low
    req = Requirement(device, min_arch=low, max_arch=high)
    assert Requirement.parse(str(req)) == req


@given(arch=ARCHS)
def test_a_rocm_gpu_is_never_named_by_a_version(arch: tuple[int, int]) -> None:
    """A ROCm GPU has a gfx name and no version: a window or a numeric arch is refused in
    every form (it would never match a detected GPU)."""
    text = f"{arch[0]}.{arch[1]}"
    for make in (
        lambda: Requirement("hip", min_arch=arch),
        lambda: Requirement.parse(f"hip>={text}"),
        lambda: Platform("hip", arch=arch),
        lambda: Platform.parse(f"hip:{text}"),
    ):
        with pytest.raises(InvalidSpecError):
            make()


@given(names=st.sets(st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True), min_size=1, max_size=3))
def test_requirement_names_round_trip(names: set[str]) -> None:
    req = Requirement("hip", archs=names)
    assert Requirement.parse(str(req)) == req


@given(arch=ARCHS, device=st.sampled_from(("cuda", "xpu", "npu")))
def test_platform_round_trips(arch: tuple[int, int], device: str) -> None:
    platform = Platform(device, arch=arch)
    assert Platform.parse(str(platform)) == platform


@given(arch=ARCHS, low=ARCHS, high=ARCHS)
def test_window_matches_like_tuple_comparison(
    arch: tuple[int, int], low: tuple[int, int], high: tuple[int, int]
) -> None:
    if low > high:
        low, high = high, low
    reason = Requirement("cuda", min_arch=low, max_arch=high).matches(Platform("cuda", arch=arch))
    assert (reason is None) == (low <= arch <= high)

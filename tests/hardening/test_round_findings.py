"""Regressions for defects in spec storage, registration and use_backend found by probing."""

from __future__ import annotations

import warnings

import kernreg
from kernreg import KernelSpec
from kernreg.spec import Origin


def _double(x: int) -> int:
    return 2 * x


def _triple(x: int) -> int:
    return 3 * x


class _TaggedSpec(KernelSpec):
    __slots__ = ("tag",)
    tag: str

    def __init__(self, *args: object, tag: str = "", **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._set("tag", tag)


def test_with_origin_keeps_a_subclass_and_its_fields() -> None:
    spec = _TaggedSpec("round.tagged", "torch", _double, tag="fast")
    moved = spec.with_origin(Origin("elsewhere.py", 3))
    assert type(moved) is _TaggedSpec
    assert moved.tag == "fast"
    assert moved == spec
    assert moved.origin == Origin("elsewhere.py", 3)


def test_use_backend_around_a_scoped_registry_that_it_pinned_does_not_warn() -> None:
    registry = kernreg.registry
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with kernreg.use_backend("round.scopedpin", "slow"), registry.scoped():
            registry.register(KernelSpec("round.scopedpin", "fast", _double, priority=1))
            registry.register(KernelSpec("round.scopedpin", "slow", _triple))
            assert kernreg.get_kernel("round.scopedpin")(1) == 3
    assert "round.scopedpin" not in registry.ops()


def test_use_backend_that_matched_nothing_still_warns_after_a_used_block() -> None:
    registry = kernreg.registry
    with registry.scoped():
        registry.register(KernelSpec("round.usedonce", "slow", _triple))
        with kernreg.use_backend("round.usedonce", "slow"):
            kernreg.get_kernel("round.usedonce")
    # A later block of another pattern is not taken for the used one.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with kernreg.use_backend("round.neverregistered", "slow"):
            pass
    assert any("pinned nothing" in str(w.message) for w in caught)


class _AtLeast:
    """A ``when`` predicate comparing by value, as a dataclass would."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, x: int) -> bool:
        return x >= self.n

    def __eq__(self, other: object) -> bool:
        return type(other) is _AtLeast and other.n == self.n

    def __hash__(self) -> int:
        return hash(self.n)


def test_a_spec_keeps_its_own_when_predicate_when_an_equal_one_was_seen() -> None:
    first, second = _AtLeast(5), _AtLeast(5)
    a = KernelSpec("round.when", "torch", _double, when=first)
    b = KernelSpec("round.when", "torch", _double, when=second)
    c = a.replace(when=second)
    assert a.when is first
    assert b.when is second
    assert c.when is second
    assert a == b
    second.n = 100  # the user's own predicate object: a change reaches its spec only
    assert b.when(50) is False
    assert a.when(50) is True


def test_use_backend_loads_no_plugin_to_vet_a_pattern_a_registry_has() -> None:
    from kernreg.inventory import Inventory

    class Recording(Inventory):
        loads = 0

        def _ensure_plugins(self) -> None:
            Recording.loads += 1

    inventory = Recording()
    inventory.register(KernelSpec("round.haveit", "torch", _double))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with kernreg.use_backend("round.haveit", "torch"):
            pass  # nothing decided: the pattern is vetted against the registries
    assert Recording.loads == 0

"""Specs as values (fields read-only, compared, hashed, pickled, subclassed) and the
inventory that holds them; and that the shortcuts taken on the way (validated fields
remembered, target modules remembered, the last call site remembered) accept and refuse
exactly what the full checks do."""

from __future__ import annotations

import copy
import pickle
import re
import threading
from typing import Any

import pytest

from kernreg import (
    InvalidSpecError,
    KernelConflictError,
    KernelRegistry,
    KernelSpec,
    Platform,
    Requirement,
)
from kernreg.config import Config
from kernreg.spec import Origin

TARGET_RE = re.compile(r"[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")

#: The public fields of a spec, in order (``origin`` is neither shown nor compared).
FIELDS = (
    "op",
    "backend",
    "target",
    "variant",
    "requires",
    "dtypes",
    "when",
    "packages",
    "traits",
    "priority",
    "reference",
    "description",
    "origin",
)


def _line_of(marker: str) -> int:
    with open(__file__, encoding="utf-8") as handle:
        return next(
            i for i, line in enumerate(handle, 1) if marker in line and "_line_of" not in line
        )


def test_public_fields_read_and_refuse_assignment() -> None:
    spec = KernelSpec("ro.op", "triton", "m:f", variant="v", dtypes=("float16",), priority=2)
    assert (spec.op, spec.backend, spec.target, spec.variant) == ("ro.op", "triton", "m:f", "v")
    assert spec.dtypes == frozenset({"float16"})
    assert spec.priority == 2
    assert spec.key == ("ro.op", "triton", "v")
    assert spec.label == "triton/v"
    for name in FIELDS:
        with pytest.raises(AttributeError, match=f"cannot assign to field '{name}'"):
            setattr(spec, name, None)
        with pytest.raises(AttributeError, match=f"cannot delete field '{name}'"):
            delattr(spec, name)
    with pytest.raises(AttributeError):
        spec.other = 1  # type: ignore[attr-defined]


def test_repr_lists_the_public_fields_in_order_and_origin_is_not_compared() -> None:
    spec = KernelSpec("t.op", "torch", "m:f")
    assert repr(spec).startswith("KernelSpec(op='t.op', backend=")
    assert re.findall(r"(\w+)=", repr(spec)) == list(FIELDS[:-1])
    moved = spec.with_origin(Origin("elsewhere.py", 9))
    assert moved == spec
    assert hash(moved) == hash(spec)
    assert moved.origin != spec.origin


def test_replace_changes_own_and_shared_fields_and_refuses_others() -> None:
    spec = KernelSpec("r.op", "torch", "m:f", priority=1).with_origin(Origin("f.py", 3))
    changed = spec.replace(priority=5, target="m:g", op="r.other")
    assert (changed.op, changed.target, changed.priority) == ("r.other", "m:g", 5)
    assert changed.origin == spec.origin
    assert spec.priority == 1
    assert spec.replace() == spec
    with pytest.raises(TypeError, match="no fields"):
        spec.replace(colour="red")
    # Not re-validated, as for every frozen value: even an unhashable value is kept.
    assert spec.replace(backend=["odd"]).backend == ["odd"]
    # An unchecked True for priority is never shared with a checked priority of 1.
    odd = spec.replace(priority=True)
    assert KernelSpec("r.op", "torch", "m:f", priority=1).priority is not True
    assert odd.priority is True


def test_pickle_copy_and_with_origin_keep_every_field() -> None:
    spec = KernelSpec(
        "p.op", "triton", "m:f", requires=("cuda",), traits=("deterministic",), priority=7
    ).with_origin(Origin("here.py", 12, "dist", "1.0"))
    clone = pickle.loads(pickle.dumps(spec))
    assert clone == spec
    assert clone.origin == spec.origin
    assert clone.describe() == spec.describe()
    assert copy.copy(spec) is spec
    assert copy.deepcopy(spec) is spec
    moved = spec.with_origin(Origin("there.py", 1))
    assert moved == spec
    assert moved.origin == Origin("there.py", 1)
    assert hash(moved) == hash(spec)


class TaggedSpec(KernelSpec):
    """A subclass adding a compared field and a hidden one."""

    __slots__ = ("tag", "note")
    _hidden = ("note",)
    tag: str
    note: str

    def __init__(self, *args: Any, tag: str = "", note: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._set("tag", tag)
        self._set("note", note)


def test_subclasses_add_fields_that_compare_pickle_and_refuse_assignment() -> None:
    a = TaggedSpec("sub.op", "torch", "m:f", priority=2, tag="x", note="one")
    # The added fields come after the spec's own; a hidden one is neither shown nor compared.
    assert re.findall(r"(\w+)=", repr(a)) == [*FIELDS[:-1], "tag"]
    assert a == TaggedSpec("sub.op", "torch", "m:f", priority=2, tag="x", note="two")
    assert a != TaggedSpec("sub.op", "torch", "m:f", priority=2, tag="y")
    assert a != KernelSpec("sub.op", "torch", "m:f", priority=2)
    clone = pickle.loads(pickle.dumps(a))
    assert type(clone) is TaggedSpec
    assert clone == a
    assert clone.note == "one"
    assert a.replace(tag="z").tag == "z"
    assert a.replace(priority=4).priority == 4
    for name in ("tag", "note", "op", "priority"):
        with pytest.raises(AttributeError, match=f"cannot assign to field '{name}'"):
            setattr(a, name, "new")
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    stored = registry.register(a)
    assert stored == a
    assert type(stored) is TaggedSpec
    assert stored.note == "one"
    assert stored.origin is not None
    assert registry.get("sub.op") == (a,)


TARGETS = [
    "m:f",
    "pkg.mod:Cls.method",
    "pkg.mod:f",
    "pkg.mod:1f",
    "pkg.mod:f.",
    "pkg.mod:f..g",
    "pkg.mod:f.1",
    "pkg.mod:",
    ":f",
    "pkg..mod:f",
    "pkg.mod:f:g",
    "pkg.mod:f g",
    "pkg.mod:f\n",
    "pkg.mod:é",
    "pkg.mod:aé",
    "pkg.mod:a²",
    "pkg.mod:a·b",
    "pkg.mod:_",
    "pkg.mod:class",
    "pkg.mod:\uff46",  # a fullwidth f
    "pkg.mod:a\u0300",
    "1pkg:f",
    "pkg.mod:a-b",
]


@pytest.mark.parametrize("target", TARGETS)
def test_targets_are_accepted_exactly_as_the_pattern_says(target: str) -> None:
    valid = TARGET_RE.fullmatch(target) is not None
    # Twice: the second time the module part is known valid and only the rest is checked.
    KernelSpec("t.first", "torch", "pkg.mod:first")
    for _ in range(2):
        if valid:
            assert KernelSpec("t.op", "torch", target).target == target
        else:
            with pytest.raises(InvalidSpecError, match=r"expected 'module\.path:attr\.path'"):
                KernelSpec("t.op", "torch", target)


def test_remembered_fields_still_check_types_that_compare_equal() -> None:
    KernelSpec("eq.op", "torch", "m:f", priority=1, reference=True)
    with pytest.raises(InvalidSpecError, match="priority"):
        KernelSpec("eq.op", "torch", "m:f", priority=1.0, reference=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidSpecError, match="reference"):
        KernelSpec("eq.op", "torch", "m:f", priority=1, reference=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidSpecError, match="priority"):
        KernelSpec("eq.op", "torch", "m:f", priority=True)


def test_a_list_of_requirements_changed_after_use_is_read_again() -> None:
    requires: list[Any] = ["cuda"]
    assert KernelSpec("l.op", "triton", "m:f", requires=requires).requires == {
        Requirement.parse("cuda")
    }
    requires.append("rocm")
    assert len(KernelSpec("l.op", "triton", "m:f", requires=requires).requires) == 2
    requires.append(3)
    with pytest.raises(InvalidSpecError, match="invalid requirement 3"):
        KernelSpec("l.op", "triton", "m:f", requires=requires)


def test_the_first_invalid_field_is_named_first() -> None:
    with pytest.raises(InvalidSpecError, match="backend"):
        KernelSpec("o.op", "Bad Backend", "not a target", priority="x")  # type: ignore[arg-type]
    with pytest.raises(InvalidSpecError, match="target"):
        KernelSpec("o.op", "torch", "not a target", priority="x")  # type: ignore[arg-type]


def test_origins_of_a_loop_and_of_distributions_at_one_site() -> None:
    from kernreg.inventory import current_distribution

    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    for i in range(3):
        token = current_distribution.set(("dist", "1.0")) if i == 1 else None
        try:
            registry.register(KernelSpec(f"site.op_{i}", "torch", "m:f"))  # site: loop
        finally:
            if token is not None:
                current_distribution.reset(token)
        registry.register(KernelSpec(f"site.op_{i}", "triton", "m:g"))  # site: second
    origins = [registry.get_backend(f"site.op_{i}", "torch").origin for i in range(3)]
    line = _line_of("# site: loop")
    assert origins == [
        Origin(__file__, line),
        Origin(__file__, line, "dist", "1.0"),
        Origin(__file__, line),
    ]
    assert registry.get_backend("site.op_2", "triton").origin == Origin(
        __file__, _line_of("# site: second")
    )


def test_threads_adding_backends_to_one_op_lose_none() -> None:
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    ops = [f"race.op_{i}" for i in range(200)]
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def add(backend: str) -> None:
        start.wait()
        try:
            for op in ops:
                registry.register(KernelSpec(op, backend, f"m:{backend}"))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=add, args=(f"b{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert all(len(registry.get(op)) == 4 for op in ops)


def test_threads_registering_one_key_never_both_win() -> None:
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    for round_ in range(50):
        op = f"duel.op_{round_}"
        start = threading.Barrier(2)
        outcomes: list[str] = []

        def put(
            target: str,
            op: str = op,
            start: threading.Barrier = start,
            outcomes: list[str] = outcomes,
        ) -> None:
            start.wait()
            try:
                registry.register(KernelSpec(op, "torch", target))
                outcomes.append("won")
            except KernelConflictError:
                outcomes.append("conflict")

        threads = [threading.Thread(target=put, args=(t,)) for t in ("m:a", "m:b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(outcomes) == ["conflict", "won"]
        assert len(registry.get(op)) == 1


def test_unregister_and_reregister_keep_the_reference_rules(registry: KernelRegistry) -> None:
    ref = registry.register(KernelSpec("u.op", "torch", "m:f", reference=True))
    registry.register(KernelSpec("u.op", "triton", "m:g"))
    assert registry.reference("u.op") is ref
    registry.unregister("u.op", "torch")
    assert registry.reference("u.op") is None
    second = registry.register(KernelSpec("u.op", "aot", "m:h", reference=True))
    assert registry.reference("u.op") is second
    assert [s.backend for s in registry.get("u.op")] == ["aot", "triton"]

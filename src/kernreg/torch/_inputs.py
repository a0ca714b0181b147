"""Which inputs the parity harness feeds an op: a side table of input generators.

An op declares its generator next to its reference::

    @kernreg.torch.inputs("layernorm.rmsnorm")
    def rmsnorm_inputs(dtype, device, seed):
        x = torch.randn(7, 96, dtype=dtype, device=device)
        return (x, torch.ones(96, dtype=dtype, device=device)), {"eps": 1e-6}

or, from a plugin's registration function (no torch import there), as a target string:
``register_inputs("layernorm.rmsnorm", "my_pkg.inputs:rmsnorm", mutates=("x",))``.

A generator takes ``(dtype, device, seed)`` (a ``torch.dtype``, a ``torch.device`` and an
int that picks the shape and values) and returns ``(args, kwargs)`` for one call.
``mutates`` names the parameters the op writes in place; the harness compares them after
the call, and checks every other tensor argument is left unchanged.

Benchmarks (:mod:`kernreg.torch.bench`) time an op on a few *named* representative shapes,
which the generator declares with :func:`bench_shapes` (also importable from
:mod:`kernreg.torch.bench`): each shape is a set of keyword arguments the generator
accepts on top of ``(dtype, device, seed)``::

    @kernreg.torch.inputs("layernorm.rmsnorm")
    @bench_shapes(small={"tokens": 16, "hidden": 1024}, large={"tokens": 512, "hidden": 8192})
    def rmsnorm_inputs(dtype, device, seed, *, tokens=7, hidden=96): ...

The table is keyed by op id and shared by every registry: an op id has one signature,
so one generator fits all its implementations wherever they are registered. This module
imports no torch.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from kernreg._frozen import Frozen
from kernreg._names import check_op_id
from kernreg.dtypes import normalize_dtype
from kernreg.errors import InvalidSpecError, KernregError
from kernreg.inventory import current_distribution
from kernreg.plugins import record_undo
from kernreg.spec import resolve_target, target_name

__all__ = [
    "DEFAULT_DTYPES",
    "SHAPES_ATTRIBUTE",
    "InputGeneratorConflictError",
    "InputGeneratorLoadError",
    "InputSpec",
    "bench_shapes",
    "declared_shapes",
    "input_spec",
    "inputs",
    "register_inputs",
    "unregister_inputs",
]

F = TypeVar("F", bound=Callable[..., Any])

#: The dtypes parity runs on unless an op's generator says otherwise.
DEFAULT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")


class InputSpec(Frozen):
    """An op's input generator (a callable or a ``"module:attr"`` target), the parameters
    it mutates in place, the dtypes parity checks by default and the parameters its calls
    dispatch on (``dispatch_args``; empty: the first one, as an op object's default)."""

    __slots__ = ("op", "generator", "mutates", "dtypes", "dispatch_args")
    op: str
    generator: str | Callable[..., Any]
    mutates: tuple[str, ...]
    dtypes: tuple[str, ...]
    dispatch_args: tuple[str, ...]

    def __init__(
        self,
        op: str,
        generator: str | Callable[..., Any],
        *,
        mutates: Iterable[str] = (),
        dtypes: Iterable[str] = DEFAULT_DTYPES,
        dispatch_args: Iterable[str] = (),
    ) -> None:
        check_op_id(op)
        if not (isinstance(generator, str) and ":" in generator) and not callable(generator):
            raise InvalidSpecError("generator", generator, "expected 'module:attr' or a callable")
        if any(isinstance(v, str) for v in (mutates, dtypes, dispatch_args)):
            raise InvalidSpecError(
                "mutates/dtypes/dispatch_args",
                (mutates, dtypes, dispatch_args),
                "expected collections",
            )
        self._set("op", op)
        self._set("generator", generator)
        self._set("mutates", tuple(mutates))
        self._set("dtypes", tuple(normalize_dtype(d, "dtypes") for d in dtypes))
        self._set("dispatch_args", tuple(dispatch_args))

    def load(self) -> Callable[..., Any]:
        """The generator itself (imported now for a target string)."""
        if not isinstance(self.generator, str):
            return self.generator
        try:
            obj = resolve_target(self.generator)
        except Exception as exc:
            raise InputGeneratorLoadError(self, exc) from exc
        return obj  # type: ignore[no-any-return]

    def shapes(self) -> dict[str, dict[str, object]]:
        """The generator's named benchmark shapes (see :func:`bench_shapes`), in declared
        order; empty when it declares none. Imports a target string's generator."""
        return declared_shapes(self.load())

    def describe(self) -> dict[str, object]:
        return {
            "op": self.op,
            "generator": target_name(self.generator),
            "mutates": list(self.mutates),
            "dtypes": list(self.dtypes),
            "dispatch_args": list(self.dispatch_args),
        }


class InputGeneratorLoadError(KernregError, ImportError):
    """The input generator's target could not be imported."""

    def __init__(self, spec: InputSpec, cause: BaseException) -> None:
        self.input_spec = spec
        self.cause = cause
        super().__init__(
            f"Cannot load the input generator of op '{spec.op}': target "
            f"{target_name(spec.generator)!r} failed with {type(cause).__name__}: {cause}",
        )


class InputGeneratorConflictError(KernregError, ValueError):
    """A second, different input generator declared for an op: names both generators and
    the distributions that declared them (``None`` for the host program)."""

    def __init__(
        self,
        old: InputSpec,
        new: InputSpec,
        old_distribution: str | None,
        new_distribution: str | None,
    ) -> None:
        self.old = old
        self.new = new
        self.old_distribution = old_distribution
        self.new_distribution = new_distribution

        def where(dist: str | None) -> str:
            return f" (distribution {dist})" if dist else ""

        super().__init__(
            f"Conflicting input generator for op '{new.op}': "
            f"'{target_name(old.generator)}'{where(old_distribution)} != "
            f"'{target_name(new.generator)}'{where(new_distribution)}; an op has one "
            "generator, declared by the distribution that ships its reference; pass "
            "replace=True to override on purpose"
        )


_lock = threading.Lock()
_table: dict[str, InputSpec] = {}
#: The distribution whose plugin declared each op's generator (``None``: not a plugin).
_owners: dict[str, str | None] = {}


def _reset_lock_in_child() -> None:
    # A child forked while another thread held the lock would wait for it forever.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_lock_in_child)


def register_inputs(
    op: str,
    generator: str | Callable[..., Any],
    *,
    mutates: Iterable[str] = (),
    dtypes: Iterable[str] = DEFAULT_DTYPES,
    dispatch_args: Iterable[str] = (),
    replace: bool = False,
) -> InputSpec:
    """Declare ``op``'s input generator. Registering an equal one again is a no-op; a
    different one raises :class:`InputGeneratorConflictError` (a ``ValueError``) naming
    both and the distributions that declared them, unless ``replace=True``.

    ``dispatch_args``: the parameters the op's calls dispatch on, where the first is not
    the one (an integer ``positions`` before ``q``); what is made from the op id alone
    (:func:`kernreg.torch.as_custom_op`, a saved program's custom op loaded in a fresh
    process, ``kernreg tune``) dispatches and buckets on them, as the op's own op object
    does."""
    spec = InputSpec(op, generator, mutates=mutates, dtypes=dtypes, dispatch_args=dispatch_args)
    loading = current_distribution.get()
    distribution = loading[0] if loading is not None else None
    with _lock:
        old = _table.get(op)
        if old == spec:
            return spec
        if old is not None and not replace:
            raise InputGeneratorConflictError(old, spec, _owners.get(op), distribution)
        previous_owner = _owners.get(op)
        _table[op] = spec
        _owners[op] = distribution
    # A plugin that fails after this call is undone whole, its input generators too.
    record_undo(functools.partial(_restore, op, old, previous_owner, spec))
    return spec


def _restore(op: str, previous: InputSpec | None, owner: str | None, registered: InputSpec) -> None:
    """Put back ``previous`` (declared by ``owner``) as ``op``'s generator, if ``registered``
    is still the one there."""
    with _lock:
        if _table.get(op) != registered:
            return
        if previous is None:
            del _table[op]
            _owners.pop(op, None)
        else:
            _table[op] = previous
            _owners[op] = owner


def inputs(
    op: str,
    *,
    mutates: Iterable[str] = (),
    dtypes: Iterable[str] = DEFAULT_DTYPES,
    dispatch_args: Iterable[str] = (),
) -> Callable[[F], F]:
    """Decorator form of :func:`register_inputs`."""

    def decorate(generator: F) -> F:
        register_inputs(op, generator, mutates=mutates, dtypes=dtypes, dispatch_args=dispatch_args)
        return generator

    return decorate


def input_spec(op: str) -> InputSpec | None:
    """The input generator declared for ``op``, if any."""
    return _table.get(op)


def unregister_inputs(op: str) -> InputSpec | None:
    """Forget ``op``'s input generator (tests); returns what was registered."""
    with _lock:
        _owners.pop(op, None)
        return _table.pop(op, None)


# --- named benchmark shapes -------------------------------------------------------------------

#: The attribute :func:`bench_shapes` sets on a generator.
SHAPES_ATTRIBUTE = "kernreg_bench_shapes"

_SHAPE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_SCALARS = (bool, int, float, str)


def bench_shapes(**shapes: Mapping[str, object]) -> Callable[[F], F]:
    """Declare an input generator's named representative shapes, smallest first.

    Each value holds keyword arguments the generator accepts after ``(dtype, device, seed)``
    (numbers, strings or booleans), e.g. ``small={"tokens": 16, "hidden": 1024}``.
    Benchmarks call ``generator(dtype, device, 0, **shape)`` per named shape; the first one
    is the ``--quick`` shape.
    """
    checked = {name: check_shape(name, dims) for name, dims in shapes.items()}
    if not checked:
        raise InvalidSpecError("shapes", shapes, "declare at least one named shape")

    def decorate(generator: F) -> F:
        setattr(generator, SHAPES_ATTRIBUTE, checked)
        return generator

    return decorate


def declared_shapes(generator: Callable[..., Any]) -> dict[str, dict[str, object]]:
    """The named shapes ``generator`` declares with :func:`bench_shapes` (a copy; empty if none)."""
    shapes = getattr(generator, SHAPES_ATTRIBUTE, None)
    if not isinstance(shapes, dict):
        return {}
    return {name: dict(dims) for name, dims in shapes.items()}


def check_shape(name: str, dims: Mapping[str, object]) -> dict[str, object]:
    if not _SHAPE_NAME.match(name):
        raise InvalidSpecError("shapes", name, "a shape name is letters, digits, '_', '.', '-'")
    if not isinstance(dims, Mapping):
        raise InvalidSpecError("shapes", dims, f"shape {name!r}: expected a mapping of keywords")
    out: dict[str, object] = {}
    for key, value in dims.items():
        if not (isinstance(key, str) and key.isidentifier()):
            raise InvalidSpecError("shapes", key, f"shape {name!r}: keys are keyword names")
        if not isinstance(value, _SCALARS):
            raise InvalidSpecError(
                "shapes", value, f"shape {name!r}: {key} must be a number, string or bool"
            )
        out[key] = value
    return out

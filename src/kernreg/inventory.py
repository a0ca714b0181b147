"""The inventory: every registered :class:`~kernreg.spec.KernelSpec` by ``(op, backend,
variant)``, its conflict rules, overrides, freeze/scoped, and invalidation of what is
cached from it."""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from fnmatch import fnmatchcase
from types import FrameType
from typing import Any, Literal, Protocol, TypeVar

from kernreg._frozen import Frozen
from kernreg._names import check_name, check_op_id, check_variant
from kernreg.errors import (
    BackendNotFoundError,
    DuplicateReferenceError,
    InvalidSpecError,
    KernelConflictError,
    KernregError,
    OpNotFoundError,
    RegistryFrozenError,
    close_op_ids,
    did_you_mean,
)
from kernreg.spec import KernelSpec, Origin, target_name

__all__ = [
    "Inventory",
    "Override",
    "caller_origin",
    "current_distribution",
    "process_state_changed",
    "registration_journal",
    "unmatched_pattern_hint",
]

_I = TypeVar("_I", bound="Inventory")


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: Files whose frames are kernreg's own: the package and the op wrappers it generates.
_INTERNAL_FILES = (_PACKAGE_DIR, "<kernreg ")

#: The distribution whose plugin is being loaded, so its specs are attributed to it.
current_distribution: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "kernreg_current_distribution", default=None
)


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside kernreg (its
    package files and the code it generates)."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL_FILES):
        frame = frame.f_back
        level += 1
    return level


def caller_origin(depth: int = 1) -> Origin:
    """file:line of the first frame outside kernreg: the user's registering call.

    The walk starts ``depth`` frames up (1: the caller of this function).
    """
    frame: FrameType | None
    try:
        frame = sys._getframe(depth)
    except ValueError:  # called with fewer Python frames above (from C, say)
        frame = None
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    distribution, version = current_distribution.get() or (None, None)
    if frame is None:
        return Origin("<unknown>", 0, distribution, version)
    return Origin(frame.f_code.co_filename, frame.f_lineno, distribution, version)


#: While a plugin loads, every change it makes is journaled so a failure can be undone whole.
registration_journal: contextvars.ContextVar[
    list[tuple[Inventory, tuple[str, str, str], KernelSpec | None]] | None
] = contextvars.ContextVar("kernreg_journal", default=None)


class Override(Frozen):
    """A deliberate change of an existing registration: ``replace=True`` or ``unregister``."""

    __slots__ = ("kind", "old", "new", "origin")
    kind: Literal["replace", "unregister"]
    old: KernelSpec
    new: KernelSpec | None
    origin: Origin

    def __init__(
        self,
        kind: Literal["replace", "unregister"],
        old: KernelSpec,
        new: KernelSpec | None,
        origin: Origin,
    ) -> None:
        self._set("kind", kind)
        self._set("old", old)
        self._set("new", new)
        self._set("origin", origin)

    @property
    def key(self) -> tuple[str, str, str]:
        return self.old.key

    def __str__(self) -> str:
        if self.new is None:
            return f"op '{self.old.op}', backend '{self.old.label}': unregistered at {self.origin} (was {self.old.target_name} from {self.old.origin})"
        return (
            f"op '{self.old.op}', backend '{self.old.label}': {self.old.target_name} ({self.old.origin}) "
            f"replaced by {self.new.target_name} ({self.new.origin})"
        )


class _Subscriber(Protocol):
    def invalidate(self) -> None: ...


def _describe_difference(old: KernelSpec, new: KernelSpec) -> str:
    if old.target != new.target:
        return f"'{old.target_name}' != '{new.target_name}'"
    diffs = []
    for name in KernelSpec._compare:  # the key fields are equal, the target was compared above
        a, b = getattr(old, name), getattr(new, name)
        if a != b:
            show = (lambda v: sorted(str(x) for x in v)) if isinstance(a, frozenset) else repr
            diffs.append(f"{name} {show(a)} != {show(b)}")
    return ", ".join(diffs)


def _reloaded(old: KernelSpec, new: KernelSpec) -> bool:
    """Whether ``new`` is ``old`` registered again by a reloaded module: the same call site
    and fields, with function objects of the same names compiled anew (a reload recompiles
    the module; a helper registering a closure per call reuses one code object)."""
    if isinstance(old.target, str) or isinstance(new.target, str):
        return False
    if old.target_name != new.target_name or old.origin is None or new.origin is None:
        return False
    if (old.origin.file, old.origin.line) != (new.origin.file, new.origin.line):
        return False
    if _same_code(old.target, new.target):
        return False
    if old.when != new.when and not (
        callable(old.when)
        and callable(new.when)
        and target_name(old.when) == target_name(new.when)
        and not _same_code(old.when, new.when)
    ):
        return False
    unchanged = (f for f in KernelSpec._compare if f not in ("target", "when"))
    return all(getattr(old, f) == getattr(new, f) for f in unchanged)


def _same_code(a: object, b: object) -> bool:
    """Whether two different callables run one compiled body (closures of one definition)."""
    if a is b:
        return False
    code = getattr(a, "__code__", None)
    return code is not None and code is getattr(b, "__code__", None)


def _conflict_message(old: KernelSpec, new: KernelSpec) -> str:
    return (
        f"Conflicting kernel registration for op '{old.op}', backend '{old.label}': "
        f"{_describe_difference(old, new)}\n"
        f"  registered first at: {old.origin}\n"
        f"  registered again at: {new.origin}\n"
        "To override on purpose, register the new one with replace=True (or unregister the "
        "first); to keep both, give one of them a different variant."
    )


def _index(specs: tuple[KernelSpec, ...], backend: str, variant: str) -> int:
    """Where the spec ``(backend, variant)`` is among an op's specs; -1: absent."""
    for index, spec in enumerate(specs):
        if spec.backend == backend and spec.variant == variant:
            return index
    return -1


def _reference(specs: tuple[KernelSpec, ...]) -> KernelSpec | None:
    """The reference among an op's specs (there is at most one)."""
    return next((spec for spec in specs if spec.reference), None)


#: Every live inventory: a forked child gives each a fresh lock, and a change of process
#: state reaches all their cached decisions.
_registries: weakref.WeakSet[Inventory] = weakref.WeakSet()


class Inventory:
    """The implementations of every op, keyed by ``(op, backend, variant)``.

    Mutations are thread-safe, checked against the conflict rules, and empty every cache
    that subscribed (``_caches``, :meth:`subscribe`).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        _registries.add(self)
        #: The specs of every op, in registration order: a tuple costs a third of a dict.
        self._specs: dict[str, tuple[KernelSpec, ...]] = {}
        self._sorted: dict[str, tuple[KernelSpec, ...]] = {}
        self._overrides: list[Override] = []
        self._frozen = False
        self._generation = 0
        #: What every mutation empties (the cached decisions of the layer above).
        self._caches: list[dict[Any, Any]] = []
        self._subscribers: weakref.WeakSet[Any] = weakref.WeakSet()
        #: Whether anything ever subscribed (asking the WeakSet costs more than a mutation).
        self._subscribed = False

    @property
    def generation(self) -> int:
        """Increases with every mutation; a decision made at one generation is valid only there."""
        return self._generation

    # --- mutation -----------------------------------------------------------------------

    def register(self, spec: KernelSpec, *, replace: bool = False) -> KernelSpec:
        """Add ``spec``. Returns the stored spec, whose ``origin`` names the registering call.

        Re-registering an equal spec is a no-op, even on a frozen registry. A different spec for the same
        ``(op, backend, variant)`` raises :class:`KernelConflictError` unless
        ``replace=True``, which is recorded in :meth:`overrides`.
        """
        if not isinstance(spec, KernelSpec):
            raise InvalidSpecError("spec", spec, "expected a KernelSpec")
        if spec.origin is None:
            spec = spec.with_origin(caller_origin(2))
        return self._register_checked(spec, replace)

    def _register_checked(self, spec: KernelSpec, replace: bool) -> KernelSpec:
        """:meth:`register` against the conflict, reference and freeze rules."""
        op = spec.op
        with self._lock:
            specs = self._specs.get(op, ())
            index = _index(specs, spec.backend, spec.variant)
            old = None if index < 0 else specs[index]
            reloaded = False
            if old is not None:
                if old == spec:
                    return old  # also when frozen: reloading a module must stay safe
                reloaded = _reloaded(old, spec)
                if not replace and not reloaded:
                    self._check_mutable()
                    raise KernelConflictError(_conflict_message(old, spec), old, spec)
            self._check_mutable()
            # The op's reference is always one of its registered specs: at this slot, `old`.
            reference = _reference(specs)
            if reference is not None and spec.reference and reference is not old:
                raise DuplicateReferenceError(
                    f"Op '{spec.op}' already has a reference implementation '{reference.label}' "
                    f"({reference.origin}); cannot make '{spec.label}' ({spec.origin}) a second one. "
                    "Register it with reference=False, or unregister the first reference.",
                    reference,
                    spec,
                )
            if old is None:
                self._specs[op] = (*specs, spec)
            else:
                self._specs[op] = (*specs[:index], spec, *specs[index + 1 :])
                if not reloaded:
                    self._overrides.append(
                        Override("replace", old, spec, spec.origin or caller_origin())
                    )
            self._changed(op, spec.key, old)
        return spec

    def unregister(self, op: str, backend: str, variant: str = "") -> KernelSpec:
        """Remove and return the implementation ``(op, backend, variant)`` (recorded as an override)."""
        with self._lock:
            self._check_mutable()
            spec = self.get_backend(op, backend, variant)
            remaining = tuple(s for s in self._specs[op] if s is not spec)
            if remaining:
                self._specs[op] = remaining
            else:
                del self._specs[op]
            self._overrides.append(Override("unregister", spec, None, caller_origin()))
            self._changed(op, spec.key, spec)
        return spec

    def _changed(self, op: str, key: tuple[str, str, str], previous: KernelSpec | None) -> None:
        """After the op's specs changed (lock held): journal it, forget what was derived."""
        journal = registration_journal.get()
        if journal is not None:
            journal.append((self, key, previous))
        self._sorted.pop(op, None)
        self._invalidate()

    def freeze(self) -> None:
        """Refuse every later mutation (after start-up, so nothing changes under a running engine)."""
        with self._lock:
            self._frozen = True

    @property
    def frozen(self) -> bool:
        return self._frozen

    def _snapshot(self) -> tuple[Any, ...]:
        with self._lock:
            return (dict(self._specs), list(self._overrides), self._frozen)

    def _restore(self, saved: tuple[Any, ...]) -> None:
        with self._lock:
            self._specs, self._overrides, self._frozen = saved
            self._sorted.clear()
            self._invalidate()

    @contextlib.contextmanager
    def scoped(self: _I) -> Iterator[_I]:
        """A block whose registrations, removals and configuration vanish at exit (for tests).

        A frozen registry accepts changes inside the block and is frozen again at exit.
        """
        saved = self._snapshot()
        with self._lock:
            self._frozen = False
        try:
            yield self
        finally:
            self._restore(saved)

    def _undo(self, key: tuple[str, str, str], previous: KernelSpec | None) -> None:
        """Put ``key`` back to ``previous`` (``None``: absent), bypassing the conflict rules."""
        op, backend, variant = key
        with self._lock:
            specs = self._specs.get(op, ())
            index = _index(specs, backend, variant)
            if index < 0:
                specs = specs if previous is None else (*specs, previous)
            elif previous is None:
                specs = (*specs[:index], *specs[index + 1 :])
            else:
                specs = (*specs[:index], previous, *specs[index + 1 :])
            if specs:
                self._specs[op] = specs
            else:
                self._specs.pop(op, None)
            self._sorted.pop(op, None)
            self._invalidate()

    def _check_mutable(self) -> None:
        if self._frozen:
            raise RegistryFrozenError(
                "the kernel registry is frozen; register kernels before freeze() is called, "
                "or use registry.scoped() in tests"
            )

    def _invalidate(self) -> None:
        # Called with the lock held: a decision computed before this point can no longer be stored.
        self._generation += 1
        # Registering 100,000 specs invalidates 100,000 times: skip what is already empty.
        for cache in self._caches:
            if cache:
                cache.clear()
        if self._subscribed:
            for subscriber in list(self._subscribers):
                subscriber.invalidate()

    def subscribe(self, subscriber: _Subscriber) -> None:
        """Have ``subscriber.invalidate()`` called (lock held) on every mutation; held weakly."""
        with self._lock:
            self._subscribers.add(subscriber)
            self._subscribed = True

    # --- queries ------------------------------------------------------------------------

    def has(self, op: str) -> bool:
        self._ensure_plugins()
        return op in self._specs

    def ops(self) -> tuple[str, ...]:
        """Every op id with at least one implementation, sorted."""
        self._ensure_plugins()
        with self._lock:
            return tuple(sorted(self._specs))

    def _check_op_id(self, op: object) -> None:
        """:func:`check_op_id`, naming the registered op a malformed id probably meant
        (``rmsnorm`` -> ``layernorm.rmsnorm``)."""
        try:
            check_op_id(op)
        except InvalidSpecError as exc:
            hint = did_you_mean(close_op_ids(op, self._specs))
            if not hint:
                raise
            raise InvalidSpecError(exc.field, exc.value, f"{exc.why}; {hint}") from None

    def get(self, op: str) -> tuple[KernelSpec, ...]:
        """All implementations of ``op``, highest priority first, then by backend and variant."""
        self._ensure_plugins()
        try:
            specs = self._sorted.get(op)
        except TypeError:  # unhashable, so not an op id: say so instead of a bare TypeError
            self._check_op_id(op)
            raise
        if specs is None:
            with self._lock:
                stored = self._specs.get(op)
                if stored is None:
                    self._check_op_id(op)
                    raise OpNotFoundError(op, self._specs)
                specs = self._sorted[op] = tuple(sorted(stored, key=KernelSpec.sort_key))
        return specs

    def get_backend(self, op: str, backend: str, variant: str = "") -> KernelSpec:
        """The implementation ``(op, backend, variant)``; ``KeyError`` subclasses when missing."""
        self._ensure_plugins()
        with self._lock:
            specs = self._specs.get(op) if isinstance(op, str) else None
            if specs is None:
                self._check_op_id(op)
                raise OpNotFoundError(op, self._specs)
            index = _index(specs, backend, variant) if isinstance(backend, str) else -1
            if index < 0:
                check_name(backend, "backend")
                check_variant(variant)
                known = tuple(sorted(spec.label for spec in specs))
                raise BackendNotFoundError(op, backend, variant, known)
            return specs[index]

    def _stored(self, op: str, backend: str, variant: str) -> KernelSpec | None:
        """The spec ``(op, backend, variant)`` as stored now (plugins are not loaded first)."""
        specs = self._specs.get(op, ())
        index = _index(specs, backend, variant)
        return None if index < 0 else specs[index]

    def reference(self, op: str) -> KernelSpec | None:
        """The op's reference implementation, if one is registered."""
        return _reference(self.get(op))

    def all_specs(self) -> tuple[KernelSpec, ...]:
        """Every spec, sorted by op, then as :meth:`get` orders them."""
        return tuple(spec for op in self.ops() for spec in self.get(op))

    def overrides(self) -> tuple[Override, ...]:
        """Every deliberate replacement or removal, in the order it happened."""
        self._ensure_plugins()
        with self._lock:
            return tuple(self._overrides)

    def __len__(self) -> int:
        self._ensure_plugins()
        with self._lock:
            return sum(map(len, self._specs.values()))

    def __contains__(self, op: object) -> bool:
        self._ensure_plugins()
        return op in self._specs

    def __repr__(self) -> str:
        implementations = len(self)  # loads the plugins first, so both counts include them
        return f"<{type(self).__name__} {len(self._specs)} ops, {implementations} implementations>"

    def _ensure_plugins(self) -> None:
        """Load the plugins first where this registry loads them (the resolver does): every
        reader of the inventory calls this, so none sees it without the plugins' kernels.
        A reader inside a plugin being loaded sees what is registered so far."""


#: Patterns some inventory had an op for: a use_backend block that opens again checks nothing.
_matched_patterns: set[str] = set()


def unmatched_pattern_hint(pattern: str) -> str | None:
    """``None`` when an op of some live inventory matches ``pattern`` (an op id or glob),
    else why not, with the op ids it probably meant: for a :func:`~kernreg.use_backend`
    block that would otherwise change nothing without a word. Inventories that load
    plugins load them first."""
    if pattern in _matched_patterns:
        return None
    inventories = list(_registries)
    known: set[str] = set()
    # What is registered now first: plugins are loaded (third-party imports) only when
    # nothing registered matches, since one of them may register the op.
    for load_plugins in (False, True):
        for inventory in inventories:
            if load_plugins:
                try:
                    inventory._ensure_plugins()
                except KernregError:  # a plugin that fails says so where the registry is used
                    return None
            with inventory._lock:
                ops = list(inventory._specs)
            if pattern in ops or (
                _is_glob(pattern) and any(fnmatchcase(op, pattern) for op in ops)
            ):
                if len(_matched_patterns) >= 4096:
                    _matched_patterns.clear()
                _matched_patterns.add(pattern)
                return None
            known.update(ops)
    hint = did_you_mean(close_op_ids(pattern, known)) if not _is_glob(pattern) else ""
    return "it matches no registered op" + (f"; {hint}" if hint else "")


def _is_glob(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")


def process_state_changed() -> None:
    """Forget the cached decisions of every registry: call it when state that a
    process-state ``when`` predicate (one taking no arguments) reads has changed."""
    for reg in list(_registries):
        with reg._lock:
            reg._invalidate()


def _fresh_locks_in_child() -> None:
    """After ``os.fork``: a lock another thread held at the fork stays held forever in the
    child, so every inventory gets a fresh one."""
    for reg in list(_registries):
        reg._lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_locks_in_child)

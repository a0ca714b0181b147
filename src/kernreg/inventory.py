"""The inventory: every registered :class:`~kernreg.spec.KernelSpec` by ``(op, backend,
variant)``, its conflict rules and overrides, and where a registration came from."""

from __future__ import annotations

import bisect
import contextvars
import dataclasses
import functools
import inspect
import os
import sys
from types import CodeType, FrameType
from typing import Any, Literal

from kernreg._names import check_name, check_op_id, check_variant
from kernreg.errors import (
    BackendNotFoundError,
    DuplicateReferenceError,
    InvalidSpecError,
    KernelConflictError,
    OpNotFoundError,
    close_op_ids,
    did_you_mean,
)
from kernreg.spec import KernelSpec, Origin, target_name

__all__ = [
    "Inventory",
    "Override",
    "caller_origin",
    "current_distribution",
    "registration_journal",
    "user_stacklevel",
]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: Files whose frames are kernreg's own: the package and the op wrappers it generates.
_INTERNAL_FILES = (_PACKAGE_DIR, "<kernreg ")

#: The distribution whose plugin is being loaded, so its specs are attributed to it.
current_distribution: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "kernreg_current_distribution", default=None
)

#: While a plugin loads, every change it makes is journaled as ``(registry, key, previous
#: spec)``, so a failure can be undone whole.
registration_journal: contextvars.ContextVar[
    list[tuple[Any, tuple[str, str, str], KernelSpec | None]] | None
] = contextvars.ContextVar("kernreg_journal", default=None)


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside kernreg."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL_FILES):
        frame = frame.f_back
        level += 1
    return level


def caller_origin(depth: int = 1) -> Origin:
    """file:line of the user's registering call: the first frame outside kernreg, walking
    from ``depth`` frames up (1: the caller of this function)."""
    frame: FrameType | None
    try:
        frame = sys._getframe(depth)
    except ValueError:  # called with fewer Python frames above (from C, say)
        frame = None
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    where = ("<unknown>", 0) if frame is None else (frame.f_code.co_filename, _line(frame))
    return _origin(*where, *(current_distribution.get() or (None, None)))


def _line(frame: FrameType) -> int:
    """``frame.f_lineno``, which scans the code's line table from its start up to the frame's
    instruction: N registrations in one module cost N² (8,000 of them: a 6.0 s import, 0.8 s
    with this table). Near the start of the code, the scan is the cheaper."""
    if frame.f_lasti < 4096:
        return frame.f_lineno
    starts, lines = _line_table(_Code(frame.f_code))
    return lines[bisect.bisect_right(starts, frame.f_lasti) - 1] or frame.f_lineno


class _Code:
    """A code object that hashes and compares by identity (its own hash reads all of it)."""

    __slots__ = ("code",)

    def __init__(self, code: CodeType) -> None:
        self.code = code

    def __hash__(self) -> int:
        return id(self.code)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Code) and other.code is self.code


@functools.lru_cache(maxsize=8)  # registrations come in runs from one module
def _line_table(code: _Code) -> tuple[list[int], list[int | None]]:
    """The first byte offset of each range of ``code``'s instructions, and its line."""
    ranges = list(code.code.co_lines())
    return [start for start, _, _ in ranges], [line for _, _, line in ranges]


# Specs registered from one line (a loop, a helper) share one Origin: 64 bytes a spec.
_origin = functools.lru_cache(maxsize=1024)(Origin)


@dataclasses.dataclass(frozen=True, slots=True)
class Override:
    """A deliberate change of an existing registration: ``replace=True`` or ``unregister``."""

    kind: Literal["replace", "unregister"]
    old: KernelSpec
    new: KernelSpec | None
    origin: Origin

    @property
    def key(self) -> tuple[str, str, str]:
        return self.old.key

    def __str__(self) -> str:
        old, new = self.old, self.new
        head = f"op '{old.op}', backend '{old.label}': "
        if new is None:
            return f"{head}unregistered at {self.origin} (was {old.target_name} from {old.origin})"
        return (
            f"{head}{old.target_name} ({old.origin}) replaced by {new.target_name} ({new.origin})"
        )


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
    and fields, with function objects of the same names compiled anew."""
    if isinstance(old.target, str) or isinstance(new.target, str):
        return False
    if old.target_name != new.target_name or old.origin is None or new.origin is None:
        return False
    if (old.origin.file, old.origin.line) != (new.origin.file, new.origin.line):
        return False
    # A wrapper (a derived torch_compile implementation) is reloaded with what it wraps.
    if _same_code(inspect.unwrap(old.target), inspect.unwrap(new.target)):
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
    """Whether two different callables run one compiled body: closures of one definition (a
    helper registering one per call), where a reload compiles the module anew."""
    if a is b:
        return False
    code = getattr(a, "__code__", None)
    return code is not None and code is getattr(b, "__code__", None)


class Inventory:
    """The implementations of every op, keyed by ``(op, backend, variant)``, and the overrides
    made to them. Plain storage: its owner (:class:`kernreg.registry.KernelRegistry`) locks it,
    loads plugins before reading it and forgets its decisions when it changes."""

    def __init__(self) -> None:
        #: The specs of every op, in canonical order (a tuple costs a third of a dict).
        self.specs: dict[str, tuple[KernelSpec, ...]] = {}
        #: Every deliberate replacement or removal, in the order it happened.
        self.override_log: list[Override] = []

    def add(self, spec: KernelSpec, *, replace: bool) -> KernelSpec | None:
        """Store ``spec`` under the conflict and reference rules; return the spec it displaced
        (the caller has handled an equal spec: a no-op)."""
        old = self.stored(*spec.key)
        reloaded = old is not None and _reloaded(old, spec)
        if old is not None and not replace and not reloaded:
            message = (
                f"Conflicting kernel registration for op '{old.op}', backend '{old.label}': "
                f"{_describe_difference(old, spec)}\n"
                f"  registered first at: {old.origin}\n"
                f"  registered again at: {spec.origin}\n"
                "To override on purpose, register the new one with replace=True (or unregister "
                "the first); to keep both, give one of them a different variant."
            )
            raise KernelConflictError(message, old, spec)
        # The op's reference is always one of its registered specs: at this slot, `old`.
        reference = next((s for s in self.specs.get(spec.op, ()) if s.reference), None)
        if reference is not None and spec.reference and reference is not old:
            raise DuplicateReferenceError(
                f"Op '{spec.op}' already has a reference implementation '{reference.label}' "
                f"({reference.origin}); cannot make '{spec.label}' ({spec.origin}) a second one. "
                "Register it with reference=False, or unregister the first reference.",
                reference,
                spec,
            )
        if old is not None and not reloaded:
            self.override_log.append(Override("replace", old, spec, spec.origin or caller_origin()))
        return self.put(spec.key, spec)

    def put(self, key: tuple[str, str, str], spec: KernelSpec | None) -> KernelSpec | None:
        """Set ``key`` to ``spec`` (``None``: remove it), bypassing the rules; return the old."""
        previous = self.stored(*key)
        specs = [s for s in self.specs.get(key[0], ()) if s is not previous]
        if spec is not None:
            specs.append(spec)
        if specs:
            self.specs[key[0]] = tuple(sorted(specs, key=KernelSpec.sort_key))
        else:
            self.specs.pop(key[0], None)
        return previous

    def stored(self, op: str, backend: str, variant: str) -> KernelSpec | None:
        return next((s for s in self.specs.get(op, ()) if s.key == (op, backend, variant)), None)

    def remove(self, op: str, backend: str, variant: str) -> KernelSpec:
        """Remove and return ``(op, backend, variant)`` (recorded as an override)."""
        spec = self.get_backend(op, backend, variant)
        self.put(spec.key, None)
        self.override_log.append(Override("unregister", spec, None, caller_origin()))
        return spec

    def copy(self) -> Inventory:
        """An independent copy (the specs themselves are immutable and shared)."""
        clone = Inventory()
        clone.specs, clone.override_log = dict(self.specs), list(self.override_log)
        return clone

    def get(self, op: str) -> tuple[KernelSpec, ...]:
        """All implementations of ``op``, highest priority first, then by backend and variant."""
        specs = self.specs.get(op) if isinstance(op, str) else None
        if specs is None:
            try:
                check_op_id(op)
            except InvalidSpecError as exc:  # name the op it probably meant (rmsnorm)
                hint = did_you_mean(close_op_ids(op, self.specs))
                if not hint:
                    raise
                raise InvalidSpecError(exc.field, exc.value, f"{exc.why}; {hint}") from None
            raise OpNotFoundError(op, self.specs)
        return specs

    def get_backend(self, op: str, backend: str, variant: str = "") -> KernelSpec:
        """The implementation ``(op, backend, variant)``; ``KeyError`` subclasses when missing."""
        specs = self.get(op)
        spec = self.stored(op, backend, variant)
        if spec is None:
            check_name(backend, "backend")
            check_variant(variant)
            raise BackendNotFoundError(op, backend, variant, tuple(sorted(s.label for s in specs)))
        return spec

"""What one implementation of an operator is: :class:`KernelSpec`, and where it came from."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import operator
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from kernreg._frozen import Frozen
from kernreg._names import check_name, check_op_id, check_variant, label
from kernreg.dtypes import normalize_dtype
from kernreg.errors import InvalidSpecError, KernelLoadError
from kernreg.platform import Requirement

__all__ = ["KNOWN_TRAITS", "KernelSpec", "Origin"]

_TARGET_RE = re.compile(r"[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")

#: Traits with an agreed meaning. Other names are allowed: backends may declare their own.
KNOWN_TRAITS: Mapping[str, str] = MappingProxyType(
    {
        "deterministic": "same inputs give bitwise the same outputs, run to run",
        "batch_invariant": "a row's result does not depend on the batch it is in",
        "cuda_graph_safe": "can be captured in a CUDA graph",
        "compile_safe": "can be traced by torch.compile without a graph break",
        "inplace": "writes its results into its inputs",
        "backward": "has a backward (autograd) implementation",
    }
)


@dataclasses.dataclass(frozen=True, slots=True)
class Origin:
    """Where a registration came from: the user's call site and, for plugins, the distribution."""

    file: str
    line: int
    distribution: str | None = None
    version: str | None = None

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}"
        if self.distribution:
            dist = self.distribution + (f" {self.version}" if self.version else "")
            return f"{where} (distribution {dist})"
        return where


Target = str | Callable[..., Any]


def _check_target(value: object, field_name: str) -> None:
    if not (_TARGET_RE.fullmatch(value) if isinstance(value, str) else callable(value)):
        raise InvalidSpecError(field_name, value, "expected 'module.path:attr.path' or a callable")


def target_name(target: Target) -> str:
    """A readable ``module:qualname`` for a target string or a callable."""
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or "?"
    qualname = (
        getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    )
    return f"{module}:{qualname}"


def resolve_target(target: str) -> Any:
    """Import ``module:attr.path`` and return the attribute. A module imported (and
    initialised) already is read from ``sys.modules``: ``importlib.import_module`` costs
    0.7 µs, and ``kernelize`` imports its targets again on each call."""
    module_name, _, attr_path = target.partition(":")
    obj: Any = sys.modules.get(module_name)
    if obj is None or getattr(getattr(obj, "__spec__", None), "_initializing", False):
        obj = importlib.import_module(module_name)  # waits for another thread's import
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    return obj


#: Every empty collection field holds this one (an empty frozenset costs 216 bytes).
_EMPTY: frozenset[Any] = frozenset()


def _names(value: object, field_name: str, check: Callable[[Any, str], str]) -> frozenset[str]:
    """A collection of names as a frozenset, each checked (and normalised) by ``check``."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise InvalidSpecError(
            field_name, value, "expected a collection (list, tuple or set) of names"
        )
    return frozenset(check(item, field_name) for item in value) or _EMPTY


def _requirements(value: object) -> frozenset[Requirement]:
    if isinstance(value, (str, Requirement)) or not isinstance(value, Iterable):
        raise InvalidSpecError(
            "requires", value, "expected a collection of Requirement objects or strings"
        )
    items = tuple(value)
    try:
        return _requirement_set(items)
    except TypeError:  # an unhashable item: Requirement.coerce says what is wrong with it
        return frozenset(map(Requirement.coerce, items)) or _EMPTY


# The one cache of spec construction: an inventory names a few sets of requirements
# (("cuda>=8.0",), ("cuda", "hip")) over and over, and its specs share one frozenset per
# set (216 bytes each: half of what a registered spec retains without it).
@functools.lru_cache(maxsize=256)
def _requirement_set(items: tuple[Requirement | str, ...]) -> frozenset[Requirement]:
    return frozenset(map(Requirement.coerce, items)) or _EMPTY


#: The fields most specs leave empty, kept in one slot (``_rare``): a spec retains 32 bytes
#: less (benchmarks/bench_sglang.py, retained memory per registered spec: 1.38x sglang's,
#: 1.71x with a slot per field; budget 1.5x).
_RARE = ("dtypes", "when", "packages", "traits", "description")
Rare = tuple[frozenset[str], Target | None, frozenset[str], frozenset[str], str]
_PLAIN: Rare = (_EMPTY, None, _EMPTY, _EMPTY, "")


def _shared(rare: tuple[Any, ...]) -> Rare:
    """``rare``, or the one tuple all specs share when it holds only the defaults."""
    return _PLAIN if all(map(operator.is_, rare, _PLAIN)) else rare


def _rare_field(index: int) -> Any:
    """A read-only field of a spec kept in its ``_rare`` tuple at ``index``."""
    return property(lambda spec: spec._rare[index])


def _check_package(value: object, field_name: str) -> str:
    # packaging is imported only for specs that name packages, keeping `import kernreg` light.
    from packaging.requirements import InvalidRequirement
    from packaging.requirements import Requirement as PackageRequirement

    if not isinstance(value, str):
        raise InvalidSpecError(field_name, value, "expected a PEP 508 requirement string")
    try:
        parsed = PackageRequirement(value)
    except InvalidRequirement as exc:
        raise InvalidSpecError(field_name, value, f"not a PEP 508 requirement ({exc})") from None
    # An extra is what an installer is asked for; no kernel is chosen under one, so the
    # marker would always read extra == "" and the gate would silently never apply.
    if parsed.marker is not None and "extra" in re.sub(
        r"\"[^\"]*\"|'[^']*'", "", str(parsed.marker)
    ):
        why = "an 'extra' marker never holds when a kernel is chosen; name the package without it"
        raise InvalidSpecError(field_name, value, why)
    return value


class KernelSpec(Frozen):
    """One implementation of an operator, and the conditions under which it may run
    (docs/design.md, "Concepts"). Every field is validated at construction; equality and
    hashing cover every field but ``origin``."""

    __slots__ = (
        "op",
        "backend",
        "target",
        "variant",
        "requires",
        "priority",
        "reference",
        "origin",
        "_rare",
    )
    _hidden = ("origin",)
    op: str
    backend: str
    target: Target
    variant: str
    requires: frozenset[Requirement]
    priority: int
    reference: bool
    origin: Origin | None
    _rare: Rare

    def __init__(
        self,
        op: str,
        backend: str,
        target: Target,
        *,
        variant: str = "",
        requires: Iterable[Requirement | str] = (),
        dtypes: Iterable[str] = (),
        when: Target | None = None,
        packages: Iterable[str] = (),
        traits: Iterable[str] = (),
        priority: int = 0,
        reference: bool = False,
        description: str = "",
        origin: Origin | None = None,
    ) -> None:
        # Checked in the order the parameters are documented: the first wrong one is named.
        self._set("op", check_op_id(op, "op"))
        self._set("backend", check_name(backend, "backend"))
        self._set("variant", check_variant(variant))
        _check_target(target, "target")
        self._set("target", target)
        self._set("requires", _requirements(requires))
        checked_dtypes = _names(dtypes, "dtypes", normalize_dtype)
        if when is not None:
            _check_target(when, "when")
        checked_packages = _names(packages, "packages", _check_package)
        checked_traits = _names(traits, "traits", check_name)
        if type(priority) is not int:
            raise InvalidSpecError("priority", priority, "expected an int")
        self._set("priority", priority)
        if type(reference) is not bool:
            raise InvalidSpecError("reference", reference, "expected True or False")
        self._set("reference", reference)
        if not isinstance(description, str):
            raise InvalidSpecError("description", description, "expected a string")
        rare = (checked_dtypes, when, checked_packages, checked_traits, description)
        self._set("_rare", _shared(rare))
        if origin is not None and not isinstance(origin, Origin):
            raise InvalidSpecError("origin", origin, "expected an Origin or None")
        self._set("origin", origin)

    #: Every parameter is a field (those kept in ``_rare`` too), in the parameters' order.
    _fields = tuple(inspect.signature(__init__).parameters)[1:]

    def replace(self, **changes: Any) -> KernelSpec:
        """A copy with ``changes`` applied (fields are not re-validated)."""
        if changes.keys().isdisjoint(_RARE):  # with_origin, once per registration
            return super().replace(**changes)
        rare = tuple(
            changes.pop(name, value) for name, value in zip(_RARE, self._rare, strict=True)
        )
        return super().replace(_rare=_shared(rare), **changes)

    dtypes: frozenset[str] = _rare_field(0)
    when: Target | None = _rare_field(1)
    packages: frozenset[str] = _rare_field(2)
    traits: frozenset[str] = _rare_field(3)
    description: str = _rare_field(4)

    @property
    def key(self) -> tuple[str, str, str]:
        """The registry key ``(op, backend, variant)``."""
        return (self.op, self.backend, self.variant)

    @property
    def label(self) -> str:
        """``backend`` or ``backend/variant``."""
        return label(self.backend, self.variant)

    @property
    def target_name(self) -> str:
        return target_name(self.target)

    @property
    def gated(self) -> bool:
        """Whether the choice of this spec can depend on the call (device, dtypes, ``when``)."""
        return bool(self.requires or self.dtypes) or self.when is not None

    def load(self) -> Callable[..., Any]:
        """Import and return the implementation; errors name the op, backend and target."""
        return self._import(self.target, "")

    def load_when(self) -> Callable[..., Any] | None:
        """Import and return the ``when`` predicate, or ``None`` when the spec has none."""
        return None if self.when is None else self._import(self.when, "when predicate")

    def _import(self, target: Target, what: str) -> Callable[..., Any]:
        if not isinstance(target, str):
            return target
        try:
            obj = resolve_target(target)
        except Exception as exc:
            raise KernelLoadError(self, exc) from exc
        if not callable(obj):
            why = f"{what} {target!r}" if what else f"{type(obj).__name__} object"
            raise KernelLoadError(self, TypeError(f"{why} is not callable"))
        return obj  # type: ignore[no-any-return]

    def with_origin(self, origin: Origin) -> KernelSpec:
        """A copy carrying ``origin`` (the fields are already valid, so nothing is re-checked)."""
        return self.replace(origin=origin)

    def sort_key(self) -> tuple[int, str, str]:
        """Candidates are listed by priority (highest first), then backend and variant."""
        return (-self.priority, self.backend, self.variant)

    def describe(self) -> dict[str, object]:
        """A JSON-ready description, for the CLI, plans and tests."""
        origin = self.origin
        return {
            "op": self.op,
            "backend": self.backend,
            "variant": self.variant,
            "target": self.target_name,
            "requires": sorted(str(r) for r in self.requires),
            "dtypes": sorted(self.dtypes),
            "when": None if self.when is None else target_name(self.when),
            "packages": sorted(self.packages),
            "traits": sorted(self.traits),
            "priority": self.priority,
            "reference": self.reference,
            "description": self.description,
            "origin": None if origin is None else dataclasses.asdict(origin),
        }

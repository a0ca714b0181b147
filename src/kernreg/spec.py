"""What one implementation of an operator is: :class:`KernelSpec`, and where it came from."""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, cast

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


class Origin(Frozen):
    """Where a registration came from: the user's call site and, for plugins, the distribution."""

    __slots__ = ("file", "line", "distribution", "version")
    file: str
    line: int
    distribution: str | None
    version: str | None

    def __init__(
        self, file: str, line: int, distribution: str | None = None, version: str | None = None
    ) -> None:
        self._set("file", file)
        self._set("line", line)
        self._set("distribution", distribution)
        self._set("version", version)

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}"
        if self.distribution:
            dist = self.distribution + (f" {self.version}" if self.version else "")
            return f"{where} (distribution {dist})"
        return where


Target = str | Callable[..., Any]


def _check_target(value: object, field_name: str) -> None:
    if isinstance(value, str):
        if _TARGET_RE.fullmatch(value) is None:
            raise InvalidSpecError(
                field_name, value, "expected 'module.path:attr.path' or a callable"
            )
    elif not callable(value):
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
    """Import ``module:attr.path`` and return the attribute."""
    module_name, _, attr_path = target.partition(":")
    obj: Any = importlib.import_module(module_name)
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


def _check_package(value: object, field_name: str) -> str:
    # packaging is imported only for specs that name packages, keeping `import kernreg` light.
    from packaging.requirements import InvalidRequirement
    from packaging.requirements import Requirement as PackageRequirement

    if not isinstance(value, str):
        raise InvalidSpecError(field_name, value, "expected a PEP 508 requirement string")
    try:
        PackageRequirement(value)
    except InvalidRequirement as exc:
        raise InvalidSpecError(field_name, value, f"not a PEP 508 requirement ({exc})") from None
    return value


class KernelSpec(Frozen):
    """One implementation of an operator, and the conditions under which it may run.

    Parameters (docs/design.md, "Concepts"): ``op`` and ``backend`` (plus ``variant``) form the key;
    ``target`` is ``"module:attr"`` (imported lazily) or a callable; ``requires``
    are alternatives (empty: any device); ``dtypes`` restricts the call's dtypes
    (empty: any); ``when`` is a per-call predicate; ``packages`` are PEP 508
    requirements checked against installed metadata; ``priority`` orders eligible
    candidates (higher wins); ``reference`` marks the op's correctness oracle.
    Every field is validated at construction. Equality and hashing cover every field
    except ``origin``.
    """

    __slots__ = (
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
    _hidden = ("origin",)
    op: str
    backend: str
    target: Target
    variant: str
    requires: frozenset[Requirement]
    dtypes: frozenset[str]
    when: Target | None
    packages: frozenset[str]
    traits: frozenset[str]
    priority: int
    reference: bool
    description: str
    origin: Origin | None

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
        self._set("dtypes", _names(dtypes, "dtypes", normalize_dtype))
        if when is not None:
            _check_target(when, "when")
        self._set("when", when)
        self._set("packages", _names(packages, "packages", _check_package))
        self._set("traits", _names(traits, "traits", check_name))
        if type(priority) is not int:
            raise InvalidSpecError("priority", priority, "expected an int")
        self._set("priority", priority)
        if type(reference) is not bool:
            raise InvalidSpecError("reference", reference, "expected True or False")
        self._set("reference", reference)
        if not isinstance(description, str):
            raise InvalidSpecError("description", description, "expected a string")
        self._set("description", description)
        if origin is not None and not isinstance(origin, Origin):
            raise InvalidSpecError("origin", origin, "expected an Origin or None")
        self._set("origin", origin)

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
        return cast(KernelSpec, self.replace(origin=origin))

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
            "origin": None
            if origin is None
            else {
                "file": origin.file,
                "line": origin.line,
                "distribution": origin.distribution,
                "version": origin.version,
            },
        }

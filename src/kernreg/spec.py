"""What one implementation of an operator is: :class:`KernelSpec`, and where it came from."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from types import CodeType

from kernreg._frozen import Frozen
from kernreg._names import OP_ID_RE, check_name, check_op_id, check_variant, label
from kernreg._patterns import LazyPattern
from kernreg._typing import Any, cast
from kernreg.dtypes import normalize_dtype
from kernreg.errors import InvalidSpecError, KernelLoadError
from kernreg.platform import Requirement

__all__ = ["KNOWN_TRAITS", "KernelSpec", "Origin"]

_TARGET_RE = LazyPattern(r"[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")

#: Traits with an agreed meaning. Other names are allowed: backends may declare their own.
KNOWN_TRAITS: dict[str, str] = {
    "deterministic": "same inputs give bitwise the same outputs, run to run",
    "batch_invariant": "a row's result does not depend on the batch it is in",
    "cuda_graph_safe": "can be captured in a CUDA graph",
    "compile_safe": "can be traced by torch.compile without a graph break",
    "inplace": "writes its results into its inputs",
    "backward": "has a backward (autograd) implementation",
}


class Origin(Frozen):
    """Where a registration came from: the user's call site and, for plugins, the distribution.

    An origin taken from a running frame keeps the code object and instruction offset and
    works out ``file`` and ``line`` when first read: registering costs no line-table walk.
    """

    __slots__ = ("_file", "_line", "distribution", "version", "_code", "_offset")
    _file: str | None
    _line: int | None
    distribution: str | None
    version: str | None
    _code: CodeType | None
    _offset: int

    def __init__(
        self, file: str, line: int, distribution: str | None = None, version: str | None = None
    ) -> None:
        self._set("_file", file)
        self._set("_line", line)
        self._set("distribution", distribution)
        self._set("version", version)
        self._set("_code", None)
        self._set("_offset", 0)

    @classmethod
    def at(
        cls, code: CodeType, offset: int, distribution: str | None, version: str | None
    ) -> Origin:
        """The origin of the instruction at byte ``offset`` of ``code`` (a frame's ``f_lasti``)."""
        origin = object.__new__(cls)
        setattr_ = object.__setattr__
        setattr_(origin, "_file", None)
        setattr_(origin, "_line", None)
        setattr_(origin, "distribution", distribution)
        setattr_(origin, "version", version)
        setattr_(origin, "_code", code)
        setattr_(origin, "_offset", offset)
        return origin

    @property
    def file(self) -> str:
        file = self._file
        if file is None:
            file = cast(CodeType, self._code).co_filename
            object.__setattr__(self, "_file", file)
        return file

    @property
    def line(self) -> int:
        line = self._line
        if line is None:
            code, offset = cast(CodeType, self._code), self._offset
            line = next(
                (n for start, end, n in code.co_lines() if start <= offset < end and n), None
            )
            if line is None:
                line = code.co_firstlineno
            object.__setattr__(self, "_line", line)
        return line

    def __reduce__(self) -> tuple[Any, ...]:
        return (Origin, (self.file, self.line, self.distribution, self.version))

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}"
        if self.distribution:
            dist = self.distribution + (f" {self.version}" if self.version else "")
            return f"{where} (distribution {dist})"
        return where


# Compared, hashed and shown by what it names, not by how it is stored.
Origin._fields = Origin._compare = Origin._repr = ("file", "line", "distribution", "version")


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


_EMPTY: frozenset[Any] = frozenset()
_COLLECTIONS = frozenset({tuple, list, set, frozenset})
_IMMUTABLE = frozenset({tuple, frozenset})
_CACHE_SIZE = 1024


class _ValidCache:
    """Field values already validated, so equal inputs share one frozenset and skip checks.

    ``by_id`` maps an immutable input (a tuple or frozenset, kept alive by the entry, so
    its id cannot be reused) to its validated frozenset; ``shared`` interns validated
    frozensets by value. Both are bounded: full, they are emptied.
    """

    __slots__ = ("by_id", "shared", "shared_input")

    def __init__(self) -> None:
        self.by_id: dict[int, tuple[object, frozenset[Any]]] = {}
        self.shared: dict[frozenset[Any], frozenset[Any]] = {}
        #: Validated results by an equal input tuple (used for ``requires``).
        self.shared_input: dict[tuple[Any, ...], frozenset[Any]] = {}

    def get(self, value: object) -> frozenset[Any] | None:
        hit = self.by_id.get(id(value))
        return hit[1] if hit is not None and hit[0] is value else None

    def keep(self, value: object, result: frozenset[Any]) -> frozenset[Any]:
        shared = self.shared
        if len(shared) >= _CACHE_SIZE:
            shared.clear()
        result = shared.setdefault(result, result)
        if type(value) in _IMMUTABLE:
            by_id = self.by_id
            if len(by_id) >= _CACHE_SIZE:
                by_id.clear()
            by_id[id(value)] = (value, result)
        return result


_REQUIRES = _ValidCache()
#: The op id the last spec was built for (already validated).
_last_op: object = object()
#: The default of every collection field (the empty tuple is a singleton in CPython).
_NO_ITEMS: tuple[()] = ()
_NAME_CACHES: dict[str, _ValidCache] = {}
#: Names (backends, traits) that passed ``check_name``; bounded like the caches above.
_VALID_NAMES: set[str] = set()


def _frozen_names(
    value: object, field_name: str, check: Callable[[object, str], str]
) -> frozenset[str]:
    # Concrete types first: the abstract isinstance check costs ~1 µs per spec field.
    if type(value) not in _COLLECTIONS and (
        isinstance(value, str) or not isinstance(value, Iterable)
    ):
        raise InvalidSpecError(
            field_name, value, "expected a collection (list, tuple or set) of names"
        )
    if not value:
        return _EMPTY
    cache = _NAME_CACHES.get(field_name)
    if cache is None:
        cache = _NAME_CACHES[field_name] = _ValidCache()
    found = cache.get(value)
    if found is not None:
        return found
    names = frozenset(check(item, field_name) for item in cast(Iterable[object], value))
    return cache.keep(value, names)


def _frozen_requires(requires: object) -> frozenset[Requirement]:
    hit = _REQUIRES.by_id.get(id(requires))
    if hit is not None and hit[0] is requires:
        return hit[1]
    if type(requires) is tuple:  # an equal tuple seen before
        try:
            found = _REQUIRES.shared_input.get(requires)
        except TypeError:  # an unhashable item: not a requirement, said below
            found = None
        if found is not None:
            return found
    if type(requires) not in _COLLECTIONS and (
        isinstance(requires, (str, Requirement)) or not isinstance(requires, Iterable)
    ):
        raise InvalidSpecError(
            "requires", requires, "expected a collection of Requirement objects or strings"
        )
    if not requires:
        return _EMPTY
    items = cast(Iterable[Requirement | str], requires)
    coerced = _REQUIRES.keep(requires, frozenset(Requirement.coerce(r) for r in items))
    if type(requires) is tuple:
        if len(_REQUIRES.shared_input) >= _CACHE_SIZE:
            _REQUIRES.shared_input.clear()
        _REQUIRES.shared_input[requires] = coerced
    return coerced


def _valid_name(value: object, field_name: str) -> None:
    if type(value) is not str or value not in _VALID_NAMES:
        check_name(value, field_name)
        if type(value) is str:
            if len(_VALID_NAMES) >= _CACHE_SIZE:
                _VALID_NAMES.clear()
            _VALID_NAMES.add(value)


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


class _SpecFields:
    """The storage of :class:`KernelSpec`: its fields, in their order."""

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


class _SpecBuilder(_SpecFields):
    """A spec while its ``__init__`` runs: the same storage, plainly assignable.

    Assigning 13 fields through ``object.__setattr__`` costs about 60% of building a spec;
    a spec under construction is this class for the few lines that store its fields.
    """

    __slots__ = ()


class KernelSpec(_SpecFields, Frozen):
    """One implementation of an operator, and the conditions under which it may run.

    Parameters (docs/design.md, "Concepts"): ``op`` and ``backend`` (plus ``variant``) form the key;
    ``target`` is ``"module:attr"`` (imported lazily) or a callable; ``requires``
    are alternatives (empty: any device); ``dtypes`` restricts the call's dtypes
    (empty: any); ``when`` is a per-call predicate; ``packages`` are PEP 508
    requirements checked against installed metadata; ``priority`` orders eligible
    candidates (higher wins); ``reference`` marks the op's correctness oracle.
    Equality and hashing cover every field except ``origin``.
    """

    __slots__ = ()  # the fields are _SpecFields'
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
        # Registering 100,000 specs has a budget of one second, so the common case (names
        # seen before, shared collections, empty ones) costs set lookups, not regexes.
        global _last_op
        if op is not _last_op:
            if type(op) is not str or OP_ID_RE.fullmatch(op) is None:
                check_op_id(op, "op")
            _last_op = op  # specs of one op are usually built one after the other
        if type(backend) is not str or backend not in _VALID_NAMES:
            _valid_name(backend, "backend")
        if type(variant) is not str or variant != "":
            check_variant(variant)
        if type(target) is str:
            if _TARGET_RE.fullmatch(target) is None:
                _check_target(target, "target")
        elif not callable(target):
            _check_target(target, "target")
        requires_ = _EMPTY if requires is _NO_ITEMS else _frozen_requires(requires)
        dtypes_ = (
            _EMPTY if dtypes is _NO_ITEMS else _frozen_names(dtypes, "dtypes", normalize_dtype)
        )
        if when is not None:
            _check_target(when, "when")
        packages_ = (
            _EMPTY if packages is _NO_ITEMS else _frozen_names(packages, "packages", _check_package)
        )
        traits_ = _EMPTY if traits is _NO_ITEMS else _frozen_names(traits, "traits", check_name)
        if type(priority) is not int:
            raise InvalidSpecError("priority", priority, "expected an int")
        if type(reference) is not bool:
            raise InvalidSpecError("reference", reference, "expected True or False")
        if type(description) is not str and not isinstance(description, str):
            raise InvalidSpecError("description", description, "expected a string")
        if origin is not None and type(origin) is not Origin:
            raise InvalidSpecError("origin", origin, "expected an Origin or None")
        values = (
            op,
            backend,
            target,
            variant,
            requires_,
            dtypes_,
            when,
            packages_,
            traits_,
            priority,
            reference,
            description,
            origin,
        )
        cls = type(self)
        if cls is not KernelSpec:  # a subclass may add storage: no class swap for it
            for name, value in zip(_SpecFields.__slots__, values, strict=True):
                object.__setattr__(self, name, value)
            return
        build = cast(Any, self)
        object.__setattr__(build, "__class__", _SpecBuilder)
        (
            build.op,
            build.backend,
            build.target,
            build.variant,
            build.requires,
            build.dtypes,
            build.when,
            build.packages,
            build.traits,
            build.priority,
            build.reference,
            build.description,
            build.origin,
        ) = values
        object.__setattr__(build, "__class__", KernelSpec)

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
        if not isinstance(self.target, str):
            return self.target
        try:
            obj = resolve_target(self.target)
        except Exception as exc:
            raise KernelLoadError(self, exc) from exc
        if not callable(obj):
            raise KernelLoadError(self, TypeError(f"{type(obj).__name__} object is not callable"))
        return obj  # type: ignore[no-any-return]

    def load_when(self) -> Callable[..., Any] | None:
        """Import and return the ``when`` predicate, or ``None`` when the spec has none."""
        if self.when is None or not isinstance(self.when, str):
            return self.when
        try:
            obj = resolve_target(self.when)
        except Exception as exc:
            raise KernelLoadError(self, exc) from exc
        if not callable(obj):
            raise KernelLoadError(self, TypeError(f"when predicate {self.when!r} is not callable"))
        return obj  # type: ignore[no-any-return]

    def with_origin(self, origin: Origin) -> KernelSpec:
        """A copy carrying ``origin`` (the fields are already valid, so nothing is re-checked)."""
        clone = object.__new__(KernelSpec)
        setattr_ = object.__setattr__
        for name in _COPIED_FIELDS:  # an explicit loop: Frozen.replace costs 2 µs per spec
            setattr_(clone, name, getattr(self, name))
        setattr_(clone, "origin", origin)
        return clone

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


_COPIED_FIELDS = tuple(name for name in KernelSpec._fields if name != "origin")

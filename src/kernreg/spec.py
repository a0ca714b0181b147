"""What one implementation of an operator is: :class:`KernelSpec`, and where it came from."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from operator import attrgetter
from types import CodeType
from typing import Any, cast

from kernreg._frozen import Frozen
from kernreg._names import OP_ID_RE, check_name, check_op_id, check_variant, label
from kernreg.dtypes import normalize_dtype
from kernreg.errors import InvalidSpecError, KernelLoadError
from kernreg.platform import Requirement

__all__ = ["KNOWN_TRAITS", "KernelSpec", "Origin"]

_TARGET_RE = re.compile(r"[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")

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
        # Later targets in this module check only their attribute (KernelSpec.__init__).
        if len(_VALID_MODULES) >= _CACHE_SIZE:
            _VALID_MODULES.clear()
        _VALID_MODULES.add(value.partition(":")[0])
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
#: The module parts of targets that passed ``_TARGET_RE`` (each a valid dotted path).
_VALID_MODULES: set[str] = set()
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


class _Meta:
    """Every field of a spec but its op, target and origin: what the specs of one backend,
    registered the same way, have in common. Validated once and shared (:func:`_shared_meta`),
    it keeps a spec at four slots; it is never changed after it is built."""

    __slots__ = (
        "backend",
        "variant",
        "requires",
        "dtypes",
        "when",
        "packages",
        "traits",
        "priority",
        "reference",
        "description",
        "slot",
        "values",
    )
    backend: str
    variant: str
    requires: frozenset[Requirement]
    dtypes: frozenset[str]
    when: Target | None
    packages: frozenset[str]
    traits: frozenset[str]
    priority: int
    reference: bool
    description: str
    #: ``(backend, variant)``, one tuple per pair: the spec's key within its op.
    slot: tuple[str, str]
    #: The fields above as one tuple, what equality and hashing of specs compare.
    values: tuple[Any, ...]

    def __init__(self, values: tuple[Any, ...]) -> None:
        self.values = values
        (
            self.backend,
            self.variant,
            self.requires,
            self.dtypes,
            self.when,
            self.packages,
            self.traits,
            self.priority,
            self.reference,
            self.description,
        ) = values
        pair = (self.backend, self.variant)
        try:
            self.slot = _SLOTS.setdefault(pair, pair)
        except TypeError:  # an unhashable value given to replace(): no registry key
            self.slot = pair


_META_FIELDS = _Meta.__slots__[:-2]
#: The fields a spec stores itself (in ``_op``, ``_target``, ``_origin``).
_OWN_FIELDS = ("op", "target", "origin")
#: The one (backend, variant) pair of each key, so that pairs compare by identity. Never
#: emptied (that would make equal pairs different objects): it grows with the distinct
#: keys a process builds specs for, which its inventory holds anyway.
_SLOTS: dict[tuple[str, str], tuple[str, str]] = {}
#: Validated metas by the arguments they were built from (``requires`` by identity: the
#: entry keeps that tuple or frozenset alive, so no other object can have its id).
_METAS: dict[tuple[Any, ...], tuple[_Meta, object]] = {}
#: Validated metas by value: equal ones built from different arguments are one object.
_SHARED_METAS: dict[tuple[Any, ...], _Meta] = {}


def _shared_meta(values: tuple[Any, ...]) -> _Meta:
    """The one meta of these field values (checked or not: an unchecked value is never
    equal to a checked one, except 1 and True, which are therefore never shared). A ``when``
    predicate is shared only with itself: equal is not enough for an object that may
    change or be compared by identity."""
    if type(values[7]) is not int or type(values[8]) is not bool:
        return _Meta(values)
    try:
        meta = _SHARED_METAS.get(values)
    except TypeError:  # an unhashable `when`: compared by value elsewhere, never shared
        return _Meta(values)
    if meta is None:
        if len(_SHARED_METAS) >= _CACHE_SIZE:
            _SHARED_METAS.clear()
        meta = _SHARED_METAS[values] = _Meta(values)
    elif meta.when is not values[4] and type(values[4]) is not str:
        return _Meta(values)  # an equal predicate object is still another predicate
    return meta


def backend_slot(backend: str, variant: str) -> tuple[str, str]:
    """The pair ``(backend, variant)`` as every spec of that key holds it (in its shared
    fields): the same object, so a lookup compares pointers. A pair no spec has is new."""
    pair = (backend, variant)
    return _SLOTS.get(pair, pair)


def _checked_meta(
    backend: object,
    target: object,
    variant: object,
    requires: object,
    dtypes: object,
    when: object,
    packages: object,
    traits: object,
    priority: object,
    reference: object,
    description: object,
) -> _Meta:
    """Validate every field but ``op`` and ``origin``, in the order the parameters are
    documented (so the first wrong one is named), and return their shared meta."""
    _valid_name(backend, "backend")
    check_variant(variant)
    _check_target(target, "target")
    requires_ = _EMPTY if requires is _NO_ITEMS else _frozen_requires(requires)
    dtypes_ = _EMPTY if dtypes is _NO_ITEMS else _frozen_names(dtypes, "dtypes", normalize_dtype)
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
    if not isinstance(description, str):
        raise InvalidSpecError("description", description, "expected a string")
    return _shared_meta(
        (
            backend,
            variant,
            requires_,
            dtypes_,
            when,
            packages_,
            traits_,
            priority,
            reference,
            description,
        )
    )


def _remember_meta(key: tuple[Any, ...], requires: object, meta: _Meta) -> None:
    """Let later specs built from the same arguments skip validation (``key`` as built in
    :meth:`KernelSpec.__init__`)."""
    if type(requires) not in _IMMUTABLE:  # a list may change: its id says nothing
        return
    if len(_METAS) >= _CACHE_SIZE:
        _METAS.clear()
    try:
        _METAS[key] = (meta, requires)
    except TypeError:  # an unhashable argument (a list of dtypes, say): checked per spec
        return


class _SpecFields:
    """The storage of :class:`KernelSpec`: four slots, the rest shared in ``_meta``.

    Four slots keep a spec as small as a four-field C struct (64 bytes); the fields specs
    have in common (backend, requirements, priority, ...) live once in a :class:`_Meta`.
    The slots are private and plainly assignable (a spec is filled at the cost of four
    stores); the public fields are read-only properties over them.
    """

    __slots__ = ("_op", "_target", "_origin", "_meta")


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

    __slots__ = ()  # the storage is _SpecFields'
    # Frozen's refusal is per field (the properties below): a Python-level __setattr__
    # would cost a call per store while a spec is built.
    __setattr__ = object.__setattr__  # type: ignore[assignment]
    __delattr__ = object.__delattr__

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
    _op: str
    _target: Target
    _origin: Origin | None
    _meta: _Meta

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
        # Registering 100,000 specs has a budget of one second, so the common case (an op
        # seen last, fields built the same way before) costs a few lookups, not validation.
        global _last_op
        if op is not _last_op:
            if type(op) is not str or OP_ID_RE.fullmatch(op) is None:
                check_op_id(op, "op")
            _last_op = op  # specs of one op are usually built one after the other
        key = (
            backend,
            variant,
            id(requires),
            dtypes,
            when,
            packages,
            traits,
            priority,
            reference,
            description,
        )
        try:
            meta: _Meta | None = _METAS[key][0]
        except (KeyError, TypeError):
            meta = None
        # An equal key may hold 1.0 for 1 or 1 for True: the types are checked here. It may
        # also hold an equal but different `when` object (a predicate comparing by value),
        # and a spec must keep its own predicate.
        if (
            meta is None
            or type(priority) is not int
            or type(reference) is not bool
            or (when is not None and meta.when is not when and type(when) is not str)
        ):
            meta = _checked_meta(
                backend,
                target,
                variant,
                requires,
                dtypes,
                when,
                packages,
                traits,
                priority,
                reference,
                description,
            )
            _remember_meta(key, requires, meta)
        if type(target) is str:
            module, _, attr = target.partition(":")
            if module not in _VALID_MODULES or not (attr.isascii() and attr.isidentifier()):
                _check_target(target, "target")
        elif not callable(target):
            _check_target(target, "target")
        if origin is not None and type(origin) is not Origin:
            raise InvalidSpecError("origin", origin, "expected an Origin or None")
        self._op = op
        self._target = target
        self._meta = meta
        self._origin = origin

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A subclass's own public slots are fields after KernelSpec's, compared unless
        # hidden, and refuse assignment like every field.
        super().__init_subclass__(**kwargs)
        hidden = {"origin", *cls.__dict__.get("_hidden", ())}
        cls._fields = KernelSpec._fields + cls._fields
        cls._compare = cls._repr = tuple(name for name in cls._fields if name not in hidden)
        if "__setattr__" not in cls.__dict__:
            cls.__setattr__ = _set_private  # type: ignore[method-assign,assignment]

    @property
    def key(self) -> tuple[str, str, str]:
        """The registry key ``(op, backend, variant)``."""
        return (self._op, *self._meta.slot)

    @property
    def label(self) -> str:
        """``backend`` or ``backend/variant``."""
        return label(*self._meta.slot)

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
        if type(self) is not KernelSpec:  # a subclass's own fields are copied too
            return cast(KernelSpec, self.replace(origin=origin))
        clone = object.__new__(KernelSpec)
        clone._op = self._op
        clone._target = self._target
        clone._meta = self._meta
        clone._origin = origin
        return clone

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` applied (fields are not re-validated)."""
        shared = {name: changes.pop(name) for name in _META_FIELDS if name in changes}
        stored = {"_" + name: changes.pop(name) for name in _OWN_FIELDS if name in changes}
        clone = super().replace(**stored, **changes)
        if shared:
            meta = self._meta
            values = tuple(shared.pop(name, getattr(meta, name)) for name in _META_FIELDS)
            clone._meta = _shared_meta(values)
        return clone

    def _key(self) -> tuple[Any, ...]:
        # Equality and hashing: what _compare names, read as three values (every field
        # but origin); reading them one property at a time costs twelve calls per side.
        key = (self._op, self._target, self._meta.values)
        if type(self) is KernelSpec:
            return key
        compare, base = self._compare, KernelSpec._compare
        if compare[: len(base)] != base:  # a subclass hiding one of KernelSpec's fields
            return super()._key()
        return (*key, *(getattr(self, name) for name in compare[len(base) :]))

    def __reduce__(self) -> tuple[Any, ...]:
        values = {name: getattr(self, name) for name in KernelSpec._fields}
        # A subclass's own slots follow the storage in _slots.
        values.update((name, getattr(self, name)) for name in self._slots[len(KernelSpec._slots) :])
        return (_unpickle, (type(self), values))

    def sort_key(self) -> tuple[int, str, str]:
        """Candidates are listed by priority (highest first), then backend and variant."""
        meta = self._meta
        return (-meta.priority, meta.backend, meta.variant)

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


def _set_private(spec: KernelSpec, name: str, value: Any) -> None:
    """``__setattr__`` of KernelSpec's subclasses: their own public slots are fields too."""
    if name in type(spec)._fields:
        Frozen.__setattr__(spec, name, value)
    object.__setattr__(spec, name, value)


def _field(name: str, storage: str) -> property:
    """The read-only public field ``name``, read from ``storage`` (a C-level getter)."""

    def refuse_set(spec: KernelSpec, value: object) -> None:
        Frozen.__setattr__(spec, name, value)

    def refuse_delete(spec: KernelSpec) -> None:
        Frozen.__delattr__(spec, name)

    return property(attrgetter(storage), refuse_set, refuse_delete)


# The public fields, in their documented order.
KernelSpec._fields = ("op", "backend", "target", "variant", *_META_FIELDS[2:], "origin")
KernelSpec._compare = KernelSpec._repr = KernelSpec._fields[:-1]
for _name in KernelSpec._fields:
    _storage = "_" + _name if _name in _OWN_FIELDS else "_meta." + _name
    setattr(KernelSpec, _name, _field(_name, _storage))


def _unpickle(cls: type[KernelSpec], values: dict[str, Any]) -> KernelSpec:
    """A spec pickled by :meth:`KernelSpec.__reduce__`: its fields were valid when pickled."""
    spec = object.__new__(cls)
    spec._op = values.pop("op")
    spec._target = values.pop("target")
    spec._origin = values.pop("origin")
    spec._meta = _shared_meta(tuple(values.pop(name) for name in _META_FIELDS))
    for name, value in values.items():  # a subclass's own fields
        object.__setattr__(spec, name, value)
    return spec

"""A small base for immutable value objects: slots, equality and hashing over the fields,
``replace``, pickling."""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

_F = TypeVar("_F", bound="Frozen")


class Frozen:
    """Immutable, comparing and hashing by the fields in ``_compare`` (default: every slot).
    Subclasses declare ``__slots__`` and set their fields with ``self._set(name, value)``."""

    __slots__ = ()
    _fields: ClassVar[tuple[str, ...]] = ()
    _slots: ClassVar[tuple[str, ...]] = ()
    _compare: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__slots__", ())
        cls._slots = (*cls._slots, *own)
        if "_fields" not in cls.__dict__:  # a class may list its fields (KernelSpec does)
            cls._fields = (*cls._fields, *(s for s in own if not s.startswith("_")))
        hidden = {name for klass in cls.__mro__ for name in klass.__dict__.get("_hidden", ())}
        cls._compare = tuple(f for f in cls._fields if f not in hidden)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"cannot assign to field {name!r} of a frozen {type(self).__name__}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r} of a frozen {type(self).__name__}")

    def _key(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._compare)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        args = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._compare)
        return f"{type(self).__name__}({args})"

    def __copy__(self) -> Frozen:
        return self

    def __deepcopy__(self, _memo: dict[int, Any]) -> Frozen:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), {name: getattr(self, name) for name in self._slots}))

    def replace(self: _F, **changes: Any) -> _F:
        """A copy with ``changes`` applied (fields are not re-validated)."""
        values = {name: getattr(self, name) for name in self._slots}
        if not changes.keys() <= values.keys():
            raise TypeError(
                f"{type(self).__name__} has no fields {sorted(changes.keys() - values.keys())}"
            )
        values.update(changes)
        return _rebuild(type(self), values)


def _rebuild(cls: type[_F], values: dict[str, Any]) -> _F:
    obj = object.__new__(cls)
    for name, value in values.items():
        object.__setattr__(obj, name, value)
    if "_hash" in cls._slots:  # a cached hash holds for these fields, in this process only
        object.__setattr__(obj, "_hash", hash(obj._key()))
    return obj

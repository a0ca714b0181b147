"""The :mod:`typing` names kernreg's core modules use, without importing :mod:`typing`.

``import typing`` loads ``re`` and ``enum`` with it: about 6 ms, close to a third of the
budget of ``import kernreg`` (docs/design.md, "Budgets"). Type checkers see the real
names. When kernreg runs, every annotation is a string that is never evaluated
(``from __future__ import annotations``), so only what runs needs a stand-in: protocols
and generic bases are plain classes, ``cast`` returns its value, and subscripting
``Literal`` gives ``str``.

Annotations are evaluated only by introspection (``typing.get_type_hints``, which has
imported :mod:`typing` by then), so the stand-ins evaluate to something valid there:
``Any`` is ``object``, ``ClassVar[X]`` is typing's own, a ``TypeVar`` is erased to
``object`` and a ``ParamSpec`` to ``...`` (so ``Callable[P, R]`` reads
``Callable[..., object]``).

Code that wants the real objects (``typing.get_type_hints`` on kernreg's functions,
``isinstance`` against a protocol) imports :mod:`typing` and kernreg's outer layers, which
use it directly.
"""

from __future__ import annotations

TYPE_CHECKING = False

if TYPE_CHECKING:
    from typing import Any as Any
    from typing import ClassVar as ClassVar
    from typing import Generic as Generic
    from typing import Literal as Literal
    from typing import ParamSpec as ParamSpec
    from typing import Protocol as Protocol
    from typing import TypeVar as TypeVar
    from typing import cast as cast
else:
    Any = object

    class _ClassVarForm:
        """``ClassVar[X]``, built by :mod:`typing` when an annotation is evaluated."""

        __slots__ = ()

        def __getitem__(self, item):
            import typing

            return typing.ClassVar[item]

    ClassVar = _ClassVarForm()

    class _Generic:
        """A base class that may be subscripted (``Generic[P, R]``): the class itself."""

        __slots__ = ()

        def __class_getitem__(cls, params):
            return cls

    class Protocol(_Generic):
        """What a protocol is at run time: a plain base class (not for ``isinstance``)."""

        __slots__ = ()

    class Generic(_Generic):
        __slots__ = ()

    class _LiteralForm:
        def __getitem__(self, values):
            return str

    Literal = _LiteralForm()

    def TypeVar(name, *constraints, **options):  # noqa: N802 (typing's name)
        return object

    def ParamSpec(name, **options):  # noqa: N802 (typing's name)
        return ...

    def cast(typ, value):
        return value


__all__ = [
    "TYPE_CHECKING",
    "Any",
    "ClassVar",
    "Generic",
    "Literal",
    "ParamSpec",
    "Protocol",
    "TypeVar",
    "cast",
]

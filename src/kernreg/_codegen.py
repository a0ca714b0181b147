"""Functions generated with a reference's exact signature, the way ``dataclasses``
generates ``__init__``: an op object costs one Python frame and no ``*args`` packing
(docs/design.md, "What the hot path costs")."""

from __future__ import annotations

import inspect
import keyword
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kernreg.errors import InvalidSpecError

__all__ = ["Signature"]

#: The prefix of every name generated code reads; reference parameters may not use it.
PREFIX = "_kr_"


class Signature:
    """A function's parameters as source text: how to declare them and how to forward them."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.inspected = sig = inspect.signature(func)
        self.defaults: dict[str, Any] = {}
        self.names: list[str] = []
        self.kinds: dict[str, str] = {}
        params: list[str] = []
        forward: list[str] = []
        previous = ""
        for param in sig.parameters.values():
            name, kind = param.name, param.kind.name
            if name.startswith(PREFIX) or keyword.iskeyword(name):
                raise InvalidSpecError("reference", func, f"parameter name {name!r} is reserved")
            self.names.append(name)
            self.kinds[name] = kind
            if previous == "POSITIONAL_ONLY" and kind != "POSITIONAL_ONLY":
                params.append("/")
            if kind == "KEYWORD_ONLY" and previous not in ("KEYWORD_ONLY", "VAR_POSITIONAL"):
                params.append("*")
            text = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}.get(kind, "") + name
            forward.append(f"{name}={name}" if kind == "KEYWORD_ONLY" else text)
            if param.default is not param.empty:
                self.defaults[f"{PREFIX}d_{name}"] = param.default
                text += f"={PREFIX}d_{name}"
            params.append(text)
            previous = kind
        if previous == "POSITIONAL_ONLY":
            params.append("/")
        self.params = ", ".join(params)
        self.forward = ", ".join(forward)

    def factory(
        self, name: str, body: str, cells: Iterable[str]
    ) -> Callable[..., Callable[..., Any]]:
        """A maker of ``def name(<params>): <body>``: called with a value for each name in
        ``cells``, it returns a new function whose body reads them as ``$name`` (closure
        variables). Compiling costs ~50 µs; a function, ~1 µs."""
        if keyword.iskeyword(name) or not name.isidentifier():  # op ids: ``bitwise.and``
            name += "_"
        inner = "".join(f"        {line}\n" for line in body.replace("$", PREFIX).splitlines())
        source = (
            f"def {PREFIX}factory({', '.join([*(PREFIX + c for c in cells), *self.defaults])}):\n"
            f"    def {name}({self.params}):\n{inner}"
            f"    return {name}\n"
        )
        scope: dict[str, Any] = {}
        exec(compile(source, f"<kernreg {name}>", "exec"), {}, scope)
        make = scope[f"{PREFIX}factory"]
        return lambda **values: make(**{PREFIX + k: v for k, v in values.items()}, **self.defaults)

    def forwarded(
        self, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A call's arguments as the generated function passes them on: by position up to
        the keyword-only ones, defaults filled in (``TypeError`` where they do not bind)."""
        bound = self.inspected.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.args, bound.kwargs

    def value(self, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """The value parameter ``name`` takes in a call, as Python would bind it (``*args``:
        its first value)."""
        kind = self.kinds[name]
        # A positional-only name in kwargs belongs to **kwargs, not to the parameter.
        if kind not in ("POSITIONAL_ONLY", "VAR_POSITIONAL") and name in kwargs:
            return kwargs[name]
        if kind != "KEYWORD_ONLY":
            index = self.names.index(name)
            if index < len(args):
                return args[index]
        return self.defaults.get(f"{PREFIX}d_{name}")

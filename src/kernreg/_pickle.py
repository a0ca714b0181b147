"""Pickling op objects by reference: pickle stores ``kernreg.dispatch.op_objects.<key>``,
the op id and the options that made the op object, and unpickling returns the op object
made with them in that process (made then if needed)."""

from __future__ import annotations

import importlib
import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["OpObjects", "keep_op", "kept_op", "pickle_key"]


class OpObjects:
    """The op objects of the process-wide registry by pickle key, which pickle reads as
    attributes: every public attribute is an op object (an op id may begin with any word),
    made by ``make(op_id, like=..., strict=..., autotune=..., dispatch_args=...)`` if missing."""

    def __init__(self, module: str, make: Callable[..., Any]) -> None:
        self.__module__ = module  # where pickle finds this object itself: module.op_objects
        self._make = make
        self._made: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()

    def __getattr__(self, name: str) -> Any:
        """The op object named ``name``: a key, or an op object's name as people read it,
        ``demo.scale (2 implementations: ...)|like=...``. Pickle reads such a name one
        dot at a time, so a part before the summary gives a stand-in for what follows."""
        if name.startswith("__"):
            raise AttributeError(name)
        if "/" not in name and "|" not in name and " (" not in name:
            return _NamePart(self, name)
        op_id, summary, rest = name.partition(" (")
        # Drop the part of the name for people (the implementations), not for pickle.
        key = op_id.replace(".", "/") + (re.sub(r" \([^)]*\)", "", f" ({rest}") if summary else "")
        try:
            return self._unpickle(key)
        except (KeyError, ValueError, ImportError) as exc:
            raise AttributeError(f"no op object for {key!r}: {exc}") from exc

    def _unpickle(self, key: str) -> Any:
        found = self._made.get(key)
        if found is not None:
            return found
        op_id, *fields = key.replace("/", ".").split("|")
        options = dict(field.partition("=")[::2] for field in fields)
        like: Any = None
        if "like" in options:
            module_name, _, qualname = options["like"].partition(":")
            like = importlib.import_module(module_name)  # may define the op object itself
            found = self._made.get(key)
            if found is not None:
                return found
            for part in qualname.split("."):
                like = getattr(like, part)
            like = getattr(like, "reference", like)  # an op object: its reference
        flags = {k: bool(int(options[k])) for k in ("strict", "autotune") if k in options}
        args = options["args"].split(",") if "args" in options else None
        return self._make(op_id, like=like, dispatch_args=args, **flags)

    def __reduce__(self) -> str:
        return "op_objects"


def pickle_key(
    op_id: str,
    strict: bool | None,
    autotune: bool | None,
    dispatch_args: Sequence[str] | None,
    like: Callable[..., Any] | None,
) -> str | None:
    """The name an op object pickles under: its op id and options, dots written as ``/``
    (pickle splits names at dots); ``None`` when ``like`` is a local function."""
    flags = (("strict", strict), ("autotune", autotune))
    fields = [op_id, *(f"{name}={int(value)}" for name, value in flags if value is not None)]
    if dispatch_args is not None:
        fields.append("args=" + ",".join(dispatch_args))
    if like is not None:
        module = getattr(like, "__module__", None)
        qualname = getattr(like, "__qualname__", None)
        if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
            return None
        fields.append(f"like={module}:{qualname}")
    return "|".join(fields).replace(".", "/")


def kept_op(objects: OpObjects, key: str) -> Any:
    """The op object kept under ``key``, or ``None``."""
    return objects._made.get(key)


def keep_op(objects: OpObjects, key: str, made: Any, *, newest: bool) -> Any:
    """Keep ``made`` under ``key`` if ``newest`` (a reloaded module's definition) or none
    is kept there yet; return the one kept."""
    made.__module__ = objects.__module__
    if newest:
        objects._made[key] = made
    return objects._made.setdefault(key, made)


@dataclass
class _NamePart:
    """What pickle reads of an op object's name up to a dot of its op id."""

    _objects: OpObjects
    _prefix: str

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._objects, f"{self._prefix}.{name}")

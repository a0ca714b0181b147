"""Run a function once a module has finished importing (without importing it)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["after_import"]


class _After(importlib.abc.MetaPathFinder):
    """A one-shot finder: wraps the real loader of ``name`` to call ``then`` after it."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader: Any = None if spec is None else spec.loader
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module
        then = self.then

        def run_then_hook(module: ModuleType) -> None:
            exec_module(module)
            then()

        loader.exec_module = run_then_hook
        return spec


def after_import(name: str, then: Callable[[], None]) -> None:
    """Call ``then()`` right after the top-level module ``name`` is first imported."""
    sys.meta_path.insert(0, _After(name, then))

"""The one at-fork handler: a forked child gets every core :class:`Lock` fresh (one another
thread held at ``os.fork`` would stay held forever) and notes a torch import the fork cut."""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any

__all__ = ["Lock", "torch_import_cut"]


class Lock:
    """A re-entrant lock that a forked child gets fresh (unlocked)."""

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        _locks.add(self)

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()


_locks: weakref.WeakSet[Lock] = weakref.WeakSet()
_torch_cut = False


def torch_import_cut() -> bool:
    """Whether this process was forked while another thread was importing torch."""
    return _torch_cut


def _after_fork_in_child() -> None:
    global _torch_cut
    for lock in list(_locks):
        lock._lock = threading.RLock()
    torch = sys.modules.get("torch")
    _torch_cut = bool(getattr(getattr(torch, "__spec__", None), "_initializing", False))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

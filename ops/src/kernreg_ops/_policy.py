"""The opt-in for ``torch_compile`` implementations.

``torch.compile`` costs seconds per new shape and dtype on the first call, so the op
pack never selects its compiled implementations unless the program asks for them.
They carry the ``when`` predicate :func:`compile_allowed`, which is false until
:func:`set_compile_allowed` (or the :func:`allow_compile` block) turns it on.
The predicate takes no arguments: it reads process state, not the call, so kernreg
evaluates it when it makes a decision, never per call (a dispatched call costs the same
whether or not the switch exists). Changing the switch calls
:func:`kernreg.registry.process_state_changed`, so every cached decision (op objects, kernelized
models' sites) is made again on its next use. While compilation is not allowed,
``kernreg explain`` rejects these implementations with "when predicate is false
(process state, checked when deciding)".
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

__all__ = ["allow_compile", "compile_allowed", "set_compile_allowed"]

_lock = threading.Lock()
_allowed = False


def _reset_lock_in_child() -> None:
    # A child forked while another thread held the lock would wait for it forever.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_lock_in_child)


def compile_allowed() -> bool:
    """The ``when`` predicate of every ``torch_compile`` implementation (process state)."""
    return _allowed


def _changed() -> None:
    from kernreg.registry import process_state_changed

    process_state_changed()


def set_compile_allowed(allowed: bool) -> None:
    """Let kernreg select ``torch_compile`` implementations (process-wide)."""
    global _allowed
    with _lock:
        changed, _allowed = _allowed != bool(allowed), bool(allowed)
    if changed:
        _changed()


@contextlib.contextmanager
def allow_compile(allowed: bool = True) -> Iterator[None]:
    """Allow (or forbid) ``torch_compile`` implementations within the block."""
    global _allowed
    with _lock:
        previous, _allowed = _allowed, bool(allowed)
    if previous != _allowed:
        _changed()
    try:
        yield
    finally:
        with _lock:
            changed, _allowed = _allowed != previous, previous
        if changed:
            _changed()

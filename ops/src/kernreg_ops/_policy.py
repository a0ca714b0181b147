"""The opt-in for ``torch_compile`` implementations.

``torch.compile`` costs seconds per new shape and dtype on the first call, so the op
pack never selects its compiled implementations unless the program asks for them.
They carry the ``when`` predicate :func:`compile_allowed`, which is false until
:func:`set_compile_allowed` (or the :func:`allow_compile` block) turns it on.
``kernreg explain`` lists them as *conditional* ("eligible if its when predicate
holds"); a decision for a call (``op.explain_call(...)``) says "when predicate is false
for this call" while compilation is not allowed. Where a faster implementation is
chosen (``aten``, ``triton``), the predicate is not even evaluated.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["allow_compile", "compile_allowed", "set_compile_allowed"]

_lock = threading.Lock()
_allowed = False


def compile_allowed(*args: object, **kwargs: object) -> bool:
    """The ``when`` predicate of every ``torch_compile`` implementation (ignores the call)."""
    return _allowed


def set_compile_allowed(allowed: bool) -> None:
    """Let kernreg select ``torch_compile`` implementations (process-wide)."""
    global _allowed
    with _lock:
        _allowed = bool(allowed)


@contextlib.contextmanager
def allow_compile(allowed: bool = True) -> Iterator[None]:
    """Allow (or forbid) ``torch_compile`` implementations within the block."""
    global _allowed
    with _lock:
        previous, _allowed = _allowed, bool(allowed)
    try:
        yield
    finally:
        with _lock:
            _allowed = previous

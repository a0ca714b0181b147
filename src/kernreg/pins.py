"""Scoped pins: :func:`use_backend` blocks, context-local, and the process-wide number
naming the set of pins open (op objects and compiled graphs read it)."""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from collections.abc import Callable, Iterator

from kernreg._names import check_name, check_op_glob, check_variant
from kernreg.config import ConfigWarning, Pin

__all__ = [
    "current_scoped_pin",
    "on_scoped_pins_token",
    "on_use_backend",
    "scoped_pins_active",
    "scoped_pins_token",
    "use_backend",
]

_scoped_pins: contextvars.ContextVar[tuple[Pin, ...]] = contextvars.ContextVar(
    "kernreg_scoped_pins", default=()
)
_scoped_lock = threading.Lock()
#: How many use_backend blocks are open in the whole process: a pre-filter only, so that
#: contexts without a pin never read the context variable.
_scoped_active = 0
#: ``[0]`` while no use_backend block is open anywhere, else a number naming the set of
#: pins open in the whole process. Op objects read it on each call (one list index: the
#: only cost a block open elsewhere adds), and torch.compile guards on it: a graph is
#: traced again when the open pins change, and a set seen before gets its number again,
#: so opening and closing blocks never runs a compiled function into the recompile limit.
scoped_pins_token: list[int] = [0]
_open_pins: dict[Pin, int] = {}
_token_listeners: list[Callable[[int], None]] = []


#: Says why a use_backend pattern would change nothing (``None``: it names an op);
#: installed by :mod:`kernreg.registry`, which knows the inventories.
_pattern_checks: list[Callable[[str], str | None]] = []
#: The ids of the open use_backend pins that some decision found for its op: such a block
#: pinned something even if the op is gone when it ends (a ``registry.scoped()`` inside it).
_used_pins: set[int] = set()


def on_use_backend(check: Callable[[str], str | None]) -> None:
    """Have ``check(pattern)`` vet each :func:`use_backend` pattern: what it returns is
    warned about (a :class:`~kernreg.config.ConfigWarning`) when the block ends, unless
    it ends with an exception."""
    _pattern_checks.append(check)


def on_scoped_pins_token(listener: Callable[[int], None]) -> None:
    """Call ``listener(token)`` (lock held) whenever :data:`scoped_pins_token` changes."""
    _token_listeners.append(listener)


_pin_set_numbers: dict[frozenset[Pin], int] = {frozenset(): 0}


def scoped_pins_active() -> bool:
    """Whether any thread or task is inside a :func:`use_backend` block right now (a cheap
    pre-filter: :func:`current_scoped_pin` says whether one applies in this context)."""
    return _scoped_active > 0


def _blocks_changed(pin: Pin, delta: int) -> None:
    global _scoped_active
    with _scoped_lock:
        _scoped_active += delta
        count = _open_pins.get(pin, 0) + delta
        if count > 0:
            _open_pins[pin] = count
        else:
            _open_pins.pop(pin, None)
        key = frozenset(_open_pins)
        number = _pin_set_numbers.get(key)
        if number is None:
            number = _pin_set_numbers[key] = len(_pin_set_numbers)
        scoped_pins_token[0] = number
        for listener in _token_listeners:
            listener(number)


@contextlib.contextmanager
def use_backend(pattern: str, backend: str, variant: str | None = None) -> Iterator[Pin]:
    """Pin ops matching ``pattern`` (an op id or glob) to ``backend`` within the block.

    The pin is context-local: other threads and async tasks are not affected. Inside
    the block the pin wins over configured pins and is strict like them.
    """
    check_op_glob(pattern, "use_backend pattern")
    check_name(backend, "backend")
    if variant is not None:
        check_variant(variant)
    pin = Pin(pattern, backend, variant, source="use_backend")
    token = _scoped_pins.set((pin, *_scoped_pins.get()))
    _blocks_changed(pin, +1)
    used = False
    try:
        yield pin
    finally:
        try:
            _scoped_pins.reset(token)
        except (ValueError, RuntimeError):
            # Closed in another context than the one it opened in (an async generator
            # finalised by another task): drop the pin from this one; the opening context
            # keeps its own value, which ends with it.
            _scoped_pins.set(tuple(p for p in _scoped_pins.get() if p is not pin))
        finally:
            _blocks_changed(pin, -1)
            used = id(pin) in _used_pins
            _used_pins.discard(id(pin))  # the id is free for another object from here on
    if used:
        return
    # Checked when the block ends without an error (ops may be registered inside it).
    for check in _pattern_checks:
        why = check(pattern)
        if why is not None:
            # stacklevel 3: this generator, contextlib's __exit__, the `with` statement.
            warnings.warn(
                f"use_backend({pattern!r}, {backend!r}) pinned nothing: {why}",
                ConfigWarning,
                stacklevel=3,
            )


def current_scoped_pin(op: str) -> Pin | None:
    """The innermost :func:`use_backend` pin of this context that matches ``op``."""
    for pin in _scoped_pins.get():
        if pin.matches(op):
            _used_pins.add(id(pin))
            return pin
    return None


def _fresh_lock_in_child() -> None:
    """After ``os.fork``: a lock another thread held at the fork stays held forever in the
    child, so it is replaced by a fresh one."""
    global _scoped_lock
    _scoped_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_in_child)

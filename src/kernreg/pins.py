"""Scoped pins: :func:`use_backend` blocks, held in a context variable.

Each context decides by its own pins alone: a thread, an async task, or a context copied
inside a block (``asyncio.create_task``, ``asyncio.to_thread``,
``contextvars.copy_context``) sees the pins its context holds, whatever other threads
have open. A block's end removes its own pin from the context it ends in, so blocks that
end out of order (two generators consumed interleaved) leave nothing behind.

``torch.compile`` cannot guard on a context variable, so a process-wide key names the
set of blocks open: a compiled graph guards on it and is traced again when it changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
import weakref
from collections.abc import Callable, Iterator

from kernreg._fork import Lock
from kernreg._names import check_name, check_op_glob, check_variant
from kernreg.config import ConfigWarning, Pin

__all__ = [
    "context_pins",
    "note_pin_used",
    "on_use_backend",
    "open_blocks",
    "pins_for",
    "use_backend",
]


class _Block:
    """One use_backend block's pin, as contexts hold it (alive while any context does)."""

    __slots__ = ("__weakref__", "ended", "pin")

    def __init__(self, pin: Pin) -> None:
        self.pin = pin
        #: Set when the block ended in another context than it opened in (an async
        #: generator finalised by another task): the opening context, which still holds
        #: the block, cannot be reached, so the pin ends everywhere.
        self.ended = False


_blocks: contextvars.ContextVar[tuple[_Block, ...]] = contextvars.ContextVar(
    "kernreg_pins", default=()
)

#: Whether this context holds any use_backend block (true: :func:`pins_for` says which
#: pins apply). The context variable's own ``get``: op objects call it on every call, so
#: no Python frame stands in front of it.
context_pins: Callable[[], tuple[_Block, ...]] = _blocks.get


class OpenBlocks:
    """The blocks open in the whole process, named for ``torch.compile``'s guards, and
    the pins some decision used (a block that pinned something says nothing at its end)."""

    def __init__(self) -> None:
        self.lock = Lock()
        self.open: dict[Pin, int] = {}  # open pin -> blocks open with it
        self.names: dict[frozenset[Pin], str] = {frozenset(): ""}
        #: Names the set of open pins: a string, as torch.compile never makes a string a
        #: dynamic input (an int that changes becomes one, and could not be guarded on).
        self.key = ""
        self.used: set[int] = set()  # ids of open pins that a decision applied

    def changed(self, pin: Pin, delta: int) -> None:
        with self.lock:
            count = self.open.get(pin, 0) + delta
            if count > 0:
                self.open[pin] = count
            else:
                self.open.pop(pin, None)
            # A set of open pins seen before gets its number again, so opening and closing
            # blocks never runs a compiled function into dynamo's recompile limit.
            self.key = self.names.setdefault(frozenset(self.open), f"pins{len(self.names)}")


#: The use_backend blocks open in this process (``open_blocks.key`` names their set).
open_blocks = OpenBlocks()


def note_pin_used(pin: Pin) -> None:
    """Record that a decision applied ``pin`` (its block pinned something)."""
    open_blocks.used.add(id(pin))


#: The pins of the blocks some context still holds, by the block's id: a block lives as
#: long as the contexts holding it (its own, and those copied inside it), and only ops a
#: live pin matches ask for this context's pins when called.
_live: dict[int, Pin] = {}
_liveness_listeners: list[Callable[[Pin], None]] = []


def on_pin_liveness(listener: Callable[[Pin], None]) -> None:
    """Call ``listener(pin)`` when a block opens and when no context holds it any more
    (:func:`live_pins` says what is live then)."""
    _liveness_listeners.append(listener)


def live_pins() -> list[Pin]:
    """The pins of every block that some context still holds."""
    return list(_live.values())


def _pin_gone(key: int) -> None:
    # A finaliser: the id is not reused before it returns (the block is freed after).
    pin = _live.pop(key)
    for listener in _liveness_listeners:
        listener(pin)


#: Says why a use_backend pattern would change nothing (``None``: it names an op);
#: installed by :mod:`kernreg.registry`, which knows the inventories.
_pattern_checks: list[Callable[[str], str | None]] = []


def on_use_backend(check: Callable[[str], str | None]) -> None:
    """Have ``check(pattern)`` vet each :func:`use_backend` pattern: what it returns is
    warned about (a :class:`~kernreg.config.ConfigWarning`) when the block ends, unless
    it ends with an exception."""
    _pattern_checks.append(check)


@contextlib.contextmanager
def use_backend(pattern: str, backend: str, variant: str | None = None) -> Iterator[Pin]:
    """Pin ops matching ``pattern`` (an op id or glob) to ``backend`` within the block.

    The pin is context-local: other threads and async tasks are not affected (a context
    copied inside the block keeps it). Inside the block the pin wins over configured pins
    and is strict like them. A glob pin does not apply to an op without that backend.
    """
    check_op_glob(pattern, "use_backend pattern")
    check_name(backend, "backend")
    if variant is not None:
        check_variant(variant)
    pin = Pin(pattern, backend, variant, source="use_backend")
    block = _Block(pin)
    _live[id(block)] = pin
    weakref.finalize(block, _pin_gone, id(block)).atexit = False  # nothing to do at exit
    for listener in _liveness_listeners:
        listener(pin)
    token = _blocks.set((block, *_blocks.get()))
    open_blocks.changed(pin, +1)
    try:
        yield pin
    finally:
        held = _blocks.get()
        try:
            _blocks.reset(token)  # only to learn whether this is the opening context
        except ValueError:
            block.ended = True
        # Remove this block, not restore the value from the block's start: blocks of two
        # generators consumed interleaved end out of order.
        _blocks.set(tuple(b for b in held if b is not block))
        open_blocks.changed(pin, -1)
        used = id(pin) in open_blocks.used
        open_blocks.used.discard(id(pin))  # the id is free for another object from here on
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


def pins_for(op: str) -> tuple[Pin, ...]:
    """This context's use_backend pins that match ``op``, innermost first."""
    return tuple(b.pin for b in _blocks.get() if not b.ended and b.pin.matches(op))

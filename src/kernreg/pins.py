"""Scoped pins: the blocks of :func:`kernreg.use_backend`, held in a context variable.

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
import weakref
from collections.abc import Callable, Iterator

from kernreg._fork import Lock
from kernreg._names import check_name, check_op_glob, check_variant
from kernreg.config import Pin

__all__ = [
    "context_pins",
    "live_pins",
    "note_pin_used",
    "on_pin_liveness",
    "open_blocks",
    "pin_block",
    "pins_for",
]


class _Block:
    """One block's pin, as contexts hold it (alive while any context does)."""

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

#: Whether this context holds any block (:func:`pins_for` says which pins apply): the
#: context variable's own ``get``, called by every lookup, so no Python frame stands in front.
context_pins: Callable[[], tuple[_Block, ...]] = _blocks.get


class OpenBlocks:
    """The blocks of the whole process: those open (named for ``torch.compile``'s guards),
    those some context still holds (live), and the pins some decision used."""

    def __init__(self) -> None:
        self.lock = Lock()
        self.open: dict[Pin, int] = {}  # open pin -> blocks open with it
        self.names: dict[frozenset[Pin], str] = {frozenset(): ""}
        #: Names the set of open pins: a string, as torch.compile never makes a string a
        #: dynamic input (an int that changes becomes one, and could not be guarded on).
        self.key = ""
        self.used: set[int] = set()  # ids of open pins that a decision applied
        #: The pins of blocks some context still holds, by the block's id: only op objects
        #: a live pin matches ask for the calling context's pins.
        self.live: dict[int, Pin] = {}
        self.listeners: list[Callable[[Pin], None]] = []

    def changed(self, pin: Pin, delta: int) -> None:
        with self.lock:
            count = self.open.get(pin, 0) + delta
            if count > 0:
                self.open[pin] = count
            else:
                self.open.pop(pin, None)
            # A set of open pins seen before gets its name again, so opening and closing
            # blocks never runs a compiled function into dynamo's recompile limit.
            self.key = self.names.setdefault(frozenset(self.open), f"pins{len(self.names)}")

    def gone(self, key: int) -> None:
        """A block no context holds any more (a finaliser: its id is not reused before)."""
        pin = self.live.pop(key)
        for listener in self.listeners:
            listener(pin)


#: The blocks of this process (``open_blocks.key`` names the set of those open).
open_blocks = OpenBlocks()


def note_pin_used(pin: Pin) -> None:
    """Record that a decision applied ``pin`` (its block pinned something)."""
    open_blocks.used.add(id(pin))


def on_pin_liveness(listener: Callable[[Pin], None]) -> None:
    """Call ``listener(pin)`` when a block opens and when no context holds it any more
    (:func:`live_pins` says what is live then)."""
    open_blocks.listeners.append(listener)


def live_pins() -> list[Pin]:
    """The pins of every block that some context still holds."""
    return list(open_blocks.live.values())


@contextlib.contextmanager
def pin_block(pattern: str, backend: str, variant: str | None = None) -> Iterator[Pin]:
    """Pin ops matching ``pattern`` to ``backend`` in this context while the block is open
    (what :func:`kernreg.use_backend` does; the pin's ``used`` note says at the end
    whether a decision applied it)."""
    check_op_glob(pattern, "use_backend pattern")
    check_name(backend, "backend")
    if variant is not None:
        check_variant(variant)
    pin = Pin(pattern, backend, variant, source="use_backend")
    block = _Block(pin)
    open_blocks.live[id(block)] = pin
    weakref.finalize(block, open_blocks.gone, id(block)).atexit = False
    for listener in open_blocks.listeners:
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


def pin_was_used(pin: Pin) -> bool:
    """Whether a decision applied ``pin``, forgetting it (its id may be reused after)."""
    used = id(pin) in open_blocks.used
    open_blocks.used.discard(id(pin))
    return used


def pins_for(op: str) -> tuple[Pin, ...]:
    """This context's use_backend pins that match ``op``, innermost first."""
    return tuple(b.pin for b in _blocks.get() if not b.ended and b.pin.matches(op))

"""Pins: the :class:`Pin` value (``KERNREG_PIN``, plans' site pins, ``use_backend``), and
the blocks of :func:`kernreg.use_backend` and :func:`compile_region`, held in a context
variable: each thread, task or copied context decides by the pins its context holds.
``torch.compile`` cannot guard on a context variable: it guards on ``open_blocks.key``."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from fnmatch import fnmatchcase
from typing import Any

from kernreg._fork import Lock
from kernreg._names import check_name, check_op_glob, check_variant, parse_label
from kernreg.errors import ConfigError, InvalidSpecError

__all__ = [
    "COMPILE_REGION",
    "Pin",
    "as_items",
    "compile_region",
    "context_pins",
    "note_pin_used",
    "on_pin_liveness",
    "open_blocks",
    "parse_pins",
    "parse_rule",
    "pin_block",
    "pins_for",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Pin:
    """``pattern=backend[/variant]``: ops matching ``pattern`` use that implementation.
    ``variant`` ``None`` leaves the variant open (the best eligible one of the backend).
    ``site`` (``pattern@site=backend``) is a module-path glob: the pin applies only to the
    layers of a model at those paths, when ``kernreg.torch.kernelize`` binds them."""

    pattern: str
    backend: str
    variant: str | None = None
    source: str = dataclasses.field(default="", compare=False, repr=False)
    site: str | None = None

    def matches(self, op: str) -> bool:
        return self.pattern == op or fnmatchcase(op, self.pattern)

    @property
    def exact(self) -> bool:
        return not any(ch in self.pattern for ch in "*?[")

    def __str__(self) -> str:
        target = self.backend if self.variant is None else f"{self.backend}/{self.variant}"
        where = "" if self.site is None else f"@{self.site}"
        return f"{self.pattern}{where}={target}"


def as_items(key: str, value: Any) -> list[str]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise ConfigError(key, value, "expected a comma-separated string or a list of strings")
    return [item.strip() for item in items if item.strip()]


def parse_rule(key: str, item: str, *, default_pattern: str | None) -> Pin:
    pattern, sep, target = item.partition("=")
    if not sep:
        if default_pattern is None:
            raise ConfigError(key, item, "expected 'op_or_glob=backend[/variant]'")
        pattern, target = default_pattern, item
    site: str | None = None
    if "@" in pattern and default_pattern is None:  # op@module.glob=backend: a site pin
        pattern, _, site = pattern.partition("@")
        site = site.strip()
        if not site:
            raise ConfigError(key, item, "expected 'op_or_glob@module_glob=backend[/variant]'")
    try:
        check_op_glob(pattern.strip(), key)
        backend, variant = parse_label(target, key)
    except InvalidSpecError as exc:
        raise ConfigError(key, item, str(exc)) from None
    return Pin(pattern.strip(), backend, variant, source=key, site=site)


def parse_pins(key: str, value: Any) -> tuple[Pin, ...]:
    if isinstance(value, dict):
        items = []
        for pattern, target in value.items():
            if not isinstance(target, str):
                raise ConfigError(
                    f"{key}.{pattern}", target, "expected 'backend' or 'backend/variant'"
                )
            items.append(f"{pattern}={target}")
    else:
        items = as_items(key, value)
    pins = tuple(parse_rule(key, item, default_pattern=None) for item in items)
    seen: dict[tuple[str, str | None], Pin] = {}
    for pin in pins:
        first = seen.setdefault((pin.pattern, pin.site), pin)
        if first != pin:
            name = pin.pattern if pin.site is None else f"{pin.pattern}@{pin.site}"
            raise ConfigError(key, value, f"'{name}' is pinned twice ({first}, {pin})")
    return pins


class _Block:
    """One block's pin, as contexts hold it (alive while any context does)."""

    __slots__ = ("__weakref__", "ended", "pin")

    def __init__(self, pin: Pin) -> None:
        self.pin = pin
        #: Ended in another context than it opened in (an async generator finalised by
        #: another task): the opening context still holds it, so the pin ends everywhere.
        self.ended = False


_blocks: contextvars.ContextVar[tuple[_Block, ...]] = contextvars.ContextVar(
    "kernreg_pins", default=()
)

#: This context's blocks, with no Python frame in front: every lookup calls it.
context_pins: Callable[[], tuple[_Block, ...]] = _blocks.get


class OpenBlocks:
    """The blocks of the whole process: those open (named for ``torch.compile``'s guards),
    those some context still holds (live, with listeners), and the pins decisions used."""

    def __init__(self) -> None:
        self.lock = Lock()
        self.open: dict[Pin, int] = {}  # open pin -> blocks open with it
        self.names: dict[frozenset[Pin], str] = {frozenset(): ""}
        #: Names the set of open pins: a string, as torch.compile never makes a string a
        #: dynamic input (an int that changes becomes one, and could not be guarded on).
        self.key = ""
        self.used: set[int] = set()  # ids of open pins that a decision applied
        #: The pins of blocks some context still holds, by the block's id.
        self.live: dict[int, Pin] = {}
        #: See :func:`on_pin_liveness`.
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
    """Call ``listener(pin)`` when a block opens and when no context holds it any more."""
    open_blocks.listeners.append(listener)


def pin_block(
    pattern: str, backend: str, variant: str | None = None
) -> contextlib.AbstractContextManager[Pin]:
    """Pin ops matching ``pattern`` to ``backend`` in this context while the block is open
    (what :func:`kernreg.use_backend` does)."""
    check_op_glob(pattern, "use_backend pattern")
    check_name(backend, "backend")
    if variant is not None:
        check_variant(variant)
    return _block(Pin(pattern, backend, variant, source="use_backend"))


class _CompileRegion(Pin):
    """What a compile-safe region holds in place of a pin: it matches every op, and
    decisions of its context accept only ``compile_safe`` implementations."""

    __slots__ = ()

    def matches(self, op: str) -> bool:
        return True

    def __str__(self) -> str:
        return "compile-safe region"


#: What every :func:`compile_region` block holds (one value, so caches keyed by it hold).
COMPILE_REGION: Pin = _CompileRegion("*", "compile_safe", source="compile_region")


def compile_region() -> contextlib.AbstractContextManager[Pin]:
    """While the block is open, this context's decisions choose among ``compile_safe``
    implementations (and a plain-torch reference): wrap an outer ``torch.compile`` in it."""
    return _block(COMPILE_REGION)


@contextlib.contextmanager
def _block(pin: Pin) -> Iterator[Pin]:
    """Hold ``pin`` in this context while the block is open."""
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

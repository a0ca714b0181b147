"""Conditional implementations on the command line: ``--conditional`` for ``parity`` and
``bench``, and the hint in their skip lines.

An implementation behind a ``when`` predicate (the op pack's opt-in ``torch_compile``
ones, for example) is skipped wherever its predicate is false for the generated call.
With the switch, the command runs with those predicates removed from the op's specs in a
scoped registry (undone at exit), so the implementations are checked or timed wherever
the rest of their conditions allow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import click

from kernreg.registry import KernelRegistry

__all__ = [
    "CONDITIONAL_SWITCH",
    "conditional_option",
    "conditional_skip_hint",
    "predicates_held",
]

F = TypeVar("F", bound=Callable[..., Any])

#: The switch of ``parity`` and ``bench`` that runs conditional implementations anyway.
CONDITIONAL_SWITCH = "--conditional"


def conditional_option(func: F) -> F:
    """``--conditional`` (alias ``--allow-compile``): run implementations behind a ``when``
    predicate as if it held (the op pack's opt-in ``torch_compile`` ones, for example)."""
    return click.option(
        CONDITIONAL_SWITCH,
        "--allow-compile",
        "conditional",
        is_flag=True,
        help="Also run the conditional implementations (those behind a `when` predicate, "
        "such as the opt-in torch_compile ones) as if their predicate held.",
    )(func)


def conditional_skip_hint(reason: str) -> str:
    """``reason`` for a skipped implementation, plus how to run it when a predicate is why."""
    if "when predicate" in reason:
        return f"{reason} ({CONDITIONAL_SWITCH} runs it anyway)"
    return reason


@contextlib.contextmanager
def predicates_held(registry: KernelRegistry, ops: Sequence[str]) -> Iterator[None]:
    """Within the block, ``registry`` holds the implementations of ``ops`` without their
    ``when`` predicates (so they are eligible wherever the rest allows); all undone at exit."""
    with registry.scoped():
        for op in ops:
            for spec in registry.get(op):
                if spec.when is not None:
                    registry.register(spec.replace(when=None), replace=True)
        yield

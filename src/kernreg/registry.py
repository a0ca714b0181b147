"""The registry: :class:`KernelRegistry` (the inventory of :mod:`kernreg.inventory` with
the decisions of :mod:`kernreg.resolver`), the process-wide instance, and the names
``from kernreg.registry import ...`` has always offered."""

from __future__ import annotations

from kernreg.inventory import (
    Override,
    process_state_changed,
    unmatched_pattern_hint,
)
from kernreg.inventory import (
    caller_origin as caller_origin,
)
from kernreg.inventory import (
    current_distribution as current_distribution,
)
from kernreg.inventory import (
    registration_journal as registration_journal,
)
from kernreg.pins import on_use_backend, use_backend
from kernreg.resolver import Resolver
from kernreg.resolver import chosen_or_raise as chosen_or_raise
from kernreg.resolver import use_plugin_loader as use_plugin_loader
from kernreg.selection import provide_default_registry
from kernreg.spec import KernelSpec

__all__ = [
    "KernelRegistry",
    "Override",
    "default_registry",
    "process_state_changed",
    "register_kernel",
    "use_backend",
]


class KernelRegistry(Resolver):
    """The inventory of implementations, keyed by ``(op, backend, variant)``, and the
    decisions made from it.

    Mutations are thread-safe and invalidate every cached decision. ``config`` and
    ``platform`` default to the environment (read once, at first use) and detection.
    """


# --- the process-wide registry -------------------------------------------------------------

registry = KernelRegistry()
registry.autoload_plugins = True


def default_registry() -> KernelRegistry:
    """The process-wide registry (``kernreg.registry``)."""
    return registry


def register_kernel(spec: KernelSpec, *, replace: bool = False) -> KernelSpec:
    """Register ``spec`` in the process-wide registry."""
    return registry.register(spec, replace=replace)


provide_default_registry(default_registry)
on_use_backend(unmatched_pattern_hint)

"""The public get_kernel and select_kernel: a warm lookup first, else the full dispatch path.

Serving code calls ``get_kernel(op)`` or ``get_kernel(op, backend)`` on every step, so
the common call (no argument but ``registry``, no ``use_backend`` block open) is one
read of the registry's warm entries; anything else, and every first call,
goes through :func:`kernreg.dispatch.get_kernel` (or ``select_kernel``), which decides,
checks the arguments and keeps the entry. The other arguments arrive as ``**options``
because a function with keyword-only defaults costs a third more to call; their names
and types are the dispatch functions' (``__wrapped__`` points there, for ``inspect``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kernreg import dispatch
from kernreg.pins import context_pins
from kernreg.registry import KernelRegistry

if TYPE_CHECKING:
    from kernreg.dispatch import PlatformLike
    from kernreg.spec import KernelSpec

__all__ = ["get_kernel", "select_kernel"]

# The module, not the package attribute of the same name (that is the registry itself):
# its ``registry`` is read on every call, so a replaced process-wide registry is seen.
_registry_module = sys.modules["kernreg.registry"]

if TYPE_CHECKING:

    def get_kernel(
        op: str,
        backend: str | None = None,
        *,
        variant: str | None = None,
        platform: PlatformLike = None,
        dtypes: Sequence[str] | None = None,
        traits: Sequence[str] = (),
        strict: bool | None = None,
        registry: KernelRegistry | None = None,
    ) -> Callable[..., Any]:
        """The chosen implementation itself (not a wrapper), imported once per decision key."""

    def select_kernel(
        op: str,
        backend: str | None = None,
        *,
        variant: str | None = None,
        platform: PlatformLike = None,
        dtypes: Sequence[str] | None = None,
        traits: Sequence[str] = (),
        strict: bool | None = None,
        registry: KernelRegistry | None = None,
    ) -> KernelSpec:
        """The spec that runs for ``op``, decided by the selection rules."""

else:

    def _warm(options: dict[str, Any]) -> Any:
        """The registry whose warm entries may answer a call with these options, or None."""
        if not options:
            return _registry_module.registry
        if len(options) == 1 and "registry" in options:
            registry = options["registry"]
            if registry is None:
                return _registry_module.registry
            if isinstance(registry, KernelRegistry):
                return registry
        return None

    def get_kernel(op, backend=None, **options):
        """The chosen implementation itself (not a wrapper), imported once per decision key."""
        # Nested dicts, no tuple key: a non-string op or backend can only find the entry of
        # an equal string; an unhashable one raises TypeError and is named by the full path.
        # Subscripts, not .get(): the hit is the path that counts.
        if not (options or context_pins()):
            try:  # written out in both branches: a shared tail costs this one ~5 ns
                if backend is None:
                    return _registry_module.registry._warm_kernels[op]
                return _registry_module.registry._warm_by_backend[backend][op]
            except (KeyError, TypeError):
                pass
        elif len(options) == 1 and not context_pins():
            # get_kernel(op, registry=r): what _warm(options) answers, without calling it.
            registry = options.get("registry", _warm)  # _warm: no registry is that
            if registry is None:
                registry = _registry_module.registry
            elif type(registry) is not KernelRegistry and not isinstance(registry, KernelRegistry):
                registry = None  # another option: the full path decides
            if registry is not None:
                try:
                    return (
                        registry._warm_kernels[op]
                        if backend is None
                        else registry._warm_by_backend[backend][op]
                    )
                except (KeyError, TypeError):
                    pass
        return dispatch.get_kernel(op, backend, **options)

    def select_kernel(op, backend=None, **options):
        """The spec that runs for ``op``, decided by the selection rules."""
        if not context_pins():
            registry = _registry_module.registry if not options else _warm(options)
            if registry is not None:
                try:
                    return registry._warm_specs[backend][op]
                except (KeyError, TypeError):
                    pass
        return dispatch.select_kernel(op, backend, **options)

    get_kernel.__wrapped__ = dispatch.get_kernel
    select_kernel.__wrapped__ = dispatch.select_kernel

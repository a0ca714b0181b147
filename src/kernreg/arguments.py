"""The ``platform=`` and ``registry=`` arguments the public functions take, turned into
the objects they name (shared by op objects, the torch layer and the CLI)."""

from __future__ import annotations

from kernreg.platform import Platform
from kernreg.registry import KernelRegistry, default_registry

__all__ = ["PlatformLike", "platform_argument", "registry_argument"]

#: A ``platform=`` argument: a Platform, its text form (``"cuda:9.0"``) or ``None`` (here).
PlatformLike = Platform | str | None


def platform_argument(value: PlatformLike) -> Platform | None:
    """The platform ``value`` names (``None`` stays ``None``: the registry's own)."""
    if value is None or isinstance(value, Platform):
        return value
    return Platform.parse(value, source="argument")


def registry_argument(registry: KernelRegistry | None) -> KernelRegistry:
    """``registry``, else the process-wide one."""
    return default_registry() if registry is None else registry

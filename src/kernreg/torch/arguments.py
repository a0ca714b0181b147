"""The ``platform=`` and ``registry=`` arguments the torch layer's functions take, turned
into the objects they name."""

from __future__ import annotations

from kernreg.platform import Platform, PlatformLike, parse_platform
from kernreg.registry import KernelRegistry, default_registry

__all__ = ["PlatformLike", "platform_argument", "registry_argument"]


def platform_argument(value: PlatformLike) -> Platform | None:
    """The platform ``value`` names (``None`` stays ``None``: the registry's own)."""
    if value is None or isinstance(value, Platform):
        return value
    # The devices the kernels mention are read only for a name that looks mistaken (h100).
    return parse_platform(value, source="platform", known=_mentioned_devices)


def _mentioned_devices() -> set[str]:
    return {req.device for spec in default_registry().all_specs() for req in spec.requires}


def registry_argument(registry: KernelRegistry | None) -> KernelRegistry:
    """``registry``, else the process-wide one."""
    return default_registry() if registry is None else registry

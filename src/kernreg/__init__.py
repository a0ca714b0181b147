"""kernreg: the inventory of ML operator kernels, and which implementation runs.

Registration is metadata only: importing kernreg imports no torch, numpy or kernel module.
Decisions are deterministic, explainable (:func:`explain`) and cached. Everything else is
imported from the module named after its concept (``kernreg.plan``, ``kernreg.config``, ...).
"""

from __future__ import annotations

import importlib
import warnings
from types import MappingProxyType
from typing import Any

from kernreg.dispatch import Op, dispatcher, op
from kernreg.errors import (
    AmbiguousKernelError,
    BackendNotFoundError,
    ConfigError,
    InvalidSpecError,
    KernelConflictError,
    KernelLoadError,
    KernregError,
    NoEligibleKernelError,
    OpNotFoundError,
    StrictFallbackError,
)
from kernreg.platform import Platform, Requirement
from kernreg.plugins import load_plugins as _load_plugins
from kernreg.registry import (
    KernelRegistry,
    default_registry,
    explain,
    get_kernel,
    register_kernel,
    select_kernel,
    use_backend,
    use_plugin_loader,
)
from kernreg.selection import Decision
from kernreg.spec import KernelSpec
from kernreg.tracing import stats, trace
from kernreg.version import __version__

__all__ = [
    "AmbiguousKernelError",
    "BackendNotFoundError",
    "ConfigError",
    "Decision",
    "InvalidSpecError",
    "KernelConflictError",
    "KernelLoadError",
    "KernelRegistry",
    "KernelSpec",
    "KernregError",
    "NoEligibleKernelError",
    "Op",
    "OpNotFoundError",
    "Platform",
    "Requirement",
    "StrictFallbackError",
    "__version__",
    "default_registry",
    "dispatcher",
    "explain",
    "get_kernel",
    "op",
    "register_kernel",
    "select_kernel",
    "stats",
    "trace",
    "use_backend",
]

# Autoloading registries (the process-wide one) load plugins on their first read.
use_plugin_loader(lambda registry: _load_plugins(registry=registry))

#: Names that were top-level up to 0.1, and the module each lives in now.
_MODULE_OF = MappingProxyType(
    {
        name: module
        for module, names in (
            ("kernreg.config", "ENV_VARS Config ConfigWarning Pin load_config"),
            ("kernreg.dtypes", "DTYPES normalize_dtype"),
            ("kernreg.errors", "DuplicateReferenceError PluginLoadError RegistryFrozenError"),
            ("kernreg.inventory", "Override"),
            ("kernreg.plan", "PlanEntry PlanError PlanWarning SelectionPlan"),
            ("kernreg.plugins", "PluginReport load_plugins"),
            ("kernreg.registry", "build_plan find_ambiguities fingerprint process_state_changed"),
            ("kernreg.selection", "Ambiguity Candidate"),
            ("kernreg.spec", "KNOWN_TRAITS Origin"),
            ("kernreg.tracing", "CallRecord Trace"),
        )
        for name in names.split()
    }
)


def __getattr__(name: str) -> Any:
    """``kernreg.<name>`` of a name that moved to its module: works for one more release."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'kernreg' has no attribute {name!r}")
    warnings.warn(
        f"kernreg.{name} is deprecated and goes in the next release: "
        f"use `from {module} import {name}`",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), name)

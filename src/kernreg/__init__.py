"""kernreg: the inventory of ML operator kernels, and which implementation runs.

Registration is metadata only: importing kernreg imports no torch, numpy or kernel
module. Decisions are deterministic, explainable (:func:`explain`) and cached, so a
dispatched call costs a dict lookup or less.
"""

from __future__ import annotations

from kernreg._lookup import get_kernel, select_kernel
from kernreg.config import ENV_VARS, Config, ConfigWarning, Pin, load_config
from kernreg.dispatch import Op, dispatcher, explain, op
from kernreg.dtypes import DTYPES, normalize_dtype
from kernreg.errors import (
    AmbiguousKernelError,
    BackendNotFoundError,
    ConfigError,
    DuplicateReferenceError,
    InvalidSpecError,
    KernelConflictError,
    KernelLoadError,
    KernregError,
    NoEligibleKernelError,
    OpNotFoundError,
    PluginLoadError,
    RegistryFrozenError,
    StrictFallbackError,
)
from kernreg.plan import (
    PlanEntry,
    PlanError,
    PlanWarning,
    SelectionPlan,
    build_plan,
    fingerprint,
)
from kernreg.platform import Platform, Requirement
from kernreg.plugins import PluginReport, load_plugins
from kernreg.registry import (
    KernelRegistry,
    Override,
    default_registry,
    process_state_changed,
    register_kernel,
    registry,
    use_backend,
)
from kernreg.resolver import use_plugin_loader
from kernreg.selection import Ambiguity, Candidate, Decision, find_ambiguities
from kernreg.spec import KNOWN_TRAITS, KernelSpec, Origin
from kernreg.tracing import CallRecord, Trace, trace
from kernreg.version import __version__

__all__ = [
    "DTYPES",
    "ENV_VARS",
    "KNOWN_TRAITS",
    "Ambiguity",
    "AmbiguousKernelError",
    "BackendNotFoundError",
    "CallRecord",
    "Candidate",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "Decision",
    "DuplicateReferenceError",
    "InvalidSpecError",
    "KernelConflictError",
    "KernelLoadError",
    "KernelRegistry",
    "KernelSpec",
    "KernregError",
    "NoEligibleKernelError",
    "Op",
    "OpNotFoundError",
    "Origin",
    "Override",
    "Pin",
    "PlanEntry",
    "PlanError",
    "PlanWarning",
    "Platform",
    "PluginLoadError",
    "PluginReport",
    "RegistryFrozenError",
    "Requirement",
    "SelectionPlan",
    "StrictFallbackError",
    "Trace",
    "__version__",
    "build_plan",
    "default_registry",
    "dispatcher",
    "explain",
    "find_ambiguities",
    "fingerprint",
    "get_kernel",
    "load_config",
    "load_plugins",
    "normalize_dtype",
    "op",
    "process_state_changed",
    "register_kernel",
    "registry",
    "select_kernel",
    "trace",
    "use_backend",
]


def _load_plugins(registry: KernelRegistry) -> None:
    """The plugin loader of autoloading registries: plugins are the outer layer's."""
    load_plugins(registry=registry)


use_plugin_loader(_load_plugins)

"""Discovery of kernels shipped by other distributions, through the ``kernreg.kernels`` entry points.

An entry point names either a function, called with the registry to fill::

    [project.entry-points."kernreg.kernels"]
    my_kernels = "my_pkg.kernels:register"

or a module whose import registers its kernels (``my_kernels = "my_pkg.kernels"``).
Plugins load in a fixed order, sorted by distribution name then entry-point name, so
the result never depends on installation order or ``sys.path``. Every spec a plugin
registers carries the distribution's name and version in its origin. A plugin that
fails is undone whole, reported, and (unless strict) does not stop the host program.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kernreg._frozen import Frozen
from kernreg.errors import PluginLoadError
from kernreg.registry import KernelRegistry, _journal, current_distribution, default_registry

if TYPE_CHECKING:
    # importlib.metadata costs ~20 ms to import: it is loaded when plugins are, not with kernreg.
    from importlib.metadata import EntryPoint

__all__ = [
    "ENTRY_POINT_GROUP",
    "PLUGIN_API_VERSION",
    "PluginFailure",
    "PluginInfo",
    "PluginReport",
    "PluginWarning",
    "discover",
    "load_plugins",
]

ENTRY_POINT_GROUP = "kernreg.kernels"

#: The plugin API this kernreg speaks. A plugin may declare the version it was written
#: for as ``KERNREG_PLUGIN_API = 1`` in its module (or as an attribute of its function).
PLUGIN_API_VERSION = 1


class PluginWarning(UserWarning):
    """A plugin failed to load and was skipped (lenient mode)."""


class PluginInfo(Frozen):
    """One discovered entry point and the distribution that ships it."""

    __slots__ = ("distribution", "version", "name", "value")
    distribution: str
    version: str
    name: str
    value: str

    def __init__(self, distribution: str, version: str, name: str, value: str) -> None:
        self._set("distribution", distribution)
        self._set("version", version)
        self._set("name", name)
        self._set("value", value)

    def __str__(self) -> str:
        return f"plugin '{self.name}' ({self.value}) from distribution {self.distribution} {self.version}"

    def describe(self) -> dict[str, str]:
        return {
            "distribution": self.distribution,
            "version": self.version,
            "name": self.name,
            "value": self.value,
        }


class PluginFailure(Frozen):
    """A plugin that did not load: which one, the error and the traceback text."""

    __slots__ = ("plugin", "error", "traceback")
    plugin: PluginInfo
    error: str
    traceback: str

    def __init__(self, plugin: PluginInfo, error: str, traceback: str = "") -> None:
        self._set("plugin", plugin)
        self._set("error", error)
        self._set("traceback", traceback)

    def __str__(self) -> str:
        return f"{self.plugin}: {self.error}"

    def describe(self) -> dict[str, Any]:
        return {**self.plugin.describe(), "error": self.error}


class PluginReport(Frozen):
    """What :func:`load_plugins` did: loaded plugins (with how many specs each added), failures, skips."""

    __slots__ = ("loaded", "failed", "skipped", "disabled")
    loaded: tuple[tuple[PluginInfo, int], ...]
    failed: tuple[PluginFailure, ...]
    skipped: tuple[tuple[PluginInfo, str], ...]
    disabled: str | None

    def __init__(
        self,
        loaded: tuple[tuple[PluginInfo, int], ...] = (),
        failed: tuple[PluginFailure, ...] = (),
        skipped: tuple[tuple[PluginInfo, str], ...] = (),
        disabled: str | None = None,
    ) -> None:
        self._set("loaded", loaded)
        self._set("failed", failed)
        self._set("skipped", skipped)
        self._set("disabled", disabled)

    @property
    def ok(self) -> bool:
        return not self.failed

    def describe(self) -> dict[str, Any]:
        return {
            "loaded": [{**info.describe(), "specs": count} for info, count in self.loaded],
            "failed": [failure.describe() for failure in self.failed],
            "skipped": [{**info.describe(), "reason": reason} for info, reason in self.skipped],
            "disabled": self.disabled,
        }


class _Loading:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.active: set[int] = set()


_loading = _Loading()


def discover(entry_points: Iterable[EntryPoint] | None = None) -> list[PluginInfo]:
    """Every ``kernreg.kernels`` entry point, sorted by (distribution, entry-point name)."""
    import importlib.metadata

    eps = (
        importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        if entry_points is None
        else entry_points
    )
    infos = []
    for ep in eps:
        dist = getattr(ep, "dist", None)
        name = dist.metadata["Name"] if dist is not None else "<unknown>"
        version = dist.version if dist is not None else ""
        infos.append(PluginInfo(name, version, ep.name, ep.value))
    return sorted(infos, key=lambda i: (_canonical(i.distribution), i.name, i.value))


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _duplicates(infos: list[PluginInfo]) -> dict[str, list[PluginInfo]]:
    by_name: dict[str, list[PluginInfo]] = {}
    for info in infos:
        by_name.setdefault(info.name, []).append(info)
    return {
        name: group
        for name, group in by_name.items()
        if len({_canonical(i.distribution) for i in group}) > 1
    }


def _check_api_version(obj: Any, info: PluginInfo) -> None:
    declared = getattr(obj, "KERNREG_PLUGIN_API", None)
    if declared is None:
        module = getattr(obj, "__module__", None)
        if isinstance(module, str):
            import sys

            declared = getattr(sys.modules.get(module), "KERNREG_PLUGIN_API", None)
    if declared is not None and declared != PLUGIN_API_VERSION:
        raise PluginLoadError(
            f"{info} declares kernreg plugin API {declared!r}, but this kernreg supports "
            f"API {PLUGIN_API_VERSION}: upgrade the one that is behind, or pin compatible versions",
            info.distribution,
            info.name,
        )


def _load_one(info: PluginInfo, registry: KernelRegistry) -> int:
    """Load one plugin; return how many specs it added. Undo everything it did if it fails."""
    journal: list[Any] = []
    overrides_before = len(registry._overrides)
    dist_token = current_distribution.set((info.distribution, info.version))
    journal_token = _journal.set(journal)
    try:
        import importlib.metadata

        ep = importlib.metadata.EntryPoint(info.name, info.value, ENTRY_POINT_GROUP)
        obj = ep.load()
        _check_api_version(obj, info)
        if ep.attr:
            if not callable(obj):
                raise PluginLoadError(
                    f"{info}: {info.value} is not callable; an entry point names a registration "
                    "function (called with the registry) or a module",
                    info.distribution,
                    info.name,
                )
            obj(registry)
        elif registry is not default_registry() and not journal:
            raise PluginLoadError(
                f"{info} is a module entry point: it registers into the process-wide registry "
                "on import, not into this one; name a registration function instead",
                info.distribution,
                info.name,
            )
    except BaseException:
        for reg, key, previous in reversed(journal):
            reg._undo(key, previous)
        with registry._lock:
            del registry._overrides[overrides_before:]
        raise
    finally:
        _journal.reset(journal_token)
        current_distribution.reset(dist_token)
    return sum(1 for _, _, previous in journal if previous is None)


def load_plugins(
    *,
    registry: KernelRegistry | None = None,
    strict: bool | None = None,
    entry_points: Iterable[EntryPoint] | None = None,
    reload: bool = False,
) -> PluginReport:
    """Load every allowed plugin into ``registry`` (default: the process-wide one), once.

    ``strict`` (default ``KERNREG_STRICT_PLUGINS``) turns a failing plugin into
    :class:`PluginLoadError`; otherwise the failure is undone, warned about once and
    recorded in the returned report (and in ``kernreg check``).
    """
    reg = default_registry() if registry is None else registry
    with _loading.lock:
        if reg.plugin_report is not None and not reload:
            return reg.plugin_report  # type: ignore[no-any-return]
        if id(reg) in _loading.active:  # a plugin asked for a decision while loading
            return PluginReport(disabled="plugins are being loaded")
        _loading.active.add(id(reg))
        try:
            report = _load_all(reg, strict, entry_points)
        finally:
            _loading.active.discard(id(reg))
        reg.plugin_report = report
        return report


def _load_all(
    reg: KernelRegistry,
    strict: bool | None,
    entry_points: Iterable[EntryPoint] | None,
) -> PluginReport:
    config = reg.config
    strict_mode = config.strict_plugins if strict is None else strict
    if config.plugins == "none":
        return PluginReport(disabled="KERNREG_PLUGINS=none")
    infos = discover(entry_points)
    loaded: list[tuple[PluginInfo, int]] = []
    failed: list[PluginFailure] = []
    skipped: list[tuple[PluginInfo, str]] = []
    duplicates = _duplicates(infos)
    for info in infos:
        reason = config.plugin_allowed(info.distribution)
        if reason is not None:
            skipped.append((info, reason))
            continue
        if info.name in duplicates:
            others = ", ".join(f"{i.distribution} {i.version}" for i in duplicates[info.name])
            message = (
                f"Multiple distributions register kernel plugin '{info.name}': {others}. "
                "Entry-point names must be unique across distributions: uninstall one of them, "
                "rename one entry point, or exclude one with KERNREG_PLUGINS_DENY"
            )
            if strict_mode:
                raise PluginLoadError(message, info.distribution, info.name)
            _warn(PluginFailure(info, message), failed)
            continue
        try:
            count = _load_one(info, reg)
        except (Exception, SystemExit) as exc:  # a plugin must never end the host program
            if strict_mode:
                if isinstance(exc, PluginLoadError):
                    raise
                raise PluginLoadError(
                    f"{info} failed to load: {type(exc).__name__}: {exc}",
                    info.distribution,
                    info.name,
                ) from exc
            import traceback

            _warn(
                PluginFailure(info, f"{type(exc).__name__}: {exc}", traceback.format_exc()), failed
            )
            continue
        loaded.append((info, count))
    return PluginReport(tuple(loaded), tuple(failed), tuple(skipped))


def _warn(failure: PluginFailure, failed: list[PluginFailure]) -> None:
    failed.append(failure)
    warnings.warn(
        f"kernreg skipped {failure} (set KERNREG_STRICT_PLUGINS=1 to make this an error)",
        PluginWarning,
        stacklevel=4,
    )

"""Discovery of kernels shipped by other distributions, through the ``kernreg.kernels`` entry points.

An entry point names a function called with the registry to fill (``"my_pkg.kernels:register"``)
or a module whose import registers into the process-wide registry (``"my_pkg.kernels"``).
Plugins load sorted by distribution and name; a plugin that fails is undone whole and reported.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from difflib import get_close_matches
from typing import Any, Protocol

from kernreg._fork import Lock
from kernreg.config import normalize_distribution
from kernreg.errors import DuplicateReferenceError, KernelConflictError, PluginLoadError
from kernreg.inventory import user_stacklevel
from kernreg.registry import (
    KernelRegistry,
    current_distribution,
    default_registry,
    registration_journal,
)
from kernreg.spec import KernelSpec


class _EntryPoint(Protocol):
    """What discovery reads of an ``importlib.metadata.EntryPoint`` (and its ``dist``)."""

    @property
    def name(self) -> str: ...

    @property
    def value(self) -> str: ...


__all__ = [
    "ENTRY_POINT_GROUP",
    "PLUGIN_API_VERSION",
    "PluginConflict",
    "PluginFailure",
    "PluginInfo",
    "PluginReport",
    "PluginWarning",
    "discover",
    "load_plugins",
    "record_undo",
]

ENTRY_POINT_GROUP = "kernreg.kernels"

#: The plugin API this kernreg speaks. A plugin may declare the version it was written
#: for as ``KERNREG_PLUGIN_API = 1`` in its module (or as an attribute of its function).
PLUGIN_API_VERSION = 1


class PluginWarning(UserWarning):
    """A plugin failed to load and was skipped (lenient mode)."""


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    """One discovered entry point and the distribution that ships it."""

    distribution: str
    version: str
    name: str
    value: str

    @property
    def module(self) -> str:
        return self.value.partition(":")[0].strip()

    @property
    def is_module(self) -> bool:
        """Whether the entry point names a module (which registers on import), not a function."""
        return ":" not in self.value

    def __str__(self) -> str:
        dist = self.distribution + (f" {self.version}" if self.version else "")
        return f"plugin '{self.name}' ({self.value}) from distribution {dist}"

    def describe(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PluginFailure:
    """A plugin that did not load: which one, the error, its traceback and the exception itself."""

    plugin: PluginInfo
    error: str
    traceback: str = dataclasses.field(default="", repr=False, compare=False)
    exception: BaseException | None = dataclasses.field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        return f"{self.plugin}: {self.error}"

    def describe(self) -> dict[str, Any]:
        return {**self.plugin.describe(), "error": self.error}


@dataclasses.dataclass(frozen=True)
class PluginConflict:
    """Two distributions register different implementations for one ``(op, backend, variant)``,
    or each a reference for one op: neither is kept, the user chooses (``KERNREG_PLUGINS_DENY``).
    ``plugins`` and ``specs`` are both sides, the one that registered first first."""

    plugins: tuple[PluginInfo, PluginInfo]
    specs: tuple[KernelSpec, KernelSpec]
    error: str

    @property
    def op(self) -> str:
        return self.specs[1].op

    def resolutions(self, denied: Iterable[str] = ()) -> tuple[str, str]:
        """The two ``KERNREG_PLUGINS_DENY`` values that settle it (``denied`` kept): the
        first keeps the first side's implementation, the second the other side's."""
        first, second = (info.distribution for info in self.plugins)
        kept = list(denied)
        return ",".join(dict.fromkeys([*kept, second])), ",".join(dict.fromkeys([*kept, first]))

    def message(self, denied: Iterable[str] = ()) -> str:
        first, second = (info.distribution for info in self.plugins)
        keep_first, keep_second = self.resolutions(denied)
        return (
            f"{self.error.partition(chr(10))[0]}; distribution {second} conflicts with "
            f"distribution {first}, which registered it first, and neither runs until you "
            f"choose; to resolve: KERNREG_PLUGINS_DENY={keep_first} keeps {first}'s implementation "
            f"(KERNREG_PLUGINS_DENY={keep_second} keeps {second}'s)"
        )

    def __str__(self) -> str:
        return self.message()

    def describe(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "backends": list(dict.fromkeys(spec.label for spec in self.specs)),
            "plugins": [info.describe() for info in self.plugins],
            "targets": [spec.target_name for spec in self.specs],
            "error": self.error,
        }


@dataclasses.dataclass(frozen=True)
class PluginReport:
    """What :func:`load_plugins` did: loaded plugins (with how many specs each added), failures,
    skips, conflicts between distributions, and why nothing was discovered (``disabled``)."""

    loaded: tuple[tuple[PluginInfo, int], ...] = ()
    failed: tuple[PluginFailure, ...] = ()
    skipped: tuple[tuple[PluginInfo, str], ...] = ()
    disabled: str | None = None
    conflicts: tuple[PluginConflict, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether no plugin failed and no two distributions conflict."""
        return not self.failed and not self.conflicts

    def describe(self) -> dict[str, Any]:
        return {
            "loaded": [{**info.describe(), "specs": count} for info, count in self.loaded],
            "failed": [failure.describe() for failure in self.failed],
            "skipped": [{**info.describe(), "reason": reason} for info, reason in self.skipped],
            "disabled": self.disabled,
            "conflicts": [conflict.describe() for conflict in self.conflicts],
        }

    @property
    def distributions(self) -> tuple[str, ...]:
        """The distributions that ship a plugin (loaded, failed or skipped), sorted."""
        infos = [info for info, _ in (*self.loaded, *self.skipped)]
        infos += [failure.plugin for failure in self.failed]
        return tuple(sorted({info.distribution for info in infos}))

    def unmatched_denials(self, denied: Iterable[str]) -> list[str]:
        """A message for each ``KERNREG_PLUGINS_DENY`` name that is no installed plugin
        distribution (a typo denies nothing), with the installed name it resembles."""
        return self._unmatched(denied, "KERNREG_PLUGINS_DENY", "denies")

    def unmatched_allowed(self, allowed: str | Iterable[str]) -> list[str]:
        """A message for each ``KERNREG_PLUGINS`` name that is no installed plugin
        distribution (a typo allows nothing), with the installed name it resembles."""
        return (
            []
            if isinstance(allowed, str)
            else self._unmatched(allowed, "KERNREG_PLUGINS", "allows")
        )

    def _unmatched(self, names: Iterable[str], variable: str, verb: str) -> list[str]:
        if self.disabled is not None:
            return []
        installed = {normalize_distribution(d): d for d in self.distributions}
        messages = []
        for name in names:
            if normalize_distribution(name) in installed:
                continue
            close = get_close_matches(normalize_distribution(name), sorted(installed), n=1)
            hint = f"; did you mean '{installed[close[0]]}'?" if close else ""
            messages.append(
                f"{variable} names '{name}', which ships no installed plugin, "
                f"so it {verb} nothing{hint}"
            )
        return messages

    def __str__(self) -> str:
        if self.disabled is not None:
            return f"plugins disabled: {self.disabled}"
        lines = [f"loaded {info} ({count} specs)" for info, count in self.loaded]
        lines += [f"FAILED {failure}" for failure in self.failed]
        lines += [f"CONFLICT {conflict}" for conflict in self.conflicts]
        lines += [f"skipped {info}: {reason}" for info, reason in self.skipped]
        return "\n".join(lines) or "no plugins installed"


class _Loading:
    """The state of plugin loading in this process (one object, one lock)."""

    def __init__(self) -> None:
        self.lock = Lock()
        #: The registries being loaded, each with the thread loading it.
        self.active: dict[int, int] = {}
        #: What each module entry point registered when it was imported: a module runs
        #: once per process, so a later load registers these again instead.
        self.module_specs: dict[PluginInfo, tuple[KernelSpec, ...]] = {}


_loading = _Loading()


def discover(entry_points: Iterable[_EntryPoint] | None = None) -> list[PluginInfo]:
    """Every ``kernreg.kernels`` entry point, sorted by (distribution, entry-point name), read
    from installed metadata (nothing is imported) or from ``entry_points``."""
    # Imported here: importlib.metadata (with the e-mail parser) is 40% of `import kernreg`
    # (22 of 55 ms), and a process that loads no plugins never needs it.
    import importlib.metadata

    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    infos = set()
    for ep in entry_points:
        dist = getattr(ep, "dist", None)
        name, version = "<unknown>", ""
        if dist is not None:
            metadata = dist.metadata  # parsed afresh on each access
            name, version = metadata.get("Name") or name, metadata.get("Version") or version
        infos.add(PluginInfo(name, version, ep.name, ep.value))
    return sorted(
        infos, key=lambda i: (normalize_distribution(i.distribution), i.name, i.value, i.version)
    )


def _duplicates(infos: list[PluginInfo]) -> dict[str, str]:
    """The error for each entry-point name that more than one distribution uses."""
    by_name: dict[str, list[PluginInfo]] = {}
    for info in infos:
        by_name.setdefault(info.name, []).append(info)
    return {
        name: (
            f"Multiple distributions register kernel plugin '{name}': "
            f"{', '.join(info.distribution for info in group)}. "
            "Entry-point names in the 'kernreg.kernels' group must be unique, so none of them "
            "was loaded: uninstall one of these distributions, rename the entry point in one "
            "of them, or exclude one with KERNREG_PLUGINS_DENY=<distribution>"
        )
        for name, group in by_name.items()
        if len({normalize_distribution(i.distribution) for i in group}) > 1
    }


def _check_api_version(obj: Any, info: PluginInfo) -> None:
    declared = getattr(obj, "KERNREG_PLUGIN_API", None)
    if declared is None:  # a function's module may declare it
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        declared = getattr(module, "KERNREG_PLUGIN_API", None)
    if declared is not None and (type(declared) is not int or declared != PLUGIN_API_VERSION):
        raise PluginLoadError(
            f"{info} declares kernreg plugin API {declared!r}, but this kernreg supports "
            f"API {PLUGIN_API_VERSION}: upgrade whichever of {info.distribution} and kernreg "
            "is behind, or pin versions that agree",
            info.distribution,
            info.name,
        )


#: How to undo the registrations other tables (layer mappings) made during the current load.
_undo_log: ContextVar[list[Callable[[], None]] | None] = ContextVar(
    "kernreg_plugin_undo", default=None
)


def record_undo(undo: Callable[[], None]) -> bool:
    """Record how to undo a registration made while a plugin loads; if that load fails,
    ``undo()`` runs (latest first). Returns whether a plugin load is recording."""
    log = _undo_log.get()
    if log is not None:
        log.append(undo)
    return log is not None


def _load_one(info: PluginInfo, registry: KernelRegistry) -> int:
    """Load one plugin; return how many specs it added. Undo everything it did if it fails."""
    journal: list[tuple[KernelRegistry, tuple[str, str, str], KernelSpec | None]] = []
    touched = {registry, default_registry()}
    # A plugin that freezes, configures or sets a plan and then fails is undone whole.
    checkpoints = {reg: reg.checkpoint() for reg in touched}
    dist_token = current_distribution.set((info.distribution, info.version))
    journal_token = registration_journal.set(journal)
    undo_log: list[Callable[[], None]] = []
    undo_token = _undo_log.set(undo_log)
    try:
        replay = _loading.module_specs.get(info) if info.module in sys.modules else None
        if replay is not None:
            # A module imported by an earlier load: importing is a no-op, so register again.
            for spec in replay:
                registry.register(spec)
            return _count_added(journal, registry)
        from importlib.metadata import EntryPoint

        obj = EntryPoint(info.name, info.value, ENTRY_POINT_GROUP).load()
        _check_api_version(obj, info)
        if info.is_module:  # what the import left in the registry, in registration order
            keys = dict.fromkeys(key for reg, key, _ in journal if reg is registry)
            stored = (registry.stored(*key) for key in keys)
            _loading.module_specs[info] = tuple(spec for spec in stored if spec is not None)
        elif not callable(obj):
            raise PluginLoadError(
                f"{info}: {info.value} is not callable; an entry point names a registration "
                "function (called with the registry) or a module",
                info.distribution,
                info.name,
            )
        else:
            obj(registry)
    except BaseException:
        for undo in reversed(undo_log):
            undo()
        for reg in touched:  # first: a registry the plugin froze is thawed again
            reg.rollback(checkpoints[reg])
        for reg, key, previous in reversed(journal):
            reg.restore(key, previous)
        raise
    finally:
        _undo_log.reset(undo_token)
        registration_journal.reset(journal_token)
        current_distribution.reset(dist_token)
    return _count_added(journal, registry)


def _count_added(journal: list[Any], registry: KernelRegistry) -> int:
    """How many keys of ``registry`` the journaled changes filled that were empty before."""
    # Reversed: each key keeps what it held before its first change.
    before = {key: previous for reg, key, previous in reversed(journal) if reg is registry}
    return sum(old is None and registry.stored(*key) is not None for key, old in before.items())


def load_plugins(
    *,
    registry: KernelRegistry | None = None,
    strict: bool | None = None,
    entry_points: Iterable[_EntryPoint] | None = None,
    reload: bool = False,
) -> PluginReport:
    """Load every allowed plugin into ``registry`` (default: the process-wide one), once
    unless ``reload``. ``strict`` (default ``KERNREG_STRICT_PLUGINS``) turns a failing plugin
    into :class:`PluginLoadError`; otherwise it is undone, warned about and reported."""
    reg = default_registry() if registry is None else registry
    with _loading.lock:
        if reg.plugin_report is not None and not reload:
            return reg.plugin_report  # type: ignore[no-any-return]
        if _loading.active.get(id(reg)) == threading.get_ident():
            # A plugin asked for a decision while loading.
            return PluginReport(disabled="plugins are being loaded")
        _loading.active[id(reg)] = threading.get_ident()
        try:
            report = _load_all(reg, strict, entry_points)
        finally:
            _loading.active.pop(id(reg), None)
        reg.plugin_report = report
    # Warn after the report is stored: with warnings turned into errors, the failure is
    # raised once, and the next selection goes on with the plugins that did load.
    deny = reg.config.plugins_deny
    messages = [
        *(f"kernreg skipped {f} (set KERNREG_STRICT_PLUGINS=1 to make this an error)"
          for f in report.failed),
        *(f"kernreg plugin conflict: {c.message(deny)}" for c in report.conflicts),
        *report.unmatched_denials(deny),
        *report.unmatched_allowed(reg.config.plugins),
    ]  # fmt: skip
    for message in messages:
        warnings.warn(message, PluginWarning, stacklevel=user_stacklevel())
    return report


def _load_all(
    reg: KernelRegistry, strict: bool | None, entry_points: Iterable[_EntryPoint] | None
) -> PluginReport:
    config = reg.config
    strict_mode = config.strict_plugins if strict is None else strict
    if config.plugins == "none":
        return PluginReport(disabled="KERNREG_PLUGINS=none")
    # Every decision that needs no plugin code is made before any plugin code runs.
    found = [(info, config.plugin_allowed(info.distribution)) for info in discover(entry_points)]
    skipped = [(info, reason) for info, reason in found if reason is not None]
    allowed = [info for info, reason in found if reason is None]
    duplicates = _duplicates(allowed)
    if strict_mode and duplicates:
        name = min(duplicates)
        first = next(info for info in allowed if info.name == name)
        raise PluginLoadError(duplicates[name], first.distribution, name)
    failed: list[PluginFailure] = []
    loaded: list[tuple[PluginInfo, int]] = []
    contest = _Contest(reg, [info for info in allowed if info.name not in duplicates])
    for info in allowed:
        if info.name in duplicates:
            error = PluginLoadError(duplicates[info.name], info.distribution, info.name)
            failed.append(PluginFailure(info, str(error), exception=error))
            continue
        if info.is_module and reg is not default_registry():
            reason = "module entry point: it registers into the process-wide registry"
            skipped.append((info, reason))
            continue
        try:
            loaded.append((info, contest.load(info, strict_mode)))
        except (Exception, SystemExit) as exc:  # a plugin must never end the host program
            if strict_mode and isinstance(exc, PluginLoadError):
                raise
            why = f"{type(exc).__name__}: {exc}"
            if strict_mode:
                message = f"{info} failed to load: {why}"
                raise PluginLoadError(message, info.distribution, info.name) from exc
            failed.append(PluginFailure(info, why, traceback.format_exc(), exc))
    kept = tuple((info, count - contest.taken[info]) for info, count in loaded)
    return PluginReport(kept, tuple(failed), tuple(skipped), conflicts=tuple(contest.conflicts))


class _Contest:
    """The registrations two distributions dispute while plugins load. The load order must not
    settle a conflict: the earlier spec is withdrawn and the plugin loads again from the start,
    and what a plugin registers at a disputed key (or op's reference) is withdrawn after it."""

    def __init__(self, registry: KernelRegistry, plugins: list[PluginInfo]) -> None:
        self.registry = registry
        self.plugins = plugins
        self.conflicts: list[PluginConflict] = []
        #: Each disputed key, and disputed op (two references), with the first side's plugin
        #: and spec: a third distribution registering there is in the same dispute.
        self.keys: dict[tuple[str, str, str], tuple[PluginInfo, KernelSpec]] = {}
        self.references: dict[str, tuple[PluginInfo, KernelSpec]] = {}
        #: How many specs each plugin lost to disputes (for the report's counts).
        self.taken: Counter[PluginInfo] = Counter()

    def load(self, info: PluginInfo, strict: bool) -> int:
        """Load ``info``, every disputed registration withdrawn; return how many specs it added."""
        while True:
            try:
                count = _load_one(info, self.registry)
            except (KernelConflictError, DuplicateReferenceError) as exc:
                other = self._other_side(exc, info)
                if other is None:
                    raise
                self.conflicts.append(PluginConflict((other, info), (exc.old, exc.new), str(exc)))
                if isinstance(exc, DuplicateReferenceError):
                    self.references.setdefault(exc.old.op, (other, exc.old))
                else:
                    self.keys.setdefault(exc.old.key, (other, exc.old))
                self.registry.restore(exc.old.key, None)
                self.taken[other] += 1
                if strict:
                    raise
                continue  # the disputed spec is gone: load the plugin again, whole
            self._withdraw(info)
            return count

    def _other_side(
        self, exc: KernelConflictError | DuplicateReferenceError, info: PluginInfo
    ) -> PluginInfo | None:
        """The plugin of another distribution whose spec ``exc`` ran into, if it is one."""
        dist = _distribution(exc.old)
        if dist is None or dist == normalize_distribution(info.distribution):
            return None
        if self.registry.stored(*exc.old.key) is not exc.old:
            return None  # not in the registry loading (a module registered elsewhere)
        return next(
            (p for p in self.plugins if normalize_distribution(p.distribution) == dist), None
        )

    def _withdraw(self, info: PluginInfo) -> None:
        """Take out what ``info`` registered at disputed keys."""
        registry, dist = self.registry, normalize_distribution(info.distribution)
        found = [(registry.stored(*key), first) for key, first in sorted(self.keys.items())]
        for op, first in sorted(self.references.items()):
            found.extend((s, first) for s in registry.get(op) if s.reference)
        for spec, (other, old) in found:
            if spec is None or _distribution(spec) != dist:
                continue
            registry.restore(spec.key, None)
            self.taken[info] += 1
            if not any(c.plugins[1] == info and c.specs[1].key == spec.key for c in self.conflicts):
                # A third distribution at a disputed place: in the dispute too.
                error = (
                    f"Conflicting kernel registration for op '{spec.op}', backend "
                    f"'{spec.label}': '{old.target_name}' != '{spec.target_name}'"
                )
                self.conflicts.append(PluginConflict((other, info), (old, spec), error))


def _distribution(spec: KernelSpec) -> str | None:
    """The distribution that registered ``spec`` (normalized), if a plugin did."""
    dist = None if spec.origin is None else spec.origin.distribution
    return None if dist is None else normalize_distribution(dist)

"""The registry: :class:`KernelRegistry` owns an inventory of specs and answers what runs,
caching decisions until the next change; :func:`default_registry` is the process-wide one."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from fnmatch import fnmatchcase
from types import SimpleNamespace
from typing import Any, cast

from kernreg._compile import inline_instead, run_while_tracing, through_the_compiler
from kernreg._fork import Lock, torch_import_cut
from kernreg._names import check_name, check_op_id, check_variant
from kernreg._packages import clear_cache
from kernreg.ambiguity import Ambiguity, find_ambiguities_in
from kernreg.autotune import implementations_key, platform_key
from kernreg.config import Config, ConfigWarning, Pin, load_config, unknown_variable_hint
from kernreg.demotion import DemotionTable
from kernreg.dtypes import normalize_dtype
from kernreg.errors import (
    AmbiguousKernelError,
    BackendNotFoundError,
    DemotionError,
    DemotionWarning,
    InvalidSpecError,
    KernregError,
    NoEligibleKernelError,
    RegistryFrozenError,
    StrictFallbackError,
    close_op_ids,
    did_you_mean,
)
from kernreg.inventory import (
    Inventory,
    Override,
    caller_origin,
    current_distribution,
    registration_journal,
    user_stacklevel,
)
from kernreg.measurement import Measurement
from kernreg.pins import context_pins, note_pin_used, open_blocks, pin_block, pin_was_used, pins_for
from kernreg.plan import Dtypes, PlanWarning, SelectionPlan, plan_mismatch, plan_of
from kernreg.platform import Platform, PlatformLike, parse_platform
from kernreg.selection import Call, Decision, decide, quick_choice
from kernreg.spec import KernelSpec
from kernreg.tracing import count, count_decision, export_at_exit
from kernreg.tuning import Demotion, TuningKey, TuningStore, TuningStoreError

__all__ = [
    "KernelRegistry",
    "Override",
    "build_plan",
    "caller_origin",
    "chosen_or_raise",
    "current_distribution",
    "default_registry",
    "explain",
    "find_ambiguities",
    "fingerprint",
    "get_kernel",
    "process_state_changed",
    "register_kernel",
    "registration_journal",
    "select_kernel",
    "use_backend",
    "use_plugin_loader",
]


_logger = logging.getLogger("kernreg")

#: The traits of a call that asks for none (``frozenset()`` makes a new 216-byte set each time).
_NO_TRAITS: frozenset[str] = frozenset()

#: Every live registry: a change of process state reaches all their cached decisions.
_registries: weakref.WeakSet[KernelRegistry] = weakref.WeakSet()
#: The unknown environment variables warned about, and what loads plugins (use_plugin_loader).
_warned_unknown: set[str] = set()
_plugin_loader: Callable[[Any], object] | None = None

#: What :meth:`KernelRegistry.checkpoint` records besides the override log; a
#: :meth:`KernelRegistry.scoped` block puts back all of it, with the inventory and the
#: plugins' state. The tuning store and what was read from it go with the configuration.
_SETTINGS = (
    *("_frozen", "_config", "_platform", "_plan", "_plan_set"),
    *("_store", "_store_failed", "_store_given", "_measured", "_demoted"),
)
_SCOPED = ("_inventory", "autoload_plugins", "plugin_report", *_SETTINGS)

_FROZEN = (
    "the kernel registry is frozen; register kernels before freeze() is called, "
    "or use registry.scoped() in tests"
)
_CUT_BY_FORK = (
    "forked while another thread was importing torch; torch is unusable in this process "
    "(import torch before forking, or set KERNREG_PLATFORM)"
)


class KernelRegistry:
    """The implementations of every op and the decisions made from them. ``config`` and
    ``platform`` default to the environment (read at first use) and detection."""

    _store: TuningStore | None
    _store_failed: bool
    _measured: dict[TuningKey, dict[str, Measurement]]

    def __init__(self, *, config: Config | None = None, platform: Platform | None = None) -> None:
        self._lock = Lock()
        self._inventory = Inventory()
        self._frozen = False
        self._scope_threads: list[threading.Thread] = []  # the thread of each open scoped()
        self._generation = 0
        self._subscribers: weakref.WeakSet[Any] = weakref.WeakSet()
        _registries.add(self)
        # Cached until the next mutation: explain's decisions by everything a decision
        # depends on; select_kernel's specs and get_kernel's implementations by their arguments.
        # A mutation changes the state first, then replaces these dicts with new ones; a
        # reader takes a dict before it reads any state, so what it stores after a mutation
        # goes into a dict nobody reads again. No lock on the decision path.
        self._decisions: dict[tuple[Any, ...], Decision] = {}
        self._chosen: dict[Any, dict[str, KernelSpec]] = {}
        self._kernels: dict[Any, dict[str, Callable[..., Any]]] = {}
        self._traced = SimpleNamespace()  # what the lookups answered while torch.compile traced
        self._token = os.urandom(8).hex()  # names it to what runs while torch.compile traces
        self._config = config
        self._platform = platform
        self._plan: SelectionPlan | None = None
        self._plan_set = False
        self._plan_warned: set[tuple[str, Platform, Dtypes]] = set()
        self._plan_checked: tuple[SelectionPlan | None, Platform | None] = (None, None)
        self._store_given = False  # use_tuning_store's; else the store follows the cache_dir
        self._forget_store()
        #: Whether the first selection loads plugins from entry points (the default registry does).
        self.autoload_plugins = False
        self.plugin_report: Any = None

    # --- the inventory ------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """Increases with every mutation; a decision made at one generation is valid only there."""
        return self._generation

    def register(self, spec: KernelSpec, *, replace: bool = False) -> KernelSpec:
        """Add ``spec`` and return the stored spec (an equal one is a no-op, even when frozen);
        a different spec for its key raises :class:`KernelConflictError` unless ``replace``."""
        if not isinstance(spec, KernelSpec):
            raise InvalidSpecError("spec", spec, "expected a KernelSpec")
        if spec.origin is None:
            spec = spec.with_origin(caller_origin(2))
        if replace:  # what it replaces on purpose may be a plugin's, not loaded yet
            self.ensure_plugins()
        with self._lock:
            old = self._inventory.stored(*spec.key)
            if old is not None and old == spec:
                return old  # also when frozen: reloading a module must stay safe
            self._check_mutable()
            self._changed(spec.key, self._inventory.add(spec, replace=replace))
        return spec

    def unregister(self, op: str, backend: str, variant: str = "") -> KernelSpec:
        """Remove and return ``(op, backend, variant)`` (recorded as an override)."""
        self.ensure_plugins()
        with self._lock:
            self._check_mutable()
            spec = self._inventory.remove(op, backend, variant)
            self._changed(spec.key, spec)
        return spec

    def _changed(self, key: tuple[str, str, str], previous: KernelSpec | None) -> None:
        # Lock held: journal the change for a loading plugin, forget every decision.
        journal = registration_journal.get()
        if journal is not None:
            journal.append((self, key, previous))
        self._invalidate()

    def restore(self, key: tuple[str, str, str], previous: KernelSpec | None) -> None:
        """Put ``key`` back to ``previous`` (``None``: absent), bypassing the conflict rules:
        how a failed plugin's registrations are undone. A frozen registry refuses it."""
        with self._lock:
            self._check_mutable()
            self._inventory.put(key, previous)
            self._invalidate()

    def stored(self, op: str, backend: str, variant: str = "") -> KernelSpec | None:
        """The spec ``(op, backend, variant)`` as stored now (plugins are not loaded first)."""
        return self._inventory.stored(op, backend, variant)

    def stored_implementations(self, op: str) -> tuple[KernelSpec, ...]:
        """Every implementation of ``op`` as stored now (plugins are not loaded first)."""
        with self._lock:
            try:
                return self._inventory.get(op)
            except KeyError:
                return ()

    def checkpoint(self) -> tuple[Any, ...]:
        """What :meth:`rollback` puts back: the override log's length and the settings."""
        with self._lock:
            return (len(self._inventory.override_log), *(getattr(self, n) for n in _SETTINGS))

    def rollback(self, checkpoint: tuple[Any, ...]) -> None:
        """Forget the overrides and settings changed since :meth:`checkpoint` (a failed plugin)."""
        overrides, *settings = checkpoint
        with self._lock:
            del self._inventory.override_log[overrides:]
            if settings != [getattr(self, name) for name in _SETTINGS]:
                vars(self).update(zip(_SETTINGS, settings, strict=True))
                self._plan_warned.clear()
                self._invalidate()

    def freeze(self) -> None:
        """Refuse every later mutation (after start-up, so nothing changes under an engine);
        plugins not yet loaded are loaded first: they are part of start-up."""
        self.ensure_plugins()
        with self._lock:
            self._frozen = True

    @property
    def frozen(self) -> bool:
        return self._frozen

    def _check_mutable(self) -> None:
        if self._frozen:
            raise RegistryFrozenError(_FROZEN)

    @contextlib.contextmanager
    def scoped(self) -> Iterator[KernelRegistry]:
        """A block whose registrations, removals and configuration vanish at exit (for tests);
        a frozen registry accepts changes inside it. Scopes nest within one thread; another
        thread's open scope is a ``RuntimeError`` (the one closed last would keep the other's
        changes)."""
        thread = threading.current_thread()
        with self._lock:
            # A thread that is not alive: one of the parent's, in a child forked meanwhile.
            if any(o is not thread and o.is_alive() for o in self._scope_threads):
                raise RuntimeError(
                    "registry.scoped() is open in another thread; scopes of one registry nest "
                    "within one thread (give each thread its own KernelRegistry)"
                )
            self._scope_threads.append(thread)
            saved = {name: getattr(self, name) for name in _SCOPED}
            saved["_inventory"] = self._inventory.copy()
            self._frozen = False
        try:
            yield self
        finally:
            with self._lock:
                self._scope_threads.remove(thread)
                vars(self).update(saved)
                self._invalidate()

    def _invalidate(self) -> None:
        # Called with the lock held, after the state changed (see __init__).
        self._generation += 1
        self._decisions, self._chosen, self._kernels = {}, {}, {}
        vars(self._traced).clear()
        if self._subscribers:  # iterating even an empty WeakSet costs microseconds
            for subscriber in list(self._subscribers):
                subscriber.invalidate()

    def subscribe(self, subscriber: Any) -> None:
        """Have ``subscriber.invalidate()`` called (lock held) on every mutation; held weakly."""
        with self._lock:
            self._subscribers.add(subscriber)

    def has(self, op: str) -> bool:
        self.ensure_plugins()
        return op in self._inventory.specs

    __contains__ = has

    def ops(self) -> tuple[str, ...]:
        """Every op id with at least one implementation, sorted."""
        self.ensure_plugins()
        with self._lock:
            return tuple(sorted(self._inventory.specs))

    def get(self, op: str) -> tuple[KernelSpec, ...]:
        """All implementations of ``op``, highest priority first, then by backend and variant."""
        self.ensure_plugins()
        with self._lock:
            return self._inventory.get(op)

    def get_backend(self, op: str, backend: str, variant: str = "") -> KernelSpec:
        """The implementation ``(op, backend, variant)``; ``KeyError`` subclasses when missing."""
        self.ensure_plugins()
        with self._lock:
            return self._inventory.get_backend(op, backend, variant)

    def reference(self, op: str) -> KernelSpec | None:
        """The op's reference implementation, if one is registered."""
        return next((spec for spec in self.get(op) if spec.reference), None)

    def all_specs(self) -> tuple[KernelSpec, ...]:
        """Every spec, sorted by op, then as :meth:`get` orders them."""
        return tuple(spec for op in self.ops() for spec in self.get(op))

    def overrides(self) -> tuple[Override, ...]:
        """Every deliberate replacement or removal, in the order it happened."""
        self.ensure_plugins()
        with self._lock:
            return tuple(self._inventory.override_log)

    def __len__(self) -> int:
        self.ensure_plugins()
        with self._lock:
            return sum(map(len, self._inventory.specs.values()))

    def __repr__(self) -> str:
        note = ""
        try:  # loads the plugins first, so the counts include them
            self.ensure_plugins()
        except Exception:  # a repr never raises (debuggers, logs); selecting raises it
            note = " (plugins failed to load)"
        with self._lock:
            ops, specs = len(self._inventory.specs), self._inventory.specs.values()
            implementations = sum(map(len, specs))
        return f"<{type(self).__name__} {ops} ops, {implementations} implementations{note}>"

    # --- configuration ------------------------------------------------------------------

    @property
    def config(self) -> Config:
        """The configuration; read from the environment on first use (raises ``ConfigError``)."""
        config = self._config
        if config is None:
            # Read outside the lock: reading may import modules, and a lock held across an
            # import blocks every other thread (and hangs a child forked meanwhile).
            fresh = _environment_config()
            with self._lock:
                if self._config is None:
                    self._config = fresh
                config = self._config
        return config

    def configure(self, config: Config | None = None, *, platform: Platform | None = None) -> None:
        """Replace the configuration (``None``: re-read the environment) and the platform.
        Installed packages are looked up again (one installed since is seen)."""
        clear_cache()
        with self._lock:
            self._config = config
            self._platform = platform
            if not self._store_given:  # a new cache_dir: its store's measurements decide
                self._forget_store()
            self._plan_warned.clear()  # a new platform or plan may miss again: say so again
            self._invalidate()

    @property
    def platform(self) -> Platform:
        """The platform decisions are made for: configured, else detected once."""
        platform = self._platform
        if platform is None:
            # Detection imports torch (about 1.5 s): never under the lock (see ``config``).
            # A fork while another thread imported torch: that import never finishes here.
            cut = Platform("cpu", source=_CUT_BY_FORK) if torch_import_cut() else None
            detected = self.config.platform or cut or Platform.detect()
            with self._lock:
                if self._platform is None:
                    self._platform = detected
                platform = self._platform
        return platform

    @property
    def plan(self) -> SelectionPlan | None:
        """The selection plan decisions follow: :meth:`use_plan`'s, else ``KERNREG_LOCK``'s."""
        plan = self._plan if self._plan_set else cast("SelectionPlan | None", self.config.plan)
        checked = self._plan_checked
        if plan is not None and (checked[0] is not plan or checked[1] != self._platform):
            # Warn once when the plan decides nothing this process decides.
            platform = self.platform
            self._plan_checked = (plan, self._platform)
            why = plan_mismatch(plan, platform, self.ops())
            if why is not None:
                warnings.warn(why, PlanWarning, stacklevel=user_stacklevel())
        return plan

    def use_plan(self, plan: SelectionPlan | None) -> None:
        """Follow ``plan`` from now on (``None``: follow none, whatever ``KERNREG_LOCK`` says)."""
        with self._lock:
            self._plan, self._plan_set = plan, True
            self._plan_warned.clear()
            self._invalidate()

    # --- decisions ----------------------------------------------------------------------

    def ensure_plugins(self) -> None:
        """Load the plugins now if this registry loads them and has not yet."""
        if self.autoload_plugins and self.plugin_report is None and _plugin_loader is not None:
            _plugin_loader(self)

    def explain(
        self,
        op: str,
        *,
        backend: str | None = None,
        variant: str | None = None,
        platform: PlatformLike = None,
        dtypes: Sequence[str] | None = None,
        traits: Sequence[str] = (),
        strict: bool | None = None,
        call: Call | None = None,
        follow_plan: bool = True,
        bucket: str | None = None,
        autotune: bool | None = None,
    ) -> Decision:
        """The whole decision for ``op`` (cached unless ``call`` is given); it raises only for
        unknown ops and backends (``KeyError`` subclasses). ``follow_plan=False`` ignores a
        loaded plan; with a shape ``bucket`` under the autotune policy, measurements decide."""
        if type(op) is not str:
            check_op_id(op)
        if backend is not None:
            check_name(backend, "backend")
        if variant is not None:
            check_variant(variant)
            if backend is None:  # step 1 reads the variant only with its backend
                raise InvalidSpecError("variant", variant, "give backend= with it")
        # The attributes first, the properties only where unset (a first decision of
        # every op at start-up: benchmarks/bench_sglang.py --startup).
        if self.autoload_plugins and self.plugin_report is None:
            self.ensure_plugins()
        decisions = self._decisions  # before any state is read (see __init__)
        config = self._config or self.config
        if platform is None:
            plat = self._platform or self.platform
        else:  # kernreg.explain passes Platform objects; a string is parsed (and checked)
            plat = platform if isinstance(platform, Platform) else self._parse_platform(platform)
        if isinstance(dtypes, str):  # one dtype
            dtypes = (dtypes,)
        elif dtypes is not None and not isinstance(dtypes, Iterable):
            raise InvalidSpecError("dtypes", dtypes, "expected a dtype name or a sequence of them")
        dtypes = None if dtypes is None else tuple(normalize_dtype(d) for d in dtypes)
        if isinstance(traits, str):  # one trait, as a lone dtype is one dtype
            traits = (traits,)
        needed = frozenset(check_name(t, "traits") for t in traits) if traits else _NO_TRAITS
        pins = pins_for(op) if context_pins() else ()
        for pin in pins:
            note_pin_used(pin)
        tuned = autotune if autotune is not None else bool(config.policy) and config.autotuned(op)
        key = (op, backend, variant, plat, dtypes, needed, strict, pins, follow_plan, bucket, tuned)
        if call is None and (cached := decisions.get(key)) is not None:
            return cached
        specs = self._inventory.get(op)
        plan = self.plan if follow_plan and (self._plan_set or config.plan is not None) else None
        if backend is not None and not any(
            s.backend == backend and (variant is None or s.variant == variant) for s in specs
        ):
            raise BackendNotFoundError(op, backend, variant, tuple(s.label for s in specs))
        planned = None if plan is None else plan.lookup(op, plat, dtypes, bucket if tuned else None)
        demotes = config.demotes(op)
        demoted = None
        if demotes:
            hint = f"kernreg tune --clear-demotions {op} clears it"
            if self is not _default:  # which the command line does not reach (see demote)
                hint = f"registry.clear_demotions({op!r}) on this KernelRegistry clears it"
            demoted = self._demoted.reasons(op, plat, dtypes, specs, bucket, hint)
        decision = decide(
            op,
            specs,
            platform=plat,
            config=config,
            backend=backend,
            variant=variant,
            dtypes=dtypes,
            traits=needed,
            scoped_pins=pins,
            strict=strict,
            call=call,
            planned=planned,
            planned_source="" if plan is None else plan.source,
            autotune=tuned,
            measured=self.measurements(op, plat, dtypes, bucket) if tuned and bucket else None,
            demoted=demoted,
        )
        if decision.plan_miss is not None and (op, plat, dtypes) not in self._plan_warned:
            # Once per decision and plan: a drifted plan must not flood the log per call.
            self._plan_warned.add((op, plat, dtypes))
            warnings.warn(f"op '{op}' on {plat}: {decision.plan_miss}", PlanWarning, stacklevel=3)
        if call is None and not decision.tuning:  # a decision waiting for measurements is not kept
            decisions[key] = decision
            if decision.rule == "reference" and decision.ok and len(specs) > 1:
                _logger.info("op %s falls back to the reference implementation on %s", op, plat)
        return decision

    def _quick_choice(self, op: str) -> KernelSpec | None:
        """select_kernel's counted choice for a call that asks for nothing, when no plan,
        autotune or demotion applies; a tie or nothing eligible raises (decided when read)."""
        if self.autoload_plugins and self.plugin_report is None:
            self.ensure_plugins()
        config = self._config or self.config
        if self._plan_set or config.plan is not None:
            return None
        if (config.policy and config.autotuned(op)) or (config.demote and config.demotes(op)):
            return None
        specs, platform = self._inventory.get(op), self._platform or self.platform
        quick = quick_choice(op, specs, platform, config)
        if quick is None:
            return None
        rule, spec = quick
        count(op, rule, "" if spec is None else spec.label)
        if spec is None:
            error = AmbiguousKernelError if rule == "ambiguous" else NoEligibleKernelError
            raise error(functools.partial(decide, op, specs, platform=platform, config=config))
        return spec

    def _parse_platform(self, text: str, source: str = "platform") -> Platform:
        """A ``platform=`` text, checked as ``--platform`` is (``"gpu"``, ``"h100"`` refused)."""
        return parse_platform(
            text,
            source=source,
            known=lambda: {r.device for spec in self.all_specs() for r in spec.requires},
        )

    # --- tuning -------------------------------------------------------------------------

    @property
    def tuning_store_path(self) -> str:
        """Where :attr:`tuning_store` is opened: ``KERNREG_CACHE_DIR``, else the user cache."""
        folder = self.config.cache_dir
        return os.path.join(folder, "tuning.sqlite3") if folder else TuningStore.default_path()

    @property
    def tuning_store(self) -> TuningStore | None:
        """The store measurements and demotions persist in; ``None`` when it cannot be opened."""
        if self._store is None and not self._store_failed:
            try:
                self._store = TuningStore(self.tuning_store_path)
            except TuningStoreError as exc:
                self._store_failed = True
                why = f"{exc}; autotune results are kept in memory only"
                warnings.warn(why, ConfigWarning, stacklevel=3)
        return self._store

    def use_tuning_store(self, store: TuningStore | None) -> None:
        """Keep measurements in ``store`` (``None``: in memory only), whatever the configured
        cache directory says, until the next call."""
        with self._lock:
            self._forget_store()
            self._store, self._store_failed, self._store_given = store, store is None, True
            self._invalidate()

    def _forget_store(self) -> None:
        # Lock held (or in __init__): measurements and demotions are read from the next store.
        self._store = None
        self._store_failed = False
        self._measured = {}
        self._demoted = DemotionTable(self._existing_store)

    def tuning_key(self, op: str, platform: Platform, dtypes: Dtypes, bucket: str) -> TuningKey:
        return TuningKey(
            op, platform_key(platform), implementations_key(self.get(op)), dtypes or (), bucket
        )

    def measurements(
        self, op: str, platform: Platform, dtypes: Dtypes, bucket: str
    ) -> dict[str, Measurement] | None:
        """What has been measured for this op, platform, dtypes and shape bucket, if anything."""
        key = self.tuning_key(op, platform, dtypes, bucket)
        found = self._measured.get(key)
        if found is None and (store := self.tuning_store) is not None:
            found = store.get(key)
            if found is not None:
                self._measured[key] = found
        return found

    def tuned_buckets(self, op: str, platform: Platform) -> list[tuple[Dtypes, str]]:
        """The (dtypes, shape bucket) pairs with recorded measurements for ``op`` here."""
        here = (platform_key(platform), implementations_key(self.get(op)))
        keys = {key for key in list(self._measured) if key.op == op}  # list: one atomic copy
        if (store := self.tuning_store) is not None:
            keys.update(key for key, _ in store.entries() if key.op == op)
        found = {(k.dtypes, k.bucket) for k in keys if (k.platform, k.implementations) == here}
        return [(dtypes or None, bucket) for dtypes, bucket in sorted(found)]

    def record_measurements(
        self,
        op: str,
        platform: Platform,
        dtypes: Dtypes,
        bucket: str,
        results: Mapping[str, Measurement],
    ) -> dict[str, Measurement]:
        """Keep ``results`` and return what is kept (the first recorded result wins)."""
        key = self.tuning_key(op, platform, dtypes, bucket)
        store = self.tuning_store
        kept = store.put(key, results) if store else dict(self._measured.get(key) or results)
        with self._lock:
            self._measured[key] = kept
        return kept

    # --- demotions (docs/fallbacks.md#sticky-demotion) -----------------------------------

    def demote(
        self,
        decision: Decision,
        error: Exception,
        bucket: str = "-",
        *,
        strict: bool | None = None,
        spec: KernelSpec | None = None,
    ) -> None:
        """Demote ``spec`` (default: ``decision``'s choice), which raised ``error`` in shape
        ``bucket``, for that op, platform and dtypes, with a :class:`DemotionWarning`; in
        strict mode raise :class:`DemotionError` from ``error`` instead."""
        spec = spec or decision.chosen
        op, dtypes = decision.op, decision.dtypes or ()
        assert spec is not None
        text = f"{type(error).__name__}: {error}"
        where = f"{decision.platform}, {', '.join(dtypes) or 'any dtype'}, shape bucket {bucket}"
        if self.config.is_strict(op) if strict is None else strict:
            raise DemotionError(op, spec.label, where, text) from error
        line = " ".join(text.split())  # one line for check, explain and tune --show
        line = line if len(line) <= 400 else line[:397] + "..."
        where_key = platform_key(decision.platform)
        demotion = Demotion(op, implementations_key((spec,)), where_key, dtypes, bucket, line)
        if not self._demoted.add(demotion):  # another thread's call failed first: it warned
            return
        with self._lock:
            self._invalidate()
        count(op, "demoted", spec.label, type(error).__name__)
        clear = f"registry.clear_demotions({op!r}) on the KernelRegistry that demoted it"
        if self is _default:  # the one the command line and default_registry() reach
            clear = (
                f"kernreg tune --clear-demotions {op}, or "
                f"kernreg.default_registry().clear_demotions({op!r})"
            )
        warnings.warn(
            f"op '{op}': {spec.label} raised {text} on {where}; demoted there (KERNREG_DEMOTE), "
            f"its calls fall back by the normal rules; clear it with {clear}",
            DemotionWarning,
            stacklevel=user_stacklevel(),
        )
        if (store := self.tuning_store) is not None:
            try:
                store.demote(demotion)
            except TuningStoreError as exc:
                warnings.warn(f"{exc}; the demotion is kept in memory only", ConfigWarning, 2)

    def _existing_store(self) -> TuningStore | None:
        """The tuning store if it is open or its file exists (reading never creates one)."""
        opened = self._store is not None or os.path.exists(self.tuning_store_path)
        return self.tuning_store if opened else None

    def demoted_buckets(
        self, op: str, platform: Platform, dtypes: Dtypes, spec: KernelSpec
    ) -> dict[str, Demotion]:
        """The demotions of ``spec`` here by shape bucket (empty without the policy)."""
        if not self.config.demotes(op):
            return {}
        return self._demoted.here(op, platform, dtypes).get(implementations_key((spec,)), {})

    def demotions(self, pattern: str = "*") -> tuple[Demotion, ...]:
        """The demotions of ops matching ``pattern`` (an op id or glob), the store's included."""
        return self._demoted.matching(pattern)

    def clear_demotions(self, pattern: str = "*") -> tuple[Demotion, ...]:
        """Forget and return the demotions of ops matching ``pattern``, the store's included."""
        store = self.tuning_store if self.demotions(pattern) else None
        gone = self._demoted.clear(pattern, store.clear_demotions(pattern) if store else ())
        with self._lock:
            self._invalidate()
        return gone

    def select(
        self,
        op: str,
        *,
        backend: str | None = None,
        variant: str | None = None,
        platform: PlatformLike = None,
        dtypes: Sequence[str] | None = None,
        traits: Sequence[str] = (),
        strict: bool | None = None,
        call: Call | None = None,
    ) -> KernelSpec:
        """The spec that runs, or the error that says why none can."""
        if call is None:
            return select_kernel(op, backend, variant, platform, dtypes, traits, strict, self)
        decision = self.explain(
            op,
            backend=backend,
            variant=variant,
            platform=platform,
            dtypes=dtypes,
            traits=traits,
            strict=strict,
            call=call,
        )
        return chosen_or_raise(decision)

    def get_kernel(
        self,
        op: str,
        backend: str | None = None,
        *,
        variant: str | None = None,
        platform: PlatformLike = None,
        dtypes: Sequence[str] | None = None,
        traits: Sequence[str] = (),
        strict: bool | None = None,
    ) -> Callable[..., Any]:
        """The chosen implementation itself, imported once per decision key."""
        return get_kernel(op, backend, variant, platform, dtypes, traits, strict, self)


# The lookups are cached by options, then op; the options are the backend alone when no
# other is given: a tuple key there would cost ~35 ns, a third of sglang's lookup (budget:
# 1.25x). Their parameters are not keyword-only: CPython 3.11 does not specialise such calls
# (another ~50 ns). For the same reason each writes its warm path out instead of calling a
# shared one. The commonest call, ``(op)`` or ``(op, backend)`` on the process-wide registry,
# is answered first, in one expression: 8% fewer instructions than through the general
# path's locals (callgrind; the general path alone is 1.28x-1.33x sglang's time).


def select_kernel(
    op: str,
    backend: str | None = None,
    variant: str | None = None,
    platform: PlatformLike = None,
    dtypes: Sequence[str] | None = None,
    traits: Sequence[str] = (),
    strict: bool | None = None,
    registry: KernelRegistry | None = None,
) -> KernelSpec:
    """The spec that runs for ``op`` (docs/design.md gives the order of the rules)."""
    if (
        registry is None
        and variant is None
        and platform is None
        and dtypes is None
        and strict is None
        and not traits
        and not context_pins()
    ):
        try:
            return _default._chosen[backend][op]
        except (KeyError, TypeError):  # not decided yet; an unhashable backend
            pass
    reg = _default if registry is None else registry
    if variant is None and platform is None and dtypes is None and strict is None and not traits:
        options: Any = backend
    else:
        options = (backend, variant, platform, dtypes, traits, strict)
    cache = reg._chosen  # taken before any state is read (see KernelRegistry)
    pinned = context_pins()
    if not pinned:
        try:
            return cache[options][op]
        except (KeyError, TypeError):  # TypeError: an unhashable argument, decided each time
            pass
        if options is None and (spec := reg._quick_choice(op)) is not None:
            _keep(cache, options, op, spec)  # its explanation is made when asked for
            return spec
    decision = reg.explain(
        op,
        backend=backend,
        variant=variant,
        platform=platform,
        dtypes=dtypes,
        traits=traits,
        strict=strict,
    )
    count_decision(decision)
    spec = chosen_or_raise(decision)
    if not pinned and not decision.tuning:  # a decision waiting for measurements is not kept
        _keep(cache, options, op, spec)
    return spec


def get_kernel(
    op: str,
    backend: str | None = None,
    variant: str | None = None,
    platform: PlatformLike = None,
    dtypes: Sequence[str] | None = None,
    traits: Sequence[str] = (),
    strict: bool | None = None,
    registry: KernelRegistry | None = None,
) -> Callable[..., Any]:
    """The chosen implementation itself (not a wrapper), imported once per decision key."""
    if (
        registry is None
        and variant is None
        and platform is None
        and dtypes is None
        and strict is None
        and not traits
        and not context_pins()
    ):
        try:
            return _default._kernels[backend][op]
        except (KeyError, TypeError):  # not decided yet; an unhashable backend
            pass
    reg = _default if registry is None else registry
    if variant is None and platform is None and dtypes is None and strict is None and not traits:
        options: Any = backend
    else:
        options = (backend, variant, platform, dtypes, traits, strict)
    cache = reg._kernels  # taken before any state is read (see KernelRegistry)
    if not context_pins():
        try:
            return cache[options][op]
        except (KeyError, TypeError):  # TypeError: an unhashable argument, decided each time
            pass
    kernel = select_kernel(op, backend, variant, platform, dtypes, traits, strict, reg).load()
    if not context_pins():
        _keep(cache, options, op, kernel)
    return kernel


def _keep(cache: dict[Any, dict[str, Any]], options: Any, op: str, value: Any) -> None:
    try:  # not contextlib.suppress: a tenth of a first decision (bench_sglang.py --startup)
        by_op = cache.get(options)
    except TypeError:  # an unhashable argument: not kept
        return
    if by_op is None:  # not setdefault: a dict for every first decision
        by_op = cache[options] = {}
    by_op[op] = value


def explain(
    op: str,
    *,
    backend: str | None = None,
    variant: str | None = None,
    platform: PlatformLike = None,
    dtypes: Sequence[str] | None = None,
    traits: Sequence[str] = (),
    strict: bool | None = None,
    registry: KernelRegistry | None = None,
) -> Decision:
    """The whole decision for ``op``: every candidate, eligible or not, with its reasons."""
    return (_default if registry is None else registry).explain(
        op,
        backend=backend,
        variant=variant,
        platform=platform,
        dtypes=dtypes,
        traits=traits,
        strict=strict,
    )


def _by_token(token: str) -> KernelRegistry:
    for reg in list(_registries):
        if reg._token == token:
            return reg
    raise TypeError("registry= is not a KernelRegistry made by KernelRegistry() (a copy?)")


def _traced_route(lookup: Callable[..., Any], prefix: str) -> Callable[..., Any]:
    """What dynamo traces instead of ``lookup``: the answer found for real, read through a
    registry attribute that a mutation clears (so the region is traced again)."""

    @run_while_tracing  # dynamo can neither take the lock nor read the pins
    def answer(blocks: str, token: str | None, *args: Any) -> str:
        # The registry by its token: torch < 2.13 passes only constants to this function.
        reg = _default if token is None else _by_token(token)
        try:
            found = lookup(*args, reg)
        except Exception as exc:  # reaches the caller with its own type, as eager calls do
            raise through_the_compiler(exc) from exc.__cause__
        name = f"{prefix}_{id(found):x}"  # one attribute per answer, whichever thread traces
        setattr(reg._traced, name, found)
        return name

    def traced(
        op: str,
        backend: str | None = None,
        variant: str | None = None,
        platform: PlatformLike = None,
        dtypes: Sequence[str] | None = None,
        traits: Sequence[str] = (),
        strict: bool | None = None,
        registry: KernelRegistry | None = None,
    ) -> Any:
        # Spelled out: dynamo runs for real only arguments it can name. The open use_backend
        # blocks are passed so that a compiled region guards on them.
        args = (op, backend, variant, platform, dtypes, traits, strict)
        name = answer(open_blocks.key, None if registry is None else registry._token, *args)
        return getattr((_default if registry is None else registry)._traced, name)

    return traced


inline_instead(select_kernel, _traced_route(select_kernel, "spec"))
inline_instead(get_kernel, _traced_route(get_kernel, "kernel"))


def find_ambiguities(registry: KernelRegistry | None = None) -> tuple[Ambiguity, ...]:
    """Every pair of same-op, equal-priority, non-reference specs of ``registry`` whose
    requirements and dtypes intersect (``when`` predicates count as overlapping)."""
    reg = _default if registry is None else registry
    return find_ambiguities_in({op: reg.get(op) for op in reg.ops()})


def chosen_or_raise(decision: Decision) -> KernelSpec:
    """Turn a decision into its chosen spec, or the exception that explains why there is none."""
    if decision.chosen is None:
        error = AmbiguousKernelError if decision.rule == "ambiguous" else NoEligibleKernelError
        raise error(decision)
    if decision.strict_error:
        raise StrictFallbackError(
            decision,
            f"Strict mode: op '{decision.op}' would fall back to its reference "
            f"'{decision.chosen.label}' because no other implementation is eligible",
        )
    return decision.chosen


def _environment_config() -> Config:
    """The environment's configuration, warning once about each unknown variable."""
    config = load_config()
    if config.stats_file:
        export_at_exit(config.stats_file)
    for var in config.unknown:
        if var not in _warned_unknown:
            _warned_unknown.add(var)
            warnings.warn(unknown_variable_hint(var) + " (ignored)", ConfigWarning, stacklevel=4)
    if config.backend is not None:
        _logger.warning(
            "KERNREG_BACKEND=%s: that backend is used wherever it is eligible", config.backend
        )
    return config


def use_plugin_loader(loader: Callable[[Any], object]) -> None:
    """Load plugins with ``loader(registry)``, once per autoloading registry."""
    global _plugin_loader
    _plugin_loader = loader


def build_plan(
    registry: KernelRegistry | None = None,
    *,
    platforms: Sequence[Platform | str] = (),
    follow_plan: bool = False,
) -> SelectionPlan:
    """Decide every op of ``registry`` on each platform (default: this one), dtype set and
    measured or demoted shape bucket; ``follow_plan=False`` ignores a loaded plan."""
    reg = _default if registry is None else registry
    given = [
        p if isinstance(p, Platform) else reg._parse_platform(p, "platforms") for p in platforms
    ]
    plats = given or [reg.platform]
    return plan_of(reg, plats, follow_plan=follow_plan, platform_key=platform_key)


def fingerprint(
    registry: KernelRegistry | None = None, *, platforms: Sequence[Platform | str] = ()
) -> str:
    """A hash of the effective decisions (a loaded plan included), stable across processes
    and import orders: equal on two ranks exactly when they run the same kernels."""
    return build_plan(registry, platforms=platforms, follow_plan=True).fingerprint()


# --- every live registry ---------------------------------------------------------------------


def every_subscriber() -> list[Any]:
    """What every live registry notifies of its changes (op objects, kernelized layers)."""
    found: list[Any] = []
    for reg in list(_registries):
        with reg._lock:
            found.extend(reg._subscribers)
    return found


@contextlib.contextmanager
def use_backend(pattern: str, backend: str, variant: str | None = None) -> Iterator[Pin]:
    """Pin ops matching ``pattern`` (an op id or glob) to ``backend`` within the block, for
    this context only, over configured pins and strict like them; a block that pinned
    nothing warns why (a ``ConfigWarning``)."""
    with pin_block(pattern, backend, variant) as pin:
        yield pin
        used = pin_was_used(pin)
    # Checked at the end: ops may be registered inside the block.
    why = None if used else _unmatched_pattern_hint(pattern)
    if why is not None:
        message = f"use_backend({pattern!r}, {backend!r}) pinned nothing: {why}"
        # stacklevel 3: this generator, contextlib's __exit__, the `with` statement.
        warnings.warn(message, ConfigWarning, stacklevel=3)


def process_state_changed() -> None:
    """Forget the cached decisions of every registry: call it when state that a
    process-state ``when`` predicate (one taking no arguments) reads has changed."""
    for reg in list(_registries):
        with reg._lock:
            reg._invalidate()


def _unmatched_pattern_hint(pattern: str) -> str | None:
    """``None`` when an op of some live registry matches ``pattern``, else why not. Plugins
    are loaded only when nothing registered now matches: one of them may register the op."""
    registries = list(_registries)
    known: set[str] = set()
    for load_plugins in (False, True):
        for reg in registries:
            try:
                if load_plugins:
                    reg.ensure_plugins()
            except KernregError:  # a plugin that fails says so where the registry is used
                return None
            with reg._lock:
                ops = list(reg._inventory.specs)
            if any(fnmatchcase(op, pattern) for op in ops):
                return None
            known.update(ops)
    hint = "" if any(ch in pattern for ch in "*?[") else did_you_mean(close_op_ids(pattern, known))
    return "it matches no registered op" + (f"; {hint}" if hint else "")


# --- the process-wide registry ---------------------------------------------------------------

_default = KernelRegistry()
_default.autoload_plugins = True


def default_registry() -> KernelRegistry:
    """The process-wide registry."""
    return _default


def register_kernel(spec: KernelSpec, *, replace: bool = False) -> KernelSpec:
    """Register ``spec`` in the process-wide registry."""
    return _default.register(spec, replace=replace)


def __getattr__(name: str) -> Any:
    """``kernreg.registry.<attribute>``: the 0.1 spelling of the process-wide registry."""
    if name.startswith("_") or not (hasattr(KernelRegistry, name) or name in vars(_default)):
        raise AttributeError(f"module 'kernreg.registry' has no attribute {name!r}")
    warnings.warn(
        f"kernreg.registry is the module, not the process-wide registry: use "
        f"kernreg.default_registry().{name} (kernreg.registry.{name} goes in the next release)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(_default, name)

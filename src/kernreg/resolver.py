"""The resolver: the inventory plus what a decision reads (configuration, platform,
selection plan, tuning store and measurements) and the decisions it keeps
(:meth:`Resolver.explain`, :meth:`Resolver.select`, :meth:`Resolver.get_kernel`)."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from kernreg._names import check_name, check_op_id, check_variant
from kernreg.config import (
    Config,
    ConfigWarning,
    load_config,
    unknown_variable_hint,
    use_lock_loader,
)
from kernreg.errors import (
    AmbiguousKernelError,
    BackendNotFoundError,
    InvalidSpecError,
    NoEligibleKernelError,
    StrictFallbackError,
)
from kernreg.inventory import Inventory, user_stacklevel
from kernreg.pins import context_pins, note_pin_used, pins_for
from kernreg.platform import Platform
from kernreg.selection import Call, Decision, decide
from kernreg.spec import KernelSpec

if TYPE_CHECKING:
    from kernreg.measurement import Measurement
    from kernreg.plan import SelectionPlan
    from kernreg.tuning import TuningKey, TuningStore

__all__ = ["Resolver", "chosen_or_raise", "use_plugin_loader"]


def _log(level: str, message: str, *args: object) -> None:
    getattr(logging.getLogger("kernreg"), level)(message, *args)


class Resolver(Inventory):
    """The inventory and the decisions made from it: ``config`` and ``platform`` default to
    the environment (read once, at first use) and detection; every mutation of the
    inventory empties the kept decisions."""

    def __init__(self, *, config: Config | None = None, platform: Platform | None = None) -> None:
        super().__init__()
        self._decisions: dict[tuple[Any, ...], Decision] = {}
        #: Warm lookups, emptied by every mutation. get_kernel(op) and get_kernel(op, backend)
        #: read ``_warm_kernels[op]`` and ``_warm_by_backend[backend][op]``, select(op,
        #: backend) reads ``_warm_specs[backend][op]``: nested dicts, so a warm call builds
        #: and hashes no tuple, and no key of one kind can be mistaken for another.
        self._warm_kernels: dict[str, Callable[..., Any]] = {}
        self._warm_by_backend: dict[str, dict[str, Callable[..., Any]]] = {}
        self._warm_specs: dict[str | None, dict[str, KernelSpec]] = {}
        #: get_kernel's implementations under every argument (the calls that are not warm).
        self._kernels: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self._caches.extend(
            (
                self._decisions,
                self._warm_kernels,
                self._warm_by_backend,
                self._warm_specs,
                self._kernels,
            )
        )
        self._config = config
        self._platform = platform
        self._plan: SelectionPlan | None = None
        self._plan_set = False
        self._plan_warned: set[tuple[str, Platform, tuple[str, ...] | None]] = set()
        self._plan_checked: tuple[SelectionPlan | None, Platform | None] = (None, None)
        self._store: TuningStore | None = None
        self._store_failed = False
        self._measured: dict[TuningKey, dict[str, Measurement]] = {}
        #: Whether the first selection loads plugins from entry points (the default registry does).
        self.autoload_plugins = False
        self.plugin_report: Any = None

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
        from kernreg._packages import clear_cache

        clear_cache()
        with self._lock:
            self._config = config
            self._platform = platform
            self._invalidate()

    @property
    def platform(self) -> Platform:
        """The platform decisions are made for: configured, else detected once."""
        platform = self._platform
        if platform is None:
            # Detection imports torch (about 1.5 s): never under the lock (see ``config``).
            detected = self.config.platform or _torch_cut_by_fork() or Platform.detect()
            with self._lock:
                if self._platform is None:
                    self._platform = detected
                platform = self._platform
        return platform

    @property
    def plan(self) -> SelectionPlan | None:
        """The selection plan every decision follows: set by :meth:`use_plan`, else
        ``KERNREG_LOCK``, else none."""
        plan = self._plan if self._plan_set else cast("SelectionPlan | None", self.config.plan)
        checked = self._plan_checked
        if plan is not None and (checked[0] is not plan or checked[1] != self._platform):
            self._check_plan(plan)
        return plan

    def _check_plan(self, plan: SelectionPlan) -> None:
        """Warn once (``PlanWarning``) when ``plan`` decides nothing this process decides."""
        from kernreg.plan import PlanWarning, plan_mismatch

        platform = self.platform
        self._plan_checked = (plan, self._platform)
        why = plan_mismatch(plan, platform, self.ops())
        if why is not None:
            warnings.warn(why, PlanWarning, stacklevel=user_stacklevel())

    def use_plan(self, plan: SelectionPlan | None) -> None:
        """Follow ``plan`` from now on (``None``: follow none, whatever ``KERNREG_LOCK`` says)."""
        with self._lock:
            self._plan, self._plan_set = plan, True
            self._plan_warned.clear()
            self._invalidate()

    def _snapshot(self) -> tuple[Any, ...]:
        with self._lock:
            return (
                super()._snapshot(),
                self._config,
                self._platform,
                self.autoload_plugins,
                self.plugin_report,
                self._plan,
                self._plan_set,
            )

    def _restore(self, saved: tuple[Any, ...]) -> None:
        with self._lock:
            (
                inventory,
                self._config,
                self._platform,
                self.autoload_plugins,
                self.plugin_report,
                self._plan,
                self._plan_set,
            ) = saved
            super()._restore(inventory)

    def _settings(self) -> tuple[Any, ...]:
        """What ``freeze``, ``configure``, ``use_plan`` and ``use_tuning_store`` change."""
        with self._lock:
            return (
                self._frozen,
                self._config,
                self._platform,
                self._plan,
                self._plan_set,
                self._store,
                self._store_failed,
            )

    def _restore_settings(self, saved: tuple[Any, ...]) -> None:
        """Put back what :meth:`_settings` returned (a failed plugin's changes are undone)."""
        with self._lock:
            if saved == self._settings():
                return
            (
                self._frozen,
                self._config,
                self._platform,
                self._plan,
                self._plan_set,
                self._store,
                self._store_failed,
            ) = saved
            self._plan_warned.clear()
            self._invalidate()

    # --- decisions ----------------------------------------------------------------------

    def _ensure_plugins(self) -> None:
        if self.autoload_plugins and self.plugin_report is None and _plugin_loader:
            _plugin_loader[0](self)

    def explain(
        self,
        op: str,
        *,
        backend: str | None = None,
        variant: str | None = None,
        platform: Platform | None = None,
        dtypes: Sequence[str] | None = None,
        traits: Sequence[str] = (),
        strict: bool | None = None,
        call: Call | None = None,
        follow_plan: bool = True,
        bucket: str | None = None,
        autotune: bool | None = None,
    ) -> Decision:
        """The whole decision for ``op`` (cached unless ``call`` is given). Never raises for
        an empty or ambiguous outcome; unknown ops and backends raise ``KeyError`` subclasses.

        ``follow_plan=False`` ignores a loaded selection plan: what would be chosen now.
        ``bucket`` is the call's shape bucket, for the autotune policy (``autotune``,
        default ``KERNREG_POLICY``): with it, recorded measurements decide.
        """
        if type(op) is not str:
            check_op_id(op)
        if backend is not None:
            check_name(backend, "backend")
        if variant is not None:
            check_variant(variant)
        self._ensure_plugins()
        config = self.config
        if platform is None:
            plat = self.platform
        else:  # kernreg.explain passes Platform objects; a string is parsed (and checked)
            plat = platform if isinstance(platform, Platform) else self._parse_platform(platform)
        dtype_key = None if dtypes is None else _dtype_key(dtypes)
        if isinstance(traits, str):  # one trait, as a lone dtype is one dtype
            traits = (traits,)
        trait_key = frozenset(check_name(t, "traits") for t in traits) if traits else frozenset()
        pins = pins_for(op) if context_pins() else ()
        for pin in pins:
            note_pin_used(pin)
        tuned = config.autotuned(op) if autotune is None else autotune
        key = (
            op,
            backend,
            variant,
            plat,
            dtype_key,
            trait_key,
            strict,
            pins,
            follow_plan,
            bucket,
            tuned,
        )
        if call is None:
            cached = self._decisions.get(key)
            if cached is not None:
                return cached
        generation = self._generation
        specs = self.get(op)
        plan = self.plan if follow_plan else None
        planned = (
            plan.lookup(op, plat, dtype_key, bucket if tuned else None)
            if plan is not None
            else None
        )
        if backend is not None and not any(
            s.backend == backend and (variant is None or s.variant == variant) for s in specs
        ):
            raise BackendNotFoundError(op, backend, variant, tuple(s.label for s in specs))
        decision = decide(
            op,
            specs,
            platform=plat,
            config=config,
            backend=backend,
            variant=variant,
            dtypes=dtype_key,
            traits=trait_key,
            scoped_pins=pins,
            strict=strict,
            call=call,
            planned=planned,
            planned_source=plan.source if plan is not None else "",
            autotune=tuned,
            measured=self.measurements(op, plat, dtype_key, bucket) if tuned and bucket else None,
        )
        if decision.plan_miss is not None and (op, plat, dtype_key) not in self._plan_warned:
            # Once per decision and plan: a drifted plan must not flood the log per call.
            self._plan_warned.add((op, plat, dtype_key))
            from kernreg.plan import PlanWarning

            warnings.warn(f"op '{op}' on {plat}: {decision.plan_miss}", PlanWarning, stacklevel=3)
        if call is None and not decision.tuning:  # a decision waiting for measurements is not kept
            with self._lock:
                if self._generation == generation:
                    self._decisions[key] = decision
            if decision.rule == "reference" and decision.ok and len(specs) > 1:
                _log("info", "op %s falls back to the reference implementation on %s", op, plat)
        return decision

    def _parse_platform(self, text: str) -> Platform:
        """A ``platform=`` text, checked as ``--platform`` is (``"gpu"``, ``"h100"`` refused)."""
        from kernreg.platform import parse_platform

        return parse_platform(
            text,
            source="platform",
            known=lambda: {r.device for spec in self.all_specs() for r in spec.requires},
        )

    # --- tuning -------------------------------------------------------------------------

    @property
    def tuning_store(self) -> TuningStore | None:
        """The store measurements persist in (``KERNREG_CACHE_DIR``, else the user cache
        directory); ``None`` when it cannot be opened, and measurements stay in memory."""
        if self._store is None and not self._store_failed:
            from kernreg.tuning import TuningStore, TuningStoreError

            cache_dir = self.config.cache_dir
            try:
                self._store = TuningStore(
                    os.path.join(cache_dir, "tuning.sqlite3") if cache_dir else None
                )
            except TuningStoreError as exc:
                self._store_failed = True
                warnings.warn(
                    f"{exc}; autotune results are kept in memory only", ConfigWarning, stacklevel=3
                )
        return self._store

    def use_tuning_store(self, store: TuningStore | None) -> None:
        """Keep measurements in ``store`` (``None``: in memory only)."""
        with self._lock:
            self._store, self._store_failed = store, store is None
            self._invalidate()

    def tuning_key(
        self, op: str, platform: Platform, dtypes: tuple[str, ...] | None, bucket: str
    ) -> TuningKey:
        from kernreg.autotune import implementations_key, platform_key
        from kernreg.tuning import TuningKey

        return TuningKey(
            op, platform_key(platform), implementations_key(self.get(op)), dtypes or (), bucket
        )

    def measurements(
        self, op: str, platform: Platform, dtypes: tuple[str, ...] | None, bucket: str
    ) -> dict[str, Measurement] | None:
        """What has been measured for this op, platform, dtypes and shape bucket, if anything."""
        key = self.tuning_key(op, platform, dtypes, bucket)
        found = self._measured.get(key)
        if found is None:
            store = self.tuning_store
            found = store.get(key) if store is not None else None
            if found is not None:
                self._measured[key] = found
        return found

    def tuned_buckets(
        self, op: str, platform: Platform
    ) -> list[tuple[tuple[str, ...] | None, str]]:
        """The (dtypes, shape bucket) pairs with recorded measurements for ``op`` here."""
        from kernreg.autotune import implementations_key, platform_key

        wanted = (op, platform_key(platform), implementations_key(self.get(op)))
        keys = set(self._measured)
        store = self.tuning_store
        if store is not None:
            keys.update(key for key, _ in store.entries() if key.op == op)
        found = {
            (key.dtypes or None, key.bucket)
            for key in keys
            if (key.op, key.platform, key.implementations) == wanted
        }
        return sorted(found, key=lambda item: (item[0] or (), item[1]))

    def record_measurements(
        self,
        op: str,
        platform: Platform,
        dtypes: tuple[str, ...] | None,
        bucket: str,
        results: Mapping[str, Measurement],
    ) -> dict[str, Measurement]:
        """Keep ``results``; returns what is kept now (the first recorded result wins, so
        processes tuning at once agree)."""
        key = self.tuning_key(op, platform, dtypes, bucket)
        store = self.tuning_store
        kept = (
            store.put(key, results)
            if store is not None
            else dict(self._measured.get(key) or results)
        )
        with self._lock:
            self._measured[key] = kept
        return kept

    def select(
        self,
        op: str,
        *,
        backend: str | None = None,
        variant: str | None = None,
        platform: Platform | None = None,
        dtypes: Sequence[str] | None = None,
        traits: Sequence[str] = (),
        strict: bool | None = None,
        call: Call | None = None,
    ) -> KernelSpec:
        """The spec that runs, or the error that says why none can."""
        warm = (
            type(op) is str
            and variant is None
            and platform is None
            and dtypes is None
            and traits is _NO_ITEMS
            and strict is None
            and call is None
            and (backend is None or type(backend) is str)
            and not context_pins()
        )
        if warm:  # the common case keeps a decided spec under backend, then op
            spec: KernelSpec | None = self._warm_specs.get(backend, _NOTHING_KEPT).get(op)
            if spec is not None:
                return spec
        generation = self._generation
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
        spec = chosen_or_raise(decision)
        if warm and not decision.tuning:
            with self._lock:
                if self._generation == generation:
                    self._warm_specs.setdefault(backend, {})[op] = spec
        return spec

    def get_kernel(
        self,
        op: str,
        backend: str | None = None,
        *,
        variant: str | None = None,
        platform: Platform | None = None,
        dtypes: Sequence[str] | None = None,
        traits: Sequence[str] = (),
        strict: bool | None = None,
    ) -> Callable[..., Any]:
        """The chosen implementation itself, imported once per decision key."""
        # The common call, get_kernel(op) or get_kernel(op, backend), is a warm lookup
        # while no use_backend block is open (see _warm_kernels).
        warm = (
            type(op) is str
            and variant is None
            and platform is None
            and dtypes is None
            and traits is _NO_ITEMS
            and strict is None
            and (backend is None or type(backend) is str)
            and not context_pins()
        )
        if warm:
            kept = (
                self._warm_kernels
                if backend is None
                else self._warm_by_backend.get(backend, _NOTHING_KEPT)
            )
            kernel = kept.get(op)
            if kernel is not None:
                return kernel
        key: tuple[Any, ...] | None
        pins = pins_for(op) if not warm and context_pins() else ()
        try:
            key = (
                op,
                backend,
                variant,
                platform,
                None if dtypes is None else tuple(dtypes),
                tuple(traits),
                strict,
                pins,
            )
            kernel = self._kernels.get(key)
        except TypeError:  # a malformed or unhashable argument: select() below names it
            kernel = key = None
        if kernel is not None:
            return kernel
        generation = self._generation
        spec = self.select(
            op,
            backend=backend,
            variant=variant,
            platform=platform,
            dtypes=dtypes,
            traits=traits,
            strict=strict,
        )
        kernel = spec.load()
        with self._lock:
            if self._generation == generation and key is not None:
                self._kernels[key] = kernel
                if warm:
                    if backend is None:
                        self._warm_kernels[op] = kernel
                    else:
                        self._warm_by_backend.setdefault(backend, {})[op] = kernel
        return kernel


#: The default of ``traits``: the empty tuple is a singleton, so ``is`` tells it apart.
_NO_ITEMS: tuple[()] = ()
#: What a warm lookup reads for a backend with nothing kept yet (never written to).
_NOTHING_KEPT: dict[str, Any] = {}


def chosen_or_raise(decision: Decision) -> KernelSpec:
    """Turn a decision into its chosen spec, or the exception that explains why there is none."""
    if decision.chosen is None:
        if decision.rule == "ambiguous":
            raise AmbiguousKernelError(decision)
        headline = f"No eligible kernel for op '{decision.op}'"
        raise NoEligibleKernelError(
            decision, f"{headline}: {decision.reason}" if decision.reason else headline
        )
    if decision.strict_error:
        raise StrictFallbackError(
            decision,
            f"Strict mode: op '{decision.op}' would fall back to its reference "
            f"'{decision.chosen.label}' because no other implementation is eligible",
        )
    return decision.chosen


def _dtype_key(dtypes: Sequence[str]) -> tuple[str, ...]:
    from kernreg.dtypes import normalize_dtype

    if isinstance(dtypes, str):
        dtypes = (dtypes,)
    elif not isinstance(dtypes, Iterable):
        raise InvalidSpecError("dtypes", dtypes, "expected a dtype name or a sequence of them")
    return tuple(normalize_dtype(d) for d in dtypes)


_warned_unknown: set[str] = set()


def _environment_config() -> Config:
    config = load_config()
    for var in config.unknown:
        if var not in _warned_unknown:
            _warned_unknown.add(var)
            warnings.warn(unknown_variable_hint(var) + " (ignored)", ConfigWarning, stacklevel=4)
    if config.backend is not None:
        _log(
            "warning",
            "KERNREG_BACKEND=%s: that backend is used wherever it is eligible",
            config.backend,
        )
    return config


_torch_half_imported = False


def _note_torch_in_child() -> None:
    """After ``os.fork``: whether another thread was importing torch at the fork."""
    global _torch_half_imported
    torch = sys.modules.get("torch")
    _torch_half_imported = bool(getattr(getattr(torch, "__spec__", None), "_initializing", False))


def _torch_cut_by_fork() -> Platform | None:
    """A CPU platform when this process was forked while another thread imported torch:
    that import never finishes here (its thread is gone), so detection must not wait on it."""
    if not _torch_half_imported:
        return None
    return Platform(
        "cpu",
        source="forked while another thread was importing torch; torch is unusable in this "
        "process (import torch before forking, or set KERNREG_PLATFORM)",
    )


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_note_torch_in_child)


def _load_plan(path: str) -> tuple[SelectionPlan | None, str]:
    """The plan ``KERNREG_LOCK`` names, or why the file is none (for the ConfigError)."""
    from kernreg.plan import PlanError, SelectionPlan

    try:
        return SelectionPlan.load(path), ""
    except PlanError as exc:
        return None, str(exc)


use_lock_loader(_load_plan)

#: Loads the plugins of a registry whose ``autoload_plugins`` is set, on its first
#: decision; installed by the layer that owns plugins (the ``kernreg`` package).
_plugin_loader: list[Callable[[Any], object]] = []


def use_plugin_loader(loader: Callable[[Any], object]) -> None:
    """Load plugins with ``loader(registry)`` (once per autoloading registry)."""
    _plugin_loader[:] = [loader]

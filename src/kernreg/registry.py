"""The inventory: :class:`KernelRegistry`, its conflict rules, and cached decisions."""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kernreg._frozen import Frozen
from kernreg._names import check_name, check_op_glob, check_op_id, check_variant, label
from kernreg.config import Config, ConfigWarning, Pin, load_config, unknown_variable_hint
from kernreg.errors import (
    AmbiguousKernelError,
    BackendNotFoundError,
    DuplicateReferenceError,
    InvalidSpecError,
    KernelConflictError,
    NoEligibleKernelError,
    OpNotFoundError,
    RegistryFrozenError,
    StrictFallbackError,
)
from kernreg.platform import Platform
from kernreg.selection import Call, Decision, decide
from kernreg.spec import KernelSpec, Origin, target_name

if TYPE_CHECKING:
    from kernreg.plan import SelectionPlan
    from kernreg.tuning import Measurement, TuningKey, TuningStore

__all__ = [
    "KernelRegistry",
    "Override",
    "default_registry",
    "process_state_changed",
    "register_kernel",
    "use_backend",
]


def _log(level: str, message: str, *args: object) -> None:
    # logging costs ~3 ms to import; only decisions that have something to report load it.
    import logging

    getattr(logging.getLogger("kernreg"), level)(message, *args)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

#: The distribution whose plugin is being loaded, so its specs are attributed to it.
current_distribution: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "kernreg_current_distribution", default=None
)


#: One Origin per call site and distribution: specs registered from one line share it.
#: Keyed by the code object's id; the Origin holds the code object, so the id stays its own.
_origins: dict[tuple[int, int, tuple[str, str] | None], Origin] = {}
_unknown_origins: dict[tuple[str, str] | None, Origin] = {}


def caller_origin(depth: int = 1) -> Origin:
    """file:line of the first frame outside kernreg: the user's registering call.

    The walk starts ``depth`` frames up (1: the caller of this function; a kernreg caller
    may skip itself, which spares creating its frame object). Origins are shared per call
    site and read their line only when asked, so attaching one costs a frame walk and a
    dict lookup.
    """
    frame: FrameType | None
    try:
        frame = sys._getframe(depth)
    except ValueError:  # called with fewer Python frames above (from C, say)
        frame = None
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    dist = current_distribution.get()
    if frame is None:
        origin = _unknown_origins.get(dist)
        if origin is None:
            distribution, version = dist or (None, None)
            origin = _unknown_origins[dist] = Origin("<unknown>", 0, distribution, version)
        return origin
    code = frame.f_code
    offset = frame.f_lasti
    key = (id(code), offset, dist)
    origin = _origins.get(key)
    if origin is None:
        if len(_origins) >= 4096:  # code generated at run time could make call sites unbounded
            _origins.clear()
        distribution, version = dist or (None, None)
        origin = _origins[key] = Origin.at(code, offset, distribution, version)
    return origin


#: The (backend, variant) keys of the specs of every op, one shared tuple per pair.
_slots: dict[str, tuple[str, str]] = {}
_variant_slots: dict[tuple[str, str], tuple[str, str]] = {}


def _slot(backend: str, variant: str) -> tuple[str, str]:
    if variant == "":
        slot = _slots.get(backend)
        if slot is None:
            if len(_slots) >= 4096:
                _slots.clear()
            slot = _slots[backend] = (backend, "")
        return slot
    pair = (backend, variant)
    if len(_variant_slots) >= 4096:
        _variant_slots.clear()
    return _variant_slots.setdefault(pair, pair)


#: While a plugin loads, every change it makes is journaled so a failure can be undone whole.
_journal: contextvars.ContextVar[
    list[tuple[KernelRegistry, tuple[str, str, str], KernelSpec | None]] | None
] = contextvars.ContextVar("kernreg_journal", default=None)


class Override(Frozen):
    """A deliberate change of an existing registration: ``replace=True`` or ``unregister``."""

    __slots__ = ("kind", "old", "new", "origin")
    kind: Literal["replace", "unregister"]
    old: KernelSpec
    new: KernelSpec | None
    origin: Origin

    def __init__(
        self,
        kind: Literal["replace", "unregister"],
        old: KernelSpec,
        new: KernelSpec | None,
        origin: Origin,
    ) -> None:
        self._set("kind", kind)
        self._set("old", old)
        self._set("new", new)
        self._set("origin", origin)

    @property
    def key(self) -> tuple[str, str, str]:
        return self.old.key

    def __str__(self) -> str:
        if self.new is None:
            return f"op '{self.old.op}', backend '{self.old.label}': unregistered at {self.origin} (was {self.old.target_name} from {self.old.origin})"
        return (
            f"op '{self.old.op}', backend '{self.old.label}': {self.old.target_name} ({self.old.origin}) "
            f"replaced by {self.new.target_name} ({self.new.origin})"
        )


class _Subscriber(Protocol):
    def invalidate(self) -> None: ...


def _describe_difference(old: KernelSpec, new: KernelSpec) -> str:
    if old.target != new.target:
        return f"'{old.target_name}' != '{new.target_name}'"
    diffs = []
    for name in KernelSpec._compare:  # the key fields are equal, the target was compared above
        a, b = getattr(old, name), getattr(new, name)
        if a != b:
            show = (lambda v: sorted(str(x) for x in v)) if isinstance(a, frozenset) else repr
            diffs.append(f"{name} {show(a)} != {show(b)}")
    return ", ".join(diffs)


def _reloaded(old: KernelSpec, new: KernelSpec) -> bool:
    """Whether ``new`` is ``old`` registered again by a reloaded module: the same call site
    and fields, with function objects of the same names compiled anew (a reload recompiles
    the module; a helper registering a closure per call reuses one code object)."""
    if isinstance(old.target, str) or isinstance(new.target, str):
        return False
    if old.target_name != new.target_name or old.origin is None or new.origin is None:
        return False
    if (old.origin.file, old.origin.line) != (new.origin.file, new.origin.line):
        return False
    if _same_code(old.target, new.target):
        return False
    if old.when != new.when and not (
        callable(old.when)
        and callable(new.when)
        and target_name(old.when) == target_name(new.when)
        and not _same_code(old.when, new.when)
    ):
        return False
    unchanged = (f for f in KernelSpec._compare if f not in ("target", "when"))
    return all(getattr(old, f) == getattr(new, f) for f in unchanged)


def _same_code(a: object, b: object) -> bool:
    """Whether two different callables run one compiled body (closures of one definition)."""
    if a is b:
        return False
    code = getattr(a, "__code__", None)
    return code is not None and code is getattr(b, "__code__", None)


def _conflict_message(old: KernelSpec, new: KernelSpec) -> str:
    return (
        f"Conflicting kernel registration for op '{old.op}', backend '{old.label}': "
        f"{_describe_difference(old, new)}\n"
        f"  registered first at: {old.origin}\n"
        f"  registered again at: {new.origin}\n"
        "To override on purpose, register the new one with replace=True (or unregister the "
        "first); to keep both, give one of them a different variant."
    )


#: Every live registry: a forked child gives each a fresh lock, and a change of process
#: state reaches all their cached decisions.
_registries: weakref.WeakSet[KernelRegistry] = weakref.WeakSet()


class KernelRegistry:
    """The inventory of implementations, keyed by ``(op, backend, variant)``.

    Mutations are thread-safe and invalidate every cached decision. ``config`` and
    ``platform`` default to the environment (read once, at first use) and detection.
    """

    def __init__(self, *, config: Config | None = None, platform: Platform | None = None) -> None:
        self._lock = threading.RLock()
        _registries.add(self)
        self._specs: dict[str, dict[tuple[str, str], KernelSpec]] = {}
        self._sorted: dict[str, tuple[KernelSpec, ...]] = {}
        self._references: dict[str, KernelSpec] = {}
        self._overrides: list[Override] = []
        self._frozen = False
        self._generation = 0
        self._decisions: dict[tuple[Any, ...], Decision] = {}
        #: Warm lookups, emptied by every mutation: get_kernel's implementations (keyed by
        #: op, (op, backend) or every argument) and select's specs ((op, backend, _SELECTED)).
        self._kernels: dict[Any, Any] = {}
        self._subscribers: weakref.WeakSet[Any] = weakref.WeakSet()
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
        """Replace the configuration (``None``: re-read the environment) and the platform."""
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
        plan = self._plan if self._plan_set else self.config.plan
        checked = self._plan_checked
        if plan is not None and (checked[0] is not plan or checked[1] != self._platform):
            self._check_plan(plan)
        return plan

    def _check_plan(self, plan: SelectionPlan) -> None:
        """Warn once (``PlanWarning``) when ``plan`` decides nothing this process decides."""
        from kernreg.plan import PlanWarning, plan_mismatch
        from kernreg.plugins import _user_stacklevel

        platform = self.platform
        self._plan_checked = (plan, self._platform)
        why = plan_mismatch(plan, platform, self.ops())
        if why is not None:
            warnings.warn(why, PlanWarning, stacklevel=_user_stacklevel())

    def use_plan(self, plan: SelectionPlan | None) -> None:
        """Follow ``plan`` from now on (``None``: follow none, whatever ``KERNREG_LOCK`` says)."""
        with self._lock:
            self._plan, self._plan_set = plan, True
            self._plan_warned.clear()
            self._invalidate()

    @property
    def generation(self) -> int:
        """Increases with every mutation; a decision made at one generation is valid only there."""
        return self._generation

    # --- mutation -----------------------------------------------------------------------

    def register(self, spec: KernelSpec, *, replace: bool = False) -> KernelSpec:
        """Add ``spec``. Returns the stored spec, whose ``origin`` names the registering call.

        Re-registering an equal spec is a no-op, even on a frozen registry. A different spec for the same
        ``(op, backend, variant)`` raises :class:`KernelConflictError` unless
        ``replace=True``, which is recorded in :meth:`overrides`.
        """
        if type(spec) is not KernelSpec and not isinstance(spec, KernelSpec):
            raise InvalidSpecError("spec", spec, "expected a KernelSpec")
        if spec.origin is None:
            # Attached in place: origin is no part of a spec's value, and a copy per
            # registration would double the cost. A spec keeps its first registration's origin.
            object.__setattr__(spec, "origin", caller_origin(2))
        op = spec.op
        slot = _slot(spec.backend, spec.variant)
        lock = self._lock
        lock.acquire()  # not `with`: this is the path 100,000 registrations take
        try:
            by_key = self._specs.get(op)
            old = by_key.get(slot) if by_key else None
            reloaded = False
            if old is not None:
                if old == spec:
                    return old  # also when frozen: reloading a module must stay safe
                reloaded = _reloaded(old, spec)
                if not replace and not reloaded:
                    self._check_mutable()
                    raise KernelConflictError(_conflict_message(old, spec), old, spec)
            if self._frozen:
                self._check_mutable()
            # The op's reference is always one of its registered specs: at this slot, `old`.
            reference = self._references.get(op)
            if reference is not None and spec.reference and reference is not old:
                raise DuplicateReferenceError(
                    f"Op '{spec.op}' already has a reference implementation '{reference.label}' "
                    f"({reference.origin}); cannot make '{spec.label}' ({spec.origin}) a second one. "
                    "Register it with reference=False, or unregister the first reference.",
                    reference,
                    spec,
                )
            if by_key is None:
                self._specs[op] = {slot: spec}
            else:
                by_key[slot] = spec
            if spec.reference:
                self._references[op] = spec
            elif reference is not None and reference is old:
                del self._references[op]
            if old is not None and not reloaded:
                self._overrides.append(
                    Override("replace", old, spec, spec.origin or caller_origin())
                )
            journal = _journal.get()
            if journal is not None:
                journal.append((self, spec.key, old))
            if self._sorted:
                self._sorted.pop(op, None)
            self._invalidate()
        finally:
            lock.release()
        return spec

    def unregister(self, op: str, backend: str, variant: str = "") -> KernelSpec:
        """Remove and return the implementation ``(op, backend, variant)`` (recorded as an override)."""
        with self._lock:
            self._check_mutable()
            spec = self.get_backend(op, backend, variant)
            by_key = self._specs[op]
            del by_key[(backend, variant)]
            if not by_key:
                del self._specs[op]
            if self._references.get(op) is spec:
                del self._references[op]
            self._overrides.append(Override("unregister", spec, None, caller_origin()))
            journal = _journal.get()
            if journal is not None:
                journal.append((self, spec.key, spec))
            self._sorted.pop(op, None)
            self._invalidate()
        return spec

    def freeze(self) -> None:
        """Refuse every later mutation (after start-up, so nothing changes under a running engine)."""
        with self._lock:
            self._frozen = True

    @property
    def frozen(self) -> bool:
        return self._frozen

    def _snapshot(self) -> tuple[Any, ...]:
        with self._lock:
            return (
                {op: dict(by_key) for op, by_key in self._specs.items()},
                dict(self._references),
                list(self._overrides),
                self._frozen,
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
                self._specs,
                self._references,
                self._overrides,
                self._frozen,
                self._config,
                self._platform,
                self.autoload_plugins,
                self.plugin_report,
                self._plan,
                self._plan_set,
            ) = saved
            self._sorted.clear()
            self._invalidate()

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

    @contextlib.contextmanager
    def scoped(self) -> Iterator[KernelRegistry]:
        """A block whose registrations, removals and configuration vanish at exit (for tests).

        A frozen registry accepts changes inside the block and is frozen again at exit.
        """
        saved = self._snapshot()
        with self._lock:
            self._frozen = False
        try:
            yield self
        finally:
            self._restore(saved)

    def _undo(self, key: tuple[str, str, str], previous: KernelSpec | None) -> None:
        """Put ``key`` back to ``previous`` (``None``: absent), bypassing the conflict rules."""
        op, backend, variant = key
        with self._lock:
            by_key = self._specs.setdefault(op, {})
            if previous is None:
                by_key.pop((backend, variant), None)
            else:
                by_key[(backend, variant)] = previous
            if not by_key:
                del self._specs[op]
            current = self._references.get(op)
            if current is not None and current.key == key:
                del self._references[op]
            if previous is not None and previous.reference:
                self._references[op] = previous
            self._sorted.pop(op, None)
            self._invalidate()

    def _check_mutable(self) -> None:
        if self._frozen:
            raise RegistryFrozenError(
                "the kernel registry is frozen; register kernels before freeze() is called, "
                "or use registry.scoped() in tests"
            )

    def _invalidate(self) -> None:
        # Called with the lock held: a decision computed before this point can no longer be stored.
        self._generation += 1
        # Registering 100,000 specs invalidates 100,000 times: skip what is already empty.
        if self._decisions:
            self._decisions.clear()
        if self._kernels:
            self._kernels.clear()
        if self._subscribers:
            for subscriber in list(self._subscribers):
                subscriber.invalidate()

    def subscribe(self, subscriber: _Subscriber) -> None:
        """Have ``subscriber.invalidate()`` called (lock held) on every mutation; held weakly."""
        with self._lock:
            self._subscribers.add(subscriber)

    # --- queries ------------------------------------------------------------------------

    def has(self, op: str) -> bool:
        self._ensure_plugins()
        return op in self._specs

    def ops(self) -> tuple[str, ...]:
        """Every op id with at least one implementation, sorted."""
        self._ensure_plugins()
        with self._lock:
            return tuple(sorted(self._specs))

    def get(self, op: str) -> tuple[KernelSpec, ...]:
        """All implementations of ``op``, highest priority first, then by backend and variant."""
        self._ensure_plugins()
        try:
            specs = self._sorted.get(op)
        except TypeError:  # unhashable, so not an op id: say so instead of a bare TypeError
            check_op_id(op)
            raise
        if specs is None:
            with self._lock:
                by_key = self._specs.get(op)
                if by_key is None:
                    check_op_id(op)
                    raise OpNotFoundError(op, self._specs)
                specs = self._sorted[op] = tuple(sorted(by_key.values(), key=KernelSpec.sort_key))
        return specs

    def get_backend(self, op: str, backend: str, variant: str = "") -> KernelSpec:
        """The implementation ``(op, backend, variant)``; ``KeyError`` subclasses when missing."""
        self._ensure_plugins()
        with self._lock:
            by_key = self._specs.get(op) if isinstance(op, str) else None
            if by_key is None:
                check_op_id(op)
                raise OpNotFoundError(op, self._specs)
            spec = by_key.get((backend, variant)) if isinstance(backend, str) else None
            if spec is None:
                check_name(backend, "backend")
                check_variant(variant)
                known = tuple(sorted(label(b, v) for b, v in by_key))
                raise BackendNotFoundError(op, backend, variant, known)
            return spec

    def reference(self, op: str) -> KernelSpec | None:
        """The op's reference implementation, if one is registered."""
        self.get(op)
        return self._references.get(op)

    def all_specs(self) -> tuple[KernelSpec, ...]:
        """Every spec, sorted by op, then as :meth:`get` orders them."""
        return tuple(spec for op in self.ops() for spec in self.get(op))

    def overrides(self) -> tuple[Override, ...]:
        """Every deliberate replacement or removal, in the order it happened."""
        self._ensure_plugins()
        with self._lock:
            return tuple(self._overrides)

    def __len__(self) -> int:
        self._ensure_plugins()
        with self._lock:
            return sum(len(by_key) for by_key in self._specs.values())

    def __contains__(self, op: object) -> bool:
        self._ensure_plugins()
        return op in self._specs

    def __repr__(self) -> str:
        implementations = len(self)  # loads the plugins first, so both counts include them
        return f"<KernelRegistry {len(self._specs)} ops, {implementations} implementations>"

    # --- decisions ----------------------------------------------------------------------

    def _ensure_plugins(self) -> None:
        """Load the plugins first if this registry autoloads them and has not yet: every
        reader of the inventory calls this, so none sees it without the plugins' kernels.
        A reader inside a plugin being loaded sees what is registered so far."""
        if self.autoload_plugins and self.plugin_report is None:
            from kernreg.plugins import load_plugins

            load_plugins(registry=self)

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
            plat = platform if isinstance(platform, Platform) else Platform.parse(platform)
        dtype_key = None if dtypes is None else _dtype_key(dtypes)
        if isinstance(traits, str):  # one trait, as a lone dtype is one dtype
            traits = (traits,)
        trait_key = frozenset(check_name(t, "traits") for t in traits) if traits else frozenset()
        pin = (
            current_scoped_pin(op) if _scoped_active else None
        )  # no contextvar read unless a block is open
        tuned = config.autotuned(op) if autotune is None else autotune
        key = (
            op,
            backend,
            variant,
            plat,
            dtype_key,
            trait_key,
            strict,
            pin,
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
            scoped_pin=pin,
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
            and not scoped_pins_active()
        )
        if warm:  # the common case keeps a decided spec under (op, backend): one dict lookup
            spec = self._kernels.get((op, backend, _SELECTED))
            if spec is not None:
                return spec  # type: ignore[no-any-return]
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
                    self._kernels[(op, backend, _SELECTED)] = spec
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
        # The common call, get_kernel(op) or get_kernel(op, backend), is one dict lookup:
        # kept under op or (op, backend) while no use_backend block is open.
        warm = (
            type(op) is str
            and variant is None
            and platform is None
            and dtypes is None
            and traits is _NO_ITEMS
            and strict is None
            and (backend is None or type(backend) is str)
            and not scoped_pins_active()
        )
        if warm:
            kernel: Callable[..., Any] | None = self._kernels.get(
                op if backend is None else (op, backend)
            )
            if kernel is not None:
                return kernel
        key: tuple[Any, ...] | None
        pin = current_scoped_pin(op) if not warm and scoped_pins_active() else None
        try:
            key = (
                op,
                backend,
                variant,
                platform,
                None if dtypes is None else tuple(dtypes),
                tuple(traits),
                strict,
                pin,
            )
            kernel = self._kernels.get(key)
        except TypeError:  # a malformed or unhashable argument: select() below names it
            kernel = key = None
        if kernel is not None:
            return kernel  # type: ignore[no-any-return]
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
                    self._kernels[op if backend is None else (op, backend)] = kernel
        return kernel


#: Marks the warm entries :meth:`KernelRegistry.select` keeps beside get_kernel's.
_SELECTED = object()
#: The default of ``traits``: the empty tuple is a singleton, so ``is`` tells it apart.
_NO_ITEMS: tuple[()] = ()


def chosen_or_raise(decision: Decision) -> KernelSpec:
    """Turn a decision into its chosen spec, or the exception that explains why there is none."""
    if decision.chosen is None:
        if decision.rule == "ambiguous":
            raise AmbiguousKernelError(decision)
        raise NoEligibleKernelError(decision)
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


# --- scoped pins ----------------------------------------------------------------------------

_scoped_pins: contextvars.ContextVar[tuple[Pin, ...]] = contextvars.ContextVar(
    "kernreg_scoped_pins", default=()
)
_scoped_lock = threading.Lock()
#: How many use_backend blocks are open in the whole process: a pre-filter only, so that
#: contexts without a pin never read the context variable.
_scoped_active = 0
#: ``[0]`` while no use_backend block is open anywhere, else a number naming the set of
#: pins open in the whole process. Op objects read it on each call (one list index: the
#: only cost a block open elsewhere adds), and torch.compile guards on it: a graph is
#: traced again when the open pins change, and a set seen before gets its number again,
#: so opening and closing blocks never runs a compiled function into the recompile limit.
scoped_pins_token: list[int] = [0]
_open_pins: dict[Pin, int] = {}
_token_listeners: list[Callable[[int], None]] = []


def on_scoped_pins_token(listener: Callable[[int], None]) -> None:
    """Call ``listener(token)`` (lock held) whenever :data:`scoped_pins_token` changes."""
    _token_listeners.append(listener)


_pin_set_numbers: dict[frozenset[Pin], int] = {frozenset(): 0}


def scoped_pins_active() -> bool:
    """Whether any thread or task is inside a :func:`use_backend` block right now (a cheap
    pre-filter: :func:`current_scoped_pin` says whether one applies in this context)."""
    return _scoped_active > 0


def _blocks_changed(pin: Pin, delta: int) -> None:
    global _scoped_active
    with _scoped_lock:
        _scoped_active += delta
        count = _open_pins.get(pin, 0) + delta
        if count > 0:
            _open_pins[pin] = count
        else:
            _open_pins.pop(pin, None)
        key = frozenset(_open_pins)
        number = _pin_set_numbers.get(key)
        if number is None:
            number = _pin_set_numbers[key] = len(_pin_set_numbers)
        scoped_pins_token[0] = number
        for listener in _token_listeners:
            listener(number)


@contextlib.contextmanager
def use_backend(pattern: str, backend: str, variant: str | None = None) -> Iterator[Pin]:
    """Pin ops matching ``pattern`` (an op id or glob) to ``backend`` within the block.

    The pin is context-local: other threads and async tasks are not affected. Inside
    the block the pin wins over configured pins and is strict like them.
    """
    check_op_glob(pattern, "use_backend pattern")
    check_name(backend, "backend")
    if variant is not None:
        check_variant(variant)
    pin = Pin(pattern, backend, variant, source="use_backend")
    token = _scoped_pins.set((pin, *_scoped_pins.get()))
    _blocks_changed(pin, +1)
    try:
        yield pin
    finally:
        try:
            _scoped_pins.reset(token)
        except (ValueError, RuntimeError):
            # Closed in another context than the one it opened in (an async generator
            # finalised by another task): drop the pin from this one; the opening context
            # keeps its own value, which ends with it.
            _scoped_pins.set(tuple(p for p in _scoped_pins.get() if p is not pin))
        finally:
            _blocks_changed(pin, -1)


def current_scoped_pin(op: str) -> Pin | None:
    """The innermost :func:`use_backend` pin of this context that matches ``op``."""
    for pin in _scoped_pins.get():
        if pin.matches(op):
            return pin
    return None


_torch_half_imported = False


def _fresh_locks_in_child() -> None:
    """After ``os.fork``: a lock another thread held at the fork stays held forever in the
    child, so every lock of this module is replaced by a fresh one."""
    global _scoped_lock, _torch_half_imported
    _scoped_lock = threading.Lock()
    for reg in list(_registries):
        reg._lock = threading.RLock()
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
    os.register_at_fork(after_in_child=_fresh_locks_in_child)


# --- the process-wide registry -------------------------------------------------------------

registry = KernelRegistry()
registry.autoload_plugins = True


def process_state_changed() -> None:
    """Forget the cached decisions of every registry: call it when state that a
    process-state ``when`` predicate (one taking no arguments) reads has changed."""
    for reg in list(_registries):
        with reg._lock:
            reg._invalidate()


def default_registry() -> KernelRegistry:
    """The process-wide registry (``kernreg.registry``)."""
    return registry


def register_kernel(spec: KernelSpec, *, replace: bool = False) -> KernelSpec:
    """Register ``spec`` in the process-wide registry."""
    return registry.register(spec, replace=replace)

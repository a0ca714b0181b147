"""Op objects: the callable face of an op, made by :func:`op` or :func:`dispatcher`.

An op object is a function generated with its reference's exact signature
(:mod:`kernreg._codegen`) whose body calls ``box[0]``, which holds:

* the chosen implementation itself, when the decision does not depend on the call;
* a generated lookup of the implementation by the dispatch arguments' ``dtype`` and the
  first one's ``device``, in the cache of a table built for one registry generation;
* while a use_backend pin that some context holds matches the op, the scoped route,
  which asks the calling context whether a pin applies to it;
* after a registry mutation, a resolver that decides again on the next call.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, cast

from kernreg._codegen import PREFIX, Signature
from kernreg._compile import (
    DERIVED_PRIORITY,
    Targets,
    compiled_reference,
    inline_instead,
    run_while_tracing,
    through_the_compiler,
    tracing,
)
from kernreg._fork import Lock
from kernreg._names import check_name, check_op_id, check_variant
from kernreg._pickle import OpObjects
from kernreg.autotune import shape_bucket
from kernreg.config import Pin
from kernreg.dtypes import dtype_name
from kernreg.errors import InvalidSpecError
from kernreg.measurement import measurer
from kernreg.pins import live_pins, on_pin_liveness, open_blocks, pins_for
from kernreg.platform import Platform, PlatformLike, Requirement
from kernreg.registry import (
    KernelRegistry,
    chosen_or_raise,
    default_registry,
    every_subscriber,
    process_state_changed,
)
from kernreg.selection import Decision
from kernreg.spec import KernelSpec, Target, target_name
from kernreg.tracing import (
    active_traces,
    count,
    count_decision,
    on_trace_change,
    record_call,
    record_decision,
)

__all__ = ["Op", "dispatcher", "guarded", "op"]

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])


class Op(Protocol, Generic[P, R]):
    """What :func:`op` returns: a function with the reference's signature that dispatches.

    Besides being called, it offers ``register`` (a decorator for further
    implementations), ``explain``, ``select``, ``get_kernel``, ``specs`` and the
    ``op_id``, ``reference`` and ``registry`` attributes.
    """

    op_id: str
    reference: Callable[P, R]
    registry: KernelRegistry

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...

    def register(
        self,
        backend: str,
        target: Target | None = None,
        *,
        variant: str = "",
        requires: Iterable[Requirement | str] = (),
        dtypes: Iterable[str] = (),
        when: Target | None = None,
        packages: Iterable[str] = (),
        traits: Iterable[str] = (),
        priority: int = 0,
        description: str = "",
        replace: bool = False,
    ) -> Any: ...

    def explain(
        self,
        *,
        backend: str | None = None,
        platform: PlatformLike = None,
        dtypes: Sequence[str] | None = None,
    ) -> Decision: ...

    def explain_call(self, *args: Any, **kwargs: Any) -> Decision: ...

    def select(
        self,
        *,
        backend: str | None = None,
        platform: PlatformLike = None,
        dtypes: Sequence[str] | None = None,
    ) -> KernelSpec: ...

    def get_kernel(
        self,
        backend: str | None = None,
        *,
        variant: str | None = None,
        platform: PlatformLike = None,
        dtypes: Sequence[str] | None = None,
    ) -> Callable[..., Any]: ...

    def specs(self) -> tuple[KernelSpec, ...]: ...


#: How many (pin, call attributes) decisions an op object keeps for pinned calls.
_PINNED_ENTRIES = 256
# Opening the first trace and closing the last one: every op object resolves again.
on_trace_change(process_state_changed)


def _pin_liveness(pin: Pin) -> None:
    """A use_backend pin became live, or no context holds it any more: the op objects it
    matches take the scoped route while any live pin matches them."""
    for state in every_subscriber():
        if isinstance(state, _OpState) and pin.matches(state.op_id):
            state.follow_live_pins()


on_pin_liveness(_pin_liveness)


def _call_attrs(values: Sequence[Any]) -> tuple[tuple[Any, Any], ...]:
    """``(dtype, device)`` of each dispatch argument (``None`` where it has none)."""
    return tuple((getattr(v, "dtype", None), getattr(v, "device", None)) for v in values)


def _key_parts(dispatch_args: Sequence[str], gates: tuple[str, ...]) -> tuple[tuple[int, str], ...]:
    """The levels of a gated op's per-call cache, outermost first: ``(index of a dispatch
    argument, attribute)``. The generated lookups and the keys stored on a miss both follow
    this order, so it is written only here.

    Every argument's dtype (and shape bucket input, when autotuned) is a level, but only the
    first argument's device: a decision takes its platform from the first device among the
    arguments, which is the first argument's whenever it has one; when it has none (a
    Python scalar, ``None``) the key holds ``None`` and the call is not cached. With torch
    tensors, each ``.device`` read makes a new object to hash and compare (~140 ns a call).
    """
    return tuple(
        (index, attr)
        for index in range(len(dispatch_args))
        for attr in gates
        if attr != "device" or index == 0
    )


def _cache_key(values: Sequence[Any]) -> tuple[Any, ...] | None:
    """``values`` (one per level of :func:`_key_parts`) as a cache key, or ``None`` where one
    is missing: such a call is decided again every time, never stored."""
    if not values or any(value is None for value in values):
        return None
    return tuple(values)


def _cache_put(cache: dict[Any, Any], key: tuple[Any, ...], target: Callable[..., Any]) -> None:
    """Store ``target`` under the nested ``key`` (an unhashable part: not stored, decided
    again on the next call). ``cache`` belongs to one table, whose shape never changes."""
    with contextlib.suppress(TypeError):
        node = cache
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = target


class _Table:
    """One registry generation's per-call dispatch state of an op object: its gates (the
    argument attributes looked up) and the nesting of its cache never change, so a call
    in flight only reads, or stores into, a table of its own shape."""

    __slots__ = ("state", "gates", "parts", "epoch", "cache")

    def __init__(self, state: _OpState, gates: tuple[str, ...], epoch: int) -> None:
        self.state = state
        self.gates = gates
        self.parts = _key_parts(state.dispatch_args, gates)  # the levels of ``cache``
        self.epoch = epoch
        self.cache: dict[Any, Any] = {}

    @run_while_tracing
    def miss(self, pairs: Sequence[tuple[Any, Any]]) -> str:
        """Decide a call missing from the cache (see :meth:`_OpState.miss`)."""
        return self.state.miss(self, pairs)

    def tuned_miss(self, /, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        return self.state.tuned_miss(self, args, kwargs)


class _OpState:
    """The mutable half of an op object: what ``box[0]`` holds, and how it is decided."""

    def __init__(
        self,
        op_id: str,
        signature: Signature,
        registry: KernelRegistry,
        dispatch_args: tuple[str, ...],
        strict: bool | None,
        autotune: bool | None = None,
    ) -> None:
        self.op_id = op_id
        self.registry = registry
        self.lock = Lock()
        self.strict = strict
        self.autotune = autotune
        self.dispatch_args = dispatch_args
        self.signature = signature

        # A plain function, not a bound method: a compiled region guards on what box[0]
        # holds, and dynamo's guard for a method fails outright once a function replaces it.
        def resolve_and_call(*args: Any, **kwargs: Any) -> Any:
            return getattr(self.targets, self._resolved_name())(*args, **kwargs)

        self.resolve_and_call = resolve_and_call
        #: The decided target: the implementation, a gated lookup, or the resolver.
        self.target: Callable[..., Any] = resolve_and_call
        #: What the op object calls: the target, or while a live pin matches the op, the
        #: scoped route (set by _make_op).
        self.box: list[Callable[..., Any]] = [resolve_and_call]
        self.scoped: Callable[..., Any] = resolve_and_call
        self.live_pins = False
        self.targets = Targets(resolve_and_call)
        self.epoch = 0
        #: (ids of pins, dispatch attributes) -> (pins, name in ``targets``), for calls
        #: under a scoped pin.
        self.pinned: dict[Any, tuple[Any, str]] = {}
        self._gated_factories: dict[tuple[str, ...], Callable[..., Any]] = {}
        #: The op object and the name pickle finds it by, once it has one (see :meth:`rename`).
        self.named: tuple[weakref.ref[Any], str] | None = None

    def rename(self) -> None:
        """Show the op's implementations in the op object's name, which its repr shows:
        ``<function op_objects.demo.scale (2 implementations: fast, torch reference)...>``
        (pickle finds it by that name: see :meth:`OpObjects.find`)."""
        if self.named is None:
            return
        ref, pickle_name = self.named
        made = ref()
        if made is None:
            return
        specs = self.registry.stored_implementations(self.op_id)
        labels = [f"{s.label} reference" if s.reference else s.label for s in specs]
        count = f"{len(specs)} implementation{'' if len(specs) == 1 else 's'}"
        summary = f"{count}: {', '.join(labels)}" if labels else count
        _, bar, rest = pickle_name.partition("|")
        made.__qualname__ = f"op_objects.{self.op_id} ({summary}){bar}{rest}"

    def invalidate(self) -> None:
        """Decide again on the next call (a registry mutation, tracing opened or closed)."""
        with self.lock:
            self.epoch += 1
            self.pinned = {}
            self.targets.clear()
            self.target = self.resolve_and_call
            self.box[0] = self.scoped if self.live_pins else self.target
        self.rename()

    def follow_live_pins(self) -> None:
        """Take the scoped route while a live use_backend pin matches the op, else the target."""
        with self.lock:
            self.live_pins = any(pin.matches(self.op_id) for pin in live_pins())
            self.box[0] = self.scoped if self.live_pins else self.target

    def _publish(self, epoch: int, target: Callable[..., Any]) -> None:
        with self.lock:
            if self.epoch == epoch:
                self.target = target
                self.box[0] = self.scoped if self.live_pins else target

    def _store(self, target: Callable[..., Any]) -> str:
        """Keep ``target`` as an attribute of ``self.targets``; return its name."""
        name = f"t{self.epoch}_{id(target):x}"
        with self.lock:
            setattr(self.targets, name, target)
        return name

    def _shared(self) -> bool:
        """Whether a decision made now may serve every context: not when a scoped pin of
        this context applies to the op (a call that re-dispatches mid-way can get here)."""
        return not pins_for(self.op_id)

    @run_while_tracing
    def _resolved_name(self) -> str:
        return self._store(self.resolve())

    def resolve(self) -> Callable[..., Any]:
        """Choose what ``box[0]`` holds now; keep it unless the registry moved meanwhile or
        torch.compile is tracing (its guards read box[0] after the trace)."""
        self.registry.ensure_plugins()
        epoch = self.epoch
        specs = self.registry.get(self.op_id)
        tuned = (
            self.registry.config.autotuned(self.op_id) if self.autotune is None else self.autotune
        )
        gates = tuple(
            attr
            for attr, used in (
                ("dtype", tuned or any(s.dtypes for s in specs)),
                ("device", tuned or any(s.requires for s in specs)),
                ("shape", tuned),  # measured choices differ by shape bucket
            )
            if used
        )
        if gates and self.dispatch_args:
            target = self._gated_lookup(_Table(self, gates, epoch))
        else:
            target = self._callable_for(self.registry.explain(self.op_id, strict=self.strict))
        if not tracing() and self._shared():
            self._publish(epoch, target)
        return target

    def _gated_lookup(self, table: _Table) -> Callable[..., Any]:
        """A function with the reference's signature that looks the implementation up per
        call in ``table``'s cache (compiled once per set of gates)."""
        factory = self._gated_factories.get(table.gates)
        if factory is None:
            lookup = "".join(f"[{self.dispatch_args[i]}.{attr}]" for i, attr in table.parts)
            forward = self.signature.forward
            if "shape" in table.gates:  # autotune: the miss may measure this call's arguments
                miss = f"{PREFIX}tuned_miss({forward})"
            else:
                values = "(" + ", ".join(self.dispatch_args) + ",)"
                miss = f"{PREFIX}getattr({PREFIX}targets, {PREFIX}miss({PREFIX}attrs({values})))"
            body = (
                "try:\n"
                # Nested dicts: with torch tensors, c[x.dtype][x.device] costs ~25 ns less
                # than c[x.dtype, x.device].
                f"    {PREFIX}impl = {PREFIX}cache{lookup}\n"
                # KeyError on a miss; AttributeError/TypeError: an argument without the attribute.
                f"except {PREFIX}Exception:\n"
                f"    {PREFIX}impl = {miss}\n"
                f"return {PREFIX}impl({forward})\n"
            )
            cells = ("cache", "miss", "tuned_miss", "targets", "attrs", "getattr", "Exception")
            factory = self.signature.factory(
                "gated_" + self.op_id.replace(".", "_"), body, [PREFIX + c for c in cells]
            )
            self._gated_factories[table.gates] = factory
        return cast(
            Callable[..., Any],
            factory(
                **{
                    f"{PREFIX}cache": table.cache,
                    f"{PREFIX}miss": table.miss,
                    f"{PREFIX}tuned_miss": table.tuned_miss,
                    f"{PREFIX}targets": self.targets,
                    f"{PREFIX}attrs": _call_attrs,
                    f"{PREFIX}getattr": getattr,
                    f"{PREFIX}Exception": Exception,
                }
            ),
        )

    def _inputs_from_attrs(
        self, pairs: Sequence[tuple[Any, Any]], parts: Sequence[tuple[int, str]]
    ) -> tuple[Platform, tuple[str, ...] | None, Any]:
        """Platform, dtypes and cache key (levels ``parts``, see :func:`_key_parts`) from
        the ``(dtype, device)`` of each dispatch argument. The platform is the first
        device's: the cache key holds the first argument's device for that reason."""
        base = self.registry.platform
        dtypes = [dtype_name(dtype) for dtype, _ in pairs if dtype is not None]
        device = next((dev for _, dev in pairs if dev is not None), None)
        platform = base if device is None else base.for_device(device)
        cache_key = _cache_key([pairs[i][attr == "device"] for i, attr in parts])  # (dtype, device)
        return platform, (tuple(dtypes) if dtypes else None), cache_key

    def miss(self, table: _Table, pairs: Sequence[tuple[Any, Any]]) -> str:
        """Decide for a call missing from ``table``'s cache; the name of its target in
        ``self.targets``.

        Takes only the dispatch arguments' dtypes and devices, which are constants while
        ``torch.compile`` traces, so a compiled region runs it for real (see
        :func:`run_while_tracing`).
        """
        platform, dtypes, cache_key = self._inputs_from_attrs(pairs, table.parts)
        decision = self.registry.explain(
            self.op_id, platform=platform, dtypes=dtypes, strict=self.strict
        )
        target = self._callable_for(decision)
        if cache_key is not None and not tracing() and self._shared():
            _cache_put(table.cache, cache_key, target)
        return self._store(target)

    def tuned_miss(
        self, table: _Table, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Callable[..., Any]:
        """Decide a call of an autotuned op missing from ``table``, measuring the candidates
        on this call's arguments when its shape bucket has no recorded result yet."""
        values = [self.signature.value(name, args, kwargs) for name in self.dispatch_args]
        platform, dtypes, _ = self._inputs_from_attrs(_call_attrs(values), ())
        bucket = shape_bucket(self.dispatch_args, values)
        registry, op_id = self.registry, self.op_id

        def decide() -> Decision:
            return registry.explain(
                op_id,
                platform=platform,
                dtypes=dtypes,
                strict=self.strict,
                bucket=bucket,
                autotune=True,
            )

        decision = decide()
        if decision.tuning and not tracing():
            measure = measurer()  # None without the torch layer: priority decides
            if measure is not None:
                results = measure(op_id, decision.tuning, args, kwargs, params=self.signature.names)
                if results:
                    registry.record_measurements(op_id, platform, dtypes, bucket, results)
                    decision = decide()
        target = self._callable_for(decision)
        key = _cache_key([getattr(values[index], attr, None) for index, attr in table.parts])
        if key is not None and not tracing() and self._shared():
            _cache_put(table.cache, key, target)
        return target

    @run_while_tracing
    def scoped_route(self, blocks: str) -> bool:
        """Whether a call takes the scoped route: a pin of this context matches this op
        (``blocks``, the key of the set of open blocks, is passed so that a compiled
        graph guards on it)."""
        return bool(pins_for(self.op_id))

    @run_while_tracing
    def pinned_name(self, pairs: Sequence[tuple[Any, Any]]) -> str:
        """The name in ``self.targets`` of what a call runs under this context's scoped pin,
        or ``""`` when no open :func:`~kernreg.use_backend` block of this context pins this op.

        Reads the context of the call (also while torch.compile traces: it runs for real).
        """
        pins = pins_for(self.op_id)
        if not pins:
            return ""
        pinned = self.pinned
        # Keyed by the pins' identities (hashing a pin's fields costs ~4 us a call); the
        # entry keeps the pins, so an id reused by a later pin is never taken for one.
        key: Any = (tuple(map(id, pins)), tuple(pairs))
        try:
            found = pinned.get(key)
        except TypeError:  # an unhashable dtype or device: decided on each call
            found, key = None, None
        if found is not None and all(a is b for a, b in zip(found[0], pins, strict=True)):
            return found[1]
        platform, dtypes, _ = self._inputs_from_attrs(pairs, ())
        decision = self.registry.explain(
            self.op_id, platform=platform, dtypes=dtypes, strict=self.strict
        )
        name = self._store(self._callable_for(decision))
        if key is not None and not tracing():
            if len(pinned) >= _PINNED_ENTRIES:  # every block makes a new pin: stay bounded
                pinned.clear()
            pinned[key] = (pins, name)  # this generation's dict: invalidate() replaces it
        return name

    def _callable_for(self, decision: Decision) -> Callable[..., Any]:
        """What a call should run for ``decision``: the implementation, a ``when`` chooser,
        or a function raising the decision's error.

        While torch.compile traces (this runs for real then), an error is raised right
        away, so it reaches the caller with its own type and message, and an open trace
        records the decision once instead of wrapping the call in recording code.
        """
        compiling = tracing()
        try:
            static = chosen_or_raise(decision).load()
        except Exception as exc:
            if compiling:
                raise through_the_compiler(exc) from exc.__cause__
            error = exc

            @run_while_tracing  # torch.compile calls it for real: the error passes through
            def raise_error() -> None:
                raise through_the_compiler(error) if tracing() else error

            def static(*args: Any, **kwargs: Any) -> Any:
                raise_error()

        label = decision.chosen.label if decision.ok and decision.chosen else "<error>"
        recording = bool(active_traces())
        if recording and compiling:
            if not decision.conditional:
                record_decision(self.op_id, label, decision.rule, decision.dtypes or ())
            recording = False
        elif recording:
            static = self._traced(static, label, decision.rule)
        if decision.ok:  # while dynamo traces, a failure is not caught (see guarded)
            static = self._guarded(decision, static)
        if not decision.conditional:
            count_decision(decision)
            return static
        return self._chooser(decision, static, recording)

    def _guarded(
        self, decision: Decision, impl: Callable[..., Any], spec: KernelSpec | None = None
    ) -> Callable[..., Any]:
        """``impl`` (what ``decision``, or a ``when`` predicate for ``spec``, chose) under
        the demotion policy: see :func:`guarded`. A call in a demoted bucket runs what
        the rules choose for that bucket."""
        registry, op_id, strict = self.registry, self.op_id, self.strict
        platform, dtypes = decision.platform, decision.dtypes

        def values(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
            return [self.signature.value(name, args, kwargs) for name in self.dispatch_args]

        def instead(where: str) -> Callable[..., Any]:
            if spec is None:
                again = registry.explain(
                    op_id, platform=platform, dtypes=dtypes, strict=strict, bucket=where
                )
                return self._callable_for(again)

            def by_call(*args: Any, **kwargs: Any) -> Any:  # the predicates decide per call
                again = registry.explain(
                    op_id,
                    platform=platform,
                    dtypes=dtypes,
                    strict=strict,
                    call=(args, kwargs),
                    bucket=where,
                )
                return self._callable_for(again)(*args, **kwargs)

            return by_call

        return guarded(
            decision,
            impl,
            registry=registry,
            strict=strict,
            spec=spec,
            names=self.dispatch_args,
            values=values,
            instead=instead,
        )

    def _traced(
        self, impl: Callable[..., Any], implementation: str, rule: str
    ) -> Callable[..., Any]:
        """``impl`` wrapped to record each call in the open traces (only while one is open)."""
        op_id, names, bind = self.op_id, self.dispatch_args, self.signature.value

        def traced(*args: Any, **kwargs: Any) -> Any:
            record_call(op_id, implementation, rule, [bind(name, args, kwargs) for name in names])
            return impl(*args, **kwargs)

        return traced

    @run_while_tracing
    def _loaded_name(self, spec: KernelSpec, rule: str = "when") -> str:
        """Import ``spec``'s implementation (for real, also while torch.compile traces)."""
        if active_traces() and tracing():
            record_decision(self.op_id, spec.label, rule, ())
        return self._store(spec.load())

    def _chooser(
        self, decision: Decision, static: Callable[..., Any], recording: bool
    ) -> Callable[..., Any]:
        """Evaluate ``when`` predicates, highest priority first, then fall back to ``static``."""
        tiers: dict[int, list[tuple[Callable[..., Any], KernelSpec]]] = {}
        for spec in decision.conditional:
            predicate = spec.load_when()
            assert predicate is not None
            tiers.setdefault(spec.priority, []).append((predicate, spec))
        firm = (
            decision.chosen.priority
            if decision.chosen is not None and decision.rule != "reference"
            else None
        )
        ordered = [(p, tiers[p], p == firm) for p in sorted(tiers, reverse=True)]
        loaded: dict[tuple[str, str, str], Callable[..., Any]] = {}
        if tracing():  # a dict that dynamo saw change would fail its guard: fill it now
            for spec in decision.conditional:
                impl = getattr(self.targets, self._loaded_name(spec))
                loaded[spec.key] = self._guarded(decision, impl, spec)
        registry, op_id, strict = self.registry, self.op_id, self.strict
        platform, dtypes = decision.platform, decision.dtypes

        def choose(*args: Any, **kwargs: Any) -> Any:
            for _, tier, shares_firm_tier in ordered:
                hits = [spec for predicate, spec in tier if predicate(*args, **kwargs)]
                if not hits:
                    continue
                if len(hits) == 1 and not shares_firm_tier:
                    count(op_id, "when", hits[0].label)
                    impl = loaded.get(hits[0].key)
                    if impl is None:
                        impl = getattr(self.targets, self._loaded_name(hits[0]))
                        if recording:
                            impl = self._traced(impl, hits[0].label, "when")
                        impl = loaded[hits[0].key] = self._guarded(decision, impl, hits[0])
                    return impl(*args, **kwargs)
                # Several candidates hold at one priority: let the full decision raise the error.
                spec = registry.select(
                    op_id, platform=platform, dtypes=dtypes, strict=strict, call=(args, kwargs)
                )
                count(op_id, "when", spec.label)
                return (
                    self._traced(spec.load(), spec.label, "when") if recording else spec.load()
                )(*args, **kwargs)
            count_decision(decision, "predicate false" if decision.rule == "reference" else None)
            return static(*args, **kwargs)

        return choose


def guarded(
    decision: Decision,
    impl: Callable[..., Any],
    *,
    registry: KernelRegistry | None = None,
    traits: Sequence[str] = (),
    strict: bool | None = None,
    spec: KernelSpec | None = None,
    names: Sequence[str] | None = None,
    values: Callable[[tuple[Any, ...], dict[str, Any]], Sequence[Any]] | None = None,
    instead: Callable[[str], Callable[..., Any]] | None = None,
) -> Callable[..., Any]:
    """``impl``, the implementation ``decision`` chose (or ``spec``, chosen by its ``when``
    predicate), under the demotion policy (``KERNREG_DEMOTE``, docs/fallbacks.md): an
    ``Exception`` it raises demotes it for the call's shape bucket and the call is
    answered without it; a call in a bucket it is demoted in runs, without trying it,
    what the rules choose for that bucket. ``impl`` itself where the policy is off for
    the op, the choice is the reference or was asked for (``backend=``, a pin).

    A call's shape bucket is that of its dispatch arguments ``values(args, kwargs)``,
    named ``names`` (default: the first positional argument, named as the reference's
    first parameter), found once per set of shapes; ``instead(bucket)`` what runs
    in a demoted bucket (default: decided again for it with ``traits`` and ``strict``,
    itself guarded). While torch.compile traces, a failure is not caught (it propagates)
    but a demotion recorded before holds. ``kernreg.torch.kernelize`` binds its
    implementations through this.
    """
    reg = default_registry() if registry is None else registry
    chosen, op_id = spec or decision.chosen, decision.op
    if (
        chosen is None
        or chosen.reference
        or (spec is None and decision.rule not in ("priority", "autotune"))
        or not reg.config.demotes(op_id)
    ):
        return impl
    if names is None:
        reference = reg.reference(op_id)
        names = Signature(reference.load()).names[:1] if reference is not None else ()
    dispatched = names
    known: dict[Any, str] = {}  # shapes -> bucket: shape_bucket costs ~2 us a call

    def bucket(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        found = values(args, kwargs) if values is not None else args[: len(dispatched)]
        shapes = tuple(getattr(v, "shape", None) for v in found)
        try:
            where = known.get(shapes)
        except TypeError:  # an unhashable shape: found each time
            return shape_bucket(dispatched[: len(found)], found)
        if where is None:
            if len(known) > 1024:  # sizes without end (sequence lengths): stay bounded
                known.clear()
            where = known[shapes] = shape_bucket(dispatched[: len(found)], found)
        return where

    if instead is None:

        def instead(where: str) -> Callable[..., Any]:
            # In an empty context: the calling context's use_backend pins and compile-safe
            # region must not become what every later call in the bucket runs.
            again = contextvars.Context().run(
                reg.explain,
                op_id,
                platform=decision.platform,
                dtypes=decision.dtypes,
                traits=traits,
                strict=strict,
                bucket=where,
            )
            run = chosen_or_raise(again).load()
            return guarded(again, run, registry=reg, traits=traits, strict=strict, names=names)

    demoted = reg.demoted_buckets(op_id, decision.platform, decision.dtypes, chosen)
    found = Targets(impl)  # what runs in each demoted bucket, by name (read while tracing)

    @run_while_tracing  # torch.compile decides for real; the name is a constant
    def instead_name(where: str) -> str:
        name = "b_" + where.encode().hex()  # one attribute per bucket
        if name not in vars(found):
            setattr(found, name, instead(where))
        return name

    def guarded_call(*args: Any, **kwargs: Any) -> Any:
        try:
            return impl(*args, **kwargs)
        except Exception as exc:  # KeyboardInterrupt, SystemExit: never demoted
            where = bucket(args, kwargs)
            reg.demote(decision, exc, where, strict=strict, spec=chosen)  # strict: DemotionError
            out = kwargs.get("out")
            outs = out if isinstance(out, tuple | list) else (out,)
            inputs = (*args, *(v for k, v in kwargs.items() if k != "out"))
            if out is not None and any(o is v for o in outs for v in inputs):
                raise  # out= is an input, perhaps half written: no fallback can answer
        return getattr(found, instead_name(where))(*args, **kwargs)

    inline_instead(guarded_call, impl)  # torch.compile traces the implementation itself
    if not demoted:
        return guarded_call

    def in_bucket(*args: Any, **kwargs: Any) -> Any:
        where = bucket(args, kwargs)
        if where in demoted:
            return getattr(found, instead_name(where))(*args, **kwargs)
        return guarded_call(*args, **kwargs)

    return in_bucket


def op(
    op_id: str,
    *,
    backend: str = "torch",
    dispatch_args: Sequence[str] | None = None,
    strict: bool | None = None,
    autotune: bool | None = None,
    traits: Iterable[str] = (),
    description: str = "",
    torch_compile: bool = False,
    registry: KernelRegistry | None = None,
) -> Callable[[Callable[P, R]], Op[P, R]]:
    """Define op ``op_id`` on its reference implementation; the result dispatches when called.

    ``backend`` names the reference's backend. ``dispatch_args`` are the parameters whose
    ``dtype``/``device`` select the implementation per call (default: the first one).
    ``strict=True`` makes a fallback to the reference an error for this op.
    ``autotune=True`` chooses by measured speed per shape bucket (default:
    ``KERNREG_POLICY``). ``torch_compile=True`` also registers a derived ``torch_compile``
    implementation: ``torch.compile`` of the reference, compiled on its first call, trait
    ``compile_safe``, priority ``-100`` (below every hand-written kernel).
    """
    check_op_id(op_id)
    check_name(backend, "backend")
    reg = default_registry() if registry is None else registry

    def decorate(reference: Callable[P, R]) -> Op[P, R]:
        signature = Signature(reference)
        names = _dispatch_names(signature, dispatch_args, reference)
        # Build the op object before registering, so a failure leaves nothing registered.
        made, state = _make_op(op_id, reference, signature, reg, names, strict, autotune)
        reg.register(
            KernelSpec(
                op_id, backend, reference, reference=True, traits=traits, description=description
            )
        )
        if torch_compile:
            reg.register(
                KernelSpec(
                    op_id,
                    "torch_compile",
                    compiled_reference(reference),
                    traits={"compile_safe"},
                    priority=DERIVED_PRIORITY,
                    description="torch.compile of the reference (derived)",
                )
            )
        located = reference if "<" not in getattr(reference, "__qualname__", "<") else None
        key = _pickle_key(reg, op_id, strict, autotune, dispatch_args, located)
        if key is not None:
            op_objects.keep(key, made)  # the newest definition (a reloaded module's)
            state.named = (weakref.ref(made), key)
            state.rename()
        return cast(Op[P, R], made)

    return decorate


def dispatcher(
    op_id: str,
    *,
    like: Callable[P, R] | None = None,
    dispatch_args: Sequence[str] | None = None,
    strict: bool | None = None,
    autotune: bool | None = None,
    registry: KernelRegistry | None = None,
) -> Op[P, R]:
    """The op object of an op whose implementations are registered elsewhere (by a plugin).

    The wrapper takes the signature of ``like``, or else of the op's reference
    implementation, which is imported now. Nothing is registered. Op objects of the
    process-wide registry pickle by reference (op id and these options): unpickling
    returns the op object made with them in that process, made now if needed.
    """
    check_op_id(op_id)
    reg = default_registry() if registry is None else registry
    key = _pickle_key(reg, op_id, strict, autotune, dispatch_args, like)
    if key is not None:
        existing = op_objects.get(key)
        if existing is not None:
            return cast(Op[P, R], existing)
    reg.ensure_plugins()
    reference = reg.reference(op_id)
    if like is None:
        if reference is None:
            raise InvalidSpecError(
                "like",
                None,
                f"op '{op_id}' has no reference implementation to take the signature from",
            )
        like = reference.load()
    signature = Signature(like)
    names = _dispatch_names(signature, dispatch_args, like)
    made, state = _make_op(
        op_id, reference.load() if reference else like, signature, reg, names, strict, autotune
    )
    if key is not None:
        kept = op_objects.keep(key, made, newest=False)
        if kept is made:
            state.named = (weakref.ref(made), key)
            state.rename()
        made = kept
    return cast(Op[P, R], made)


def _pickle_key(
    reg: KernelRegistry,
    op_id: str,
    strict: bool | None,
    autotune: bool | None,
    dispatch_args: Sequence[str] | None,
    like: Callable[..., Any] | None,
) -> str | None:
    """The pickle key of an op object; ``None``: not picklable by reference (another
    registry than the process-wide one, or ``like`` a local function)."""
    if reg is not default_registry():
        return None
    return OpObjects.key(op_id, strict, autotune, dispatch_args, like)


def _dispatch_names(
    signature: Signature, dispatch_args: Sequence[str] | None, func: Callable[..., Any]
) -> tuple[str, ...]:
    if dispatch_args is None:  # the first parameter, unless it is *args or **kwargs
        first = signature.names[:1]
        names = tuple(n for n in first if not signature.kinds[n].startswith("VAR_"))
    else:
        names = tuple(dispatch_args)
    for name in names:
        if signature.kinds.get(name) not in (
            "POSITIONAL_ONLY",
            "POSITIONAL_OR_KEYWORD",
            "KEYWORD_ONLY",
        ):
            raise InvalidSpecError(
                "dispatch_args", name, f"not a named parameter of {target_name(func)}"
            )
    return names


def _make_op(
    op_id: str,
    reference: Callable[..., Any],
    signature: Signature,
    reg: KernelRegistry,
    names: tuple[str, ...],
    strict: bool | None,
    autotune: bool | None = None,
) -> tuple[Any, _OpState]:
    """The op object and its mutable half."""
    state = _OpState(op_id, signature, reg, names, strict, autotune)
    value = signature.value

    def scoped(*args: Any, **kwargs: Any) -> Any:
        """Under a scoped pin of the caller's context: what the pin chooses; else the target."""
        # Reading the key makes torch.compile guard on the set of open blocks.
        if state.scoped_route(open_blocks.key):
            pairs = _call_attrs([value(name, args, kwargs) for name in names])
            name = state.pinned_name(pairs)
            if name:
                return getattr(state.targets, name)(*args, **kwargs)
        return state.target(*args, **kwargs)

    state.scoped = scoped
    wrapper = signature.factory(
        op_id.split(".")[-1], f"return {PREFIX}box[0]({signature.forward})\n", [f"{PREFIX}box"]
    )(**{f"{PREFIX}box": state.box})
    functools.update_wrapper(wrapper, reference)
    # torch.compile cannot read a context variable: it traces the scoped route instead,
    # which asks for real whether a pin applies and guards on the set of open blocks.
    inline_instead(wrapper, scoped)
    _attach(wrapper, state, reference)
    reg.subscribe(state)
    state.follow_live_pins()  # after subscribing: no change of live pins is missed
    return wrapper, state


def _attach(wrapper: Any, state: _OpState, reference: Callable[..., Any]) -> None:
    reg = state.registry
    op_id = state.op_id

    def register(
        backend: str,
        target: Target | None = None,
        *,
        variant: str = "",
        requires: Iterable[Requirement | str] = (),
        dtypes: Iterable[str] = (),
        when: Target | None = None,
        packages: Iterable[str] = (),
        traits: Iterable[str] = (),
        priority: int = 0,
        description: str = "",
        replace: bool = False,
    ) -> Any:
        """Add an implementation: ``@op.register("triton", requires=["cuda>=8.0"])`` on a function,
        or ``op.register("triton", "pkg.mod:fn", ...)`` for a lazily imported target."""
        check_name(backend, "backend")
        check_variant(variant)

        def add(impl: Target) -> KernelSpec:
            spec = KernelSpec(
                op_id,
                backend,
                impl,
                variant=variant,
                requires=frozenset(Requirement.coerce(r) for r in requires),
                dtypes=frozenset(dtypes),
                when=when,
                packages=frozenset(packages),
                traits=frozenset(traits),
                priority=priority,
                description=description,
            )
            return reg.register(spec, replace=replace)

        if target is not None:
            return add(target)

        def decorator(impl: F) -> F:
            add(impl)
            return impl

        return decorator

    def explain_(
        *,
        backend: str | None = None,
        platform: PlatformLike = None,
        dtypes: Sequence[str] | None = None,
    ) -> Decision:
        return reg.explain(
            op_id,
            backend=backend,
            platform=platform,
            dtypes=dtypes,
            strict=state.strict,
            autotune=state.autotune,
        )

    def explain_call(*args: Any, **kwargs: Any) -> Decision:
        """The decision this exact call gets (its dtypes, device, ``when`` predicates and,
        under the autotune policy, what was measured for its shape bucket)."""
        values = [state.signature.value(name, args, kwargs) for name in state.dispatch_args]
        platform, dtypes, _ = state._inputs_from_attrs(_call_attrs(values), ())
        return reg.explain(
            op_id,
            platform=platform,
            dtypes=dtypes,
            strict=state.strict,
            call=(args, kwargs),
            bucket=shape_bucket(state.dispatch_args, values),
            autotune=state.autotune,
        )

    def select(
        *,
        backend: str | None = None,
        platform: PlatformLike = None,
        dtypes: Sequence[str] | None = None,
    ) -> KernelSpec:
        return chosen_or_raise(explain_(backend=backend, platform=platform, dtypes=dtypes))

    def get_kernel_(
        backend: str | None = None,
        *,
        variant: str | None = None,
        platform: PlatformLike = None,
        dtypes: Sequence[str] | None = None,
    ) -> Callable[..., Any]:
        return reg.get_kernel(
            op_id,
            backend,
            variant=variant,
            platform=platform,
            dtypes=dtypes,
            strict=state.strict,
        )

    def specs() -> tuple[KernelSpec, ...]:
        return reg.get(op_id)

    wrapper.op_id = op_id
    wrapper.reference = reference
    wrapper.registry = reg
    wrapper.register = register
    wrapper.explain = explain_
    wrapper.explain_call = explain_call
    wrapper.select = select
    wrapper.get_kernel = get_kernel_
    wrapper.specs = specs


#: Where pickle finds op objects of the process-wide registry: ``op_objects.<key>``.
op_objects = OpObjects(__name__, dispatcher)

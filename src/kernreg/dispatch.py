"""Op objects, made by :func:`op` or :func:`dispatcher`: functions generated with their
reference's exact signature (:mod:`kernreg._codegen`) whose body calls ``box[0]``: the
chosen implementation, a generated per-call lookup by the dispatch arguments' dtypes and
device, the scoped route while a matching use_backend pin is live, or a resolver."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import MethodType
from typing import Any, ParamSpec, Protocol, TypeVar, cast

from kernreg._codegen import Signature
from kernreg._compile import (
    Targets,
    compiled_reference,
    inline_instead,
    run_while_tracing,
    through_the_compiler,
    tracing,
)
from kernreg._fork import Lock
from kernreg._names import check_name, check_op_id, check_variant
from kernreg._pickle import OpObjects, keep_op, kept_op, pickle_key
from kernreg.autotune import shape_bucket
from kernreg.dtypes import dtype_name
from kernreg.errors import InvalidSpecError
from kernreg.measurement import measurer
from kernreg.pins import Pin, on_pin_liveness, open_blocks, pins_for
from kernreg.platform import Platform, PlatformLike, Requirement
from kernreg.registry import (
    KernelRegistry,
    chosen_or_raise,
    default_registry,
    every_subscriber,
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

__all__ = ["Op", "dispatcher", "guarded", "in_demoted_bucket", "op"]

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])


class Op(Protocol[P, R]):
    """What :func:`op` returns: a function with the reference's signature that dispatches.
    An op object is a generated function, not an instance: :func:`_make_op` binds these
    methods to it."""

    op_id: str
    reference: Callable[P, R]
    registry: KernelRegistry
    _state: _OpState

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
    ) -> Any:
        """Add an implementation: ``@op.register("triton", requires=["cuda>=8.0"])`` on a function,
        or ``op.register("triton", "pkg.mod:fn", ...)`` for a lazily imported target."""
        check_name(backend, "backend")
        check_variant(variant)
        spec = functools.partial(
            KernelSpec,
            self.op_id,
            backend,
            variant=variant,
            requires=requires,
            dtypes=dtypes,
            when=when,
            packages=packages,
            traits=traits,
            priority=priority,
            description=description,
        )
        if target is not None:
            return self.registry.register(spec(target), replace=replace)

        def decorator(impl: F) -> F:
            self.registry.register(spec(impl), replace=replace)
            return impl

        return decorator

    def explain(
        self,
        *,
        backend: str | None = None,
        platform: PlatformLike = None,
        dtypes: Sequence[str] | None = None,
    ) -> Decision:
        return self._state.explain(platform, dtypes, backend=backend, autotune=self._state.autotune)

    def explain_call(self, *args: Any, **kwargs: Any) -> Decision:
        """The decision this exact call gets (its dtypes, device, ``when`` predicates and,
        under the autotune policy, what was measured for its shape bucket)."""
        state = self._state
        values = state.values(args, kwargs)
        return state.explain(
            *state.inputs(_call_attrs(values)),
            call=state.signature.forwarded(args, kwargs),  # as the predicates see it when run
            bucket=shape_bucket(state.dispatch_args, values),
            autotune=state.autotune,
        )

    def select(
        self,
        *,
        backend: str | None = None,
        platform: PlatformLike = None,
        dtypes: Sequence[str] | None = None,
    ) -> KernelSpec:
        return chosen_or_raise(self.explain(backend=backend, platform=platform, dtypes=dtypes))

    def get_kernel(
        self,
        backend: str | None = None,
        *,
        variant: str | None = None,
        platform: PlatformLike = None,
        dtypes: Sequence[str] | None = None,
    ) -> Callable[..., Any]:
        strict = self._state.strict
        return self.registry.get_kernel(
            self.op_id, backend, variant=variant, platform=platform, dtypes=dtypes, strict=strict
        )

    def specs(self) -> tuple[KernelSpec, ...]:
        return self.registry.get(self.op_id)


def _traces_changed() -> None:
    """The first trace opened or the last one closed: op objects record their calls or stop."""
    for state in every_subscriber():
        if isinstance(state, _OpState):
            state.follow()


on_trace_change(_traces_changed)


def _pin_liveness(pin: Pin) -> None:
    """A use_backend pin became live or died: the op objects it matches follow it."""
    for state in every_subscriber():
        if isinstance(state, _OpState) and pin.matches(state.op_id):
            state.follow()


on_pin_liveness(_pin_liveness)


def _call_attrs(values: Sequence[Any]) -> tuple[tuple[Any, Any], ...]:
    """``(dtype, device)`` of each dispatch argument (``None`` where it has none)."""
    return tuple((getattr(v, "dtype", None), getattr(v, "device", None)) for v in values)


@dataclass(eq=False)
class _OpState:
    """The mutable half of an op object: what ``box[0]`` holds, and how it is decided.

    Two routes are decided, each once per registry generation: the plain one, which
    compiled graphs trace too, and the one that records each call, taken while a trace is
    open (decided again when one opens, so the trace counts its decisions). Dynamo traces
    the plain route, guarding on whether a trace is open: a function compiled around op
    objects is compiled at most twice for traces, once with one open (recording the
    decisions it traces), once without, each reused after."""

    op_id: str
    signature: Signature
    registry: KernelRegistry
    dispatch_args: tuple[str, ...]
    strict: bool | None
    autotune: bool | None

    def __post_init__(self) -> None:
        self.lock = Lock()

        # Plain functions, not bound methods: a compiled region guards on what box[0]
        # holds, and dynamo's guard for a method fails outright once a function replaces it.
        def resolve_and_call(*args: Any, **kwargs: Any) -> Any:
            return getattr(self.targets, self._resolved_name(False))(*args, **kwargs)

        def resolve_and_record(*args: Any, **kwargs: Any) -> Any:
            return getattr(self.recorded_targets, self._resolved_name(True))(*args, **kwargs)

        def scoped(*args: Any, **kwargs: Any) -> Any:
            """Under a scoped pin of the caller's context: what the pin chooses; else the target."""
            # Reading the key makes torch.compile guard on the set of open blocks.
            if self.scoped_route(open_blocks.key):
                name = self.pinned_name(_call_attrs(self.values(args, kwargs)), False)
                return getattr(self.targets, name)(*args, **kwargs)
            # Reading ``recording`` makes a compiled graph guard on whether a trace is open:
            # compiled once more under one, deciding afresh, so the trace records its decisions.
            return (self.resolve_and_call if self.recording else self.target)(*args, **kwargs)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            """While a trace is open: the call, recorded (under a scoped pin: what it chooses)."""
            if self.live_pins and pins_for(self.op_id):
                name = self.pinned_name(_call_attrs(self.values(args, kwargs)), True)
                return getattr(self.recorded_targets, name)(*args, **kwargs)
            return self.recording_target(*args, **kwargs)

        # A compiled graph records no call (it records its decisions while it is traced):
        # dynamo takes the plain route, trace or not.
        inline_instead(recorded, scoped)
        self.resolve_and_call = resolve_and_call
        self.resolve_and_record = resolve_and_record
        self.scoped = scoped
        self.recorded = recorded
        #: The decided target: the implementation, a gated lookup, or the resolver.
        self.target: Callable[..., Any] = resolve_and_call
        #: The same, recording each call in the open traces.
        self.recording_target: Callable[..., Any] = resolve_and_record
        #: What the op object calls: the target, the scoped route while a live pin matches,
        #: or the recorded route while a trace is open.
        self.box: list[Callable[..., Any]] = [resolve_and_call]
        self.live_pins = False
        self.recording = False
        self.targets = Targets(resolve_and_call)
        self.recorded_targets = Targets(resolve_and_record)
        self.epoch = 0
        #: Per route (plain, recorded): (ids of pins, dispatch attributes) -> (pins, name in
        #: ``targets`` or ``recorded_targets``) under scoped pins.
        self.pinned: tuple[dict[Any, tuple[Any, str]], dict[Any, tuple[Any, str]]] = ({}, {})
        # Compiling a gated lookup costs ~50 us, and each registry mutation decides again.
        self._gated_factories: dict[tuple[str, ...], Callable[..., Callable[..., Any]]] = {}
        #: The op object and the name pickle finds it by, once it has one (see :meth:`rename`).
        self.named: tuple[weakref.ref[Any], str] | None = None

    def rename(self) -> None:
        """Show the op's implementations in the op object's name, which its repr shows:
        ``op_objects.demo.scale (2 implementations: fast, torch reference)|...``."""
        if self.named is None or (made := self.named[0]()) is None:
            return
        specs = self.registry.stored_implementations(self.op_id)
        labels = [f"{s.label} reference" if s.reference else s.label for s in specs]
        count = f"{len(specs)} implementation{'' if len(specs) == 1 else 's'}"
        summary = f"{count}: {', '.join(labels)}" if labels else count
        _, bar, rest = self.named[1].partition("|")
        made.__qualname__ = f"op_objects.{self.op_id} ({summary}){bar}{rest}"

    def invalidate(self) -> None:
        """Decide again on the next call (a registry mutation)."""
        with self.lock:
            self.epoch += 1
            self.pinned = ({}, {})
            self.targets.clear()
            self.recorded_targets.clear()
            self.target = self.resolve_and_call
            self.recording_target = self.resolve_and_record
            self._route()
        self.rename()

    def follow(self) -> None:
        """Take the recorded route while a trace is open, else the scoped route while a live
        use_backend pin matches the op, else the target."""
        with self.lock:
            self.live_pins = any(pin.matches(self.op_id) for pin in list(open_blocks.live.values()))
            recording = bool(active_traces())
            if recording and not self.recording:  # a trace opened: it counts the decisions
                self.recording_target = self.resolve_and_record
                self.recorded_targets.clear()
                self.pinned = (self.pinned[0], {})
            self.recording = recording
            self._route()

    def _route(self) -> None:
        # Lock held.
        if self.recording:
            self.box[0] = self.recorded
        else:
            self.box[0] = self.scoped if self.live_pins else self.target

    def _store(self, target: Callable[..., Any], recording: bool = False) -> str:
        """Keep ``target`` as an attribute of ``self.targets`` (``recording``: of
        ``self.recorded_targets``); return its name."""
        name = f"t{self.epoch}_{id(target):x}"
        with self.lock:
            setattr(self.recorded_targets if recording else self.targets, name, target)
        return name

    def values(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The dispatch arguments' values in a call."""
        return [self.signature.value(name, args, kwargs) for name in self.dispatch_args]

    def inputs(self, pairs: Sequence[tuple[Any, Any]]) -> tuple[Platform, tuple[str, ...] | None]:
        """The platform (the first device's) and dtypes of ``(dtype, device)`` pairs."""
        base = self.registry.platform
        dtypes = tuple(dtype_name(dtype) for dtype, _ in pairs if dtype is not None)
        device = next((dev for _, dev in pairs if dev is not None), None)
        return (base if device is None else base.for_device(device)), dtypes or None

    def explain(
        self, platform: PlatformLike = None, dtypes: Sequence[str] | None = None, **more: Any
    ) -> Decision:
        return self.registry.explain(
            self.op_id, platform=platform, dtypes=dtypes, strict=self.strict, **more
        )

    @run_while_tracing
    def _resolved_name(self, recording: bool) -> str:
        """Choose the target now (``recording``: the recording one, named in
        ``recorded_targets``); keep it unless the registry moved meanwhile or torch.compile
        traces (its guards read the target after); return its name in ``targets``."""
        self.registry.ensure_plugins()
        epoch = self.epoch
        specs = self.registry.get(self.op_id)
        tuned = (
            self.registry.config.autotuned(self.op_id) if self.autotune is None else self.autotune
        )
        used = {
            "dtype": tuned or any(s.dtypes for s in specs),
            "device": tuned or any(s.requires for s in specs),
            "shape": tuned,  # measured choices differ by shape bucket
        }
        gates = tuple(attr for attr, on in used.items() if on)
        if gates and self.dispatch_args:
            target = self._gated_lookup(gates, recording)
        else:
            target = self._callable_for(self.explain(), recording)
        if not tracing() and not pins_for(self.op_id):  # else this context's decision alone
            with self.lock:
                if self.epoch == epoch:
                    if recording:
                        self.recording_target = target
                    else:
                        self.target = target
                    self._route()
        return self._store(target, recording)

    def _gated_lookup(self, gates: tuple[str, ...], recording: bool) -> Callable[..., Any]:
        """A function with the reference's signature that looks the implementation up per
        call in a cache of its own (compiled once per set of gates)."""
        # The cache's levels, outermost first: (index of a dispatch argument, attribute).
        # Only the first argument's device: a decision takes its platform from the first
        # device, and with torch tensors each ``.device`` read costs ~140 ns a call.
        indices = range(len(self.dispatch_args))
        parts = [(i, attr) for i in indices for attr in gates if attr != "device" or i == 0]
        cache: dict[Any, Any] = {}  # this generation's: its nesting never changes

        def keep(key: list[Any], target: Callable[..., Any]) -> Callable[..., Any]:
            # Not kept where a part of the key is missing or unhashable (such a call is
            # decided each time), while torch.compile traces, or under a scoped pin of this
            # context (a call that re-dispatches mid-way can get here).
            if any(part is None for part in key) or tracing() or pins_for(self.op_id):
                return target
            with contextlib.suppress(TypeError):
                node = cache
                for part in key[:-1]:
                    node = node.setdefault(part, {})
                node[key[-1]] = target
            return target

        @run_while_tracing  # reads only dtypes and devices: constants while dynamo traces
        def miss(pairs: Sequence[tuple[Any, Any]]) -> str:
            target = self._callable_for(self.explain(*self.inputs(pairs)), recording)
            kept = keep([pairs[i][attr == "device"] for i, attr in parts], target)
            return self._store(kept, recording)

        def tuned_miss(*args: Any, **kwargs: Any) -> Callable[..., Any]:
            """Decide an autotuned call, first measuring the candidates on its arguments
            where its shape bucket has no recorded result."""
            values = self.values(args, kwargs)
            platform, dtypes = self.inputs(_call_attrs(values))
            bucket = shape_bucket(self.dispatch_args, values)
            decision = self.explain(platform, dtypes, bucket=bucket, autotune=True)
            # measurer(): None without the torch layer, and then priority decides.
            if decision.tuning and not tracing() and (measure := measurer()) is not None:
                names = self.signature.names
                results = measure(self.op_id, decision.tuning, args, kwargs, params=names)
                if results:
                    self.registry.record_measurements(self.op_id, platform, dtypes, bucket, results)
                    decision = self.explain(platform, dtypes, bucket=bucket, autotune=True)
            target = self._callable_for(decision, recording)
            return keep([getattr(values[i], attr, None) for i, attr in parts], target)

        cells = {
            "cache": cache,
            "miss": tuned_miss if "shape" in gates else miss,
            "targets": self.recorded_targets if recording else self.targets,
            "attrs": _call_attrs,
            "getattr": getattr,  # parameters may be named like builtins
            "Exception": Exception,
        }
        factory = self._gated_factories.get(gates)
        if factory is None:
            forward = self.signature.forward
            # A reference's leading *args dispatches on its first value (none: a miss).
            star = {n for n in self.dispatch_args if self.signature.kinds[n] == "VAR_POSITIONAL"}
            read = [f"{n}[0]" if n in star else n for n in self.dispatch_args]
            found = [f"({n}[0] if {n} else None)" if n in star else n for n in self.dispatch_args]
            if "shape" in gates:  # autotune: the miss may measure this call's arguments
                on_miss = f"$miss({forward})"
            else:
                on_miss = f"$getattr($targets, $miss($attrs(({', '.join(found)},))))"
            lookup = "".join(f"[{read[i]}.{attr}]" for i, attr in parts)
            body = (
                "try:\n"
                # Nested dicts: with torch tensors, c[x.dtype][x.device] costs ~25 ns less
                # than c[x.dtype, x.device].
                f"    $impl = $cache{lookup}\n"
                # KeyError on a miss; AttributeError/TypeError: an argument without the attribute.
                "except $Exception:\n"
                f"    $impl = {on_miss}\n"
                f"return $impl({forward})\n"
            )
            factory = self.signature.factory("gated_" + self.op_id.replace(".", "_"), body, cells)
            self._gated_factories[gates] = factory
        return factory(**cells)

    @run_while_tracing
    def scoped_route(self, _blocks: str) -> bool:
        """Whether a pin of this context matches this op (``_blocks``, the key of the set
        of open blocks, is passed so that a compiled graph guards on it)."""
        return bool(pins_for(self.op_id))

    @run_while_tracing
    def pinned_name(self, pairs: Sequence[tuple[Any, Any]], recording: bool) -> str:
        """The name in ``self.targets`` (``recording``: ``self.recorded_targets``) of what a
        call runs under this context's scoped pins."""
        pins = pins_for(self.op_id)
        pinned = self.pinned[recording]
        # Keyed by the pins' identities (hashing a pin's fields costs ~4 us a call); the
        # entry keeps the pins, so an id reused by a later pin is never taken for one.
        key: Any = (tuple(map(id, pins)), tuple(pairs))
        try:
            found = pinned.get(key)
        except TypeError:  # an unhashable dtype or device: decided on each call
            found, key = None, None
        fresh = tracing() and active_traces()  # decided again, so the trace records it
        if (
            found is not None
            and not fresh
            and all(a is b for a, b in zip(found[0], pins, strict=True))
        ):
            return found[1]
        decision = self.explain(*self.inputs(pairs))
        name = self._store(self._callable_for(decision, recording), recording)
        if key is not None and not tracing():
            if len(pinned) >= 256:  # every block makes a new pin: stay bounded
                pinned.clear()
            pinned[key] = (pins, name)  # this generation's dict: invalidate() replaces it
        return name

    def _callable_for(self, decision: Decision, recording: bool = False) -> Callable[..., Any]:
        """What a call runs for ``decision``: the implementation, a ``when`` chooser, or a
        function raising the decision's error; ``recording``: each call recorded in the open
        traces (while torch.compile traces: raised now, and an open trace records the
        decision once instead of each call)."""
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
        if compiling:
            if active_traces() and not decision.conditional:
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
        :func:`guarded`; a call in a demoted bucket runs what the rules choose there."""

        def instead(where: str) -> Callable[..., Any]:
            def decide(call: Any = None) -> Callable[..., Any]:
                platform, dtypes = decision.platform, decision.dtypes
                return self._callable_for(self.explain(platform, dtypes, call=call, bucket=where))

            if spec is None:
                return decide()
            return lambda *args, **kwargs: decide((args, kwargs))(*args, **kwargs)  # per call

        return guarded(
            decision,
            impl,
            registry=self.registry,
            strict=self.strict,
            spec=spec,
            names=self.dispatch_args,
            values=self.values,
            instead=instead,
        )

    def _traced(self, impl: Callable[..., Any], label: str, rule: str) -> Callable[..., Any]:
        """``impl`` recording each call in the open traces (made only while one is open)."""

        def traced(*args: Any, **kwargs: Any) -> Any:
            record_call(self.op_id, label, rule, self.values(args, kwargs))
            return impl(*args, **kwargs)

        return traced

    def _chooser(
        self, decision: Decision, static: Callable[..., Any], recording: bool
    ) -> Callable[..., Any]:
        """Evaluate ``when`` predicates, highest priority first, then fall back to ``static``."""
        tiers: dict[int, list[tuple[Any, KernelSpec]]] = {}  # (predicate, spec)
        for spec in decision.conditional:
            tiers.setdefault(spec.priority, []).append((spec.load_when(), spec))
        chosen = decision.chosen
        firm = chosen.priority if chosen is not None and not chosen.reference else None
        ordered = [(tiers[p], p == firm) for p in sorted(tiers, reverse=True)]

        by_key = {spec.key: spec for spec in decision.conditional}

        @run_while_tracing  # passed the key: torch < 2.13 passes only constants to it
        def loaded_name(key: tuple[str, str, str]) -> str:
            """Import the implementation (for real, also while torch.compile traces)."""
            spec = by_key[key]
            if active_traces() and tracing():
                record_decision(self.op_id, spec.label, "when", ())
            return self._store(spec.load())

        def load(spec: KernelSpec) -> Callable[..., Any]:
            impl = getattr(self.targets, loaded_name(spec.key))
            if recording:  # never while torch.compile traces (see _callable_for)
                impl = self._traced(impl, spec.label, "when")
            return self._guarded(decision, impl, spec)

        # A dict that dynamo saw change would fail its guard: while it traces, fill it now.
        loaded = {spec.key: load(spec) for spec in decision.conditional} if tracing() else {}

        def choose(*args: Any, **kwargs: Any) -> Any:
            for tier, shares_firm_tier in ordered:
                hits = [spec for predicate, spec in tier if predicate(*args, **kwargs)]
                if len(hits) == 1 and not shares_firm_tier:
                    count(self.op_id, "when", hits[0].label)
                    impl = loaded.get(hits[0].key)
                    if impl is None:
                        impl = loaded[hits[0].key] = load(hits[0])
                    return impl(*args, **kwargs)
                if hits:  # several hold at one priority: the full decision raises the error
                    again = self.explain(decision.platform, decision.dtypes, call=(args, kwargs))
                    spec = chosen_or_raise(again)
                    count(self.op_id, "when", spec.label)
                    impl = spec.load()
                    if recording:
                        impl = self._traced(impl, spec.label, "when")
                    return impl(*args, **kwargs)
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
    """``impl``, what ``decision`` (or ``spec``'s ``when`` predicate) chose, under the demotion
    policy (``KERNREG_DEMOTE``, docs/fallbacks.md); ``impl`` itself where the policy is off
    for the op, or the choice is the reference or was asked for (``backend=``, a pin).

    A call's shape bucket is that of ``values(args, kwargs)``, named ``names`` (default:
    the first positional argument); ``instead(bucket)`` runs in a demoted bucket (default:
    :func:`in_demoted_bucket`). While torch.compile traces, a failure propagates.
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
    known: dict[Any, str] = {}  # shapes -> bucket: shape_bucket costs ~2 us a call

    def bucket(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        found = values(args, kwargs) if values is not None else args[: len(names)]
        shapes = tuple(getattr(v, "shape", None) for v in found)
        try:
            where = known.get(shapes)
        except TypeError:  # an unhashable shape: found each time
            return shape_bucket(names[: len(found)], found)
        if where is None:
            if len(known) > 1024:  # sizes without end (sequence lengths): stay bounded
                known.clear()
            where = known[shapes] = shape_bucket(names[: len(found)], found)
        return where

    if instead is None:

        def instead(where: str) -> Callable[..., Any]:
            return in_demoted_bucket(decision, where, reg, traits, strict, names)[0]

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


def in_demoted_bucket(
    decision: Decision,
    bucket: str,
    registry: KernelRegistry,
    traits: Sequence[str] = (),
    strict: bool | None = None,
    names: Sequence[str] | None = None,
) -> tuple[Callable[..., Any], Decision]:
    """What answers the calls in a shape ``bucket`` where ``decision``'s choice is demoted
    (itself :func:`guarded`), and the decision that chose it; decided in an empty context,
    so the caller's pins and compile-safe region do not fix what the bucket runs."""
    again: Decision = contextvars.Context().run(
        registry.explain,
        decision.op,
        platform=decision.platform,
        dtypes=decision.dtypes,
        traits=traits,
        strict=strict,
        bucket=bucket,
    )
    run = chosen_or_raise(again).load()
    return guarded(again, run, registry=registry, traits=traits, strict=strict, names=names), again


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
    ``dtype``/``device`` select the implementation per call (default: the first one; for
    a reference taking ``*args`` first, the first positional argument). ``strict=True``
    makes a fallback to the reference an error for this op.
    ``autotune=True`` chooses by measured speed per shape bucket (default:
    ``KERNREG_POLICY``). ``torch_compile=True`` also registers a derived ``torch_compile``
    implementation: ``torch.compile`` of the reference, compiled on its first call, trait
    ``compile_safe``, priority ``-100`` (below every hand-written kernel).
    """
    check_op_id(op_id)
    check_name(backend, "backend")
    reg = default_registry() if registry is None else registry

    def decorate(reference: Callable[P, R]) -> Op[P, R]:
        # Build the op object before registering, so a failure leaves nothing registered.
        made = _make_op(op_id, reference, reference, reg, dispatch_args, strict, autotune)
        reg.register(
            KernelSpec(
                op_id, backend, reference, reference=True, traits=traits, description=description
            )
        )
        if torch_compile:
            reg.register(compiled_reference(op_id, reference))
        located = reference if "<" not in getattr(reference, "__qualname__", "<") else None
        key = _pickle_key(reg, op_id, strict, autotune, dispatch_args, located)
        _keep_for_pickle(key, made, newest=True)  # the newest: a reloaded module's
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
    if key is not None and (existing := kept_op(op_objects, key)) is not None:
        return cast(Op[P, R], existing)
    reg.ensure_plugins()
    reference = reg.reference(op_id)
    if like is None:
        if reference is None:
            why = f"op '{op_id}' has no reference implementation to take the signature from"
            raise InvalidSpecError("like", None, why)
        like = reference.load()
    made = _make_op(
        op_id, reference.load() if reference else like, like, reg, dispatch_args, strict, autotune
    )
    return cast(Op[P, R], _keep_for_pickle(key, made, newest=False))


def _pickle_key(reg: KernelRegistry, op_id: str, *options: Any) -> str | None:
    """The key an op object pickles under; ``None`` outside the process-wide registry."""
    return pickle_key(op_id, *options) if reg is default_registry() else None


def _keep_for_pickle(key: str | None, made: Any, *, newest: bool) -> Any:
    """Keep ``made`` under ``key`` (:func:`kernreg._pickle.keep_op`), named so; the one kept."""
    held = made if key is None else keep_op(op_objects, key, made, newest=newest)
    if key is not None and held is made:
        made._state.named = (weakref.ref(made), key)
        made._state.rename()
    return held


def _make_op(
    op_id: str,
    reference: Callable[..., Any],
    like: Callable[..., Any],
    reg: KernelRegistry,
    dispatch_args: Sequence[str] | None,
    strict: bool | None,
    autotune: bool | None,
) -> Any:
    """The op object, with the signature of ``like``."""
    signature = Signature(like)
    if dispatch_args is None:  # the first parameter (*args: its first value), unless **kwargs
        names = tuple(n for n in signature.names[:1] if signature.kinds[n] != "VAR_KEYWORD")
    else:
        names = tuple(dispatch_args)
        for name in names:
            if signature.kinds.get(name, "VAR_").startswith("VAR_"):  # *args, **kwargs, unknown
                raise InvalidSpecError(
                    "dispatch_args", name, f"not a named parameter of {target_name(like)}"
                )
    state = _OpState(op_id, signature, reg, names, strict, autotune)
    box_call = f"return $box[0]({signature.forward})\n"
    wrapper = signature.factory(op_id.split(".")[-1], box_call, ["box"])(box=state.box)
    functools.update_wrapper(wrapper, reference)
    # torch.compile cannot read a context variable: it traces the scoped route instead,
    # which asks for real whether a pin applies and guards on the set of open blocks.
    inline_instead(wrapper, state.scoped)
    vars(wrapper).update(op_id=op_id, reference=reference, registry=reg, _state=state)
    for name in ("register", "explain", "explain_call", "select", "get_kernel", "specs"):
        setattr(wrapper, name, MethodType(getattr(Op, name), wrapper))
    reg.subscribe(state)
    state.follow()  # after subscribing: no change of live pins or traces is missed
    return wrapper


#: Where pickle finds op objects of the process-wide registry: ``op_objects.<key>``.
op_objects = OpObjects(__name__, dispatcher)

"""Turning decisions into calls: :func:`get_kernel`, :func:`select_kernel` and op objects.

An op object is a function generated with its reference's exact signature, so calling
it costs one extra Python frame and no ``*args`` packing (the budgets are in
docs/design.md). Its body calls ``box[0]``: the chosen implementation itself for a static
decision, or a generated per-call gate that looks the decision up by the first
argument's ``dtype``/``device``. Any registry mutation resets ``box[0]`` to a resolver.
"""

from __future__ import annotations

import contextlib
import functools
import keyword
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, cast

from kernreg._names import check_name, check_op_id, check_variant
from kernreg.autotune import shape_bucket
from kernreg.dtypes import dtype_name
from kernreg.errors import InvalidSpecError
from kernreg.platform import Platform, Requirement
from kernreg.registry import (
    KernelRegistry,
    chosen_or_raise,
    default_registry,
    on_scoped_pins_change,
    scoped_pins_active,
)
from kernreg.selection import Decision
from kernreg.spec import KernelSpec, Target, target_name
from kernreg.tracing import active_traces, record_call

__all__ = ["Op", "dispatcher", "explain", "get_kernel", "op", "select_kernel"]

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])

PlatformLike = Platform | str | None


def _platform(value: PlatformLike) -> Platform | None:
    if value is None or isinstance(value, Platform):
        return value
    return Platform.parse(value, source="argument")


def _registry(registry: KernelRegistry | None) -> KernelRegistry:
    return default_registry() if registry is None else registry


def select_kernel(
    op: str,
    backend: str | None = None,
    *,
    variant: str | None = None,
    platform: PlatformLike = None,
    dtypes: Sequence[str] | None = None,
    traits: Sequence[str] = (),
    strict: bool | None = None,
    registry: KernelRegistry | None = None,
) -> KernelSpec:
    """The spec that runs for ``op`` (docs/design.md gives the order of the rules)."""
    return _registry(registry).select(
        op,
        backend=backend,
        variant=variant,
        platform=_platform(platform),
        dtypes=dtypes,
        traits=traits,
        strict=strict,
    )


def get_kernel(
    op: str,
    backend: str | None = None,
    *,
    variant: str | None = None,
    platform: PlatformLike = None,
    dtypes: Sequence[str] | None = None,
    traits: Sequence[str] = (),
    strict: bool | None = None,
    registry: KernelRegistry | None = None,
) -> Callable[..., Any]:
    """The chosen implementation itself (not a wrapper), imported once per decision key."""
    return _registry(registry).get_kernel(
        op,
        backend,
        variant=variant,
        platform=_platform(platform),
        dtypes=dtypes,
        traits=traits,
        strict=strict,
    )


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
    return _registry(registry).explain(
        op,
        backend=backend,
        variant=variant,
        platform=_platform(platform),
        dtypes=dtypes,
        traits=traits,
        strict=strict,
    )


# --- op objects -----------------------------------------------------------------------------


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


_PREFIX = "_kr_"
_all_states: weakref.WeakSet[_OpState] = weakref.WeakSet()
_all_states_lock = threading.Lock()


def invalidate_all_ops() -> None:
    """Make every op object resolve again on its next call (scoped pins or tracing changed)."""
    with _all_states_lock:
        states = list(_all_states)
    for state in states:
        with state.registry._lock:
            state.invalidate()


on_scoped_pins_change(lambda active: invalidate_all_ops())


def _device_type(device: object) -> str:
    kind = getattr(device, "type", None)
    if isinstance(kind, str):
        return kind
    return str(device).partition(":")[0]


def _run_while_tracing(func: F) -> F:
    """Have ``torch.compile`` call ``func`` for real while it traces, its result a constant.

    Selection takes locks and imports modules, which dynamo cannot trace; what it returns
    (an attribute name) is a plain string, so the traced code then reads the chosen
    implementation from :class:`_Targets` and traces into it. This sets the marker that
    ``torch.compiler.assume_constant_result`` sets, without importing torch.
    """
    func._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return func


def _tracing() -> bool:
    """Whether torch.compile is tracing right now (code it runs for real must not change
    what the trace has read: its guards are built from those objects afterwards)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.compiler.is_compiling())


class _Targets:
    """Targets chosen for calls, one attribute each, read by the name selection returns.

    A compiled region reads each one through its own attribute, so dynamo builds and
    guards it fresh instead of reusing what it saw of a container before selection ran.
    Every registry mutation clears them: a name from before then resolves to
    ``fallback`` (dispatch the call again), and a compiled region's guard on it fails,
    so it is traced again.
    """

    def __init__(self, fallback: Callable[..., Any]) -> None:
        self._fallback = fallback

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # Only called for names that are not set: those cleared by a registry mutation.
        return self._fallback

    def clear(self) -> None:
        fallback = self._fallback
        self.__dict__.clear()
        self._fallback = fallback


def _call_attrs(values: Sequence[Any]) -> tuple[tuple[Any, Any], ...]:
    """``(dtype, device)`` of each dispatch argument (``None`` where it has none)."""
    return tuple((getattr(v, "dtype", None), getattr(v, "device", None)) for v in values)


class _Signature:
    """The reference's parameters as source text: how to declare them and how to forward them."""

    def __init__(self, func: Callable[..., Any]) -> None:
        import inspect  # ~6 ms: paid by the first op definition, not by `import kernreg`

        sig = inspect.signature(func)
        self.defaults: dict[str, Any] = {}
        params: list[str] = []
        forward: list[str] = []
        self.names: list[str] = []
        saw_kw_only_marker = False
        previous_kind: Any = None
        for param in sig.parameters.values():
            name = param.name
            if name.startswith(_PREFIX) or keyword.iskeyword(name):
                raise InvalidSpecError("reference", func, f"parameter name {name!r} is reserved")
            self.names.append(name)
            kind = param.kind
            if (
                previous_kind is inspect.Parameter.POSITIONAL_ONLY
                and kind is not inspect.Parameter.POSITIONAL_ONLY
            ):
                params.append("/")
            if kind is inspect.Parameter.KEYWORD_ONLY and not saw_kw_only_marker:
                params.append("*")
                saw_kw_only_marker = True
            text = name
            if kind is inspect.Parameter.VAR_POSITIONAL:
                text = "*" + name
                saw_kw_only_marker = True
                forward.append(text)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                text = "**" + name
                forward.append(text)
            elif kind is inspect.Parameter.KEYWORD_ONLY:
                forward.append(f"{name}={name}")
            else:
                forward.append(name)
            if param.default is not inspect.Parameter.empty:
                default_name = f"{_PREFIX}d_{name}"
                self.defaults[default_name] = param.default
                text += f"={default_name}"
            params.append(text)
            previous_kind = kind
        if previous_kind is inspect.Parameter.POSITIONAL_ONLY:
            params.append("/")
        self.params = ", ".join(params)
        self.forward = ", ".join(forward)
        self.kinds = {p.name: p.kind.name for p in sig.parameters.values()}

    def build(self, name: str, body: str, namespace: dict[str, Any]) -> Callable[..., Any]:
        """Compile ``def name(<params>): <body>`` with the defaults and ``namespace`` in scope."""
        source = f"def {name}({self.params}):\n{body}"
        scope: dict[str, Any] = {**self.defaults, **namespace}
        exec(compile(source, f"<kernreg {name}>", "exec"), scope)
        return cast(Callable[..., Any], scope[name])


class _OpState:
    """The mutable half of an op object: its current target, per-signature cache and resolver."""

    def __init__(
        self,
        op_id: str,
        signature: _Signature,
        registry: KernelRegistry,
        dispatch_args: tuple[str, ...],
        strict: bool | None,
        autotune: bool | None = None,
    ) -> None:
        self.op_id = op_id
        self.registry = registry
        self.strict = strict
        self.autotune = autotune
        self.dispatch_args = dispatch_args
        self.signature = signature

        # A plain function, not a bound method: a compiled region guards on what box[0]
        # holds, and dynamo's guard for a method fails outright once a function replaces it.
        def resolve_and_call(*args: Any, **kwargs: Any) -> Any:
            return getattr(self.targets, self._resolved_name())(*args, **kwargs)

        self._resolve_and_call = resolve_and_call
        self.box: list[Callable[..., Any]] = [resolve_and_call]
        self.targets = _Targets(resolve_and_call)
        self.cache: dict[Any, Any] = {}  # nested: one level per gated attribute
        self.epoch = 0
        self._gates: tuple[str, ...] = ("dtype", "device")
        self._gated: Callable[..., Any] | None = None

    # Called with the registry lock held.
    def invalidate(self) -> None:
        self.epoch += 1
        self.cache.clear()
        self.targets.clear()
        self.box[0] = self._resolve_and_call

    def _publish(self, epoch: int, target: Callable[..., Any]) -> None:
        with self.registry._lock:
            if self.epoch == epoch:
                self.box[0] = target

    def _store(self, target: Callable[..., Any]) -> str:
        """Keep ``target`` as an attribute of ``self.targets``; return its name."""
        name = f"t{self.epoch}_{id(target):x}"
        with self.registry._lock:
            setattr(self.targets, name, target)
        return name

    @_run_while_tracing
    def _resolved_name(self) -> str:
        return self._store(self.resolve())

    def resolve(self) -> Callable[..., Any]:
        """Choose what ``box[0]`` holds now; store it unless the registry moved meanwhile or
        torch.compile is tracing (its guards read box[0] after the trace)."""
        self.registry._ensure_plugins()
        epoch = self.epoch
        if scoped_pins_active():
            target: Callable[..., Any] = self._pinned_call
        else:
            specs = self.registry.get(self.op_id)
            tuned = (
                self.registry.config.autotuned(self.op_id)
                if self.autotune is None
                else self.autotune
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
                target = self._gated_dispatcher(gates)
            else:
                decision = self.registry.explain(self.op_id, strict=self.strict)
                target = self._callable_for(decision)
        if not _tracing():
            self._publish(epoch, target)
        return target

    def _gated_dispatcher(self, gates: tuple[str, ...]) -> Callable[..., Any]:
        """A function with the reference's signature that looks the decision up per call."""
        if self._gated is not None and self._gates == gates:
            return self._gated
        # Nested dicts, one level per attribute: with torch tensors, `c[x.dtype][x.device]` costs
        # ~25 ns less than `c[x.dtype, x.device]` (no tuple to build and hash).
        lookup = f"{_PREFIX}cache" + "".join(
            f"[{arg}.{attr}]" for arg in self.dispatch_args for attr in gates
        )
        dispatch_values = "(" + ", ".join(self.dispatch_args) + ",)"
        forward = self.signature.forward
        if "shape" in gates:  # autotune: the miss may measure, on this call's own arguments
            miss = f"{_PREFIX}tuned_miss({forward})"
        else:
            miss = f"getattr({_PREFIX}targets, {_PREFIX}miss({_PREFIX}attrs({dispatch_values})))"
        body = (
            "    try:\n"
            f"        {_PREFIX}impl = {lookup}\n"
            # KeyError on a miss; AttributeError/TypeError for arguments without .dtype/.device.
            "    except Exception:\n"
            f"        {_PREFIX}impl = {miss}\n"
            f"    return {_PREFIX}impl({forward})\n"
        )
        func = self.signature.build(
            "gated_" + self.op_id.replace(".", "_"),
            body,
            {
                f"{_PREFIX}cache": self.cache,
                f"{_PREFIX}miss": self._miss,
                f"{_PREFIX}tuned_miss": self._tuned_miss,
                f"{_PREFIX}targets": self.targets,
                f"{_PREFIX}attrs": _call_attrs,
            },
        )
        self._gates, self._gated = gates, func
        return func

    def _call_inputs(self, values: Sequence[Any]) -> tuple[Platform, tuple[str, ...] | None, Any]:
        """Platform, dtypes and cache key of a call from its dispatch arguments."""
        return self._inputs_from_attrs(_call_attrs(values))

    def _inputs_from_attrs(
        self, pairs: Sequence[tuple[Any, Any]]
    ) -> tuple[Platform, tuple[str, ...] | None, Any]:
        """Platform, dtypes and cache key from the ``(dtype, device)`` of each dispatch argument."""
        base = self.registry.platform
        dtypes: list[str] = []
        key: list[Any] = []
        device = None
        cacheable = True
        attrs = self._gates
        for dtype, dev in pairs:
            if dtype is not None:
                dtypes.append(dtype_name(dtype))
            if dev is not None and device is None:
                device = dev
            for attr, obj in (("dtype", dtype), ("device", dev)):
                if attr in attrs:
                    cacheable = cacheable and obj is not None
                    key.append(obj)
        platform = base if device is None else base.for_device(device)
        cache_key = tuple(key) if cacheable and key else None
        return platform, (tuple(dtypes) if dtypes else None), cache_key

    @_run_while_tracing
    def _miss(self, pairs: Sequence[tuple[Any, Any]]) -> str:
        """Decide for a call missing from the cache; the name of its target in ``self.targets``.

        Takes only the dispatch arguments' dtypes and devices, which are constants while
        ``torch.compile`` traces, so a compiled region runs it for real (see
        :func:`_run_while_tracing`).
        """
        epoch = self.epoch
        platform, dtypes, cache_key = self._inputs_from_attrs(pairs)
        decision = self.registry.explain(
            self.op_id, platform=platform, dtypes=dtypes, strict=self.strict
        )
        target = self._callable_for(decision)
        if cache_key is not None and not _tracing():
            with self.registry._lock:
                if self.epoch == epoch:
                    # An unhashable dtype/device is decided again on the next call.
                    with contextlib.suppress(TypeError):
                        node = self.cache
                        for part in cache_key[:-1]:
                            node = node.setdefault(part, {})
                        node[cache_key[-1]] = target
        return self._store(target)

    def _tuned_miss(self, /, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        """Decide a call of an autotuned op missing from the cache, measuring the candidates
        on this call's arguments when its shape bucket has no recorded result yet."""
        epoch = self.epoch
        values = [self._bind_value(name, args, kwargs) for name in self.dispatch_args]
        platform, dtypes, _ = self._inputs_from_attrs(_call_attrs(values))
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
        if decision.tuning and not _tracing():
            try:
                from kernreg.torch.tune import measure
            except ImportError:  # no torch: nothing to measure with, priority decides
                pass
            else:
                results = measure(op_id, decision.tuning, args, kwargs, params=self.signature.names)
                if results:
                    registry.record_measurements(op_id, platform, dtypes, bucket, results)
                    decision = decide()
        target = self._callable_for(decision)
        parts = [getattr(v, attr, None) for v in values for attr in ("dtype", "device", "shape")]
        if all(p is not None for p in parts) and not _tracing():
            with self.registry._lock, contextlib.suppress(TypeError):
                if self.epoch == epoch:
                    node = self.cache
                    for part in parts[:-1]:
                        node = node.setdefault(part, {})
                    node[parts[-1]] = target
        return target

    def _pinned_call(self, /, *args: Any, **kwargs: Any) -> Any:
        """The call path while some :func:`use_backend` block is open (in any thread)."""
        values = [self._bind_value(name, args, kwargs) for name in self.dispatch_args]
        platform, dtypes, _ = self._call_inputs(values)
        decision = self.registry.explain(
            self.op_id, platform=platform, dtypes=dtypes, strict=self.strict
        )
        return self._callable_for(decision)(*args, **kwargs)

    def _bind_value(self, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """The value parameter ``name`` takes in a call, as Python would bind it."""
        kind = self.signature.kinds[name]
        # A positional-only name in kwargs belongs to **kwargs, not to the parameter.
        if kind != "POSITIONAL_ONLY" and name in kwargs:
            return kwargs[name]
        if kind != "KEYWORD_ONLY":
            index = self.signature.names.index(name)
            if index < len(args):
                return args[index]
        return self.signature.defaults.get(f"{_PREFIX}d_{name}")

    def _callable_for(self, decision: Decision) -> Callable[..., Any]:
        """What a call should run for ``decision``: the implementation, a ``when`` chooser,
        or a function raising the decision's error."""
        try:
            static = chosen_or_raise(decision).load()
        except Exception as exc:
            error = exc

            def static(*args: Any, **kwargs: Any) -> Any:
                raise error

        tracing = bool(active_traces())
        if tracing:
            static = self._traced(
                static,
                decision.chosen.label if decision.ok and decision.chosen else "<error>",
                decision.rule,
            )
        if not decision.conditional:
            return static
        return self._chooser(decision, static, tracing)

    def _traced(
        self, impl: Callable[..., Any], implementation: str, rule: str
    ) -> Callable[..., Any]:
        """``impl`` wrapped to record each call in the open traces (only while one is open)."""
        op_id, names, bind = self.op_id, self.dispatch_args, self._bind_value

        def traced(*args: Any, **kwargs: Any) -> Any:
            record_call(op_id, implementation, rule, [bind(name, args, kwargs) for name in names])
            return impl(*args, **kwargs)

        return traced

    @_run_while_tracing
    def _loaded_name(self, spec: KernelSpec) -> str:
        """Import ``spec``'s implementation (for real, also while torch.compile traces)."""
        return self._store(spec.load())

    def _chooser(
        self, decision: Decision, static: Callable[..., Any], tracing: bool
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
        registry, op_id, strict = self.registry, self.op_id, self.strict
        platform, dtypes = decision.platform, decision.dtypes

        def choose(*args: Any, **kwargs: Any) -> Any:
            for _, tier, shares_firm_tier in ordered:
                hits = [spec for predicate, spec in tier if predicate(*args, **kwargs)]
                if not hits:
                    continue
                if len(hits) == 1 and not shares_firm_tier:
                    impl = loaded.get(hits[0].key)
                    if impl is None:
                        impl = getattr(self.targets, self._loaded_name(hits[0]))
                        loaded[hits[0].key] = impl
                        if tracing:
                            impl = loaded[hits[0].key] = self._traced(impl, hits[0].label, "when")
                    return impl(*args, **kwargs)
                # Several candidates hold at one priority: let the full decision raise the error.
                spec = registry.select(
                    op_id, platform=platform, dtypes=dtypes, strict=strict, call=(args, kwargs)
                )
                return (self._traced(spec.load(), spec.label, "when") if tracing else spec.load())(
                    *args, **kwargs
                )
            return static(*args, **kwargs)

        return choose


def op(
    op_id: str,
    *,
    backend: str = "torch",
    dispatch_args: Sequence[str] | None = None,
    strict: bool | None = None,
    autotune: bool | None = None,
    traits: Iterable[str] = (),
    description: str = "",
    registry: KernelRegistry | None = None,
) -> Callable[[Callable[P, R]], Op[P, R]]:
    """Define op ``op_id`` on its reference implementation; the result dispatches when called.

    ``backend`` names the reference's backend. ``dispatch_args`` are the parameters whose
    ``dtype``/``device`` select the implementation per call (default: the first one).
    ``strict=True`` makes a fallback to the reference an error for this op.
    ``autotune=True`` chooses by measured speed per shape bucket (default:
    ``KERNREG_POLICY``).
    """
    check_op_id(op_id)
    check_name(backend, "backend")
    reg = _registry(registry)

    def decorate(reference: Callable[P, R]) -> Op[P, R]:
        signature = _Signature(reference)
        names = _dispatch_names(signature, dispatch_args, reference)
        reg.register(
            KernelSpec(
                op_id, backend, reference, reference=True, traits=traits, description=description
            )
        )
        return cast(Op[P, R], _make_op(op_id, reference, signature, reg, names, strict, autotune))

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
    implementation, which is imported now. Nothing is registered.
    """
    check_op_id(op_id)
    reg = _registry(registry)
    reg._ensure_plugins()
    reference = reg.reference(op_id)
    if like is None:
        if reference is None:
            raise InvalidSpecError(
                "like",
                None,
                f"op '{op_id}' has no reference implementation to take the signature from",
            )
        like = reference.load()
    signature = _Signature(like)
    names = _dispatch_names(signature, dispatch_args, like)
    made = _make_op(
        op_id, reference.load() if reference else like, signature, reg, names, strict, autotune
    )
    return cast(Op[P, R], made)


def _dispatch_names(
    signature: _Signature, dispatch_args: Sequence[str] | None, func: Callable[..., Any]
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
    signature: _Signature,
    reg: KernelRegistry,
    names: tuple[str, ...],
    strict: bool | None,
    autotune: bool | None = None,
) -> Any:
    state = _OpState(op_id, signature, reg, names, strict, autotune)
    wrapper = signature.build(
        op_id.split(".")[-1],
        f"    return {_PREFIX}box[0]({signature.forward})\n",
        {f"{_PREFIX}box": state.box},
    )
    functools.update_wrapper(wrapper, reference)
    _attach(wrapper, state, reference)
    reg.subscribe(state)
    with _all_states_lock:
        _all_states.add(state)
    return wrapper


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
            platform=_platform(platform),
            dtypes=dtypes,
            strict=state.strict,
            autotune=state.autotune,
        )

    def explain_call(*args: Any, **kwargs: Any) -> Decision:
        """The decision this exact call gets (its dtypes, device, ``when`` predicates and,
        under the autotune policy, what was measured for its shape bucket)."""
        values = [state._bind_value(name, args, kwargs) for name in state.dispatch_args]
        platform, dtypes, _ = state._call_inputs(values)
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
            platform=_platform(platform),
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
    wrapper._kernreg_state = state

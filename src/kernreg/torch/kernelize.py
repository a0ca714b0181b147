"""``kernelize(model)``: route every mapped layer of a model through its op, in one call.

>>> report = kernreg.torch.kernelize(model)        # doctest: +SKIP
>>> print(report)                                  # one row per mapped module  # doctest: +SKIP
>>> kernreg.torch.unkernelize(model)               # or report.undo()  # doctest: +SKIP

For each module whose exact class has a layer mapping (:mod:`kernreg.torch.layers`),
kernreg decides the op's implementation for the module's parameter dtype and device,
under the mode's required traits:

=============  ===========================================================
mode           only implementations with the trait
=============  ===========================================================
``inference``  (any)
``training``   ``backward`` (autograd differentiates them)
``compile``    ``compile_safe`` (traced by ``torch.compile(fullgraph=True)``)
=============  ===========================================================

and binds it to the module: its ``forward`` becomes ``output(module, impl(*args(module,
*inputs)))``, the implementation read from a per-site table keyed by the input's dtype
(a new dtype is decided on its first call; a registry change, or
:func:`kernreg.process_state_changed`, empties the tables). The device is the module's
when the dtype is decided: after moving a model to another device, call ``kernelize``
again. A module whose only eligible implementation is the op's reference
keeps its own forward (the model is never made slower by kernelizing it), and so does
one the decision fails for, unless ``strict=True``, which raises instead (the decision's
error, or :class:`kernreg.StrictFallbackError` for a reference-only layer). Parameters and buffers are untouched: state-dict keys never change, and
``save_pretrained``/``from_pretrained`` round-trips.

Function sites: a function mapping (:func:`kernreg.torch.register_function`, e.g. the
pack's ``<modeling module>:apply_rotary_pos_emb`` of transformers' Llama family) applies
to a model one of whose modules' classes is defined in the function's module. The module
global is process-wide, so routing it is too: ``kernelize`` swaps it for a dispatching
function while at least one kernelized model uses it (reference-counted per model; a
model that is undone or garbage-collected drops its reference) and the last undo puts
the original function object back (unless something else replaced the global since).
Every model of that modeling module runs through the dispatcher meanwhile, kernelized or
not; its implementations satisfy the traits of every live user's mode (their union), its
strictness is any user's, its pin the latest user's. The dispatcher decides per input
dtype and device type, and its report row is ``<module>:<function>``.

Pickling: ``torch.save(model)`` of a kernelized model works; the loaded model runs its
own forward (routing is process state, not model state): call ``kernelize`` on it again.

Pins per site: ``pin={"layernorm.rmsnorm@model.norm": "torch"}`` (or
``KERNREG_PIN=layernorm.rmsnorm@model.norm=torch``) pins the modules whose path matches
the glob after ``@`` (``fnmatch``), leaving other layers of that op alone; a key without
``@`` is a module-path glob for every op. A pinned site runs the pinned implementation,
even the reference; a pin that cannot run raises.
"""

from __future__ import annotations

import functools
import json
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from fnmatch import fnmatchcase
from typing import Any, Literal

import torch

from kernreg._frozen import Frozen
from kernreg._names import parse_label
from kernreg.dispatch import run_while_tracing
from kernreg.dtypes import dtype_name
from kernreg.errors import StrictFallbackError
from kernreg.registry import KernelRegistry, chosen_or_raise, default_registry
from kernreg.selection import Decision
from kernreg.torch.layers import LayerMapping, layer_mapping, layer_name
from kernreg.tracing import active_traces, on_trace_change, record_call, record_decision

__all__ = [
    "MODES",
    "KernelizeError",
    "KernelizeReport",
    "KernelizeRow",
    "kernelize",
    "unkernelize",
]

Mode = Literal["inference", "training", "compile", "torch.compile"]  # the last: "compile"
#: mode -> the traits every routed implementation must declare
MODES: dict[str, tuple[str, ...]] = {
    "inference": (),
    "training": ("backward",),
    "compile": ("compile_safe",),
}
#: the attribute a routed module carries: its site (the binding, for undo and reports)
SITE_ATTRIBUTE = "_kernreg_site"


class KernelizeError(ValueError):
    """``kernelize`` was called with an invalid argument (mode, pin)."""


class KernelizeRow(Frozen):
    """One mapped module: the op, the implementation chosen, the rule, and why."""

    __slots__ = ("path", "layer", "op", "implementation", "rule", "status", "reason")
    path: str
    layer: str
    op: str
    implementation: str | None
    rule: str
    status: str  # "routed", "kept" (own forward) or "skipped" (mapping does not apply)
    reason: str

    def __init__(
        self,
        path: str,
        layer: str,
        op: str,
        implementation: str | None,
        rule: str,
        status: str,
        reason: str,
    ) -> None:
        for name, value in zip(
            self.__slots__, (path, layer, op, implementation, rule, status, reason), strict=True
        ):
            self._set(name, value)

    def describe(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


class KernelizeReport:
    """What :func:`kernelize` did, one row per mapped module path (printable, JSON-ready)."""

    def __init__(self, model: Any, mode: str, rows: list[KernelizeRow]) -> None:
        self.model = model
        self.mode = mode
        self.rows = tuple(rows)

    @property
    def routed(self) -> tuple[str, ...]:
        """Paths of the modules now running through their op."""
        return tuple(r.path for r in self.rows if r.status == "routed")

    @property
    def kept(self) -> tuple[str, ...]:
        """Paths of mapped modules that keep their own forward."""
        return tuple(r.path for r in self.rows if r.status != "routed")

    def row(self, path: str) -> KernelizeRow:
        for r in self.rows:
            if r.path == path:
                return r
        raise KeyError(f"no mapped module at path {path!r}")

    def undo(self) -> int:
        """Restore every module's own forward (same as :func:`unkernelize`)."""
        return unkernelize(self.model)

    def to_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "modules": [r.describe() for r in self.rows]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __iter__(self) -> Iterator[KernelizeRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        header = ("module", "op", "implementation", "rule", "reason")
        table = [header] + [
            (r.path or "<root>", r.op, r.implementation or "-", r.rule, r.reason) for r in self.rows
        ]
        widths = [max(len(row[i]) for row in table) for i in range(4)]
        lines = [
            "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4]
            for row in table
        ]
        routed = len(self.routed)
        lines.append(f"{routed} of {len(self.rows)} mapped modules routed (mode {self.mode})")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<KernelizeReport mode={self.mode} routed={len(self.routed)}/{len(self.rows)}>"


class _Site:
    """The binding of one module path: a per-(dtype, device) table of implementations."""

    def __init__(
        self,
        path: str,
        mapping: LayerMapping,
        registry: KernelRegistry,
        traits: tuple[str, ...],
        strict: bool,
        pin: tuple[str, str | None] | None,
    ) -> None:
        self.path = path
        self.mapping = mapping
        self.registry = registry
        self.traits = traits
        self.strict = strict
        self.pin = pin
        #: input dtype -> implementation (the device is the module's, fixed at kernelize)
        self.table: dict[Any, Callable[..., Any]] = {}
        self.device: Any = None
        self.lock = threading.Lock()

    def __deepcopy__(self, memo: dict[int, Any]) -> _Site:
        # A copied model shares the binding of its sites (same paths, same decisions).
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # Routing is process state: a pickled model loads with its own forward.
        return (_detached, ())

    # Called by the registry (its lock held) on every mutation.
    def invalidate(self) -> None:
        self.table.clear()

    def decide(self, dtype: Any, device: Any) -> Decision:
        backend, variant = self.pin if self.pin is not None else (None, None)
        platform = self.registry.platform
        if device is not None:
            platform = platform.on_device(torch.device(device).type)
        return self.registry.explain(
            self.mapping.op,
            backend=backend,
            variant=variant,
            platform=platform,
            dtypes=None if dtype is None else (dtype_name(dtype),),
            traits=self.traits,
            strict=True if self.strict else None,
        )

    def bind(self, dtype: Any, device: Any, key: Any = None) -> Callable[..., Any]:
        """The implementation for inputs of ``dtype`` on ``device`` (raises the decision's
        error when there is none), stored in the table; while a trace is open, wrapped to
        record each call with this site."""
        decision = self.decide(dtype, device)
        chosen = chosen_or_raise(decision)
        impl = chosen.load()
        if active_traces():
            impl = self._traced(impl, chosen.label, decision.rule)
            if torch.compiler.is_compiling():
                record_decision(self.mapping.op, chosen.label, decision.rule, decision.dtypes or ())
        with self.lock:
            self.table[dtype if key is None else key] = impl
            self.device = device
        return impl

    def _traced(self, impl: Callable[..., Any], label: str, rule: str) -> Callable[..., Any]:
        op, path = self.mapping.op, self.path

        def traced(*args: Any) -> Any:
            if not torch.compiler.is_compiling():  # a compiled graph records its decision
                record_call(op, label, rule, args[:1], site=path)
            return impl(*args)

        return traced

    @run_while_tracing
    def miss_name(self, x: Any) -> str:
        """Decide for an input dtype missing from the table; returns the attribute of this
        site holding the implementation (torch.compile runs this for real, a constant)."""
        impl = self.bind(x.dtype, x.device)
        name = f"impl_{id(impl):x}"
        setattr(self, name, impl)
        return name


class _FunctionSite(_Site):
    """The binding of a routed module-level function: keyed by (dtype, device type)."""

    @run_while_tracing
    def miss_name(self, x: Any) -> str:
        impl = self.bind(x.dtype, x.device, (x.dtype, x.device.type))
        name = f"impl_{id(impl):x}"
        setattr(self, name, impl)
        return name


def _detached() -> None:
    """What an unpickled routed module holds in place of its site: nothing."""
    return None


#: Every live site, so opening or closing a trace rebinds them (with or without recording).
_sites: weakref.WeakSet[_Site] = weakref.WeakSet()


def _clear_all_sites() -> None:
    for site in list(_sites):
        site.invalidate()


on_trace_change(_clear_all_sites)


def _routed_forward(
    site: _Site,
    args_fn: Callable[..., Any],
    output_fn: Callable[..., Any] | None,
) -> Callable[..., Any]:
    """The forward bound to a routed module (a function of ``self``, made a method).

    When ``args_fn`` takes plain positional parameters after the module, the forward is
    generated with exactly those parameters (no ``*args``/``**kwargs`` forwarding: about
    100 ns less per call); otherwise it forwards whatever it is called with.
    """
    params = _plain_parameters(args_fn)
    inputs = "*inputs, **kwargs" if params is None else ", ".join(params)
    signature = f"self, {inputs}" if inputs else "self"
    call = "impl(*op_args)"
    result = call if output_fn is None else f"output_fn(self, {call}, {inputs})"
    source = (
        f"def forward({signature}):\n"
        f"    op_args = args_fn(self, {inputs})\n"
        "    try:\n"
        "        impl = table[op_args[0].dtype]\n"
        "    except KeyError:\n"
        "        impl = getattr(site, site.miss_name(op_args[0]))\n"
        f"    return {result}\n"
    )
    namespace: dict[str, Any] = {
        "args_fn": args_fn,
        "output_fn": output_fn,
        "table": site.table,
        "site": site,
    }
    exec(compile(source, f"<kernreg routed forward of {site.mapping.layer}>", "exec"), namespace)
    forward: Callable[..., Any] = namespace["forward"]
    return forward


def _dispatching_function(
    site: _FunctionSite,
    original: Callable[..., Any],
    args_fn: Callable[..., Any] | None,
    output_fn: Callable[..., Any] | None,
) -> Callable[..., Any]:
    """The function put in place of ``original``: decides per (dtype, device type) of the
    op's first argument, then runs the chosen implementation."""
    table = site.table
    if args_fn is None and output_fn is None:

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            x = args[0]
            try:
                impl = table[(x.dtype, x.device.type)]
            except KeyError:
                impl = getattr(site, site.miss_name(x))
            return impl(*args, **kwargs)

    else:

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            op_args = args if args_fn is None else args_fn(*args, **kwargs)
            op_kwargs = kwargs if args_fn is None else {}
            x = op_args[0]
            try:
                impl = table[(x.dtype, x.device.type)]
            except KeyError:
                impl = getattr(site, site.miss_name(x))
            result = impl(*op_args, **op_kwargs)
            return result if output_fn is None else output_fn(result, *args, **kwargs)

    functools.update_wrapper(dispatch, original)
    dispatch.__kernreg_original__ = original  # type: ignore[attr-defined]
    return dispatch


class _User(Frozen):
    """One kernelized model using a routed function: its mode's traits, strictness, pin."""

    __slots__ = ("ref", "traits", "strict", "pin")
    ref: Any
    traits: tuple[str, ...]
    strict: bool
    pin: tuple[str, str | None] | None

    def __init__(self, ref: Any, traits: tuple[str, ...], strict: bool, pin: Any) -> None:
        self._set("ref", ref)
        self._set("traits", traits)
        self._set("strict", strict)
        self._set("pin", pin)


class _FunctionRoute:
    """A module global swapped for a dispatcher while kernelized models use it."""

    def __init__(
        self, module: types.ModuleType, name: str, original: Callable[..., Any], site: _FunctionSite
    ) -> None:
        self.module = module
        self.name = name
        self.original = original
        self.site = site
        self.dispatcher: Callable[..., Any] | None = None
        #: id(model) -> user, in kernelize order
        self.users: dict[int, _User] = {}

    def configure(self) -> None:
        """Give the site the union of the users' traits, any strictness, the last pin."""
        users = list(self.users.values())
        traits = tuple(sorted({t for u in users for t in u.traits}))
        strict = any(u.strict for u in users)
        pins = [u.pin for u in users if u.pin is not None]
        pin = pins[-1] if pins else None
        site = self.site
        if (site.traits, site.strict, site.pin) != (traits, strict, pin):
            site.traits, site.strict, site.pin = traits, strict, pin
            site.invalidate()


_routes_lock = threading.RLock()
#: "module:function" -> its route, while installed
_routes: dict[str, _FunctionRoute] = {}


def _drop_user(key: str, model_id: int) -> bool:
    """Remove a model from a route's users; restore the original when none is left."""
    with _routes_lock:
        route = _routes.get(key)
        if route is None or route.users.pop(model_id, None) is None:
            return False
        if route.users:
            route.configure()
            return True
        del _routes[key]
        if getattr(route.module, route.name, None) is route.dispatcher:
            setattr(route.module, route.name, route.original)
        return True


def _model_modules(model: Any) -> set[str]:
    return {type(m).__module__ for m in model.modules()}


def _route_functions(
    model: Any,
    reg: KernelRegistry,
    traits: tuple[str, ...],
    strict: bool,
    pins: list[tuple[str, str, str, str | None]],
    mode: str,
) -> list[KernelizeRow]:
    """Route the function mappings whose module defines a class of ``model``."""
    import sys

    from kernreg.torch.layers import layer_mappings

    rows: list[KernelizeRow] = []
    used = _model_modules(model)
    dtype, device = _param_dtype_device(model)
    for mapping in layer_mappings():
        if mapping.kind != "function":
            continue
        module_name, _, attr = mapping.layer.partition(":")
        module = sys.modules.get(module_name)
        if module_name not in used or module is None or "." in attr:
            continue
        key = mapping.layer
        if mapping.op not in reg:
            reason = f"op '{mapping.op}' has no implementation in this registry"
            rows.append(KernelizeRow(key, key, mapping.op, None, "-", "skipped", reason))
            continue
        args_fn, output_fn, _ = mapping.load()
        site_pin = _pin_for(pins, mapping.op, key)
        with _routes_lock:
            route = _routes.get(key)
            if route is None:
                original = getattr(module, attr, None)
                if original is None or not callable(original):
                    rows.append(
                        KernelizeRow(key, key, mapping.op, None, "-", "skipped", "no such function")
                    )
                    continue
                site = _FunctionSite(key, mapping, reg, traits, strict, site_pin)
                route = _FunctionRoute(module, attr, original, site)
            else:
                site = route.site
            user = _User(weakref.ref(model, _forget(key, id(model))), traits, strict, site_pin)
            users_before = dict(route.users)
            route.users[id(model)] = user
            route.configure()
            decision = site.decide(dtype, device)
            chosen = decision.chosen
            kept_reason = ""
            if not decision.ok or chosen is None:
                if strict or site_pin is not None:
                    route.users = users_before
                    route.configure()
                    chosen_or_raise(decision)
                kept_reason = f"own function kept: {_failure(decision)}"
            elif decision.rule == "reference" and site.pin is None:
                if strict:
                    route.users = users_before
                    route.configure()
                    raise StrictFallbackError(
                        decision,
                        f"Strict mode: function '{key}' would stay as it is: only the "
                        f"reference of op '{mapping.op}' is eligible (mode {mode!r})",
                    )
                kept_reason = "only the reference is eligible: own function kept"
            if kept_reason:
                route.users = users_before
                if route.users:
                    route.configure()
                rows.append(
                    KernelizeRow(
                        key,
                        key,
                        mapping.op,
                        None if chosen is None else chosen.label,
                        decision.rule,
                        "kept",
                        kept_reason,
                    )
                )
                continue
            assert chosen is not None
            if dtype is not None and device is not None:
                site.bind(dtype, device, (dtype, torch.device(device).type))
            if key not in _routes:
                reg.subscribe(site)
                _sites.add(site)
                route.dispatcher = _dispatching_function(site, route.original, args_fn, output_fn)
                _routes[key] = route
                setattr(module, attr, route.dispatcher)
        reason = (
            f"pinned at this site to {chosen.label}"
            if site_pin is not None
            else _chosen_reason(decision)
        )
        rows.append(
            KernelizeRow(key, key, mapping.op, chosen.label, decision.rule, "routed", reason)
        )
    return rows


def _forget(key: str, model_id: int) -> Callable[[Any], None]:
    def callback(_: Any) -> None:
        _drop_user(key, model_id)

    return callback


def _unroute_functions(model: Any) -> int:
    with _routes_lock:
        keys = [k for k, r in _routes.items() if (u := r.users.get(id(model))) and u.ref() is model]
    return sum(_drop_user(k, id(model)) for k in keys)


def _plain_parameters(func: Callable[..., Any]) -> list[str] | None:
    """The names of ``func``'s parameters after the first, if all are plain positional
    ones without defaults; else ``None``."""
    import inspect

    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    if not parameters:
        return None
    plain = inspect.Parameter.POSITIONAL_OR_KEYWORD
    rest = parameters[1:]
    if any(p.kind is not plain or p.default is not p.empty for p in rest):
        return None
    names = [p.name for p in rest]
    if any(not n.isidentifier() or n in _RESERVED for n in names):
        return None
    return names


_RESERVED = frozenset({"self", "op_args", "impl", "table", "site", "args_fn", "output_fn"})


def _parse_pins(pin: Mapping[str, str] | None) -> list[tuple[str, str, str, str | None]]:
    """``(op glob, site glob, backend, variant)`` from code pins, then configuration."""
    result: list[tuple[str, str, str, str | None]] = []
    for key, target in (pin or {}).items():
        if not isinstance(key, str) or not isinstance(target, str):
            raise KernelizeError(
                f"pin {key!r}: {target!r}: expected 'op_glob@module_glob' (or 'module_glob') "
                "mapped to 'backend[/variant]'"
            )
        op_glob, sep, site_glob = key.rpartition("@")
        if not sep:
            op_glob, site_glob = "*", key
        try:
            backend, variant = parse_label(target.strip(), "pin")
        except ValueError as exc:
            raise KernelizeError(f"pin {key!r}: {exc}") from None
        result.append((op_glob.strip() or "*", site_glob.strip(), backend, variant))
    return result


def _config_site_pins(registry: KernelRegistry) -> list[tuple[str, str, str, str | None]]:
    return [
        (p.pattern, p.site, p.backend, p.variant)
        for p in getattr(registry.config, "pins", ())
        if getattr(p, "site", None)
    ]


def _pin_for(
    pins: list[tuple[str, str, str, str | None]], op: str, path: str
) -> tuple[str, str | None] | None:
    for op_glob, site_glob, backend, variant in pins:
        if fnmatchcase(op, op_glob) and fnmatchcase(path, site_glob):
            return backend, variant
    return None


def _param_dtype_device(module: Any) -> tuple[Any, Any]:
    for tensor in module.parameters():
        return tensor.dtype, tensor.device
    for tensor in module.buffers():
        return tensor.dtype, tensor.device
    return None, None


def _failure(decision: Decision) -> str:
    try:
        chosen_or_raise(decision)
    except Exception as exc:
        return str(exc).splitlines()[0]
    return ""


def kernelize(
    model: Any,
    *,
    mode: Mode = "inference",
    strict: bool = False,
    pin: Mapping[str, str] | None = None,
    registry: KernelRegistry | None = None,
) -> KernelizeReport:
    """Route every mapped layer of ``model`` through its op; return the report.

    Calling it again re-decides every site (first restoring the modules' own forward).
    """
    if mode == "torch.compile":  # the name users know the mode by
        mode = "compile"
    if mode not in MODES:
        raise KernelizeError(f"mode {mode!r} is not one of {', '.join(repr(m) for m in MODES)}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"kernelize takes a torch.nn.Module, not {type(model).__name__}")
    reg = registry if registry is not None else default_registry()
    traits = MODES[mode]
    pins = _parse_pins(pin) + _config_site_pins(reg)
    unkernelize(model)
    rows: list[KernelizeRow] = []
    for path, module in model.named_modules():
        mapping = layer_mapping(layer_name(type(module)))
        if mapping is None or mapping.kind != "layer":
            continue
        if mapping.op not in reg:
            reason = f"op '{mapping.op}' has no implementation in this registry"
            rows.append(KernelizeRow(path, mapping.layer, mapping.op, None, "-", "skipped", reason))
            continue
        args_fn, output_fn, applies = mapping.load()
        assert args_fn is not None
        why_not = applies(module) if applies is not None else None
        if why_not:
            rows.append(
                KernelizeRow(path, mapping.layer, mapping.op, None, "-", "skipped", str(why_not))
            )
            continue
        site_pin = _pin_for(pins, mapping.op, path)
        site = _Site(path, mapping, reg, traits, strict, site_pin)
        dtype, device = _param_dtype_device(module)
        decision = site.decide(dtype, device)
        chosen = decision.chosen
        if not decision.ok or chosen is None:
            if strict or site_pin is not None:
                chosen_or_raise(decision)
            rows.append(
                KernelizeRow(
                    path,
                    mapping.layer,
                    mapping.op,
                    None,
                    decision.rule,
                    "kept",
                    f"own forward kept: {_failure(decision)}",
                )
            )
            continue
        if decision.rule == "reference" and site_pin is None:
            if strict:
                raise StrictFallbackError(
                    decision,
                    f"Strict mode: layer '{path}' ({mapping.layer}) would keep its own "
                    f"forward: only the reference of op '{mapping.op}' is eligible "
                    f"(mode {mode!r})",
                )
            rows.append(
                KernelizeRow(
                    path,
                    mapping.layer,
                    mapping.op,
                    chosen.label,
                    decision.rule,
                    "kept",
                    "only the reference is eligible: own forward kept",
                )
            )
            continue
        site.bind(dtype, device)
        reg.subscribe(site)
        _sites.add(site)
        forward = _routed_forward(site, args_fn, output_fn)
        previous = module.__dict__.get("forward")
        module.__dict__[SITE_ATTRIBUTE] = (site, previous)
        module.__dict__["forward"] = types.MethodType(forward, module)
        reason = (
            f"pinned at this site to {chosen.label}"
            if site_pin is not None
            else _chosen_reason(decision)
        )
        rows.append(
            KernelizeRow(
                path, mapping.layer, mapping.op, chosen.label, decision.rule, "routed", reason
            )
        )
    rows.extend(_route_functions(model, reg, traits, strict, pins, mode))
    return KernelizeReport(model, mode, rows)


def _chosen_reason(decision: Decision) -> str:
    for cand in decision.candidates:
        if cand.spec == decision.chosen:
            return "; ".join(cand.reasons) or "eligible"
    return "eligible"


def unkernelize(model: Any) -> int:
    """Give every routed module of ``model`` its own forward back, and drop its use of
    routed functions (the last user restores the original); returns how many."""
    restored = _unroute_functions(model)
    for module in model.modules():
        state = module.__dict__.pop(SITE_ATTRIBUTE, None)
        if state is None:
            continue
        _, previous = state
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = previous
        restored += 1
    return restored

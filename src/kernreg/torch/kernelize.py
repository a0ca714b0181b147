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

Pins per site: ``pin={"layernorm.rmsnorm@model.norm": "torch"}`` (or
``KERNREG_PIN=layernorm.rmsnorm@model.norm=torch``) pins the modules whose path matches
the glob after ``@`` (``fnmatch``), leaving other layers of that op alone; a key without
``@`` is a module-path glob for every op. A pinned site runs the pinned implementation,
even the reference; a pin that cannot run raises.
"""

from __future__ import annotations

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
from kernreg.tracing import active_traces, on_trace_change, record_call

__all__ = [
    "MODES",
    "KernelizeError",
    "KernelizeReport",
    "KernelizeRow",
    "kernelize",
    "unkernelize",
]

Mode = Literal["inference", "training", "compile"]
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

    def bind(self, dtype: Any, device: Any) -> Callable[..., Any]:
        """The implementation for inputs of ``dtype`` on ``device`` (raises the decision's
        error when there is none), stored in the table; while a trace is open, wrapped to
        record each call with this site."""
        decision = self.decide(dtype, device)
        impl = chosen_or_raise(decision).load()
        if active_traces():
            impl = self._traced(impl, chosen_or_raise(decision).label, decision.rule)
        with self.lock:
            self.table[dtype] = impl
            self.device = device
        return impl

    def _traced(self, impl: Callable[..., Any], label: str, rule: str) -> Callable[..., Any]:
        op, path = self.mapping.op, self.path

        def traced(*args: Any) -> Any:
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
        if mapping is None:
            continue
        args_fn, output_fn, applies = mapping.load()
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
    return KernelizeReport(model, mode, rows)


def _chosen_reason(decision: Decision) -> str:
    for cand in decision.candidates:
        if cand.spec == decision.chosen:
            return "; ".join(cand.reasons) or "eligible"
    return "eligible"


def unkernelize(model: Any) -> int:
    """Give every routed module of ``model`` its own forward back; returns how many."""
    restored = 0
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

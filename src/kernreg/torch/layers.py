"""Layer mappings: which op a model's module class runs, and with which arguments.

A mapping names a module class lazily, as ``"module:Class"``, so registering one never
imports the model library::

    kernreg.torch.register_layer(
        "transformers.models.llama.modeling_llama:LlamaRMSNorm",
        op="layernorm.rmsnorm",
        args="my_pkg.layers:rmsnorm_args",   # (module, *forward args) -> op arguments
    )

``args`` takes the module and the arguments its ``forward`` was called with and returns
the op's positional arguments as a tuple. ``output`` (optional) takes the module, the
op's result and the forward arguments and returns what ``forward`` returns (a gated MLP
applies its down projection there); by default the op's result is returned as is.
``applies`` (optional) takes the module and returns ``None`` when the mapping fits it, or
a reason why not (an MLP whose activation is not SiLU); :func:`kernelize` then leaves
that module alone and reports the reason. Each of the three is a callable or a
``"module:attr"`` target string.

A *function mapping* (:func:`register_function`) routes a module-level function the same
way: transformers' attention calls ``apply_rotary_pos_emb(q, k, cos, sin)`` of its modeling
module, not a layer, so ``kernelize`` swaps that module's global for a dispatching
function while a kernelized model uses it (see :mod:`kernreg.torch.kernelize`). Its
``args`` (optional: the call's arguments are passed through) takes the call's arguments
and returns the op's; its ``output`` takes the op's result and the call's arguments.

``probe`` (optional) builds the inputs :func:`kernelize` verifies a swap on:
``probe(module, seq_len, dtype, device) -> (args, kwargs)`` for a layer (default: one
hidden-states tensor ``[2, seq_len, hidden]``, ``hidden`` read from the module's weight or
first linear layer), ``probe(model, function, seq_len, dtype, device)`` for a function
(``function`` is the original, to try a call shape on; no default:
a function mapping without a probe cannot be verified, and is only routed with
``verify=False``).

Mappings are metadata like kernel specs: registered in code (:func:`register_layer`, or
the :func:`layer` class decorator, or :func:`register_function`) or by plugins from their
``kernreg.kernels`` entry point; ``kernreg list --layers`` lists them. A mapping is keyed
by its class (or function) name and its op: registering an equal mapping again is a no-op;
a different one for the same class and op raises :class:`LayerConflictError` naming both
origins. A class may have mappings to several ops (an RMSNorm to ``layernorm.rmsnorm`` and
to ``layernorm.rmsnorm_offset``): ``kernelize`` tries them in op order and routes the
first that applies and passes verification.

The exact class matches its mappings (a subclass may change ``forward``). A name with
glob characters (``"transformers.models.*:*RMSNorm"``) is a *pattern mapping*: it serves
classes (or functions) that no exact mapping names, so a model family added to a library
tomorrow is routed when its layers look alike; verification rejects the ones that only
look alike. This module imports no torch.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Any, TypeVar

from kernreg._frozen import Frozen
from kernreg._names import check_op_id
from kernreg.errors import InvalidSpecError, KernregError
from kernreg.plugins import record_undo
from kernreg.registry import caller_origin, default_registry
from kernreg.spec import Origin, resolve_target, target_name

__all__ = [
    "LayerConflictError",
    "LayerMapping",
    "LayerMappingLoadError",
    "exact_mappings_in",
    "layer",
    "layer_mapping",
    "layer_mappings",
    "layer_name",
    "mappings_for",
    "register_function",
    "register_layer",
    "unregister_function",
    "unregister_layer",
]

C = TypeVar("C", bound=type)
Hook = str | Callable[..., Any]


def layer_name(cls: Any) -> str:
    """The ``"module:Class"`` name of a class, or ``"module:function"`` of a function
    (how mappings are keyed)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _check_hook(field: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, str):
        module, sep, attr = value.partition(":")
        if sep and module and attr:
            return
    elif callable(value):
        return
    raise InvalidSpecError(field, value, "expected 'module:attr' or a callable")


class LayerMapping(Frozen):
    """A module class (``"module:Class"``) routed through an op, with its argument map."""

    __slots__ = (
        "layer",
        "op",
        "args",
        "output",
        "applies",
        "probe",
        "description",
        "kind",
        "origin",
    )
    _hidden = ("origin",)
    layer: str
    op: str
    args: Hook | None
    output: Hook | None
    applies: Hook | None
    probe: Hook | None
    description: str
    kind: str  # "layer" (a module class) or "function" (a module-level function)
    origin: Origin | None

    def __init__(
        self,
        layer: str | type,
        *,
        op: str,
        args: Hook | None,
        output: Hook | None = None,
        applies: Hook | None = None,
        probe: Hook | None = None,
        description: str = "",
        kind: str = "layer",
        origin: Origin | None = None,
    ) -> None:
        if kind not in ("layer", "function"):
            raise InvalidSpecError("kind", kind, "expected 'layer' or 'function'")
        name = layer if isinstance(layer, str) else layer_name(layer)
        module, sep, cls = name.partition(":")
        if not (isinstance(name, str) and sep and module and cls):
            raise InvalidSpecError(kind, layer, f"expected 'module:{_WHAT[kind]}' or a {kind}")
        check_op_id(op)
        _check_hook("args", args, optional=kind == "function")
        _check_hook("output", output, optional=True)
        _check_hook("applies", applies, optional=True)
        _check_hook("probe", probe, optional=True)
        self._set("layer", name)
        self._set("op", op)
        self._set("args", args)
        self._set("output", output)
        self._set("applies", applies)
        self._set("probe", probe)
        self._set("description", str(description))
        self._set("kind", kind)
        self._set("origin", origin)

    @property
    def key(self) -> tuple[str, str]:
        """``(layer, op)``: what a mapping is registered under."""
        return (self.layer, self.op)

    @property
    def is_pattern(self) -> bool:
        """Whether :attr:`layer` is a glob serving classes no exact mapping names."""
        return any(c in self.layer for c in "*?[")

    def load(
        self,
    ) -> tuple[Callable[..., Any] | None, Callable[..., Any] | None, Callable[..., Any] | None]:
        """``(args, output, applies)`` as callables (target strings imported now)."""
        args, output, applies, _ = self.load_all()
        return args, output, applies

    def load_all(
        self,
    ) -> tuple[
        Callable[..., Any] | None,
        Callable[..., Any] | None,
        Callable[..., Any] | None,
        Callable[..., Any] | None,
    ]:
        """``(args, output, applies, probe)`` as callables (target strings imported now)."""
        loaded: list[Callable[..., Any] | None] = []
        for hook in (self.args, self.output, self.applies, self.probe):
            if hook is None or not isinstance(hook, str):
                loaded.append(hook)
                continue
            try:
                loaded.append(resolve_target(hook))
            except Exception as exc:
                raise LayerMappingLoadError(self, hook, exc) from exc
        args, output, applies, probe = loaded
        return args, output, applies, probe

    def describe(self) -> dict[str, object]:
        """The mapping as JSON-ready data."""
        return {
            "layer": self.layer,
            "kind": self.kind,
            "op": self.op,
            "args": None if self.args is None else target_name(self.args),
            "output": None if self.output is None else target_name(self.output),
            "applies": None if self.applies is None else target_name(self.applies),
            "probe": None if self.probe is None else target_name(self.probe),
            "description": self.description,
            "origin": None if self.origin is None else str(self.origin),
        }


class LayerConflictError(KernregError, ValueError):
    """A different mapping for a module class that already has one."""

    def __init__(self, old: LayerMapping, new: LayerMapping) -> None:
        self.old = old
        self.new = new
        super().__init__(
            f"Conflicting {new.kind} mapping for '{new.layer}' (op '{new.op}'): "
            f"{_summary(old, new)} != {_summary(new, old)}; registered at {old.origin} "
            f"and at {new.origin}. To override deliberately, pass replace=True "
            "(or unregister_layer() first)."
        )


def _summary(mapping: LayerMapping, other: LayerMapping) -> str:
    args = "passed through" if mapping.args is None else f"'{target_name(mapping.args)}'"
    kind = f" ({mapping.kind})" if mapping.kind != other.kind else ""
    return f"op '{mapping.op}' with args {args}{kind}"


_WHAT = {"layer": "Class", "function": "function"}


class LayerMappingLoadError(KernregError, ImportError):
    """A hook of a layer mapping could not be imported."""

    def __init__(self, mapping: LayerMapping, hook: str, cause: BaseException) -> None:
        self.mapping = mapping
        self.cause = cause
        super().__init__(
            f"Cannot load the layer mapping of '{mapping.layer}' (op '{mapping.op}'): "
            f"target {hook!r} failed with {type(cause).__name__}: {cause}"
        )


_lock = threading.Lock()
#: (layer, op) -> mapping
_table: dict[tuple[str, str], LayerMapping] = {}
#: Bumped on every change, so kernelize can tell a stale binding.
generation = 0


def _reset_lock_in_child() -> None:
    # A child forked while another thread held the lock would wait for it forever.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_lock_in_child)


def _put(mapping: LayerMapping, replace: bool) -> LayerMapping:
    """Store ``mapping`` (a plugin load that fails later takes it back out)."""
    global generation
    if replace:  # what it replaces on purpose may be a plugin's, not loaded yet
        _load_plugins()
    with _lock:
        old = _table.get(mapping.key)
        if old is not None and not replace:
            if old == mapping:
                return old
            raise LayerConflictError(old, mapping)
        _table[mapping.key] = mapping
        generation += 1
    record_undo(functools.partial(_restore, mapping, old))
    return mapping


def _restore(mapping: LayerMapping, old: LayerMapping | None) -> None:
    """Undo :func:`_put` of ``mapping`` (unless something replaced it since)."""
    global generation
    with _lock:
        if _table.get(mapping.key) is not mapping:
            return
        if old is None:
            del _table[mapping.key]
        else:
            _table[mapping.key] = old
        generation += 1


def register_layer(
    layer: str | type,
    *,
    op: str,
    args: Hook,
    output: Hook | None = None,
    applies: Hook | None = None,
    probe: Hook | None = None,
    description: str = "",
    replace: bool = False,
) -> LayerMapping:
    """Map the module class ``layer`` to ``op``; see the module docstring for the hooks."""
    mapping = LayerMapping(
        layer,
        op=op,
        args=args,
        output=output,
        applies=applies,
        probe=probe,
        description=description,
        origin=caller_origin(),
    )
    return _put(mapping, replace)


def register_function(
    function: str | Callable[..., Any],
    *,
    op: str,
    args: Hook | None = None,
    output: Hook | None = None,
    probe: Hook | None = None,
    description: str = "",
    replace: bool = False,
) -> LayerMapping:
    """Map the module-level function ``function`` (``"module:function"``) to ``op``.

    ``args(*call_args, **call_kwargs)`` returns the op's arguments (default: the call's
    own, passed through); ``output(result, *call_args, **call_kwargs)`` returns what the
    function returns (default: the op's result); ``probe(model, function, seq_len, dtype,
    device)`` returns ``(args, kwargs)`` of a call to verify the swap on.
    """
    name = function if isinstance(function, str) else layer_name(function)
    mapping = LayerMapping(
        name,
        op=op,
        args=args,
        output=output,
        probe=probe,
        description=description,
        kind="function",
        origin=caller_origin(),
    )
    return _put(mapping, replace)


def unregister_function(
    function: str | Callable[..., Any], op: str | None = None
) -> LayerMapping | None:
    """Forget the mapping(s) of ``function`` (to ``op``, or all); returns one of them."""
    name = function if isinstance(function, str) else layer_name(function)
    return unregister_layer(name, op)


def layer(
    op: str,
    *,
    args: Hook,
    output: Hook | None = None,
    applies: Hook | None = None,
    probe: Hook | None = None,
    description: str = "",
) -> Callable[[C], C]:
    """Class decorator form of :func:`register_layer` for a module class one owns."""

    def decorate(cls: C) -> C:
        register_layer(
            cls,
            op=op,
            args=args,
            output=output,
            applies=applies,
            probe=probe,
            description=description,
        )
        return cls

    return decorate


def layer_mapping(layer: str | type, op: str | None = None) -> LayerMapping | None:
    """The mapping registered for ``layer`` (a class or its ``"module:Class"`` name) and
    ``op``; without ``op``, the first of its mappings in op order."""
    _load_plugins()
    name = layer if isinstance(layer, str) else layer_name(layer)
    with _lock:
        if op is not None:
            return _table.get((name, op))
        found = sorted(key for key in _table if key[0] == name)
        return _table[found[0]] if found else None


def layer_mappings() -> tuple[LayerMapping, ...]:
    """Every registered mapping, sorted by class name then op (plugins loaded first)."""
    _load_plugins()
    with _lock:
        return tuple(_table[key] for key in sorted(_table))


def mappings_for(name: str, kind: str) -> tuple[LayerMapping, ...]:
    """The mappings of kind ``kind`` that serve ``name`` (``"module:Class"``), in the order
    ``kernelize`` tries them: the exact ones if there are any, else the pattern mappings
    whose glob matches, each group sorted by op."""
    _load_plugins()
    with _lock:
        found = _lookups().get((name, kind))
        if found is None:
            found = _lookups()[(name, kind)] = _match(name, kind)
        return found


def exact_mappings_in(module: str) -> tuple[LayerMapping, ...]:
    """The exact (not pattern) mappings naming a class or function of ``module``."""
    _load_plugins()
    with _lock:
        found = _lookups().get((module, ""))
        if found is None:
            found = _lookups()[(module, "")] = tuple(
                m
                for key, m in sorted(_table.items())
                if not m.is_pattern and m.layer.partition(":")[0] == module
            )
        return found


def _match(name: str, kind: str) -> tuple[LayerMapping, ...]:
    exact = sorted(
        (m for (layer_, _), m in _table.items() if layer_ == name and m.kind == kind),
        key=lambda m: m.op,
    )
    if exact:
        return tuple(exact)
    return tuple(
        sorted(
            (
                m
                for m in _table.values()
                if m.kind == kind and m.is_pattern and fnmatchcase(name, m.layer)
            ),
            key=lambda m: (m.op, m.layer),
        )
    )


#: (name, kind) -> what mappings_for found, for the table of generation _looked_up[0]
#: (kernelize asks for every module class of a model: a 4-layer Llama's 13 sites cost
#: 0.6 ms of table scans without it)
_found: dict[tuple[str, str], tuple[LayerMapping, ...]] = {}
_looked_up = [-1]


def _lookups() -> dict[tuple[str, str], tuple[LayerMapping, ...]]:
    """The lookup cache of the current table (emptied when the table changed); lock held."""
    if _looked_up[0] != generation:
        _found.clear()
        _looked_up[0] = generation
    return _found


def unregister_layer(layer: str | type, op: str | None = None) -> LayerMapping | None:
    """Forget the mapping(s) of ``layer`` (to ``op``, or all); returns one of them."""
    global generation
    name = layer if isinstance(layer, str) else layer_name(layer)
    _load_plugins()  # what it removes may be a plugin's, not loaded yet
    with _lock:
        generation += 1
        keys = sorted(key for key in _table if key[0] == name and (op is None or key[1] == op))
        removed = [_table.pop(key) for key in keys]
        return removed[0] if removed else None


def _load_plugins() -> None:
    """Plugins register their mappings from their entry points, with their kernels."""
    default_registry().ensure_plugins()

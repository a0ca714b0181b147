"""Turning decisions into calls: :func:`get_kernel`, :func:`select_kernel` and op objects.

An op object is a function generated with its reference's exact signature, so calling
it costs one extra Python frame and no ``*args`` packing (the budgets are in
docs/design.md). Its body calls ``box[0]`` (or, while a use_backend block is open anywhere,
``box[1]``, the scoped route): the chosen implementation itself for a static decision, or a generated per-call gate that
looks the decision up by the dispatch arguments' ``dtype`` and the first one's ``device``
in a table built for one registry generation and never reshaped. While ``box[0]`` holds such a gate, the op
object itself takes the code of an inline form that does the same lookup in its own frame
(see :meth:`_OpState._route`). Any registry mutation resets ``box[0]`` to a resolver,
which builds a new table. While a :func:`~kernreg.use_backend` block is open
anywhere, a call first asks whether a pin applies in its own context; other contexts keep
their decisions.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import keyword
import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, cast

from kernreg._fork import Lock
from kernreg._names import check_name, check_op_id, check_variant
from kernreg.autotune import shape_bucket
from kernreg.config import Pin
from kernreg.dtypes import dtype_name
from kernreg.errors import InvalidSpecError
from kernreg.measurement import measurer
from kernreg.pins import live_pins, on_pin_liveness, open_blocks, pins_for
from kernreg.platform import Platform, PlatformLike, Requirement
from kernreg.registry import KernelRegistry, chosen_or_raise, default_registry
from kernreg.selection import Decision
from kernreg.spec import KernelSpec, Target, target_name
from kernreg.tracing import active_traces, on_trace_change, record_call, record_decision

__all__ = ["Op", "dispatcher", "op"]

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])


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
#: How many (pin, call attributes) decisions an op object keeps for pinned calls.
_PINNED_ENTRIES = 256
_all_states: weakref.WeakSet[_OpState] = weakref.WeakSet()
# Reentrant: a block's end is noticed by a finaliser, which may run inside any code.
_all_states_lock = Lock()


def invalidate_all_ops() -> None:
    """Make every op object resolve again on its next call (tracing opened or closed)."""
    with _all_states_lock:
        states = list(_all_states)
    for state in states:
        state.invalidate()


on_trace_change(invalidate_all_ops)


def _pin_liveness(pin: Pin) -> None:
    """A use_backend pin became live, or no context holds it any more: the op objects it
    matches take the scoped route while any live pin matches them."""
    with _all_states_lock:
        states = [state for state in _all_states if pin.matches(state.op_id)]
    for state in states:
        state.follow_live_pins()


on_pin_liveness(_pin_liveness)


def run_while_tracing(func: F) -> F:
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
    what the trace has read: its guards are built from those objects afterwards).

    Another thread may be importing torch right now: a module only partly initialised
    (no ``torch.compiler`` yet, or one without its flag or ``is_compiling``) is not tracing.
    """
    compiler = sys.modules.get("torch.compiler")
    if compiler is None:
        return False
    # The flag is_compiling() returns outside TorchScript; reading it costs ~40 ns, the
    # call ~230 ns, and op objects ask on every call while a use_backend block is open.
    flag = getattr(compiler, "_is_compiling_flag", None)
    if isinstance(flag, bool):
        return flag
    is_compiling = getattr(compiler, "is_compiling", None)
    if is_compiling is None:
        return False
    try:
        return bool(is_compiling())
    except Exception:  # torch half imported: nothing can be compiling yet
        return False


_passing_classes: dict[type[BaseException], type[BaseException]] = {}


def _through_the_compiler(error: Exception) -> Exception:
    """``error`` as torch.compile passes it on unchanged: an instance of a subclass of its
    own class that dynamo also counts as a user error (any other exception raised while it
    traces comes out as ``InternalTorchDynamoError``). ``isinstance``, the message and the
    attributes (``decision``...) stay those of ``error``."""
    passing = getattr(sys.modules.get("torch._dynamo.exc"), "UserError", None)
    if not isinstance(passing, type) or isinstance(error, passing):
        return error
    cls = type(error)
    sub = _passing_classes.get(cls)
    if sub is None:
        try:
            sub = type(cls.__name__, (cls, passing), {"__module__": cls.__module__})
        except TypeError:  # an incompatible layout: keep the original
            return error
        sub.__qualname__ = cls.__qualname__
        sub.__init__ = BaseException.__init__  # type: ignore[method-assign]
        _passing_classes[cls] = sub
    clone = sub(*error.args)
    clone.__dict__.update(error.__dict__)
    clone.__dict__.setdefault("real_stack", None)
    clone.__dict__.setdefault("skip_frame", False)
    return cast(Exception, clone)


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


#: Where each attribute sits in a pair of :func:`_call_attrs`.
_PAIR_FIELDS = {"dtype": 0, "device": 1}


class _Signature:
    """The reference's parameters as source text: how to declare them and how to forward them."""

    def __init__(self, func: Callable[..., Any]) -> None:
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

    def compile(self, name: str, body: str) -> Any:
        """The code of ``def name(<params>): <body>`` (``name`` made a valid identifier)."""
        name = _identifier(name)
        return compile(f"def {name}({self.params}):\n{body}", f"<kernreg {name}>", "exec"), name

    def instantiate(self, code: Any, namespace: dict[str, Any]) -> Callable[..., Any]:
        """A new function from :meth:`compile`'s ``code`` with the defaults and
        ``namespace`` in scope (builtins it uses are passed in ``namespace`` under the
        reserved prefix, so no parameter name can shadow them)."""
        compiled, name = code
        scope: dict[str, Any] = {
            **self.defaults,
            f"{_PREFIX}getattr": getattr,
            f"{_PREFIX}Exception": Exception,
            **namespace,
        }
        exec(compiled, scope)
        return cast(Callable[..., Any], scope[name])

    def build_closure(self, name: str, body: str, cells: dict[str, Any]) -> Callable[..., Any]:
        """``def name(<params>): <body>`` reading ``cells`` as closure variables and
        :data:`_OP_GLOBALS` as its globals (names every op object shares, such as
        ``_kr_Exception``)."""
        return self.build_closures(name, [body], cells)[0]

    def build_closures(
        self, name: str, bodies: Sequence[str], cells: dict[str, Any]
    ) -> list[Callable[..., Any]]:
        """One function per body, as :meth:`build_closure` makes it, all over the same
        closure cells; each body names every cell (in a branch never taken), so their code
        objects have the same free variables and one function can take another's code."""
        name = _identifier(name)
        factory_params = ", ".join([*cells, *self.defaults])
        every_cell = f"if 0:\n    ({', '.join(cells)},)\n" if cells else ""
        source = [f"def {_PREFIX}factory({factory_params}):\n    {_PREFIX}made = []\n"]
        for body in bodies:
            inner = "".join(f"        {line}\n" for line in (every_cell + body).splitlines())
            source.append(
                f"    def {name}({self.params}):\n{inner}    {_PREFIX}made.append({name})\n"
            )
        source.append(f"    return {_PREFIX}made\n")
        scope: dict[str, Any] = {}
        exec(compile("".join(source), f"<kernreg {name}>", "exec"), _OP_GLOBALS, scope)
        made = scope[f"{_PREFIX}factory"](**cells, **self.defaults)
        return cast(list[Callable[..., Any]], made)

    def build(self, name: str, body: str, namespace: dict[str, Any]) -> Callable[..., Any]:
        """Compile ``def name(<params>): <body>`` with the defaults and ``namespace`` in scope."""
        return self.instantiate(self.compile(name, body), namespace)


#: The globals of every op object's generated code.
_OP_GLOBALS: dict[str, Any] = {f"{_PREFIX}Exception": Exception}


#: The sets of gates an op object can look up inline (autotuned ops, gated on ``shape``,
#: decide their misses through the dispatcher in box[0]).
_INLINE_GATES: tuple[tuple[str, ...], ...] = (("dtype",), ("device",), ("dtype", "device"))


def _inline_cell_name(gates: tuple[str, ...]) -> str:
    return f"{_PREFIX}g_" + "_".join(gates)


def _wrapper_cells() -> list[str]:
    """The closure variables of every op object's code, in the order _make_op makes them."""
    return [
        f"{_PREFIX}box",
        *(_inline_cell_name(gates) for gates in _INLINE_GATES),
    ]


def _nothing() -> None:
    return None


def _identifier(name: str) -> str:
    """``name`` as a function name generated code can use: op ids may end in a Python
    keyword (``bitwise.and``, ``demo.class``), which gets a trailing underscore."""
    return name + "_" if keyword.iskeyword(name) or not name.isidentifier() else name


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


def _lookup_source(
    cache: str, dispatch_args: Sequence[str], parts: Sequence[tuple[int, str]]
) -> str:
    """The generated expression that reads a call's entry: ``cache[x.dtype][x.device]...``
    (nested dicts: with torch tensors, ``c[x.dtype][x.device]`` costs ~25 ns less than
    ``c[x.dtype, x.device]``)."""
    return cache + "".join(f"[{dispatch_args[index]}.{attr}]" for index, attr in parts)


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
    """One registry generation's per-call dispatch state of an op object.

    Its gates (the argument attributes looked up) and the nesting of its cache are fixed
    when it is built and never change: a later generation gets a new table, so a call in
    flight can only read, or store into, a table of its own shape.
    """

    __slots__ = ("state", "gates", "parts", "epoch", "cache", "__weakref__")

    def __init__(self, state: _OpState, gates: tuple[str, ...], epoch: int) -> None:
        self.state = state
        self.gates = gates
        self.parts = _key_parts(state.dispatch_args, gates)  # the levels of ``cache``
        self.epoch = epoch
        self.cache: dict[Any, Any] = {}  # nested: one level per gated attribute

    @run_while_tracing
    def miss(self, pairs: Sequence[tuple[Any, Any]]) -> str:
        """Decide a call missing from the cache (see :meth:`_OpState.miss`)."""
        return self.state.miss(self, pairs)

    def tuned_miss(self, /, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        return self.state.tuned_miss(self, args, kwargs)


class _OpState:
    """The mutable half of an op object: its current target, dispatch table and resolver."""

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
        self.lock = Lock()
        self.strict = strict
        self.autotune = autotune
        self.dispatch_args = dispatch_args
        self.signature = signature

        # A plain function, not a bound method: a compiled region guards on what box[0]
        # holds, and dynamo's guard for a method fails outright once a function replaces it.
        def resolve_and_call(*args: Any, **kwargs: Any) -> Any:
            return getattr(self.targets, self._resolved_name())(*args, **kwargs)

        self._resolve_and_call = resolve_and_call
        #: What the op object calls (``box[0]``): the target, or while a live pin matches
        #: the op, the scoped route (``box[1]``); ``box[2]`` is the target itself.
        self.box: list[Callable[..., Any]] = [resolve_and_call]
        self.live_pins = False
        self.targets = _Targets(resolve_and_call)
        self.epoch = 0
        #: (id of a pin, dispatch attributes) -> (pin, name in ``targets``), for calls
        #: under a scoped pin.
        self.pinned: dict[Any, tuple[Any, str]] = {}
        #: The table of the published gated dispatcher, if ``box[0]`` holds one.
        self.table: _Table | None = None
        self._gated_code: dict[tuple[str, ...], Any] = {}
        # The op object's inline form (see _make_op): its code per set of gates, the
        # closure cell each form reads its table's cache from, and the plain form's code.
        self.wrapper: Callable[[], Any] = _nothing
        self.plain_code: Any = None
        self.inline_cells: dict[tuple[str, ...], Any] = {}
        self._inline_code: dict[tuple[str, ...], Any] = {}
        self._inline_cell: Any = None

    def invalidate(self) -> None:
        with self.lock:
            self._invalidate()

    def _invalidate(self) -> None:
        self.epoch += 1
        self.pinned = {}
        self.table = None
        cell = self._inline_cell
        if cell is not None:  # calls in the inline form now miss, and take box[0]
            cell.cell_contents = {}
            self._inline_cell = None
        self.targets.clear()
        self.box[2] = self._resolve_and_call
        self.box[0] = self.box[1] if self.live_pins else self._resolve_and_call

    def follow_live_pins(self) -> None:
        """Take the scoped route while a live use_backend pin matches the op, else the target."""
        with self.lock:
            self.live_pins = any(pin.matches(self.op_id) for pin in live_pins())
            self.box[0] = self.box[1] if self.live_pins else self.box[2]
            table = self.table
            self._route(table, None if table is None else self._inline_form(table.gates))

    @property
    def cache(self) -> dict[Any, Any]:
        """The per-call decisions of the published table (empty without one)."""
        table = self.table
        return {} if table is None else table.cache

    def _publish(
        self, epoch: int, target: Callable[..., Any], table: _Table | None, inline: Any = None
    ) -> None:
        with self.lock:
            if self.epoch == epoch:
                self.box[2] = target
                self.box[0] = self.box[1] if self.live_pins else target
                self.table = table
                self._route(table, inline)

    def _route(self, table: _Table | None, inline: Any) -> None:
        """Give the op object the form that serves ``table``: the inline lookup in its
        cache (``inline``, that form's code), else the plain call of ``box[...]``.
        Called with the registry lock held, right after ``box[0]`` is published.

        Each inline form reads the cell of its own set of gates, which only ever holds
        the cache of a table with those gates (or an empty dict): a call still running
        a form published earlier can miss, never read a cache of another shape.
        """
        wrapper = self.wrapper()
        if wrapper is None:
            return
        cell = None
        if table is not None and inline is not None and not self.live_pins:
            cell = self.inline_cells.get(table.gates)
        if cell is not None and table is not None:
            cell.cell_contents = table.cache
            self._inline_cell = cell
            if wrapper.__code__ is not inline:
                wrapper.__code__ = inline
        elif wrapper.__code__ is not self.plain_code:
            wrapper.__code__ = self.plain_code

    def _inline_form(self, gates: tuple[str, ...]) -> Any:
        """The code of the op object's inline form for ``gates`` (None: no such form)."""
        if gates not in self.inline_cells or self.plain_code is None:
            return None
        code = self._inline_code.get(gates)
        if code is None:
            forward = self.signature.forward
            lookup = _lookup_source(
                _inline_cell_name(gates),
                self.dispatch_args,
                _key_parts(self.dispatch_args, gates),
            )
            body = (
                "try:\n"
                f"    {_PREFIX}impl = {lookup}\n"
                # A miss, or an argument without the attribute: the dispatcher decides.
                f"except {_PREFIX}Exception:\n"
                f"    return {_PREFIX}box[0]({forward})\n"
                f"return {_PREFIX}impl({forward})\n"
            )
            made = self.signature.build_closures(
                self.plain_code.co_name, [body], dict.fromkeys(_wrapper_cells())
            )[0]
            code = made.__code__
            if code.co_freevars != self.plain_code.co_freevars:  # cannot take its place
                code = False
            self._inline_code[gates] = code
        return code or None

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
        """Choose what ``box[0]`` holds now; store it unless the registry moved meanwhile or
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
        target: Callable[..., Any]
        table = inline = None
        if gates and self.dispatch_args:
            table = _Table(self, gates, epoch)
            target = self._gated_dispatcher(table)
            inline = self._inline_form(gates)
        else:
            decision = self.registry.explain(self.op_id, strict=self.strict)
            target = self._callable_for(decision)
        if not _tracing() and self._shared():
            self._publish(epoch, target, table, inline)
        return target

    def _gated_dispatcher(self, table: _Table) -> Callable[..., Any]:
        """A function with the reference's signature that looks the decision up per call
        in ``table`` (the code is compiled once per set of gates; each table gets its own
        function object bound to its own cache)."""
        gates = table.gates
        code = self._gated_code.get(gates)
        if code is None:
            lookup = _lookup_source(f"{_PREFIX}cache", self.dispatch_args, table.parts)
            dispatch_values = "(" + ", ".join(self.dispatch_args) + ",)"
            forward = self.signature.forward
            if "shape" in gates:  # autotune: the miss may measure, on this call's own arguments
                miss = f"{_PREFIX}tuned_miss({forward})"
            else:
                miss = (
                    f"{_PREFIX}getattr({_PREFIX}targets, "
                    f"{_PREFIX}miss({_PREFIX}attrs({dispatch_values})))"
                )
            body = (
                "    try:\n"
                f"        {_PREFIX}impl = {lookup}\n"
                # KeyError on a miss; AttributeError/TypeError for arguments without .dtype/.device.
                f"    except {_PREFIX}Exception:\n"
                f"        {_PREFIX}impl = {miss}\n"
                f"    return {_PREFIX}impl({forward})\n"
            )
            code = self._gated_code[gates] = self.signature.compile(
                "gated_" + self.op_id.replace(".", "_"), body
            )
        return self.signature.instantiate(
            code,
            {
                f"{_PREFIX}cache": table.cache,
                f"{_PREFIX}miss": table.miss,
                f"{_PREFIX}tuned_miss": table.tuned_miss,
                f"{_PREFIX}targets": self.targets,
                f"{_PREFIX}attrs": _call_attrs,
            },
        )

    def _call_inputs(self, values: Sequence[Any]) -> tuple[Platform, tuple[str, ...] | None, Any]:
        """Platform, dtypes and cache key of a call from its dispatch arguments."""
        return self._inputs_from_attrs(_call_attrs(values), ())

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
        cache_key = _cache_key([pairs[index][_PAIR_FIELDS[attr]] for index, attr in parts])
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
        if cache_key is not None and not _tracing() and self._shared():
            _cache_put(table.cache, cache_key, target)
        return self._store(target)

    def tuned_miss(
        self, table: _Table, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Callable[..., Any]:
        """Decide a call of an autotuned op missing from ``table``, measuring the candidates
        on this call's arguments when its shape bucket has no recorded result yet."""
        values = [self._bind_value(name, args, kwargs) for name in self.dispatch_args]
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
        if decision.tuning and not _tracing():
            measure = measurer()  # None without the torch layer: priority decides
            if measure is not None:
                results = measure(op_id, decision.tuning, args, kwargs, params=self.signature.names)
                if results:
                    registry.record_measurements(op_id, platform, dtypes, bucket, results)
                    decision = decide()
        target = self._callable_for(decision)
        key = _cache_key([getattr(values[index], attr, None) for index, attr in table.parts])
        if key is not None and not _tracing() and self._shared():
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
        if key is not None and not _tracing():
            if len(pinned) >= _PINNED_ENTRIES:  # every block makes a new pin: stay bounded
                pinned.clear()
            pinned[key] = (pins, name)  # this generation's dict: invalidate() replaces it
        return name

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
        or a function raising the decision's error.

        While torch.compile traces (this runs for real then), an error is raised right
        away, so it reaches the caller with its own type and message, and an open trace
        records the decision once instead of wrapping the call in recording code.
        """
        compiling = _tracing()
        try:
            static = chosen_or_raise(decision).load()
        except Exception as exc:
            if compiling:
                raise _through_the_compiler(exc) from exc.__cause__
            error = exc

            @run_while_tracing  # torch.compile calls it for real: the error passes through
            def raise_error() -> None:
                raise _through_the_compiler(error) if _tracing() else error

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
        if not decision.conditional:
            return static
        return self._chooser(decision, static, recording)

    def _traced(
        self, impl: Callable[..., Any], implementation: str, rule: str
    ) -> Callable[..., Any]:
        """``impl`` wrapped to record each call in the open traces (only while one is open)."""
        op_id, names, bind = self.op_id, self.dispatch_args, self._bind_value

        def traced(*args: Any, **kwargs: Any) -> Any:
            record_call(op_id, implementation, rule, [bind(name, args, kwargs) for name in names])
            return impl(*args, **kwargs)

        return traced

    @run_while_tracing
    def _loaded_name(self, spec: KernelSpec, rule: str = "when") -> str:
        """Import ``spec``'s implementation (for real, also while torch.compile traces)."""
        if active_traces() and _tracing():
            record_decision(self.op_id, spec.label, rule, ())
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
    reg = default_registry() if registry is None else registry

    def decorate(reference: Callable[P, R]) -> Op[P, R]:
        signature = _Signature(reference)
        names = _dispatch_names(signature, dispatch_args, reference)
        # Build the op object before registering, so a failure leaves nothing registered.
        made = _make_op(op_id, reference, signature, reg, names, strict, autotune)
        reg.register(
            KernelSpec(
                op_id, backend, reference, reference=True, traits=traits, description=description
            )
        )
        located = reference if "<" not in getattr(reference, "__qualname__", "<") else None
        key = _pickle_key(reg, op_id, strict, autotune, dispatch_args, located)
        if key is not None:
            _name_for_pickle(made, key)
            _op_objects_by_key[key] = made  # the newest definition (a reloaded module's)
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
        existing = _op_objects_by_key.get(key)
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
    signature = _Signature(like)
    names = _dispatch_names(signature, dispatch_args, like)
    made = _make_op(
        op_id, reference.load() if reference else like, signature, reg, names, strict, autotune
    )
    if key is not None:
        _name_for_pickle(made, key)
        made = _op_objects_by_key.setdefault(key, made)
    return cast(Op[P, R], made)


# --- pickling op objects by reference --------------------------------------------------------

#: Op objects of the process-wide registry by pickle key (see :func:`_pickle_key`).
_op_objects_by_key: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def _pickle_key(
    reg: KernelRegistry,
    op_id: str,
    strict: bool | None,
    autotune: bool | None,
    dispatch_args: Sequence[str] | None,
    like: Callable[..., Any] | None,
) -> str | None:
    """The name an op object pickles under: its op id and the options that make it, dots
    written as ``/`` (pickle splits names at dots). ``None``: not picklable by reference
    (another registry than the process-wide one, or ``like`` a local function)."""
    if reg is not default_registry():
        return None
    fields = [op_id]
    if strict is not None:
        fields.append(f"strict={int(strict)}")
    if autotune is not None:
        fields.append(f"autotune={int(autotune)}")
    if dispatch_args is not None:
        fields.append("args=" + ",".join(dispatch_args))
    if like is not None:
        module = getattr(like, "__module__", None)
        qualname = getattr(like, "__qualname__", None)
        if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
            return None
        fields.append(f"like={module}:{qualname}")
    return "|".join(fields).replace(".", "/")


def _name_for_pickle(made: Any, key: str) -> None:
    made.__module__ = __name__
    made.__qualname__ = f"op_objects.{key}"


def _from_pickle_key(key: str) -> Any:
    """The op object ``key`` names, made now if this process has none yet."""
    found = _op_objects_by_key.get(key)
    if found is not None:
        return found
    op_id, *fields = key.replace("/", ".").split("|")
    options = dict(field.partition("=")[::2] for field in fields)
    like: Any = None
    if "like" in options:
        module_name, _, qualname = options["like"].partition(":")
        like = importlib.import_module(module_name)  # may define the op object itself
        found = _op_objects_by_key.get(key)
        if found is not None:
            return found
        for part in qualname.split("."):
            like = getattr(like, part)
        like = getattr(like, "reference", like)  # an op object: its reference
    return dispatcher(
        op_id,
        like=like,
        strict=bool(int(options["strict"])) if "strict" in options else None,
        autotune=bool(int(options["autotune"])) if "autotune" in options else None,
        dispatch_args=options["args"].split(",") if "args" in options else None,
    )


class _OpObjects:
    """Where pickle finds op objects: ``kernreg.dispatch.op_objects.<key>``."""

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        try:
            return _from_pickle_key(key)
        except (KeyError, ValueError, ImportError) as exc:
            raise AttributeError(f"no op object for {key!r}: {exc}") from exc

    def __reduce__(self) -> str:
        return "op_objects"


op_objects = _OpObjects()


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
    forward = signature.forward
    values = ", ".join(names) + "," if names else ""
    # Under a scoped pin of the caller's context: what the pin chooses; else the usual
    # target, without reading the arguments' attributes.
    scoped = signature.build_closure(
        "scoped_" + op_id.replace(".", "_"),
        # Reading the key makes torch.compile guard on the set of open blocks.
        f"if {_PREFIX}route({_PREFIX}blocks.key):\n"
        f"    {_PREFIX}name = {_PREFIX}pinned({_PREFIX}attrs(({values})))\n"
        f"    if {_PREFIX}name:\n"
        f"        return {_PREFIX}getattr({_PREFIX}targets, {_PREFIX}name)({forward})\n"
        f"return {_PREFIX}box[2]({forward})\n",
        {
            f"{_PREFIX}route": state.scoped_route,
            f"{_PREFIX}pinned": state.pinned_name,
            f"{_PREFIX}attrs": _call_attrs,
            f"{_PREFIX}targets": state.targets,
            f"{_PREFIX}box": state.box,
            f"{_PREFIX}getattr": getattr,
            f"{_PREFIX}blocks": open_blocks,
        },
    )
    state.box.extend((scoped, state.box[0]))
    # The hot path: box[0], the target, or while a live use_backend pin matches the op, the
    # scoped route: a plain call, nothing read per call for pins. While box[0]
    # holds a gated dispatcher, the op object takes the code of an inline form instead,
    # which looks the call up in the table's cache itself (one Python frame, not two).
    cells: dict[str, Any] = {f"{_PREFIX}box": state.box}
    cells.update((_inline_cell_name(gates), {}) for gates in _INLINE_GATES)
    wrapper = signature.build_closures(
        op_id.split(".")[-1], [f"return {_PREFIX}box[0]({forward})\n"], cells
    )[0]
    state.plain_code = wrapper.__code__
    closure = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__ or (), strict=True))
    state.inline_cells = {gates: closure[_inline_cell_name(gates)] for gates in _INLINE_GATES}
    state.wrapper = weakref.ref(wrapper)
    functools.update_wrapper(wrapper, reference)
    # torch.compile cannot read a context variable: it traces the scoped route instead,
    # which asks for real whether a pin applies and guards on the set of open blocks.
    wrapper._torchdynamo_inline = scoped  # type: ignore[attr-defined]
    _attach(wrapper, state, reference)
    reg.subscribe(state)
    with _all_states_lock:
        _all_states.add(state)
    state.follow_live_pins()  # after joining _all_states: no change of live pins is missed
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
            platform=platform,
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
    wrapper._kernreg_state = state

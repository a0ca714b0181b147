"""The forward a routed module runs: generated once per (argument map, output map).

A routed forward is ``output(module, impl(*args(module, *inputs)), *inputs)``, the
implementation read from the site's table by the dtype of the op's first argument. Where
the argument map is a plain function whose body is one ``return (a, b, ...)`` (the pack's
maps are), its expression is compiled into the forward itself, in the map's own globals:
no call of the map, no argument tuple built and unpacked, no ``*args`` call, and the
arguments after the first are evaluated only once the table says an implementation runs.
The output map is inlined the same way. Anything else (a lambda, a closure, defaults, a
body of several statements, source that no longer matches the code) is called as before.

A module settles (:func:`settled_forward`, :func:`settled_class`) when its table is
filled: the same forward, made with what it reads from its closure as its globals
instead (the table a copy), set on a subclass of the module's class, both shared by every
module in the same state. torch.compile guards what a function reads from its globals
once per graph, and a forward read from the class with the class; what a forward set on
the instance reads from its closure it guards once per module, on every compiled call.
"""

from __future__ import annotations

import ast
import builtins
import copy
import copyreg
import functools
import inspect
import sys
import textwrap
import types
import weakref
from collections.abc import Callable
from typing import Any

__all__ = [
    "Settled",
    "forward_maker",
    "forward_names",
    "is_settled",
    "made",
    "own_class",
    "plain_parameters",
    "retire",
    "route_maker",
    "settled_class",
    "settled_forward",
    "unpassed_inputs",
    "unsettled_class",
    "untaken_inputs",
    "widened",
]

#: names the generated code binds itself (a map whose parameter has one is called)
RESERVED = frozenset(
    {
        "self",
        "op_args",
        "impl",
        "table",
        "site",
        "args_fn",
        "output_fn",
        "own",
        "make",
        "original",
        "defaults",
        "dispatch",
        "miss_",
    }
)
#: what an inlined forward binds itself (its factory's parameters and its locals)
INLINED = frozenset(
    {
        "args_fn",
        "output_fn",
        "table",
        "site",
        "own",
        "impl",
        "first_",
        "result_",
        "miss_",
        "globals_",
    }
)

#: generated forward factories, by source text (compiled once per signature)
_factories: dict[str, Callable[..., Callable[..., Any]]] = {}

_NOT_INLINED = (
    ast.Lambda,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
    ast.NamedExpr,
    ast.Await,
    ast.Yield,
    ast.YieldFrom,
    ast.Starred,
)


def plain_parameters(func: Callable[..., Any]) -> list[str] | None:
    """The names of ``func``'s parameters after the first, if all are plain positional
    ones without defaults; else ``None``."""
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
    if any(not n.isidentifier() or n in RESERVED for n in names):
        return None
    return names


def _returned_expression(func: Any) -> tuple[list[str], ast.expr] | None:
    """``(parameter names, the returned expression)`` of a plain function whose body is
    one ``return`` (a docstring allowed), when its source is the code it runs."""
    if not isinstance(func, types.FunctionType) or func.__closure__:
        return None
    if func.__defaults__ or func.__kwdefaults__:
        return None
    code = func.__code__
    try:
        source = textwrap.dedent(inspect.getsource(func))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    node = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(node, ast.FunctionDef) or node.decorator_list or node.name != code.co_name:
        return None
    arguments = node.args
    if arguments.vararg or arguments.kwarg or arguments.kwonlyargs or arguments.posonlyargs:
        return None
    body = node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        return None
    expr = body[0].value
    if any(isinstance(sub, _NOT_INLINED) for sub in ast.walk(expr)):
        return None
    # The source on disk must be what was imported: compiled again, the code is the same.
    ast.increment_lineno(tree, code.co_firstlineno - 1)
    try:
        compiled = compile(tree, code.co_filename, "exec")
    except (SyntaxError, ValueError):
        return None
    again = next((c for c in compiled.co_consts if isinstance(c, types.CodeType)), None)
    if again is None or (again.co_code, again.co_names, again.co_consts) != (
        code.co_code,
        code.co_names,
        code.co_consts,
    ):
        return None
    return [a.arg for a in arguments.args], expr


def _names_in(expr: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}


class _Rename(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.copy_location(ast.Name(self.names.get(node.id, node.id), node.ctx), node)


def _inline_args(
    args_fn: Any, names: tuple[str, ...] | None = None
) -> tuple[list[str], list[str]] | None:
    """``(forward parameters, op argument sources)`` of an argument map returning a tuple;
    ``names``: the inputs' names in the forward, in place of the map's own."""
    found = _returned_expression(args_fn)
    if found is None:
        return None
    params, expr = found
    if not isinstance(expr, ast.Tuple) or not expr.elts or len(params) < 1:
        return None
    if any(not p.isidentifier() or p in INLINED for p in params) or _names_in(expr) & INLINED:
        return None
    if names is not None and len(names) == len(params) - 1:
        renamed = [params[0], *names]
        # A new name must not be one the expression reads otherwise (a global, the module).
        if len(set(renamed)) != len(renamed) or set(names) & (INLINED | _names_in(expr)):
            return None
        expr = _Rename(dict(zip(params, renamed, strict=True))).visit(expr)
        params = renamed
    return params, [ast.unparse(e) for e in expr.elts]


def _inline_output(output_fn: Any, params: list[str], namespace: dict[str, Any]) -> str | None:
    """The output map's expression over the forward's ``params`` and ``result_``."""
    found = _returned_expression(output_fn)
    if found is None or output_fn.__globals__ is not namespace:
        return None
    own_params, expr = found
    if len(own_params) != len(params) + 1:
        return None
    renames = dict(zip(own_params, [params[0], "result_", *params[1:]], strict=True))
    free = _names_in(expr) - set(own_params)
    if free & (INLINED | set(params)):
        return None
    return ast.unparse(_Rename(renames).visit(expr))


@functools.lru_cache(maxsize=256)  # one per class forward: inspect.signature costs 10 µs
def forward_names(own: Any, args_fn: Any) -> tuple[str, ...] | None:
    """The parameter names of the module's own forward ``own`` (after ``self``) where they
    differ from those of the argument map's inputs but are as many, all plain: the routed
    forward takes them, so a caller passing an input by its name (``norm(input=x)`` for
    ``torch.nn.LayerNorm``) reaches it. ``None``: the map's names serve."""
    names, mapped = plain_parameters(own), plain_parameters(args_fn)
    if names is None or mapped is None or len(names) != len(mapped) or names == mapped:
        return None
    return tuple(names)


def _forward_lines(
    signature: str,
    module: str,
    first: str,
    own_call: str,
    before: list[str],
    result: list[str],
    settled: bool,
) -> list[str]:
    """The lines of a routed forward ``def forward(signature)`` (at column 0): ``before``
    and ``result`` its first and last lines (indented 4), ``first`` the op's first argument,
    ``module`` the module's parameter, ``own_call`` the call of its own forward. The
    table's miss asks the site (a closure's ``site``; ``settled``: the module's own, through
    the global ``miss_``)."""
    miss = (
        f"impl = miss_({module}, {first})"
        if settled
        else f"impl = getattr(site, site.miss_name({first}), None)"
    )
    return [
        f"def forward({signature}):",
        *before,
        "    try:",
        f"        impl = table[{first}.dtype]",
        "    except KeyError:",
        f"        {miss}",
        "    if impl is None:",
        f"        return {own_call}",
        *result,
    ]


def _factory_source(lines: list[str]) -> str:
    """``lines`` of a forward, inside ``make(args_fn, output_fn, table, site, own)``."""
    body = "\n".join("    " + line for line in lines)
    return f"def make(args_fn, output_fn, table, site, own):\n{body}\n    return forward\n"


@functools.lru_cache(maxsize=256)  # one per argument map: inspect.signature costs 10 µs
def _plain_lines(
    args_fn: Any,
    output_fn: Any,
    trains_otherwise: bool,
    names: tuple[str, ...] | None,
    settled: bool,
) -> list[str]:
    """The forward's lines where the argument map is called (not inlined)."""
    params = plain_parameters(args_fn)
    if params is not None and names is not None:
        params = list(names)
    inputs = "*inputs, **kwargs" if params is None else ", ".join(params)
    signature = f"self, {inputs}" if inputs else "self"
    call = "impl(*op_args)"
    result = call if output_fn is None else f"output_fn(self, {call}, {inputs})"
    training = ["    if self.training:", f"        return own(self, {inputs})"]
    before = [*(training if trains_otherwise else []), f"    op_args = args_fn(self, {inputs})"]
    own_call = f"own(self, {inputs})"
    return _forward_lines(
        signature, "self", "op_args[0]", own_call, before, [f"    return {result}"], settled
    )


@functools.lru_cache(maxsize=256)  # one per argument map: inspect.signature costs 10 µs
def forward_maker(
    args_fn: Any,
    output_fn: Any,
    trains_otherwise: bool = False,
    names: tuple[str, ...] | None = None,
) -> Callable[..., Callable[..., Any]]:
    """``make(args_fn, output_fn, table, site, own)``: the forward bound to a routed module
    (a function of the module, made a method). See the module docstring.
    ``trains_otherwise``: the own forward runs while the module is in training mode;
    ``names``: the forward's input parameters (:func:`forward_names`; else the map's)."""
    inlined = _inline_args(args_fn, names)
    if inlined is not None:
        lines = _inlined_lines(args_fn, output_fn, *inlined, trains_otherwise, False)
        factory = made(_factory_source(lines), f"routed forward of {args_fn.__qualname__}")
        # The inlined expressions name the maps' globals: the factory runs in them.
        namespace = args_fn.__globals__
        return types.FunctionType(factory.__code__, namespace, "make")
    source = _factory_source(_plain_lines(args_fn, output_fn, trains_otherwise, names, False))
    make = _factories.get(source)
    if make is None:
        make = _factories.setdefault(source, made(source, "routed forward"))
    return make


@functools.lru_cache(maxsize=256)  # one per argument map and forward
def _settled_code(
    args_fn: Any, output_fn: Any, trains_otherwise: bool, names: tuple[str, ...] | None
) -> tuple[types.CodeType, dict[str, Any]]:
    """The code of a settled forward (:func:`settled_forward`) and the globals it starts
    from: the maps' own where their expressions are compiled in, else none."""
    inlined = _inline_args(args_fn, names)
    space = None if inlined is None else _module_of(args_fn)
    if inlined is not None and space is not None:
        lines = _inlined_lines(args_fn, output_fn, *inlined, trains_otherwise, True)
        where, base = f"settled forward of {args_fn.__qualname__}", {"globals_": space}
        source = _read_through(lines, args_fn.__globals__)
    else:
        lines = _plain_lines(args_fn, output_fn, trains_otherwise, names, True)
        where, base = "settled forward", {}
        source = "\n".join(lines) + "\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<kernreg {where}>", "exec"), namespace)
    return namespace["forward"].__code__, base


def _module_of(func: Any) -> types.ModuleType | None:
    """The module whose namespace ``func``'s globals are (``None``: none imported is)."""
    module = sys.modules.get(func.__globals__.get("__name__", ""))
    return module if getattr(module, "__dict__", None) is func.__globals__ else None


#: what a settled forward reads from its own globals (the rest from the maps' module)
_SETTLED_GLOBALS = frozenset({"args_fn", "output_fn", "table", "own", "miss_"})


def _read_through(lines: list[str], namespace: dict[str, Any]) -> str:
    """The source of the forward ``lines`` whose inlined expressions read the names of the
    maps' module ``namespace`` as attributes of that module (``globals_``), as it is at
    each call: a name rebound there since the forward was made (a constant changed, a
    helper patched) is read as it is now, as the map itself would read it. A builtin the
    module does not bind is read as it is."""
    tree = ast.parse("\n".join(lines) + "\n")
    forward = tree.body[0]
    assert isinstance(forward, ast.FunctionDef)
    bound = {a.arg for a in forward.args.args} | _SETTLED_GLOBALS
    bound |= {
        n.id
        for n in ast.walk(forward)
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)
    }

    class Through(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            name = node.id
            if name in bound or (name not in namespace and hasattr(builtins, name)):
                return node
            target = ast.Attribute(ast.Name("globals_", ast.Load()), name, ast.Load())
            return ast.copy_location(target, node)

    return ast.unparse(Through().visit(tree)) + "\n"


#: settled forwards by what they were made from, shared by every module in that state
_settled: weakref.WeakValueDictionary[tuple[Any, ...], Any] = weakref.WeakValueDictionary()


def settled_forward(
    own: Any,
    args_fn: Any,
    output_fn: Any,
    trains_otherwise: bool,
    table: dict[Any, Any],
    miss: Callable[[Any, Any], Any],
) -> Any:
    """The routed forward of a module whose site's table is ``table`` now, as a function of
    the module to set on its class: what the forward of :func:`forward_maker` reads from its
    closure (the maps, ``own``, a copy of the table) are its globals instead, and a dtype
    missing from the table asks ``miss(module, first argument)``. One function per state
    (the same maps, own forward and implementations), shared by every module in it: under
    ``torch.compile``, what a function reads from its globals is guarded once per graph,
    what it reads from a closure once per module (about 0.3 µs a module a compiled call).
    The globals have no ``__name__``, so dynamo reads them as they are, not the module
    the maps come from."""
    # The implementations themselves in the key: the forward holds them anyway, and its
    # entry goes with it.
    key = (own, args_fn, output_fn, trains_otherwise, *table.items())
    found = _settled.get(key)
    if found is not None:
        return found
    names = forward_names(own, args_fn)
    code, base = _settled_code(args_fn, output_fn, trains_otherwise, names)
    namespace = {k: v for k, v in base.items() if k != "__name__"}
    namespace.setdefault("__builtins__", builtins)
    namespace.update(args_fn=args_fn, output_fn=output_fn, own=own, table=dict(table), miss_=miss)
    forward = types.FunctionType(code, namespace, "forward")
    _settled[key] = forward
    return forward


def retire(forward: Any) -> None:
    """Empty the table of the settled ``forward`` (:func:`settled_forward`) and make no
    module settle on it again: its implementations were decided from a registry changed
    since. A call of it (a module still running it, a reference to it kept anywhere) then
    misses, and asks the module's site, which holds what is decided now."""
    forward.__globals__["table"].clear()
    for key, found in list(_settled.items()):
        if found is forward:
            _settled.pop(key, None)


@functools.lru_cache(maxsize=256)  # one look-up a routed module, not three: about 1% of kernelize
def route_maker(
    own: Any, args_fn: Any, output_fn: Any, trains_otherwise: bool
) -> tuple[Callable[..., Callable[..., Any]], int | None]:
    """``(make, passed)``: the factory of the forward routing a module whose own forward is
    ``own`` (:func:`forward_maker`, taking ``own``'s input names: :func:`forward_names`),
    and how many inputs the argument map passes where ``own`` takes others it does not
    (:func:`unpassed_inputs`; the forward made is then :func:`widened`), else ``None``."""
    make = forward_maker(args_fn, output_fn, trains_otherwise, forward_names(own, args_fn))
    if not unpassed_inputs(own, args_fn)[0]:
        return make, None
    passed = plain_parameters(args_fn)
    assert passed is not None  # unpassed_inputs found none otherwise
    return make, len(passed)


def made(source: str, where: str) -> Callable[..., Callable[..., Any]]:
    """The function ``make`` that generated ``source`` defines (``where``: its file name
    in tracebacks)."""
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<kernreg {where}>", "exec"), namespace)
    maker: Callable[..., Callable[..., Any]] = namespace["make"]
    return maker


def _inlined_lines(
    args_fn: Any,
    output_fn: Any,
    params: list[str],
    op_args: list[str],
    trains_otherwise: bool,
    settled: bool,
) -> list[str]:
    """The forward's lines where the maps' expressions are compiled in."""
    namespace: dict[str, Any] = args_fn.__globals__
    inputs = ", ".join(params)
    first = op_args[0]
    before = []
    if trains_otherwise:
        before += [f"    if {params[0]}.training:", f"        return own({inputs})"]
    if first not in params:  # a parameter is read as it is; anything else once
        before.append(f"    first_ = {first}")
        first = "first_"
    call = f"impl({', '.join([first, *op_args[1:]])})"
    output = None if output_fn is None else _inline_output(output_fn, params, namespace)
    if output_fn is None:
        result = [f"    return {call}"]
    elif output is not None:
        result = [f"    result_ = {call}", f"    return {output}"]
    else:
        result = [f"    return output_fn({', '.join([params[0], call, *params[1:]])})"]
    return _forward_lines(inputs, params[0], first, f"own({inputs})", before, result, settled)


class Settled(type):
    """The metaclass of the classes settled modules run as (:func:`settled_class`): each a
    subclass of a module's own class, named as it is, whose only attribute is the routed
    forward. Pickled as the class it was made from (a pickled model loads with its own
    forward), copied as itself (a deep copy runs as its original does); called, it makes
    a module of the class it was made from (``type(module)(...)`` makes one not routed)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if _made_here(cls):
            return cls.__bases__[0](*args, **kwargs)
        return super().__call__(*args, **kwargs)


def _pickled_as_base(cls: Settled) -> tuple[Any, tuple[type]]:
    return copy.copy, (cls.__bases__[0],)  # copy.copy of a class is the class


copyreg.pickle(Settled, _pickled_as_base)

#: settled classes by (own class, forward), shared by every module in that state
_settled_classes: weakref.WeakValueDictionary[tuple[type, Any], type] = (
    weakref.WeakValueDictionary()
)


def settled_class(base: type, forward: Any) -> type | None:
    """The class a module of class ``base`` runs as while ``forward`` routes it: its
    subclass with that forward (``None`` where ``base`` has a metaclass of its own, or
    making a subclass of it fails)."""
    found = _settled_classes.get((base, forward))
    if found is not None or type(base) is not type:
        return found
    namespace = {
        "forward": forward,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
        _MADE_HERE: True,
    }
    try:
        found = Settled(base.__name__, (base,), namespace)
    except Exception:  # an __init_subclass__ refusing it: the module stays as it is
        return None
    _settled_classes[(base, forward)] = found
    return found


#: set in the namespace of each class :func:`settled_class` makes, not inherited by one
#: made from it since (``torch.nn.utils.parametrize``'s)
_MADE_HERE = "__kernreg_settled__"


def _made_here(cls: type) -> bool:
    """Whether ``cls`` is a class :func:`settled_class` made (not one made from it since)."""
    return _MADE_HERE in cls.__dict__


#: classes made from a settled class since (by another library), each without it
_unsettled_classes: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()


def unsettled_class(cls: type) -> type:
    """``cls`` without the settled classes it derives from: the class a settled class was
    made from; for a class made from a settled one since (``torch.nn.utils.parametrize``
    makes a module's class a subclass of the class it has), the same class made from that
    one's base (``cls`` itself where it cannot be made)."""
    if type(cls) is not Settled:
        return cls
    if _made_here(cls):
        return cls.__bases__[0]
    found = _unsettled_classes.get(cls)
    if found is None:
        bases = tuple(unsettled_class(base) for base in cls.__bases__)
        namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
        namespace["__qualname__"] = cls.__qualname__
        try:
            found = types.new_class(cls.__name__, bases, exec_body=lambda ns: ns.update(namespace))
        except Exception:  # a layout or an __init_subclass__ refusing it
            return cls
        _unsettled_classes[cls] = found
    return found


def is_settled(module: Any) -> bool:
    """Whether ``module`` runs as a class :func:`settled_class` made."""
    cls = type(module)
    return type(cls) is Settled and _made_here(cls)


def own_class(module: Any) -> Any:
    """The class ``module`` was made as (without its :class:`Settled` one, if it has one)."""
    cls = type(module)
    return cls if type(cls) is not Settled else unsettled_class(cls)


#: what the forward that takes a module's other inputs binds itself
_WIDENED = frozenset({"self", "routed_", "own_"})


@functools.lru_cache(maxsize=256)  # one per class forward: inspect.signature costs 10 µs
def unpassed_inputs(own: Any, args_fn: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(optional, required)``: the inputs of the module's own forward ``own`` after those
    the argument map takes (``forward(self, x, residual=None)`` with a map of ``(module,
    x)``: ``residual``), those with a default (``*args`` and ``**kwargs`` among them),
    which a routed forward takes and hands to ``own`` (:func:`widened`), and those it
    cannot take: without a default, or all of them where a name clashes with one the
    routed forward binds. ``optional`` is ``("*",)`` where ``own`` gathers the map's
    inputs in ``*args`` (a routed forward then takes anything, and hands to ``own`` a call
    other than with the map's inputs alone, positionally). Both empty where the map takes
    whatever the forward is called with, or either signature cannot be read."""
    mapped = plain_parameters(args_fn)
    try:
        parameters = list(inspect.signature(own).parameters.values())[1:]
    except (TypeError, ValueError):
        return (), ()
    if mapped is None:
        return (), ()
    if any(p.kind is p.VAR_POSITIONAL for p in parameters[: len(mapped)]):
        # forward(self, *args, **kwargs): the map's inputs are among what it gathers
        return ("*",), ()
    if len(parameters) <= len(mapped):
        return (), ()
    passed, rest = parameters[: len(mapped)], parameters[len(mapped) :]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind not in positional for p in passed):
        return (), ()
    optional = tuple(
        p.name
        for p in rest
        if p.default is not p.empty
        or p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    )
    required = tuple(p.name for p in rest if p.name not in optional)
    if optional and any(p.name in _WIDENED for p in parameters):
        return (), tuple(p.name for p in rest)
    return optional, required


@functools.lru_cache(maxsize=256)  # one per class forward: inspect.signature costs 10 µs
def untaken_inputs(own: Any, args_fn: Any) -> tuple[str, ...]:
    """The inputs of the argument map ``args_fn`` beyond those the module's own forward
    ``own`` takes positionally (``forward(self, hidden_states)`` with a map of ``(module,
    hidden_states, top_k_index, top_k_weights)``: the last two): a call of the routed
    forward could never pass them. Empty where either signature cannot be read."""
    mapped = plain_parameters(args_fn)
    try:
        parameters = list(inspect.signature(own).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    if mapped is None or any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return ()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(mapped[sum(p.kind in positional for p in parameters) :])


@functools.lru_cache(maxsize=256)  # one per class forward
def _widener(own: Any, count: int) -> Callable[..., Callable[..., Any]]:
    """``make(routed_, own_, defaults)``: a forward with ``own``'s parameters that runs
    ``routed_`` on its first ``count`` inputs when the others are left at their defaults,
    else ``own_`` on them all."""
    parameters = list(inspect.signature(own).parameters.values())[1:]
    kind = inspect.Parameter
    if any(p.kind is kind.VAR_POSITIONAL for p in parameters[:count]):
        # The inputs are gathered by *args: routed when called with the map's inputs alone,
        # positionally, as the map takes them.
        source = (
            "def make(routed_, own_, defaults):\n"
            "    def forward(self, *args, **kwargs):\n"
            f"        if kwargs or len(args) != {count}:\n"
            "            return own_(self, *args, **kwargs)\n"
            "        return routed_(self, *args)\n"
            "    return forward\n"
        )
        return made(source, "routed forward of all the module's inputs")
    signature, call, given = [], [], []
    for i, p in enumerate(parameters):
        if p.kind is kind.VAR_POSITIONAL:
            signature.append(f"*{p.name}")
            call.append(f"*{p.name}")
        elif p.kind is kind.VAR_KEYWORD:
            signature.append(f"**{p.name}")
            call.append(f"**{p.name}")
        else:
            if p.kind is kind.KEYWORD_ONLY and not any(s.startswith("*") for s in signature):
                signature.append("*")
            default = "" if p.default is p.empty else f"=defaults[{i}]"
            signature.append(f"{p.name}{default}")
            call.append(f"{p.name}={p.name}" if p.kind is kind.KEYWORD_ONLY else p.name)
            if p.kind is kind.POSITIONAL_ONLY and (
                i + 1 == len(parameters) or parameters[i + 1].kind is not kind.POSITIONAL_ONLY
            ):
                signature.append("/")
        if i >= count:
            if p.kind in (kind.VAR_POSITIONAL, kind.VAR_KEYWORD):
                given.append(p.name)
            else:
                given.append(f"{p.name} is not defaults[{i}]")
    inputs = ", ".join(p.name for p in parameters[:count])
    source = (
        "def make(routed_, own_, defaults):\n"
        f"    def forward({', '.join(['self', *signature])}):\n"
        f"        if {' or '.join(given)}:\n"
        f"            return own_({', '.join(['self', *call])})\n"
        f"        return routed_({', '.join(['self', inputs]) if inputs else 'self'})\n"
        "    return forward\n"
    )
    return made(source, "routed forward of all the module's inputs")


def widened(routed: Any, own: Any, count: int) -> Any:
    """``routed`` (a forward taking a module's first ``count`` inputs) behind a forward
    with all of ``own``'s inputs (:func:`unpassed_inputs` found them optional): a call
    that passes any of the others (not left at its default) runs ``own``, which takes
    them. One call more than ``routed`` alone, for such modules only."""
    make = _widener(own, count)
    defaults = [p.default for p in list(inspect.signature(own).parameters.values())[1:]]
    return make(routed, own, defaults)

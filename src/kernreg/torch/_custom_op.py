"""Exposing an op object as a ``torch.library`` custom op: an opaque node in traced graphs.

An op object is traced through by ``torch.compile`` (the chosen implementation's
operations end up in the graph). Engines that want one opaque node instead, with
dispatch happening when the node runs, wrap it::

    rms = kernreg.torch.as_custom_op(kernreg_ops.ops.rmsnorm)      # torch.ops.kernreg.layernorm_rmsnorm

Saved programs: ``torch.export.save`` stores the node as ``torch.ops.kernreg.<name>``. In
a fresh process, importing :mod:`kernreg.torch` (before or after torch) makes the
``kernreg`` namespace define such an op again the first time it is looked up, so
``torch.export.load`` finds it: the name is the op id with dots as underscores, or one
passed to :func:`as_custom_op` earlier in this process. (Ops under another namespace or
another name are defined again by calling :func:`as_custom_op` before loading.)

Which implementation: the node does not bind one (the decision is made where the program
runs). While ``torch.export`` traces a call of the returned custom op, the decision for
the call's dtypes and device is recorded in the node's ``meta["custom"]["kernreg"]``
(``op``, ``implementation``, ``rule``), which ``torch.export.save``/``load`` keep.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._library.custom_ops import CustomOpDef
from torch._ops import _OpNamespace

from kernreg.dispatch import dispatcher
from kernreg.torch._inputs import input_spec
from kernreg.torch.calls import OUT_PARAMETER, takes_out

__all__ = ["InferenceOnlyError", "as_custom_op", "install_namespace"]


class InferenceOnlyError(ValueError):
    """A backward was asked of a custom op that mutates its inputs."""

    def __init__(self, op_id: str, mutates: tuple[str, ...]) -> None:
        self.op_id = op_id
        super().__init__(
            f"op '{op_id}' mutates {', '.join(mutates)} in place, so its custom op is "
            "inference-only; pass backward=False (or leave it unset), or wrap a "
            "functional form of the op"
        )


def _reference_backward(
    reference: Callable[..., Any],
) -> tuple[Callable[..., None], Callable[..., Any]]:
    """``(setup_context, backward)`` differentiating ``reference`` at the saved inputs."""

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        tensors = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        ctx.tensor_positions = tensors
        ctx.others = [None if i in tensors else x for i, x in enumerate(inputs)]
        ctx.save_for_backward(*(inputs[i] for i in tensors))

    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        # Under create_graph (a gradient penalty, a Hessian-vector product) torch runs the
        # backward with grad mode on: the reference is then differentiated at the saved
        # inputs themselves, so the gradients it returns are differentiable in turn.
        create_graph = torch.is_grad_enabled()
        inputs = list(ctx.others)
        wrt: list[tuple[int, torch.Tensor]] = []
        for i, saved in zip(ctx.tensor_positions, ctx.saved_tensors, strict=True):
            leaf = saved if create_graph and saved.requires_grad else saved.detach()
            if leaf.is_floating_point() or leaf.is_complex():
                if not leaf.requires_grad:
                    leaf.requires_grad_(True)
                wrt.append((i, leaf))
            inputs[i] = leaf
        with torch.enable_grad():
            out = reference(*inputs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        pairs = [
            (o, g)
            for o, g in zip(outs, grads, strict=False)
            if g is not None and isinstance(o, torch.Tensor) and o.requires_grad
        ]
        result: list[Any] = [None] * len(inputs)
        if pairs and wrt:
            computed = torch.autograd.grad(
                [o for o, _ in pairs],
                [leaf for _, leaf in wrt],
                [g for _, g in pairs],
                allow_unused=True,
                create_graph=create_graph,
            )
            for (i, _), g in zip(wrt, computed, strict=True):
                result[i] = g
        return tuple(result)

    return setup_context, backward


_lock = threading.RLock()


#: qualified names being defined right now (torch looks them up while defining them)
_defining: set[str] = set()
#: qualified name -> (the op id it runs, the custom op)
_defined: dict[str, tuple[str, Any]] = {}


def _reset_lock_in_child() -> None:
    # A child forked while another thread was defining a custom op would wait forever.
    global _lock
    _lock = threading.RLock()
    _defining.clear()


os.register_at_fork(after_in_child=_reset_lock_in_child)


def as_custom_op(
    op: Any,
    *,
    namespace: str = "kernreg",
    name: str | None = None,
    mutates_args: Sequence[str] | None = None,
    fake: Callable[..., Any] | None = None,
    backward: bool | None = None,
) -> Any:
    """Register ``op`` (an op object or op id) as ``torch.ops.<namespace>.<name>``.

    ``backward`` (default: whenever the op mutates nothing) registers a backward that
    differentiates the op's reference (pure torch) at the saved inputs, so the custom op
    trains. An op that mutates its inputs is inference-only: ``backward=True`` for it
    raises :class:`InferenceOnlyError` here, when the op is created.

    ``name`` defaults to the op id with dots as underscores. ``mutates_args`` defaults
    to the parameters the op's input generator declares as mutated. ``fake`` computes
    output metadata for tracing; it defaults to the op's reference, which is pure torch
    and so runs on fake tensors. The schema is inferred from the reference's type hints.
    Calling this again for the same op and name returns the custom op defined the first
    time; that name for another op raises ``ValueError``.
    """
    op_obj = _dispatcher_of(op) if isinstance(op, str) else op
    op_name = name or op_obj.op_id.replace(".", "_")
    qualname = f"{namespace}::{op_name}"
    with _lock:
        existing = _defined.get(qualname)
        if existing is not None:
            defined_for, custom = existing
            if defined_for != op_obj.op_id:
                raise ValueError(
                    f"torch.ops.{namespace}.{op_name} already runs op '{defined_for}'; "
                    f"give op '{op_obj.op_id}' another name="
                )
            return custom
        _defining.add(qualname)
        try:
            return _define(op_obj, qualname, mutates_args, fake, backward)
        finally:
            _defining.discard(qualname)


def _dispatcher_of(op_id: str) -> Any:
    """The op object for ``op_id``, dispatching on the parameters its input generator
    declares (``embedding.rotary``: ``q``, not the integer ``positions`` before it)."""
    from kernreg.registry import default_registry

    default_registry().ensure_plugins()  # plugins declare the generators
    declared = input_spec(op_id)
    dispatch_args = declared.dispatch_args if declared is not None else ()
    return dispatcher(op_id, dispatch_args=dispatch_args or None)


def _define(
    op_obj: Any,
    qualname: str,
    mutates_args: Sequence[str] | None,
    fake: Callable[..., Any] | None,
    backward: bool | None,
) -> Any:
    """Define the custom op (``_lock`` held)."""
    if mutates_args is None:
        declared = input_spec(op_obj.op_id)
        mutates_args = declared.mutates if declared is not None else ()
    if backward and mutates_args:
        raise InferenceOnlyError(op_obj.op_id, tuple(mutates_args))
    reference = op_obj.reference

    def run(*args: Any, **kwargs: Any) -> Any:
        return op_obj(*args, **kwargs)

    # The schema comes from the reference's signature and annotations. A custom op is a
    # functional node: an op's out= buffers (kernreg.torch.parity.takes_out) stay outside it.
    functools.update_wrapper(run, reference)
    signature = inspect.signature(reference)
    if takes_out(signature):
        kept = [p for p in signature.parameters.values() if p.name != OUT_PARAMETER]
        run.__signature__ = signature.replace(parameters=kept)  # type: ignore[attr-defined]
    custom = torch.library.custom_op(qualname, run, mutates_args=tuple(mutates_args))
    custom.register_fake(fake if fake is not None else reference)
    if not mutates_args and backward is not False:
        setup, grad = _reference_backward(reference)
        custom.register_autograd(grad, setup_context=setup)
    custom.__class__ = _RecordingCustomOp
    custom._kernreg_op = op_obj  # type: ignore[attr-defined]
    _defined[qualname] = (op_obj.op_id, custom)
    return custom


class _RecordingCustomOp(CustomOpDef):
    """A custom op that records, while ``torch.export`` traces it, the implementation
    kernreg decides for the call (in the node's ``meta["custom"]["kernreg"]``)."""

    _kernreg_op: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_exporting() or torch.compiler.is_dynamo_compiling():
            return super().__call__(*args, **kwargs)  # type: ignore[no-untyped-call]
        decision = self._kernreg_op.explain_call(*args, **kwargs)
        chosen = decision.chosen
        record = {
            "op": self._kernreg_op.op_id,
            "implementation": None if chosen is None else chosen.label,
            "rule": decision.rule,
        }
        from torch.fx import traceback as fx_traceback

        with fx_traceback.preserve_node_meta(), fx_traceback.annotate({"kernreg": record}):
            return super().__call__(*args, **kwargs)  # type: ignore[no-untyped-call]


def _op_named(namespace: str, name: str) -> str | None:
    """The op id a custom op name stands for: one defined under it in this process, else
    the registered op whose id with dots as underscores is ``name`` (if exactly one)."""
    with _lock:
        if f"{namespace}::{name}" in _defining:
            return None
        defined = _defined.get(f"{namespace}::{name}")
    if defined is not None:
        return defined[0]
    if namespace != "kernreg":
        return None
    from kernreg.registry import default_registry

    registry = default_registry()
    registry.ensure_plugins()
    matches = [op for op in registry.ops() if op.replace(".", "_") == name]
    return matches[0] if len(matches) == 1 else None


class _Namespace(_OpNamespace):
    """``torch.ops.kernreg``: defines a kernreg custom op again on its first lookup."""

    # torch names an op's packet by its namespace's module: keep torch's own.
    __module__ = _OpNamespace.__module__

    def __getattr__(self, op_name: str) -> Any:
        try:
            return super().__getattr__(op_name)
        except AttributeError:
            if op_name.startswith("_"):
                raise
            op_id = _op_named(self.name, op_name)
            if op_id is None:
                raise
        as_custom_op(op_id, namespace=self.name, name=op_name)
        return super().__getattr__(op_name)


def install_namespace() -> None:
    """Make ``torch.ops.kernreg`` define kernreg custom ops on demand (idempotent)."""
    current = torch.ops.__dict__.get("kernreg")
    if isinstance(current, _Namespace):
        return
    namespace = _Namespace("kernreg")
    if current is not None:
        namespace.__dict__.update(
            {k: v for k, v in current.__dict__.items() if k not in namespace.__dict__}
        )
    setattr(torch.ops, "kernreg", namespace)  # noqa: B010


install_namespace()

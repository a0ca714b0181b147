"""Verification of a swap before ``kernelize`` makes it: the layer's own forward (or the
original function) against the routed computation, on probe inputs built from the
layer's real parameters (and, where some are constant, as a new layer's are, again with
those perturbed), in the model's dtype and on its device.

The outcome is cached per (class or function, mapping, implementation, dtype, device,
parameter shapes, the instance's plain settings), so the cost grows with the distinct kinds of layer, not with depth.
In ``mode="training"`` the gradients (of the floating-point inputs and of the layer's
parameters, frozen ones too, under a fixed random output gradient) are compared too, on
one probe, and so are the second-order ones (unless the backward refuses them).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kernreg.spec import KernelSpec
from kernreg.torch._forward import own_class
from kernreg.torch.layers import LayerMapping
from kernreg.torch.parity import TOLERANCES, Diff, Tolerance, compare

__all__ = [
    "PROBE_LENGTHS",
    "Outcome",
    "autocast_off",
    "autocast_state",
    "verify_function",
    "verify_layer",
]

#: The sequence lengths every swap is verified on (one token, an odd length, a longer one).
PROBE_LENGTHS = (1, 7, 16)
_BATCH = 2


class Outcome:
    """What verifying one swap found: ``ok``, the largest error and, if not ok, why;
    ``trains_otherwise``: the layer's own forward computes otherwise in training mode
    (dropout), so the swap holds only while the module is in eval mode."""

    __slots__ = ("max_error", "ok", "problem", "trains_otherwise")

    def __init__(self, ok: bool, max_error: float, problem: str) -> None:
        self.ok = ok
        self.max_error = max_error
        self.problem = problem
        self.trains_otherwise = False


_cache: dict[tuple[Any, ...], Outcome] = {}

#: the device types torch.autocast serves
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla", "privateuseone")


def _autocasting(kind: str) -> bool:
    try:
        return torch.is_autocast_enabled(kind)
    except RuntimeError:  # a device type autocast does not know (meta)
        return False


def autocast_state(device: Any) -> tuple[Any, ...]:
    """What ``torch.autocast`` does on ``device``'s type now (``()``: nothing). Probes run
    under it, own forward and routed computation alike, so an outcome holds for that state
    only: a matmul's output is rounded to bfloat16 under it, which hides an
    implementation that computes float32 inputs in bfloat16."""
    kind = "cpu" if device is None else torch.device(device).type
    if not _autocasting(kind):
        return ()
    return (kind, torch.get_autocast_dtype(kind))


@contextmanager
def autocast_off() -> Iterator[None]:
    """``torch.autocast`` disabled on every device type where it is on: ``kernelize``
    verifies what the model's own dtype computes, as calls outside an autocast region do
    (a dtype first seen inside one is verified there, on its first call)."""
    with contextlib.ExitStack() as stack:
        for kind in _AUTOCAST_DEVICES:
            if _autocasting(kind):
                stack.enter_context(torch.autocast(kind, enabled=False))
        yield


def _cached(key: tuple[Any, ...], compute: Callable[[], Outcome]) -> Outcome:
    found = _cache.get(key)
    if found is not None:
        return found
    # No lock: setdefault is atomic, so two threads that computed alike keep the first
    # outcome (and a child forked meanwhile has nothing to wait for).
    return _cache.setdefault(key, compute())


def _shapes(module: torch.nn.Module) -> tuple[Any, ...]:
    # Dtypes too: a float32 weight under bfloat16 inputs (a norm kept in float32) computes
    # otherwise than the same layer all in bfloat16, and is verified as it is. A buffer of
    # one element is a setting (a norm's offset of 0 or 1): its value too.
    params = tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters())
    buffers = tuple(
        (name, tuple(b.shape), b.dtype, b.item() if b.numel() == 1 and not b.is_meta else None)
        for name, b in module.named_buffers()
    )
    return params + buffers


#: integer settings that number the layer, not what it computes: left out of the cache
#: key, or the cost of verifying would grow with depth
_LAYER_NUMBERS = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number"})


def _settings(module: torch.nn.Module) -> tuple[Any, ...]:
    """The instance's plain settings (strings, numbers, flags, ``None``) its forward may
    read: ConvNext's layer norms of one class and one weight shape normalise over the
    channels or over the last dimension as their ``data_format`` says, and a grouped
    RMSNorm over groups of its ``group_size``. A layer's number (``layer_idx``) is left
    out: it differs in every layer."""
    return tuple(
        (name, value)
        for name, value in vars(module).items()
        if not name.startswith("_")
        and name not in _LAYER_NUMBERS
        and isinstance(value, (str, int, float, type(None)))
    )


def _twin(
    module: torch.nn.Module,
    parameters: dict[str, torch.Tensor] | None = None,
    trainable: bool = False,
) -> torch.nn.Module:
    """A copy of ``module`` to probe: its submodules copied the same way, sharing their
    parameters (those named in ``parameters`` replaced) and holding copies of their
    buffers, each with its own ``training`` flag. The model's threads keep calling the
    module while it is verified (a new dtype's first call, another ``kernelize``), and a
    child forked meanwhile keeps it as it is: a probe sets nothing on it, neither a
    perturbed weight, nor a training flag, nor a buffer a forward in training mode updates
    (batch norm's running statistics). ``trainable``: the parameters replaced require
    gradients, frozen ones too."""
    twins: dict[int, torch.nn.Module] = {}

    def copy(original: torch.nn.Module, prefix: str) -> torch.nn.Module:
        found = twins.get(id(original))
        if found is not None:  # a submodule reached at two paths stays one
            return found
        twin = original.__new__(type(original))
        # Its own tables (parameters, buffers, submodules, hooks), filled below through
        # torch's own assignment: nothing set on the twin reaches the original's.
        twin.__dict__.update(
            {k: dict(v) if type(v) is dict else v for k, v in vars(original).items()}
        )
        twins[id(original)] = twin
        replaced = parameters or {}
        for name, p in original.named_parameters(recurse=False):
            if prefix + name in replaced:
                value = replaced[prefix + name]
                setattr(twin, name, torch.nn.Parameter(value, p.requires_grad or trainable))
        for name, b in original.named_buffers(recurse=False):
            setattr(twin, name, b.clone())
        for name, child in original.named_children():
            setattr(twin, name, copy(child, f"{prefix}{name}."))
        for name, value in vars(original).items():
            # a routed forward (or any method) set on the instance runs on the copy
            if isinstance(value, types.MethodType) and value.__self__ is original:
                twin.__dict__[name] = types.MethodType(value.__func__, twin)
        return twin

    return copy(module, "")


def _set_training(module: torch.nn.Module, training: bool) -> torch.nn.Module:
    """``module`` (a :func:`_twin`) with every submodule's ``training`` flag set: off for
    an inference swap; on for a training one, so a forward's dropout runs as it will in
    training (an implementation without it is rejected)."""
    for m in module.modules():
        m.training = training
    return module


def _seeded(device: torch.device) -> Callable[..., Any]:
    """``run(*args, **kwargs)`` with the device's random generator seeded alike for every
    run (two computations that draw dropout masks draw the same ones), its state restored
    after."""
    if device.type == "cuda":
        generator = torch.cuda.default_generators[device.index or torch.cuda.current_device()]
    else:
        generator = torch.default_generator

    def run(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        state = generator.get_state()
        generator.manual_seed(0)
        try:
            return function(*args, **kwargs)
        finally:
            generator.set_state(state)

    return run


def _hidden_size(module: torch.nn.Module) -> int | None:
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return int(weight.shape[0])
    for child in module.modules():
        if isinstance(child, torch.nn.Linear):
            return int(child.in_features)
    return None


def default_layer_probe(
    module: torch.nn.Module, seq_len: int, dtype: torch.dtype, device: torch.device
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """One hidden-states tensor ``[2, seq_len, hidden]``, or ``None`` when the hidden
    size cannot be read from the module."""
    hidden = _hidden_size(module)
    if hidden is None:
        return None
    generator = torch.Generator().manual_seed(seq_len)
    x = torch.randn(_BATCH, seq_len, hidden, generator=generator)
    return (x.to(device=device, dtype=dtype),), {}


def _verdict(expected: list[Any], actual: list[Any], dtype: torch.dtype, what: str) -> Outcome:
    diff = Diff()
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        compare(f"seq_len {PROBE_LENGTHS[i]}", a, e, TOLERANCES, diff)
    tolerance = TOLERANCES.get(str(dtype).removeprefix("torch."))
    if diff.problems and diff.max_abs > 0:
        return Outcome(
            False,
            diff.max_abs,
            f"verification failed: {what} differs from the layer's own computation by "
            f"up to {diff.max_abs:.3g} (tolerance {tolerance}): {diff.problems[0]}",
        )
    if diff.problems:  # a shape, dtype or structure that differs
        return Outcome(
            False,
            diff.max_abs,
            f"verification failed: {what} does not return what the layer's own computation "
            f"returns: {diff.problems[0]}",
        )
    return Outcome(True, diff.max_abs, "")


def _raised(what: str, exc: Exception) -> Outcome:
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    return Outcome(
        False,
        float("nan"),
        f"verification failed: running {what} on probe inputs raised "
        f"{type(exc).__name__}: {first_line}",
    )


def _on_meta(device: Any, module: torch.nn.Module | None = None) -> Outcome | None:
    """A failed outcome when there is no data to verify on: the module (or model) is on
    the meta device, as a model made under ``init_empty_weights`` is before it is loaded."""
    meta = device is not None and torch.device(device).type == "meta"
    if not meta and module is not None:
        meta = any(p.is_meta for p in module.parameters())
    if not meta:
        return None
    return Outcome(
        False,
        float("nan"),
        "verification failed: the parameters are on the meta device (no data to verify "
        "on): kernelize once the weights are loaded, or kernelize(verify=False) to vouch "
        "for the mapping",
    )


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of an output (a tensor, or tuples and lists of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _apart(function: Callable[[], Any]) -> Any:
    """``function()`` run in a thread of its own, under this thread's autocast regions: the
    saved-tensor hooks of this one do not see its autograd graph. A dtype first seen inside
    ``torch.utils.checkpoint`` is verified there, and the checkpoint's hooks, which count
    the tensors a forward saves to find them again when it is recomputed, would count the
    probes' too (a ``CheckpointError`` at backward)."""
    regions = [(kind, torch.get_autocast_dtype(kind)) for kind in _AUTOCAST_DEVICES]
    regions = [(kind, dtype) for kind, dtype in regions if _autocasting(kind)]
    found: dict[str, Any] = {}

    def run() -> None:
        try:
            with contextlib.ExitStack() as stack:
                for kind, dtype in regions:
                    stack.enter_context(torch.autocast(kind, dtype=dtype))
                found["result"] = function()
        except BaseException as exc:  # raised again in the calling thread
            found["error"] = exc

    thread = threading.Thread(target=run, name="kernreg-verify")
    thread.start()
    thread.join()
    if "error" in found:
        raise found["error"]
    return found["result"]


def _constant(parameter: torch.Tensor) -> bool:
    """Whether every element of a floating-point parameter is the same (how a freshly made
    layer's norm weights and biases start: ones, zeros)."""
    if not parameter.is_floating_point() or parameter.numel() == 0 or parameter.is_meta:
        return False
    # One reduction, no tensor of the parameter's size (an MoE layer's experts are GBs).
    low, high = torch.aminmax(parameter.detach())
    return bool(low == high)


def _perturbed(module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The module's constant parameters perturbed, by name, or ``None`` when none is
    constant. A mapping verified only on a layer's initial weights (a bias of zeros, a
    weight of ones) would pass whatever it does with them, and the weights loaded later
    would run it."""
    generator = torch.Generator().manual_seed(0)
    perturbed = {
        name: p.detach() + 0.5 * torch.randn(p.shape, generator=generator).to(p.device, p.dtype)
        for name, p in module.named_parameters()
        if _constant(p)
    }
    return perturbed or None


def _gradients(
    run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], params: list[Any]
) -> list[Any]:
    """The gradients of ``run(*args, **kwargs)`` (under a fixed random output gradient)
    with respect to the floating-point tensors of ``args``, then ``params``, then the
    second-order ones (those of a fixed random sum of the first, with respect to the same
    and the output gradient; :data:`_REFUSED` where differentiating the first raises),
    computed apart (:func:`_apart`)."""
    first, second = _apart(functools.partial(_gradients_here, run, args, kwargs, params))
    return [*first, *(second if second is not None else [_REFUSED] * (len(first) + 1))]


def _gradients_here(
    run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], params: list[Any]
) -> tuple[list[Any], list[Any] | None]:
    # Out of inference mode, on copies: a kernelize run under torch.inference_mode() made
    # its probes inference tensors, which autograd cannot save.
    with torch.inference_mode(False), torch.enable_grad():
        copies = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
        leaves = [
            a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in copies
        ]
        outputs = [t for t in _tensors(run(*leaves, **kwargs)) if t.requires_grad]
        generator = torch.Generator().manual_seed(0)
        # Requiring gradients, as a layer's output gradient does where layers with
        # weights follow it: a once_differentiable backward then marks its gradients.
        cotangents = [
            torch.randn(t.shape, generator=generator)
            .to(device=t.device, dtype=t.dtype)
            .requires_grad_()
            for t in outputs
        ]
        inputs = [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]
        inputs += params
        grads = torch.autograd.grad(
            outputs, inputs, cotangents, allow_unused=True, create_graph=True
        )
        first = [None if g is None else g.detach() for g in grads]
        # The second order too (a gradient penalty differentiates the gradients again): a
        # backward computed outside autograd would leave it out without a word. One that
        # raises when differentiated (once_differentiable) refuses it: nothing to compare.
        weights = [
            torch.randn(g.shape, generator=generator).to(device=g.device, dtype=g.dtype)
            for g in first
            if g is not None
        ]
        terms = [
            (g * w).sum()
            for g, w in zip([g for g in grads if g is not None], weights, strict=True)
            if g.requires_grad
        ]
        inputs += cotangents  # what a backward computed outside the graph loses too
        if _refuses_twice(grads):
            return first, None
        if not terms:
            return first, [None] * len(inputs)
        try:
            again = torch.autograd.grad(
                functools.reduce(operator.add, terms), inputs, allow_unused=True
            )
        except RuntimeError:
            return first, None
    return first, [None if g is None else g.detach() for g in again]


def _refuses_twice(grads: Any) -> bool:
    """Whether the graph of ``grads`` holds the node a ``once_differentiable`` backward
    adds (it raises when a backward reaches it; one asking for given inputs does not)."""
    seen: set[Any] = set()
    todo = [g.grad_fn for g in grads if g is not None and g.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "Error":
            return True
        todo.extend(next_node for next_node, _ in node.next_functions)
    return False


#: a second-order gradient the computation refuses (its backward raises when differentiated)
_REFUSED = object()


def _gradient_check(
    own: Callable[..., Any],
    routed: Callable[..., Any],
    built: tuple[tuple[Any, ...], dict[str, Any]],
    params: list[Any],
    dtype: torch.dtype,
    what: str,
) -> Outcome:
    """The gradients of ``routed`` against those of ``own`` on the probe ``built``, each
    within the dtype's tolerance normwise (``|a - e| <= atol * sqrt(n) + rtol * |e|``): a
    parameter's gradient sums over every token, and its rounding with them."""
    args, kwargs = built
    try:
        expected = _gradients(own, args, kwargs, params)
    except Exception:
        return Outcome(True, 0.0, "")  # the own computation has no gradient to compare
    try:
        actual = _gradients(routed, args, kwargs, params)
    except Exception as exc:
        return _raised(f"the gradients of {what}", exc)
    tolerance = TOLERANCES.get(str(dtype).removeprefix("torch."), Tolerance(0.0, 0.0))
    worst, problem = 0.0, ""
    half = len(params) + sum(
        isinstance(a, torch.Tensor) and a.is_floating_point() for a in args
    )  # first-order gradients, then second-order ones
    refused = any(g is _REFUSED for g in (*expected, *actual))
    for i, (e, a) in enumerate(zip(expected, actual, strict=False)):
        if (e is None and a is None) or (refused and i >= half):
            continue
        name = f"gradient {i}" if i < half else f"second-order gradient {i - half}"
        if i >= half and (e is None) != (a is None):  # one not reached: zero for it
            e, a = (
                (torch.zeros_like(a) if e is None else e),
                (torch.zeros_like(e) if a is None else a),
            )
        if e is None or a is None or a.shape != e.shape:
            problem = problem or f"{name}: expected {_described(e)}, got {_described(a)}"
            continue
        error = (a.double() - e.double()).norm().item()
        bound = tolerance.atol * e.numel() ** 0.5 + tolerance.rtol * e.double().norm().item()
        worst = max(worst, (a.double() - e.double()).abs().max().item())
        if not error <= bound:  # NaN fails too
            problem = problem or f"{name}: error norm {error:.3g} above {bound:.3g}"
    if problem:
        return Outcome(
            False,
            worst,
            f"verification failed: the gradients of {what} differ from the own computation's "
            f"by up to {worst:.3g} (tolerance {tolerance}, normwise): {problem}",
        )
    return Outcome(True, worst, "")


def _same(a: Any, b: Any) -> bool:
    """Whether two forward results are equal to the bit (tensors anywhere in them)."""
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(
        x.shape == y.shape and torch.allclose(x, y, rtol=0, atol=0, equal_nan=True)
        for x, y in zip(ta, tb, strict=True)
    )


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    return "no gradient"


def _checked(expected: list[Any], actual: list[Any], dtype: torch.dtype, what: str) -> Outcome:
    try:
        return _verdict(expected, actual, dtype, what)
    except Exception as exc:  # outputs that cannot be compared (no data, no such dtype)
        return _raised(f"a comparison of {what} with the layer's own computation", exc)


def verify_layer(
    module: torch.nn.Module,
    mapping: LayerMapping,
    spec: KernelSpec,
    impl: Callable[..., Any],
    hooks: tuple[Any, Any, Any, Any],
    dtype: torch.dtype,
    device: torch.device,
    gradients: bool = False,
) -> Outcome:
    """The module's class forward against ``output(module, impl(*args(module, *inputs)))``;
    ``gradients``: their gradients too (``mode="training"``)."""
    meta = _on_meta(device, module)
    if meta is not None:
        return meta
    # The implementation, the maps and the class's forward themselves, not only their
    # names: one replaced since (a module attribute, a patched class) is verified anew.
    cls = own_class(module)  # not the class it runs as while routed
    key = (
        cls,
        cls.forward,
        mapping,
        hooks,
        spec,
        impl,
        dtype,
        device,
        _shapes(module),
        _settings(module),
        gradients,
        autocast_state(device),
    )
    args_fn, output_fn, _, probe_fn = hooks

    def compute() -> Outcome:
        probe = probe_fn or default_layer_probe
        own = cls.forward
        what = f"{spec.op} ({spec.label})"
        expected: list[Any] = []
        actual: list[Any] = []
        seeded = _seeded(torch.device(device))
        layer = _set_training(_twin(module), gradients)
        try:
            with torch.no_grad():
                for seq_len in PROBE_LENGTHS:
                    built = probe(layer, seq_len, dtype, device)
                    if built is None:
                        return Outcome(
                            False,
                            float("nan"),
                            "verification failed: no probe inputs can be built for "
                            f"{cls.__name__} (give the mapping a probe=, or "
                            "kernelize(verify=False) to vouch for it)",
                        )
                    args, kwargs = built
                    try:
                        expected.append(seeded(own, layer, *args, **kwargs))
                    except Exception as exc:
                        return _raised("the layer's own forward", exc)
                    actual.append(seeded(routed, layer, *args, **kwargs))
                outcome = _checked(expected, actual, dtype, what)
                varied = _perturbed(module) if outcome.ok else None
                if varied is not None:
                    other = _set_training(_twin(module, varied), gradients)
                    # Its own lists: the checks below compare with the first pass's.
                    own_varied, routed_varied = [], []
                    for seq_len in PROBE_LENGTHS:
                        again = probe(other, seq_len, dtype, device)
                        assert again is not None  # it was for the first pass
                        own_varied.append(seeded(own, other, *again[0], **again[1]))
                        routed_varied.append(seeded(routed, other, *again[0], **again[1]))
                    outcome = _checked(
                        own_varied,
                        routed_varied,
                        dtype,
                        f"{what}, with the layer's constant parameters (weights as a new "
                        "layer starts with them) perturbed,",
                    )
                if outcome.ok and not gradients:
                    trained = seeded(own, _set_training(_twin(module), True), *args, **kwargs)
                    outcome.trains_otherwise = not _same(trained, expected[-1])
                if outcome.ok and gradients and built is not None:
                    # Every floating-point parameter's gradient, frozen ones too: a layer
                    # frozen now (requires_grad_(False)) may be unfrozen later, and the
                    # outcome holds for every layer of its kind.
                    with torch.inference_mode(False):
                        leaves = {
                            name: p.detach()
                            for name, p in module.named_parameters()
                            if p.is_floating_point()
                        }
                    trained = _set_training(_twin(module, leaves, trainable=True), True)
                    params = [p for p in trained.parameters() if p.requires_grad]
                    own_forward = functools.partial(seeded, own, trained)
                    routed_forward = functools.partial(seeded, routed, trained)
                    outcome = _gradient_check(
                        own_forward, routed_forward, built, params, dtype, what
                    )
        except Exception as exc:
            return _raised(what, exc)
        return outcome

    def routed(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        result = impl(*args_fn(layer, *args, **kwargs))
        if output_fn is not None:
            result = output_fn(layer, result, *args, **kwargs)
        return result

    return _cached(key, compute)


def verify_function(
    model: torch.nn.Module,
    name: str,
    original: Callable[..., Any],
    mapping: LayerMapping,
    spec: KernelSpec,
    impl: Callable[..., Any],
    hooks: tuple[Any, Any, Any, Any],
    dtype: torch.dtype,
    device: torch.device,
    gradients: bool = False,
) -> Outcome:
    """``original(*call)`` against the routed call, on the mapping's probe of ``model``;
    ``gradients``: their gradients too (``mode="training"``)."""
    args_fn, output_fn, _, probe_fn = hooks
    what = f"{spec.op} ({spec.label})"
    meta = _on_meta(device, model)
    if meta is not None:
        return meta
    if probe_fn is None:
        return Outcome(
            False,
            float("nan"),
            f"verification failed: the mapping of '{name}' has no probe to verify it on "
            "(give it a probe=, or kernelize(verify=False) to vouch for it)",
        )
    probes: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    try:
        with torch.no_grad():
            for seq_len in PROBE_LENGTHS:
                built = probe_fn(model, original, seq_len, dtype, device)
                if built is None:
                    return Outcome(
                        False,
                        float("nan"),
                        f"verification failed: the probe of '{name}' found nothing to "
                        "build inputs from in this model",
                    )
                probes.append(built)
    except Exception as exc:
        said = str(exc).splitlines()[0] if str(exc) else ""
        why = f"the probe of '{name}' raised {type(exc).__name__}: {said}"
        return Outcome(False, float("nan"), f"verification failed: {why}")
    signature = tuple(
        (tuple(t.shape), t.dtype) for args, _ in probes for t in args if isinstance(t, torch.Tensor)
    )
    key = (
        original,
        mapping,
        hooks,
        spec,
        impl,
        dtype,
        device,
        signature,
        gradients,
        autocast_state(device),
    )

    def routed(*args: Any, **kwargs: Any) -> Any:
        op_args = args if args_fn is None else args_fn(*args, **kwargs)
        op_kwargs = kwargs if args_fn is None else {}
        result = impl(*op_args, **op_kwargs)
        if output_fn is not None:
            result = output_fn(result, *args, **kwargs)
        return result

    def compute() -> Outcome:
        expected: list[Any] = []
        actual: list[Any] = []
        try:
            with torch.no_grad():
                for args, kwargs in probes:
                    try:
                        expected.append(original(*args, **kwargs))
                    except Exception as exc:
                        return _raised("the original function", exc)
                    actual.append(routed(*args, **kwargs))
                outcome = _checked(expected, actual, dtype, what)
                if outcome.ok and gradients:
                    outcome = _gradient_check(original, routed, probes[-1], [], dtype, what)
        except Exception as exc:
            return _raised(what, exc)
        return outcome

    return _cached(key, compute)

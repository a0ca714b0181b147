"""``kernelize(model)``: route every mapped layer of a model through its op, in one call.

>>> report = kernreg.torch.kernelize(model)        # doctest: +SKIP
>>> print(report)                                  # one row per mapped module  # doctest: +SKIP
>>> kernreg.torch.unkernelize(model)               # or report.undo()  # doctest: +SKIP

For each module whose class has layer mappings (:mod:`kernreg.torch.layers`: the exact
class's own, else the pattern mappings whose glob matches its name), kernreg tries the
mappings in op order: the first that applies, has an eligible implementation and passes
verification routes the module. Implementations are decided for the module's parameter
dtype and the device it is on (a mixed-GPU host decides per device index), under the
mode's required traits:

=============  ===========================================================
mode           only implementations with the trait
=============  ===========================================================
``inference``  (any)
``training``   ``backward`` (autograd differentiates them)
``compile``    ``compile_safe`` (traced by ``torch.compile(fullgraph=True)``)
=============  ===========================================================

**Verification** (``verify=True``, the default): before a swap is made, the module's own
forward and the routed computation run on probe inputs built from the module's real
parameters (sequence lengths 1, 7 and 16, in the model's dtype and on its device, autocast
off; a dtype first seen inside an autocast region is verified under it; where a parameter
is constant, as a new layer's ones and zeros are, again with it perturbed: a model
kernelized before its weights load) and must agree
within the parity tolerances (:data:`kernreg.torch.TOLERANCES`); in ``mode="training"``
so must their gradients (of the inputs and the module's parameters, frozen ones too,
normwise, on one probe, and the second-order ones unless the backward refuses them), the module in training mode with dropout masks drawn alike (a
forward that applies dropout is not swapped for an implementation without it; kernelized
for inference, such a layer is routed only while it is in eval mode, and a backward
through an implementation that declares no ``backward`` raises :class:`KernelizeError`,
except inside a ``torch.compile`` graph). A swap that
does not keeps the module on its own forward, its report row ``"rejected"`` with the
largest error and the implementation tried; ``strict=True`` raises
:class:`KernelizeVerificationError` instead. Outcomes are cached per (class, mapping,
implementation, dtype, device, parameter and buffer shapes, the values of one-element
buffers, the instance's plain settings such as ConvNext's ``data_format``): the cost grows with the kinds of layer,
not with depth. ``verify=False`` skips it: you vouch for your mappings. A module on the
meta device (a model made under ``init_empty_weights``, not loaded yet) has no data to
verify on: its row is ``"rejected"`` and says so (kernelize once the weights are loaded);
with ``verify=False`` it is ``"kept"``, as a decision made for the meta device would stay
with the model once its weights are loaded there.

A routed module's ``forward`` becomes ``output(module, impl(*args(module, *inputs)))``
(where the maps are plain one-``return`` functions, as the pack's are, their expressions
are compiled into the forward: no call of the maps per forward),
the implementation read from a per-site table keyed by the input's dtype (a new dtype is
decided, and verified, on its first call; one first seen while ``torch.compile`` traces,
where no probe can run, keeps the own forward in that graph and is verified and routed
on its next call outside a trace; a registry change or
:func:`kernreg.registry.process_state_changed` empties the tables). A module whose own
forward takes inputs the argument map does not pass (``forward(self, x, residual=None)``
mapped with ``args(module, x)``) is routed for the calls that leave them at their
defaults and runs its own forward for the others (its row names them); one with such an
input without a default keeps its own forward (its row ``"skipped"``). Decisions see the pins given
to ``kernelize`` and configuration, never a ``use_backend`` block open around a call (the
model runs what ``kernelize`` decided; kernelize again with ``pin=`` to change it). A
module whose only eligible implementation is the op's reference keeps its own forward
(the model is never made slower by kernelizing it), and so does one the decision fails
for, unless ``strict=True``, which raises instead. Parameters and buffers are untouched:
state-dict keys never change, and ``save_pretrained``/``from_pretrained`` round-trips.

A routed module runs its routed forward from its class: it is given a subclass of its
own class, named as it is (``isinstance`` holds; pickled, it is its own class again),
whose only attribute is that forward, shared by the modules of one kind whose tables hold
the same implementations; ``unkernelize`` gives the class back. torch.compile guards a
forward read from the class with the class, once per graph, where one set on the
instance costs guards of its own per module on every compiled call. While a table
changes (a registry change, a trace opened or closed, a new dtype first met while
torch.compile traces, another thread's kernelize) the module is routed through its
instance forward, the same computation, and settles in its class on the next call that
fills its table. Where something already set a forward on the instance
(accelerate's hooks keep the class forward as ``module._old_forward`` and call it), the
route goes beneath it: ``_old_forward`` is routed and the hook still runs. A hook set on
a routed module since (it keeps the routed forward as ``_old_forward``), or removed since
(it puts it back as ``forward``), is followed: ``kernelize`` again routes, and
``unkernelize`` restores, the attribute that holds the routed forward now, and the hook
keeps running its own forward. A module with any other instance-level ``forward`` keeps
it, and its row says why; so does one set over a routed forward since (a patch binding
its own forward to the module), which ``unkernelize`` leaves in place too.

**Function sites** (:func:`kernreg.torch.register_function`, e.g. the pack's rotary
``apply_rotary_pos_emb`` of transformers' modeling modules) are routed per model: each
module of *this* model whose class's ``forward`` calls the mapped function runs (from its
class, as a routed module does) a copy of the class's forward whose globals (a copy of
its module's, taken at kernelize time) name a dispatcher for this model and the device
the module is on (generated with the function's own parameters, it reads that device's
table by the dtype of the first argument). The modeling module and every
other model are untouched: a model that was not kernelized makes no kernreg call. The
report's row for the function is ``<module>:<function>``.

A routed module moved since (``model.to("cuda:1")``, ``.cpu()``: anything that runs
``Module._apply``, which kernelize sets on the instance and ``unkernelize`` removes)
follows its device: a module gets a table of its own there, decided on its next call; a
caller of routed functions runs the copy of its class's forward made for that device. A
module whose parameters change dtype since (``norm.float()`` in a bfloat16 model) gets a
table of its own too: each input dtype is verified again against the weights as they are.

Nothing is changed until every decision and verification has been made: a ``kernelize``
that raises leaves the model exactly as it was (still routed as before, if it was).

Pickling: ``torch.save(model)`` of a kernelized model works; the loaded model runs its
own forward (routing is process state, not model state): call ``kernelize`` on it again.
A ``copy.deepcopy`` of it is routed as it is (the copy shares its sites, and verifies a
new dtype on itself once the original is gone).

Pins per site: ``pin={"layernorm.rmsnorm@model.norm": "torch"}`` (or
``KERNREG_PIN=layernorm.rmsnorm@model.norm=torch``) pins the modules whose path matches
the glob after ``@`` (``fnmatch``), leaving other layers of that op alone; a key without
``@`` is a module-path glob for every op. A lock file (``KERNREG_LOCK``) brings the site
pins ``kernreg lock`` ran with; those of ``pin=`` come first, then ``KERNREG_PIN``'s. A
plan loaded since (``registry.use_plan``, :func:`kernreg.torch.distributed.share_plan`)
brings its site pins to the routed modules on their next call (a module ``kernelize`` left
on its own forward stays so: kernelize again). A pinned site runs the pinned implementation,
even the reference; a pin that cannot run raises. A pin that matches no op or no module
of the model warns (:class:`KernelizeWarning`), with the names it probably meant.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import functools
import gc
import inspect
import json
import operator
import os
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from fnmatch import fnmatchcase
from typing import Any, Literal

import torch

from kernreg._compile import run_while_tracing
from kernreg._frozen import Frozen
from kernreg._names import parse_label
from kernreg.dispatch import guarded, in_demoted_bucket
from kernreg.dtypes import dtype_name
from kernreg.errors import (
    BackendNotFoundError,
    KernelLoadError,
    KernregError,
    KernregWarning,
    OpNotFoundError,
    StrictFallbackError,
    did_you_mean,
)
from kernreg.inventory import user_stacklevel
from kernreg.pins import context_pins, parse_pins, pins_for
from kernreg.registry import KernelRegistry, chosen_or_raise, default_registry
from kernreg.selection import Decision
from kernreg.spec import KernelSpec
from kernreg.torch import _tags, layers
from kernreg.torch._forward import (
    RESERVED,
    Settled,
    is_settled,
    made,
    plain_parameters,
    retire,
    route_maker,
    settled_class,
    settled_forward,
    unpassed_inputs,
    unsettled_class,
    untaken_inputs,
    widened,
)
from kernreg.torch._verify import autocast_off, autocast_state, verify_function, verify_layer
from kernreg.torch.layers import (
    LayerMapping,
    LayerMappingLoadError,
    exact_mappings_in,
    layer_name,
    mappings_for,
)
from kernreg.tracing import (
    active_traces,
    count_decision,
    on_trace_change,
    record_call,
    record_decision,
)

__all__ = [
    "MODES",
    "KernelizeError",
    "KernelizeReport",
    "KernelizeRow",
    "KernelizeVerificationError",
    "KernelizeWarning",
    "UnmappedLayer",
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
#: the attribute a routed module carries: (site, attribute routed, its previous value, the
#: value set)
SITE_ATTRIBUTE = "_kernreg_site"
#: where accelerate's hooks keep the forward they call
_HOOKED_FORWARD = "_old_forward"
_CPU = torch.device("cpu")
#: why a dtype first seen while a fake-tensor trace (torch.export) runs keeps the own
#: forward in that trace
UNVERIFIED_WHILE_COMPILING = "not verified yet (first seen while compiling)"


class KernelizeError(KernregError, ValueError):
    """``kernelize`` was called with an invalid argument (mode, pin), or a model is used
    as its mode does not allow: a backward through an implementation kernelized for
    inference that declares no ``backward``."""


class _NoBackward(torch.autograd.Function):
    """The outputs of an implementation that declares no ``backward``, as they are, in a
    graph whose backward raises: its gradients were never verified, and one computed
    outside autograd would leave the layers before it without any (``grad`` ``None``,
    which optimizers skip)."""

    @staticmethod
    def forward(ctx: Any, message: str, count: int, *tensors: Any) -> Any:
        ctx.message = message
        return tuple(t.view_as(t) for t in tensors[:count])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise KernelizeError(ctx.message)


def _refusing_backward(
    impl: Callable[..., Any], chosen: KernelSpec | None, path: str, registry: KernelRegistry
) -> Callable[..., Any]:
    """``impl`` as it is where ``chosen`` declares ``backward``; else ``impl`` whose
    outputs, where an input requires gradients and autograd records, raise at backward.
    Under ``torch.no_grad()`` (inference) that costs one call and a grad-mode check.
    While torch.compile traces such a call, which cannot hold a backward that raises, the
    op's reference (``registry``'s) runs instead: autograd differentiates it, so a compiled
    model kernelized for inference and then trained gets its gradients."""
    if chosen is None or "backward" in chosen.traits:
        return impl
    op, label = chosen.op, chosen.label
    grad_enabled = torch.is_grad_enabled
    compiling = torch.compiler.is_compiling
    spec = registry.reference(op)
    try:
        reference = None if spec is None or spec is chosen else spec.load()
    except KernelLoadError:  # compiled, the kernel then runs, its backward not refused
        reference = None

    def run(*args: Any, **kwargs: Any) -> Any:
        if not grad_enabled():
            return impl(*args, **kwargs)
        if reference is not None and compiling() and _records(args):
            return reference(*args, **kwargs)
        return _refused(impl(*args, **kwargs), args, path, op, label)

    return run


def _records(args: tuple[Any, ...]) -> bool:
    """Whether autograd records a call with ``args``: one of them requires gradients."""
    return any(isinstance(arg, torch.Tensor) and arg.requires_grad for arg in args)


def _refused(result: Any, args: tuple[Any, ...], path: str, op: str, label: str) -> Any:
    """``result`` (of an implementation declaring no backward, run with autograd
    recording) in a graph whose backward raises, where an input requires gradients."""
    # Not while torch.compile traces: it traces a backward that raises as unsupported.
    if torch.compiler.is_compiling():
        return result
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if not inputs:
        return result
    message = (
        f"kernelize: '{path}' ran {op} ({label}), which declares no backward "
        "(the model was kernelized without mode='training'): its gradients are not "
        "computed or not verified; kernelize(model, mode='training') to train it"
    )
    refused: Callable[..., Any] = _NoBackward.apply
    if isinstance(result, torch.Tensor):
        return refused(message, 1, result, *inputs)[0]
    if isinstance(result, (tuple, list)) and all(isinstance(r, torch.Tensor) for r in result):
        return type(result)(refused(message, len(result), *result, *inputs))
    return result


class KernelizeVerificationError(KernregError, ValueError):
    """``strict=True``: a mapped module's swap failed verification (``path`` names it)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"Strict mode: module '{path}' cannot be routed: {reason}")


class KernelizeWarning(KernregWarning):
    """``kernelize`` left something out: a layer no mapping covers, a pin that matches
    nothing, a mapping whose class does not exist."""


class KernelizeRow(Frozen):
    """One mapped module: the op, the implementation chosen, the rule, and why."""

    __slots__ = ("path", "layer", "op", "implementation", "rule", "status", "reason")
    path: str
    layer: str
    op: str
    implementation: str | None
    rule: str
    #: "routed", "kept" (own forward), "rejected" (verification failed) or "skipped"
    #: (no mapping applies)
    status: str
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
        self._set("path", path)
        self._set("layer", layer)
        self._set("op", op)
        self._set("implementation", implementation)
        self._set("rule", rule)
        self._set("status", status)
        self._set("reason", reason)

    def describe(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


class UnmappedLayer(Frozen):
    """A layer kind of the model that no mapping covers: its class (or function), what
    makes it look like a known kind (a transformers tag, its name, a mapped class it
    subclasses), where it is, and why it is listed."""

    __slots__ = ("layer", "kind", "paths", "reason")
    layer: str
    kind: str
    paths: tuple[str, ...]
    reason: str

    def __init__(self, layer: str, kind: str, paths: tuple[str, ...], reason: str = "") -> None:
        self._set("layer", layer)
        self._set("kind", kind)
        self._set("paths", paths)
        self._set("reason", reason or f"looks like a {kind} layer but no mapping covers it")

    def describe(self) -> dict[str, object]:
        return {
            "layer": self.layer,
            "kind": self.kind,
            "paths": list(self.paths),
            "reason": self.reason,
        }


class KernelizeReport:
    """What :func:`kernelize` did, one row per mapped module path (printable, JSON-ready);
    :attr:`unmapped` lists what no mapping covers, :attr:`unresolved` the mappings whose
    class or function does not exist in a module the model uses."""

    def __init__(
        self,
        model: Any,
        mode: str,
        rows: list[KernelizeRow],
        unmapped: list[UnmappedLayer] | None = None,
        unresolved: list[str] | None = None,
    ) -> None:
        self.model = model
        self.mode = mode
        self.rows = tuple(rows)
        self.unmapped = tuple(unmapped or ())
        self.unresolved = tuple(unresolved or ())

    @property
    def routed(self) -> tuple[str, ...]:
        """Paths of the modules now running through their op."""
        return tuple(r.path for r in self.rows if r.status == "routed")

    @property
    def kept(self) -> tuple[str, ...]:
        """Paths of mapped modules that keep their own forward."""
        return tuple(r.path for r in self.rows if r.status != "routed")

    @property
    def rejected(self) -> tuple[str, ...]:
        """Paths of mapped modules whose swap failed verification."""
        return tuple(r.path for r in self.rows if r.status == "rejected")

    def row(self, path: str) -> KernelizeRow:
        for r in self.rows:
            if r.path == path:
                return r
        raise KeyError(f"no mapped module at path {path!r}")

    def summary(self) -> dict[tuple[str, str], int]:
        """``(op, implementation) -> number of routed sites``."""
        counts: dict[tuple[str, str], int] = {}
        for r in self.rows:
            if r.status == "routed" and r.implementation is not None:
                counts[(r.op, r.implementation)] = counts.get((r.op, r.implementation), 0) + 1
        return dict(sorted(counts.items()))

    def undo(self) -> int:
        """Restore every module's own forward (same as :func:`unkernelize`)."""
        return unkernelize(self.model)

    def to_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "modules": [r.describe() for r in self.rows],
            "unmapped": [u.describe() for u in self.unmapped],
            "unresolved": list(self.unresolved),
            "summary": [
                {"op": op, "implementation": impl, "count": n}
                for (op, impl), n in self.summary().items()
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __iter__(self) -> Iterator[KernelizeRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        header = ("module", "op", "implementation", "status", "rule", "reason")
        table = [header] + [
            (r.path or "<root>", r.op, r.implementation or "-", r.status, r.rule, r.reason)
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in table) for i in range(5)]
        lines = [
            "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:5])) + "  " + row[5]
            for row in table
        ]
        lines.extend(
            f"unmapped: {u.layer} ({u.kind}) at {len(u.paths)} site(s), "
            f"e.g. {u.paths[0] or '<root>'}: {u.reason}"
            for u in self.unmapped
        )
        lines.extend(f"unresolved mapping: {name}" for name in self.unresolved)
        routed = len(self.routed)
        lines.append(f"{routed} of {len(self.rows)} mapped modules routed (mode {self.mode})")
        summary = self.summary()
        if summary:
            op_width = max(len("op"), *(len(op) for op, _ in summary))
            impl_width = max(len("implementation"), *(len(impl) for _, impl in summary))
            lines.append(f"{'op'.ljust(op_width)}  {'implementation'.ljust(impl_width)}  count")
            for (op, impl), count in summary.items():
                lines.append(f"{op.ljust(op_width)}  {impl.ljust(impl_width)}  {count}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<KernelizeReport mode={self.mode} routed={len(self.routed)}/{len(self.rows)}>"


Hooks = tuple[Any, Any, Any, Any]


def _decide_in_fresh_context(registry: KernelRegistry, op: str, **kwargs: Any) -> Decision:
    # A new Context holds every context variable at its default: a use_backend block open
    # around the call that first sees a dtype must not become this model's routing.
    decision: Decision = contextvars.Context().run(registry.explain, op, **kwargs)
    return decision


class _Site:
    """The binding of one module path: a per-dtype table of implementations (``None``:
    the module's own forward runs for that dtype)."""

    def __init__(
        self,
        path: str,
        mapping: LayerMapping,
        registry: KernelRegistry,
        traits: tuple[str, ...],
        strict: bool,
        pin: tuple[str, str | None] | None,
        hooks: Hooks,
        verify: bool,
        owner: Any,
        *,
        code_pins: tuple[Pin, ...] = (),
        aliases: tuple[str, ...] = (),
    ) -> None:
        self.path = path
        self.mapping = mapping
        self.registry = registry
        self.traits = traits
        self.strict = strict
        #: the site pin it was last decided with; made again from ``code_pins`` (the
        #: kernelize call's ``pin=``), configuration and the plan followed, on each decision
        self.pin = pin
        self.code_pins = code_pins
        #: the other paths of the module (one shared at several): a pin naming any applies
        self.aliases = aliases
        self.hooks = hooks
        self.verify = verify
        #: the routed module (the model, for a function site) and its deep copies, which
        #: share this site, held weakly
        self.owners = [weakref.ref(owner)]
        self.table: dict[Any, Callable[..., Any] | None] = {}
        self.device: Any = None
        #: the dtype of the module's (first) parameter its table was filled for: a module
        #: whose weights change dtype since gets a new table (:func:`_follow_device`)
        self.weights: Any = None
        self.lock = threading.Lock()
        #: the routed forward made for the module (a function of it), and the class's
        #: forward it falls back to
        self.forward: Any = None
        self.own: Any = None
        #: the class of the modules it routes (what they settle from: :meth:`settle`)
        self.kind: type | None = None
        #: the module's own forward computes otherwise in training mode (dropout): the
        #: routed forward runs the own one while ``module.training`` is set
        self.trains_otherwise = False
        #: the routed forward can run from the module's class (:meth:`settle`)
        self.settles = False
        #: the classes its modules ran as, so a state left and met again (a trace opened
        #: and closed, a registry changed and back) is the same class: a graph
        #: torch.compile made for it still holds (bounded: :meth:`settle_owners`)
        self.classes: list[Any] = []
        #: (implementation, dtype, device) -> why verification failed ("" when it passed),
        #: so a table emptied by a trace or a registry change is refilled while
        #: torch.compile traces (nothing can be verified for real then)
        self.verified: dict[tuple[Any, ...], str] = {}
        #: the failed verifications said in a warning (once each)
        self.warned: set[tuple[Any, ...]] = set()
        #: the sites made with it, subscribed as one (:class:`_Sites`)
        self.group: _Sites | None = None
        #: the model whose kernelize made it (a layer site), held weakly
        self.routed_in: weakref.ref[Any] | None = None
        #: counts the emptyings of the table: what a call decided from the state before one
        #: (a registry change, a trace opened or closed meanwhile) is not stored
        self.epoch = 0

    def owner(self) -> Any:
        """The routed module (the model, for a function site), else a live deep copy of it
        (what new dtypes are verified on); ``None`` when all are gone."""
        for ref in self.owners:
            found = ref()
            if found is not None:
                return found
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> _Site:
        # A copied model shares the binding of its sites (same paths, same decisions). The
        # copy (made before its state is copied: in the memo now) is an owner too, so it
        # still verifies new dtypes once the original is gone.
        owners = [ref for ref in self.owners if ref() is not None]
        copies = [memo.get(id(ref())) for ref in owners]
        self.owners = owners + [weakref.ref(c) for c in copies if c is not None]
        _remember_copies(memo)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # Routing is process state: a pickled model loads with its own forward.
        return (_detached, ())

    # Called by the registry (its lock held) on every mutation.
    def invalidate(self) -> None:
        """Empty the table, and drop what :meth:`miss_name` bound: a graph torch.compile
        traced through a miss reads the implementation from this site's attribute and
        guards on it, so it is traced again (deciding again) instead of running what was
        decided before the change."""
        self.empty()
        for name in [n for n in vars(self) if n.startswith("impl_")]:
            vars(self).pop(name, None)
        # What its modules ran from their classes was decided before the change: no call
        # of those forwards, held anywhere, runs it again.
        with self.lock:
            for cls in self.classes:
                retire(cls.forward)
            self.classes.clear()

    def empty(self) -> None:
        """Empty the table: each dtype is bound again on its next call (by a trace opened
        or closed: with or without recording)."""
        with self.lock:
            self.epoch += 1
            self.table.clear()
            for owner in self.routed_owners():
                _unsettle(owner)

    def routed_owners(self) -> list[Any]:
        """The live modules this site routes now (a deep copy's too)."""
        found = (ref() for ref in self.owners)
        return [m for m in found if m is not None and _site_of(m) is self]

    def settle(self) -> None:
        """Have the modules routed through their instance forward run it from their class
        instead (:func:`_settle`), made for the table as it is now (its lock held). Not
        while a trace is open: what the table holds then records each call, and the next
        trace would make new ones."""
        if not self.settles or _planning.get() or active_traces():
            return
        if torch.compiler.is_compiling():
            # A miss torch.compile traced: the graph is made for the instance forward,
            # which its guards read once it is traced (the next kernelize settles it).
            return
        # Not while another thread changes a model's routing (kernelize, unkernelize, a
        # module moved): it reads the instance forwards. The module stays routed through
        # its own until it settles again (its next kernelize, or a table change).
        if not _kernelize_lock.acquire(blocking=False):
            return
        try:
            self.settle_owners()
        finally:
            _kernelize_lock.release()

    def settle_owners(self) -> None:
        """What :meth:`settle` does once it may (its lock and the kernelize lock held)."""
        args_fn, output_fn = self.hooks[0], self.hooks[1]
        forward = settled_forward(
            self.own, args_fn, output_fn, self.trains_otherwise, self.table, _settled_miss
        )
        for owner in self.routed_owners():
            cls = _settle(owner, forward, self.kind)
            if cls is not None and cls not in self.classes:
                if len(self.classes) >= 16:
                    del self.classes[0]
                self.classes.append(cls)

    def decide(self, dtype: Any, device: Any) -> Decision:
        # A plan loaded since (use_plan, share_plan) brings the site pins it was made with,
        # as it would to a kernelize made after it; its fingerprint says they are followed.
        pins = [*self.code_pins, *_config_site_pins(self.registry)]
        self.pin = _resolve_pin(pins, self.mapping.op, (self.path, *self.aliases))
        backend, variant = self.pin if self.pin is not None else (None, None)
        platform = self.registry.platform
        if device is not None:
            platform = platform.for_device(torch.device(device))
        return _decide_in_fresh_context(
            self.registry,
            self.mapping.op,
            backend=backend,
            variant=variant,
            platform=platform,
            dtypes=None if dtype is None else (dtype_name(dtype),),
            traits=self.traits,
            strict=True if self.strict else None,
        )

    def check(self, spec: KernelSpec, impl: Callable[..., Any], dtype: Any, device: Any) -> str:
        """Why the swap to ``impl`` fails verification (empty when it passes)."""
        where = None if device is None else torch.device(device)
        key = (spec, impl, dtype, where, self.weights, autocast_state(device))
        if torch.compiler.is_compiling():
            # Decided while torch.compile traces (a new dtype, a registry changed since the
            # model was compiled): dynamo runs this for real, so the probes run for real
            # too, and the graph is traced with what they found. Under a fake-tensor
            # trace (torch.export) they cannot: an outcome found before counts, else the
            # own forward runs (unverified) and the next eager call verifies.
            found = self.verified.get(key)
            if found is not None:
                return found
            if type(torch.empty(0)) is not torch.Tensor:
                return UNVERIFIED_WHILE_COMPILING
        problem = self._verify(spec, impl, dtype, device)
        self.verified[key] = problem
        return problem

    def _verify(self, spec: KernelSpec, impl: Callable[..., Any], dtype: Any, device: Any) -> str:
        owner = self.owner()
        if owner is None:
            return "the module is gone"
        gradients = "backward" in self.traits  # mode="training"
        outcome = verify_layer(
            owner, self.mapping, spec, impl, self.hooks, dtype, device, gradients
        )
        if outcome.trains_otherwise:
            if self.forward is not None and not self.trains_otherwise:
                # Found on a later dtype, after the forward was made without the check.
                return (
                    f"verification failed: {type(owner).__name__}'s own forward computes "
                    "otherwise in training mode (dropout), and this route was made without "
                    "the training-mode check (kernelize again to route it with one)"
                )
            self.trains_otherwise = True
        return outcome.problem

    def bind(self, dtype: Any, device: Any) -> Callable[..., Any] | None:
        """The implementation for inputs of ``dtype`` on ``device`` (``None``: the own
        forward runs), stored in the table; while a trace is open, wrapped to record each
        call with this site."""
        # A registry change (or a trace opened or closed) while this call decides and
        # verifies, which takes milliseconds, empties the table: what was decided from the
        # state before it is not stored but decided again, so no call after the change runs
        # an implementation it removed.
        for _ in range(3):
            epoch = self.epoch
            impl = self._bind(dtype, device, epoch)
            if self.epoch == epoch:
                break
        return impl

    def _bind(self, dtype: Any, device: Any, epoch: int) -> Callable[..., Any] | None:
        try:
            decision = self.decide(dtype, device)
        except (OpNotFoundError, BackendNotFoundError) as exc:  # gone since kernelize
            if self.strict or self.pin is not None:
                raise
            what = "forward" if self.mapping.kind == "layer" else "function"
            why = f"kernelize: '{self.path}' runs its own {what} again: {exc}"
            warnings.warn(why, KernelizeWarning, stacklevel=user_stacklevel())
            return self.store(dtype, device, None, ready=True, epoch=epoch)
        impl: Callable[..., Any] | None = None
        what = "forward" if self.mapping.kind == "layer" else "function"
        if decision.ok and decision.chosen is not None:
            chosen = decision.chosen
            if decision.rule == "reference" and self.pin is None and self.strict:
                # As kernelize(strict=True) would say of this state.
                raise StrictFallbackError(
                    decision,
                    f"Strict mode: '{self.path}' ({self.mapping.layer}) would run its own "
                    f"{what}: only the reference of op '{self.mapping.op}' is eligible "
                    f"for {dtype_name(dtype)}",
                )
            if decision.rule != "reference" or self.pin is not None:
                impl = chosen.load()
                tracing = torch.compiler.is_compiling()
                problem = self.verify and self.check(chosen, impl, dtype, device)
                if problem == UNVERIFIED_WHILE_COMPILING:
                    # The trace runs the own forward; kept out of the table, so the next
                    # call outside a trace verifies for real and routes.
                    return None
                if problem:
                    # Decided on a new dtype, or again after a registry change: said as
                    # kernelize says it in a report row.
                    reason = f"{problem}; implementation tried: {chosen.label}; own {what} kept"
                    if self.strict:
                        raise KernelizeVerificationError(self.path, reason)
                    if (chosen, impl, dtype, device) not in self.warned:  # once, not per trace
                        self.warned.add((chosen, impl, dtype, device))
                        warnings.warn(
                            f"kernelize: '{self.path}' runs its own {what} for "
                            f"{dtype_name(dtype)}: {reason}",
                            KernelizeWarning,
                            stacklevel=user_stacklevel(),
                        )
                    impl = None  # failed: the own forward runs
                elif active_traces():
                    impl = self._traced(impl, chosen.label, decision.rule)
                    if tracing:
                        record_decision(
                            self.mapping.op,
                            chosen.label,
                            decision.rule,
                            decision.dtypes or (),
                            self.path,
                        )
        elif self.strict:
            chosen_or_raise(decision)
        return self.store(dtype, device, impl, decision, epoch=epoch)

    def store(
        self,
        dtype: Any,
        device: Any,
        impl: Callable[..., Any] | None,
        decision: Decision | None = None,
        ready: bool = False,
        epoch: int | None = None,
    ) -> Callable[..., Any] | None:
        """Make ``impl`` what calls with inputs of ``dtype`` run (returned, guarded);
        ``decision``: the one that chose it, where the caller has it; ``ready``: ``impl``
        is guarded already and its decision counted; ``epoch``: the table's when the
        decision began (not stored if it was emptied since)."""
        if not ready:
            impl = self.guard(dtype, device, impl, decision)
        with self.lock:
            if epoch is None or epoch == self.epoch:
                self.table[dtype] = impl
                self.device = device
                self.settle()
        return impl

    def guard(
        self,
        dtype: Any,
        device: Any,
        impl: Callable[..., Any] | None,
        decision: Decision | None = None,
        count: bool = True,
    ) -> Callable[..., Any] | None:
        """``impl`` under the demotion policy (:func:`kernreg.dispatch.guarded`), its
        decision counted (``kernreg.stats()``) unless ``count`` is false."""
        if decision is None:
            decision = self.decide(dtype, device)
        if count:
            count_decision(decision)
        strict = True if self.strict else None
        instead = self._traced_instead(decision) if impl and active_traces() else None
        routed = impl and guarded(
            decision,
            impl,
            registry=self.registry,
            traits=self.traits,
            strict=strict,
            instead=instead,
        )
        return routed and _refusing_backward(routed, decision.chosen, self.path, self.registry)

    def _traced_instead(self, decision: Decision) -> Callable[[str], Callable[..., Any]]:
        """What answers the calls in a shape bucket the chosen implementation is demoted
        in (decided again without it, as :func:`kernreg.dispatch.guarded` does), recorded
        with this site while a trace is open."""
        registry, traits = self.registry, self.traits
        strict = True if self.strict else None

        def instead(where: str) -> Callable[..., Any]:
            run, again = in_demoted_bucket(decision, where, registry, traits, strict)
            assert again.chosen is not None  # in_demoted_bucket raises otherwise
            return self._traced(run, again.chosen.label, again.rule)

        return instead

    def _traced(self, impl: Callable[..., Any], label: str, rule: str) -> Callable[..., Any]:
        op, path = self.mapping.op, self.path

        def traced(*args: Any, **kwargs: Any) -> Any:
            if not torch.compiler.is_compiling():  # a compiled graph records its decision
                record_call(op, label, rule, args[:1], site=path)
            return impl(*args, **kwargs)

        return traced

    def route(self, own: Any, kind: type) -> Any:
        """Make and keep the routed forward (a function of the module) over ``own``, the
        forward of its class ``kind`` it falls back to."""
        args_fn, output_fn = self.hooks[0], self.hooks[1]
        assert args_fn is not None
        self.own = own
        self.kind = kind
        make, passed = route_maker(own, args_fn, output_fn, self.trains_otherwise)
        self.forward = make(args_fn, output_fn, self.table, self, own)
        self.settles = passed is None
        if passed is not None:  # inputs the map does not pass: own runs them
            self.forward = widened(self.forward, own, passed)
        return self.forward

    def moved_to(self, module: Any, device: Any, weights: Any) -> _Site:
        """A site like this one for ``module``, now on ``device`` with parameters of dtype
        ``weights``: an empty table, decided there on each dtype's first call (the
        verification outcomes found so far are kept)."""
        site = _Site(
            self.path,
            self.mapping,
            self.registry,
            self.traits,
            self.strict,
            self.pin,
            self.hooks,
            self.verify,
            module,
            code_pins=self.code_pins,
            aliases=self.aliases,
        )
        site.verified, site.warned = self.verified, self.warned
        site.trains_otherwise = self.trains_otherwise
        site.device = device
        site.weights = weights
        assert self.kind is not None  # routed
        site.route(self.own, self.kind)
        _subscribe([site], self.registry)
        return site

    @run_while_tracing
    def miss_name(self, x: Any) -> str:
        """Decide for an input dtype missing from the table; returns the attribute of this
        site holding the implementation (torch.compile runs this for real, a constant)."""
        impl = self.bind(x.dtype, x.device)
        name = f"impl_{id(impl):x}"
        setattr(self, name, impl)
        return name


class _FunctionSite(_Site):
    """The binding of a routed module-level function: one table per device (the callers on
    a device see a dispatcher reading that device's table), each keyed by dtype."""

    def __init__(self, *args: Any, original: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.original = original
        #: device -> dtype -> implementation (``None``: the original runs)
        self.tables: dict[Any, dict[Any, Callable[..., Any] | None]] = {}
        #: device -> what this model's callers on that device see in place of the original
        self.dispatchers: dict[Any, Callable[..., Any]] = {}
        #: (class, device) -> (the class's forward, the sites it routes by the global name
        #: of their function, the copy of it that this model's modules of the class on that
        #: device run, held weakly: the modules running it hold it, and its routed
        #: namespace leaves sys.modules when the last of them lets it go)
        self.copies: dict[tuple[type, Any], tuple[Any, dict[str, _FunctionSite], Any]] = {}

    def empty(self) -> None:
        with self.lock:
            self.epoch += 1
            for table in self.tables.values():
                table.clear()

    def store(
        self,
        dtype: Any,
        device: Any,
        impl: Callable[..., Any] | None,
        decision: Decision | None = None,
        ready: bool = False,
        epoch: int | None = None,
    ) -> Callable[..., Any] | None:
        where = _CPU if device is None else torch.device(device)  # a model without tensors
        if not ready:
            impl = self.guard(dtype, device, impl, decision)
        with self.lock:
            if epoch is None or epoch == self.epoch:
                self.tables.setdefault(where, {})[dtype] = impl
        return impl

    def dispatcher_for(self, device: Any) -> Callable[..., Any]:
        """The function this model's callers on ``device`` call in place of the original."""
        device = torch.device(device)
        dispatcher = self.dispatchers.get(device)
        if dispatcher is None:
            with self.lock:
                table = self.tables.setdefault(device, {})
            args_fn, output_fn = self.hooks[0], self.hooks[1]
            dispatcher = _dispatching_function(self, self.original, args_fn, output_fn, table)
            self.dispatchers[device] = dispatcher
        return dispatcher

    def copy_for(
        self, cls: type[torch.nn.Module], device: Any, routed: dict[str, _FunctionSite]
    ) -> Any:
        """The copy of ``cls.forward`` that this model's modules of ``cls`` on ``device``
        run: its globals name the dispatchers of ``routed`` for that device (``None``: a
        decorator hides the function to copy)."""
        overrides = {name: site.dispatcher_for(device) for name, site in routed.items()}
        forward = _with_globals(cls.forward, overrides)
        if forward is not None:
            inner = forward
            while hasattr(inner, "__wrapped__"):  # no cycle here: inspect.unwrap costs 1 µs
                inner = inner.__wrapped__
            weakref.finalize(forward, sys.modules.pop, inner.__globals__["__name__"], None)
            self.copies[(cls, device)] = (cls.forward, routed, weakref.ref(forward))
        return forward

    def copy_made(self, cls: type[torch.nn.Module], device: Any) -> Any:
        """The copy of ``cls.forward`` for ``device`` made before, if modules still run it
        and the class's forward is still the one it was made from (else ``None``)."""
        made = self.copies.get((cls, device))
        if made is None or made[0] is not cls.forward:
            return None
        return made[2]()

    def _verify(self, spec: KernelSpec, impl: Callable[..., Any], dtype: Any, device: Any) -> str:
        # Bound again by a later kernelize of the same model: the probes (built from the
        # model's rotary module, the costly part) would be the same as when it passed.
        where = None if device is None else torch.device(device)
        key = (spec, impl, dtype, where, self.weights, autocast_state(device))
        if self.verified.get(key) == "":
            return ""
        model = self.owner()
        if model is None:
            return "the model is gone"
        outcome = verify_function(
            model,
            self.path,
            self.original,
            self.mapping,
            spec,
            impl,
            self.hooks,
            dtype,
            device,
            "backward" in self.traits,  # mode="training": the gradients too
        )
        return outcome.problem


def _detached() -> None:
    """What an unpickled routed module holds in place of its site: nothing."""
    return None


class _Sites:
    """The sites one ``kernelize`` call made, subscribed to the registry (and to traces)
    as one: a subscription per site costs about 1 µs of a model's first routing. Each site
    holds its group; the group holds its sites weakly."""

    __slots__ = ("__weakref__", "sites")

    def __init__(self, sites: list[_Site]) -> None:
        self.sites = [weakref.ref(site) for site in sites]
        for site in sites:
            site.group = self

    def __iter__(self) -> Iterator[_Site]:
        return (site for site in (ref() for ref in self.sites) if site is not None)

    def invalidate(self) -> None:
        for site in self:
            site.invalidate()

    def empty(self) -> None:
        for site in self:
            site.empty()


#: Every live site's group, so opening or closing a trace rebinds them (with or without
#: recording).
_sites: weakref.WeakSet[_Sites] = weakref.WeakSet()


def _subscribe(sites: list[_Site], registry: KernelRegistry) -> None:
    """Have ``sites`` emptied by every change of ``registry`` and of the open traces."""
    group = _Sites(sites)
    registry.subscribe(group)
    _sites.add(group)


def _clear_all_sites() -> None:
    # Emptied, not invalidated: a compiled graph keeps what it runs (traced again at every
    # trace opened, graphs would reach torch.compile's recompile limit).
    for group in list(_sites):
        group.empty()


on_trace_change(_clear_all_sites)


def _dispatching_function(
    site: _FunctionSite,
    original: Callable[..., Any],
    args_fn: Callable[..., Any] | None,
    output_fn: Callable[..., Any] | None,
    table: dict[Any, Callable[..., Any] | None],
) -> Callable[..., Any]:
    """The function a model's routed callers on one device see in place of ``original``:
    decides per dtype of the op's first argument, then runs the chosen implementation.

    Generated with ``original``'s own parameters when they are plain positional ones
    (transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``): no
    ``*args``/``**kwargs`` forwarding, which costs about 250 ns of the 1 µs a decoder layer
    may add; otherwise it forwards whatever it is called with.
    """
    make = _dispatcher_maker(original, args_fn is None, output_fn is None)
    defaults = original.__defaults__ or ()
    dispatch: Callable[..., Any] = make(args_fn, output_fn, table, site, original, defaults)
    dispatch.__name__ = original.__name__
    dispatch.__qualname__ = original.__qualname__
    dispatch.__doc__ = original.__doc__
    dispatch.__kernreg_original__ = original  # type: ignore[attr-defined]
    return dispatch


@functools.lru_cache(maxsize=256)  # one per routed function: inspect.signature costs 10 µs
def _dispatcher_maker(
    original: Callable[..., Any], no_args: bool, no_output: bool
) -> Callable[..., Callable[..., Any]]:
    """``make(args_fn, output_fn, table, site, original, defaults)``: see
    :func:`_dispatching_function`."""
    params = _call_parameters(original)
    if params is None:
        inputs = signature = "*args, **kwargs"
        passed = "*args, **kwargs" if no_args else "*op_args"
        first = "args[0]" if no_args else "op_args[0]"
    else:
        defaults = original.__defaults__ or ()
        plain = params[: len(params) - len(defaults)]
        signature = ", ".join(
            plain + [f"{p}=defaults[{i}]" for i, p in enumerate(params[len(plain) :])]
        )
        inputs = ", ".join(params)
        passed = inputs if no_args else "*op_args"
        first = params[0] if no_args else "op_args[0]"
    call = f"impl({passed})"
    result = call if no_output else f"output_fn({call}, {inputs})"
    source = (
        "def make(args_fn, output_fn, table, site, original, defaults):\n"
        f"    def dispatch({signature}):\n"
        + (f"        op_args = args_fn({inputs})\n" if not no_args else "")
        + "        try:\n"
        f"            impl = table[{first}.dtype]\n"
        "        except KeyError:\n"
        f"            impl = getattr(site, site.miss_name({first}), None)\n"
        "        if impl is None:\n"
        f"            return original({inputs})\n"
        f"        return {result}\n"
        "    return dispatch\n"
    )
    return made(source, "routed function")


def _call_parameters(func: Callable[..., Any]) -> list[str] | None:
    """The names of ``func``'s parameters if all are plain positional ones (defaults
    allowed), else ``None``."""
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    plain = inspect.Parameter.POSITIONAL_OR_KEYWORD
    names = [p.name for p in parameters]
    if not parameters or any(p.kind is not plain for p in parameters):
        return None
    if any(not n.isidentifier() or n in RESERVED for n in names):
        return None
    return names


def _with_globals(func: Any, overrides: Mapping[str, Any]) -> Any:
    """A copy of ``func`` whose globals are a copy of its own with ``overrides`` applied;
    decorators that keep the function they wrap as ``__wrapped__`` and in their closure are
    copied around it. ``None`` when a decorator hides the function it calls."""
    wrapped = getattr(func, "__wrapped__", None)
    if not isinstance(func, types.FunctionType):
        return None
    if wrapped is not None:
        inner = _with_globals(wrapped, overrides)
        if inner is None or not func.__closure__:
            return None
        cells = list(func.__closure__)
        replaced = False
        for i, cell in enumerate(cells):
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if content is wrapped:
                cells[i] = types.CellType(inner)
                replaced = True
        if not replaced:
            return None
        copy = types.FunctionType(
            func.__code__, func.__globals__, func.__name__, func.__defaults__, tuple(cells)
        )
    else:
        # The copy lives in a module object of its own, registered under a name of its own:
        # torch.compile finds a function's globals through sys.modules[__name__].
        namespace = _namespace(func.__globals__, overrides)
        copy = types.FunctionType(
            func.__code__, namespace, func.__name__, func.__defaults__, func.__closure__
        )
        inner = None
    copy.__kwdefaults__ = None if func.__kwdefaults__ is None else dict(func.__kwdefaults__)
    copy.__dict__.update(func.__dict__)
    if inner is not None:
        copy.__wrapped__ = inner  # type: ignore[attr-defined]
    copy.__qualname__ = func.__qualname__
    copy.__doc__ = func.__doc__
    copy.__module__ = func.__module__
    return copy


#: prefix of the module names of routed namespaces (a copy of a modeling module's globals)
NAMESPACE_PREFIX = "kernreg._routed."
_namespace_numbers = iter(range(1 << 62))


def _namespace(original: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    name = f"{NAMESPACE_PREFIX}{original.get('__name__', 'module')}.n{next(_namespace_numbers)}"
    module = types.ModuleType(name)
    namespace = module.__dict__
    namespace.update(original)
    namespace.update(overrides)
    namespace["__name__"] = name
    sys.modules[name] = module
    return namespace


Pin = tuple[str, str, str, str | None]


def _parse_pins(pin: Mapping[str, str] | None) -> list[Pin]:
    """``(op glob, site glob, backend, variant)`` from code pins."""
    result: list[Pin] = []
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


def _config_site_pins(registry: KernelRegistry) -> list[Pin]:
    """The site pins of configuration (``KERNREG_PIN``), then those of the lock file the
    registry follows (``kernreg lock`` records the site pins it ran with): a process given
    the lock alone binds what it recorded; the first pin matching a site wins."""
    pins = [p for p in getattr(registry.config, "pins", ()) if getattr(p, "site", None)]
    plan = registry.plan
    if plan is not None and plan.site_pins:
        pins += _plan_site_pins(plan.site_pins)
    return [(p.pattern, p.site, p.backend, p.variant) for p in pins]


@functools.lru_cache(maxsize=16)
def _plan_site_pins(texts: tuple[str, ...]) -> tuple[Any, ...]:
    return parse_pins("site_pins", list(texts))


def _pin_for(pins: list[Pin], op: str, path: str) -> tuple[str, str | None] | None:
    for op_glob, site_glob, backend, variant in pins:
        if fnmatchcase(op, op_glob) and fnmatchcase(path, site_glob):
            return backend, variant
    return None


def _resolve_pin(pins: list[Pin], op: str, paths: tuple[str, ...]) -> tuple[str, str | None] | None:
    """The site pin of the module at ``paths`` (one path, or every path of a module shared
    at several: it has one forward, so a pin naming any of them applies, and pins that
    disagree are an error)."""
    if not pins:
        return None
    if len(paths) == 1:
        return _pin_for(pins, op, paths[0])
    found = {p: pin for p in paths if (pin := _pin_for(pins, op, p)) is not None}
    if len(set(found.values())) > 1:
        shown = ", ".join(f"'{p}' -> {'/'.join(filter(None, b))}" for p, b in found.items())
        raise KernelizeError(
            f"kernelize pins for op '{op}' disagree on one module shared at several "
            f"paths ({shown}): a module has one forward; pin it once"
        )
    return next(iter(found.values()), None)


def _param_dtype_device(module: Any) -> tuple[Any, Any]:
    """The dtype and device of the first parameter (else buffer) of ``module`` or, without
    one, of its first child that has one."""
    # The module's own tables, not parameters() and children(): their generators cost
    # 4-8 µs a module, about a third of kernelize's time per routed site.
    for table in (module._parameters, module._buffers):
        for tensor in table.values():
            if tensor is not None:
                return tensor.dtype, tensor.device
    for child in module._modules.values():
        found = (None, None) if child is None else _param_dtype_device(child)
        if found[0] is not None:
            return found
    return None, None


def _failure(decision: Decision) -> str:
    try:
        chosen_or_raise(decision)
    except Exception as exc:
        headline = str(exc).splitlines()[0]
        if decision.reason:
            return headline
        # The headline alone says nothing eligible, not why: each implementation's reasons
        # (implementations refused for the same reasons named together).
        refused: dict[str, list[str]] = {}
        for cand in decision.candidates:
            if not cand.eligible:
                refused.setdefault("; ".join(cand.reasons) or "not eligible", []).append(
                    cand.spec.label
                )
        why = "; ".join(f"{', '.join(labels)}: {reason}" for reason, labels in refused.items())
        return f"{headline} ({why})" if why else headline
    return ""


def _chosen_reason(decision: Decision) -> str:
    reason = "eligible"
    for cand in decision.candidates:
        if cand.spec == decision.chosen:
            reason = "; ".join(cand.reasons) or "eligible"
            break
    if decision.plan_miss:  # a lock file's entry that could not decide here says why
        reason += f" (lock file not followed: {decision.plan_miss})"
    if decision.tuning:
        reason += f" ({_NOT_AUTOTUNED})"
    return reason


#: Why a kernelized layer of an op under the autotune policy runs the priority choice.
_NOT_AUTOTUNED = (
    "the autotune policy measures calls of the op, not kernelized layers: priority decided; "
    "time the implementations with `kernreg bench` and pin the fastest"
)


#: One planned change of a module: ``(module, attribute, value, site)``, its ``attribute``
#: (``forward`` or accelerate's ``_old_forward``) set to ``value`` by ``site``. A tuple, not
#: an object: one a routed module, 1% of a fresh kernelize of the tiny Llama.
Change = tuple[Any, str, Any, "_Site"]


def _named_modules(model: Any) -> tuple[list[tuple[str, Any]], dict[int, list[str]]]:
    """``list(model.named_modules())``, without its generator per module (a third of a
    repeated kernelize's time on the tiny Llama); and the other paths of the modules
    reachable at several (a layer shared by two parents), by module id."""
    aliases: dict[int, list[str]] = {}
    if type(model).named_modules is not torch.nn.Module.named_modules:
        return list(model.named_modules()), aliases
    found: list[tuple[str, Any]] = [("", model)]
    seen = {id(model)}

    append, add = found.append, seen.add

    def walk(prefix: str, module: Any) -> None:  # prefix: the parent's path and a dot
        for name, child in module._modules.items():
            if child is not None:
                key = id(child)
                if key not in seen:
                    add(key)
                    path = prefix + name
                    append((path, child))
                    if child._modules:  # a leaf is not called into (most modules are)
                        walk(path + ".", child)
                else:
                    again(prefix + name, child)

    def again(path: str, module: Any) -> None:
        aliases.setdefault(id(module), []).append(path)
        for name, child in module._modules.items():
            if child is not None:
                again(f"{path}.{name}", child)

    walk("", model)
    return found, aliases


def _settle(module: Any, forward: Any, kind: type | None) -> type | None:
    """Have ``module``, routed through its instance ``forward``, run the routed
    ``forward`` (a function of the module) from its class instead: it is given its
    :func:`~kernreg.torch._forward.settled_class`, and its instance forward is dropped.
    Only while its class is ``kind``, the one it was routed as: a class another library
    made for it since (``torch.nn.utils.parametrize``'s, which it changes in place) is
    kept, and the module routed through its instance.
    Under ``torch.compile`` a forward set on the instance costs guards of its own (the
    method, its code, the instance dict, an aliasing check in Python), about 0.3-0.5 µs
    a module a compiled call; one from the class is guarded with the class, as the module's
    own forward is. Returns the class it runs as (``None``: left as it was)."""
    _unsettle(module)
    own = module.__dict__
    state = own.get(SITE_ATTRIBUTE)
    if state is None or state[1] != "forward" or own.get("forward") is not state[3]:
        return None  # routed beneath a hook, or a forward set over the routed one since
    if type(module) is not kind:
        return None
    cls = settled_class(kind, forward)
    if cls is None:
        return None
    try:
        _set_class(module, cls)
    except TypeError:  # a layout a subclass cannot share (__slots__)
        return None
    own.pop("forward", None)  # after the class: a call meanwhile runs either
    return cls


def _set_class(module: Any, cls: type) -> None:
    # Not through torch.nn.Module.__setattr__, which looks for a parameter, buffer or
    # submodule of that name first (a third of a settle's time).
    object.__setattr__(module, "__class__", cls)


def _unsettle(module: Any) -> None:
    """Route ``module`` through its instance forward again, as :func:`_settle` found it
    (a hook set on it since keeps the routed forward as ``_old_forward``: that is the
    instance forward it gets back too). A class made from its settled one since
    (``torch.nn.utils.parametrize``'s) is made again from the class it was settled from
    (:func:`~kernreg.torch._forward.unsettled_class`): what that class adds is kept."""
    cls = type(module)
    if type(cls) is not Settled:
        return
    own = module.__dict__
    state = own.get(SITE_ATTRIBUTE)
    value = None if state is None else state[3]
    if value is not None and value.__self__ is not module:  # a replica (DataParallel)
        value = types.MethodType(value.__func__, module)
        own[SITE_ATTRIBUTE] = (*state[:3], value)
    if value is not None:
        if "forward" not in own:
            own["forward"] = value
        else:
            hooked = own.get(_HOOKED_FORWARD)
            if getattr(hooked, "__func__", None) is cls.forward and hooked.__self__ is module:
                own[_HOOKED_FORWARD] = value
    _set_class(module, unsettled_class(cls))


#: set while this thread's kernelize plans: a table filled then settles nothing (planning
#: reads the modules as routed through their instance forward)
_planning: contextvars.ContextVar[bool] = contextvars.ContextVar("planning", default=False)


@contextlib.contextmanager
def _unsettled(model: Any) -> Iterator[tuple[list[tuple[str, Any]], dict[int, list[str]]]]:
    """``model``'s modules (:func:`_named_modules`) while kernelize plans: a settled one is
    read as routed through the instance forward it runs from its class (:func:`_runs`),
    unless something was set on its instance since (a hook, a patch: routed through its
    instance forward again, which planning reads) or its class was made anew from its
    settled one (``torch.nn.utils.parametrize``'s); settled again after it, also when it
    raises, where its route changed or its table holds more since."""
    modules, aliases = _named_modules(model)
    for _, module in modules:
        cls = type(module)
        if type(cls) is Settled and ("forward" in module.__dict__ or not is_settled(module)):
            _unsettle(module)
    planning = _planning.set(True)
    try:
        yield modules, aliases
    finally:
        _planning.reset(planning)
        # What Site.settle checks, checked once: a trace open, or torch.compile tracing.
        settles = not active_traces() and not torch.compiler.is_compiling()
        done: set[int] = set()
        for _, module in modules:
            state = module.__dict__.get(SITE_ATTRIBUTE)
            site = None if state is None else state[0]
            if site is None or _settled_as_it_is(module, state):
                continue
            if isinstance(site, _FunctionSite):
                _resettle(module)
            elif settles and site.settles and id(site) not in done:
                done.add(id(site))
                with site.lock:
                    site.settle_owners()


def _planned_class(owner: Any) -> Any:
    """The class of a module (or function) kernelize plans: a settled module's is the one
    its settled class was made from. Only while it plans, when every settled class of
    the model is one kernreg made (:func:`_unsettled` made the others anew); else
    :func:`~kernreg.torch._forward.own_class`."""
    cls = type(owner)
    return cls.__bases__[0] if type(cls) is Settled else cls


def _settled_as_it_is(module: Any, state: tuple[Any, ...]) -> bool:
    """Whether ``module`` is settled in the class its route makes now: the copy of its
    class's forward it runs (a caller of routed functions), or a forward made for what its
    site's table holds."""
    if type(type(module)) is not Settled or "forward" in module.__dict__:
        return False  # (a settled class here is one kernreg made: see _unsettled)
    forward = type(module).forward
    site = state[0]
    if isinstance(site, _FunctionSite):
        return state[3] is not None and forward is state[3].__func__
    return bool(forward.__globals__.get("table") == site.table)


def _resettle(module: Any) -> None:
    """Settle ``module`` again where its route allows (:meth:`_Site.settle`; the caller of
    routed functions, with the copy of its class's forward it runs)."""
    state = module.__dict__.get(SITE_ATTRIBUTE)
    site = None if state is None else state[0]
    if site is None:
        return
    if isinstance(site, _FunctionSite):
        forward = None if state[3] is None else state[3].__func__
        # The class it was routed as: the one the copy of the forward it runs was made for.
        kinds = [cls for (cls, _), made in site.copies.items() if made[2]() is forward]
        if forward is not None and kinds:
            _settle(module, forward, kinds[0])
        return
    with site.lock:
        site.settle()


def _settled_miss(module: Any, x: Any) -> Any:
    """What a settled forward runs for a dtype its table does not hold: what the module's
    site holds for it (decided while torch.compile traced, where nothing settles: the
    module settles now), else what it decides (:meth:`_Site.miss_name`, which settles
    the module with it). ``None`` (its own forward runs) where the module is routed no
    more: unkernelized since, its settled forward held (a wrapper, a hook) and called."""
    state = module.__dict__.get(SITE_ATTRIBUTE)
    site = None if state is None else state[0]
    if site is None or isinstance(site, _FunctionSite):
        return None
    # While torch.compile traces, the table is not read: dynamo would guard on what it
    # holds before miss_name (run for real) fills it.
    compiling = torch.compiler.is_compiling()
    impl = _ABSENT if compiling else site.table.get(x.dtype, _ABSENT)
    if impl is _ABSENT:
        return getattr(site, site.miss_name(x), None)
    cls = type(module)
    if type(cls) is Settled and x.dtype not in cls.forward.__globals__["table"]:
        with site.lock:  # decided while torch.compile traced: settled now
            site.settle()
    return impl


def _site_of(module: Any) -> _Site | None:
    """The site routing ``module`` now, if any."""
    state = module.__dict__.get(SITE_ATTRIBUTE)
    return None if state is None else state[0]


def _runs(module: Any, attribute: str, forward: Any) -> bool:
    """Whether ``module``'s ``attribute`` is ``forward`` bound to it (a settled module's
    ``forward``: the instance forward it runs from its class, its route's)."""
    own = module.__dict__
    value = own.get(attribute)
    if value is None and attribute == "forward" and type(type(module)) is Settled:
        state = own.get(SITE_ATTRIBUTE)
        value = None if state is None else state[3]
    return getattr(value, "__self__", None) is module and getattr(value, "__func__", 0) is forward


def _holder(own: dict[str, Any], state: tuple[Any, ...]) -> str | None:
    """The attribute of a routed module's ``own`` dict holding the routed forward now: the
    one kernelize set, unless a hook was set on top of it since (accelerate keeps it as
    ``_old_forward``) or the hook it was routed beneath was removed since (accelerate puts
    ``_old_forward`` back as ``forward``); ``None`` when neither holds it any more."""
    attribute: str = state[1]
    value = state[3] if len(state) > 3 else None
    if value is None or own.get(attribute) is value:
        return attribute
    for name in ("forward", _HOOKED_FORWARD):
        if own.get(name) is value:
            return name
    return None


def _route_target(module: Any) -> tuple[str | None, str]:
    """Which attribute of ``module`` to route (``None``: none can be), and why not."""
    own = module.__dict__
    holder = None if SITE_ATTRIBUTE not in own else _holder(own, own[SITE_ATTRIBUTE])
    if holder is not None:
        return holder, ""
    if "forward" not in own:
        return "forward", ""
    if _HOOKED_FORWARD in own and SITE_ATTRIBUTE not in own:
        return _HOOKED_FORWARD, ""
    # Another forward set on the instance (before kernelize, or over the routed one since:
    # a patch binding its own forward to the module) is kept as any instance forward is.
    return None, (
        "an instance-level forward is set on this module (not one kernreg can route "
        "beneath): own forward kept"
    )


#: registry -> ((its generation, the mappings' generation), what kernelize found then:
#: decisions, which ops it has)
_memos: weakref.WeakKeyDictionary[KernelRegistry, tuple[tuple[int, int], dict[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)


def _memo_of(registry: KernelRegistry) -> dict[Any, Any]:
    """What kernelize found before with ``registry`` in its present state (and the
    mappings in theirs); a mutation of either starts afresh."""
    state = (registry.generation, layers.generation)
    found = _memos.get(registry)
    if found is None or found[0] != state:
        found = _memos[registry] = (state, {})
    return found[1]


class _Fit:
    """What one mapping is for every module of one class in one ``kernelize`` call: why it
    is skipped before the module's own ``applies`` check (the op has no implementation, a
    hook cannot be loaded), its hooks, why it is skipped after it (the class's forward takes
    inputs the argument map does not pass, without defaults), and the note on those it
    does not pass that have defaults."""

    __slots__ = ("hooks", "skipped", "unfit", "unpassed")

    def __init__(self) -> None:
        self.skipped: str | LayerMappingLoadError = ""
        self.hooks: Hooks = (None, None, None, None)
        self.unfit = ""
        self.unpassed = ""


class _Kind:
    """What the sites of one kind (op, input dtype, device, site pin) share in one
    ``kernelize`` call: the decision, why its choice won, the implementation and its guarded
    callable (``None`` until a site needs them), and how many sites were bound to it."""

    __slots__ = ("bound", "decision", "guarded", "impl", "reason")

    def __init__(self, decision: Decision, reason: str) -> None:
        self.decision = decision
        self.reason = reason
        self.impl: Callable[..., Any] | None = None
        self.guarded: Callable[..., Any] | None = None
        self.bound = 0


class _Planner:
    """Decides and verifies every site of one ``kernelize`` call; changes nothing."""

    def __init__(
        self,
        model: Any,
        registry: KernelRegistry,
        mode: str,
        strict: bool,
        pins: list[Pin],
        verify: bool,
        aliases: dict[int, list[str]] | None = None,
        code_pins: tuple[Pin, ...] = (),
    ) -> None:
        self.model = model
        self.registry = registry
        #: the pins given to this call (``pin=``), which come before configuration's
        self.code_pins = code_pins
        #: the other paths of modules the model reaches at several, by module id
        self.aliases = aliases or {}
        self.mode = mode
        self.traits = MODES[mode]
        self.strict = strict
        self.pins = pins
        self.verify = verify
        self.rows: list[KernelizeRow] = []
        self.changes: list[Change] = []
        #: the sites this call made (those it kept are subscribed already)
        self.sites: list[_Site] = []
        #: ids of the modules routed as before, left as they are
        self.kept: set[int] = set()
        #: paths of the modules routed (kept as they are or changed)
        self.routed: list[str] = []
        #: ops of routed sites that the autotune policy would measure per call
        self.untuned: set[str] = set()
        #: paths of modules another kernelized model holds and routed (one forward for both)
        self.shared: list[str] = []
        #: id of such a model -> ids of its modules (none where one model holds the other)
        self._held: dict[int, set[int]] = {}
        #: function sites bound again (subscribed already)
        self.reused: set[_Site] = set()
        #: (op, input dtype, device, site pin) -> what the sites of that kind share
        self.kinds: dict[tuple[Any, ...], _Kind] = {}
        #: the model's module classes (set by :meth:`plan_layers`), with their mappings
        self.classes: dict[type, tuple[tuple[LayerMapping, ...], str, str]] = {}
        # What a call finds once for all the sites it serves (a model has few kinds of layer
        # and many layers: the 4-layer Llama has 13 sites, 3 mappings, 2 decisions), kept
        # for the next call while neither the registry nor the mappings change.
        # Targets are imported again by every call (a module attribute replaced since is
        # what the next kernelize binds), once for all the sites it serves.
        self._memo = _memo_of(registry)
        #: a trace is open: the implementations bound are recorded with their site
        self.tracing = bool(active_traces())
        self._hooks: dict[tuple[str, str], Hooks | LayerMappingLoadError] = {}
        #: (id of a mapping, class of the modules it is tried on) -> what it is for them
        self._fits: dict[tuple[int, type], _Fit] = {}
        #: id of a chosen spec (held by its decision) -> its implementation, this call's
        self._impls: dict[int, Callable[..., Any]] = {}

    def _fit(self, mapping: LayerMapping, owner: Any) -> _Fit:
        """What ``mapping`` is for every module of ``owner``'s class (the function, for a
        function mapping): whether its op has implementations, its hooks, and the inputs of
        the class's forward its argument map does not pass."""
        fit = _Fit()
        op = mapping.op
        present = self._memo.get(("has", op))
        if present is None:
            present = self._memo[("has", op)] = op in self.registry
        if not present:
            fit.skipped = f"op '{op}' has no implementation in this registry"
            return fit
        found = self._hooks.get(mapping.key)
        if found is None:
            try:
                found = self._hooks[mapping.key] = mapping.load_all()
            except LayerMappingLoadError as exc:
                found = self._hooks[mapping.key] = exc
        if isinstance(found, LayerMappingLoadError):
            fit.skipped = found
            return fit
        fit.hooks = found
        if mapping.kind == "layer":
            own = _planned_class(owner).forward
            optional, required = unpassed_inputs(own, found[0])
            untaken = untaken_inputs(own, found[0])
            if untaken:
                names = ", ".join(f"'{n}'" for n in untaken)
                fit.unfit = (
                    f"the mapping's argument map takes {names}, which its forward does not "
                    "take: own forward kept"
                )
            elif required:
                names = ", ".join(f"'{n}'" for n in required)
                fit.unfit = (
                    f"its forward takes {names}, which the mapping's argument map does not "
                    "pass: own forward kept"
                )
            elif optional == ("*",):
                assert found[0] is not None  # a map whose inputs unpassed_inputs read
                count = len(plain_parameters(found[0]) or ())
                fit.unpassed = (
                    f"; a call with other inputs than the mapping's {count}, positionally, "
                    "runs the own forward"
                )
            elif optional:
                names = " or ".join(f"'{n}'" for n in optional)
                fit.unpassed = f"; a call that passes {names} runs the own forward"
        return fit

    def _decide(self, site: _Site, dtype: Any, device: Any) -> tuple[Decision, str]:
        """The decision for ``site`` and why its choice won."""
        key = ("decision", site.mapping.op, dtype, device, site.pin, self.traits, self.strict)
        found: tuple[Decision, str] | None = self._memo.get(key)
        if found is None:
            decision = site.decide(dtype, device)
            found = self._memo[key] = (decision, _chosen_reason(decision))
        return found

    def _load(self, spec: KernelSpec) -> Callable[..., Any]:
        impl = self._impls.get(id(spec))  # a spec's label is made anew on each read
        if impl is None:
            impl = self._impls[id(spec)] = spec.load()
        return impl

    def _guarded(self, decision: Decision, impl: Callable[..., Any]) -> Callable[..., Any]:
        """``impl`` under the demotion policy; the guarded callable is made once per
        (decision, implementation) while the memo holds (a demotion changes the registry,
        and so the memo): the sites of one kind of layer share it."""
        key = ("guarded", id(decision), id(impl))
        found = self._memo.get(key)
        if found is None or found[0] is not decision or found[1] is not impl:
            strict = True if self.strict else None
            made = guarded(
                decision, impl, registry=self.registry, traits=self.traits, strict=strict
            )
            found = self._memo[key] = (decision, impl, made)
        result: Callable[..., Any] = found[2]
        return result

    def _same_site(
        self,
        site: _Site,
        path: str,
        mapping: LayerMapping,
        pin: Any,
        owner: Any,
        hooks: Hooks,
        device: Any,
        dtype: Any,
    ) -> bool:
        """Whether ``site`` is what this call would make for ``path`` (then it is kept).
        A module's site holds one device's implementations (a function site one table per
        device): a module moved since gets a new one."""
        if mapping.kind == "function":
            same_owner = type(site) is _FunctionSite and site.original is owner
            same_owner = same_owner and site.owner() is self.model
        else:
            same_owner = type(site) is _Site and site.owner() is owner and site.device == device
            same_owner = same_owner and site.weights == dtype
        return (
            same_owner
            and site.path == path
            and site.mapping is mapping
            and site.hooks == hooks
            and site.registry is self.registry
            and site.traits == self.traits
            and site.strict == self.strict
            and site.pin == pin
            and site.code_pins == self.code_pins
            and site.verify == self.verify
        )

    def _aliases_of(self, owner: Any) -> tuple[str, ...]:
        """The other paths of ``owner``, a module the model reaches at several."""
        return tuple(self.aliases.get(id(owner), ())) if self.aliases else ()

    def _candidate(
        self,
        path: str,
        mapping: LayerMapping,
        owner: Any,
        dtype: Any,
        device: Any,
        what: str,
        now: _Site | None,
    ) -> tuple[_Site | None, KernelizeRow]:
        """Try one mapping on one site: the bound site, or ``None`` and the row saying why.
        ``now`` (the site routing it now) is bound again when nothing it was made from
        changed, so a module routed as before is left as it is."""
        op = mapping.op

        def row(impl: str | None, rule: str, status: str, reason: str) -> KernelizeRow:
            return KernelizeRow(path, mapping.layer, op, impl, rule, status, reason)

        # One look-up a site for what its mapping is for every module of its class: 14
        # sites, 4 (mapping, class) pairs; about 1% of a fresh kernelize of the tiny Llama.
        fitted = (id(mapping), _planned_class(owner))
        fit = self._fits.get(fitted)
        if fit is None:
            fit = self._fits[fitted] = self._fit(mapping, owner)
        if isinstance(fit.skipped, LayerMappingLoadError) and self.strict:
            raise fit.skipped
        if fit.skipped:
            return None, row(None, "-", "skipped", str(fit.skipped))
        hooks = fit.hooks
        applies = hooks[2]
        if mapping.kind == "layer" and applies is not None:
            why_not = applies(owner)
            if why_not:
                return None, row(None, "-", "skipped", str(why_not))
        if fit.unfit:
            return None, row(None, "-", "skipped", fit.unfit)
        unpassed = fit.unpassed
        aliases = self._aliases_of(owner)
        site_pin = _resolve_pin(self.pins, op, (path, *aliases)) if self.pins else None
        site: _Site
        if now is not None and self._same_site(
            now, path, mapping, site_pin, owner, hooks, device, dtype
        ):
            site = now
        elif mapping.kind == "function":
            site = _FunctionSite(
                path,
                mapping,
                self.registry,
                self.traits,
                self.strict,
                site_pin,
                hooks,
                self.verify,
                self.model,
                original=owner,
                code_pins=self.code_pins,
                aliases=aliases,
            )
        else:
            site = _Site(
                path,
                mapping,
                self.registry,
                self.traits,
                self.strict,
                site_pin,
                hooks,
                self.verify,
                owner,
                code_pins=self.code_pins,
                aliases=aliases,
            )
            site.weights = dtype
        # One look-up a site for what its kind shares (the decision, the implementation, its
        # guarded callable): 14 sites, 3 kinds; 2% of a fresh kernelize of the tiny Llama.
        kind = self.kinds.get((op, dtype, device, site_pin))
        if kind is None:
            kind = self.kinds[(op, dtype, device, site_pin)] = _Kind(
                *self._decide(site, dtype, device)
            )
        decision, chosen_reason = kind.decision, kind.reason
        chosen = decision.chosen
        if not decision.ok or chosen is None:
            if self.strict or site_pin is not None:
                chosen_or_raise(decision)
            return None, row(None, decision.rule, "kept", f"own {what} kept: {_failure(decision)}")
        # Decided for the meta device, where a kernel requiring cpu or cuda cannot run:
        # the loaded model would keep that decision, never deciding again.
        on_meta = device is not None and device.type == "meta"  # a tensor's device
        meta_hint = (
            " (decided for the meta device: kernelize once the weights are loaded "
            "to decide for the device they are on)"
        )
        if decision.rule == "reference" and site_pin is None:
            if self.strict:
                raise StrictFallbackError(
                    decision,
                    f"Strict mode: '{path}' ({mapping.layer}) would keep its own {what}: "
                    f"only the reference of op '{op}' is eligible (mode {self.mode!r})",
                )
            reason = f"only the reference is eligible: own {what} kept"
            if on_meta:
                reason += meta_hint
            return None, row(chosen.label, decision.rule, "kept", reason)
        if on_meta and not self.verify:  # verification says so itself
            reason = f"{chosen.label} is eligible there: own {what} kept{meta_hint}"
            if self.strict:
                raise KernelizeVerificationError(path, reason)
            return None, row(chosen.label, decision.rule, "kept", reason)
        impl = kind.impl
        if impl is None:
            impl = kind.impl = self._load(chosen)
        if self.verify:
            problem = site.check(chosen, impl, dtype, device)
            if problem:
                return None, row(
                    chosen.label,
                    decision.rule,
                    "rejected",
                    f"{problem}; implementation tried: {chosen.label}; own {what} kept",
                )
        if self.tracing:  # a trace open around kernelize records the calls it binds
            traced = site._traced(impl, chosen.label, decision.rule)
            guarded_traced = site.guard(dtype, device, traced, decision, count=False)
            site.store(dtype, device, guarded_traced, ready=True)
            kind.bound += 1
        else:
            if kind.guarded is None:
                kind.guarded = self._guarded(decision, impl)
            bound = _refusing_backward(kind.guarded, chosen, path, self.registry)
            if site is not now and type(site) is _Site:
                # Made by this call, seen by no other thread yet: stored without the lock
                # (2% of a fresh kernelize of the tiny Llama).
                site.table[dtype] = bound
                site.device = device
            else:
                site.store(dtype, device, bound, decision, ready=True)
            kind.bound += 1  # counted per site, as _Site.guard does, once the call succeeds
        if decision.tuning and site_pin is None:
            self.untuned.add(op)
        # The row is made once per (path, mapping, decision) while the memo holds: a model
        # routed again, or for the first time after unkernelize, reuses it.
        key = ("row", path, mapping.key, id(decision), site_pin is not None, self.verify, unpassed)
        routed = self._memo.get(key)
        if routed is None:
            reason = f"pinned at this site to {chosen.label}" if site_pin else chosen_reason
            if self.verify:
                reason += "; verified against the own " + what
            if site.trains_otherwise:
                reason += (
                    " in eval mode (it computes otherwise in training mode, e.g. dropout: "
                    "it runs itself while training)"
                )
            routed = self._memo[key] = row(chosen.label, decision.rule, "routed", reason + unpassed)
        return site, routed

    def _choose(
        self,
        path: str,
        mappings: tuple[LayerMapping, ...],
        owner: Any,
        dtype: Any,
        device: Any,
        what: str,
        now: _Site | None = None,
    ) -> tuple[_Site | None, KernelizeRow]:
        """The first mapping that routes; else the most telling row of those tried."""
        tried: list[KernelizeRow] = []
        for mapping in mappings:
            site, row = self._candidate(path, mapping, owner, dtype, device, what, now)
            if site is not None:
                # What each rejection kept is not kept here: this mapping routes it.
                rejected = tried and "; ".join(
                    f"{r.op}: {r.reason.removesuffix(f'; own {what} kept')}"
                    for r in tried
                    if r.status == "rejected"
                )
                if rejected:
                    row = row.replace(reason=f"{row.reason} (rejected before it: {rejected})")
                return site, row
            tried.append(row)
        order = {"rejected": 0, "kept": 1, "skipped": 2}
        best = min(tried, key=lambda r: order.get(r.status, 3))
        if len(tried) > 1:
            others = "; ".join(f"{r.op}: {r.reason}" for r in tried if r is not best)
            best = best.replace(reason=f"{best.reason} (also tried {others})")
        if best.status == "rejected" and self.strict:
            raise KernelizeVerificationError(path, best.reason)
        return None, best

    def plan_layers(self, modules: list[tuple[str, Any]]) -> dict[type, list[str]]:
        """Route the model's mapped modules; returns the unmapped look-alike classes."""
        unmapped: dict[type, list[str]] = {}
        #: class -> its mappings, and the kind of layer it looks like
        mappings_of: dict[type, tuple[tuple[LayerMapping, ...], str, str]] = self.classes
        for path, module in modules:
            cls = _planned_class(module)  # a routed module runs as a subclass of it
            found = mappings_of.get(cls)
            if found is None:
                found = mappings_of[cls] = _class_mappings(cls)
            mappings, kind, _ = found
            if not mappings:
                if kind:
                    unmapped.setdefault(cls, []).append(path)
                continue
            attribute, why_not = _route_target(module)
            if attribute is None:
                self.rows.append(
                    KernelizeRow(
                        path, mappings[0].layer, mappings[0].op, None, "-", "kept", why_not
                    )
                )
                continue
            dtype, device = _param_dtype_device(module)
            now = _site_of(module)
            if now is not None and self._routed_in_another_model(now, module):
                self.shared.append(path)
            site, row = self._choose(path, mappings, module, dtype, device, "forward", now)
            self.rows.append(row)
            others = self.aliases.get(id(module), ())
            for other in others:  # one module, one forward: what runs at each of its paths
                shared = f"the same module as '{path}' (shared): {row.reason}"
                self.rows.append(row.replace(path=other, reason=shared))
            if site is None:
                continue
            self.routed.append(path)
            if others:
                self.routed += others
            if site is now and site.own is cls.forward and _runs(module, attribute, site.forward):
                self.kept.add(id(module))  # routed as before: nothing to change
                continue
            forward = site.route(cls.forward, cls)
            self.changes.append((module, attribute, types.MethodType(forward, module), site))
            if site is not now:
                site.routed_in = weakref.ref(self.model)
                self.sites.append(site)
        return unmapped

    def _routed_in_another_model(self, site: _Site | None, module: Any) -> bool:
        """Whether ``module`` (routed by ``site``) is routed by the kernelize of another
        live model holding it too: not one within this model or holding it (a part
        kernelized on its own), not a deep copy's original (a copy's modules are its own)."""
        other = None if site is None or site.routed_in is None else site.routed_in()
        if other is None or other is self.model:
            return False
        held = self._held.get(id(other))
        if held is None:
            held = {id(m) for m in other.modules()}
            if id(self.model) in held or any(m is other for m in self.model.modules()):
                held = set()  # one holds the other
            self._held[id(other)] = held
        return id(module) in held

    def plan_functions(self, modules: list[tuple[str, Any]]) -> list[UnmappedLayer]:
        """Route the mapped functions the model's modules call, for this model only."""
        unmapped: dict[str, tuple[str, list[str]]] = {}
        #: function key -> (global name, original, site or None)
        routes: dict[str, tuple[str, Any, _Site | None]] = {}
        callers: dict[type, list[str]] = {}
        #: (class, device) -> the modules of this model on that device, and their attribute
        groups: dict[tuple[type, Any], list[tuple[Any, str]]] = {}
        kept: set[_Site] = set()
        for path, module in modules:
            cls = _planned_class(module)
            keys = callers.get(cls)
            if keys is None:
                keys = callers[cls] = self._called_functions(cls, routes, unmapped, path, module)
            if not keys or not any(isinstance(routes[key][2], _FunctionSite) for key in keys):
                continue
            attribute, _ = _route_target(module)
            if attribute is None:
                continue
            device = _param_dtype_device(module)[1] or _CPU
            groups.setdefault((cls, device), []).append((module, attribute))
        for (cls, device), members in groups.items():
            keys = callers[cls]
            site = routes[keys[0]][2]
            assert isinstance(site, _FunctionSite)
            routed = {
                name: r
                for name, _, r in map(routes.__getitem__, keys)
                if isinstance(r, _FunctionSite)
            }
            # One copy of the class's forward per class and device of this model: the one
            # they run now when nothing it was made from changed, else a new one.
            forward = site.copy_made(cls, device)
            same = forward is not None and site.copies[(cls, device)][1] == routed
            if same and all(_runs(m, a, forward) and _site_of(m) is site for m, a in members):
                self.kept.update(id(m) for m, _ in members)
                kept.update(routed.values())
                continue
            forward = site.copy_for(cls, device, routed)
            if forward is None:
                continue
            for module, attribute in members:
                method = types.MethodType(forward, module)
                self.changes.append((module, attribute, method, site))
        self.sites.extend(
            site
            for _, _, site in routes.values()
            if site is not None and site not in kept and site not in self.reused
        )
        return [UnmappedLayer(k, tag, tuple(paths)) for k, (tag, paths) in unmapped.items()]

    def _called_functions(
        self,
        cls: type,
        routes: dict[str, tuple[str, Any, _Site | None]],
        unmapped: dict[str, tuple[str, list[str]]],
        path: str,
        module: Any,
    ) -> list[str]:
        """Keys of the mapped functions ``cls.forward`` calls, each routed once per model."""
        keys: list[str] = []
        for name, original, key, mappings, tag in _function_calls(cls):
            if key in routes:
                keys.append(key)
                continue
            if not mappings:
                unmapped.setdefault(key, (tag, []))[1].append(path)
                continue
            dtype, device = _param_dtype_device(self.model)
            now = _site_of(module)
            site, row = self._choose(key, mappings, original, dtype, device, "function", now)
            self.rows.append(row)
            if site is not None and site is now:
                self.reused.add(site)
            routes[key] = (name, original, site)
            keys.append(key)
        return keys


#: class -> (the mappings' generation, its layer mappings, the kind of layer it looks like,
#: why it is listed as unmapped)
_classes: weakref.WeakKeyDictionary[type, tuple[int, tuple[LayerMapping, ...], str, str]] = (
    weakref.WeakKeyDictionary()
)


def _class_mappings(cls: type) -> tuple[tuple[LayerMapping, ...], str, str]:
    """The layer mappings of ``cls`` and, without any, the kind of layer it looks like and
    why it is unmapped (empty: it looks like no known kind)."""
    found = _classes.get(cls)
    if found is None or found[0] != layers.generation:
        mappings = mappings_for(layer_name(cls), "layer")
        kind = reason = ""
        if not mappings:
            kind = _tags.layer_kind(cls)
            base, base_mappings = _mapped_base(cls)
            if base is not None:
                # A mapping names its class exactly: a subclass (another forward, other
                # settings) is not served by its base's mapping, and is told.
                kind = kind or _tags.layer_kind(base) or base_mappings[0].op
                ops = ", ".join(f"'{m.op}'" for m in base_mappings)
                reason = (
                    f"subclasses {layer_name(base)} (mapped to op {ops}) but no mapping "
                    "covers the subclass itself (a mapping names its class exactly)"
                )
        found = _classes[cls] = (layers.generation, mappings, kind, reason)
    return found[1], found[2], found[3]


def _mapped_base(cls: type) -> tuple[type | None, tuple[LayerMapping, ...]]:
    """The nearest base class of ``cls`` that a layer mapping covers, and its mappings."""
    for base in cls.__mro__[1:]:
        if base is torch.nn.Module or not issubclass(base, torch.nn.Module):
            continue  # a mixin, or Module and object
        found = mappings_for(layer_name(base), "layer")
        if found:
            return base, found
    return None, ()


Call = tuple[str, Any, str, tuple[LayerMapping, ...], str]
#: class -> (the mappings' generation, its forward, the globals it reads, the names its
#: code reads there and their values, what :func:`_function_calls` found)
_calls: weakref.WeakKeyDictionary[type, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def _function_calls(cls: type) -> list[Call]:
    """``(global name, original function, key, its mappings, its tag)`` of each mapped or
    tagged module-level function ``cls.forward`` calls (found again when the class's
    forward, a global it reads or the mappings change)."""
    raw = getattr(cls, "forward", None)
    found = _calls.get(cls)
    if found is not None and found[0] == layers.generation and found[1] is raw:
        globals_, names, values, kept = found[2:]
        if all(map(operator.is_, map(globals_.get, names), values)):
            return kept  # type: ignore[no-any-return]
    forward = inspect.unwrap(raw)  # type: ignore[arg-type]
    code = getattr(forward, "__code__", None)
    namespace = getattr(forward, "__globals__", None)
    if code is None or namespace is None:
        return []
    calls: list[Call] = []
    for name in code.co_names:
        value = namespace.get(name)
        if not isinstance(value, types.FunctionType):
            continue
        original = getattr(value, "__kernreg_original__", value)
        key = layer_name(original)
        mappings = mappings_for(key, "function")
        tag = "" if mappings else _tags.function_tag(original)
        if mappings or tag:
            calls.append((name, original, key, mappings, tag))
    values = tuple(map(namespace.get, code.co_names))
    _calls[cls] = (layers.generation, raw, namespace, code.co_names, values, calls)
    return calls


def _unresolved(classes: Iterable[type], memo: dict[Any, Any] | None = None) -> list[str]:
    """Exact mappings naming a class or function missing from a module the model uses
    (``classes``: the model's module classes); ``memo``: a planner's, which keeps what to
    look up for each set of modules (the look-ups themselves are made by every call)."""
    used = tuple(sorted({cls.__module__ for cls in classes}))
    checks = None if memo is None else memo.get(("unresolved", used))
    if checks is None:
        checks = []
        for mapping in (m for name in used for m in exact_mappings_in(name)):
            module_name, _, attr = mapping.layer.partition(":")
            if "<locals>" not in attr:
                text = f"{mapping.layer} (op '{mapping.op}'): no such {mapping.kind}"
                checks.append((module_name, attr.split("."), text))
        if memo is not None:
            memo[("unresolved", used)] = checks
    missing = []
    for module_name, parts, text in checks:
        value: Any = sys.modules.get(module_name)
        if value is None:
            continue
        for part in parts:
            value = getattr(value, part, None)
        if value is None:
            missing.append(text)
    return missing


def _warn_pins(pins: list[Pin], registry: KernelRegistry, rows: list[KernelizeRow]) -> None:
    """A pin whose op glob matches no op, or that matches no mapped module routed through
    an op it names, warns."""
    ops = list(registry.ops())
    for op_glob, site_glob, _, _ in pins:
        if not any(fnmatchcase(op, op_glob) for op in ops):
            hint = did_you_mean(difflib.get_close_matches(op_glob, ops, n=3))
            warnings.warn(
                f"kernelize pin '{op_glob}@{site_glob}' matches no op of the registry"
                + (f"; {hint}" if hint else ""),
                KernelizeWarning,
                stacklevel=3,
            )
            continue
        # The module paths of the ops the pin names: a module of another op is not pinned.
        paths = list(dict.fromkeys(r.path for r in rows if fnmatchcase(r.op, op_glob)))
        if any(fnmatchcase(path, site_glob) for path in paths):
            continue
        if op_glob == "*" and any(fnmatchcase(op, site_glob) for op in ops):
            # A key without '@' is a module glob; this one names ops.
            hint = did_you_mean([f"{site_glob}@*"])
        else:
            hint = did_you_mean(difflib.get_close_matches(site_glob, paths, n=3))
        warnings.warn(
            f"kernelize pin '{op_glob}@{site_glob}' matches no module of this model"
            + ("" if op_glob == "*" else f" routed through '{op_glob}'")
            + (f"; {hint}" if hint else ""),
            KernelizeWarning,
            stacklevel=3,
        )


def _warn_op_pins(registry: KernelRegistry) -> None:
    """A pin of configuration (``KERNREG_PIN``) without a site whose op glob matches no op
    of the registry warns: it pins nothing this model runs."""
    pins = [p for p in getattr(registry.config, "pins", ()) if not getattr(p, "site", None)]
    if not pins:
        return
    ops = list(registry.ops())
    for pin in pins:
        if any(fnmatchcase(op, pin.pattern) for op in ops):
            continue
        close = difflib.get_close_matches(pin.pattern, ops, n=3) if pin.exact else []
        hint = did_you_mean(close)
        source = f" ({pin.source})" if pin.source else ""
        warnings.warn(
            f"kernelize pin '{pin}'{source} matches no op of the registry"
            + (f"; {hint}" if hint else ""),
            KernelizeWarning,
            stacklevel=3,
        )


def _warn_blocks(rows: list[KernelizeRow]) -> None:
    """A ``use_backend`` block open around ``kernelize`` that names an op of the model
    warns: kernelize decides without it (the model runs what kernelize decided, whatever
    block is open around its calls), and the pin to pass instead is named."""
    seen: set[Any] = set()
    for op in dict.fromkeys(r.op for r in rows):
        for block in pins_for(op):
            if block.source != "use_backend" or block in seen:
                continue
            seen.add(block)
            target = block.backend if block.variant is None else f"{block.backend}/{block.variant}"
            warnings.warn(
                f"kernelize: the use_backend block open around it ({block}) does not decide "
                "what this model runs (a kernelized model runs what kernelize decided); "
                f"pass pin={{'{block.pattern}@*': '{target}'}} to pin its layers",
                KernelizeWarning,
                stacklevel=3,
            )


def kernelize(
    model: Any,
    *,
    mode: Mode = "inference",
    strict: bool = False,
    pin: Mapping[str, str] | None = None,
    registry: KernelRegistry | None = None,
    verify: bool = True,
) -> KernelizeReport:
    """Route every mapped layer of ``model`` through its op; return the report.

    Calling it again decides every site again; a module whose site would be made from
    the same things (mapping, registry state, mode, pins, dtype, device, class forward)
    keeps the binding it has. Nothing changes unless the whole call succeeds.
    ``verify=False`` skips verification: you vouch for your mappings.
    """
    if mode == "torch.compile":  # the name users know the mode by
        mode = "compile"
    if mode not in MODES:
        raise KernelizeError(f"mode {mode!r} is not one of {', '.join(repr(m) for m in MODES)}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"kernelize takes a torch.nn.Module, not {type(model).__name__}")
    reg = registry if registry is not None else default_registry()
    code_pins = _parse_pins(pin)
    pins = code_pins + _config_site_pins(reg)
    # Verified for the model's dtype as calls outside an autocast region compute it: an
    # autocast region open around kernelize would round the probes' matmuls.
    with (
        _kernelize_lock,
        autocast_off() if verify else contextlib.nullcontext(),
        _unsettled(model) as (modules, aliases),
    ):
        # A registry change while the sites are decided and verified (another thread
        # registering or unregistering, for milliseconds) makes them again: the model must
        # never keep an implementation decided from the state before it.
        for _ in range(3):
            state = (reg.generation, layers.generation)
            planner = _Planner(model, reg, mode, strict, pins, verify, aliases, tuple(code_pins))
            unmapped_classes = planner.plan_layers(modules)
            unmapped_functions = planner.plan_functions(modules)
            if (reg.generation, layers.generation) == state:
                break
        # A layer inside a routed module is not called any more: nothing is left out there.
        routed = tuple(f"{path}." for path in planner.routed if path)
        unmapped = []
        for cls, paths in unmapped_classes.items():
            left = tuple(p for p in paths if not p.startswith(routed))
            if left:
                _, kind, reason = planner.classes[cls]
                unmapped.append(UnmappedLayer(layer_name(cls), kind, left, reason))
        unmapped += unmapped_functions
        unresolved = _unresolved(planner.classes, planner._memo)
        # Warned before anything changes: a filter that raises them (`-W error`) must
        # leave the model as it was, like any other failure.
        _warn(unmapped, unresolved, planner.untuned)
        if planner.shared:
            _warn_shared(planner.shared)
        if pins:
            _warn_pins(pins, reg, planner.rows)
        _warn_op_pins(reg)
        if context_pins():
            _warn_blocks(planner.rows)
        # Every decision is made and said: from here on nothing can fail half way.
        kept = planner.kept
        _restore([m for _, m in modules if SITE_ATTRIBUTE in m.__dict__ and id(m) not in kept])
        for module, attribute, value, site in planner.changes:
            _unsettle(module)  # routed anew: through its instance forward, then settled
            own = module.__dict__
            previous = own.get(attribute, _ABSENT)
            own[SITE_ATTRIBUTE] = (site, attribute, previous, value)
            own[attribute] = value
            own.setdefault("_apply", types.MethodType(_apply, module))
            replicate = types.MethodType(_replicate_for_data_parallel, module)
            own.setdefault("_replicate_for_data_parallel", replicate)
        if planner.sites:
            _subscribe(planner.sites, reg)
        if reg.generation != state[0]:  # changed since the last planning: decide on each call
            for routed_site in {_site_of(m) for _, m in modules}:
                if routed_site is not None:
                    routed_site.invalidate()
        for bound in planner.kinds.values():
            if bound.bound:
                count_decision(bound.decision, times=bound.bound)
        _remember(model, reg, mode, planner.rows)
    return KernelizeReport(model, mode, planner.rows, unmapped, unresolved)


#: id of each kernelized model -> the model (held weakly), the registry and mode of its
#: last kernelize, and that call's rows (what :func:`routing_of` reads)
_kernelized: dict[
    int, tuple[weakref.ref[Any], weakref.ref[KernelRegistry], str, tuple[KernelizeRow, ...]]
] = {}


def _remember(model: Any, registry: KernelRegistry, mode: str, rows: list[KernelizeRow]) -> None:
    key = id(model)

    def forget(ref: weakref.ref[Any]) -> None:  # the registry is not held past the model
        if _kernelized.get(key, (None,))[0] is ref:
            _kernelized.pop(key, None)

    # The registry held weakly: the model's sites hold it while they route, and a model
    # and a registry only they hold are freed by one collection (held here, it would
    # take a second one, after the model's callback let it go).
    _kernelized[key] = (weakref.ref(model, forget), weakref.ref(registry), mode, tuple(rows))


def _remember_copies(memo: dict[int, Any]) -> None:
    """Remember the deep copies (in ``memo``) of kernelized models as kernelized like
    them: a copy runs what its original runs, and may outlive it."""
    with _kernelize_lock:
        for key, (ref, registry_ref, mode, rows) in _kernelized.copy().items():
            model, copied, registry = ref(), memo.get(key), registry_ref()
            fresh = copied is not None and id(copied) not in _kernelized
            if model is not None and registry is not None and fresh and copied is not model:
                _remember(copied, registry, mode, list(rows))


def routing_of(registry: KernelRegistry) -> list[tuple[str, ...]]:
    """What the live models kernelized with ``registry`` run at each of their mapped
    sites, sorted: ``(model class, path, op, status, implementation, kernelize pin,
    mode)``. A routed site's implementation is the one it decides now for the dtype and
    device it was kernelized for (``<own forward>`` where that falls back); the other
    rows are what kernelize left on the module's own forward (the implementation tried,
    for a rejected swap). Nothing of object identity, nor of the order of the calls, is
    in it; a model unkernelized since (or the modules of it unkernelized) drops out.
    :func:`kernreg.torch.distributed.verify` compares it across ranks."""
    entries: list[tuple[str, ...]] = []
    if _kernelized:
        # A routed module holds its forward, which holds the module: a model no longer
        # reachable lives on until a collection finds the cycle. Collected now, so what
        # ranks compare never depends on when the last collection ran.
        gc.collect()
    with _kernelize_lock:
        # A copy (made without a step a collection can run in): a model collected while
        # the loop runs is forgotten by its weak reference's callback.
        for ref, reg, mode, rows in _kernelized.copy().values():
            model = ref()
            if model is None:
                continue  # forgotten as it goes
            if reg() is not registry:
                continue
            # By the module's path in this model: a site made by the kernelize of a part
            # of it (or of another model holding the module) has a path of its own.
            live: dict[tuple[str, str], _Site] = {}
            for path, module in model.named_modules(remove_duplicate=False):
                site = _site_of(module)
                if isinstance(site, _FunctionSite):
                    for _, routed, _ in site.copies.values():
                        for function in routed.values():
                            live.setdefault((function.path, function.mapping.op), function)
                elif site is not None:
                    live[(path, site.mapping.op)] = site
            name = layer_name(type(model))
            for row in rows:
                if row.status != "routed":
                    tried = row.implementation or ""
                    entries.append((name, row.path, row.op, row.status, tried, "", mode))
                    continue
                site = live.get((row.path, row.op))
                if site is not None:  # else unkernelized since
                    entries.append((name, row.path, row.op, *_routes(site, model), mode))
    return sorted(entries)


def _routes(site: _Site, model: Any) -> tuple[str, str, str]:
    """``(status, implementation, kernelize pin)`` of a routed site now."""
    pin = _resolve_pin(list(site.code_pins), site.mapping.op, (site.path, *site.aliases))
    pinned = "" if pin is None else "/".join(filter(None, pin))
    dtype, device = site.weights, site.device
    if isinstance(site, _FunctionSite):
        dtype, device = _param_dtype_device(model)
    try:
        decision = site.decide(dtype, device)
    except KernregError as exc:
        return "routed", f"<{type(exc).__name__}>", pinned
    chosen = decision.chosen if decision.ok else None
    if chosen is None or (decision.rule == "reference" and site.pin is None):
        return "routed", "<own forward>", pinned
    failed = any(
        problem and problem != UNVERIFIED_WHILE_COMPILING and spec == chosen and kind == dtype
        for (spec, _, kind, *_), problem in list(site.verified.items())
    )
    return ("rejected" if failed else "routed"), chosen.label, pinned


def _warn(unmapped: list[UnmappedLayer], unresolved: list[str], untuned: set[str]) -> None:
    """Warn once per layer kind no mapping covers, per mapping naming nothing, and per op
    the autotune policy would measure."""
    for entry in unmapped:
        warnings.warn(
            f"kernelize: {entry.layer} {entry.reason} "
            f"({len(entry.paths)} site(s), e.g. '{entry.paths[0] or '<root>'}'); "
            "it keeps its own forward (report.unmapped lists it)",
            KernelizeWarning,
            stacklevel=3,
        )
    for name in unresolved:
        warnings.warn(f"kernelize: mapping {name}", KernelizeWarning, stacklevel=3)
    if untuned:
        ops = ", ".join(f"'{op}'" for op in sorted(untuned))
        warnings.warn(f"kernelize: ops {ops}: {_NOT_AUTOTUNED}", KernelizeWarning, stacklevel=3)


def _warn_shared(paths: list[str]) -> None:
    shown = ", ".join(f"'{p}'" for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
    warnings.warn(
        f"kernelize: {len(paths)} module(s) of this model ({shown}) are held and routed by "
        "another kernelized model too; a module has one forward: it runs what this call "
        "decides in both models (and unkernelize of either gives it its own forward back "
        "in both)",
        KernelizeWarning,
        stacklevel=3,
    )


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"

    # One of it: a copied or loaded routed module's "no forward of its own" must still be
    # recognised, or unkernelize on the copy would set the copy as its forward.
    def __deepcopy__(self, memo: dict[int, Any]) -> _Absent:
        return self

    def __reduce__(self) -> str:
        return "_ABSENT"


_ABSENT = _Absent()

#: held while a model's routing changes (reentrant: a probe may move a module)
_kernelize_lock = threading.RLock()


def _reset_lock_in_child() -> None:
    # A child forked while another thread was inside kernelize would wait for it forever.
    global _kernelize_lock
    _kernelize_lock = threading.RLock()
    for group in list(_sites):
        for site in group:
            site.lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_lock_in_child)


def _apply(self: Any, *args: Any, **kwargs: Any) -> Any:
    """A routed module's ``_apply`` (what ``to``, ``cuda``, ``cpu`` and ``to_empty`` run):
    the class's, then the route follows the module to the device it is on now. Named as
    the method it stands for: a pickled routed module loads with the class's."""
    result = type(self)._apply(self, *args, **kwargs)
    with _kernelize_lock:
        _unsettle(self)
        _follow_device(self)
        _resettle(self)
    return result


def _replicate_for_data_parallel(self: Any) -> Any:
    """A routed module's ``_replicate_for_data_parallel`` (``nn.DataParallel`` makes its
    per-device replicas with it, as shallow copies): the class's, then the replica's
    routed forward is bound to the replica, not to this module (whose weights are on
    another device). Named as the method it stands for, like :func:`_apply`."""
    replica = type(self)._replicate_for_data_parallel(self)
    own = replica.__dict__
    state = own.get(SITE_ATTRIBUTE)
    ours = {_apply, _replicate_for_data_parallel}
    if state is not None and len(state) > 3 and state[3] is not None:
        ours.add(state[3].__func__)
    for name, value in list(own.items()):
        if (
            isinstance(value, types.MethodType)
            and value.__self__ is self
            and value.__func__ in ours
        ):
            own[name] = types.MethodType(value.__func__, replica)
    if state is not None and len(state) > 3 and state[3] is not None:
        holder = _holder(vars(self), state)
        own[SITE_ATTRIBUTE] = (*state[:3], own.get(holder) if holder else state[3])
    return replica


def _follow_device(module: Any) -> None:
    """Route ``module`` for the device it is on now, if it moved since it was routed: a
    module site starts a table of its own there (and so does one whose parameters changed
    dtype: what a new dtype of input runs is verified against the weights as they are), a
    caller of routed functions runs the copy of its class's forward made for that
    device."""
    own = module.__dict__
    state = own.get(SITE_ATTRIBUTE)
    holder = None if state is None or state[0] is None else _holder(own, state)
    weights, device = _param_dtype_device(module)
    if holder is None or device is None:
        return
    site = state[0]
    cls = type(module)
    if isinstance(site, _FunctionSite):
        forward = site.copy_made(cls, device)
        if forward is None:
            routed = next((m[1] for (c, _), m in site.copies.items() if c is cls), None)
            forward = None if routed is None else site.copy_for(cls, device, routed)
    elif site.device != device or site.weights != weights:
        site = site.moved_to(module, device, weights)
        forward = site.forward
    else:
        return
    if forward is None or _runs(module, holder, forward):
        return
    value = own[holder] = types.MethodType(forward, module)
    own[SITE_ATTRIBUTE] = (site, state[1], state[2], value)


def unkernelize(model: Any) -> int:
    """Give every routed module of ``model`` its own forward back; returns how many
    modules were restored."""
    # Restored under the lock: a kernelize of the same model in another thread finds its
    # modules either routed or restored, never routed and then restored beneath it.
    with _kernelize_lock:
        found = _kernelized.get(id(model))
        if found is not None and found[0]() is model:
            _kernelized.pop(id(model), None)
        return _restore(model.modules())


def _restore(modules: Iterable[Any]) -> int:
    restored = 0
    for module in modules:
        _unsettle(module)
        state = module.__dict__.pop(SITE_ATTRIBUTE, None)
        if state is None:
            continue
        for ours in (_apply, _replicate_for_data_parallel):
            name = ours.__name__
            moves = module.__dict__.get(name)
            if getattr(moves, "__func__", None) in (ours, getattr(type(module), name)):
                del module.__dict__[name]  # ours, or what a pickled one loads as
        attribute, previous = state[1], state[2]
        own = module.__dict__
        holder = _holder(own, state)
        if holder is None or holder not in own:
            pass  # deleted or set anew since: not the routed forward, left as it is
        elif holder != attribute and holder == _HOOKED_FORWARD:
            # A hook set since keeps the routed forward: it gets what it would have kept.
            if previous is _ABSENT:
                previous = types.MethodType(type(module).forward, module)
            own[holder] = previous
        elif previous is _ABSENT:
            own.pop(holder, None)
        else:
            own[holder] = previous
        restored += 1
    return restored

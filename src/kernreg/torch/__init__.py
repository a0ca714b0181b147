"""kernreg's torch layer (the ``kernreg[torch]`` extra): parity, testing, torch.compile.

* :func:`check_parity` runs every implementation of an op that can run here against the
  reference, on inputs from the op's registered generator, with per-dtype tolerances;
* :func:`inputs` / :func:`register_inputs` declare an op's input generator;
* :func:`kernelize` routes a model's mapped layers through their ops (one call), with a
  report and undo; :func:`register_layer` / :func:`layer` declare the mappings, and
  :func:`register_function` maps a module-level function (transformers' rotary);
* :func:`as_custom_op` exposes an op object as a ``torch.library`` custom op;
* :mod:`kernreg.torch.testing` parametrizes pytest tests over implementations.

Op objects work inside ``torch.compile(fullgraph=True)`` with a cold or a warm decision
cache: selection runs for real while dynamo traces (its result is a constant for the
trace) and the chosen implementation is traced into the graph; a later registration
makes the compiled code trace again. Not supported inside a compiled region: an open
:func:`kernreg.trace` block or :func:`kernreg.use_backend` block (both graph-break; pin
with ``KERNREG_PIN`` instead). For one opaque graph node, use :func:`as_custom_op`.

``import kernreg`` never imports this package. Importing the package itself imports no
torch either (the input-generator table is metadata, filled by plugins at registration);
the parts that need torch load on first use.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kernreg.measurement import Measurement, use_measurer
from kernreg.spec import KernelSpec
from kernreg.torch._inputs import (
    InputSpec,
    bench_shapes,
    input_spec,
    inputs,
    register_inputs,
    unregister_inputs,
)
from kernreg.torch.layers import (
    LayerConflictError,
    LayerMapping,
    layer,
    layer_mapping,
    layer_mappings,
    register_function,
    register_layer,
    unregister_function,
    unregister_layer,
)

if TYPE_CHECKING:
    from kernreg.torch._custom_op import InferenceOnlyError, as_custom_op
    from kernreg.torch.kernelize import (
        KernelizeError,
        KernelizeReport,
        KernelizeRow,
        KernelizeVerificationError,
        KernelizeWarning,
        UnmappedLayer,
        kernelize,
        unkernelize,
    )
    from kernreg.torch.parity import (
        TOLERANCES,
        ParityError,
        ParityReport,
        ParityResult,
        Tolerance,
        check_parity,
    )

__all__ = [
    "TOLERANCES",
    "InferenceOnlyError",
    "InputSpec",
    "KernelizeError",
    "KernelizeReport",
    "KernelizeRow",
    "KernelizeVerificationError",
    "KernelizeWarning",
    "LayerConflictError",
    "LayerMapping",
    "ParityError",
    "ParityReport",
    "ParityResult",
    "Tolerance",
    "UnmappedLayer",
    "as_custom_op",
    "bench_shapes",
    "check_parity",
    "input_spec",
    "inputs",
    "kernelize",
    "layer",
    "layer_mapping",
    "layer_mappings",
    "register_function",
    "register_inputs",
    "register_layer",
    "unkernelize",
    "unregister_function",
    "unregister_inputs",
    "unregister_layer",
]

_LAZY = {
    "as_custom_op": "kernreg.torch._custom_op",
    "InferenceOnlyError": "kernreg.torch._custom_op",
    "KernelizeError": "kernreg.torch.kernelize",
    "KernelizeReport": "kernreg.torch.kernelize",
    "KernelizeRow": "kernreg.torch.kernelize",
    "KernelizeVerificationError": "kernreg.torch.kernelize",
    "KernelizeWarning": "kernreg.torch.kernelize",
    "UnmappedLayer": "kernreg.torch.kernelize",
    "kernelize": "kernreg.torch.kernelize",
    "unkernelize": "kernreg.torch.kernelize",
    "TOLERANCES": "kernreg.torch.parity",
    "ParityError": "kernreg.torch.parity",
    "ParityReport": "kernreg.torch.parity",
    "ParityResult": "kernreg.torch.parity",
    "Tolerance": "kernreg.torch.parity",
    "check_parity": "kernreg.torch.parity",
}


def _install_custom_op_namespace() -> None:
    """Have ``torch.ops.kernreg`` define saved programs' kernreg custom ops on lookup: now
    if torch is loaded, else right after torch finishes loading (torch is not imported)."""
    import sys

    if "torch" in sys.modules and hasattr(sys.modules["torch"], "ops"):
        importing = sys.modules.get("kernreg.torch._custom_op")
        if importing is not None and not hasattr(importing, "install_namespace"):
            return  # torch was loaded by its import, which installs the namespace itself
        from kernreg.torch._custom_op import install_namespace

        install_namespace()
        return
    from kernreg.torch._hook import after_import

    after_import("torch", _install_custom_op_namespace)


_install_custom_op_namespace()


class _Package(types.ModuleType):
    """This package's module type: importing the submodule ``kernreg.torch.kernelize``
    binds no package attribute, so ``kernreg.torch.kernelize`` stays the function whatever
    was imported first (Python's import system names a submodule on its package). So
    ``import kernreg.torch.kernelize as m`` gives the function too: the module's names
    are imported from it (``from kernreg.torch.kernelize import ...``) or from here."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "kernelize" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kernreg.torch' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def measure(
    op_id: str,
    candidates: Sequence[KernelSpec],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    /,
    *,
    params: Sequence[str] = (),
) -> Mapping[str, Measurement]:
    """The torch layer's :class:`kernreg.measurement.Measurer`: times the candidates with
    :func:`kernreg.torch.tune.measure`; measures nothing without torch."""
    try:
        from kernreg.torch.tune import measure as measure_with_torch
    except ImportError:  # no torch: nothing to measure with, priority decides
        return {}
    return measure_with_torch(op_id, candidates, args, kwargs, params=params)


use_measurer(measure)

"""Exposing an op object as a ``torch.library`` custom op: an opaque node in traced graphs.

An op object is traced through by ``torch.compile`` (the chosen implementation's
operations end up in the graph). Engines that want one opaque node instead, with
dispatch happening when the node runs, wrap it::

    rms = kernreg.torch.as_custom_op(kernreg_ops.ops.rmsnorm)      # torch.ops.kernreg.layernorm_rmsnorm
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kernreg.dispatch import dispatcher
from kernreg.torch._inputs import input_spec

__all__ = ["as_custom_op"]

_lock = threading.Lock()
#: qualified name -> (the op id it runs, the custom op)
_defined: dict[str, tuple[str, Any]] = {}


def as_custom_op(
    op: Any,
    *,
    namespace: str = "kernreg",
    name: str | None = None,
    mutates_args: Sequence[str] | None = None,
    fake: Callable[..., Any] | None = None,
) -> Any:
    """Register ``op`` (an op object or op id) as ``torch.ops.<namespace>.<name>``.

    ``name`` defaults to the op id with dots as underscores. ``mutates_args`` defaults
    to the parameters the op's input generator declares as mutated. ``fake`` computes
    output metadata for tracing; it defaults to the op's reference, which is pure torch
    and so runs on fake tensors. The schema is inferred from the reference's type hints.
    Calling this again for the same op and name returns the custom op defined the first
    time; that name for another op raises ``ValueError``.
    """
    op_obj = dispatcher(op) if isinstance(op, str) else op
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
        if mutates_args is None:
            declared = input_spec(op_obj.op_id)
            mutates_args = declared.mutates if declared is not None else ()
        reference = op_obj.reference

        def run(*args: Any, **kwargs: Any) -> Any:
            return op_obj(*args, **kwargs)

        # The schema comes from the reference's signature and annotations.
        functools.update_wrapper(run, reference)
        custom = torch.library.custom_op(qualname, run, mutates_args=tuple(mutates_args))
        custom.register_fake(fake if fake is not None else reference)
        _defined[qualname] = (op_obj.op_id, custom)
        return custom

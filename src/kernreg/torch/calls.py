"""What running an implementation on torch values needs, shared by the parity check and
the benchmark: whether a device can run here, fresh copies of a call's arguments, the
one-line text of an implementation's exception, and whether an op takes ``out=``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["OUT_PARAMETER", "clone_value", "device_available", "error_text", "takes_out"]


def device_available(device: torch.device) -> bool:
    """Whether ``device`` can run here (its torch backend says it is available)."""
    if device.type == "cpu":
        return True
    module = getattr(torch, device.type, None)
    available = getattr(module, "is_available", None)
    return bool(available()) if callable(available) else False


def clone_value(value: Any) -> Any:
    """``value`` with every tensor in it cloned (tuples, lists and dicts rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(clone_value(v) for v in value)
    if isinstance(value, dict):
        return {k: clone_value(v) for k, v in value.items()}
    return value


def error_text(exc: BaseException) -> str:
    """``raised TypeError: <first line of the message>``: how a report names an exception."""
    first = str(exc).partition("\n")[0]
    return f"raised {type(exc).__name__}: {first}"


#: The parameter through which an op takes its output buffers (see :func:`takes_out`).
OUT_PARAMETER = "out"


def takes_out(reference: Callable[..., Any] | inspect.Signature) -> bool:
    """Whether an op's reference declares that its implementations honour ``out=``.

    The declaration is the reference's signature (which every implementation of the op
    shares): a parameter named ``out``, passable by keyword, whose default is ``None``.
    Every implementation then writes its result into the ``out`` it is given (a tensor,
    or a tuple of tensors shaped like the result) and returns that same ``out``.
    """
    signature = (
        reference if isinstance(reference, inspect.Signature) else inspect.signature(reference)
    )
    parameter = signature.parameters.get(OUT_PARAMETER)
    return (
        parameter is not None
        and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
        and parameter.default is None
    )

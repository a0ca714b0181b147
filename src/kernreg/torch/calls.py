"""What running an implementation on torch values needs, shared by the parity check and
the benchmark: whether a device can run here, fresh copies of a call's arguments, and the
one-line text of an implementation's exception."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_value", "device_available", "error_text"]


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

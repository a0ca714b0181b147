"""What a model library says about its layers: transformers' kernel tags, and names.

transformers tags layers in its modeling files (``@use_kernel_forward_from_hub("RMSNorm")``
on a class or a function, ``@use_kernelized_func(apply_rotary_pos_emb)`` on an attention
class). The decorators do nothing at run time unless Hugging Face ``kernels`` is
installed and enabled, so a class usually carries no mark: the tags are read from the
class's attribute when it is there (``kernel_layer_name``), else from its module's source
(read once per module). A class no tag names still looks like a known kind of layer by
its name (``...RMSNorm``, ``...LayerNorm``, ``...MLP``, ``...Experts``).
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from typing import Any

__all__ = ["function_tag", "layer_kind"]

#: class-name endings of the layer kinds an op pack serves
KNOWN_KINDS = ("RMSNorm", "LayerNorm", "MLP", "Experts")

#: a module-level tag decorator, then the class or function it decorates: the next line
#: that starts with ``class`` or ``def`` (other decorators, comment lines such as ``#
#: Copied from ...``, and decorators written over several lines come between)
_TAG = re.compile(
    r"^@use_kernel_(?:forward|func)_from_hub\(\s*[\"']([^\"']+)[\"']\s*\)[^\n]*\n"
    r"(?:(?!(?:class|def)\s).*\n)*?"
    r"(?:class|def)\s+(\w+)",
    re.MULTILINE,
)


@functools.lru_cache(maxsize=256)
def _source_tags(module_name: str) -> dict[str, str]:
    """``name -> tag`` of the tagged classes and functions of a module's source."""
    module = sys.modules.get(module_name)
    if module is None:
        return {}
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return {}
    if "use_kernel_" not in source:
        return {}
    return {name: tag for tag, name in _TAG.findall(source)}


def layer_kind(cls: type) -> str:
    """The kind of layer ``cls`` looks like (its transformers tag, else its name's known
    ending); empty when it looks like none."""
    tag = getattr(cls, "kernel_layer_name", None)
    if isinstance(tag, str) and tag:
        return tag
    tag = _source_tags(cls.__module__).get(cls.__qualname__, "")
    if tag:
        return tag
    name = cls.__name__
    for kind in KNOWN_KINDS:
        if name.endswith(kind):
            return kind
    return ""


def function_tag(func: Any) -> str:
    """The transformers tag of a module-level function (empty without one)."""
    module = getattr(func, "__module__", None)
    name = getattr(func, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(name, str):
        return ""
    return _source_tags(module).get(name, "")

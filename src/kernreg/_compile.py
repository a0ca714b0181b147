"""Op objects inside ``torch.compile``, without importing torch: every private torch name
kernreg relies on is here, and ``tests/torch/test_compile.py`` checks each against the
installed torch (they were checked with torch :data:`CHECKED_TORCH_VERSIONS`)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

from kernreg.spec import KernelSpec

__all__ = [
    "CHECKED_TORCH_VERSIONS",
    "Targets",
    "compiled_reference",
    "inline_instead",
    "run_while_tracing",
    "through_the_compiler",
    "tracing",
]

#: The torch releases whose private names below were checked.
CHECKED_TORCH_VERSIONS = ("2.13",)

F = TypeVar("F", bound=Callable[..., Any])


def run_while_tracing(func: F) -> F:
    """Have ``torch.compile`` call ``func`` for real while it traces, its result a constant
    (the marker ``torch.compiler.assume_constant_result`` sets): selection takes locks and
    imports modules, which dynamo cannot trace, and returns a name of :class:`Targets`."""
    func._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return func


def inline_instead(wrapper: Any, route: Callable[..., Any]) -> None:
    """Have dynamo trace ``route`` wherever it meets ``wrapper`` (same arguments)."""
    wrapper._torchdynamo_inline = route


def compiled_reference(op_id: str, reference: Callable[..., Any]) -> KernelSpec:
    """The derived ``torch_compile`` implementation of an op (``kernreg.op(...,
    torch_compile=True)``): ``torch.compile`` of its reference, compiled on the first call.
    An outer ``torch.compile`` traces the reference itself (it compiles it anyway)."""
    compiled: list[Callable[..., Any]] = []

    def torch_compile(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            import torch  # the call's tensors come from torch: imported already

            compiled.append(torch.compile(reference))
        return compiled[0](*args, **kwargs)

    functools.update_wrapper(torch_compile, reference)
    torch_compile.__qualname__ = f"{reference.__qualname__}.torch_compile"
    inline_instead(torch_compile, reference)
    return KernelSpec(
        op_id,
        "torch_compile",
        torch_compile,
        traits={"compile_safe"},
        priority=-100,
        description="torch.compile of the reference (derived)",
    )


def tracing() -> bool:
    """Whether torch.compile is tracing now (code it runs for real must not change what
    the trace has read). A torch that another thread is still importing is not tracing."""
    compiler = sys.modules.get("torch.compiler")
    if compiler is None:
        return False
    # What is_compiling() returns outside TorchScript; reading it costs ~40 ns, the call
    # ~230 ns, and op objects ask on every call while a use_backend block is open.
    flag = getattr(compiler, "_is_compiling_flag", None)
    if isinstance(flag, bool):
        return flag
    try:
        return bool(compiler.is_compiling())
    except Exception:  # torch half imported (no is_compiling yet): nothing can be compiling
        return False


def through_the_compiler(error: Exception) -> Exception:
    """``error`` as an instance of a subclass of its class that dynamo counts as a user
    error, so torch.compile passes it on (any other exception raised while it traces comes
    out as ``InternalTorchDynamoError``); the message and the attributes stay ``error``'s."""
    passing = getattr(sys.modules.get("torch._dynamo.exc"), "UserError", None)
    if not isinstance(passing, type) or isinstance(error, passing):
        return error
    cls = type(error)
    names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    try:
        sub = type(cls.__name__, (cls, passing), {**names, "__init__": BaseException.__init__})
    except TypeError:  # an incompatible layout: keep the original
        return error
    clone = sub(*error.args)
    clone.__dict__.update(error.__dict__)
    clone.__dict__.setdefault("real_stack", None)  # what dynamo reads of a UserError
    clone.__dict__.setdefault("skip_frame", False)
    return cast(Exception, clone)


class Targets:
    """Implementations chosen for calls, one attribute each, read by the name that a
    :func:`run_while_tracing` function returns (dynamo guards on each attribute afresh);
    after :meth:`clear` (a registry mutation) an old name reads ``fallback``."""

    def __init__(self, fallback: Callable[..., Any]) -> None:
        self._fallback = fallback

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return self._fallback  # only names that are not set: cleared by a mutation

    def clear(self) -> None:
        self.__dict__ = {"_fallback": self._fallback}

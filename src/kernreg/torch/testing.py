"""pytest helpers: run a test once per implementation of an op.

::

    from kernreg.torch.testing import parametrize_implementations

    @parametrize_implementations("layernorm.rmsnorm", dtype="bfloat16")
    def test_rmsnorm(implementation):
        out = implementation.load()(x, weight)

Each implementation becomes one test (id: its label, such as ``triton`` or
``triton/v2``) receiving its :class:`~kernreg.KernelSpec`. Those that cannot run here
are skipped with the reasons :func:`kernreg.explain` gives (wrong device, missing
package, unsupported dtype), so a CPU run shows what a GPU run would add.
"""

from __future__ import annotations

from typing import Any

import pytest

from kernreg.registry import KernelRegistry
from kernreg.torch.arguments import PlatformLike, platform_argument, registry_argument

__all__ = ["implementation_params", "parametrize_implementations"]


def implementation_params(
    op: Any,
    *,
    dtype: str | None = "float32",
    platform: PlatformLike = None,
    registry: KernelRegistry | None = None,
) -> list[Any]:
    """One ``pytest.param`` per implementation of ``op`` (an op id or op object), with a
    skip mark carrying the rejection reasons for those that cannot run here."""
    op_id: str = op if isinstance(op, str) else op.op_id
    reg = registry if registry is not None else getattr(op, "registry", None)
    reg = reg if isinstance(reg, KernelRegistry) else registry_argument(None)
    decision = reg.explain(
        op_id, platform=platform_argument(platform), dtypes=None if dtype is None else (dtype,)
    )
    params = []
    for candidate in decision.candidates:
        spec = candidate.spec
        marks: tuple[Any, ...] = ()
        if candidate.status == "rejected":
            reason = f"{spec.label} cannot run here: " + "; ".join(candidate.reasons)
            marks = (pytest.mark.skip(reason=reason),)
        params.append(pytest.param(spec, id=spec.label, marks=marks))
    return params


def parametrize_implementations(
    op: Any,
    *,
    dtype: str | None = "float32",
    platform: PlatformLike = None,
    registry: KernelRegistry | None = None,
    argname: str = "implementation",
) -> pytest.MarkDecorator:
    """``pytest.mark.parametrize(argname, ...)`` over every implementation of ``op``.

    Eligibility is decided for ``dtype`` (``None``: dtype-restricted implementations
    are skipped, since the call's dtype is unknown) on ``platform`` (default: here).
    """
    params = implementation_params(op, dtype=dtype, platform=platform, registry=registry)
    return pytest.mark.parametrize(argname, params)

"""Every error kernreg raises survives pickling: a worker process hands it to its parent."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from kernreg import KernelRegistry, KernelSpec
from kernreg.config import Config
from kernreg.errors import (
    BackendNotFoundError,
    ConfigError,
    DemotionError,
    DuplicateReferenceError,
    InvalidSpecError,
    KernelConflictError,
    KernelLoadError,
    KernregError,
    NoEligibleKernelError,
    OpNotFoundError,
    PluginLoadError,
    RegistryFrozenError,
    StrictFallbackError,
    WhenPredicateError,
)
from kernreg.measurement import TuningDataError
from kernreg.plan import PlanError
from kernreg.tuning import TuningStoreError

SPEC = KernelSpec("demo.scale", "triton", "pkg_a.k:scale", priority=5)
OTHER = KernelSpec("demo.scale", "triton", "pkg_b.k:scale", priority=5)


def _raised(registry: KernelRegistry, call: Any) -> KernregError:
    with pytest.raises(KernregError) as info:
        call(registry)
    return info.value


def _made_by_a_registry(registry: KernelRegistry) -> list[KernregError]:
    registry.register(KernelSpec("demo.scale", "torch", "math:fabs", reference=True))
    registry.register(SPEC)
    registry.register(KernelSpec("demo.gated", "cuda_only", "math:fabs", requires=["cuda"]))
    registry.register(KernelSpec("demo.gated", "torch", "math:fabs", reference=True))
    registry.register(KernelSpec("demo.tied", "a", "math:fabs"))
    registry.register(KernelSpec("demo.tied", "b", "math:fabs"))
    registry.register(KernelSpec("demo.broken", "torch", "no_such_module_here:f"))
    calls = [
        lambda r: r.register(OTHER),
        lambda r: r.register(KernelSpec("demo.scale", "aot", "math:fabs", reference=True)),
        lambda r: r.select("demo.scal"),
        lambda r: r.select("demo.scale", backend="trito"),
        lambda r: r.select("demo.gated"),
        lambda r: r.select("demo.tied"),
        lambda r: r.get_kernel("demo.broken"),
    ]
    return [_raised(registry, call) for call in calls]


def _made_directly() -> list[KernregError]:
    return [
        InvalidSpecError("op", "Bad", "lower-case dotted segments"),
        ConfigError("KERNREG_STRICT", "maybe", "expected 0 or 1"),
        PluginLoadError("plugin failed", "dist-a", "ep"),
        WhenPredicateError(SPEC, "pkg:when", ValueError("boom")),
        DemotionError("demo.scale", "triton", "float32 on cpu", "ValueError: boom"),
        RegistryFrozenError("frozen"),
        PlanError("plan.json", "not JSON"),
        TuningDataError("bad row"),
        TuningStoreError("/tmp/x.sqlite", "read-only"),
    ]


def _same(a: KernregError, b: KernregError) -> None:
    assert type(b) is type(a)
    assert str(b) == str(a)
    assert vars(b).keys() == vars(a).keys()
    for name in ("op", "backend", "old", "new", "spec", "key", "value", "path", "source"):
        if hasattr(a, name):
            assert getattr(b, name) == getattr(a, name), name


def test_every_error_pickles_with_its_message_and_attributes() -> None:
    registry = KernelRegistry(config=Config(strict=True))
    errors = _made_by_a_registry(registry) + _made_directly()
    kinds = {type(e) for e in errors}
    assert {KernelConflictError, DuplicateReferenceError, OpNotFoundError} <= kinds
    assert {BackendNotFoundError, StrictFallbackError, KernelLoadError} <= kinds
    for error in errors:
        _same(error, pickle.loads(pickle.dumps(error)))


def test_a_decision_error_pickled_keeps_its_decision() -> None:
    registry = KernelRegistry(config=Config())
    registry.register(KernelSpec("demo.gated", "cuda_only", "math:fabs", requires=["cuda"]))
    with pytest.raises(NoEligibleKernelError) as info:
        registry.select("demo.gated")
    copy = pickle.loads(pickle.dumps(info.value))
    assert copy.decision == info.value.decision
    assert "cuda_only" in str(copy)

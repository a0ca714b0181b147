"""``when`` predicates that take no arguments read process state: decided once, not per call."""

from __future__ import annotations

import kernreg
from kernreg import KernelRegistry, KernelSpec, Platform
from kernreg.config import Config

_state = {"on": False, "calls": 0}


def switch_on() -> bool:
    _state["calls"] += 1
    return _state["on"]


def per_call(x: object) -> bool:
    return True


def fast(x: int) -> str:
    return "fast"


def slow(x: int) -> str:
    return "reference"


def _registry() -> KernelRegistry:
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    registry.register(KernelSpec("demo.state", "torch", slow, reference=True))
    registry.register(KernelSpec("demo.state", "fast", fast, when=switch_on, priority=5))
    return registry


def test_process_state_predicate_is_decided_not_conditional() -> None:
    _state.update(on=False, calls=0)
    registry = _registry()
    decision = registry.explain("demo.state")
    assert decision.chosen is not None
    assert decision.chosen.backend == "torch"
    assert decision.conditional == ()
    assert decision.candidate("fast").reasons == (
        "when predicate is false (process state, checked when deciding)",
    )


def test_op_object_does_not_evaluate_it_per_call_and_follows_a_change() -> None:
    _state.update(on=False, calls=0)
    registry = _registry()
    op = kernreg.op("demo.state", registry=registry)(slow)
    assert [op(1) for _ in range(5)] == ["reference"] * 5
    assert _state["calls"] == 1  # once, when deciding
    _state["on"] = True
    assert op(1) == "reference"  # still the cached decision: nobody said the state changed
    kernreg.registry.process_state_changed()
    assert [op(1) for _ in range(5)] == ["fast"] * 5
    assert _state["calls"] == 2
    _state["on"] = False
    kernreg.registry.process_state_changed()
    assert op(1) == "reference"


def test_predicate_with_parameters_stays_per_call() -> None:
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    registry.register(KernelSpec("demo.call", "torch", slow, reference=True))
    registry.register(KernelSpec("demo.call", "fast", fast, when=per_call, priority=5))
    assert [s.label for s in registry.explain("demo.call").conditional] == ["fast"]

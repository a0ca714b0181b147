"""What the hardening tests share: a snapshot of everything a registry holds, so a failed
call can be shown to have changed nothing (imported by the tests beside this file)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kernreg import KernelRegistry, KernregError


def registry_state(registry: KernelRegistry) -> tuple[Any, ...]:
    """Specs (with their origins), references, overrides, frozenness and every decision."""
    specs = registry.all_specs()
    return (
        [(spec, spec.origin) for spec in specs],
        {op: registry.reference(op) for op in registry.ops()},
        [(o.kind, o.old, o.new, o.origin) for o in registry.overrides()],
        registry.frozen,
        {op: _outcome(registry, op) for op in registry.ops()},
    )


def _outcome(registry: KernelRegistry, op: str) -> tuple[Any, ...]:
    decision = registry.explain(op)
    return (
        decision.rule,
        decision.chosen,
        tuple((c.spec.key, c.status, c.reasons) for c in decision.candidates),
    )


def assert_fails_cleanly(
    registry: KernelRegistry,
    call: Callable[[], object],
    error: type[KernregError],
    builtin: type[Exception],
    *named: str,
) -> KernregError:
    """``call`` raises ``error`` (a ``builtin``), its message names every string in
    ``named``, and the registry is exactly as it was before."""
    before = registry_state(registry)
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert isinstance(info.value, builtin)
    message = str(info.value)
    for text in named:
        assert text in message, f"{text!r} not named in: {message}"
    assert registry_state(registry) == before
    return info.value

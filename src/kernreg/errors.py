"""The exceptions kernreg raises, each naming the object at fault and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

__all__ = [
    "AmbiguousKernelError",
    "BackendNotFoundError",
    "ConfigError",
    "DemotionError",
    "DemotionWarning",
    "DuplicateReferenceError",
    "InvalidSpecError",
    "KernelConflictError",
    "KernelLoadError",
    "KernregError",
    "KernregWarning",
    "NoEligibleKernelError",
    "OpNotFoundError",
    "PluginLoadError",
    "RegistryFrozenError",
    "StrictFallbackError",
    "WhenPredicateError",
    "close_names",
    "close_op_ids",
    "did_you_mean",
]


class KernregError(Exception):
    """Base class of every error kernreg raises on purpose."""

    def __reduce__(self) -> Any:
        # Rebuilt from its message and attributes, not by calling ``__init__`` again with the
        # message: a worker process's error reaches its parent whole.
        return _rebuilt, (type(self), self.args), self.__dict__


def _rebuilt(cls: type[KernregError], args: tuple[Any, ...]) -> KernregError:
    error = cls.__new__(cls)
    error.args = args
    return error


class KernregWarning(UserWarning):
    """Base class of the warnings kernreg gives about something it left undone."""


class InvalidSpecError(KernregError, ValueError):
    """A field (``field``) of a spec, requirement, platform or name is malformed (``value``)."""

    def __init__(self, field: str, value: object, why: str) -> None:
        self.field, self.value, self.why = field, value, why
        super().__init__(f"invalid {field} {value!r}: {why}")


class _TwoSpecsError(KernregError, ValueError):
    # ``old`` and ``new`` are KernelSpec objects (typed Any: the spec module imports this one).
    def __init__(self, message: str, old: Any, new: Any) -> None:
        self.old, self.new = old, new
        super().__init__(message)


class KernelConflictError(_TwoSpecsError):
    """Two different specs (``old``, ``new``) were registered for one ``(op, backend, variant)``."""


class DuplicateReferenceError(_TwoSpecsError):
    """A second ``reference=True`` implementation (``new``) was registered for an op."""


class _MessageKeyError(KernregError, KeyError):
    # KeyError.__str__ quotes its argument; these messages are meant to be read as they are.
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def close_op_ids(op: object, known: Iterable[str], limit: int = 3) -> list[str]:
    """The registered op ids ``op`` most likely meant: ids with its last segment, else close
    spellings of the id or of its last segment, else the ops of a group it names."""
    if not isinstance(op, str) or not op:
        return []
    word = op.lower()
    tail = word.rpartition(".")[2]
    tails = {k: k.rpartition(".")[2] for k in sorted(set(known))}
    found = (
        [k for k, t in tails.items() if t == tail and k != op]
        or close_names(word, tails, limit)
        or [k for c in close_names(tail, tails.values(), limit) for k in tails if tails[k] == c]
        or [k for k in tails if k.startswith(word + ".")]
    )
    return [k for k in dict.fromkeys(found) if k != op][:limit]


def close_names(word: str, candidates: Iterable[str], limit: int = 3) -> list[str]:
    """The ``candidates`` (backends, variables...) that ``word`` most likely misspells:
    difflib's close matches, keeping only those about as close as the best one."""
    matches = difflib.get_close_matches(word, sorted(set(candidates)), n=limit, cutoff=0.75)
    ratios = [difflib.SequenceMatcher(None, word, m).ratio() for m in matches]
    return [m for m, ratio in zip(matches, ratios, strict=True) if ratio >= ratios[0] - 0.05]


def did_you_mean(suggestions: Iterable[str]) -> str:
    """``"did you mean 'a.b'?"`` (or ``'a.b' or 'c.d'``); empty when there is nothing to say."""
    quoted = " or ".join(f"'{s}'" for s in suggestions)
    return f"did you mean {quoted}?" if quoted else ""


class OpNotFoundError(_MessageKeyError):
    """No implementation is registered for an op id; ``suggestions``: what was probably meant."""

    def __init__(self, op: str, known: Iterable[str] = ()) -> None:
        self.op = op
        self.suggestions = tuple(close_op_ids(op, known))
        hint = did_you_mean(self.suggestions)
        super().__init__(f"No kernels registered for op '{op}'" + (f"; {hint}" if hint else ""))


class BackendNotFoundError(_MessageKeyError):
    """The op exists but has no implementation from the requested backend."""

    def __init__(
        self, op: str, backend: str, variant: str | None = None, known: tuple[str, ...] = ()
    ) -> None:
        self.op, self.backend, self.variant = op, backend, variant
        label = backend if not variant else f"{backend}/{variant}"
        message = f"No '{label}' backend registered for op '{op}'"
        if known:
            message += f"; registered: {', '.join(known)}"
            backends = {k.partition("/")[0] for k in known}
            if backend not in backends and (close := close_names(backend, backends)):
                message += f"; {did_you_mean(close)}"
        super().__init__(message)


class RegistryFrozenError(KernregError, RuntimeError):
    """The registry was frozen and a mutation was attempted."""


class KernelLoadError(KernregError, ImportError):
    """Importing or resolving an implementation's target failed."""

    def __init__(self, spec: Any, cause: BaseException) -> None:
        self.spec, self.cause = spec, cause
        super().__init__(
            f"Cannot load kernel for op '{spec.op}', backend '{spec.label}': target "
            f"{spec.target_name!r} failed with {type(cause).__name__}: {cause}"
            f" (registered at {spec.origin})"
        )


class ConfigError(KernregError, ValueError):
    """A configuration value (environment variable or TOML key) is invalid."""

    def __init__(self, key: str, value: Any, why: str) -> None:
        self.key, self.value = key, value
        super().__init__(f"invalid configuration {key}={value!r}: {why}")


class _DecisionError(KernregError):
    """An error carrying the decision that raised it (a kernreg.selection.Decision, typed
    Any: that module imports this one). Given a function instead, the error calls it when
    the decision is first read: start-up decides every op and reads few of its errors (59 of
    sglang's 476 ops fail on cuda:9.0; a first decision: 6.3 µs per op, 4.7 µs with this,
    benchmarks/bench_sglang.py --startup)."""

    _decision: Any
    _extra: tuple[Any, ...] = ()  # the arguments after the decision

    @property
    def decision(self) -> Any:
        made = self._decision
        if callable(made):  # two threads may both make it: equal decisions
            made = self._decision = made()
            _ARGS.__set__(self, (made, *self._extra))
        return made

    @property
    def args(self) -> tuple[Any, ...]:
        _ = self.decision  # made now: args carry it
        return tuple(_ARGS.__get__(self))

    @args.setter
    def args(self, value: Any) -> None:
        _ARGS.__set__(self, value)

    def __reduce__(self) -> Any:
        _ = self.decision
        return super().__reduce__()

    def __repr__(self) -> str:
        _ = self.decision
        return super().__repr__()


_ARGS = BaseException.__dict__["args"]


class AmbiguousKernelError(_DecisionError, ValueError):
    """Several eligible implementations share the highest priority."""

    def __init__(self, decision: Any) -> None:
        self._decision = decision
        super().__init__(*(() if callable(decision) else (decision,)))

    def __str__(self) -> str:
        decision = self.decision
        names = ", ".join(f"'{c.spec.label}'" for c in decision.tied)
        return (
            f"Ambiguous kernel selection for op '{decision.op}': {names} are all eligible "
            f"with priority {decision.tied[0].spec.priority}. Give them different priorities, "
            f"pin one (KERNREG_PIN={decision.op}=<backend>) or pass backend=.\n{decision}"
        )


class NoEligibleKernelError(_DecisionError, LookupError):
    """No implementation of the op can run for this call; ``decision`` says why."""

    def __init__(self, decision: Any, headline: str | None = None) -> None:
        self._decision, self.headline, self._extra = decision, headline, (headline,)
        super().__init__(*(() if callable(decision) else (decision,)), headline)

    def __str__(self) -> str:
        decision = self.decision
        headline = self.headline or f"No eligible kernel for op '{decision.op}'"
        if self.headline is None and decision.reason:
            headline += f": {decision.reason}"
        return f"{headline}\n{decision}"


class StrictFallbackError(NoEligibleKernelError):
    """Strict mode forbade falling back to the reference implementation."""


class PluginLoadError(KernregError, RuntimeError):
    """A plugin could not be loaded (strict mode), naming its distribution and entry point."""

    def __init__(
        self, message: str, distribution: str | None = None, entry_point: str | None = None
    ) -> None:
        self.distribution, self.entry_point = distribution, entry_point
        super().__init__(message)


class WhenPredicateError(KernregError, RuntimeError):
    """A process-state ``when`` predicate (one taking no arguments) raised while deciding."""

    def __init__(self, spec: Any, when: str, cause: BaseException) -> None:
        self.spec, self.cause = spec, cause
        origin = f" (registered at {spec.origin})" if spec.origin is not None else ""
        super().__init__(
            f"the when predicate {when!r} of op '{spec.op}', implementation '{spec.label}'"
            f"{origin} raised {type(cause).__name__}: {cause}; a process-state predicate "
            "is called when deciding and must return true or false: fix it, or unregister "
            "that implementation"
        )


class DemotionWarning(KernregWarning):
    """An implementation raised under the demotion policy (``KERNREG_DEMOTE``) and was demoted."""


class DemotionError(KernregError, RuntimeError):
    """An implementation raised under the demotion policy where strict mode forbids falling
    back; the original exception is its ``__cause__``."""

    def __init__(self, op: str, implementation: str, where: str, error: str) -> None:
        self.op, self.implementation = op, implementation
        super().__init__(
            f"op '{op}': {implementation} raised {error} on {where}; strict mode "
            f"(KERNREG_STRICT or strict=True) forbids demoting it and falling back"
        )

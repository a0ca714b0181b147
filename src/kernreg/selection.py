"""The decision: which implementation of an op runs, and why. Pure functions over plain data.

:func:`decide` applies :data:`RULES`, one function per rule, in the documented order
(the first that decides wins; the others pass on):

1. an explicit ``backend=`` (and ``variant=``) from the caller: strict (``_explicit``);
2. a pin: a scoped one (:func:`kernreg.use_backend`), then the loaded selection plan, then
   one from configuration: strict (``_scoped_pin``, ``_plan``, ``_configured_pin``); a
   compile-safe region (:func:`kernreg.pins.compile_region`) pins nothing: it rejects
   every candidate that is not compile-safe, and no plan applies inside it;
3. the debugging switch ``KERNREG_BACKEND``: used where eligible, else step 4 goes on
   (``_env_backend``);
4. the remaining candidates minus denied backends, filtered by eligibility (``_deny``);
5. measured speed under the autotune policy, else the highest priority; a tie is an
   ambiguity, never broken by order (``_measured``, ``_priority``);
6. otherwise the reference, unless strict mode forbids the fallback (``_reference``).

The registry caches decisions and the dispatch layer turns them into callables; neither
decides anything itself, so :func:`explain` and the hot path tell the same story.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from kernreg._frozen import Frozen
from kernreg._names import display_label
from kernreg._packages import assuming, missing_reason
from kernreg.autotune import choose_measured
from kernreg.config import Config, Pin
from kernreg.errors import close_names, did_you_mean
from kernreg.pins import COMPILE_REGION
from kernreg.plan import PlanEntry
from kernreg.platform import Platform, Requirement
from kernreg.spec import KernelSpec

if TYPE_CHECKING:
    from kernreg.measurement import Measurement

__all__ = [
    "Ambiguity",
    "Candidate",
    "Decision",
    "Rule",
    "decide",
    "find_ambiguities_in",
]


Rule = Literal[
    "explicit",
    "scoped_pin",
    "plan",
    "pin",
    "autotune",
    "env_backend",
    "priority",
    "reference",
    "ambiguous",
    "none",
]
Status = Literal["chosen", "eligible", "conditional", "rejected"]

#: A call's arguments, when a decision is made for one call (``when`` predicates need them).
Call = tuple[Sequence[Any], Mapping[str, Any]]


class Candidate(Frozen):
    """One implementation as the decision saw it: eligible or not, and every reason."""

    __slots__ = ("spec", "eligible", "status", "reasons")
    spec: KernelSpec
    eligible: bool
    status: Status
    reasons: tuple[str, ...]

    def __init__(
        self, spec: KernelSpec, eligible: bool, status: Status, reasons: tuple[str, ...]
    ) -> None:
        # object.__setattr__ directly: a decision builds one Candidate per implementation.
        set_ = object.__setattr__
        set_(self, "spec", spec)
        set_(self, "eligible", eligible)
        set_(self, "status", status)
        set_(self, "reasons", reasons)

    def describe(self) -> dict[str, object]:
        return {
            "backend": self.spec.backend,
            "variant": self.spec.variant,
            "label": self.spec.label,
            "priority": self.spec.priority,
            "reference": self.spec.reference,
            "eligible": self.eligible,
            "status": self.status,
            "reasons": list(self.reasons),
            "target": self.spec.target_name,
            "origin": None if self.spec.origin is None else str(self.spec.origin),
        }


class Decision(Frozen):
    """The whole decision for one op, platform and call signature.

    ``chosen`` is ``None`` when nothing can run (``rule`` ``"none"``) or several
    candidates tie (``rule`` ``"ambiguous"``, see ``tied``). ``conditional`` lists,
    highest priority first, candidates whose ``when`` predicate outranks the choice
    and is checked per call.

    The explanation (``candidates``, ``notes``, ``tied``, ``reason``) is built when first
    read: a process decides every op at start-up and reads few explanations.
    """

    __slots__ = (
        "op",
        "chosen",
        "rule",
        "platform",
        "dtypes",
        "conditional",
        "strict_error",
        "plan_miss",
        "tuning",
        "_explained",
        "_explain",
    )
    op: str
    chosen: KernelSpec | None
    rule: Rule
    platform: Platform
    dtypes: tuple[str, ...] | None
    conditional: tuple[KernelSpec, ...]
    strict_error: bool
    plan_miss: str | None
    tuning: tuple[KernelSpec, ...]
    _explained: tuple[tuple[Candidate, ...], tuple[str, ...], tuple[Candidate, ...], str] | None
    _explain: Callable[[], Decision] | None

    def __init__(
        self,
        op: str,
        chosen: KernelSpec | None,
        rule: Rule,
        candidates: tuple[Candidate, ...],
        platform: Platform,
        dtypes: tuple[str, ...] | None,
        notes: tuple[str, ...] = (),
        tied: tuple[Candidate, ...] = (),
        conditional: tuple[KernelSpec, ...] = (),
        strict_error: bool = False,
        plan_miss: str | None = None,
        tuning: tuple[KernelSpec, ...] = (),
        reason: str = "",
        *,
        explain: Callable[[], Decision] | None = None,
    ) -> None:
        set_ = object.__setattr__  # a decision per op at start-up: no method call per field
        set_(self, "op", op)
        set_(self, "chosen", chosen)
        set_(self, "rule", rule)
        set_(self, "platform", platform)
        set_(self, "dtypes", dtypes)
        set_(self, "conditional", conditional)
        set_(self, "strict_error", strict_error)
        set_(self, "plan_miss", plan_miss)
        set_(self, "tuning", tuning)
        set_(self, "_explained", None if explain else (candidates, notes, tied, reason))
        set_(self, "_explain", explain)

    def _explanation(
        self,
    ) -> tuple[tuple[Candidate, ...], tuple[str, ...], tuple[Candidate, ...], str]:
        explained = self._explained
        if explained is None:
            assert self._explain is not None
            full = self._explain()
            if (full.chosen, full.rule, full.strict_error, full.conditional) != (
                self.chosen,
                self.rule,
                self.strict_error,
                self.conditional,
            ):  # pragma: no cover - the quick outcome and the rules must agree
                raise AssertionError(f"op {self.op}: the explanation disagrees with the decision")
            explained = full._explanation()
            # A cache of derived values: the decision itself is unchanged.
            self._set("_explained", explained)
            self._set("_explain", None)
        return explained

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        """Every implementation of the op as the decision saw it, in canonical order."""
        return self._explanation()[0]

    @property
    def notes(self) -> tuple[str, ...]:
        return self._explanation()[1]

    @property
    def tied(self) -> tuple[Candidate, ...]:
        return self._explanation()[2]

    @property
    def reason(self) -> str:
        """Why nothing is chosen, for the first line of the error (``""``: see the table)."""
        return self._explanation()[3]

    def _key(self) -> tuple[Any, ...]:
        return (*super()._key(), self._explanation())

    def __reduce__(self) -> tuple[Any, ...]:
        self._explanation()
        return super().__reduce__()

    @property
    def ok(self) -> bool:
        return self.chosen is not None and not self.strict_error

    def candidate(self, backend: str, variant: str = "") -> Candidate:
        for cand in self.candidates:
            if cand.spec.backend == backend and cand.spec.variant == variant:
                return cand
        raise KeyError((backend, variant))

    def describe(self) -> dict[str, object]:
        """A JSON-ready form of the decision (the CLI's ``--json``)."""
        return {
            "op": self.op,
            "platform": str(self.platform),
            "dtypes": None if self.dtypes is None else list(self.dtypes),
            "chosen": None if self.chosen is None else self.chosen.label,
            "rule": self.rule,
            "ok": self.ok,
            "notes": list(self.notes),
            "tied": [c.spec.label for c in self.tied],
            "conditional": [s.label for s in self.conditional],
            "plan_miss": self.plan_miss,
            "tuning": [s.label for s in self.tuning],
            "candidates": [c.describe() for c in self.candidates],
        }

    def __str__(self) -> str:
        dtypes = "any dtype" if self.dtypes is None else ", ".join(self.dtypes) or "no dtype"
        if self.chosen is not None and not self.strict_error:
            outcome = f"-> {self.chosen.label} (rule: {self.rule})"
        elif self.rule == "ambiguous":
            outcome = "-> ambiguous: " + ", ".join(c.spec.label for c in self.tied)
        elif self.strict_error:
            outcome = "-> strict mode forbids falling back to the reference"
        else:
            outcome = "-> nothing eligible"
        where = str(self.platform)
        if self.platform.device == "unknown":  # say what the call carried as its device
            where += f" [{self.platform.source}]"
        lines = [f"op {self.op} on {where}, {dtypes} {outcome}"]
        width = max((len(_row_label(c)) for c in self.candidates), default=0)
        for cand in self.candidates:
            reasons = "; ".join(cand.reasons)
            lines.append(
                f"  {cand.status:<11} {_row_label(cand):<{width}}  priority {cand.spec.priority:>4}  {reasons}"
            )
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


def _fmt(measurement: Measurement) -> str:
    """A measurement as the decision table shows it."""
    return f"{measurement.median_ns / 1e3:.3g} us +- {measurement.spread_ns / 1e3:.2g}"


def _row_label(cand: Candidate) -> str:
    return display_label(cand.spec.label, cand.spec.reference)


class _Check:
    """Mutable scratch state of one candidate while the decision is made."""

    __slots__ = ("conditional", "rejections", "spec")

    def __init__(self, spec: KernelSpec) -> None:
        self.spec = spec
        self.rejections: list[str] = []
        self.conditional = False


def _check_eligibility(
    spec: KernelSpec,
    platform: Platform,
    dtypes: tuple[str, ...] | None,
    traits: frozenset[str],
    call: Call | None,
    packages_reason: Callable[[str], str | None],
    region: bool = False,
) -> _Check:
    check = _Check(spec)
    # Each field read once: a decision checks every implementation of the op.
    requires, spec_dtypes, packages = spec.requires, spec.dtypes, spec.packages
    # Requirements are alternatives: rejected when every one fails (matches() is the reason).
    if requires and all(req.matches(platform) for req in requires):
        reasons = [req.matches(platform) or "" for req in _sorted_requirements(requires)]
        check.rejections.append("; ".join(reasons))
    if spec_dtypes:
        if dtypes is None:
            allowed = ", ".join(sorted(spec_dtypes))
            check.rejections.append(
                f"accepts only {allowed}; the call's dtypes are unknown (pass dtypes=)"
            )
        else:
            bad = [d for d in dtypes if d not in spec_dtypes]
            if bad:
                allowed = ", ".join(sorted(spec_dtypes))
                check.rejections.append(
                    f"accepts only {allowed}, not {', '.join(sorted(set(bad)))}"
                )
    if packages:
        for requirement in sorted(packages):
            reason = packages_reason(requirement)
            if reason:
                check.rejections.append(reason)
    if traits:
        missing = traits - spec.traits
        if missing:
            check.rejections.append(f"lacks required traits: {', '.join(sorted(missing))}")
    if region and not compile_safe(spec):
        check.rejections.append("not compile_safe: inside a compile-safe region")
    if spec.when is not None and not check.rejections:
        state = process_state_predicate(spec)
        if state is not None:
            try:
                holds = state()
            except Exception as exc:  # name the op and implementation it gates
                from kernreg.errors import WhenPredicateError
                from kernreg.spec import target_name

                raise WhenPredicateError(spec, target_name(spec.when), exc) from exc
            if not holds:
                check.rejections.append(PROCESS_STATE_FALSE)
        elif call is None:
            check.conditional = True
        else:
            predicate = spec.load_when()
            assert predicate is not None
            if not predicate(*call[0], **call[1]):
                check.rejections.append("when predicate is false for this call")
    return check


def compile_safe(spec: KernelSpec) -> bool:
    """Whether a compile-safe region accepts ``spec``: it declares ``compile_safe``, or it
    is a plain-torch reference (as sglang's ``forward_native``, the compile path)."""
    return "compile_safe" in spec.traits or (spec.reference and spec.backend == "torch")


#: The reason a process-state ``when`` predicate gives when it does not hold.
PROCESS_STATE_FALSE = "when predicate is false (process state, checked when deciding)"


def process_state_predicate(spec: KernelSpec) -> Callable[[], object] | None:
    """``spec``'s ``when`` predicate if it takes no arguments (it reads process state, not
    the call, so it is evaluated when the decision is made), else ``None``.

    A predicate whose target cannot be imported is treated as a per-call one (its error
    surfaces where it did before: when the call needs it).
    """
    try:
        predicate = spec.load_when()
    except Exception:
        return None
    if predicate is None or not _takes_no_arguments(predicate):
        return None
    return predicate


def _takes_no_arguments(predicate: Callable[..., Any]) -> bool:
    try:
        return not inspect.signature(predicate).parameters
    except (TypeError, ValueError):
        return False


def _sorted_requirements(reqs: Iterable[Requirement]) -> list[Requirement]:
    return sorted(reqs, key=Requirement.sort_key)


class _Pick:
    """The outcome of the priority step over some candidates."""

    __slots__ = ("chosen", "conditional", "tied")

    def __init__(
        self, chosen: KernelSpec | None = None, conditional: Sequence[KernelSpec] = ()
    ) -> None:
        self.chosen = chosen
        self.tied: list[KernelSpec] = []
        self.conditional: list[KernelSpec] = list(conditional)


def _pick(checks: Sequence[_Check]) -> _Pick:
    """Highest priority among eligible checks (given in canonical order, highest priority
    first); conditional ones at or above the choice are kept."""
    result = _Pick()
    firm: list[KernelSpec] = []
    for check in checks:
        if check.rejections:
            continue
        if firm and check.spec.priority != firm[0].priority:
            break
        if check.conditional:
            result.conditional.append(check.spec)
        else:
            firm.append(check.spec)
    if len(firm) == 1:
        result.chosen = firm[0]
    elif firm:
        result.tied = firm
    return result


def _assumption_notes(specs: Sequence[KernelSpec], config: Config) -> list[str]:
    """A note naming the assumed packages that some spec's package gate reads."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    gated = {canonicalize_name(Requirement(p).name) for s in specs for p in s.packages}
    used = [a for a in config.assume_packages if a.name in gated]
    if not used:
        return []
    sources = sorted({a.source for a in used if a.source})
    via = f" ({', '.join(sources)})" if sources else ""
    return [f"packages assumed{via}: {', '.join(map(str, used))}"]


def decide(
    op: str,
    specs: Sequence[KernelSpec],
    *,
    platform: Platform,
    config: Config,
    backend: str | None = None,
    variant: str | None = None,
    dtypes: tuple[str, ...] | None = None,
    traits: frozenset[str] = frozenset(),
    scoped_pins: tuple[Pin, ...] = (),
    strict: bool | None = None,
    call: Call | None = None,
    planned: PlanEntry | None = None,
    planned_source: str = "",
    autotune: bool = False,
    measured: Mapping[str, Measurement] | None = None,
    packages_reason: Callable[[str], str | None] = missing_reason,
    demoted: Mapping[str, str] | None = None,
) -> Decision:
    """Decide which of ``specs`` (all of op ``op``) runs. Never raises for a selection outcome.

    ``specs`` must be non-empty and are listed in the decision in a canonical order, so
    the result does not depend on the order they were registered in. The caller turns
    ``Decision`` into an exception when nothing (or more than one) can be chosen.
    ``demoted`` maps the labels of demoted implementations to why (docs/fallbacks.md):
    a reason ``demoted: ...`` (demoted for this call's shape bucket) rejects it like a
    denied one; any other is a note (it is demoted in other buckets only).
    """
    # Most ops have one implementation: their specs are kept as given (no list to make).
    ordered = tuple(specs) if len(specs) < 2 else tuple(sorted(specs, key=KernelSpec.sort_key))
    if config.assume_packages:
        packages_reason = assuming(config.assume_packages, packages_reason)
    required_traits = traits | config.traits if config.traits else traits
    strict_mode = config.is_strict(op) if strict is None else strict
    region = COMPILE_REGION in scoped_pins

    # A process-state ``when`` predicate is called once, now: the explanation shows what
    # the decision saw, even when it is read after the state changed.
    gated: dict[tuple[str, str, str], _Check] = {}
    for s in ordered:
        if s.when is not None:
            gated[s.key] = _check_eligibility(
                s, platform, dtypes, required_traits, call, packages_reason, region
            )
    # _Deciding's fields in order (the notes, ``()``, start afresh in the explanation).
    state = (
        op, ordered, gated, (), platform, config, backend, variant, dtypes, required_traits,
        call, packages_reason, scoped_pins, region, strict_mode, planned, planned_source,
        autotune, measured, demoted or {},
    )  # fmt: skip

    # Only eligibility, priority and the reference fallback decide when no request, pin,
    # plan, switch, deny rule or measurement applies: rules 5b and 6 (_priority,
    # _reference), told apart by a yes/no check of each candidate; the explanation (every
    # reason, in words) is built when the decision is first read, from the arguments
    # kept in a partial (no scratch state, no strings: start-up decides every op and reads
    # few explanations; benchmarks/bench_sglang.py --startup: sglang's 476 first decisions
    # cost about 9 us each this way in a fresh process, 24 us with every reason in words).
    if (
        backend is None
        and not scoped_pins
        and (planned is None or not planned.backend)
        and not autotune
        and config.backend is None
        and (not config.pins or config.pin_for(op) is None)
        and not (config.deny and any(rule.matches(op) for rule in config.deny))
        and not demoted
    ):
        chosen: KernelSpec | None = None
        firm = 0
        conditional: tuple[KernelSpec, ...] = ()
        reference: KernelSpec | None = None
        for spec in ordered:
            check = gated.get(spec.key) if gated else None
            eligible: bool | None
            if check is None:
                eligible = _eligible(spec, platform, dtypes, required_traits, packages_reason)
            else:
                eligible = None if check.conditional else not check.rejections
            if spec.reference:
                reference = spec if eligible else None
            elif chosen is not None and spec.priority != chosen.priority:
                continue
            elif eligible is None:
                conditional += (spec,)
            elif eligible:
                firm += 1
                chosen = spec if chosen is None else chosen
        rule: Rule = "priority" if firm == 1 else "ambiguous"
        if firm > 1:
            chosen = None
        elif not firm:
            chosen, rule = (reference, "reference") if reference is not None else (None, "none")
        return Decision(
            op,
            chosen,
            rule,
            (),
            platform,
            dtypes,
            conditional=conditional,
            strict_error=rule == "reference" and strict_mode and len(ordered) > 1,
            explain=functools.partial(_explain, state),
        )
    return _explain(state)


def _explain(state: tuple[Any, ...]) -> Decision:
    return _Deciding(*state).explain()


def _eligible(
    spec: KernelSpec,
    platform: Platform,
    dtypes: tuple[str, ...] | None,
    traits: frozenset[str],
    packages_reason: Callable[[str], str | None],
) -> bool:
    """:func:`_check_eligibility` of a spec without a ``when`` predicate, without the reasons."""
    requires, spec_dtypes = spec.requires, spec.dtypes
    if requires:
        for req in requires:
            if req.allows(platform):
                break
        else:
            return False
    if spec_dtypes and (dtypes is None or not spec_dtypes.issuperset(dtypes)):
        return False
    if spec.packages and any(packages_reason(p) for p in spec.packages):
        return False
    return not traits or traits <= spec.traits


@dataclasses.dataclass(slots=True)
class _Deciding:
    """What the rules of one decision share: the candidates, their checks and statuses so
    far, and the notes (scratch state, made and dropped by :func:`decide`)."""

    op: str
    ordered: tuple[KernelSpec, ...]
    checks: dict[tuple[str, str, str], _Check]
    notes: list[str]
    platform: Platform
    config: Config
    backend: str | None
    variant: str | None
    dtypes: tuple[str, ...] | None
    traits: frozenset[str]
    call: Call | None
    packages_reason: Callable[[str], str | None]
    scoped_pins: tuple[Pin, ...]
    region: bool
    strict_mode: bool
    planned: PlanEntry | None
    planned_source: str
    autotune: bool
    measured: Mapping[str, Measurement] | None
    demoted: Mapping[str, str]
    status: dict[tuple[str, str, str], tuple[Status, str]] = dataclasses.field(default_factory=dict)
    plan_miss: str | None = None
    tuning: tuple[KernelSpec, ...] = ()

    def explain(self) -> Decision:
        """The decision with its whole explanation: the rules in order, the first decides.
        They run on a copy of this state: threads may read one decision's table at once."""
        checks = {
            s.key: self.checks.get(s.key)
            or _check_eligibility(
                s,
                self.platform,
                self.dtypes,
                self.traits,
                self.call,
                self.packages_reason,
                self.region,
            )
            for s in self.ordered
        }
        notes = _assumption_notes(self.ordered, self.config) if self.config.assume_packages else []
        state = dataclasses.replace(self, checks=checks, notes=notes, status={})
        for rule in RULES:
            decision = rule(state)
            if decision is not None:
                return decision
        raise AssertionError("the reference rule always decides")  # pragma: no cover

    def finish(
        self,
        rule: Rule,
        pick: _Pick | None,
        *,
        strict_error: bool = False,
        why: str = "",
    ) -> Decision:
        """The decision: every candidate with its status and reasons (``why``: why
        nothing is chosen, for the error's first line)."""
        chosen = pick.chosen if pick else None
        candidates = []
        status = self.status
        for spec in self.ordered:
            key = spec.key
            check = self.checks[key]
            reasons = list(check.rejections)
            if key in status:
                state, reason = status[key]
            elif reasons:
                state, reason = "rejected", ""
            elif check.conditional:
                state, reason = (
                    "conditional",
                    "eligible if its when predicate holds (checked per call)",
                )
            elif spec is chosen:
                state, reason = "chosen", ""
            else:
                state, reason = "eligible", ""
            if reason:
                reasons.append(reason)
            candidates.append(Candidate(spec, not check.rejections, state, tuple(reasons)))
        tied = tuple(c for c in candidates if pick and c.spec in pick.tied)
        conditional = tuple(pick.conditional) if pick and chosen is not None else ()
        if pick and chosen is None and pick.conditional:
            conditional = tuple(pick.conditional)
        return Decision(
            self.op,
            chosen,
            rule,
            tuple(candidates),
            self.platform,
            self.dtypes,
            tuple(self.notes),
            tied,
            conditional,
            strict_error,
            self.plan_miss,
            self.tuning,
            why,
        )

    def strict_pick(self, rule: Rule, source: str, subset: list[_Check]) -> Decision:
        """Choose within ``subset`` only (explicit requests and pins): no fallback."""
        status, checks = self.status, self.checks
        pick = _pick(subset)
        for check in subset:
            outranked = check.spec is not pick.chosen and check.spec not in pick.tied
            if outranked and not check.rejections and not check.conditional:
                status[check.spec.key] = ("eligible", f"outranked within {source}")
        for spec in self.ordered:
            if spec.key not in status and all(spec is not c.spec for c in subset):
                status[spec.key] = (
                    "rejected" if checks[spec.key].rejections else "eligible",
                    f"not selected: {source}",
                )
        if pick.chosen is not None:
            status[pick.chosen.key] = ("chosen", f"selected by {source}")
            return self.finish(rule, pick)
        if pick.tied:
            return self.finish("ambiguous", pick)
        self.notes.append(f"{source} is strict: no fallback")
        return self.finish("none", pick, why=f"{source} is strict: no fallback")

    def matching(self, name: str, var: str | None) -> list[_Check]:
        """The checks of the implementations of backend ``name`` (and variant ``var``)."""
        return [
            self.checks[s.key]
            for s in self.ordered
            if s.backend == name and (var is None or s.variant == var)
        ]

    def apply_pin(self, pin: Pin | None, rule: Rule) -> Decision | None:
        """Decide by ``pin`` if it names this op; ``None`` passes on."""
        if pin is None or not pin.matches(self.op):
            return None
        subset = self.matching(pin.backend, pin.variant)
        source = f"pin {pin}" + (f" ({pin.source})" if pin.source else "")
        if subset:
            return self.strict_pick(rule, source, subset)
        if pin.exact:
            label = pin.backend if pin.variant is None else f"{pin.backend}/{pin.variant}"
            labels = [s.label for s in self.ordered]
            backends = sorted({s.backend for s in self.ordered})
            why = (
                f"no implementation of op '{self.op}' has backend '{label}' "
                f"(registered: {', '.join(labels)})"
            )
            if pin.backend not in backends:
                hint = did_you_mean(close_names(pin.backend, backends))
                why += f"; {hint}" if hint else ""
            for spec in self.ordered:
                rejected = bool(self.checks[spec.key].rejections)
                self.status[spec.key] = (
                    "rejected" if rejected else "eligible",
                    f"not selected: {source}",
                )
            self.notes.append(f"{source}: {why}")
            return self.finish("none", None, why=f"{source}: {why}")
        self.notes.append(f"{source} does not apply: no '{pin.backend}' implementation")
        return None


# --- the rules, in order: each decides or passes on (returns None) ---------------------------


def _explicit(d: _Deciding) -> Decision | None:
    """1. An explicit ``backend=`` (and ``variant=``) from the caller: strict."""
    if d.backend is None:
        return None
    subset = d.matching(d.backend, d.variant)
    source = f"backend={d.backend}" + (f", variant={d.variant}" if d.variant is not None else "")
    if not subset:
        d.notes.append(f"no implementation matches {source}")
        return d.finish("none", None)
    return d.strict_pick("explicit", source, subset)


def _scoped_pin(d: _Deciding) -> Decision | None:
    """2a. The innermost :func:`kernreg.use_backend` pin that applies: strict. A glob pin
    without an implementation of its backend passes on to the enclosing pins. A
    compile-safe region pins nothing: its check of each candidate was made up front."""
    if d.region:
        d.notes.append(
            "inside a compile-safe region (kernreg.pins.compile_region): only compile_safe "
            "implementations and a plain-torch reference are eligible; no plan applies"
        )
    for pin in d.scoped_pins:
        if pin is COMPILE_REGION:
            continue
        decision = d.apply_pin(pin, "scoped_pin")
        if decision is not None:
            return decision
    return None


def _plan(d: _Deciding) -> Decision | None:
    """2b. The loaded selection plan, unless denied; a miss is noted (strict: nothing runs)."""
    planned, checks, status = d.planned, d.checks, d.status
    if planned is None or not planned.backend or d.region:  # plans record eager decisions
        return None
    subset = d.matching(planned.backend, planned.variant)
    source = f"plan {d.planned_source}".rstrip()
    # A deny rule wins over a plan: it is the switch that turns a broken kernel off.
    denials = {
        c.spec.key: f"denied by {hit.source or 'deny'} ({hit}), which wins over the {source}"
        for c in subset
        if (hit := d.config.denied(d.op, c.spec.backend, c.spec.variant)) is not None
    }
    usable = [
        c for c in subset if not c.rejections and not c.conditional and c.spec.key not in denials
    ]
    if usable:
        status[usable[0].spec.key] = ("chosen", f"selected by the {source}")
        for spec in d.ordered:
            if spec.key not in status:
                state: Status = "rejected" if checks[spec.key].rejections else "eligible"
                status[spec.key] = (state, f"not selected: {source}")
        return d.finish("plan", _Pick(usable[0].spec))
    reasons = [*subset[0].rejections, *denials.values()] if subset else []
    why = "; ".join(reasons) if reasons else "not registered"
    miss = f"planned {planned.label} is not available here ({why})"
    d.plan_miss = miss
    if d.strict_mode:
        d.notes.append(f"{miss}; strict mode forbids choosing anything else")
        return d.finish("none", None)
    d.notes.append(f"{miss}; decided normally")
    return None


def _configured_pin(d: _Deciding) -> Decision | None:
    """2c. A pin from configuration (``KERNREG_PIN``, site pins): strict."""
    return d.apply_pin(d.config.pin_for(d.op), "pin")


def _env_backend(d: _Deciding) -> Decision | None:
    """3. The debugging switch ``KERNREG_BACKEND``: used where eligible, else passes on."""
    backend = d.config.backend
    if backend is None:
        return None
    pick = _pick(d.matching(backend, None))
    if pick.chosen is not None and not pick.conditional:
        d.status[pick.chosen.key] = ("chosen", f"selected by KERNREG_BACKEND={backend}")
        return d.finish("env_backend", pick)
    d.notes.append(f"KERNREG_BACKEND={backend} not eligible here; normal selection")
    return None


def _deny(d: _Deciding) -> Decision | None:
    """4. Denied and demoted backends become ineligible (eligibility was checked up
    front); passes on."""
    for spec in d.ordered:
        rule_hit = d.config.denied(d.op, spec.backend, spec.variant)
        if rule_hit is not None:
            d.checks[spec.key].rejections.append(
                f"denied by {rule_hit.source or 'deny'} ({rule_hit})"
            )
        why = d.demoted.get(spec.label)
        if why is not None and why.startswith("demoted:"):
            d.checks[spec.key].rejections.append(why)
        elif why is not None:  # demoted in other shape buckets only
            d.notes.append(f"{spec.label} {why}")
    return None


def _measured(d: _Deciding) -> Decision | None:
    """5a. Autotune policy: recorded measurements decide among the firm candidates; without
    them the candidates are noted for measuring and priority decides meanwhile."""
    if not d.autotune:
        return None
    checks, status, measured = d.checks, d.status, d.measured
    firm = [
        s
        for s in d.ordered
        if not checks[s.key].rejections
        and not checks[s.key].conditional
        and not (s.reference and d.strict_mode)
    ]
    # A recorded result decides; a candidate missing from it failed to run when measured.
    timed = [s for s in firm if measured is not None and s.label in measured]
    if len(firm) >= 2 and measured is not None and timed:
        chosen = choose_measured(timed, measured)
        status[chosen.key] = ("chosen", f"fastest measured ({_fmt(measured[chosen.label])})")
        for spec in firm:
            if spec is not chosen:
                why = (
                    f"measured {_fmt(measured[spec.label])}"
                    if spec in timed
                    else "failed when measured"
                )
                status[spec.key] = ("eligible", why)
        return d.finish("autotune", _Pick(chosen))
    if len(firm) >= 2:
        d.tuning = tuple(firm)
        d.notes.append(
            "autotune: " + ", ".join(s.label for s in firm) + " not measured for this call "
            "signature yet (measured on the first call); priority decides until then"
        )
    return None


def _priority(d: _Deciding) -> Decision | None:
    """5b. The highest priority among eligible non-reference candidates; a tie is an
    ambiguity, never broken by order."""
    checks, status = d.checks, d.status
    others = [checks[s.key] for s in d.ordered if not s.reference]
    pick = _pick(others)
    if pick.chosen is not None or pick.tied:
        if pick.chosen is not None:
            status[pick.chosen.key] = ("chosen", "highest priority among eligible")
            for check in others:
                if not check.rejections and not check.conditional and check.spec is not pick.chosen:
                    status[check.spec.key] = ("eligible", f"outranked by {pick.chosen.label}")
        for spec in d.ordered:
            if spec.reference and not checks[spec.key].rejections:
                status[spec.key] = ("eligible", "reference, not needed")
        return d.finish("priority" if pick.chosen is not None else "ambiguous", pick)
    return None


def _reference(d: _Deciding) -> Decision:
    """6. The reference, unless strict mode forbids the fallback; always decides."""
    ordered, status = d.ordered, d.status
    others = [d.checks[s.key] for s in ordered if not s.reference]
    reference = next((s for s in ordered if s.reference), None)
    fallback = _Pick(conditional=_pick(others).conditional)
    if reference is None:
        d.notes.append("no reference implementation registered")
        return d.finish("none", fallback)
    ref_check = d.checks[reference.key]
    if ref_check.rejections or ref_check.conditional:
        d.notes.append("the reference implementation is not eligible either")
        return d.finish("none", fallback)
    fallback.chosen = reference
    if len(ordered) == 1:
        status[reference.key] = ("chosen", "reference (the only implementation)")
        return d.finish("reference", fallback)
    if d.strict_mode:
        status[reference.key] = ("eligible", "reference; fallback forbidden by strict mode")
        d.notes.append(
            "strict mode (KERNREG_STRICT or strict=True) forbids falling back to the reference"
        )
        return d.finish("reference", fallback, strict_error=True)
    status[reference.key] = (
        "chosen",
        "fallback to the reference: no other implementation is eligible",
    )
    return d.finish("reference", fallback)


#: The rules :func:`decide` applies, in the documented order; the first decision wins.
RULES: tuple[Callable[[_Deciding], Decision | None], ...] = (
    _explicit,
    _scoped_pin,
    _plan,
    _configured_pin,
    _env_backend,
    _deny,
    _measured,
    _priority,
    _reference,
)


# --- static overlap check -------------------------------------------------------------------


class Ambiguity(Frozen):
    """Two same-op, same-priority specs that some platform and call could both satisfy."""

    __slots__ = ("op", "first", "second", "reason")
    op: str
    first: KernelSpec
    second: KernelSpec
    reason: str

    def __init__(self, op: str, first: KernelSpec, second: KernelSpec, reason: str) -> None:
        self._set("op", op)
        self._set("first", first)
        self._set("second", second)
        self._set("reason", reason)

    def __str__(self) -> str:
        return (
            f"op '{self.op}': '{self.first.label}' ({self.first.origin}) and '{self.second.label}' "
            f"({self.second.origin}) share priority {self.first.priority} and can both be eligible: "
            f"{self.reason}"
        )

    def describe(self) -> dict[str, object]:
        return {
            "op": self.op,
            "first": self.first.label,
            "second": self.second.label,
            "priority": self.first.priority,
            "first_origin": None if self.first.origin is None else str(self.first.origin),
            "second_origin": None if self.second.origin is None else str(self.second.origin),
            "reason": self.reason,
        }


def _sm_arch(name: str) -> tuple[int, int] | None:
    if name.startswith("sm_") and name[3:].rstrip("abf").isdigit():
        digits = name[3:].rstrip("abf")
        return (int(digits[:-1]), int(digits[-1])) if len(digits) >= 2 else None
    return None


def _window_overlap(a: Requirement, b: Requirement) -> bool:
    lo = max((x for x in (a.min_arch, b.min_arch) if x is not None), default=None)
    hi = min((x for x in (a.max_arch, b.max_arch) if x is not None), default=None)
    return lo is None or hi is None or lo <= hi


def _in_window(arch: tuple[int, int], req: Requirement) -> bool:
    return (req.min_arch is None or arch >= req.min_arch) and (
        req.max_arch is None or arch <= req.max_arch
    )


def _names_fit(names: frozenset[str], other: Requirement) -> bool:
    """Could some arch in ``names`` satisfy ``other``'s window (unknown mappings: assume yes)."""
    if other.min_arch is None and other.max_arch is None:
        return True
    for name in names:
        arch = _sm_arch(name)
        if arch is None or _in_window(arch, other):
            return True
    return False


def requirements_overlap(a: Requirement, b: Requirement) -> bool:
    """Whether some platform satisfies both requirements."""
    if a.device != b.device or not _window_overlap(a, b):
        return False
    if a.archs and b.archs:
        return bool(a.archs & b.archs)
    if a.archs:
        return _names_fit(a.archs, b)
    if b.archs:
        return _names_fit(b.archs, a)
    return True


def _overlap_reason(a: KernelSpec, b: KernelSpec) -> str | None:
    parts = []
    if not a.requires or not b.requires:
        parts.append(
            "devices: " + ("any" if not (a.requires or b.requires) else "one runs anywhere")
        )
    else:
        shared = [
            f"{ra} & {rb}"
            for ra in _sorted_requirements(a.requires)
            for rb in _sorted_requirements(b.requires)
            if requirements_overlap(ra, rb)
        ]
        if not shared:
            return None
        parts.append("devices: " + ", ".join(shared))
    if a.dtypes and b.dtypes:
        common = a.dtypes & b.dtypes
        if not common:
            return None
        parts.append("dtypes: " + ", ".join(sorted(common)))
    else:
        parts.append("dtypes: " + (", ".join(sorted(a.dtypes or b.dtypes)) or "any"))
    if a.when is not None or b.when is not None:
        parts.append("when predicates may both hold")
    return "; ".join(parts)


def find_ambiguities_in(specs_by_op: Mapping[str, Sequence[KernelSpec]]) -> tuple[Ambiguity, ...]:
    found = []
    for op in sorted(specs_by_op):
        candidates = sorted(
            (s for s in specs_by_op[op] if not s.reference), key=KernelSpec.sort_key
        )
        for i, first in enumerate(candidates):
            for second in candidates[i + 1 :]:
                if second.priority != first.priority:
                    break
                reason = _overlap_reason(first, second)
                if reason is not None:
                    found.append(Ambiguity(op, first, second, reason))
    return tuple(found)

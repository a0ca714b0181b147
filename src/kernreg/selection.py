"""The decision: which implementation of an op runs, and why. Pure functions over plain data.

:func:`decide` applies :data:`RULES`, one function per rule, in the documented order; the
first that decides wins. The registry caches decisions and dispatch turns them into
callables; neither decides anything, so :func:`explain` and the hot path tell one story.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from kernreg._frozen import Frozen
from kernreg._names import display_label
from kernreg._packages import assuming, missing_reason
from kernreg.ambiguity import Ambiguity  # where kernreg.Ambiguity points (the check is its own)
from kernreg.autotune import choose_measured
from kernreg.config import Config, Pin
from kernreg.errors import WhenPredicateError, close_names, did_you_mean
from kernreg.measurement import Measurement
from kernreg.pins import COMPILE_REGION
from kernreg.plan import PlanEntry
from kernreg.platform import Platform, Requirement
from kernreg.spec import KernelSpec, target_name

__all__ = [
    "Ambiguity",
    "Candidate",
    "Decision",
    "Rule",
    "decide",
    "quick_choice",
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

#: What :func:`_check` finds: ``()`` (can run), ``None`` (``when`` decides per call), or why not.
Check = tuple[str, ...] | None

#: A rejection by :func:`_check` before its reasons are put in words.
_REJECTED = ("rejected",)


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """One implementation as the decision saw it: eligible or not, and every reason."""

    spec: KernelSpec
    eligible: bool
    status: Status
    reasons: tuple[str, ...]

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


Explanation = tuple[tuple[Candidate, ...], tuple[str, ...], tuple[Candidate, ...], str]


def _explaining(index: int, doc: str = "") -> Any:
    """A property of a decision that reads part ``index`` of its :data:`Explanation`."""
    return property(lambda decision: decision._explanation()[index], doc=doc)


class Decision(Frozen):
    """The whole decision for one op, platform and call signature. ``chosen`` is ``None``
    when nothing can run (rule ``"none"``) or several candidates tie (rule ``"ambiguous"``,
    see ``tied``); ``conditional`` lists, highest priority first, candidates whose ``when``
    predicate outranks the choice and is checked per call. The explanation (``candidates``,
    ``notes``, ``tied``, ``reason``) may be built when first read."""

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
    #: The explanation, or the function that makes the decision again with it.
    _explained: Explanation | Callable[[], Decision]

    def __init__(
        self,
        op: str,
        chosen: KernelSpec | None,
        rule: Rule,
        platform: Platform,
        dtypes: tuple[str, ...] | None,
        explained: Explanation | Callable[[], Decision],
        conditional: tuple[KernelSpec, ...] = (),
        strict_error: bool = False,
        plan_miss: str | None = None,
        tuning: tuple[KernelSpec, ...] = (),
    ) -> None:
        set_ = object.__setattr__  # no method call per field: about 0.5 us of a first decision
        set_(self, "op", op)
        set_(self, "chosen", chosen)
        set_(self, "rule", rule)
        set_(self, "platform", platform)
        set_(self, "dtypes", dtypes)
        set_(self, "conditional", conditional)
        set_(self, "strict_error", strict_error)
        set_(self, "plan_miss", plan_miss)
        set_(self, "tuning", tuning)
        set_(self, "_explained", explained)

    def _explanation(self) -> Explanation:
        explained = self._explained
        if callable(explained):
            full = explained()
            outcome = (full.chosen, full.rule, full.strict_error, full.conditional)
            assert outcome == (self.chosen, self.rule, self.strict_error, self.conditional)
            explained = full._explanation()
            self._set("_explained", explained)  # a cache: the decision itself is unchanged
        return explained

    candidates: tuple[Candidate, ...] = _explaining(
        0, "Every implementation of the op as the decision saw it, in canonical order."
    )
    notes: tuple[str, ...] = _explaining(1)
    tied: tuple[Candidate, ...] = _explaining(2)
    reason: str = _explaining(
        3, "Why nothing is chosen, for the first line of the error (``''``: see the table)."
    )

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
        labels = [display_label(c.spec.label, c.spec.reference) for c in self.candidates]
        width = max(map(len, labels), default=0)
        for cand, label in zip(self.candidates, labels, strict=True):
            reasons = "; ".join(cand.reasons)
            lines.append(
                f"  {cand.status:<11} {label:<{width}}  priority {cand.spec.priority:>4}  {reasons}"
            )
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


def _fmt(measurement: Measurement) -> str:
    return f"{measurement.median_ns / 1e3:.3g} us +- {measurement.spread_ns / 1e3:.2g}"


def _check(
    spec: KernelSpec,
    platform: Platform,
    dtypes: tuple[str, ...] | None,
    traits: frozenset[str],
    call: Call | None,
    packages_reason: Callable[[str], str | None],
    region: bool,
    words: bool = False,
) -> Check:
    """Why ``spec`` cannot run here: ``()`` when it can, ``None`` when its ``when``
    predicate decides per call. Without ``words`` a rejection is :data:`_REJECTED`, and
    the explanation asks again for the reasons: a decision builds no strings."""
    reasons: list[str] = []
    # Requirements are alternatives: rejected when every one fails (matches() is the reason).
    for req in spec.requires:
        if req.allows(platform):
            break
    else:
        if spec.requires:
            if not words:
                return _REJECTED
            ordered = sorted(spec.requires, key=Requirement.sort_key)
            reasons.append("; ".join(req.matches(platform) or "" for req in ordered))
    if spec.dtypes and (dtypes is None or not spec.dtypes.issuperset(dtypes)):
        if not words:
            return _REJECTED
        allowed = ", ".join(sorted(spec.dtypes))
        if dtypes is None:
            reasons.append(f"accepts only {allowed}; the call's dtypes are unknown (pass dtypes=)")
        else:
            bad = ", ".join(sorted(set(dtypes) - spec.dtypes))
            reasons.append(f"accepts only {allowed}, not {bad}")
    if spec.packages and any(map(packages_reason, spec.packages)):
        if not words:
            return _REJECTED
        reasons.extend(filter(None, map(packages_reason, sorted(spec.packages))))
    if traits and not traits <= spec.traits:
        if not words:
            return _REJECTED
        reasons.append(f"lacks required traits: {', '.join(sorted(traits - spec.traits))}")
    # A plain-torch reference (as sglang's forward_native, the compile path) is compile-safe.
    if (
        region
        and "compile_safe" not in spec.traits
        and not (spec.reference and spec.backend == "torch")
    ):
        if not words:
            return _REJECTED
        reasons.append("not compile_safe: inside a compile-safe region")
    if words or spec.when is None:
        return tuple(reasons)
    state = process_state_predicate(spec)
    if state is not None:
        try:
            holds = state()
        except Exception as exc:  # name the op and implementation it gates
            raise WhenPredicateError(spec, target_name(spec.when), exc) from exc
        return () if holds else ("when predicate is false (process state, checked when deciding)",)
    if call is None:
        return None
    predicate = spec.load_when()
    assert predicate is not None
    return () if predicate(*call[0], **call[1]) else ("when predicate is false for this call",)


def process_state_predicate(spec: KernelSpec) -> Callable[[], object] | None:
    """``spec``'s ``when`` predicate if it takes no arguments (it reads process state, not
    the call, so it is evaluated when the decision is made), else ``None``. A predicate
    that cannot be imported counts as a per-call one: its error surfaces at the call."""
    try:
        predicate = spec.load_when()
        takes_none = predicate is not None and not inspect.signature(predicate).parameters
        return predicate if takes_none else None
    except Exception:  # an import error, or a callable without a signature
        return None


def _pick(
    checked: Iterable[tuple[KernelSpec, Check]], references: bool = True
) -> tuple[list[KernelSpec], tuple[KernelSpec, ...]]:
    """The eligible specs of the highest priority among ``checked`` (in canonical order)
    and the conditional ones at or above that priority."""
    firm: list[KernelSpec] = []
    conditional: tuple[KernelSpec, ...] = ()
    for spec, check in checked:
        if check or (spec.reference and not references):  # rejected, or left out
            continue
        if firm and spec.priority != firm[0].priority:
            break
        if check is None:
            conditional += (spec,)
        else:
            firm.append(spec)
    return firm, conditional


def _by_priority(
    checked: Sequence[tuple[KernelSpec, Check]],
) -> tuple[Rule, KernelSpec | None, list[KernelSpec], tuple[KernelSpec, ...]]:
    """Rules 5b and 6 without words: the rule, the choice, the tie and the conditional ones."""
    firm, conditional = _pick(checked, False)
    if len(firm) == 1:
        return "priority", firm[0], [], conditional
    if firm:
        return "ambiguous", None, firm, conditional
    for spec, check in checked:
        if spec.reference:
            if check == ():
                return "reference", spec, [], conditional
            break
    return "none", None, [], conditional


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
    """Decide which of ``specs`` (non-empty, all of op ``op``, in any order) runs; never
    raises for a selection outcome. ``demoted`` maps the labels of demoted implementations
    to why (docs/fallbacks.md): ``demoted: ...`` (for this call's shape bucket) rejects
    one like a deny rule; any other reason is a note."""
    # Most ops have one implementation: their specs are kept as given (no list to sort).
    ordered = specs if len(specs) < 2 else sorted(specs, key=KernelSpec.sort_key)
    if config.assume_packages:
        packages_reason = assuming(config.assume_packages, packages_reason)
    traits = traits | config.traits if config.traits else traits
    region = COMPILE_REGION in scoped_pins
    # Each spec is checked once, now: a process-state ``when`` predicate is called once,
    # and the explanation shows what the decision saw, even when read after a change.
    checked = [
        (s, _check(s, platform, dtypes, traits, call, packages_reason, region)) for s in ordered
    ]
    strict_mode = config.is_strict(op) if strict is None else strict
    state = (
        op, checked, platform, config, backend, variant, dtypes, traits, packages_reason,
        scoped_pins, strict_mode, planned, planned_source, autotune, measured, demoted or {},
    )  # fmt: skip
    # When no request, pin, plan, switch, deny rule or measurement applies, only rules 5b
    # and 6 decide, from the checks alone; the explanation (every status and note, in
    # words) is built when first read: start-up decides every op and reads few
    # explanations (benchmarks/bench_sglang.py --startup).
    if (
        backend is None
        and not scoped_pins
        and (planned is None or not planned.backend)
        and not autotune
        and not demoted
        and _unconfigured(op, config)
    ):
        rule, chosen, _, conditional = _by_priority(checked)
        return Decision(
            op,
            chosen,
            rule,
            platform,
            dtypes,
            lambda: _Deciding(*state).explain(),
            conditional,
            rule == "reference" and strict_mode and len(ordered) > 1,
        )
    return _Deciding(*state).explain()


def _unconfigured(op: str, config: Config) -> bool:
    """Whether no environment backend, pin or deny rule of ``config`` applies to ``op``."""
    return (
        config.backend is None
        and (not config.pins or config.pin_for(op) is None)
        and not (config.deny and any(rule.matches(op) for rule in config.deny))
    )


def quick_choice(
    op: str, specs: Sequence[KernelSpec], platform: Platform, config: Config
) -> tuple[Rule, KernelSpec | None] | None:
    """:func:`decide`'s rule and choice (no spec: a tie, nothing eligible) for a call that asks
    for nothing (no backend, dtypes, traits or pins) when no configuration rule applies,
    without a :class:`Decision`; ``None`` where a fallback or ``when`` predicate needs the whole
    decision. ``specs`` are in canonical order. Start-up decides every op: 4.7 µs per op with
    this, 13.8 µs with the whole decision (benchmarks/bench_sglang.py --startup)."""
    if config.assume_packages or not _unconfigured(op, config):
        return None
    checked = []
    for spec in specs:
        if spec.when is not None:  # evaluated by the decision the explanation shows
            return None
        checked.append(
            (spec, _check(spec, platform, None, config.traits, None, missing_reason, False))
        )
    rule, chosen, _, conditional = _by_priority(checked)
    if conditional or (rule == "reference" and len(specs) > 1):
        return None
    return rule, chosen


@dataclasses.dataclass(eq=False, slots=True)
class _Row:
    """One candidate while the rules run: its check (:data:`Check`) and its status so far."""

    spec: KernelSpec
    check: Check
    status: tuple[Status, str] | None = None

    def reject(self, reason: str) -> None:
        self.check = (*(self.check or ()), reason)


@dataclasses.dataclass(slots=True)
class _Deciding:
    """What the rules of one decision read, and the scratch state they write (made afresh
    for each explanation: threads may read one decision's table at once)."""

    op: str
    checked: Sequence[tuple[KernelSpec, Check]]
    platform: Platform
    config: Config
    backend: str | None
    variant: str | None
    dtypes: tuple[str, ...] | None
    traits: frozenset[str]
    packages_reason: Callable[[str], str | None]
    scoped_pins: tuple[Pin, ...]
    strict_mode: bool
    planned: PlanEntry | None
    planned_source: str
    autotune: bool
    measured: Mapping[str, Measurement] | None
    demoted: Mapping[str, str]
    rows: list[_Row] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    plan_miss: str | None = None
    tuning: tuple[KernelSpec, ...] = ()

    def explain(self) -> Decision:
        """The decision with its whole explanation: the rules in order, the first decides."""
        region = COMPILE_REGION in self.scoped_pins
        args = (self.platform, self.dtypes, self.traits, None, self.packages_reason, region)
        self.rows = [
            _Row(spec, _check(spec, *args, words=True) if check is _REJECTED else check)
            for spec, check in self.checked
        ]
        if self.config.assume_packages:
            self.notes = _assumption_notes([r.spec for r in self.rows], self.config)
        for rule in RULES:
            decision = rule(self)
            if decision is not None:
                return decision
        raise AssertionError("the priority rule always decides")  # pragma: no cover

    def pairs(self, rows: Iterable[_Row] | None = None) -> list[tuple[KernelSpec, Check]]:
        return [(r.spec, r.check) for r in (self.rows if rows is None else rows)]

    def mark(self, spec: KernelSpec, status: Status, reason: str) -> None:
        for row in self.rows:
            if row.spec is spec:
                row.status = (status, reason)

    def not_selected(self, source: str, keep: Sequence[_Row] = ()) -> None:
        """Every row without a status but those in ``keep``: not selected by ``source``."""
        for row in self.rows:
            if row.status is None and row not in keep:
                row.status = ("rejected" if row.check else "eligible", f"not selected: {source}")

    def matching(self, name: str, var: str | None) -> list[_Row]:
        """The rows of the implementations of backend ``name`` (and variant ``var``)."""
        return [r for r in self.rows if r.spec.backend == name and var in (None, r.spec.variant)]

    def finish(
        self,
        rule: Rule,
        chosen: KernelSpec | None = None,
        tied: Sequence[KernelSpec] = (),
        conditional: Sequence[KernelSpec] = (),
        *,
        strict_error: bool = False,
        why: str = "",
    ) -> Decision:
        """The decision: every candidate with its status and reasons (``why``: why
        nothing is chosen, for the error's first line)."""
        candidates = []
        for row in self.rows:
            check = row.check
            if row.status is not None:
                status, reason = row.status
            elif check:
                status, reason = "rejected", ""
            elif check is None:
                status = "conditional"
                reason = "eligible if its when predicate holds (checked per call)"
            else:
                status, reason = ("chosen" if row.spec is chosen else "eligible"), ""
            reasons = (*(check or ()), reason) if reason else check or ()
            candidates.append(Candidate(row.spec, not check, status, reasons))
        ties = tuple(c for c in candidates if c.spec in tied)
        return Decision(
            self.op,
            chosen,
            rule,
            self.platform,
            self.dtypes,
            (tuple(candidates), tuple(self.notes), ties, why),
            tuple(conditional),
            strict_error,
            self.plan_miss,
            self.tuning,
        )

    def strict_pick(self, rule: Rule, source: str, subset: list[_Row]) -> Decision:
        """Choose within ``subset`` only (explicit requests and pins): no fallback."""
        firm, conditional = _pick(self.pairs(subset))
        for row in subset:
            if row.check == () and row.spec not in firm:
                row.status = ("eligible", f"outranked within {source}")
        self.not_selected(source, keep=subset)
        if len(firm) == 1:
            self.mark(firm[0], "chosen", f"selected by {source}")
            return self.finish(rule, firm[0], conditional=conditional)
        if firm:
            return self.finish("ambiguous", tied=firm, conditional=conditional)
        self.notes.append(f"{source} is strict: no fallback")
        return self.finish("none", conditional=conditional, why=f"{source} is strict: no fallback")

    def apply_pin(self, pin: Pin | None, rule: Rule) -> Decision | None:
        """Decide by ``pin`` if it names this op; ``None`` passes on."""
        if pin is None or not pin.matches(self.op):
            return None
        subset = self.matching(pin.backend, pin.variant)
        source = f"pin {pin}" + (f" ({pin.source})" if pin.source else "")
        if subset:
            return self.strict_pick(rule, source, subset)
        if not pin.exact:
            self.notes.append(f"{source} does not apply: no '{pin.backend}' implementation")
            return None
        label = pin.backend if pin.variant is None else f"{pin.backend}/{pin.variant}"
        backends = sorted({r.spec.backend for r in self.rows})
        hint = "" if pin.backend in backends else did_you_mean(close_names(pin.backend, backends))
        why = (
            f"{source}: no implementation of op '{self.op}' has backend '{label}' "
            f"(registered: {', '.join(r.spec.label for r in self.rows)})"
        ) + (f"; {hint}" if hint else "")
        self.not_selected(source)
        self.notes.append(why)
        return self.finish("none", why=why)

    def denial(self, spec: KernelSpec) -> str | None:
        """Why a deny rule excludes ``spec``, or ``None``."""
        hit = self.config.denied(self.op, spec.backend, spec.variant)
        return None if hit is None else f"denied by {hit.source or 'deny'} ({hit})"


# --- the rules, in order: each decides or passes on (returns None) ---------------------------


def _explicit(d: _Deciding) -> Decision | None:
    """1. An explicit ``backend=`` (and ``variant=``) from the caller: strict."""
    if d.backend is None:
        return None
    subset = d.matching(d.backend, d.variant)
    source = f"backend={d.backend}" + (f", variant={d.variant}" if d.variant is not None else "")
    if not subset:
        d.notes.append(f"no implementation matches {source}")
        return d.finish("none")
    return d.strict_pick("explicit", source, subset)


def _scoped_pin(d: _Deciding) -> Decision | None:
    """2a. The innermost :func:`kernreg.use_backend` pin that applies: strict. A glob pin
    without an implementation of its backend passes on to the enclosing pins; a compile-safe
    region pins nothing (each candidate's check was made up front)."""
    if COMPILE_REGION in d.scoped_pins:
        d.notes.append(
            "inside a compile-safe region (kernreg.pins.compile_region): only compile_safe "
            "implementations and a plain-torch reference are eligible; no plan applies"
        )
    for pin in d.scoped_pins:
        decision = None if pin is COMPILE_REGION else d.apply_pin(pin, "scoped_pin")
        if decision is not None:
            return decision
    return None


def _plan(d: _Deciding) -> Decision | None:
    """2b. The loaded selection plan, unless denied; a miss is noted (strict: nothing runs)."""
    planned = d.planned
    if planned is None or not planned.backend or COMPILE_REGION in d.scoped_pins:
        return None  # plans record eager decisions
    source = f"plan {d.planned_source}".rstrip()
    switch = d.config.backend
    if switch is not None and _pick(d.pairs(d.matching(switch, None)))[0]:
        # The debugging switch is what its user is debugging with: not outvoted by a plan.
        d.notes.append(f"KERNREG_BACKEND={switch} wins over the {source}")
        return None
    subset = d.matching(planned.backend, planned.variant)
    # A deny rule wins over a plan: it is the switch that turns a broken kernel off.
    denials = {row: why for row in subset if (why := d.denial(row.spec)) is not None}
    usable = [r.spec for r in subset if r.check == () and r not in denials]
    if usable:
        # A plan records the choice made without a call: the ``when`` predicates that read
        # the call still choose above it, per call, as where the plan was written.
        above = [
            r
            for r in d.rows
            if r.spec.when is not None
            and r.check in ((), None)
            and (usable[0].reference or r.spec.priority > usable[0].priority)
            and process_state_predicate(r.spec) is None
            and d.denial(r.spec) is None
            and not d.demoted.get(r.spec.label, "").startswith("demoted:")
        ]
        firm, conditional = _pick(d.pairs(above), False)
        if len(firm) > 1:
            return d.finish("ambiguous", tied=firm, conditional=conditional)
        chosen = firm[0] if firm else usable[0]
        d.mark(chosen, "chosen", f"selected by the {source}")
        d.not_selected(source, keep=above)
        return d.finish("plan", chosen, conditional=conditional)
    wins = [f"{why}, which wins over the {source}" for why in denials.values()]
    reasons = [*(subset[0].check or ()), *wins] if subset else []
    d.plan_miss = (
        f"planned {planned.label} is not available here ({'; '.join(reasons) or 'not registered'})"
    )
    if d.strict_mode:
        d.notes.append(f"{d.plan_miss}; strict mode forbids choosing anything else")
        return d.finish("none")
    d.notes.append(f"{d.plan_miss}; decided normally")
    return None


def _configured_pin(d: _Deciding) -> Decision | None:
    """2c. A pin from configuration (``KERNREG_PIN``, site pins): strict."""
    return d.apply_pin(d.config.pin_for(d.op), "pin")


def _env_backend(d: _Deciding) -> Decision | None:
    """3. The debugging switch ``KERNREG_BACKEND``: used where eligible, else passes on."""
    backend = d.config.backend
    if backend is None:
        return None
    firm, conditional = _pick(d.pairs(d.matching(backend, None)))
    if len(firm) == 1 and not conditional:
        d.mark(firm[0], "chosen", f"selected by KERNREG_BACKEND={backend}")
        return d.finish("env_backend", firm[0])
    d.notes.append(f"KERNREG_BACKEND={backend} not eligible here; normal selection")
    return None


def _deny(d: _Deciding) -> Decision | None:
    """4. Denied and demoted backends become ineligible; passes on."""
    for row in d.rows:
        denied = d.denial(row.spec)
        if denied is not None:
            row.reject(denied)
        why = d.demoted.get(row.spec.label)
        if why is not None and why.startswith("demoted:"):
            row.reject(why)
        elif why is not None:  # demoted in other shape buckets only
            d.notes.append(f"{row.spec.label} {why}")
    return None


def _measured(d: _Deciding) -> Decision | None:
    """5a. Autotune policy: recorded measurements decide among the firm candidates; without
    them the candidates are noted for measuring and priority decides meanwhile."""
    if not d.autotune:
        return None
    measured = d.measured or {}
    firm = [r for r in d.rows if r.check == () and not (r.spec.reference and d.strict_mode)]
    # A recorded result decides; a candidate missing from it failed to run when measured.
    timed = [r.spec for r in firm if r.spec.label in measured]
    if len(firm) >= 2 and timed:
        chosen = choose_measured(timed, measured)
        for row in firm:
            if row.spec is chosen:
                row.status = ("chosen", f"fastest measured ({_fmt(measured[chosen.label])})")
            elif row.spec in timed:
                row.status = ("eligible", f"measured {_fmt(measured[row.spec.label])}")
            else:
                row.status = ("eligible", "failed when measured")
        return d.finish("autotune", chosen)
    if len(firm) >= 2:
        d.tuning = tuple(r.spec for r in firm)
        d.notes.append(
            "autotune: " + ", ".join(s.label for s in d.tuning) + " not measured for this call "
            "signature yet (measured on the first call); priority decides until then"
        )
    return None


def _priority(d: _Deciding) -> Decision:
    """5b. The highest priority among eligible non-reference candidates (a tie is an
    ambiguity, never broken by order); 6. else the reference, unless strict mode forbids
    the fallback. Always decides."""
    rule, chosen, tied, conditional = _by_priority(d.pairs())
    if rule in ("priority", "ambiguous"):
        for row in d.rows:
            if row.spec is chosen:
                row.status = ("chosen", "highest priority among eligible")
            elif row.spec.reference and not row.check:
                row.status = ("eligible", "reference, not needed")
            elif chosen is not None and row.check == () and not row.spec.reference:
                row.status = ("eligible", f"outranked by {chosen.label}")
        return d.finish(rule, chosen, tied, conditional)
    if chosen is None:
        if any(r.spec.reference for r in d.rows):
            d.notes.append("the reference implementation is not eligible either")
        else:
            d.notes.append("no reference implementation registered")
        return d.finish("none", conditional=conditional)
    strict_error = d.strict_mode and len(d.rows) > 1
    if len(d.rows) == 1:
        d.mark(chosen, "chosen", "reference (the only implementation)")
    elif strict_error:
        d.mark(chosen, "eligible", "reference; fallback forbidden by strict mode")
        why = "strict mode (KERNREG_STRICT or strict=True) forbids falling back to the reference"
        d.notes.append(why)
    else:
        d.mark(chosen, "chosen", "fallback to the reference: no other implementation is eligible")
    return d.finish(rule, chosen, conditional=conditional, strict_error=strict_error)


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
)

"""``kernreg list``, ``kernreg explain`` and ``kernreg platform``: what is registered, what runs."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from fnmatch import fnmatchcase

import click

from kernreg._names import display_label, parse_label
from kernreg.cli._app import (
    CliError,
    State,
    assume_package_option,
    assumed_packages_text,
    common_options,
    decision_outcome,
    describe_platform,
    dtype_option,
    echo_error,
    echo_json,
    echo_wrapped,
    format_origin,
    import_modules,
    json_option,
    module_error,
    op_callback,
    open_registry,
    platform_option,
    print_table,
    short_origin,
    terminal_width,
)
from kernreg.errors import InvalidSpecError, KernregError, close_op_ids, did_you_mean
from kernreg.platform import Platform
from kernreg.registry import KernelRegistry, default_registry
from kernreg.selection import Decision
from kernreg.spec import KernelSpec

__all__ = ["COMMANDS"]


def _dtypes_text(dtypes: tuple[str, ...] | None) -> str:
    return "unknown (pass --dtype)" if dtypes is None else ", ".join(dtypes)


@functools.cache
def _names_text(values: frozenset[object], empty: str) -> str:
    """Sorted, comma-joined; cached because many specs share the same set."""
    return ",".join(sorted(str(v) for v in values)) or empty


# --- list ----------------------------------------------------------------------------------

#: The columns of ``list``: the default view, and the ``--wide`` one with every detail.
_LIST_HEADERS = ("", "OP", "IMPLEMENTATION", "PRIORITY", "ORIGIN", "SELECTION")
_WIDE_HEADERS = (
    "",
    "OP",
    "IMPLEMENTATION",
    "PRIORITY",
    "REQUIRES",
    "DTYPES",
    "TRAITS",
    "ORIGIN",
    "SELECTION",
    "REASONS",
)
#: Columns the default view gives up, in this order, when the terminal is too narrow.
_DROPPABLE = ("ORIGIN", "PRIORITY")


def _reasons_text(reasons: Sequence[str]) -> str:
    """The reasons of a candidate in command-line words: ``(pass --dtype)``, not ``dtypes=``."""
    return "; ".join(r.replace("(pass dtypes=)", "(pass --dtype)") for r in reasons) or "-"


def _requires_text(spec: KernelSpec) -> str:
    if not spec.packages:
        return _names_text(spec.requires, "any")
    return ",".join(filter(None, (_names_text(spec.requires, ""), _names_text(spec.packages, ""))))


def _selection(decision: Decision) -> list[str]:
    """What the SELECTION column says for each candidate of ``decision``, in its order."""
    if decision.ok:
        return [
            f"chosen ({decision.rule})" if c.spec is decision.chosen else c.status
            for c in decision.candidates
        ]
    if decision.rule == "ambiguous":
        tied = {c.spec.key for c in decision.tied}
        return [
            "AMBIGUOUS (tied)" if c.spec.key in tied else "AMBIGUOUS" for c in decision.candidates
        ]
    text = "STRICT: no fallback" if decision.strict_error else "NOTHING ELIGIBLE"
    return [text] * len(decision.candidates)


def _for_dtypes(text: str, dtypes: Sequence[str]) -> str:
    """``chosen (priority)`` for some dtypes as ``chosen for float16, bfloat16 (priority)``."""
    head, paren, tail = text.partition(" (")
    return f"{head} for {', '.join(dtypes)}" + (f" ({tail}" if paren else "")


class _Listing:
    """One op as ``list`` shows it: its implementations, and each one's part in the
    decisions, one decision per dtype when no ``--dtype`` was given."""

    __slots__ = ("by_dtype", "chosen", "failed", "op", "reasons", "selection", "specs")

    def __init__(
        self,
        op: str,
        specs: tuple[KernelSpec, ...],
        selection: list[str],
        reasons: list[tuple[str, ...]],
        by_dtype: dict[str | None, tuple[KernelSpec | None, str, str]],
    ) -> None:
        self.op = op
        self.specs = specs
        self.selection = selection
        self.reasons = reasons
        #: Per dtype decided (``None``: one decision for every dtype): the chosen spec
        #: (``None`` when the decision failed), the rule and the outcome in words.
        self.by_dtype = by_dtype
        #: The specs some decision chose: what real calls run.
        self.chosen = {c for c, _, _ in by_dtype.values() if c is not None}
        self.failed = any(c is None for c, _, _ in by_dtype.values())

    @property
    def single(self) -> KernelSpec | None:
        """The implementation every decision chose, or ``None`` (one failed, or they differ)."""
        choices = [c for c, _, _ in self.by_dtype.values()]
        return choices[0] if len(set(choices)) == 1 else None


def _op_dtypes(op: str) -> tuple[str, ...]:
    """The dtypes real calls of ``op`` use, as far as metadata says without torch: those of
    its input generator (:func:`kernreg.torch.register_inputs`), else float32, float16 and
    bfloat16."""
    from kernreg.torch._inputs import DEFAULT_DTYPES, input_spec

    declared = input_spec(op)
    return DEFAULT_DTYPES if declared is None else declared.dtypes


def _listing(
    registry: KernelRegistry, op: str, platform: Platform, dtypes: tuple[str, ...] | None
) -> _Listing:
    """The decisions for ``op``: for ``dtypes``, or without them one per dtype its calls
    use (:func:`_op_dtypes`), since what runs depends on the call's dtype. A decision that
    raises is shown in the rows, not raised."""
    specs = registry.get(op)
    if dtypes is None and any(spec.dtypes for spec in specs):
        keys: list[tuple[str, ...] | None] = [(d,) for d in _op_dtypes(op)]
    else:  # no implementation looks at the dtype: one decision speaks for all
        keys = [dtypes]
    decisions: dict[str | None, Decision | str] = {}
    for key in keys:
        name = key[0] if key is not None and dtypes is None else None
        try:
            decisions[name] = registry.explain(op, platform=platform, dtypes=key)
        except KernregError as exc:
            decisions[name] = str(exc).partition("\n")[0]
    texts: dict[str | None, list[str]] = {}
    reasons: list[list[str]] = [[] for _ in specs]
    by_dtype: dict[str | None, tuple[KernelSpec | None, str, str]] = {}
    order = {spec.key: i for i, spec in enumerate(specs)}
    for name, decision in decisions.items():
        if isinstance(decision, str):
            texts[name] = [f"ERROR: {decision}"] * len(specs)
            by_dtype[name] = (None, "error", decision)
            continue
        row_texts = [""] * len(specs)
        for cand, text in zip(decision.candidates, _selection(decision), strict=True):
            i = order[cand.spec.key]
            row_texts[i] = text
            reasons[i].extend(r for r in cand.reasons if r not in reasons[i])
        texts[name] = row_texts
        by_dtype[name] = (
            decision.chosen if decision.ok else None,
            decision.rule,
            decision_outcome(decision),
        )
    selection = []
    for i in range(len(specs)):
        groups: dict[str, list[str]] = {}
        for name, row_texts in texts.items():
            groups.setdefault(row_texts[i], []).append(name or "")
        if len(groups) == 1:
            selection.append(next(iter(groups)))
        else:  # what runs first: "chosen for float16 (priority); rejected for float32"
            ordered = sorted(groups.items(), key=lambda item: not item[0].startswith("chosen"))
            selection.append("; ".join(_for_dtypes(t, ds) for t, ds in ordered))
    return _Listing(op, specs, selection, [tuple(r) for r in reasons], by_dtype)


def _outcome_text(listing: _Listing) -> str:
    """The decisions in words: one outcome, or one per dtype when they differ."""
    outcomes = {d: outcome for d, (_, _, outcome) in listing.by_dtype.items()}
    if len(set(outcomes.values())) == 1:
        return next(iter(outcomes.values()))
    return "; ".join(f"{d}: {outcome}" for d, outcome in outcomes.items())


def _list_json(
    listings: list[_Listing], platform: Platform, dtypes: tuple[str, ...] | None
) -> dict[str, object]:
    ops = []
    for listing in listings:
        implementations = []
        for spec, selection, reasons in zip(
            listing.specs, listing.selection, listing.reasons, strict=True
        ):
            entry = spec.describe()
            entry["label"] = spec.label
            entry["chosen"] = spec in listing.chosen
            entry["chosen_for"] = [
                d for d, (c, _, _) in listing.by_dtype.items() if d is not None and c is spec
            ]
            entry["selection"] = selection
            entry["reasons"] = list(reasons)
            implementations.append(entry)
        single = listing.single
        rules = {rule for _, rule, _ in listing.by_dtype.values()}
        ops.append(
            {
                "op": listing.op,
                # The implementation every call runs; null when it depends on the dtype.
                "chosen": None if single is None else single.label,
                "rule": rules.pop() if len(rules) == 1 else "per dtype",
                "ok": not listing.failed,
                "outcome": _outcome_text(listing),
                "by_dtype": {
                    d: {"chosen": None if c is None else c.label, "rule": rule}
                    for d, (c, rule, _) in listing.by_dtype.items()
                    if d is not None
                },
                "implementations": implementations,
            }
        )
    return {
        "platform": platform.describe(),
        "dtypes": None if dtypes is None else list(dtypes),
        "ops": ops,
    }


def _list_rows(listings: list[_Listing], wide: bool) -> tuple[list[list[str]], list[str | None]]:
    rows: list[list[str]] = []
    styles: list[str | None] = []
    for listing in listings:
        failed = listing.failed
        for spec, selection, reasons in zip(
            listing.specs, listing.selection, listing.reasons, strict=True
        ):
            is_chosen = spec in listing.chosen
            mark = "*" if is_chosen else ("!" if failed else "")
            name = display_label(spec.label, spec.reference)
            if wide:
                row = [
                    mark,
                    listing.op,
                    name,
                    str(spec.priority),
                    _requires_text(spec),
                    _names_text(spec.dtypes, "any"),
                    _names_text(spec.traits, "-"),
                    format_origin(spec.origin),
                    selection,
                    _reasons_text(reasons),
                ]
            else:
                row = [mark, listing.op, name, str(spec.priority), short_origin(spec.origin)]
                row.append(selection)
            rows.append(row)
            styles.append("bold green" if is_chosen else ("red" if failed else None))
    return rows, styles


def _distribution_only(origin: str) -> str:
    """``kernreg-ops:_plugin.py:109`` as ``kernreg-ops``; other origins unchanged."""
    dist, sep, rest = origin.partition(":")
    return dist if sep and ":" in rest else origin


@click.command("list")
@click.argument("pattern", metavar="[GLOB]", required=False, default="*")
@click.option(
    "--layers",
    is_flag=True,
    help="List layer mappings (module class -> op) instead; GLOB selects op ids or layers "
    "('llama', '*RMSNorm').",
)
@platform_option
@assume_package_option
@dtype_option
@click.option(
    "--wide",
    is_flag=True,
    help="Every column (requirements, dtypes, traits, full origin, reasons), however wide.",
)
@json_option
@common_options
@click.pass_obj
def list_command(
    state: State,
    pattern: str,
    platform: Platform | None,
    dtypes: tuple[str, ...],
    wide: bool,
    as_json: bool,
    layers: bool = False,
) -> int:
    """List every op's implementations and mark the one that would run.

    GLOB selects op ids (fnmatch, e.g. 'layernorm.*'); exits 1 when it matches
    none. For each implementation: backend/variant, priority, origin (file:line,
    or distribution:file:line for a plugin) and its part in the decision on the
    platform (detected, KERNREG_PLATFORM, or --platform). Without --dtype, each
    op is decided for every dtype its calls use (its input generator's, else
    float32, float16 and bfloat16): 'chosen for float16, bfloat16' says which.
    The table fits the terminal (100 columns when there is none); --wide adds
    requirements, dtypes, traits, the full origin and every reason on long lines,
    --json everything. '*' marks what runs; '!' marks the rows of an op whose
    decision is an error (AMBIGUOUS, NOTHING ELIGIBLE, STRICT).
    """
    registry = open_registry(state)
    if layers:
        return _list_layers(pattern, as_json, wide)
    plat = registry.platform if platform is None else platform
    dtype_key = dtypes or None
    ops = [op for op in registry.ops() if pattern == "*" or fnmatchcase(op, pattern)]
    listings = [_listing(registry, op, plat, dtype_key) for op in ops]
    assumed = assumed_packages_text(registry)
    if as_json:
        data = _list_json(listings, plat, dtype_key)
        if assumed:  # only then: the shape of the usual listing stays as it was
            data["assumed_packages"] = [str(a) for a in registry.config.assume_packages]
        echo_json(data)
        return 0 if ops or pattern == "*" else 1
    title = f"platform {describe_platform(plat)}; dtypes {_list_dtypes_text(listings, dtype_key)}"
    if assumed:
        title += f"; packages assumed: {assumed}"
    if not ops:
        if pattern == "*":
            click.echo(f"{title}\n\nno ops registered")
            return 0
        click.echo(title)
        raise CliError(f"no op matches {pattern!r}", _pattern_hint(pattern, registry.ops()))
    rows, styles = _list_rows(listings, wide)
    print_table(
        _WIDE_HEADERS if wide else _LIST_HEADERS,
        rows,
        title=title,
        styles=styles,
        fit=not wide,  # --wide: long lines, every column whole
        droppable=_DROPPABLE,
        shortenable=("SELECTION",),
        compact={"ORIGIN": _distribution_only},
        section="OP",
        more="--wide shows all",
        width=terminal_width(),  # 100 columns without a terminal
    )
    return 0


def _list_dtypes_text(listings: Sequence[_Listing], dtypes: tuple[str, ...] | None) -> str:
    """The title's dtypes: those given, or the ones decided per op without ``--dtype``."""
    if dtypes is not None:
        return ", ".join(dtypes)
    decided = {tuple(d for d in listing.by_dtype if d is not None) for listing in listings}
    decided.discard(())
    if not decided:
        return "any"
    if len(decided) == 1:
        return f"{', '.join(decided.pop())}, each decided (--dtype picks one)"
    return "those of each op's inputs, each decided (--dtype picks one)"


def _pattern_hint(pattern: str, ops: Sequence[str]) -> str:
    """What to try when GLOB matched nothing: a glob over a group, or a close op id."""
    if not any(ch in pattern for ch in "*?["):
        groups = sorted({op.split(".")[0] for op in ops})
        if pattern in groups or any(op.startswith(pattern + ".") for op in ops):
            return f"GLOB is a glob over op ids: try '{pattern}.*'"
        suggestion = did_you_mean(close_op_ids(pattern, ops))
        if suggestion:
            return suggestion
        return f"GLOB is a glob over op ids, such as '{pattern}*' or '*{pattern}*'"
    return "`kernreg list` shows every op"


def _short_layer(layer: str) -> str:
    """``transformers.models.llama.modeling_llama:LlamaMLP`` as ``modeling_llama:LlamaMLP``."""
    module, sep, name = layer.partition(":")
    return f"{module.rpartition('.')[2]}{sep}{name}"


def _layer_matches(pattern: str, op: str, layer: str) -> bool:
    """Whether GLOB selects a layer mapping: by op id (as for implementations), or by the
    layer ``module:Class``, case-insensitively, as a glob or, without glob characters,
    as a substring (``llama`` selects ``...modeling_llama:LlamaRMSNorm``)."""
    if pattern == "*" or fnmatchcase(op, pattern):
        return True
    wanted, target = pattern.lower(), layer.lower()
    if any(ch in pattern for ch in "*?["):
        return fnmatchcase(target, wanted) or fnmatchcase(target.rpartition(":")[2], wanted)
    return wanted in target


def _list_layers(pattern: str, as_json: bool, wide: bool = False) -> int:
    """``kernreg list --layers``: the layer mappings ``kernelize`` applies (no torch import)."""
    from kernreg.torch.layers import layer_mappings

    every = layer_mappings()
    mappings = [m for m in every if _layer_matches(pattern, m.op, m.layer)]
    if as_json:
        echo_json({"layers": [m.describe() for m in mappings]})
        return 0
    if not mappings:
        if every:
            raise CliError(
                f"no layer mapping matches {pattern!r} ({len(every)} registered)",
                "GLOB matches the op id or the layer (module:Class, case-insensitively; "
                "a word without */?/[ is a substring): `kernreg list --layers` shows them all",
            )
        click.echo("no layer mappings registered")
        return 0
    rows = [
        [m.layer, m.op, str(m.describe()["args"]), str(m.origin or "")]
        if wide
        else [m.layer, m.op, str(m.describe()["args"]), short_origin(m.origin)]
        for m in mappings
    ]
    print_table(
        ("LAYER", "OP", "ARGS", "ORIGIN"),
        rows,
        title="layer mappings",
        fit=not wide,
        droppable=("ARGS", "ORIGIN"),
        compact={"ORIGIN": _distribution_only, "LAYER": _short_layer},
        keep=("LAYER", "OP"),
        more="--wide shows all",
        width=terminal_width(),  # 100 columns without a terminal
    )
    return 0


# --- explain -------------------------------------------------------------------------------


def _check_backend(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> tuple[str, str | None] | None:
    if value is None:
        return None
    try:
        return parse_label(value, "backend")
    except InvalidSpecError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


@click.command("explain")
@click.argument("op", callback=op_callback)
@platform_option
@assume_package_option
@dtype_option
@click.option(
    "--backend",
    metavar="BACKEND[/VARIANT]",
    callback=_check_backend,
    help="Ask for this implementation, as backend= does in code (strict).",
)
@json_option
@common_options
@click.pass_obj
def explain_command(
    state: State,
    op: str,
    platform: Platform | None,
    dtypes: tuple[str, ...],
    backend: tuple[str, str | None] | None,
    as_json: bool,
) -> int:
    """Explain the decision for OP: every implementation, the rule that chose, every reason.

    Exits 1 (after printing the table) when the decision is ambiguous, finds
    nothing eligible, or strict mode forbids the fallback to the reference.
    """
    registry = open_registry(state)
    name, variant = backend if backend is not None else (None, None)
    decision = registry.explain(
        op, backend=name, variant=variant, platform=platform, dtypes=dtypes or None
    )
    devices = [
        (
            device,
            registry.explain(
                op, backend=name, variant=variant, platform=device, dtypes=dtypes or None
            ),
        )
        for device in (decision.platform.devices if len(decision.platform.devices) > 1 else ())
    ]
    if as_json:
        echo_json(
            {
                **decision.describe(),
                "devices": [
                    {
                        "index": d.index,
                        "platform": str(d),
                        "chosen": x.chosen and x.chosen.label,
                        "rule": x.rule,
                    }
                    for d, x in devices
                ],
            }
        )
    else:
        _print_decision(decision)
        for device, each in devices:
            click.echo(f"device {device.index} ({device}): -> {decision_outcome(each)}")
    if decision.ok:
        return 0
    if not as_json:
        echo_error(f"op '{op}': {decision_outcome(decision)}", _decision_hint(decision))
    return 1


def _print_decision(decision: Decision) -> None:
    title = (
        f"op {decision.op} on {describe_platform(decision.platform)}; "
        f"dtypes {_dtypes_text(decision.dtypes)}\n-> {decision_outcome(decision)}"
    )
    rows = []
    styles: list[str | None] = []
    for cand in decision.candidates:
        spec = cand.spec
        rows.append(
            [
                cand.status,
                display_label(spec.label, spec.reference),
                str(spec.priority),
                _reasons_text(cand.reasons),
                spec.target_name,
                format_origin(spec.origin),
            ]
        )
        styles.append(
            "bold green"
            if cand.status == "chosen" and decision.ok
            else ("dim" if cand.status == "rejected" else None)
        )
    short = {format_origin(c.spec.origin): short_origin(c.spec.origin) for c in decision.candidates}
    print_table(
        ("STATUS", "IMPLEMENTATION", "PRIORITY", "REASONS", "TARGET", "ORIGIN"),
        rows,
        title=title,
        styles=styles,
        compact={"ORIGIN": lambda cell: short.get(cell, cell)},
        droppable=("ORIGIN", "TARGET", "PRIORITY"),
        wrap=("REASONS",),
    )
    for note in decision.notes:
        echo_wrapped(f"note: {note}", "  ")


def _decision_hint(decision: Decision) -> str:
    if decision.rule == "ambiguous":
        return (
            "give the tied implementations different priorities, or pin one "
            f"(KERNREG_PIN={decision.op}=<backend>)"
        )
    if decision.strict_error:
        return "make a faster implementation eligible, or drop strict mode for this op"
    return "the REASONS column says why each implementation was rejected"


# --- platform ------------------------------------------------------------------------------


def _machine_platform() -> Platform:
    """What detection finds on this machine, ignoring KERNREG_PLATFORM."""
    saved = os.environ.pop("KERNREG_PLATFORM", None)
    try:
        return Platform.detect()
    finally:
        if saved is not None:
            os.environ["KERNREG_PLATFORM"] = saved


@click.command("platform")
@json_option
@common_options
@click.pass_obj
def platform_command(state: State, as_json: bool) -> int:
    """Show the platform decisions are made for, where it came from, and the machine's own.

    Every device of the machine is listed with its architecture (one row per index).

    KERNREG_PLATFORM (or 'platform' in the KERNREG_CONFIG file) overrides detection.
    """
    failures = import_modules(state)
    if failures:
        raise module_error(*failures[0])
    registry = default_registry()
    config = registry.config
    effective = registry.platform
    overridden = config.platform is not None
    machine = _machine_platform() if overridden else effective
    override = None
    if overridden:
        assert config.platform is not None
        value = str(config.platform)
        if len(config.platform.devices) > 1:  # a host of several devices, as it was spelt
            archs = ",".join(str(d).partition(":")[2] for d in config.platform.devices)
            value = f"{config.platform.device}:{archs}"
        override = {"source": config.platform.source, "value": value}
    if as_json:
        echo_json(
            {
                "platform": effective.describe(),
                "override": override,
                "detected": machine.describe(),
            }
        )
        return 0
    rows = [
        [key, "-" if value is None else str(value)]
        for key, value in effective.describe().items()
        if key != "devices"
    ]
    rows.extend([f"device {d.index}", str(d)] for d in effective.devices)
    if override is not None:
        rows.append(["override", f"{override['source']}={override['value']}"])
        rows.append(["detected", describe_platform(machine)])
    print_table(("FIELD", "VALUE"), rows)
    return 0


COMMANDS = (list_command, explain_command, platform_command)

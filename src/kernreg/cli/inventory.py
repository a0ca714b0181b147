"""``kernreg list``, ``kernreg explain`` and ``kernreg platform``: what is registered, what runs."""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
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
    format_origin,
    import_modules,
    json_option,
    module_error,
    op_callback,
    open_registry,
    platform_option,
    print_table,
    short_origin,
)
from kernreg.errors import InvalidSpecError, KernregError, close_op_ids, did_you_mean
from kernreg.platform import Platform
from kernreg.registry import KernelRegistry, default_registry
from kernreg.selection import Candidate, Decision
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
#: The width ``list`` fits when it cannot ask a terminal (output to a pipe or a file).
DEFAULT_WIDTH = 100
#: What ``list`` says for an implementation restricted to some dtypes, while they are unknown.
UNDECIDED = "undecided (needs --dtype)"


def _reasons_text(reasons: Sequence[str]) -> str:
    """The reasons of a candidate in command-line words: ``(pass --dtype)``, not ``dtypes=``."""
    return "; ".join(r.replace("(pass dtypes=)", "(pass --dtype)") for r in reasons) or "-"


def _requires_text(spec: KernelSpec) -> str:
    if not spec.packages:
        return _names_text(spec.requires, "any")
    return ",".join(filter(None, (_names_text(spec.requires, ""), _names_text(spec.packages, ""))))


def _undecided(decision: Decision, cand: Candidate) -> bool:
    """Whether ``cand`` was rejected only because the call's dtypes are unknown.

    The dtype check adds exactly one reason; a candidate with no other reason would be
    eligible for some dtype it accepts, so ``list`` cannot say "rejected" without ``--dtype``.
    """
    return (
        cand.status == "rejected"
        and decision.dtypes is None
        and bool(cand.spec.dtypes)
        and len(cand.reasons) == 1
    )


def _selection(decision: Decision) -> list[str]:
    """What the SELECTION column says for each candidate of ``decision``, in its order."""
    if decision.ok:
        return [
            f"chosen ({decision.rule})"
            if c.spec is decision.chosen
            else (UNDECIDED if _undecided(decision, c) else c.status)
            for c in decision.candidates
        ]
    if decision.rule == "ambiguous":
        tied = {c.spec.key for c in decision.tied}
        return [
            "AMBIGUOUS (tied)" if c.spec.key in tied else "AMBIGUOUS" for c in decision.candidates
        ]
    text = "STRICT: no fallback" if decision.strict_error else "NOTHING ELIGIBLE"
    return [text] * len(decision.candidates)


class _Listing:
    """One op as ``list`` shows it: its implementations, and each one's part in the decision."""

    __slots__ = ("chosen", "op", "outcome", "reasons", "rule", "selection", "specs")

    def __init__(
        self,
        op: str,
        specs: tuple[KernelSpec, ...],
        selection: list[str],
        reasons: list[tuple[str, ...]],
        chosen: KernelSpec | None,
        rule: str,
        outcome: str,
    ) -> None:
        self.op = op
        self.specs = specs
        self.selection = selection
        self.reasons = reasons
        self.chosen = chosen
        self.rule = rule
        self.outcome = outcome


def _listing(
    registry: KernelRegistry, op: str, platform: Platform, dtypes: tuple[str, ...] | None
) -> _Listing:
    """One decision for ``op``; a decision that raises is shown in the rows, not raised."""
    try:
        decision = registry.explain(op, platform=platform, dtypes=dtypes)
    except KernregError as exc:
        error = str(exc).partition("\n")[0]
        specs = registry.get(op)
        return _Listing(
            op, specs, [f"ERROR: {error}"] * len(specs), [()] * len(specs), None, "error", error
        )
    return _Listing(
        op,
        tuple(c.spec for c in decision.candidates),
        _selection(decision),
        [c.reasons for c in decision.candidates],
        decision.chosen if decision.ok else None,
        decision.rule,
        decision_outcome(decision),
    )


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
            entry["chosen"] = spec is listing.chosen
            entry["selection"] = selection
            entry["reasons"] = list(reasons)
            implementations.append(entry)
        ops.append(
            {
                "op": listing.op,
                "chosen": None if listing.chosen is None else listing.chosen.label,
                "rule": listing.rule,
                "ok": listing.chosen is not None,
                "outcome": listing.outcome,
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
        failed = listing.chosen is None
        for spec, selection, reasons in zip(
            listing.specs, listing.selection, listing.reasons, strict=True
        ):
            is_chosen = spec is listing.chosen
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


def _table_width(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> int:
    """The width of the plain table: each column as wide as its widest cell, two spaces apart."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    return sum(widths) + 2 * (len(widths) - 1)


def fit_columns(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    width: int,
    droppable: Sequence[str],
    shortenable: Sequence[str] = (),
    compact: Mapping[str, Callable[[str], str]] | None = None,
) -> tuple[list[str], list[list[str]], list[str]]:
    """Fit a table into ``width`` characters; return the headers, rows and dropped columns.

    In order, while the table is too wide: write the ``compact`` columns' cells in their
    short form (``compact[header](cell)``); drop the ``droppable`` columns; drop the
    parenthesised ending of the ``shortenable`` columns' cells, longest first
    ("undecided (needs --dtype)" becomes "undecided"); cut the widest column's long cells
    with ``...``. Names (op ids, implementations) are cut only when nothing else is left.
    """
    kept_headers = list(headers)
    kept_rows = [list(r) for r in rows]
    for name, short in (compact or {}).items():
        if _table_width(kept_headers, kept_rows) <= width:
            break
        column = kept_headers.index(name)
        for row in kept_rows:
            row[column] = short(row[column])
    dropped: list[str] = []
    for name in droppable:
        if _table_width(kept_headers, kept_rows) <= width:
            break
        column = kept_headers.index(name)
        del kept_headers[column]
        for row in kept_rows:
            del row[column]
        dropped.append(name)
    for name in shortenable:
        if name not in kept_headers:
            continue
        column = kept_headers.index(name)
        while _table_width(kept_headers, kept_rows) > width:
            longest = max((len(r[column]) for r in kept_rows if " (" in r[column]), default=0)
            if not longest:
                break
            for row in kept_rows:
                if len(row[column]) == longest and " (" in row[column]:
                    row[column] = row[column].partition(" (")[0]
    excess = _table_width(kept_headers, kept_rows) - width
    if excess > 0 and kept_rows:
        widths = [max(len(h), *(len(r[i]) for r in kept_rows)) for i, h in enumerate(kept_headers)]
        widest = max(range(len(widths)), key=widths.__getitem__)
        limit = max(widths[widest] - excess, len(kept_headers[widest]), 8)
        for row in kept_rows:
            if len(row[widest]) > limit:
                row[widest] = row[widest][: limit - 3] + "..."
    return kept_headers, kept_rows, dropped


def _distribution_only(origin: str) -> str:
    """``kernreg-ops:_plugin.py:109`` as ``kernreg-ops``; other origins unchanged."""
    dist, sep, rest = origin.partition(":")
    return dist if sep and ":" in rest else origin


def _terminal_width() -> int:
    """The terminal's width (``COLUMNS`` first), or :data:`DEFAULT_WIDTH` without one."""
    return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns


@click.command("list")
@click.argument("pattern", metavar="[GLOB]", required=False, default="*")
@click.option(
    "--layers",
    is_flag=True,
    help="List layer mappings (module class -> op) instead; GLOB selects ops.",
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

    \b
    GLOB selects op ids (fnmatch, e.g. 'layernorm.*'); exits 1 when it matches none.
    For each implementation: backend/variant, priority, origin (file:line, or
    distribution:file:line for a plugin) and its part in the decision on the
    platform (detected, KERNREG_PLATFORM, or --platform). The table fits the
    terminal (100 columns when there is none); --wide adds requirements, dtypes,
    traits, the full origin and every reason, --json everything. '*' marks the
    chosen implementation; '!' marks every row of an op whose decision is an error
    (AMBIGUOUS, NOTHING ELIGIBLE, STRICT); 'undecided (needs --dtype)' marks an
    implementation that some dtypes allow: `kernreg explain OP --dtype D` decides.
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
    title = f"platform {describe_platform(plat)}; dtypes {_dtypes_text(dtype_key)}"
    if assumed:
        title += f"; packages assumed: {assumed}"
    if not ops:
        if pattern == "*":
            click.echo(f"{title}\n\nno ops registered")
            return 0
        click.echo(title)
        raise CliError(f"no op matches {pattern!r}", _pattern_hint(pattern, registry.ops()))
    rows, styles = _list_rows(listings, wide)
    headers: Sequence[str] = _WIDE_HEADERS if wide else _LIST_HEADERS
    dropped: list[str] = []
    if not wide:
        headers, rows, dropped = fit_columns(
            headers,
            rows,
            _terminal_width(),
            _DROPPABLE,
            ("SELECTION",),
            {"ORIGIN": _distribution_only},
        )
    print_table(headers, rows, title=title, styles=styles, fold=wide)
    if dropped:
        click.echo(f"note: {' and '.join(dropped)} left out to fit the terminal; --wide shows all")
    if any(UNDECIDED in listing.selection for listing in listings):
        click.echo("note: 'undecided' implementations accept only some dtypes; --dtype decides")
    return 0


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


def _list_layers(pattern: str, as_json: bool, wide: bool = False) -> int:
    """``kernreg list --layers``: the layer mappings ``kernelize`` applies (no torch import)."""
    from kernreg.torch.layers import layer_mappings

    mappings = [m for m in layer_mappings() if pattern == "*" or fnmatchcase(m.op, pattern)]
    if as_json:
        echo_json({"layers": [m.describe() for m in mappings]})
        return 0
    if not mappings:
        click.echo("no layer mappings registered")
        return 0
    rows = [
        [m.layer, m.op, str(m.describe()["args"]), str(m.origin or "")]
        if wide
        else [m.layer, m.op, str(m.describe()["args"]), short_origin(m.origin)]
        for m in mappings
    ]
    headers: Sequence[str] = ("LAYER", "OP", "ARGS", "ORIGIN")
    dropped: list[str] = []
    if not wide:  # the same 100-column rule as the implementations' table
        headers, rows, dropped = fit_columns(
            headers, rows, _terminal_width(), ("ARGS",), (), {"ORIGIN": _distribution_only}
        )
    print_table(headers, rows, title="layer mappings", fold=wide)
    if dropped:
        click.echo(f"note: {' and '.join(dropped)} left out to fit the terminal; --wide shows all")
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
    print_table(
        ("STATUS", "IMPLEMENTATION", "PRIORITY", "REASONS", "TARGET", "ORIGIN"),
        rows,
        title=title,
        styles=styles,
    )
    for note in decision.notes:
        click.echo(f"note: {note}")


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

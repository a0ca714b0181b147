"""``kernreg list``, ``kernreg explain`` and ``kernreg platform``: what is registered, what runs."""

from __future__ import annotations

import functools
import os
from fnmatch import fnmatchcase

import click

from kernreg._names import parse_label
from kernreg.cli._app import (
    State,
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
)
from kernreg.errors import InvalidSpecError, KernregError
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

_LIST_HEADERS = (
    "",
    "OP",
    "IMPLEMENTATION",
    "PRIORITY",
    "REQUIRES",
    "DTYPES",
    "TRAITS",
    "ORIGIN",
    "SELECTION",
)


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


class _Listing:
    """One op as ``list`` shows it: its implementations, and each one's part in the decision."""

    __slots__ = ("chosen", "op", "outcome", "rule", "selection", "specs")

    def __init__(
        self,
        op: str,
        specs: tuple[KernelSpec, ...],
        selection: list[str],
        chosen: KernelSpec | None,
        rule: str,
        outcome: str,
    ) -> None:
        self.op = op
        self.specs = specs
        self.selection = selection
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
        return _Listing(op, specs, [f"ERROR: {error}"] * len(specs), None, "error", error)
    return _Listing(
        op,
        tuple(c.spec for c in decision.candidates),
        _selection(decision),
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
        for spec, selection in zip(listing.specs, listing.selection, strict=True):
            entry = spec.describe()
            entry["label"] = spec.label
            entry["chosen"] = spec is listing.chosen
            entry["selection"] = selection
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


def _list_rows(listings: list[_Listing]) -> tuple[list[list[str]], list[str | None]]:
    rows: list[list[str]] = []
    styles: list[str | None] = []
    for listing in listings:
        failed = listing.chosen is None
        for spec, selection in zip(listing.specs, listing.selection, strict=True):
            is_chosen = spec is listing.chosen
            rows.append(
                [
                    "*" if is_chosen else ("!" if failed else ""),
                    listing.op,
                    spec.label + (" (ref)" if spec.reference else ""),
                    str(spec.priority),
                    _requires_text(spec),
                    _names_text(spec.dtypes, "any"),
                    _names_text(spec.traits, "-"),
                    format_origin(spec.origin),
                    selection,
                ]
            )
            styles.append("bold green" if is_chosen else ("red" if failed else None))
    return rows, styles


@click.command("list")
@click.argument("pattern", metavar="[GLOB]", required=False, default="*")
@click.option(
    "--layers",
    is_flag=True,
    help="List layer mappings (module class -> op) instead; GLOB selects ops.",
)
@platform_option
@dtype_option
@json_option
@common_options
@click.pass_obj
def list_command(
    state: State,
    pattern: str,
    platform: Platform | None,
    dtypes: tuple[str, ...],
    as_json: bool,
    layers: bool = False,
) -> int:
    """List every op's implementations and mark the one that would run.

    \b
    GLOB selects op ids (fnmatch, e.g. 'layernorm.*'). For each implementation:
    backend/variant, priority, requirements (devices, packages), dtypes, traits,
    origin (file:line [distribution]) and its part in the decision on the platform
    (detected, KERNREG_PLATFORM, or --platform). '*' marks the chosen
    implementation; '!' marks every row of an op whose decision is an error
    (AMBIGUOUS, NOTHING ELIGIBLE, STRICT): `kernreg explain OP` says why.
    """
    registry = open_registry(state)
    if layers:
        return _list_layers(pattern, as_json)
    plat = registry.platform if platform is None else platform
    dtype_key = dtypes or None
    ops = [op for op in registry.ops() if pattern == "*" or fnmatchcase(op, pattern)]
    listings = [_listing(registry, op, plat, dtype_key) for op in ops]
    if as_json:
        echo_json(_list_json(listings, plat, dtype_key))
        return 0
    rows, styles = _list_rows(listings)
    title = f"platform {describe_platform(plat)}; dtypes {_dtypes_text(dtype_key)}"
    if not ops:
        what = "no ops registered" if pattern == "*" else f"no op matches {pattern!r}"
        click.echo(f"{title}\n\n{what}")
        return 0
    print_table(_LIST_HEADERS, rows, title=title, styles=styles)
    return 0


def _list_layers(pattern: str, as_json: bool) -> int:
    """``kernreg list --layers``: the layer mappings ``kernelize`` applies (no torch import)."""
    from kernreg.torch.layers import layer_mappings

    mappings = [m for m in layer_mappings() if pattern == "*" or fnmatchcase(m.op, pattern)]
    if as_json:
        echo_json({"layers": [m.describe() for m in mappings]})
        return 0
    if not mappings:
        click.echo("no layer mappings registered")
        return 0
    rows = [[m.layer, m.op, str(m.describe()["args"]), str(m.origin or "")] for m in mappings]
    print_table(("LAYER", "OP", "ARGS", "ORIGIN"), rows, title="layer mappings")
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
    if as_json:
        echo_json(decision.describe())
    else:
        _print_decision(decision)
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
                spec.label + (" (ref)" if spec.reference else ""),
                str(spec.priority),
                "; ".join(cand.reasons) or "-",
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
        override = {"source": config.platform.source, "value": str(config.platform)}
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
        [key, "-" if value is None else str(value)] for key, value in effective.describe().items()
    ]
    if override is not None:
        rows.append(["override", f"{override['source']}={override['value']}"])
        rows.append(["detected", describe_platform(machine)])
    print_table(("FIELD", "VALUE"), rows)
    return 0


COMMANDS = (list_command, explain_command, platform_command)

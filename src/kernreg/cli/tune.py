"""``kernreg tune``: fill the autotune store ahead of time, or show what it holds."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import click

from kernreg._names import check_op_glob
from kernreg.cli._app import (
    CliError,
    State,
    common_options,
    describe_platform,
    dtypes_callback,
    echo_json,
    echo_wrapped,
    json_option,
    op_callback,
    open_registry,
    print_table,
)
from kernreg.errors import InvalidSpecError
from kernreg.registry import KernelRegistry

__all__ = ["COMMANDS"]


def _format_ns(ns: float) -> str:
    return f"{ns / 1e3:.3g} us" if ns >= 1e3 else f"{ns:.0f} ns"


def _platform_text(platform: str) -> str:
    """A stored platform key in words: ``cpu|torch=2.13.0|runtime=-`` as
    ``cpu, torch 2.13.0`` (the versions tell apart entries of one device)."""
    device, *versions = platform.split("|")
    known = [v.replace("=", " ", 1) for v in versions if not v.endswith("=-")]
    return ", ".join([device, *known])


@click.command("tune")
@click.argument("op", required=False, callback=op_callback)
@click.option("--all", "all_ops", is_flag=True, help="Tune every op with an input generator.")
@click.option(
    "--shape", "shapes", multiple=True, metavar="NAME", help="A named shape (repeatable)."
)
@click.option(
    "--dtype",
    "dtypes",
    multiple=True,
    callback=dtypes_callback,
    metavar="DTYPE",
    help="A dtype (repeatable).",
)
@click.option("--quick", is_flag=True, help="The first (smallest) shape only.")
@click.option("--show", is_flag=True, help="List what the tuning store holds instead of tuning.")
@click.option(
    "--clear-demotions",
    is_flag=True,
    help="Forget the demotions (KERNREG_DEMOTE) of OP, an op id or glob (default: all).",
)
@json_option
@common_options
@click.pass_obj
def tune_command(
    state: State,
    op: str | None,
    all_ops: bool,
    shapes: tuple[str, ...],
    dtypes: tuple[str, ...],
    quick: bool,
    show: bool,
    clear_demotions: bool,
    as_json: bool,
) -> int:
    """Measure the eligible implementations of OP (or --all) on the shapes its input
    generator declares, and keep the results in the tuning store that the autotune
    policy (KERNREG_POLICY=autotune) reads. Call signatures already in the store are not
    measured again. With --show, list the store (demotions included); with
    --clear-demotions, forget the demotions of OP (a glob too), or of every op.
    """
    if clear_demotions and op is not None and state.bad_op is not None:
        with contextlib.suppress(InvalidSpecError):
            check_op_glob(op, "OP")  # a glob names the ops to clear
            state.bad_op = None
    registry = open_registry(state)
    if clear_demotions:
        cleared = registry.clear_demotions(op or "*")
        if as_json:
            echo_json({"cleared": [d.describe() for d in cleared]})
        else:
            for demotion in cleared:
                echo_wrapped(f"cleared: {demotion}", "  ")
            click.echo(f"{len(cleared)} demotion{'' if len(cleared) == 1 else 's'} cleared")
        return 0
    if show:
        return _show(registry, op, as_json)
    if (op is None) == (not all_ops):
        raise click.UsageError("give one OP or --all (or --show)")
    try:
        from kernreg.torch import input_spec
        from kernreg.torch.tune import counter, tune_op
    except ImportError as exc:
        raise CliError(
            f"kernreg tune needs torch ({exc})", "pip install 'kernreg[torch]'"
        ) from None
    ops = (
        [op]
        if op is not None
        else [o for o in registry.ops() if input_spec(o) and registry.reference(o)]
    )
    before = counter.value
    rows = [
        row
        for name in ops
        for row in tune_op(
            name, shapes=shapes or None, dtypes=dtypes or None, registry=registry, quick=quick
        )
    ]
    measured = counter.value - before
    store = registry.tuning_store
    where = store.path if store is not None else "memory (the store could not be opened)"
    if as_json:
        echo_json({"store": where, "measurements": measured, "rows": [r.describe() for r in rows]})
        return 0
    print_table(
        ("OP", "DTYPE", "SHAPE", "BUCKET", "CHOSEN", "RULE", "MEASURED"),
        [
            [
                r.op,
                r.dtype,
                r.shape,
                r.bucket,
                r.chosen or "-",
                r.rule,
                _measured_text(r),
            ]
            for r in rows
        ],
        title=f"tune on {describe_platform(registry.platform)}",
    )
    echo_wrapped(f"{len(rows)} call signature(s), {measured} measurement(s); store: {where}", "  ")
    return 0


def _measured_text(row: Any) -> str:
    """The MEASURED column: measured by this run, read from the store, or nothing to time."""
    if row.measured_now:
        return "measured"
    if row.results:
        return "stored"
    return "nothing to measure"


def _show(registry: KernelRegistry, op: str | None, as_json: bool) -> int:
    path = registry.tuning_store_path
    store = registry.tuning_store if os.path.exists(path) else None  # listing creates none
    if store is None and os.path.exists(path):
        raise CliError(
            "the tuning store cannot be opened", "set KERNREG_CACHE_DIR to a writable directory"
        )
    stored = store.entries() if store is not None else []
    entries = [(key, results) for key, results in stored if op is None or key.op == op]
    demotions = registry.demotions(op or "*")
    if op is not None and not entries and not demotions and not registry.has(op):
        registry.get(op)  # an op neither stored nor registered: OpNotFoundError, did you mean
    if as_json:
        echo_json(
            {
                "store": path,
                "demotions": [d.describe() for d in demotions],
                "entries": [
                    {
                        "key": key.describe(),
                        "results": {k: m.describe() for k, m in sorted(results.items())},
                    }
                    for key, results in entries
                ],
            }
        )
        return 0
    rows = []
    for key, results in entries:
        fastest = min(results, key=lambda label: results[label].median_ns)
        timings = ", ".join(
            f"{label} {_format_ns(m.median_ns)}" for label, m in sorted(results.items())
        )
        rows.append(
            [
                key.op,
                _platform_text(key.platform),
                ",".join(key.dtypes) or "-",
                key.bucket,
                fastest,
                timings,
            ]
        )
    print_table(
        ("OP", "PLATFORM", "DTYPES", "BUCKET", "FASTEST", "MEDIANS"),
        rows,
        title=f"tuning store {path}",
        wrap=("MEDIANS",),  # the timings are the answer: folded, never cut
    )
    click.echo(f"{len(rows)} entr{'y' if len(rows) == 1 else 'ies'}")
    if demotions:
        print_table(
            ("OP", "DEMOTED", "PLATFORM", "DTYPES", "BUCKET", "ERROR"),
            [
                [
                    d.op,
                    d.label,
                    _platform_text(d.platform),
                    ",".join(d.dtypes) or "-",
                    d.bucket,
                    d.error,
                ]
                for d in demotions
            ],
            title="demotions (KERNREG_DEMOTE); kernreg tune --clear-demotions [OP] clears them",
            wrap=("ERROR",),
        )
        click.echo(f"{len(demotions)} demotion{'' if len(demotions) == 1 else 's'}")
    return 0


COMMANDS = (tune_command,)

"""``kernreg bench``: time every implementation of an op that can run here, against the reference.

Needs torch (``pip install 'kernreg[torch]'``); ``--plot`` needs matplotlib
(``pip install 'kernreg[plot]'``). The inputs come from each op's registered generator, on
the named shapes it declares (:func:`kernreg.torch.bench.bench_shapes`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from kernreg._names import display_label
from kernreg.cli._app import (
    CliError,
    State,
    common_options,
    describe_platform,
    dtypes_callback,
    echo_json,
    echo_warning,
    echo_wrapped,
    escapes_understood,
    json_option,
    op_callback,
    open_registry,
    print_table,
)
from kernreg.cli._conditional import (
    conditional_option,
    conditional_skip_hint,
    predicates_held,
)

__all__ = ["COMMANDS"]

_HEADERS = (
    "OP",
    "IMPLEMENTATION",
    "DTYPE",
    "SHAPE",
    "DIMS",
    "MEDIAN",
    "IQR",
    "CALLS",
    "SPEED-UP",
)
#: Left out first when the terminal is narrow; the others carry the answer.
_DROPPABLE = ("DIMS", "IQR", "CALLS")
_KEEP = ("OP", "IMPLEMENTATION", "DTYPE", "SHAPE", "MEDIAN", "SPEED-UP")
_PLOT_HINT = "pip install 'kernreg[plot]'"


def _speedup_style(result: Any) -> str | None:
    """Green for a significant speed-up, yellow for a significant slow-down."""
    if result.reference or result.speedup is None or not result.significant:
        return None
    return "green" if result.speedup > 1 else "yellow"


def _median_text(result: Any, format_ns: Callable[[float], str]) -> str:
    """``29.4 us +-1.2%``: the median with its unit and the half-width of its 95% interval."""
    low, high = result.interval
    median = result.measurement.median_ns
    half = (high - low) / 2 / median if median else 0.0
    text = f"{format_ns(median)} +-{half:.1%}"
    return text + " (noisy)" if result.noisy else text


def _rows(report: Any, format_ns: Callable[[float], str]) -> list[tuple[list[str], str | None]]:
    rows = []
    for r in report.results:
        label = display_label(r.implementation, r.reference)
        rows.append(
            (
                [
                    report.op,
                    label,
                    r.dtype,
                    r.shape,
                    r.dims_text or "-",
                    _median_text(r, format_ns),
                    format_ns(r.measurement.spread_ns),
                    str(r.measurement.repeats),
                    r.speedup_text,
                ],
                _speedup_style(r),
            )
        )
    return rows


def _not_timed(reports: list[Any]) -> list[str]:
    """One line per implementation and reason, naming the ops (all of them: "every op")."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for report in reports:
        for skip in report.skipped:
            ops = grouped.setdefault((skip.implementation, skip.reason), [])
            if report.op not in ops:
                ops.append(report.op)
    lines = []
    for (implementation, reason), ops in grouped.items():
        where = "every op" if len(reports) > 1 and len(ops) == len(reports) else ", ".join(ops)
        lines.append(f"  {implementation} ({where}): {conditional_skip_hint(reason)}")
    return lines


def _check_matplotlib() -> None:
    try:
        importlib.import_module("matplotlib")
    except ImportError as exc:
        raise CliError(f"--plot needs matplotlib ({exc})", _PLOT_HINT) from None


@contextmanager
def _progress() -> Iterator[Callable[[str], Callable[[int, int, str], None]]]:
    """Per op, a ``progress(done, total, what)`` callback: on a terminal, one status line
    on stderr rewritten in place and erased at the end (nothing is left above the
    table); else one plain line per op once it finishes."""
    if sys.stderr.isatty() and escapes_understood():
        width = shutil.get_terminal_size((80, 24)).columns

        def status(text: str) -> None:
            sys.stderr.write("\r\x1b[K" + text[: max(width - 1, 0)])
            sys.stderr.flush()

        def on_terminal(op: str) -> Callable[[int, int, str], None]:
            def update(done: int, total: int, what: str) -> None:
                status(f"bench {done}/{total}: {what}")

            return update

        try:
            yield on_terminal
        finally:
            status("")
        return

    def plain(op: str) -> Callable[[int, int, str], None]:
        started = time.perf_counter()

        def update(done: int, total: int, what: str) -> None:
            if done == total:
                elapsed = time.perf_counter() - started
                click.echo(f"bench {op}: done in {elapsed:.2f} s", err=True)

        return update

    yield plain


@click.command("bench")
@click.argument("op", required=False, callback=op_callback)
@click.option("--all", "all_ops", is_flag=True, help="Benchmark every op with an input generator.")
@click.option(
    "--shape",
    "shapes",
    multiple=True,
    metavar="NAME",
    help="A named shape of the op's input generator (repeatable; default: all of them, "
    "e.g. small, medium, large).",
)
@click.option(
    "--dtype",
    "dtypes",
    multiple=True,
    callback=dtypes_callback,
    metavar="DTYPE",
    help="Benchmark this dtype (repeatable; default: the generator's, usually float32, "
    "float16 and bfloat16).",
)
@click.option(
    "--quick",
    is_flag=True,
    help="The first (smallest) shape only, with fewer warm-up and timed calls.",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    metavar="N",
    help="Untimed calls before timing (the table's title shows what was used).",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    metavar="N",
    help="At least this many timed calls per implementation, dtype and shape (default 25; "
    "10 with --quick).",
)
@click.option(
    "--max-time",
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="After those, go on timing a dtype and shape until every median's 95% interval "
    "is within 2% or this time has passed (default 0.5; 0.1 with --quick).",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, writable=True),
    metavar="FILE.png",
    help=f"Also write a PNG chart of the times (needs matplotlib: {_PLOT_HINT}).",
)
@conditional_option
@json_option
@common_options
@click.pass_obj
def bench_command(
    state: State,
    op: str | None,
    all_ops: bool,
    shapes: tuple[str, ...],
    dtypes: tuple[str, ...],
    quick: bool,
    warmup: int | None,
    repeats: int | None,
    max_time: float | None,
    plot_path: str | None,
    conditional: bool,
    as_json: bool,
) -> int:
    """Time every implementation of OP that can run here, on representative shapes.

    Each implementation eligible on this machine (the reference included) runs on the
    named shapes of the op's input generator, per dtype: warm-up calls, then timed
    calls (CUDA events on a GPU), the implementations interleaved, until each median
    is known to +-2% (95% interval) or --max-time runs out. The table shows the median
    with its interval, the interquartile range and the speed-up over the reference
    with its 95% interval: 'n.s.' (not significant) when that interval includes 1x.
    Implementations that cannot run here are listed with the reason. A median whose
    interval stays wider than +-5% is marked "(noisy)" and warned about.
    """
    if (op is None) == (not all_ops):
        raise click.UsageError("give one OP or --all")
    try:
        from kernreg.torch import input_spec
        from kernreg.torch.bench import benchmark, format_ns, op_shapes
    except ImportError as exc:
        raise CliError(
            f"kernreg bench needs torch ({exc})", "pip install 'kernreg[torch]'"
        ) from None
    if plot_path is not None:
        _check_matplotlib()
        _check_plot_path(plot_path)
    registry = open_registry(state)
    if op is not None:
        registry.explain(op)  # an unknown op fails here, before any timing
        ops = [op]
        without: list[str] = []
    else:
        every = registry.ops()
        ops = [o for o in every if input_spec(o) is not None]
        without = [o for o in every if o not in ops]
    if shapes:
        for name in ops:  # every op checked before anything is timed
            known = op_shapes(name, registry=registry)
            missing = [s for s in shapes if s not in known]
            if missing:
                raise CliError(
                    f"op '{name}' has no shape {', '.join(map(repr, missing))}; "
                    f"its shapes: {', '.join(known)}"
                )
    with (
        predicates_held(registry, ops) if conditional else contextlib.nullcontext(),
        _progress() as progress_for,
    ):
        reports = [
            benchmark(
                name,
                shapes=shapes or None,
                dtypes=dtypes or None,
                registry=registry,
                warmup=warmup,
                repeats=repeats,
                max_time=max_time,
                quick=quick,
                progress=progress_for(name),
            )
            for name in ops
        ]
    if plot_path is not None:
        from kernreg.torch.bench import plot_reports

        try:
            plot_reports(reports, plot_path)
        except OSError as exc:
            raise CliError(
                f"cannot write the plot {plot_path!r}: {exc.strerror or exc}",
                "choose a FILE.png in a folder you can write to",
            ) from None
    if as_json:
        echo_json(
            {
                "platform": str(registry.platform),
                "quick": quick,
                "reports": [r.describe() for r in reports],
                "not_benchmarked": dict.fromkeys(without, "no input generator"),
                "plot": plot_path,
            }
        )
        return 0
    rows: list[list[str]] = []
    styles: list[str | None] = []
    for report in reports:
        for row, style in _rows(report, format_ns):
            rows.append(row)
            styles.append(style)
    calls = (
        f"{reports[0].warmup} warm-up + at least {reports[0].repeats} timed calls each, "
        f"interleaved, up to {reports[0].max_time:g} s per shape"
        if reports
        else ""
    )
    print_table(
        _HEADERS,
        rows,
        title=f"bench on {describe_platform(registry.platform)} ({calls})",
        styles=styles,
        droppable=_DROPPABLE,
        keep=_KEEP,
        shortenable=("MEDIAN",),  # "(noisy)" goes before anything is cut: the warning says it
        section="OP",
        wrap=(),
    )
    if any(not r.reference and r.speedup is not None for rep in reports for r in rep.results):
        echo_wrapped(
            "SPEED-UP: the reference's median over this one's, [95% interval]; "
            "n.s.: not significant (the interval includes 1x)",
            "  ",
        )
    not_timed = _not_timed(reports)
    if not_timed:
        click.echo("not timed here:")
        for line in not_timed:
            echo_wrapped(line, "  ")
    summary = f"{len(reports)} op(s) benchmarked, {len(rows)} timing(s)"
    if without:
        summary += f"; not benchmarked (no input generator): {', '.join(without)}"
    if plot_path is not None:
        summary += f"; plot written to {plot_path}"
    echo_wrapped(summary, "  ")
    _warn_noisy(reports)
    return 0


def _warn_noisy(reports: list[Any]) -> None:
    """One warning naming the timings whose spread is too wide to trust."""
    from kernreg.torch.bench import NOISY_FRACTION

    noisy = [
        f"{r.op} {r.implementation} {r.dtype} {r.shape}"
        for report in reports
        for r in report.results
        if r.noisy
    ]
    if noisy:
        shown = "; ".join(noisy[:5]) + (f"; and {len(noisy) - 5} more" if len(noisy) > 5 else "")
        echo_warning(
            f"{len(noisy)} timing(s) too noisy to trust (the 95% interval of the median "
            f"stayed wider than +-{NOISY_FRACTION:.0%} within --max-time): {shown}. "
            "Give them more time (--max-time), or rerun when the machine is less busy."
        )


def _check_plot_path(path: str) -> None:
    """Fail before any timing when the plot cannot be written where asked."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(
            f"cannot write the plot {path!r}: folder {folder} does not exist",
            "create the folder first, or choose another FILE.png",
        )


COMMANDS = (bench_command,)

"""``kernreg bench``: time every implementation of an op that can run here, against the reference.

Needs torch (``pip install 'kernreg[torch]'``); ``--plot`` needs matplotlib
(``pip install 'kernreg[plot]'``). The inputs come from each op's registered generator, on
the named shapes it declares (:func:`kernreg.torch.bench.bench_shapes`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
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
    "ROUNDS",
    "SPEED-UP",
)
_PLOT_HINT = "pip install 'kernreg[plot]'"


def _speedup_style(speedup: float | None, reference: bool) -> str | None:
    if reference or speedup is None:
        return None
    if speedup >= 1.05:
        return "green"
    return "yellow" if speedup <= 0.95 else None


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
                    format_ns(r.measurement.median_ns),
                    format_ns(r.measurement.spread_ns) + (" (noisy)" if r.noisy else ""),
                    str(r.measurement.repeats),
                    "-" if r.speedup is None else f"{r.speedup:.2f}x",
                ],
                _speedup_style(r.speedup, r.reference),
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
    """Per op, a ``progress(done, total, what)`` callback: a rich bar on a terminal
    (stderr), else one plain line per op once it finishes."""
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=Console(stderr=True),
            transient=True,
        ) as bar:

            def for_op(op: str) -> Callable[[int, int, str], None]:
                task = bar.add_task(op, total=None)

                def update(done: int, total: int, what: str) -> None:
                    bar.update(task, completed=done, total=total, description=what)
                    if done == total:
                        bar.remove_task(task)

                return update

            yield for_op
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
    help="Timed calls per measurement.",
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
    plot_path: str | None,
    conditional: bool,
    as_json: bool,
) -> int:
    """Time every implementation of OP that can run here, on representative shapes.

    Each implementation eligible on this machine (the reference included) runs on the
    named shapes of the op's input generator, per dtype: warm-up calls, then timed
    calls (CUDA events on a GPU). The table shows the median, the interquartile range
    and the speed-up over the reference; implementations that cannot run here are
    listed with the reason. A timing whose IQR exceeds a tenth of its median is marked
    "(noisy)" and warned about: rerun it on a quieter machine, or with more --repeats.
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
        f"{reports[0].warmup} warm-up + {reports[0].repeats} timed calls each" if reports else ""
    )
    print_table(
        _HEADERS,
        rows,
        title=f"bench on {describe_platform(registry.platform)} ({calls})",
        styles=styles,
    )
    not_timed = _not_timed(reports)
    if not_timed:
        click.echo("not timed here:")
        click.echo("\n".join(not_timed))
    summary = f"{len(reports)} op(s) benchmarked, {len(rows)} timing(s)"
    if without:
        summary += f"; not benchmarked (no input generator): {', '.join(without)}"
    if plot_path is not None:
        summary += f"; plot written to {plot_path}"
    click.echo(summary)
    _warn_noisy(reports)
    return 0


def _warn_noisy(reports: list[Any]) -> None:
    """One warning naming the timings whose spread is too wide to trust."""
    from kernreg.torch.bench import NOISY_IQR_FRACTION

    noisy = [
        f"{r.op} {r.implementation} {r.dtype} {r.shape}"
        for report in reports
        for r in report.results
        if r.noisy
    ]
    if noisy:
        shown = "; ".join(noisy[:5]) + (f"; and {len(noisy) - 5} more" if len(noisy) > 5 else "")
        echo_warning(
            f"{len(noisy)} timing(s) too noisy to trust (IQR above "
            f"{NOISY_IQR_FRACTION:.0%} of the median): {shown}. Rerun on an idle machine "
            "or with more --repeats."
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

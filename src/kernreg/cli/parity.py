"""``kernreg parity``: run implementations against the op's reference, here, on real inputs.

Needs torch (``pip install 'kernreg[torch]'``); the inputs come from each op's registered
generator (:func:`kernreg.torch.inputs`). Exits 1 when any implementation disagrees with
the reference or raises.
"""

from __future__ import annotations

import contextlib
from typing import Any

import click

from kernreg._names import display_label
from kernreg.cli._app import (
    CliError,
    SeedType,
    State,
    assume_package_option,
    common_options,
    describe_platform,
    dtype_option,
    echo_error,
    echo_json,
    echo_wrapped,
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
from kernreg.errors import KernregError

__all__ = ["COMMANDS"]

_HEADERS = ("OP", "IMPLEMENTATION", "DTYPE", "STATUS", "MAX ABS ERR", "TOLERANCE", "DETAIL")
_SEVERITY = {"pass": 0, "skipped": 1, "fail": 2, "error": 3}
_STYLES = {"pass": "green", "skipped": "dim", "fail": "red", "error": "red"}


def _rows(report: Any) -> list[tuple[list[str], str]]:
    """One row per (implementation, dtype): the worst status over the input cases."""
    grouped: dict[tuple[str, str], list[Any]] = {}
    for result in report.results:
        grouped.setdefault((result.implementation, result.dtype), []).append(result)
    rows = []
    for (implementation, dtype), results in grouped.items():
        worst = max(results, key=lambda r: _SEVERITY[r.status])
        errors = [r.max_abs_error for r in results if r.max_abs_error is not None]
        tolerance = next((r.tolerance for r in results if r.tolerance is not None), None)
        detail = worst.message
        if worst.status == "skipped":
            detail = conditional_skip_hint(detail)
        if worst.status == "pass" and len(results) > 1:
            detail = f"{len(results)} cases"
        label = display_label(implementation, implementation == report.reference)
        rows.append(
            (
                [
                    report.op,
                    label,
                    dtype,
                    worst.status,
                    f"{max(errors):.3g}" if errors else "-",
                    "-" if tolerance is None else str(tolerance),
                    detail,
                ],
                worst.status,
            )
        )
    return rows


@click.command("parity")
@click.argument("op", required=False, callback=op_callback)
@click.option("--all", "all_ops", is_flag=True, help="Check every op with an input generator.")
@dtype_option
@click.option(
    "--seed",
    "seeds",
    # A seed a generator cannot take is a usage error naming it, not a failed op.
    type=SeedType(),
    multiple=True,
    metavar="N",
    help="Input case to generate (repeatable; default 0 and 1).",
)
@click.option(
    "--interpret",
    is_flag=True,
    help="Run the triton implementations through Triton's interpreter on CPU tensors, "
    "as if on a GPU that meets their requirements (needs triton; no timing).",
)
@click.option(
    "--strict",
    is_flag=True,
    help="With --all, also exit 1 when an op escapes the check (no input generator, or no "
    "reference).",
)
@assume_package_option
@conditional_option
@json_option
@common_options
@click.pass_obj
def parity_command(
    state: State,
    op: str | None,
    all_ops: bool,
    dtypes: tuple[str, ...],
    seeds: tuple[int, ...],
    interpret: bool,
    conditional: bool,
    as_json: bool,
    strict: bool = False,
) -> int:
    """Run every implementation of OP that can run here against its reference.

    Outputs, in-place writes and untouched inputs are compared with per-dtype
    tolerances; implementations that cannot run here are listed as skipped with the
    reasons `kernreg explain` gives. Exits 1 on any mismatch or error.

    With --interpret only the triton implementations run, in Triton's interpreter
    (TRITON_INTERPRET=1), on CPU: their device gates are simulated, the others apply.
    """
    if (op is None) == (not all_ops):
        raise click.UsageError("give one OP or --all")
    try:
        from kernreg.torch import input_spec
        from kernreg.torch.parity import check_parity
    except ImportError as exc:
        raise CliError(
            f"kernreg parity needs torch ({exc})", "pip install 'kernreg[torch]'"
        ) from None
    if interpret:
        _enable_interpreter()  # before the -m modules import any kernel module
    registry = open_registry(state)
    if op is not None:
        ops = [op]
        without: list[str] = []
    else:
        every = registry.ops()
        ops = [o for o in every if input_spec(o) is not None and registry.reference(o)]
        without = [o for o in every if o not in ops]
    not_checked = dict.fromkeys(without, "no input generator or no reference")
    if interpret:
        for name in [o for o in ops if not _has_triton(registry, o)]:
            not_checked[name] = "no triton implementation"
            if op is None:
                ops.remove(name)  # one named OP still gets its reference checked
    reports = []
    errors: dict[str, str] = {}
    with predicates_held(registry, ops) if conditional else contextlib.nullcontext():
        for name in ops:
            try:
                reports.append(
                    check_parity(
                        name,
                        dtypes=dtypes or None,
                        seeds=seeds or (0, 1),
                        registry=registry,
                        interpret=interpret,
                    )
                )
            except KernregError as exc:
                if op is not None:
                    raise
                errors[name] = str(exc).partition("\n")[0]  # one broken generator stops no other
    ok = all(r.ok for r in reports) and not errors
    compared = [r for r in reports if any(i != r.reference for i in r.checked)]
    code = 0 if ok and not (strict and without) else 1
    if as_json:
        echo_json(
            {
                "ok": ok,
                "nothing_compared": [r.op for r in reports if r not in compared],
                "platform": str(registry.platform),
                "interpreted": interpret,
                "reports": [r.describe() for r in reports],
                "not_checked": not_checked,
                "errors": errors,
            }
        )
        return code
    rows: list[list[str]] = []
    styles: list[str | None] = []
    for report in reports:
        for row, status in _rows(report):
            rows.append(row)
            styles.append(_STYLES[status])
    title = f"parity on {describe_platform(registry.platform)}"
    if interpret:
        from kernreg.torch.parity import INTERPRETED_NOTE

        title = f"parity of the triton implementations, {INTERPRETED_NOTE}"
    print_table(_HEADERS, rows, title=title, styles=styles, droppable=("TOLERANCE",), section="OP")
    failing = sum(len(r.failures) for r in reports)
    if not ok:
        verdict = f"{failing} failing case(s)"
    elif not compared:
        verdict = "nothing was compared: only the reference ran (see the skipped rows)"
    elif len(compared) < len(reports):
        alone = ", ".join(r.op for r in reports if r not in compared)
        verdict = (
            "the implementations that ran agree with the reference; "
            f"nothing compared for {alone} (only the reference ran)"
        )
    else:
        verdict = "all implementations that ran agree with the reference"
    summary = f"{len(reports)} op(s) checked: {verdict}"
    if interpret:
        no_triton = [o for o, why in not_checked.items() if why == "no triton implementation"]
        if no_triton:
            summary += f"; no triton implementation: {', '.join(no_triton)}"
        summary = summary.replace(" checked:", f" checked, {INTERPRETED_NOTE}:", 1)
    echo_wrapped(summary, "  ")
    no_generator = [o for o in without if input_spec(o) is None]
    no_reference = [o for o in without if o not in no_generator]
    if no_generator:
        echo_wrapped(
            f"not checked, no input generator: {', '.join(no_generator)} "
            "(declare one with kernreg.torch.register_inputs; --strict makes this exit 1)",
            "  ",
        )
    if no_reference:
        echo_wrapped(f"not checked, no reference: {', '.join(no_reference)}", "  ")
    for name, message in errors.items():
        echo_error(f"op {name} could not be checked: {message}")
    return code


def _enable_interpreter() -> None:
    from kernreg.torch.parity import TritonInterpreterError, enable_triton_interpreter

    try:
        enable_triton_interpreter()
    except TritonInterpreterError as exc:
        raise CliError(f"kernreg parity --interpret: {exc}", exc.hint) from None


def _has_triton(registry: Any, op: str) -> bool:
    return any(spec.backend == "triton" for spec in registry.get(op))


COMMANDS = (parity_command,)

"""``kernreg lock``: write the selection plan of this inventory, or check a plan for drift."""

from __future__ import annotations

import functools
import os

import click

from kernreg.cli._app import (
    CliError,
    State,
    assume_package_option,
    common_options,
    echo_json,
    echo_warning,
    json_option,
    open_registry,
    platform_option,
)
from kernreg.plan import SelectionPlan, build_plan
from kernreg.platform import Platform

__all__ = ["COMMANDS"]


@click.command("lock")
@functools.partial(platform_option, multiple=True)
@assume_package_option
@click.option(
    "-o",
    "--output",
    "path",
    default="kernreg.lock",
    show_default=True,
    metavar="FILE",
    help="The plan file to write (or, with --check, to compare against).",
)
@click.option(
    "--check", is_flag=True, help="Compare FILE with what would be chosen now; exit 1 on drift."
)
@click.option(
    "--fingerprint", "show_fingerprint", is_flag=True, help="Print the plan's fingerprint only."
)
@json_option
@common_options
@click.pass_obj
def lock_command(
    state: State,
    platforms: tuple[Platform, ...],
    path: str,
    check: bool,
    show_fingerprint: bool,
    as_json: bool,
) -> int:
    """Write the selection plan: for each op x platform x dtype set, the implementation
    chosen, its distribution and version, and the rule that chose it.

    Workers follow a plan with KERNREG_LOCK=FILE. With --check, FILE is compared with the
    decisions made now (ignoring any loaded plan), and every difference is listed.
    """
    registry = open_registry(state)
    current = build_plan(registry, platforms=platforms, follow_plan=False)
    if show_fingerprint:
        click.echo(current.fingerprint())
        return 0
    if check:
        if not os.path.exists(path):
            raise CliError(f"no plan at {path}", "write one with `kernreg lock -o FILE`")
        locked = SelectionPlan.load(path)
        compared = {e.platform for e in locked.entries()}
        if not platforms and compared:
            # Compare on the platforms the plan was written for, not only this machine's.
            current = build_plan(registry, platforms=sorted(compared), follow_plan=False)
        drift = locked.diff(current)
        # Versions that moved are a warning: the decisions above say whether it mattered.
        versions = locked.environment_drift(current)
        if as_json:
            echo_json(
                {
                    "ok": not drift,
                    "path": path,
                    "drift": drift,
                    "environment_drift": versions,
                    "fingerprint": current.fingerprint(),
                }
            )
        elif drift:
            click.echo(f"{path}: {len(drift)} decision(s) drifted:")
            for line in drift:
                click.echo(f"  {line}")
        else:
            click.echo(f"{path}: up to date ({len(locked)} decisions)")
        if versions and not as_json:
            echo_warning(f"{path}: the environment changed since it was written:")
            for line in versions:
                click.echo(f"  {line}", err=True)
        return 1 if drift else 0
    current.save(path)
    if as_json:
        echo_json({"path": path, "entries": len(current), "fingerprint": current.fingerprint()})
    else:
        click.echo(
            f"wrote {path}: {len(current)} decisions, fingerprint {current.fingerprint()[:16]}"
        )
    return 0


COMMANDS = (lock_command,)

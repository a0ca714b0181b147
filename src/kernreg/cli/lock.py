"""``kernreg lock``: write the selection plan of this inventory, or check a plan for drift."""

from __future__ import annotations

import functools
import io
import os
import sys

import click

from kernreg._packages import parse_assumed
from kernreg.cli._app import (
    CliError,
    State,
    assume_package_option,
    common_options,
    echo_json,
    echo_warning,
    echo_wrapped,
    json_option,
    open_registry,
    platform_option,
)
from kernreg.plan import MAX_PLAN_BYTES, PlanError, SelectionPlan
from kernreg.platform import Platform
from kernreg.registry import build_plan

__all__ = ["COMMANDS", "DEFAULT_PLAN"]

#: The plan file ``kernreg lock`` writes (and ``--check`` reads) when none is named.
DEFAULT_PLAN = "kernreg.lock"


@click.command("lock")
@click.argument("file", required=False, metavar="[FILE]")
@functools.partial(
    platform_option,
    multiple=True,
    help_text="Decide on this platform instead of the detected one (repeatable: "
    "one plan for several platforms)",
)
@assume_package_option
@click.option(
    "-o",
    "--output",
    "path",
    default=None,
    metavar="FILE",
    help="The plan file, as the FILE argument (default: kernreg.lock).",
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
    file: str | None,
    platforms: tuple[Platform, ...],
    path: str | None,
    check: bool,
    show_fingerprint: bool,
    as_json: bool,
) -> int:
    """Write the selection plan to FILE (default kernreg.lock): for each op x platform x
    dtype set, the implementation chosen, its distribution and version, and the rule that
    chose it.

    Workers follow a plan with KERNREG_LOCK=FILE. With --check, FILE is compared with the
    decisions made now (ignoring any loaded plan), and every difference is listed:
    `kernreg lock --check plan.json`. FILE may also be given as -o FILE; - writes the plan
    to stdout (with --check: reads it from stdin).
    """
    if file is not None and path is not None and file != path:
        raise click.UsageError(f"two plan files given: {file!r} and -o {path!r}; give one")
    path = file or path or DEFAULT_PLAN
    registry = open_registry(state)
    current = build_plan(registry, platforms=platforms, follow_plan=False)
    if show_fingerprint:
        click.echo(current.fingerprint())
        return 0
    if check:
        locked = _read_plan(path)
        compared = {e.platform for e in locked.entries()}
        assumed = (locked.environment or {}).get("assumed_packages")
        if assumed and not registry.config.assume_packages:
            # Decided for a target's packages, as for its platforms: compared the same way.
            try:
                packages = parse_assumed(assumed, source=locked.source)
            except ValueError as exc:
                raise PlanError(locked.source, f"environment: assumed_packages: {exc}") from None
            registry.configure(registry.config.replace(assume_packages=packages))
            current = build_plan(registry, platforms=platforms, follow_plan=False)
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
                echo_wrapped(f"  {line}", "  ")
        else:
            click.echo(f"{path}: up to date ({len(locked)} decisions)")
        if versions and not as_json:
            echo_warning(f"{path}: the environment changed since it was written:")
            for line in versions:
                click.echo(f"  {line}", err=True)
        return 1 if drift else 0
    if path == "-" and as_json:
        raise click.UsageError("the plan goes to stdout (FILE -): --json has no room there")
    if path != "-":
        _check_writable(path)
    try:
        if path == "-":  # the plan itself on stdout, as a shell user means by '-'
            click.echo(current.to_json(), nl=False)
            return 0
        current.save(path)
    except PlanError as exc:
        raise CliError(
            f"cannot write the plan to {path}: {str(exc).partition(': ')[2]}",
            "lock fewer platforms (--platform), or fewer ops (KERNREG_PLUGINS, -m): "
            "KERNREG_LOCK reads no bigger plan",
        ) from None
    except OSError as exc:
        raise CliError(
            f"cannot write the plan to {path}: {exc.strerror or exc}",
            "choose a FILE in a folder that exists and that you can write to",
        ) from None
    if as_json:
        echo_json({"path": path, "entries": len(current), "fingerprint": current.fingerprint()})
    else:
        echo_wrapped(
            f"wrote {path}: {len(current)} decisions, fingerprint {current.fingerprint()[:16]}",
            "  ",
        )
    return 0


def _read_plan(path: str) -> SelectionPlan:
    """The plan to check: the file at ``path``, or standard input for ``-``."""
    if path == "-":  # as `kernreg lock - | ... | kernreg lock --check -` pipes it
        try:
            stdin = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8-sig")
            text = stdin.read(MAX_PLAN_BYTES + 1)  # from_json refuses a longer text
        except ValueError as exc:  # not UTF-8
            raise PlanError("<stdin>", f"cannot read it ({exc})") from None
        return SelectionPlan.from_json(text, source="<stdin>")
    if not os.path.exists(path):
        raise CliError(
            f"no plan at {path}", f"write one with `kernreg lock {path}` (or `-o {path}`)"
        )
    return SelectionPlan.load(path)


def _check_writable(path: str) -> None:
    """Fail before deciding anything when ``path`` cannot take a plan file."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CliError(f"cannot write the plan to {path}: it is a folder", "give a file name")
    if not os.path.isdir(folder):
        raise CliError(
            f"cannot write the plan to {path}: folder {folder} does not exist",
            "create the folder first, or choose another FILE",
        )


COMMANDS = (lock_command,)

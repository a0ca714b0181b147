"""``kernreg stats``: a process's decision counters, from the snapshot it exported."""

from __future__ import annotations

import glob

import click

from kernreg.cli._app import CliError, State, common_options, echo_json, json_option
from kernreg.registry import default_registry
from kernreg.tracing import Stats

__all__ = ["COMMANDS"]


@click.command("stats")
@click.argument("file", required=False)
@json_option
@common_options
@click.pass_obj
def stats_command(state: State, file: str | None, as_json: bool) -> int:
    """Show the decision counters a process exported: FILE, written by
    kernreg.stats().save(FILE), or else KERNREG_STATS_FILE, which a process writes when it
    exits ({pid} in it: every process's file). Nothing is imported or decided here."""
    pattern = file or default_registry().config.stats_file
    if pattern is None:
        raise CliError(
            "no stats file given",
            "pass FILE, or set KERNREG_STATS_FILE for the process and for this command",
        )
    paths = sorted(glob.glob(glob.escape(pattern).replace("{pid}", "*"))) or [pattern]
    try:
        snapshots = {path: Stats.load(path) for path in paths}
    except (OSError, ValueError) as exc:
        raise CliError(
            f"cannot read stats: {exc}", "write it with kernreg.stats().save(FILE)"
        ) from None
    if as_json:
        echo_json({path: s.to_dict() for path, s in snapshots.items()})
        return 0
    for path, snapshot in snapshots.items():
        click.echo(f"{path}:\n{snapshot}")
    return 0


COMMANDS = (stats_command,)

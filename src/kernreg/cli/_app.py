"""The ``kernreg`` command group and what its commands share.

Shared here: the options every command takes (``-m/--module``, ``--debug``), the
options that turn ``--platform`` and ``--dtype`` into kernreg values (a bad value is a
usage error, exit 2, naming the value), opening the registry (import the
``-m`` modules, read the configuration, load plugins), output (tables fitted to the
terminal, coloured on one, JSON with ``--json``) and turning
errors into one line plus a hint on stderr (exit 1; ``--debug`` adds the traceback).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import shutil
import sys
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import click

import kernreg
from kernreg._names import check_op_id, label
from kernreg._packages import AssumedPackage, parse_assumed
from kernreg.config import ConfigWarning, Pin, normalize_distribution
from kernreg.dtypes import normalize_dtype
from kernreg.errors import (
    AmbiguousKernelError,
    BackendNotFoundError,
    ConfigError,
    DuplicateReferenceError,
    InvalidSpecError,
    KernelConflictError,
    KernelLoadError,
    KernregError,
    NoEligibleKernelError,
    OpNotFoundError,
    PluginLoadError,
    RegistryFrozenError,
    close_op_ids,
    did_you_mean,
)
from kernreg.plan import PlanError
from kernreg.platform import Platform
from kernreg.platform import parse_platform as checked_platform
from kernreg.plugins import PluginWarning, load_plugins
from kernreg.registry import KernelRegistry, default_registry
from kernreg.selection import Decision
from kernreg.spec import KNOWN_TRAITS, KernelSpec, Origin

__all__ = [
    "COMMAND_MODULES",
    "DEFAULT_WIDTH",
    "CliError",
    "SeedType",
    "State",
    "apply_assumed_packages",
    "assume_package_option",
    "assumed_packages_text",
    "cli",
    "common_options",
    "conflict_resolution",
    "decision_outcome",
    "denied_pins",
    "describe_platform",
    "dtype_option",
    "echo_error",
    "echo_json",
    "echo_warning",
    "echo_wrapped",
    "escapes_understood",
    "fit_columns",
    "fold",
    "format_origin",
    "import_modules",
    "is_terminal",
    "json_option",
    "module_error",
    "op_callback",
    "open_registry",
    "origin_location",
    "parse_platform",
    "platform_option",
    "print_table",
    "run",
    "short_origin",
    "style",
    "table_width",
    "terminal_width",
    "unmatched_pins",
    "unmatched_traits",
    "unused_assumed_packages",
]

#: The modules whose commands make up ``kernreg``, imported (in this order) when the
#: command line starts. A command module defines click commands with the helpers of this
#: module and lists them in a module-level ``COMMANDS`` tuple; adding a command module
#: is a one-line change here.
COMMAND_MODULES = (
    "kernreg.cli.inventory",
    "kernreg.cli.check",
    "kernreg.cli.parity",
    "kernreg.cli.lock",
    "kernreg.cli.bench",
    "kernreg.cli.tune",
    "kernreg.cli.stats",
)

F = TypeVar("F", bound=Callable[..., Any])


class State:
    """What the options of the group and of the command gathered for one invocation."""

    def __init__(self) -> None:
        self.modules: list[str] = []
        self.debug = False
        self.imported = False
        #: ``--assume-package`` values, parsed; they override KERNREG_ASSUME_PACKAGES by name.
        self.assumed_packages: tuple[AssumedPackage, ...] = ()
        #: Warning categories a command reports itself (``check``), so they are not echoed.
        self.reported_warnings: tuple[type[Warning], ...] = ()
        #: An ``OP`` argument that is not an op id: reported by :func:`open_registry`, once
        #: the registered ops are known and a "did you mean" can be offered.
        self.bad_op: tuple[str, str, click.Context, click.Parameter] | None = None


class CliError(Exception):
    """An error to show as one line plus a hint (exit status ``exit_code``)."""

    def __init__(self, message: str, hint: str | None = None, exit_code: int = 1) -> None:
        self.message = message
        self.hint = hint
        self.exit_code = exit_code
        super().__init__(message)


# --- parameter types and shared options ------------------------------------------------------


def parse_platform(text: str, state: State | None = None) -> Platform:
    """A ``--platform`` value as a Platform; a bad one is a usage error naming it.

    A device name that looks misspelt (``gpu``, ``rocm``, ``sm_90``, ``cdua``) is an
    error with a suggestion, unless a registered kernel (after the ``-m`` imports and
    the plugins) mentions that device.
    """
    try:
        return checked_platform(text, source="--platform", known=lambda: _inventory_devices(state))
    except InvalidSpecError as exc:
        raise click.BadParameter(str(exc)) from None


def _inventory_devices(state: State | None) -> set[str]:
    """Devices the registered kernels mention (``-m`` modules and plugins loaded first)."""
    try:
        for name in state.modules if state is not None else ():
            with contextlib.suppress(Exception, SystemExit):
                importlib.import_module(name)  # a failure is reported by the command
        registry = default_registry()
        load_plugins(registry=registry)
        return {req.device for spec in registry.all_specs() for req in spec.requires}
    except Exception:
        return set()


def _platform_callback(
    ctx: click.Context, param: click.Parameter, value: str | tuple[str, ...] | None
) -> Platform | tuple[Platform, ...] | None:
    if value is None:
        return None
    state = ctx.find_object(State)
    if isinstance(value, tuple):  # a platform repeated (cuda:9.0, cuda:sm_90) counts once
        # Keyed with its devices too: cuda:8.0 equals the mixed host cuda:8.0,9.0.
        first: dict[Any, Platform] = {}
        for platform in (parse_platform(v, state) for v in value):
            first.setdefault((platform, platform.devices), platform)
        return tuple(first.values())
    return parse_platform(value, state)


def op_callback(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An ``OP`` argument checked as an op id; a malformed one is a usage error naming it.

    The error is raised by :func:`open_registry`, after the ``-m`` modules and plugins
    have registered their ops, so that it can suggest the op id that was meant.
    """
    if value is None:
        return None
    try:
        return check_op_id(value)
    except InvalidSpecError as exc:
        _state(ctx).bad_op = (value, str(exc), ctx, param)
        return value


def dtypes_callback(
    ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
) -> tuple[str, ...]:
    names = []
    for text in value:
        try:
            names.append(normalize_dtype(text))
        except InvalidSpecError:
            raise click.BadParameter(
                f"unknown dtype {text!r}; known: {', '.join(sorted(kernreg.dtypes.DTYPES))} "
                "(and aliases such as bf16, fp16)"
            ) from None
    return tuple(names)


def _state(ctx: click.Context) -> State:
    return ctx.ensure_object(State)


def _add_modules(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> None:
    _state(ctx).modules.extend(value)


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        _state(ctx).debug = True


def common_options(func: F) -> F:
    """``-m/--module`` and ``--debug``, accepted before the command name and after it."""
    func = click.option(
        "-m",
        "--module",
        "modules",
        multiple=True,
        metavar="MODULE",
        expose_value=False,
        is_eager=True,  # before --platform, whose check reads the modules' kernels
        callback=_add_modules,
        help="Import MODULE first (repeatable), so kernels it registers on import are seen. "
        "The current directory is importable.",
    )(func)
    func = click.option(
        "--debug",
        is_flag=True,
        expose_value=False,
        callback=_set_debug,
        help="Show the traceback of an error.",
    )(func)
    return func


_ASSUME_SOURCE = "--assume-package"


def _comma_items(value: str) -> list[str]:
    """``"a==1, b==2,"`` as ``["a==1", "b==2"]``; a value without commas as it is."""
    return [item for item in value.split(",") if item.strip()] if "," in value else [value]


def _add_assumed(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> None:
    if not value:
        return
    state = _state(ctx)
    try:
        state.assumed_packages = parse_assumed(
            # Also a comma-separated list, as KERNREG_ASSUME_PACKAGES takes it.
            [
                *(str(a) for a in state.assumed_packages),
                *(item for v in value for item in _comma_items(v)),
            ],
            source=_ASSUME_SOURCE,
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def assume_package_option(func: F) -> F:
    """``--assume-package NAME==VERSION`` (repeatable): package gates see that version."""
    return click.option(
        "--assume-package",
        multiple=True,
        metavar="NAME==VERSION",
        expose_value=False,
        callback=_add_assumed,
        help="Decide as if this package version were installed (repeatable), e.g. "
        "triton==3.4 (KERNREG_ASSUME_PACKAGES does the same).",
    )(func)


def apply_assumed_packages(state: State, registry: KernelRegistry) -> None:
    """Give ``registry`` the ``--assume-package`` versions, over the configuration's by name."""
    if not state.assumed_packages:
        return
    config = registry.config
    given = {a.name for a in state.assumed_packages}
    kept = [a for a in config.assume_packages if a.name not in given]
    merged = tuple(sorted([*kept, *state.assumed_packages], key=lambda a: a.name))
    registry.configure(config.replace(assume_packages=merged))


def unused_assumed_packages(registry: KernelRegistry) -> list[str]:
    """A message for each assumed package that no registered implementation requires (a
    misspelt ``--assume-package tritn==3.4`` changes no decision and would say nothing)."""
    assumed = registry.config.assume_packages
    if not assumed:
        return []
    from difflib import get_close_matches

    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    required: set[str] = set()
    for op in registry.ops():
        for spec in registry.get(op):
            for text in spec.packages:
                with contextlib.suppress(InvalidRequirement):
                    required.add(canonicalize_name(Requirement(text).name))
    messages = []
    for package in assumed:
        if package.name in required:
            continue
        where = f" ({package.source})" if package.source else ""
        close = get_close_matches(package.name, sorted(required), n=2, cutoff=0.6)
        hint = f"; {did_you_mean(close)}" if close else ""
        messages.append(
            f"assumed package '{package.name}'{where} is required by no registered "
            f"implementation, so it changes no decision{hint}"
        )
    return messages


def unmatched_traits(registry: KernelRegistry) -> list[str]:
    """A message for each required trait (``KERNREG_TRAITS``) that no registered
    implementation declares: a misspelt one makes every op ineligible, and said nothing."""
    required = registry.config.traits
    if not required:
        return []
    from difflib import get_close_matches

    declared = {t for op in registry.ops() for spec in registry.get(op) for t in spec.traits}
    messages = []
    for trait in sorted(required - declared):
        close = get_close_matches(trait, sorted(declared | set(KNOWN_TRAITS)), n=2, cutoff=0.6)
        hint = f"; {did_you_mean(close)}" if close else ""
        messages.append(
            f"required trait '{trait}' (KERNREG_TRAITS) is declared by no registered "
            f"implementation, so no op has an eligible one{hint}"
        )
    return messages


def unmatched_pins(registry: KernelRegistry) -> list[str]:
    """A message for each configured pin, deny rule and debugging switch (``KERNREG_BACKEND``)
    that names no registered op, or no implementation of the ops it names (misspelt, a pin
    shows only in decisions, and a deny rule or the switch nowhere: it does nothing)."""
    config = registry.config
    named = [(f"pin '{pin}'", pin) for pin in config.pins]
    named += [(f"deny rule '{rule}'", rule) for rule in config.deny]
    if config.backend is not None:
        named.append((f"KERNREG_BACKEND={config.backend}", Pin("*", config.backend)))
    ops = registry.ops()
    messages = []
    for name, pin in named:
        where = f" ({pin.source})" if pin.source else ""
        matched = [op for op in ops if pin.matches(op)]
        if not matched:
            hint = did_you_mean(close_op_ids(pin.pattern, ops)) if pin.exact else ""
            messages.append(
                f"{name}{where} matches no registered op" + (f"; {hint}" if hint else "")
            )
            continue
        labels = {s.label for op in matched for s in registry.get(op)}
        backends = {s.backend for op in matched for s in registry.get(op)}
        # A variant pinned as "" ("torch/") is the default one, labelled "torch".
        wanted = pin.backend if pin.variant is None else label(pin.backend, pin.variant)
        if (pin.backend not in backends) if pin.variant is None else (wanted not in labels):
            shown = ", ".join(sorted(labels))
            messages.append(
                f"{name}{where}: no op it matches has a '{wanted}' implementation "
                f"(they have: {shown})"
            )
    return messages


def denied_pins(registry: KernelRegistry) -> list[str]:
    """A message for each configured pin that can choose an implementation a deny rule
    names: the pin wins (pins come before deny rules), and the deny rule reads as if it held."""
    config = registry.config
    found: dict[tuple[Pin, Pin], dict[str, None]] = {}
    for pin in config.pins if config.deny else ():
        for op in filter(pin.matches, registry.ops()):
            for spec in registry.get(op):
                rule = config.denied(op, spec.backend, spec.variant)
                if rule and spec.backend == pin.backend and pin.variant in (None, spec.variant):
                    found.setdefault((pin, rule), {})[f"{op} ({spec.label})"] = None
    return [
        f"pin '{pin}'{f' ({pin.source})' if pin.source else ''} wins over deny rule '{rule}'"
        f"{f' ({rule.source})' if rule.source else ''}: {', '.join(where)} runs although "
        "denied (a pin comes before deny rules); drop the pin or the deny rule"
        for (pin, rule), where in found.items()
    ]


def assumed_packages_text(registry: KernelRegistry) -> str:
    """``triton==3.4 [--assume-package]``: the assumed package versions, or ``""``."""
    return ", ".join(
        f"{a} [{a.source}]" if a.source else str(a) for a in registry.config.assume_packages
    )


def platform_option(func: F, *, multiple: bool = False, help_text: str | None = None) -> F:
    """``--platform PLATFORM`` (a Platform, or a tuple of them when ``multiple``)."""
    if help_text is None:
        help_text = (
            "Also decide every op on this platform (repeatable)"
            if multiple
            else "Decide for this platform instead of the detected one"
        )
    return click.option(
        "--platform",
        "platforms" if multiple else "platform",
        multiple=multiple,
        callback=_platform_callback,
        metavar="PLATFORM",
        help=help_text + ": cpu, cuda:9.0, cuda:sm_90a, hip:gfx942, ...",
    )(func)


class SeedType(click.ParamType):  # type: ignore[type-arg]
    """A seed for the input generators: an integer in int64's range (torch's seeds), a
    usage error naming the value otherwise; the range is not spelt out in ``--help``."""

    name = "integer"
    LOW, HIGH = -(2**63), 2**63 - 1

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            number = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not an integer", param, ctx)
        if not self.LOW <= number <= self.HIGH:
            self.fail(f"{value} is out of range: a seed is a 64-bit signed integer", param, ctx)
        return number


def dtype_option(func: F) -> F:
    return click.option(
        "--dtype",
        "dtypes",
        multiple=True,
        callback=dtypes_callback,
        metavar="DTYPE",
        help="A dtype of the call (repeatable); without it, implementations restricted to "
        "some dtypes are not chosen because the call's dtypes are unknown.",
    )(func)


def json_option(func: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, help="Write JSON to stdout instead of a table."
    )(func)


# --- the registry --------------------------------------------------------------------------


def import_modules(state: State) -> list[tuple[str, BaseException]]:
    """Import the ``-m`` modules once, in order; return the ones that failed, with the error."""
    if state.imported:
        return []
    state.imported = True
    if state.modules and "" not in sys.path and os.getcwd() not in sys.path:
        # The console script's sys.path lacks the current directory; `python -m` has it.
        sys.path.insert(0, os.getcwd())
    failures: list[tuple[str, BaseException]] = []
    for name in state.modules:
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as exc:
            failures.append((name, exc))
    return failures


def module_error(name: str, exc: BaseException) -> CliError:
    """The error shown when an ``-m`` module does not import."""
    first, _, rest = str(exc).partition("\n")
    message = f"importing module '{name}' failed: {type(exc).__name__}: {first}"
    if isinstance(exc, ModuleNotFoundError) and exc.name and name.startswith(exc.name):
        hint = "is it on PYTHONPATH, or in the current directory?"
    else:
        hint = _hint_for(exc) or "the error comes from the module's own code"
    error = CliError(message + ("\n" + rest if rest else ""), hint)
    error.__cause__ = exc
    return error


def open_registry(state: State) -> KernelRegistry:
    """The process-wide registry, after the ``-m`` imports, the configuration and plugins.

    A module that fails to import or an invalid configuration raise; plugin failures are
    warned about (and listed in full by ``kernreg check``).
    """
    failures = import_modules(state)
    if failures:
        raise module_error(*failures[0])
    registry = default_registry()
    registry.config  # noqa: B018 - read now, so an invalid value is reported before anything else
    apply_assumed_packages(state, registry)
    load_plugins(registry=registry)
    for message in [
        *unmatched_pins(registry),
        *denied_pins(registry),
        *unused_assumed_packages(registry),
        *unmatched_traits(registry),
    ]:
        echo_warning(message)
    if state.bad_op is not None:
        value, message, ctx, param = state.bad_op
        suggestion = did_you_mean(close_op_ids(value, registry.ops()))
        raise click.BadParameter(message + (f"; {suggestion}" if suggestion else ""), ctx, param)
    return registry


# --- output --------------------------------------------------------------------------------


def is_terminal() -> bool:
    """Whether stdout is a terminal (people get coloured tables, programs plain text)."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def color_enabled(err: bool = False) -> bool:
    """Whether to colour output to stdout (or stderr): on a terminal, unless ``NO_COLOR``
    is set to anything (https://no-color.org) or the terminal is a dumb one."""
    if os.environ.get("NO_COLOR") or not escapes_understood():
        return False
    return _stderr_is_terminal() if err else is_terminal()


def escapes_understood() -> bool:
    """Whether the terminal takes escape sequences (colours, erasing a line): not
    ``TERM=dumb`` (Emacs' shell, some CI logs)."""
    return os.environ.get("TERM") != "dumb"


def style(text: str, err: bool = False, **styles: Any) -> str:
    """``click.style(text, **styles)`` where colours are on (:func:`color_enabled`), else
    ``text`` unchanged."""
    return click.style(text, **styles) if color_enabled(err) else text


def echo_json(data: object) -> None:
    """JSON on one line for programs; indented on a terminal (json's C encoder only runs
    without indentation, and is ten times faster on a 10,000-spec listing)."""
    sys.stdout.write(json.dumps(data, indent=2 if is_terminal() else None) + "\n")


def echo_error(message: str, hint: str | None = None) -> None:
    """``error: message`` (and ``hint: hint``) on stderr, folded at spaces on a terminal."""
    _echo_marked("error: ", message, "red")
    if hint:
        click.echo(_fold_stderr(f"hint: {hint}"), err=True)


def echo_warning(message: str) -> None:
    """``warning: message`` on stderr, folded at spaces on a terminal."""
    _echo_marked("warning: ", message, "yellow")


def _echo_marked(lead: str, message: str, color: str) -> None:
    text = _fold_stderr(lead + message)[len(lead) :]
    click.echo(style(lead, err=True, fg=color, bold=True) + text, err=True)


def _fold_stderr(text: str) -> str:
    if not _stderr_is_terminal() or "\n" in text:
        return text
    return _fold(text, terminal_width(), "  ")


def _fold(text: str, width: int, indent: str) -> str:
    """``text`` folded at spaces into ``width`` columns, continuation lines indented by
    ``indent`` more than the first; a word longer than a line is left whole."""
    import textwrap

    lead = text[: len(text) - len(text.lstrip())]
    return "\n".join(
        textwrap.wrap(
            text,
            width,
            subsequent_indent=lead + indent,
            break_long_words=False,
            break_on_hyphens=False,
        )
        or [""]
    )


def fold(text: str, indent: str = "") -> str:
    """``text`` for stdout: folded at spaces to the terminal's width (continuation lines
    indented by ``indent`` more than the first); whole when there is no terminal."""
    if not (is_terminal() or os.environ.get("COLUMNS")) or "\n" in text:
        return text
    return _fold(text, terminal_width(), indent)


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


#: The width tables fit when no terminal says otherwise (output to a pipe or a file).
DEFAULT_WIDTH = 100
#: The narrowest a wrapped column (reasons, details) gets before other columns are cut.
MIN_WRAP_WIDTH = 24
#: Other columns are left out before a wrapped column gets narrower than this.
COMFORTABLE_WRAP_WIDTH = 40


def terminal_width() -> int:
    """The terminal's width (``COLUMNS`` first), or :data:`DEFAULT_WIDTH` without one."""
    return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns


def _cell_width(cell: str) -> int:
    return max(len(line) for line in cell.split("\n")) if "\n" in cell else len(cell)


def _column_widths(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[int]:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            width = _cell_width(cell)
            if width > widths[i]:
                widths[i] = width
    return widths


def table_width(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> int:
    """The width of a table: each column as wide as its widest cell, two spaces apart."""
    widths = _column_widths(headers, rows)
    return sum(widths) + 2 * (len(widths) - 1)


def fit_columns(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    width: int,
    droppable: Sequence[str] = (),
    shortenable: Sequence[str] = (),
    compact: Mapping[str, Callable[[str], str]] | None = None,
    wrap: Sequence[str] = (),
    keep: Sequence[str] = (),
    section: str | None = None,
) -> tuple[list[str], list[list[str]], list[str], list[str] | None, list[str] | None]:
    """Fit a table into ``width`` characters; return the headers, rows, dropped columns,
    the section headings (one per row; ``None`` unless the section column was moved out)
    and the details (one per row; ``None`` unless the last wrapped column was moved out).

    In order, while the table is too wide: write the ``compact`` columns' cells in their
    short form (``compact[header](cell)``); drop the ``droppable`` columns; move the
    ``section`` column (the op) out of the rows into headings (:func:`print_table` writes
    each above the rows that share it); drop the parenthesised ending of the
    ``shortenable`` columns' cells, longest first ("chosen (priority)" becomes "chosen");
    wrap the ``wrap`` columns (reasons, details) at spaces into the width left for them;
    move the last of them out of the rows, to be written below each row, when even
    wrapped it leaves no room; cut the widest column's long cells with ``...``, never
    one of ``keep`` (op ids, implementations, dtypes, statuses: the answer), nor a
    wrapped one.
    """
    kept_headers = list(headers)
    kept_rows = [list(r) for r in rows]
    for name, short in (compact or {}).items():
        if table_width(kept_headers, kept_rows) <= width or name not in kept_headers:
            continue
        column = kept_headers.index(name)
        for row in kept_rows:
            row[column] = short(row[column])
    dropped: list[str] = []

    def too_wide() -> bool:
        # A wrapped column counts at COMFORTABLE_WRAP_WIDTH at most: columns are dropped
        # only when the reasons would otherwise be squeezed below it.
        widths = _column_widths(kept_headers, kept_rows)
        for i, h in enumerate(kept_headers):
            if h in wrap:
                widths[i] = min(widths[i], max(COMFORTABLE_WRAP_WIDTH, len(h)))
        return sum(widths) + 2 * (len(widths) - 1) > width

    for name in droppable:
        if not too_wide():
            break
        if name not in kept_headers:
            continue
        column = kept_headers.index(name)
        del kept_headers[column]
        for row in kept_rows:
            del row[column]
        dropped.append(name)
    headings: list[str] | None = None
    if section in kept_headers and too_wide():
        column = kept_headers.index(section)
        del kept_headers[column]
        headings = [row.pop(column) for row in kept_rows]
        for row in kept_rows:  # indented under its heading
            row[0] = "  " + row[0]
        kept_headers[0] = "  " + kept_headers[0]
    for name in shortenable:
        if name not in kept_headers:
            continue
        column = kept_headers.index(name)
        while table_width(kept_headers, kept_rows) > width:
            longest = max((len(r[column]) for r in kept_rows if " (" in r[column]), default=0)
            if not longest:
                break
            for row in kept_rows:
                if len(row[column]) == longest and " (" in row[column]:
                    row[column] = row[column].partition(" (")[0]
    for name in wrap:
        excess = table_width(kept_headers, kept_rows) - width
        if excess <= 0 or name not in kept_headers:
            continue
        column = kept_headers.index(name)
        current = _column_widths(kept_headers, kept_rows)[column]
        target = max(current - excess, MIN_WRAP_WIDTH, len(name))
        if target < current:
            for row in kept_rows:
                row[column] = _wrap_words(row[column], target)
    details: list[str] | None = None
    moved = [h for h in kept_headers if h in wrap]
    if moved and table_width(kept_headers, kept_rows) > width:
        # Too narrow for the reasons beside the answer: each row's go on lines below it.
        column = kept_headers.index(moved[-1])
        del kept_headers[column]
        details = [" ".join(row.pop(column).split()) for row in kept_rows]
    # Headers compared without the indent that moving the section column out gave the first.
    cuttable = [
        i for i, h in enumerate(kept_headers) if h.strip() not in keep and h.strip() not in wrap
    ]
    excess = table_width(kept_headers, kept_rows) - width
    if excess > 0 and kept_rows and cuttable:
        widths = _column_widths(kept_headers, kept_rows)
        widest = max(cuttable, key=widths.__getitem__)
        limit = max(widths[widest] - excess, len(kept_headers[widest]), 8)
        for row in kept_rows:
            if len(row[widest]) > limit:
                row[widest] = row[widest][: limit - 3] + "..."
    return kept_headers, kept_rows, dropped, headings, details


def _wrap_words(text: str, width: int) -> str:
    """``text`` folded at spaces (and after ``;``) into lines of at most ``width``
    characters; a word longer than that is left whole rather than cut mid-identifier."""
    import textwrap

    return "\n".join(
        textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False) or [""]
    )


def print_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    title: str | None = None,
    styles: Sequence[str | None] | None = None,
    fit: bool = True,
    droppable: Sequence[str] = (),
    shortenable: Sequence[str] = (),
    compact: Mapping[str, Callable[[str], str]] | None = None,
    wrap: Sequence[str] | None = None,
    keep: Sequence[str] = ("OP", "IMPLEMENTATION", "DTYPE", "STATUS"),
    section: str | None = None,
    more: str = "--json shows all",
    width: int | None = None,
) -> list[str]:
    """A table with columns aligned by spaces, fitted to the terminal; return the columns
    left out.

    ``fit`` (default) fits the table into ``width`` (default: the terminal's, when stdout
    is one or ``COLUMNS`` is set; else the table is written whole, as for ``fit=False``)
    as :func:`fit_columns` does with ``droppable``,
    ``shortenable``, ``compact``, ``wrap`` (default: the descriptive columns such as
    REASONS and DETAIL), ``keep`` and ``section`` (a column, such as OP, that becomes a
    heading line above its rows when the table is too wide with it); a note after the
    table names the columns left out and what shows them (``more``). ``fit=False`` writes every column whole, however
    long the lines. On a terminal, ``styles`` (one per row: ``"bold green"``, ``"dim"``,
    ...) colour the rows and the header is bold.
    """
    dropped: list[str] = []
    headings: list[str] | None = None
    details: list[str] | None = None
    if width is None and (is_terminal() or os.environ.get("COLUMNS")):
        width = terminal_width()
    if fit and width is not None:
        wrapping = [h for h in headers if h in _WRAPPING_COLUMNS] if wrap is None else wrap
        headers, rows, dropped, headings, details = fit_columns(
            headers,
            rows,
            width,
            droppable,
            shortenable,
            compact,
            wrapping,
            keep,
            section,
        )
    widths = _column_widths(headers, rows)
    # One format string for every line: a tenth of the cost of padding cell by cell.
    template = "".join(f"{{:<{w + 2}}}" for w in widths[:-1]) + "{}"
    color = color_enabled()
    if title is not None and fit and width is not None:
        title = _wrap_title(title, width)
    out = [] if title is None else [title, ""]
    header = template.format(*headers).rstrip()
    out.append(click.style(header, bold=True) if color else header)
    for i, row in enumerate(rows):
        if headings is not None and (i == 0 or headings[i] != headings[i - 1]):
            out.append(click.style(headings[i], bold=True) if color else headings[i])
        if any("\n" in cell for cell in row):
            split = [cell.split("\n") for cell in row]
            height = max(len(lines) for lines in split)
            lines = [
                template.format(*(c[k] if k < len(c) else "" for c in split)).rstrip()
                for k in range(height)
            ]
        else:
            lines = [template.format(*row).rstrip()]
        if details is not None and details[i] not in ("", "-"):
            assert width is not None
            indent = " " * (len(row[0]) - len(row[0].lstrip()) + 4)
            lines.extend(_fold(indent + details[i], width, "").split("\n"))
        style = styles[i] if styles and color else None
        out.extend(_styled(line, style) for line in lines)
    sys.stdout.write("\n".join(out) + "\n")
    if dropped:
        names = ", ".join(dropped[:-1]) + " and " + dropped[-1] if len(dropped) > 1 else dropped[0]
        assert width is not None
        note = f"note: {names} left out to fit {width} columns; {more}"
        click.echo(_wrap_words(note, width))
    return dropped


def echo_wrapped(text: str, indent: str = "") -> None:
    """``text`` on stdout, folded as :func:`fold` does."""
    click.echo(fold(text, indent))


def _wrap_title(title: str, width: int) -> str:
    """Each line of ``title`` folded at spaces to ``width`` (continuations indented)."""
    import textwrap

    return "\n".join(
        "\n".join(
            textwrap.wrap(
                line,
                width,
                subsequent_indent="  ",
                break_long_words=False,
                break_on_hyphens=False,
            )
            or [""]
        )
        for line in title.split("\n")
    )


_WRAPPING_COLUMNS = frozenset({"REASONS", "DETAIL", "VALUE", "MESSAGE"})


def _styled(line: str, style: str | None) -> str:
    """``line`` in a rich-style colour (``"bold green"``, ``"dim"``, ``"red"``)."""
    if not style:
        return line
    words = style.split()
    colors = [w for w in words if w not in ("bold", "dim")]
    return click.style(
        line, fg=colors[0] if colors else None, bold="bold" in words, dim="dim" in words
    )


def _short_path(file: str) -> str:
    return _relative_to(file, os.getcwd())


@functools.cache
def _relative_to(file: str, cwd: str) -> str:
    # Keyed on the directory too: a process that changes directory (run() called twice
    # from a program, a test) must not see paths relative to the previous one.
    prefix = os.path.join(cwd, "")
    if os.path.dirname(cwd) == cwd:  # the root: a relative path would only drop the "/"
        return file
    return file[len(prefix) :] if file.startswith(prefix) else file


def origin_location(origin: Origin) -> str:
    """``file:line``, the file relative to the current directory, or else to the import
    path entry that holds it (``kernreg_ops/_plugin.py:152``, not a site-packages path)."""
    short = _short_path(origin.file)
    if short == origin.file:
        short = _import_path(origin.file)
    return f"{short}:{origin.line}"


def format_origin(origin: Origin | None) -> str:
    """:func:`origin_location` and ``[distribution version]``."""
    if origin is None:
        return "-"
    text = origin_location(origin)
    if origin.distribution:
        version = f" {origin.version}" if origin.version else ""
        text += f" [{origin.distribution}{version}]"
    return text


def short_origin(origin: Origin | None) -> str:
    """Where a spec was registered, short enough for a table column.

    ``distribution:file.py:line`` for a plugin's spec, else the path relative to the current
    directory, or to the import path entry that holds it (the module's own path).
    """
    if origin is None:
        return "-"
    if origin.distribution:
        return f"{origin.distribution}:{os.path.basename(origin.file)}:{origin.line}"
    return f"{_module_path(origin.file, os.getcwd())}:{origin.line}"


@functools.cache
def _module_path(file: str, cwd: str) -> str:
    short = _relative_to(file, cwd)
    if short != file:
        return short
    short = _import_path(file)
    return os.path.basename(file) if short == file else short


@functools.cache
def _import_path(file: str) -> str:
    """``file`` relative to the import path entry that holds it; unchanged without one."""
    roots = [p for p in sys.path if p and os.path.isabs(p) and file.startswith(os.path.join(p, ""))]
    if roots:
        return file[len(os.path.join(max(roots, key=len), "")) :]
    return file


def decision_outcome(decision: Decision) -> str:
    """One line: what the decision chose, or why it chose nothing."""
    if decision.chosen is not None and not decision.strict_error:
        return f"{decision.chosen.label} (rule: {decision.rule})"
    if decision.rule == "ambiguous":
        labels = ", ".join(c.spec.label for c in decision.tied)
        return f"ambiguous: {labels} tie at priority {decision.tied[0].spec.priority}"
    if decision.strict_error and decision.chosen is not None:
        return f"strict mode forbids the fallback to the reference '{decision.chosen.label}'"
    notes = "; ".join(decision.notes)
    return "nothing eligible" + (f" ({notes})" if notes else "")


def describe_platform(platform: Platform) -> str:
    """``cuda:9.0 [--platform]``: the platform and where its description came from (and
    every device of a host with several: ``; devices 0 cuda:8.0, 1 cuda:9.0``)."""
    text = f"{platform} [{platform.source}]" if platform.source else str(platform)
    if len(platform.devices) > 1:
        text += "; devices " + ", ".join(f"{d.index} {d}" for d in platform.devices)
    return text


# --- plugin conflicts ------------------------------------------------------------------------


def _distribution(spec: KernelSpec) -> str | None:
    origin = spec.origin
    return None if origin is None else origin.distribution


def conflict_resolution(
    exc: BaseException | None, failing: str | None, denied: Sequence[str] = ()
) -> tuple[str, str] | None:
    """For a plugin that failed on a conflicting registration: a line naming both sides,
    and the exact ``KERNREG_PLUGINS_DENY`` value that resolves it (``denied`` kept).

    ``failing`` is the distribution whose plugin failed; ``None`` when ``exc`` is no conflict.
    """
    from kernreg.torch._inputs import InputGeneratorConflictError  # torch-free

    kinds = (KernelConflictError, DuplicateReferenceError, InputGeneratorConflictError)
    while exc is not None and not isinstance(exc, kinds):
        exc = exc.__cause__
    if exc is None:
        return None
    report = default_registry().plugin_report
    if report is not None and report.disabled is None:
        # A name that ships no plugin (a typo) denies nothing: not copied into the fix.
        installed = {normalize_distribution(d) for d in report.distributions}
        denied = [d for d in denied if normalize_distribution(d) in installed]
    if isinstance(exc, InputGeneratorConflictError):
        return _generator_conflict(exc, failing, denied)
    old, spec = exc.old, exc.new
    first = _distribution(old)
    second = _distribution(spec) or failing
    if second is None:
        return None

    def named(dist: str | None) -> str:
        return f"distribution {dist}" if dist else f"{format_origin(old.origin)}"

    if isinstance(exc, DuplicateReferenceError):
        what = f"op '{spec.op}': a second reference ('{spec.label}')"
        line = f"{what} from {named(second)}; {named(first)} registered '{old.label}' first"
    else:
        line = (
            f"op '{spec.op}', backend '{spec.label}': {named(second)} conflicts with "
            f"{named(first)}, which registered it first"
        )
    return line, _deny_fix(first, second, denied, "implementation")


def _deny_fix(first: str | None, second: str, denied: Sequence[str], what: str) -> str:
    """``KERNREG_PLUGINS_DENY=second keeps first's what (KERNREG_PLUGINS_DENY=first keeps
    second's)``, ``denied`` kept in both values."""
    fix = f"KERNREG_PLUGINS_DENY={','.join(dict.fromkeys([*denied, second]))}"
    if first:
        fix += f" keeps {first}'s {what}"
        other = ",".join(dict.fromkeys([*denied, first]))
        fix += f" (KERNREG_PLUGINS_DENY={other} keeps {second}'s)"
    return fix


def _generator_conflict(
    exc: Any, failing: str | None, denied: Sequence[str]
) -> tuple[str, str] | None:
    """The line and fix of an input-generator conflict between two distributions."""
    from kernreg.spec import target_name

    first, second = exc.old_distribution, exc.new_distribution or failing
    if second is None:
        return None
    old_name = target_name(exc.old.generator)
    new_name = target_name(exc.new.generator)
    owner = f"distribution {first}" if first else "the host program"
    line = (
        f"op '{exc.new.op}': input generator '{new_name}' from distribution {second} "
        f"conflicts with '{old_name}' from {owner}, which declared it first"
    )
    return line, _deny_fix(first, second, denied, "generator")


def _denied_plugins() -> tuple[str, ...]:
    try:
        return default_registry().config.plugins_deny
    except KernregError:
        return ()


# --- errors --------------------------------------------------------------------------------

_HINTS: tuple[tuple[type[BaseException], str], ...] = (
    (ConfigError, "fix or unset that setting; `kernreg check` lists every configuration problem"),
    (OpNotFoundError, "`kernreg list` shows the ops; `-m MODULE` imports an engine's kernels"),
    (BackendNotFoundError, "`kernreg list OP` shows the op's implementations"),
    (KernelConflictError, "`kernreg check` lists every conflict with both origins"),
    (DuplicateReferenceError, "register the other implementation with reference=False"),
    (AmbiguousKernelError, "give them different priorities, or pin one with KERNREG_PIN"),
    (NoEligibleKernelError, "`kernreg explain OP` shows why each implementation was rejected"),
    (KernelLoadError, "`kernreg check --import-targets` checks every target"),
    (PluginLoadError, "fix the plugin, or exclude it with KERNREG_PLUGINS_DENY"),
    (RegistryFrozenError, "register kernels before registry.freeze()"),
    (InvalidSpecError, "fix the value as the message says"),
    (PlanError, "regenerate the plan with `kernreg lock`"),
)


def _hint_for(exc: BaseException) -> str | None:
    for kind, hint in _HINTS:
        if isinstance(exc, kind):
            return hint
    return None


def report_error(exc: BaseException, debug: bool) -> tuple[int, str, str | None]:
    """Show ``exc`` as one line (its first line) plus a hint; return the exit status, the
    line and the hint."""
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    if isinstance(exc, CliError):
        first, _, rest = exc.message.partition("\n")
        echo_error(first, None)
        hint, code = exc.hint, exc.exit_code
    else:
        first, _, rest = str(exc).partition("\n")
        if not isinstance(exc, KernregError):
            first = f"{type(exc).__name__}: {first}"
        echo_error(first)
        if isinstance(exc, KernregError):
            hint = _hint_for(exc)
        else:
            hint = "this is unexpected: please report it with the traceback"
        code = 1
    if rest and isinstance(exc, (KernelConflictError, DuplicateReferenceError, CliError)):
        # Conflicts go on to name both origins: worth the extra lines.
        for extra in rest.splitlines():
            if extra.strip().startswith(("registered", "To override")):
                click.echo("  " + extra.strip(), err=True)
    if isinstance(exc, PluginLoadError):
        resolution = conflict_resolution(exc, exc.distribution, _denied_plugins())
        if resolution is not None:
            click.echo(_fold_stderr(f"  {resolution[0]}"), err=True)
            hint = resolution[1]
    if hint and not debug and _may_hide_a_traceback(exc):
        # kernreg's own errors say all there is to say; a traceback helps with the others.
        hint += " (--debug shows the traceback)"
    if hint:
        click.echo(_fold_stderr(f"hint: {hint}"), err=True)
    return code, first, hint


def _echo_json_error(message: str, hint: str | None, code: int) -> None:
    """Under ``--json``, a failed command still writes one JSON object to stdout (the
    human-readable lines stay on stderr), so a reader that parses stdout sees the error;
    where stdout cannot be written (the error itself, perhaps), stderr says it all."""
    with contextlib.suppress(OSError):
        click.echo(json.dumps({"error": message, "hint": hint, "exit_code": code}))


def _may_hide_a_traceback(exc: BaseException) -> bool:
    """Whether ``--debug`` would add something: not for kernreg's own errors and CLI errors,
    which say all there is to say, unless they stand for another error (a module's)."""
    if isinstance(exc, KernregError):
        return False
    return not isinstance(exc, CliError) or exc.__cause__ is not None


# --- the group -----------------------------------------------------------------------------

_HELP = """The inventory of ML operator kernels, and which implementation runs.

Exit status: 0 success; 1 an error (or, for `check`, a problem; for `explain`,
an ambiguous or empty decision); 2 a usage error (unknown option, invalid
--platform or --dtype value).

Configuration comes from KERNREG_* environment variables (KERNREG_PLATFORM
simulates another machine); an invalid value is an error (exit 1).
"""


@click.group(
    name="kernreg",
    help=_HELP,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(kernreg.__version__, "-V", "--version", prog_name="kernreg")
@common_options
@assume_package_option
def cli() -> None:
    pass


def _echo_conflict(message: str) -> None:
    """After a plugin warning: both sides of the conflict it reports, and the fix, if any."""
    report = default_registry().plugin_report
    if report is None:
        return
    for failure in report.failed:
        if str(failure) in message:
            resolution = conflict_resolution(
                failure.exception, failure.plugin.distribution, _denied_plugins()
            )
            if resolution is not None:
                click.echo(_fold_stderr(f"  {resolution[0]}"), err=True)
                click.echo(_fold_stderr(f"hint: {resolution[1]}"), err=True)
            return


def _add_commands(group: click.Group) -> None:
    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        for command in module.COMMANDS:
            group.add_command(command)


_commands_added = False


def build_cli() -> click.Group:
    """The ``kernreg`` group with the commands of every module in :data:`COMMAND_MODULES`."""
    global _commands_added
    if not _commands_added:
        _add_commands(cli)
        _commands_added = True
    return cli


def run(argv: Sequence[str]) -> int:
    """Run the command line with ``argv``; return the exit status instead of exiting."""
    state = State()
    group = build_cli()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PluginWarning)
        warnings.simplefilter("always", ConfigWarning)
        try:
            result = group.main(args=list(argv), obj=state, standalone_mode=False)
            code = result if isinstance(result, int) else 0
        except click.ClickException as exc:
            exc.show()
            code = exc.exit_code
            if "--json" in argv:
                _echo_json_error(exc.format_message(), None, code)
        except click.exceptions.Abort:
            click.echo("Aborted!", err=True)
            code = 130
        except BrokenPipeError:
            # The reader went away (`kernreg list | head`): nothing more to say.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            code = 1
        except Exception as exc:
            code, message, hint = report_error(exc, state.debug)
            if "--json" in argv:
                _echo_json_error(message, hint, code)
    for warning in caught:
        if state.reported_warnings and issubclass(warning.category, state.reported_warnings):
            continue
        if issubclass(warning.category, PluginWarning):
            first = str(warning.message).partition("\n")[0]
            echo_warning(f"{first} (`kernreg check` lists every plugin problem)")
            _echo_conflict(str(warning.message))
        elif issubclass(warning.category, ConfigWarning):
            echo_warning(str(warning.message))
        else:
            echo_warning(
                f"{warning.category.__name__}: {warning.message} "
                f"({warning.filename}:{warning.lineno})"
            )
    return code

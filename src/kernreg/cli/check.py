"""``kernreg check``: the linter for CI. Everything that would go wrong later, found now.

Each finding is a :class:`Problem` with a severity from :data:`KINDS`. Target imports
run in a child interpreter, so an import that crashes or hangs is reported against its
target instead of ending the check.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, Literal

import click

from kernreg._packages import missing_reason
from kernreg.cli._app import (
    State,
    apply_assumed_packages,
    assume_package_option,
    assumed_packages_text,
    common_options,
    conflict_resolution,
    decision_outcome,
    denied_pins,
    echo_json,
    fold,
    format_origin,
    import_modules,
    json_option,
    origin_location,
    platform_option,
    style,
    unmatched_pins,
    unmatched_traits,
    unused_assumed_packages,
)
from kernreg.config import (
    Config,
    ConfigWarning,
    load_config,
    normalize_distribution,
    unknown_variable_hint,
)
from kernreg.errors import ConfigError, KernregError, WhenPredicateError
from kernreg.platform import Platform
from kernreg.plugins import PluginReport, PluginWarning, discover, load_plugins
from kernreg.registry import KernelRegistry, default_registry, find_ambiguities
from kernreg.selection import process_state_predicate
from kernreg.spec import KernelSpec, target_name

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = ["COMMANDS", "KINDS", "Problem", "import_targets"]

Severity = Literal["error", "warning"]

#: Every kind of problem, its severity and what it means: the one table behind the
#: check, its ``--help`` and its exit status.
KINDS: dict[str, tuple[Severity, str]] = {
    "config": ("error", "an invalid KERNREG_* value or KERNREG_CONFIG file"),
    "unknown_variable": ("error", "a KERNREG_* variable kernreg does not know (a typo?)"),
    "module": ("error", "a -m module failed to import"),
    "plugin": ("error", "a plugin failed to load"),
    "plugin_conflict": (
        "error",
        "a plugin registers a kernel that conflicts with another registration, "
        "or two distributions share an entry-point name",
    ),
    "ambiguity": ("error", "two implementations share a priority and can both be eligible"),
    "when_error": (
        "error",
        "a process-state when predicate (one taking no arguments) raises instead of "
        "returning true or false, so no decision of its op can be made",
    ),
    "missing_reference": ("error", "an op has no reference implementation"),
    "unimportable": (
        "error",
        "--import-targets: a target or when predicate does not import, is not callable, "
        "crashes the interpreter or hangs (implementations whose declared packages are "
        "not installed are skipped)",
    ),
    "platform_ambiguous": ("error", "--platform: the decision is ambiguous on that platform"),
    "platform_nothing_eligible": (
        "error",
        "--platform: nothing is eligible on that platform, whatever the dtype",
    ),
    "platform_partial": (
        "warning",
        "--platform: nothing is eligible on that platform for some of the op's dtypes",
    ),
    "same_object": (
        "warning",
        "--import-targets: two target names resolve to the same object "
        "(a re-export; the commonest cause of conflicts)",
    ),
    "no_inputs": (
        "warning",
        "a plugin's op has no input generator, so parity checks none of its implementations",
    ),
    "override": ("warning", "a registration was replaced or removed on purpose"),
    "demoted": (
        "warning",
        "an implementation raised under the demotion policy (KERNREG_DEMOTE) and is demoted "
        "in the tuning store: its calls fall back (kernreg tune --clear-demotions clears it)",
    ),
    "pin_unmatched": (
        "warning",
        "a configured pin, deny rule or debugging switch (KERNREG_PIN, KERNREG_DENY, "
        "KERNREG_BACKEND, KERNREG_CONFIG) matches no registered op, or no implementation of "
        "the ops it matches",
    ),
    "pin_denied": (
        "warning",
        "a configured pin can choose an implementation that a deny rule names: the pin "
        "wins (pins come before deny rules), so the denied implementation runs",
    ),
    "assumed_unused": (
        "warning",
        "an assumed package (--assume-package, KERNREG_ASSUME_PACKAGES) is required by no "
        "registered implementation, so it changes no decision (a misspelt name?)",
    ),
    "traits_unmatched": (
        "warning",
        "a required trait (KERNREG_TRAITS) is declared by no registered implementation, so no "
        "op has an eligible one (a misspelt name?)",
    ),
    "plan_miss": (
        "warning",
        "a decision of the selection plan (KERNREG_LOCK) names an implementation this process "
        "cannot run (another package version, a deny rule, not registered): that op is decided "
        "afresh, or in strict mode runs nothing (PlanWarning)",
    ),
    "plan_unmatched": (
        "warning",
        "the selection plan (KERNREG_LOCK) decides nothing this process decides: "
        "it is for another platform or another inventory (PlanWarning)",
    ),
}


class Problem:
    """One finding: its kind (and severity), the op and implementations, a message, origins."""

    __slots__ = ("backends", "kind", "message", "op", "origins", "severity")

    def __init__(
        self,
        kind: str,
        message: str,
        *,
        op: str | None = None,
        backends: Sequence[str] = (),
        origins: Sequence[str] = (),
    ) -> None:
        self.kind = kind
        self.severity: Severity = KINDS[kind][0]
        self.message = message
        self.op = op
        self.backends = list(backends)
        self.origins = list(origins)

    def describe(self) -> dict[str, object]:
        return {
            "severity": self.severity,
            "kind": self.kind,
            "op": self.op,
            "backends": self.backends,
            "message": self.message,
            "origins": self.origins,
        }


# --- configuration and plugins -------------------------------------------------------------


def config_without_errors(environ: Mapping[str, str]) -> tuple[Config, list[ConfigError]]:
    """Every configuration error, and the configuration read without the offending settings."""
    env = dict(environ)
    errors: list[ConfigError] = []
    while True:
        try:
            return load_config(env), errors
        except ConfigError as exc:
            errors.append(exc)
            # A TOML key's error names the file; drop the file then.
            culprit = exc.key if exc.key in env else "KERNREG_CONFIG"
            if culprit not in env:
                return Config(), errors
            del env[culprit]


def _check_config(registry: KernelRegistry) -> list[Problem]:
    try:
        config = registry.config
        errors: list[ConfigError] = []
    except ConfigError:
        config, errors = config_without_errors(os.environ)
        registry.configure(config)
    problems = [Problem("config", str(exc), origins=[exc.key]) for exc in errors]
    problems.extend(
        Problem("unknown_variable", unknown_variable_hint(var), origins=[var])
        for var in config.unknown
    )
    return problems


_CONFLICT_RE = re.compile(r"op '([^']+)', backend '([^']+)'")
_REGISTERED_RE = re.compile(r"registered (?:first|again) at: (.*)")


def _check_plugins(report: PluginReport, denied: Sequence[str] = ()) -> list[Problem]:
    # Two distributions disputing a registration: neither side's spec was kept.
    problems = [
        Problem(
            "plugin_conflict",
            dispute.message(denied),
            op=dispute.op,
            backends=list(dict.fromkeys(spec.label for spec in dispute.specs)),
            origins=[
                f"entry point '{info.name}' = {info.value} "
                f"(distribution {info.distribution} {info.version})"
                + ("" if spec.origin is None else f": {origin_location(spec.origin)}")
                for info, spec in zip(dispute.plugins, dispute.specs, strict=True)
            ],
        )
        for dispute in report.conflicts
    ]
    for failure in report.failed:
        first = failure.error.partition("\n")[0]
        resolution = conflict_resolution(failure.exception, failure.plugin.distribution, denied)
        if resolution is not None:
            first += f"; to resolve: {resolution[1]}"
        conflict = failure.error.startswith(
            ("KernelConflictError", "DuplicateReferenceError", "Multiple distributions")
        )
        match = _CONFLICT_RE.search(first)
        info = failure.plugin
        origins = [
            f"entry point '{info.name}' = {info.value} (distribution {info.distribution} {info.version})"
        ]
        origins.extend(m[1].strip() for m in _REGISTERED_RE.finditer(failure.error))
        problems.append(
            Problem(
                "plugin_conflict" if conflict else "plugin",
                f"{info}: {first}",
                op=match[1] if match else None,
                backends=[match[2]] if match else [],
                origins=origins,
            )
        )
    return problems


def _plugins_without_hangs(
    config: Config, timeout: float
) -> tuple[list[EntryPoint] | None, list[Problem]]:
    """Import each allowed plugin's module in a child interpreter first: the entry points
    safe to load here (``None``: all of them), and a problem for each that hangs or
    crashes the interpreter on import, which is then not loaded at all."""
    import importlib.metadata

    from kernreg.plugins import ENTRY_POINT_GROUP

    eps = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    infos = {id(ep): discover([ep])[0] for ep in eps}
    probed = sorted(
        {info for info in infos.values() if config.plugin_allowed(info.distribution) is None},
        key=lambda info: (info.distribution, info.name),
    )
    if not probed:
        return None, []
    # The value without extras ("mod:func [extra]"): a module, or module:attr.
    results = import_targets([info.value.partition("[")[0].strip() for info in probed], timeout)
    stopped = {
        info: result
        for info in probed
        if (result := results[info.value.partition("[")[0].strip()]).stopped
    }
    if not stopped:
        return None, []
    problems = [
        Problem(
            "plugin",
            f"{info}: {result.error}; not loaded",
            origins=[
                f"entry point '{info.name}' = {info.value} "
                f"(distribution {info.distribution} {info.version})"
            ],
        )
        for info, result in stopped.items()
    ]
    return [ep for ep in eps if infos[id(ep)] not in stopped], problems


# --- the inventory -------------------------------------------------------------------------


def _origins(specs: Sequence[KernelSpec]) -> list[str]:
    # One line per distinct place: a plugin registering several implementations from
    # one helper would otherwise repeat the same origin once per implementation.
    return list(dict.fromkeys(format_origin(s.origin) for s in specs))


def _check_ambiguities(registry: KernelRegistry) -> list[Problem]:
    return [
        Problem(
            "ambiguity",
            f"op '{a.op}': '{a.first.label}' and '{a.second.label}' share priority "
            f"{a.first.priority} and can both be eligible ({a.reason})",
            op=a.op,
            backends=[a.first.label, a.second.label],
            origins=_origins([a.first, a.second]),
        )
        for a in find_ambiguities(registry)
    ]


def _check_references(specs_by_op: Mapping[str, Sequence[KernelSpec]]) -> list[Problem]:
    return [
        Problem(
            "missing_reference",
            f"op '{op}' has no reference implementation (reference=True): nothing to fall "
            "back to, and no oracle for parity tests",
            op=op,
            backends=[s.label for s in specs],
            origins=_origins(specs),
        )
        for op, specs in specs_by_op.items()
        if not any(s.reference for s in specs)
    ]


def _check_input_generators(specs_by_op: Mapping[str, Sequence[KernelSpec]]) -> list[Problem]:
    """Plugin ops with a reference and another implementation but no input generator:
    `kernreg parity` cannot check them, nor `kernreg bench` time them."""
    from kernreg.torch._inputs import input_spec  # torch-free

    problems = []
    for op, specs in specs_by_op.items():
        reference = next((s for s in specs if s.reference), None)
        if reference is None or reference.origin is None or not reference.origin.distribution:
            continue  # no reference: missing_reference says so; the host's ops: its own tests
        if len(specs) < 2 or input_spec(op) is not None:
            continue
        problems.append(
            Problem(
                "no_inputs",
                f"op '{op}' (distribution {reference.origin.distribution}) has no input "
                "generator, so `kernreg parity` checks none of its implementations against "
                "the reference: declare one with kernreg.torch.register_inputs "
                "(docs/plugins.md)",
                op=op,
                backends=[s.label for s in specs],
                origins=_origins([reference]),
            )
        )
    return problems


def _check_overrides(registry: KernelRegistry) -> list[Problem]:
    return [
        Problem(
            "override",
            str(o),
            op=o.old.op,
            backends=[o.old.label],
            origins=[format_origin(o.old.origin), format_origin(o.origin)],
        )
        for o in registry.overrides()
    ]


def _check_plan(registry: KernelRegistry, platforms: Sequence[Platform] = ()) -> list[Problem]:
    """The loaded selection plan, if any, must decide something on the platforms checked
    (``--platform``, else this one), and each of its choices there must be one that runs."""
    import warnings

    from kernreg.plan import PlanWarning, plan_mismatch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)  # reported below, as a finding
        plan = registry.plan
    if plan is None:
        return []
    ops = registry.ops()
    reasons = [plan_mismatch(plan, p, ops) for p in (platforms or (registry.platform,))]
    if all(why is not None for why in reasons):
        return [Problem("plan_unmatched", str(reasons[0]), origins=[plan.source])]
    # Each planned choice this process cannot follow (a package version, a deny rule).
    devices = {str(d): d for p in (platforms or (registry.platform,)) for d in _devices(p)}
    problems = []
    for entry in plan.entries():
        platform = devices.get(entry.platform)
        if platform is None or not entry.backend or entry.op not in ops:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PlanWarning)  # reported here, as a finding
            decision = registry.explain(
                entry.op, platform=platform, dtypes=entry.dtypes, bucket=entry.bucket
            )
        if decision.plan_miss is not None:
            where = entry.platform + (f", {', '.join(entry.dtypes)}" if entry.dtypes else "")
            message = f"op '{entry.op}' on {where}: {decision.plan_miss}"
            problems.append(
                Problem(
                    "plan_miss", message, op=entry.op, backends=[entry.label], origins=[plan.source]
                )
            )
    return problems


def _check_process_state(specs_by_op: Mapping[str, Sequence[KernelSpec]]) -> list[Problem]:
    """Call each process-state ``when`` predicate once, as a decision would."""
    problems = []
    for op, specs in specs_by_op.items():
        for spec in specs:
            predicate = process_state_predicate(spec) if spec.when is not None else None
            if predicate is None:
                continue
            try:
                predicate()
            except Exception as exc:
                error = WhenPredicateError(spec, target_name(spec.when or ""), exc)
                problems.append(
                    Problem(
                        "when_error",
                        str(error),
                        op=op,
                        backends=[spec.label],
                        origins=[format_origin(spec.origin)],
                    )
                )
    return problems


def _devices(platform: Platform) -> list[Platform]:
    """``platform`` and each device of it that decides differently (another architecture)."""
    found = {str(platform): platform}
    for device in platform.devices:
        found.setdefault(str(device), device)
    return list(found.values())


def _where(platform: Platform) -> str:
    """``cuda:7.5 (device 1)`` for a device of a mixed host, else the platform."""
    return str(platform) if platform.index is None else f"{platform} (device {platform.index})"


def _check_platform(
    registry: KernelRegistry, platform: Platform, specs_by_op: Mapping[str, Sequence[KernelSpec]]
) -> list[Problem]:
    """Decide every op on ``platform``, once per dtype the op's specs name (or once, untyped)."""
    problems = []
    for op, specs in specs_by_op.items():
        named = sorted({d for s in specs for d in s.dtypes})
        scenarios: list[tuple[str, ...] | None] = [(d,) for d in named] if named else [None]
        ambiguous: list[str] = []
        failed: list[tuple[str, str]] = []
        for dtypes in scenarios:
            where = "any dtype" if dtypes is None else dtypes[0]
            try:
                decision = registry.explain(op, platform=platform, dtypes=dtypes)
            except KernregError as exc:
                failed.append((where, str(exc).partition("\n")[0]))
                continue
            if decision.ok:
                continue
            if decision.rule == "ambiguous":
                ambiguous.append(f"{where}: {decision_outcome(decision)}")
            else:
                failed.append((where, decision_outcome(decision)))
        labels = [s.label for s in specs]
        if ambiguous:
            problems.append(
                Problem(
                    "platform_ambiguous",
                    f"op '{op}' on {_where(platform)}: " + "; ".join(ambiguous),
                    op=op,
                    backends=labels,
                    origins=_origins(specs),
                )
            )
        if failed:
            every = len(failed) == len(scenarios)
            detail = "; ".join(f"{where}: {why}" for where, why in failed)
            problems.append(
                Problem(
                    "platform_nothing_eligible" if every else "platform_partial",
                    f"op '{op}' on {_where(platform)}: {detail}",
                    op=op,
                    backends=labels,
                    origins=_origins(specs),
                )
            )
    return problems


# --- importing targets ---------------------------------------------------------------------

# Runs in a child interpreter: reads {"path": sys.path, "targets": [[index, target], ...]}
# on stdin and reports each import on a private copy of stdout, so whatever the imported
# modules print (to stdout or stderr) cannot corrupt the protocol.
_WORKER = r"""
import importlib, json, os, sys
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
request = json.load(sys.stdin)
sys.path[:] = request["path"]
keep = []
def send(message):
    out.write(json.dumps(message) + "\n")
    out.flush()
for index, target in request["targets"]:
    send({"start": index})
    try:
        module_name, _, attr_path = target.partition(":")
        obj = importlib.import_module(module_name)
        for attr in filter(None, attr_path.split(".")):  # none: a module (plugin) entry point
            obj = getattr(obj, attr)
    except BaseException as exc:
        first = str(exc).partition("\n")[0]
        send({"done": index, "error": type(exc).__name__ + ": " + first})
    else:
        if not callable(obj):
            send({"done": index, "not_callable": type(obj).__name__})
            continue
        keep.append(obj)  # alive to the end, so no two objects share an id
        name = "%s:%s" % (
            getattr(obj, "__module__", None) or "?",
            getattr(obj, "__qualname__", None) or type(obj).__name__,
        )
        send({"done": index, "id": id(obj), "name": name})
"""

#: Seconds the child interpreter may take to start, on top of the first import's timeout.
_STARTUP_GRACE = 10.0


class ImportResult:
    """How importing one target went: ``error`` is ``None`` on success.

    ``identity`` tells objects apart within one child interpreter: ``(run, id(obj))``.
    ``stopped`` says the import hung or crashed the interpreter: importing it in this
    process would do the same.
    """

    __slots__ = ("error", "identity", "name", "stopped")

    def __init__(
        self,
        error: str | None,
        identity: tuple[int, int] | None = None,
        name: str = "",
        *,
        stopped: bool = False,
    ) -> None:
        self.error = error
        self.identity = identity
        self.name = name
        self.stopped = stopped


def _stderr_tail(handle: IO[bytes]) -> str:
    handle.seek(0)
    text = handle.read()[-4000:].decode("utf-8", "replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _run_worker(
    batch: Sequence[tuple[int, str]], timeout: float, run: int
) -> dict[int, ImportResult]:
    """Import ``batch`` in one child, in order; stop at the first crash or hang."""
    results: dict[int, ImportResult] = {}
    request = json.dumps({"path": sys.path, "targets": list(batch)}).encode()
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
        )
        assert proc.stdin is not None
        assert proc.stdout is not None
        stdout = proc.stdout
        lines: queue.Queue[bytes | None] = queue.Queue()

        def pump() -> None:
            for raw in stdout:
                lines.put(raw)
            lines.put(None)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        with contextlib.suppress(OSError):  # the child died at start-up: reported below
            proc.stdin.write(request)
        with contextlib.suppress(OSError):
            proc.stdin.close()
        current: int | None = None
        started = False
        deadline = time.monotonic() + timeout + _STARTUP_GRACE
        while True:
            try:
                raw = lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                if current is not None and current not in results:
                    results[current] = ImportResult(
                        f"did not finish importing within {timeout:g} s (stopped)", stopped=True
                    )
                break
            if raw is None:
                code = proc.wait()
                if current is not None and current not in results:
                    tail = _stderr_tail(errors)
                    results[current] = ImportResult(
                        f"crashed the interpreter while importing ({_exit_text(code)})"
                        + (f": {tail}" if tail else ""),
                        stopped=True,
                    )
                elif not started and code != 0:
                    tail = _stderr_tail(errors)
                    for index, _ in batch:
                        results[index] = ImportResult(
                            f"could not be checked: the import checker failed to start "
                            f"({_exit_text(code)}){': ' + tail if tail else ''}"
                        )
                break
            try:
                message = json.loads(raw)
            except ValueError:
                continue
            if "start" in message:
                current = message["start"]
                started = True
                deadline = time.monotonic() + timeout
            elif "not_callable" in message:
                results[message["done"]] = ImportResult(
                    f"imports, but is not callable (a {message['not_callable']} object)"
                )
            elif "error" in message:
                results[message["done"]] = ImportResult("does not import: " + message["error"])
            else:
                results[message["done"]] = ImportResult(None, (run, message["id"]), message["name"])
            if len(results) == len(batch):
                # Every target has its answer: what the child does next (a non-daemon thread
                # an import started can keep it from exiting) is no target's problem.
                break
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        reader.join(timeout=1.0)
        stdout.close()
    return results


def import_targets(targets: Sequence[str], timeout: float) -> dict[str, ImportResult]:
    """Import each ``module:attr`` target in a child interpreter, ``timeout`` seconds each.

    One child imports the whole batch; when an import crashes it or hangs, that target
    is reported and a fresh child goes on with the targets after it.
    """
    pending = list(enumerate(targets))
    results: dict[int, ImportResult] = {}
    run = 0
    while pending:
        run += 1
        done = _run_worker(pending, timeout, run)
        results.update(done)
        if not done:  # the child never reached an import: give up rather than loop
            for index, _ in pending:
                results[index] = ImportResult(
                    "could not be checked: the import checker stopped before importing anything"
                )
        pending = [(i, t) for i, t in pending if i not in results]
    return {targets[i]: result for i, result in results.items()}


def _check_targets(
    specs_by_op: Mapping[str, Sequence[KernelSpec]], timeout: float
) -> tuple[list[Problem], int, int]:
    """Problems, how many targets were imported, and how many specs were skipped because
    a package they declare is not installed (their targets are not expected to import)."""
    uses: dict[str, list[tuple[KernelSpec, str]]] = {}
    skipped = 0
    for specs in specs_by_op.values():
        for spec in specs:
            if any(missing_reason(p) for p in spec.packages):
                skipped += 1
                continue
            if isinstance(spec.target, str):
                uses.setdefault(spec.target, []).append((spec, "target"))
            if isinstance(spec.when, str):
                uses.setdefault(spec.when, []).append((spec, "when predicate"))
    results = import_targets(sorted(uses), timeout) if uses else {}
    problems = []
    by_identity: dict[tuple[int, int], list[str]] = {}
    for target in sorted(results):
        result = results[target]
        if result.error is None:
            assert result.identity is not None
            by_identity.setdefault(result.identity, []).append(target)
            continue
        for spec, role in uses[target]:
            problems.append(
                Problem(
                    "unimportable",
                    f"{role} '{target}' of op '{spec.op}', backend '{spec.label}' {result.error}",
                    op=spec.op,
                    backends=[spec.label],
                    origins=_origins([spec]),
                )
            )
    for names in by_identity.values():
        if len(names) < 2:
            continue
        specs = [spec for name in names for spec, _ in uses[name]]
        ops = sorted({s.op for s in specs})
        problems.append(
            Problem(
                "same_object",
                f"{' and '.join(repr(n) for n in names)} are the same object "
                f"({results[names[0]].name}); name it one way everywhere, so that registering "
                "it twice compares equal instead of conflicting",
                op=ops[0] if len(ops) == 1 else None,
                backends=[s.label for s in specs],
                origins=_origins(specs),
            )
        )
    return problems, len(uses), skipped


# --- the command ---------------------------------------------------------------------------


_CHECK_HELP = """Lint the inventory, plugins and configuration for CI.

Exits 0 when there is no error (warnings allowed), 1 when there is at least one
error, 2 on a usage error. Each problem has a kind and a severity (below).
"""


class _CheckCommand(click.Command):
    """``kernreg check``, whose help ends with the kinds of problems, fitted to the terminal."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Problems"):
            formatter.write_dl(
                [(f"{kind} ({severity})", meaning) for kind, (severity, meaning) in KINDS.items()]
            )
        super().format_epilog(ctx, formatter)


def _echo_problems(problems: Sequence[Problem], summary: str) -> None:
    """One line per problem and origin (folded at spaces on a terminal), then ``summary``."""
    colors = {"error": "red", "warning": "yellow"}
    for problem in problems:
        lead = f"{problem.severity}:"
        text = fold(f"{lead} [{problem.kind}] {problem.message}", "  ")
        click.echo(style(lead, fg=colors[problem.severity], bold=True) + text[len(lead) :])
        for origin in problem.origins:
            click.echo(fold(f"    at {origin}", "  "))
    click.echo(fold(summary, "  "))


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


@click.command("check", cls=_CheckCommand, help=_CHECK_HELP)
@click.option(
    "--import-targets",
    is_flag=True,
    help="Import every target and string when predicate, in a child interpreter.",
)
@click.option(
    "--import-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="How long one target's import may take before it is reported as hanging.",
)
@functools.partial(platform_option, multiple=True)
@assume_package_option
@json_option
@common_options
@click.pass_obj
def check_command(
    state: State,
    import_targets: bool,
    import_timeout: float,
    platforms: tuple[Platform, ...],
    as_json: bool,
) -> int:
    state.reported_warnings = (PluginWarning, ConfigWarning)
    problems = [
        Problem("module", f"importing module '{name}' failed: {type(exc).__name__}: {exc}")
        for name, exc in import_modules(state)
    ]
    registry = default_registry()
    problems.extend(_check_config(registry))
    apply_assumed_packages(state, registry)
    entry_points = None
    if import_targets and registry.plugin_report is None:
        # A plugin that hangs or crashes on import must not take the check down with it.
        entry_points, found = _plugins_without_hangs(registry.config, import_timeout)
        problems.extend(found)
    # Lenient whatever KERNREG_STRICT_PLUGINS says: every failure is listed, not just the first.
    report = load_plugins(registry=registry, strict=False, entry_points=entry_points)
    problems.extend(_check_plugins(report, registry.config.plugins_deny))
    config, allowed = registry.config, registry.config.plugins
    if entry_points is not None and not isinstance(allowed, str):
        # A plugin left out above (it hangs or crashes on import) is installed all the same.
        installed = {normalize_distribution(info.distribution) for info in discover()}
        allowed = tuple(name for name in allowed if normalize_distribution(name) not in installed)
    unmatched = [*report.unmatched_allowed(allowed), *report.unmatched_denials(config.plugins_deny)]
    problems.extend(Problem("config", m) for m in unmatched)
    specs_by_op = {op: registry.get(op) for op in registry.ops()}
    problems.extend(_check_ambiguities(registry))
    problems.extend(_check_references(specs_by_op))
    problems.extend(_check_input_generators(specs_by_op))
    problems.extend(_check_process_state(specs_by_op))
    for platform in platforms:
        # Every device of a mixed host (cuda:9.0,7.5): the verdict must not depend on which
        # device is listed first, as neither `lock` nor `explain` does.
        for device in _devices(platform):
            problems.extend(_check_platform(registry, device, specs_by_op))
    targets: int | None = None
    skipped_specs: int | None = None
    if import_targets:
        found, targets, skipped_specs = _check_targets(specs_by_op, import_timeout)
        problems.extend(found)
    problems.extend(_check_overrides(registry))
    problems.extend(
        Problem("demoted", str(d), op=d.op, backends=[d.label]) for d in registry.demotions()
    )
    problems.extend(_check_plan(registry, platforms))
    problems.extend(Problem("pin_unmatched", m) for m in unmatched_pins(registry))
    problems.extend(Problem("pin_denied", m) for m in denied_pins(registry))
    problems.extend(Problem("assumed_unused", m) for m in unused_assumed_packages(registry))
    problems.extend(Problem("traits_unmatched", m) for m in unmatched_traits(registry))

    errors = sum(1 for p in problems if p.severity == "error")
    warnings = len(problems) - errors
    implementations = sum(len(specs) for specs in specs_by_op.values())
    if as_json:
        data: dict[str, Any] = {
            "ok": errors == 0,
            "errors": errors,
            "warnings": warnings,
            "problems": [p.describe() for p in problems],
            "checked": {
                "ops": len(specs_by_op),
                "implementations": implementations,
                "platforms": [str(p) for p in platforms],
                "targets": targets,
                "skipped_for_packages": skipped_specs,
            },
            "plugins": report.describe(),
        }
        if registry.config.assume_packages:
            data["checked"]["assumed_packages"] = [str(a) for a in registry.config.assume_packages]
        echo_json(data)
    else:
        checked = f"{_plural(len(specs_by_op), 'op')}, {_plural(implementations, 'implementation')}"
        if platforms:
            checked += f", on {', '.join(_where(d) for p in platforms for d in _devices(p))}"
        if registry.config.assume_packages:
            checked += f", packages assumed: {assumed_packages_text(registry)}"
        if targets is not None:
            checked += f", {_plural(targets, 'target')} checked"
            if skipped_specs:
                checked += (
                    f" ({_plural(skipped_specs, 'implementation')} skipped: "
                    "declared packages not installed)"
                )
        verdict = (
            "no problems"
            if not problems
            else f"{_plural(errors, 'error')}, {_plural(warnings, 'warning')}"
        )
        _echo_problems(problems, f"kernreg check: {verdict} ({checked})")
    return 1 if errors else 0


COMMANDS = (check_command,)

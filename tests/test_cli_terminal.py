"""Every command's output in a real terminal (a pseudo-terminal) 80, 100 and 160 columns
wide: no line longer than the terminal, the columns that carry the answer whole, help
texts that fit; and the small things a new user reads first (print(trace), list --layers).
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from tests.test_cli import FIXTURES, _write_distribution, kernreg, make_env

import kernreg as kr

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
WIDTHS = (80, 100, 160)


def in_terminal(
    columns: int,
    *args: str,
    plugins: bool = False,
    env: Mapping[str, str | None] = (),
    path: tuple[Path, ...] = (),
    cwd: Path = FIXTURES,
    raw: bool = False,
) -> tuple[int, str]:
    """Run ``kernreg *args`` with stdout and stderr on a pseudo-terminal ``columns`` wide;
    the output without its escape sequences, unless ``raw``."""
    code, text = _on_terminal(columns, ("-m", "kernreg", *args), plugins, env, path, cwd)
    return code, text if raw else ANSI.sub("", text)


def _on_terminal(
    columns: int,
    argv: tuple[str, ...],
    plugins: bool,
    env: Mapping[str, str | None],
    path: tuple[Path, ...],
    cwd: Path,
) -> tuple[int, str]:
    """``python *argv`` with stdout and stderr on a pseudo-terminal ``columns`` wide."""
    main, child = pty.openpty()
    import fcntl
    import struct
    import termios

    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 60, columns, 0, 0))
    environment = make_env(
        {"TERM": "xterm", "LINES": "60", "KERNREG_PLATFORM": "cpu", **dict(env)}, path
    )
    if plugins:
        environment.pop("KERNREG_PLUGINS")
    proc = subprocess.Popen(
        [sys.executable, *argv],
        cwd=cwd,
        env=environment,
        stdin=child,
        stdout=child,
        stderr=child,
    )
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    code = proc.wait(timeout=300)
    os.close(main)
    return code, b"".join(chunks).decode().replace("\r\n", "\n")


#: Ends each command's output in :func:`in_terminal_batch`, before its exit status.
_END = "\x1ekernreg-batch-exit "

#: Runs each ``[columns, env, argv]`` of ``argv[1]`` (JSON) through ``kernreg.cli.main``
#: on this process's terminal, resized to ``columns`` and with ``env`` set first.
_TERMINAL_BATCH = f"""
import fcntl, json, os, struct, sys, termios
from kernreg.cli import main
for columns, env, argv in json.loads(sys.argv[1]):
    fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", 60, columns, 0, 0))
    before = {{key: os.environ.get(key) for key in env}}
    os.environ.update(env)
    code = main(argv)
    for key, value in before.items():
        if value is None:
            del os.environ[key]
        else:
            os.environ[key] = value
    sys.stdout.flush()
    sys.stderr.flush()
    sys.stdout.write({_END!r} + str(code) + "\\n")
    sys.stdout.flush()
"""


def in_terminal_batch(
    *runs: tuple[int, tuple[str, ...], Mapping[str, str]],
    plugins: bool = False,
    cwd: Path = FIXTURES,
    raw: bool = False,
) -> list[tuple[int, str]]:
    """``in_terminal(columns, *args, env=env, plugins=plugins, cwd=cwd, raw=raw)`` for each
    ``(columns, args, env)`` of ``runs``, in one interpreter on one pseudo-terminal, resized
    before each command: for commands that change nothing a later one sees, where starting
    an interpreter (that imports torch) per command costs most of a test. ``env`` holds
    variables the CLI reads per command (``TERM``, ``NO_COLOR``), never ``KERNREG_*``."""
    assert not any(key.startswith("KERNREG_") for _, _, env in runs for key in env)
    script = json.dumps([[columns, dict(env), list(args)] for columns, args, env in runs])
    code, text = _on_terminal(80, ("-c", _TERMINAL_BATCH, script), plugins, {}, (), cwd)
    first, *ends = text.split(_END)
    assert code == 0, text
    assert len(ends) == len(runs), text
    outputs, codes = [first], []
    for end in ends:
        status, _, after = end.partition("\n")
        codes.append(int(status))
        outputs.append(after)
    exiting = outputs.pop()  # what exiting wrote: with the last command's output
    outputs[-1] += exiting
    return [(c, o if raw else ANSI.sub("", o)) for c, o in zip(codes, outputs, strict=True)]


def assert_fits(text: str, columns: int) -> None:
    long = [line for line in text.splitlines() if len(line) > columns]
    assert not long, f"lines wider than {columns}:\n" + "\n".join(long)


COMMANDS = [
    ("list",),
    ("explain", "layernorm.rmsnorm"),
    ("explain", "layernorm.rmsnorm", "--platform", "cuda:9.0", "--dtype", "bf16"),
    ("list", "--layers"),
    ("check",),
    ("platform",),
]
NARROW = (40, 60)
NARROW_COMMANDS = [
    ("list",),
    ("explain", "layernorm.rmsnorm"),
    ("check",),
    ("lock", "--check", "no-such.lock"),
]


@pytest.fixture(scope="module")
def fitted(once_per_session: Callable[..., Any]) -> dict[Any, tuple[int, str]]:
    """``(columns, command line) -> (exit status, output)`` of every command line of
    ``COMMANDS`` at each of ``WIDTHS`` and of ``NARROW_COMMANDS`` at each of ``NARROW``, with
    the installed plugins: in one interpreter, once per test run."""
    pytest.importorskip("kernreg_ops")
    runs = [(c, args, {}) for c in WIDTHS for args in COMMANDS]
    runs += [(c, args, {}) for c in NARROW for args in NARROW_COMMANDS]
    results = once_per_session("cli_terminal_fits", lambda: in_terminal_batch(*runs, plugins=True))
    return {
        (columns, args): (code, text)
        for (columns, args, _), (code, text) in zip(runs, results, strict=True)
    }


@pytest.mark.parametrize("columns", WIDTHS)
@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a))
def test_commands_fit_the_terminal(
    fitted: dict[Any, tuple[int, str]], columns: int, args: tuple[str, ...]
) -> None:
    code, text = fitted[(columns, args)]
    assert code in (0, 1), text
    assert_fits(text, columns)
    if args[0] == "list" and "--layers" not in args:
        # Op ids and implementation names are never cut or wrapped.
        rows = [line for line in text.splitlines() if "layernorm.rmsnorm" in line.split()]
        assert len(rows) == 4, text
        assert any("torch (reference)" in row for row in rows), text
    if args[0] == "explain":
        statuses = [line.split()[0] for line in text.splitlines() if line[:1].isalpha()]
        assert {"chosen", "rejected"} <= set(statuses), text
        assert "torch (reference)" in text


@pytest.mark.parametrize("columns", WIDTHS)
def test_list_wide_writes_long_lines_not_one_character_columns(columns: int) -> None:
    code, text = in_terminal(columns, "-m", "clifx_wide", "list", "--wide")
    assert code == 0, text
    rows = [line for line in text.splitlines() if "layernorm.rmsnorm" in line.split()]
    assert len(rows) == 3  # one line per implementation, every column whole
    assert all("clifx_wide.py:" in row for row in rows)


@pytest.mark.parametrize(
    "command", ["list", "explain", "check", "platform", "lock", "parity", "bench", "tune", "stats"]
)
def test_help_fits_80_columns(command: str) -> None:
    proc = kernreg(command, "--help", env={"COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    assert_fits(proc.stdout, 80)
    assert "9223372036854775807" not in proc.stdout  # no int64 range for --seed
    if command in ("parity", "bench"):
        assert "--platform" not in proc.stdout  # they have none: no help mentions it


def test_print_trace_shows_ops_and_counts() -> None:
    registry = kr.KernelRegistry(platform=kr.Platform.parse("cpu"))

    @kr.op("demo.scale", registry=registry)
    def scale(x: float) -> float:
        return 2 * x

    with kr.trace() as empty:
        pass
    assert str(empty) == "trace: no calls recorded"
    assert repr(empty) == "<Trace: 0 calls of 0 ops>"
    with kr.trace() as t:
        scale(1.0)
        scale(2.0)
    assert repr(t) == "<Trace: 2 calls of 1 op; demo.scale: torch x2>"
    assert str(t) == (
        "trace: 2 calls\n  demo.scale  torch: 2\n"  # the calls, then the decisions made
        "kernreg stats: 1 decision of 1 op, 0 fallbacks to the reference\n"
        "  demo.scale  reference   torch: 1"
    )


def _layer_rows(*args: str) -> list[dict[str, str]]:
    proc = kernreg("list", "--layers", *args, "--json", env={"KERNREG_PLUGINS": None})
    assert proc.returncode == 0, proc.stderr
    rows: list[dict[str, str]] = json.loads(proc.stdout)["layers"]
    return rows


@pytest.mark.parametrize(
    ("glob", "matches"),
    [
        ("llama", lambda row: "llama" in row["layer"].lower()),
        ("*RMSNorm", lambda row: row["layer"].lower().endswith("rmsnorm")),
        ("layernorm.*", lambda row: row["op"].startswith("layernorm.")),
    ],
)
def test_list_layers_matches_layer_classes(
    glob: str, matches: Callable[[dict[str, str]], bool]
) -> None:
    pytest.importorskip("kernreg_ops")
    every = _layer_rows()
    selected = _layer_rows(glob)
    assert selected
    assert selected == [row for row in every if matches(row)]
    none = kernreg("list", "--layers", "gpt2", env={"KERNREG_PLUGINS": None})
    assert none.returncode == 1
    assert f"no layer mapping matches 'gpt2' ({len(every)} registered)" in none.stderr


# --- narrow terminals, no colour, check's findings ----------------------------------------


@pytest.mark.parametrize("columns", NARROW)
@pytest.mark.parametrize("args", NARROW_COMMANDS, ids=lambda a: " ".join(a))
def test_commands_fit_a_narrow_terminal(
    fitted: dict[Any, tuple[int, str]], columns: int, args: tuple[str, ...]
) -> None:
    code, text = fitted[(columns, args)]
    assert code in (0, 1), text
    assert_fits(text, columns)
    if args[0] == "list":
        # The op goes above its rows; implementations and decisions stay whole.
        assert "\nlayernorm.rmsnorm\n" in text, text
        assert re.search(r"^  \*  aten +chosen", text, re.M), text
        assert "torch (reference)" in text
    if args[0] == "explain" and columns == 40:
        # No room for the reasons beside the answer: they go under their row, whole words.
        assert re.search(r"^rejected  triton\n    needs device cuda>=8\.0,", text, re.M), text
        assert "torch (reference)" in text


@pytest.mark.parametrize(
    "command", [(), ("list",), ("explain",), ("check",), ("parity",), ("bench",), ("lock",)]
)
def test_help_fits_a_narrow_terminal(command: tuple[str, ...]) -> None:
    code, text = in_terminal(60, *command, "--help")
    assert code == 0, text
    assert_fits(text, 60)
    if command == ("check",):
        assert re.search(r"^  plugin_conflict \(error\)", text, re.M), text


def test_no_color_turns_the_colours_off_in_a_terminal() -> None:
    pytest.importorskip("kernreg_ops")
    colour = re.compile(r"\x1b\[[0-9;]*m")
    code, coloured = in_terminal(100, "explain", "nosuch.op", plugins=True, raw=True)
    assert code == 1
    assert colour.search(coloured)  # the error: in red on a terminal
    for args in (("explain", "layernorm.rmsnorm"), ("explain", "nosuch.op"), ("check",)):
        code, text = in_terminal(100, *args, plugins=True, env={"NO_COLOR": "1"}, raw=True)
        assert code in (0, 1), text
        assert not colour.search(text), text


def test_check_findings_fold_in_a_terminal_and_name_relative_origins(tmp_path: Path) -> None:
    _write_distribution(tmp_path, "clifx-plugin-a", "conflict_a = clifx_plugin_mods:register_a")
    _write_distribution(tmp_path, "clifx-plugin-b", "conflict_b = clifx_plugin_mods:register_b")
    env = {"KERNREG_PLUGINS": "clifx-plugin-a,clifx-plugin-b"}
    # Run away from the fixtures: their files are found on the import path, not below here.
    code, text = in_terminal(80, "check", env=env, path=(tmp_path,), cwd=tmp_path)
    assert code == 1, text
    assert_fits(text, 80)
    assert str(FIXTURES) not in text
    origins = " ".join(text.split()).split(" at entry point ")[1:]
    assert len(origins) == 2, text
    assert origins[0].startswith(
        "'conflict_a' = clifx_plugin_mods:register_a (distribution clifx-plugin-a 1.0): "
        "clifx_plugin_mods.py:"
    ), text
    proc = subprocess.run(
        [sys.executable, "-m", "kernreg", "check", "--json"],
        cwd=tmp_path,
        env=make_env(env, (tmp_path,)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    (conflict,) = [p for p in json.loads(proc.stdout)["problems"] if p["kind"] == "plugin_conflict"]
    assert all(str(FIXTURES) not in origin for origin in conflict["origins"])


@pytest.mark.parametrize("columns", WIDTHS)
def test_lock_and_its_drift_fit_the_terminal(columns: int, tmp_path: Path) -> None:
    pytest.importorskip("kernreg_ops")
    plan = "kernreg.lock"  # in tmp_path: a short line
    code, text = in_terminal(columns, "lock", plan, plugins=True, cwd=tmp_path)
    assert code == 0, text
    assert_fits(text, columns)
    assert text.startswith(f"wrote {plan}: ")
    code, text = in_terminal(
        columns, "lock", "--check", plan, plugins=True, env={"KERNREG_DENY": "aten"}, cwd=tmp_path
    )
    assert code == 1, text
    assert_fits(text, columns)
    drifted = " ".join(text.split())
    assert "~ layernorm.rmsnorm on cpu, float32: aten (priority) [kernreg-ops " in drifted, text


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_text_an_output_encoding_cannot_hold_is_escaped_not_a_crash(
    tmp_path: Path, encoding: str
) -> None:
    # A legacy locale or PYTHONIOENCODING: non-ASCII origins and reasons must not turn a
    # table into "UnicodeEncodeError ... this is unexpected".
    (tmp_path / "kernels_\u03bb\u65e5.py").write_text(
        "from kernreg import KernelSpec, register_kernel\n"
        "def ref(x):\n    return x\n"
        "register_kernel(KernelSpec('uni.op', 'torch', ref, reference=True))\n"
        "register_kernel(KernelSpec('uni.op', 'fast', ref, requires=['cuda'], priority=3))\n"
    )
    env = {"PYTHONIOENCODING": encoding}
    for argv in (("explain", "uni.op"), ("list", "--wide")):
        proc = kernreg("-m", "kernels_\u03bb\u65e5", *argv, env=env, path=(tmp_path,))
        assert proc.returncode == 0, (argv, proc.stderr)
        assert "kernels_\\u03bb\\u65e5" in proc.stdout + proc.stderr, (argv, proc.stdout)

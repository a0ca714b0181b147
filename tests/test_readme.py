"""The documentation's examples run and print what they claim, and its tables stay true.

Every fenced block of README.md, docs/*.md and ops/README.md is checked by its info
string (the convention docs/design.md documents): ``python`` blocks run, in order, in
one fresh interpreter per file; ``toml`` blocks parse; ``text`` blocks are output;
anything marked ``no-run`` is shown only. A comment line right after a ``print(...)``
line states what it prints. A ``text`` block whose first line is ``$ kernreg ...`` is a
sample of the command line: the command runs and prints that block's other lines, as a
100-column terminal shows them (``columns=N`` in the info string: N columns), timings
masked (they differ from run to run).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kernreg.config import ENV_VARS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text(encoding="utf-8")
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "ops" / "README.md"]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```$", re.S | re.M)
RUN, PARSE, OUTPUT, SHOWN = "run", "parse", "output", "shown"


def blocks(path: Path) -> list[tuple[str, str]]:
    """``(kind, code)`` of every fenced block of ``path``, in order."""
    out = []
    for info, code in FENCE.findall(path.read_text(encoding="utf-8")):
        words = info.split()
        if "no-run" in words[1:]:
            kind = SHOWN
        elif words[:1] in (["python"], ["py"]):
            kind = RUN
        elif words[:1] == ["toml"]:
            kind = PARSE
        elif words[:1] == ["text"]:
            kind = OUTPUT
        else:
            kind = f"unmarked {info or '(no info string)'}"
        out.append((kind, code))
    return out


def claims(code: str) -> list[str]:
    """The comment lines right after a ``print(...)`` line: what it prints."""
    out: list[str] = []
    after_print = False
    for line in code.splitlines():
        stripped = line.strip()
        if after_print and stripped.startswith("#"):
            out.append(stripped[2:].rstrip())
            continue
        after_print = stripped.startswith("print(")
    return out


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    env["KERNREG_PLATFORM"] = "cpu"  # no torch import for detection: the examples need none
    env["KERNREG_CACHE_DIR"] = str(cwd / "cache")
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


PYTHON_BLOCKS = [code for kind, code in blocks(README) if kind == RUN]


def test_the_readme_has_python_examples() -> None:
    assert len(PYTHON_BLOCKS) >= 3


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_block_is_run_parsed_or_marked(path: Path) -> None:
    found = blocks(path)
    fences = [
        line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("```")
    ]
    assert len(fences) == 2 * len(found), f"{path}: a fence is not closed or not recognised"
    unmarked = [kind for kind, _ in found if kind.startswith("unmarked")]
    assert not unmarked, f"{path}: mark these blocks 'no-run' or give them a checked language"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_python_examples_run_and_print_what_they_claim(path: Path, tmp_path: Path) -> None:
    code = [c for kind, c in blocks(path) if kind == RUN]
    if not code:
        pytest.skip(f"{path.name} has no runnable Python block")
    source = "\n".join(code)
    if re.search(r"^\s*(import|from) (torch|kernreg_ops)\b", source, re.M):
        pytest.importorskip("torch")
        pytest.importorskip("kernreg_ops")
    result = run_python(source, tmp_path)
    assert result.returncode == 0, result.stderr
    printed = {line.rstrip() for line in result.stdout.splitlines()}
    missing = [line for block in code for line in claims(block) if line not in printed]
    assert not missing, (
        f"{path.name} claims output that was not printed: {missing}\n{result.stdout}"
    )


def test_the_readme_shows_example_output() -> None:
    assert any(claims(code) for code in PYTHON_BLOCKS), "the README shows no example output"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_toml_blocks_parse(path: Path) -> None:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    for kind, code in blocks(path):
        if kind == PARSE:
            tomllib.loads(code)


def test_the_environment_table_lists_every_variable() -> None:
    rows = dict(re.findall(r"^\| `(KERNREG_[A-Z_]+)` \|\s*(`?[a-z_]*`?)\s*\|", TEXT, re.M))
    assert set(rows) == set(ENV_VARS)
    for var, (toml_key, _) in ENV_VARS.items():
        assert rows[var].strip("`") == toml_key, var


def test_the_error_table_names_every_public_error() -> None:
    import kernreg

    errors = {name for name in kernreg.__all__ if name.endswith("Error") and name != "KernregError"}
    documented = set(re.findall(r"^\| `([A-Za-z]+Error)`", TEXT, re.M))
    assert errors <= documented, errors - documented


# --- samples of the command line ------------------------------------------------------------

#: The width of the terminal the samples are shown in.
SAMPLE_COLUMNS = 100
#: The first line of a sample: the command, after any environment variables it sets.
PROMPT = re.compile(r"\$ ([A-Z_]+=\S* )*kernreg ")


def cli_samples(path: Path) -> list[tuple[str, str, int]]:
    """``(command line, output, columns)`` of every ``text`` block of ``path`` that starts
    with a ``$ kernreg ...`` line; ``columns=N`` in the info string sets the terminal's
    width (default :data:`SAMPLE_COLUMNS`)."""
    samples = []
    for info, code in FENCE.findall(path.read_text(encoding="utf-8")):
        words = info.split()
        if words[:1] == ["text"] and PROMPT.match(code):
            options = dict(w.split("=", 1) for w in words[1:] if "=" in w)
            command, _, output = code.partition("\n")
            samples.append((command[2:], output, int(options.get("columns", SAMPLE_COLUMNS))))
    return samples


SAMPLES = [
    pytest.param(*sample, id=f"{path.relative_to(ROOT)}: {sample[0]}")
    for path in DOCS
    for sample in cli_samples(path)
]
#: A table's header line, as kernreg's commands print them.
TABLE_HEADER = re.compile(r"^\s*(OP|STATUS)\s+IMPLEMENTATION\s", re.M)


def test_the_docs_show_command_line_samples() -> None:
    commands = [command.split()[1] for command, _, _ in cli_samples(README)]
    assert "explain" in commands
    assert any(cli_samples(ROOT / "ops" / "README.md"))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_shown_is_a_checked_sample(path: Path) -> None:
    shown = [
        code
        for kind, code in blocks(path)
        if kind == OUTPUT and TABLE_HEADER.search(code) and not PROMPT.match(code)
    ]
    assert not shown, (
        f"{path.relative_to(ROOT)}: start these blocks with the `$ kernreg ...` line they show"
    )


def _timings_masked(text: str) -> list[str]:
    """``text``'s lines with what changes from run to run masked: numbers, noise marks,
    the n.s. of speed-ups near 1x, the runs of spaces that align them, and the packages
    this environment happens to lack."""
    lines = []
    for line in text.splitlines():
        line = re.sub(r"; package \S+ is not installed \(needs [^)]*\)", "", line)
        line = re.sub(r" \(noisy\)| n\.s\.$", "", line)
        line = re.sub(r"\d+(\.\d+)?( (ns|us|ms|s)\b)?", "N", line)
        lines.append(" ".join(line.split()))
    return lines


@pytest.mark.parametrize(("command", "output", "columns"), SAMPLES)
def test_command_line_samples_print_what_the_command_prints(
    command: str, output: str, columns: int, tmp_path: Path
) -> None:
    pytest.importorskip("click")
    pytest.importorskip("kernreg_ops")
    words = shlex.split(command)
    assignments = dict(w.split("=", 1) for w in words[: words.index("kernreg")])
    args = words[words.index("kernreg") + 1 :]
    if args[0] in ("bench", "parity", "tune"):
        pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    env.update(assignments, COLUMNS=str(columns), KERNREG_CACHE_DIR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "kernreg", *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    if args[0] == "bench":
        assert _timings_masked(result.stdout) == _timings_masked(output), result.stdout
    else:
        assert result.stdout.splitlines() == output.splitlines(), result.stdout


def test_the_readme_says_how_long_the_test_command_takes() -> None:
    before, _, _ = TEXT.partition("python -m pytest\n")
    lead = before.rsplit("\n\n", 2)[-2]  # the paragraph that introduces the command
    assert re.search(r"about \d+ minutes on a 2-core machine", lead), lead

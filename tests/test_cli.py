"""The ``kernreg`` command line, run as users run it: in a fresh interpreter.

Every command runs in a subprocess with ``tests/cli_fixtures`` on ``PYTHONPATH`` (the
fixture modules register kernels on import, for ``-m``), the fixture folder as the
working directory (so origins read ``clifx_basic.py:5``), and ``KERNREG_PLUGINS=none``
unless a test says otherwise.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from _support import kernreg_cli
from kernreg.config import ENV_VARS
from kernreg.plan import SelectionPlan

FIXTURES = Path(__file__).resolve().parent / "cli_fixtures"
KERNREG_SCRIPT = Path(sys.executable).parent / ("kernreg.exe" if os.name == "nt" else "kernreg")


def make_env(extra: Mapping[str, str | None] = (), path: tuple[Path, ...] = ()) -> dict[str, str]:
    # Not COLUMNS either (pytest-xdist's workers set it to 80): tables are fitted to it.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_") and k != "COLUMNS"}
    env["KERNREG_PLUGINS"] = "none"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(FIXTURES), *(str(p) for p in path), *filter(None, [env.get("PYTHONPATH")])]
    )
    for key, value in dict(extra).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def kernreg(
    *args: str,
    env: Mapping[str, str | None] = (),
    path: tuple[Path, ...] = (),
    command: tuple[str, ...] = (sys.executable, "-m", "kernreg"),
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*command, *args],
        cwd=FIXTURES,
        env=make_env(env, path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def kernreg_json(*args: str, expect: int = 0, **kwargs: Any) -> Any:
    proc = kernreg(*args, "--json", **kwargs)
    assert proc.returncode == expect, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def rows(stdout: str) -> list[list[str]]:
    """The plain table's rows (after the header), split on runs of two or more spaces."""
    import re

    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "IMPLEMENTATION" in line) + 1
    return [re.split(r" {2,}", line.strip()) for line in lines[start:] if line.strip()]


def row_for(stdout: str, op: str, label: str) -> str:
    for line in stdout.splitlines():
        cells = line.split()
        if op in cells and label in cells:
            return line
    raise AssertionError(f"no row for {op} {label} in:\n{stdout}")


# --- list ----------------------------------------------------------------------------------


def test_list_marks_the_chosen_implementation_on_a_simulated_platform() -> None:
    proc = kernreg(
        "-m", "clifx_basic", "list", "--wide", "--platform", "cuda:9.0", "--dtype", "bf16"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "platform cuda:9.0 [--platform]; dtypes bfloat16"
    header = proc.stdout.splitlines()[2].split()
    assert header == [
        "OP",
        "IMPLEMENTATION",
        "PRIORITY",
        "REQUIRES",
        "DTYPES",
        "TRAITS",
        "ORIGIN",
        "SELECTION",
        "REASONS",
    ]
    chosen = row_for(proc.stdout, "demo.rmsnorm", "cuda/sm90")
    assert chosen.startswith("*")
    assert chosen.split()[-6:] == [
        "chosen",
        "(priority)",
        "highest",
        "priority",
        "among",
        "eligible",
    ]
    assert "cuda==9.0" in chosen
    assert "clifx_basic.py:21" in chosen
    triton = row_for(proc.stdout, "demo.rmsnorm", "triton")
    assert not triton.startswith("*")
    assert "bfloat16,float16" in triton
    assert "cuda_graph_safe" in triton
    assert triton.endswith("eligible            outranked by cuda/sm90")
    assert row_for(proc.stdout, "demo.gelu", "torch").startswith("*")
    assert proc.stderr == ""


def test_list_on_the_configured_platform_falls_back_to_the_reference() -> None:
    proc = kernreg("-m", "clifx_basic", "list", env={"KERNREG_PLATFORM": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(
        "platform cpu [KERNREG_PLATFORM]; dtypes float32, float16, bfloat16, each decided"
    )
    assert row_for(proc.stdout, "demo.rmsnorm", "(reference)").startswith("*")
    assert "chosen (reference)" in row_for(proc.stdout, "demo.rmsnorm", "(reference)")
    assert row_for(proc.stdout, "demo.rmsnorm", "triton").endswith("rejected")
    table = [r for r in rows(proc.stdout) if not r[0].startswith("note:")]
    assert [r[1] if r[0] == "*" else r[0] for r in table] == [
        "demo.gelu",
        "demo.rmsnorm",
        "demo.rmsnorm",
        "demo.rmsnorm",
    ]


def test_list_filters_ops_by_glob() -> None:
    proc = kernreg("-m", "clifx_basic", "list", "demo.g*", "--platform", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "demo.gelu" in proc.stdout
    assert "demo.rmsnorm" not in proc.stdout
    none = kernreg("-m", "clifx_basic", "list", "nothing.*", "--platform", "cpu")
    assert none.returncode == 1
    assert none.stderr.startswith("error: no op matches 'nothing.*'\n")


def test_list_shows_an_ambiguous_decision_in_its_rows() -> None:
    proc = kernreg("-m", "clifx_ambiguous", "list", "--platform", "cuda:9.0")
    assert proc.returncode == 0, proc.stderr
    for label in ("cuda", "triton"):
        row = row_for(proc.stdout, "amb.op", label)
        assert row.startswith("!")
        assert row.endswith("AMBIGUOUS (tied)")
    assert row_for(proc.stdout, "amb.op", "(reference)").endswith("AMBIGUOUS")


def test_list_shows_nothing_eligible_in_its_rows() -> None:
    proc = kernreg("-m", "clifx_noref", "-m", "clifx_basic", "list", "--platform", "cpu")
    assert proc.returncode == 0, proc.stderr
    row = row_for(proc.stdout, "noref.op", "triton")
    assert row.startswith("!")
    assert row.endswith("NOTHING ELIGIBLE")
    assert row_for(proc.stdout, "demo.gelu", "torch").startswith("*")


def test_list_shows_a_forbidden_fallback_in_strict_mode() -> None:
    proc = kernreg("-m", "clifx_basic", "list", "--platform", "cpu", env={"KERNREG_STRICT": "1"})
    assert proc.returncode == 0, proc.stderr
    assert row_for(proc.stdout, "demo.rmsnorm", "(reference)").endswith("STRICT: no fallback")
    assert row_for(proc.stdout, "demo.gelu", "(reference)").startswith("*")
    explained = kernreg(
        "-m",
        "clifx_basic",
        "explain",
        "demo.rmsnorm",
        "--platform",
        "cpu",
        env={"KERNREG_STRICT": "1"},
    )
    assert explained.returncode == 1
    assert "-> strict mode forbids the fallback to the reference 'torch'" in explained.stdout


def test_list_json_shape() -> None:
    data = kernreg_json(
        "-m", "clifx_basic", "-m", "clifx_ambiguous", "list", "--platform", "cuda:9.0"
    )
    assert set(data) == {"platform", "dtypes", "ops"}
    assert data["platform"] == {
        "platform": "cuda:9.0",
        "device": "cuda",
        "arch": "9.0",
        "arch_name": "sm_90",
        "index": None,
        "torch_version": None,
        "runtime_version": None,
        "driver_version": None,
        "source": "--platform",
        "devices": [],
    }
    assert data["dtypes"] is None
    assert [o["op"] for o in data["ops"]] == ["amb.op", "demo.gelu", "demo.rmsnorm"]
    for entry in data["ops"]:
        assert set(entry) == {
            "op",
            "chosen",
            "rule",
            "ok",
            "outcome",
            "by_dtype",
            "implementations",
        }
        for impl in entry["implementations"]:
            assert set(impl) == {
                "op",
                "backend",
                "variant",
                "label",
                "target",
                "requires",
                "dtypes",
                "when",
                "packages",
                "traits",
                "priority",
                "reference",
                "description",
                "origin",
                "chosen",
                "chosen_for",
                "selection",
                "reasons",
            }
            assert set(impl["origin"]) == {"file", "line", "distribution", "version"}
            assert isinstance(impl["origin"]["line"], int)
    amb, gelu, rms = data["ops"]
    assert amb["chosen"] is None
    assert amb["rule"] == "ambiguous"
    assert amb["ok"] is False
    assert amb["outcome"] == "ambiguous: cuda, triton tie at priority 5"
    assert [i["selection"] for i in amb["implementations"]] == [
        "AMBIGUOUS (tied)",
        "AMBIGUOUS (tied)",
        "AMBIGUOUS",
    ]
    assert gelu["chosen"] == "torch"
    assert gelu["rule"] == "reference"
    assert rms["chosen"] == "cuda/sm90"
    assert rms["outcome"] == "cuda/sm90 (rule: priority)"
    sm90 = rms["implementations"][0]
    assert sm90["label"] == "cuda/sm90"
    assert sm90["chosen"] is True
    assert sm90["selection"] == "chosen (priority)"
    assert sm90["requires"] == ["cuda==9.0"]
    assert sm90["target"] == "clifx_targets:rms_cuda"
    assert sm90["origin"]["file"] == str(FIXTURES / "clifx_basic.py")
    assert [i["chosen"] for i in rms["implementations"]] == [True, False, False]


def test_list_json_with_dtypes() -> None:
    data = kernreg_json(
        "-m", "clifx_basic", "list", "demo.rmsnorm", "--platform", "cuda:8.0", "--dtype", "fp16"
    )
    assert data["dtypes"] == ["float16"]
    assert data["ops"][0]["chosen"] == "triton"


def test_list_works_with_installed_plugins() -> None:
    # Whatever plugins are installed in this environment load too; the fixture's ops show.
    proc = kernreg(
        "-m", "clifx_basic", "list", "demo.*", "--platform", "cpu", env={"KERNREG_PLUGINS": None}
    )
    assert proc.returncode == 0, proc.stderr
    assert "demo.rmsnorm" in proc.stdout


# --- explain -------------------------------------------------------------------------------


def test_explain_prints_the_decision_table() -> None:
    proc = kernreg(
        "-m", "clifx_basic", "explain", "demo.rmsnorm", "--platform", "cuda:8.6", "--dtype", "fp16"
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "op demo.rmsnorm on cuda:8.6 [--platform]; dtypes float16"
    assert lines[1] == "-> triton (rule: priority)"
    table = rows(proc.stdout)
    assert [r[:3] for r in table] == [
        ["rejected", "cuda/sm90", "20"],
        ["chosen", "triton", "10"],
        ["eligible", "torch (reference)", "0"],
    ]
    assert table[0][3] == "needs cuda==9.0, platform is 8.6"
    assert table[1][3] == "highest priority among eligible"
    assert table[1][4] == "clifx_targets:rms_triton"
    assert table[1][5] == "clifx_basic.py:10"


def test_explain_json_is_the_decision_description() -> None:
    data = kernreg_json("-m", "clifx_basic", "explain", "demo.rmsnorm", "--platform", "cpu")
    assert set(data) == {
        "op",
        "platform",
        "dtypes",
        "chosen",
        "rule",
        "ok",
        "notes",
        "tied",
        "conditional",
        "plan_miss",
        "tuning",
        "candidates",
        "devices",  # per device of a host with several; empty otherwise
    }
    assert data["op"] == "demo.rmsnorm"
    assert data["platform"] == "cpu"
    assert data["dtypes"] is None
    assert data["chosen"] == "torch"
    assert data["rule"] == "reference"
    assert data["ok"] is True
    assert data["plan_miss"] is None
    assert data["tuning"] == []
    assert [c["label"] for c in data["candidates"]] == ["cuda/sm90", "triton", "torch"]
    assert [c["status"] for c in data["candidates"]] == ["rejected", "rejected", "chosen"]
    triton = data["candidates"][1]
    assert set(triton) == {
        "backend",
        "variant",
        "label",
        "priority",
        "reference",
        "eligible",
        "status",
        "reasons",
        "target",
        "origin",
    }
    assert triton["reasons"][0] == "needs device cuda>=8.0, platform is cpu"
    assert any("dtypes are unknown" in r for r in triton["reasons"])


def test_explain_ambiguous_prints_the_table_and_exits_1() -> None:
    proc = kernreg("-m", "clifx_ambiguous", "explain", "amb.op", "--platform", "cuda:9.0")
    assert proc.returncode == 1
    assert "-> ambiguous: cuda, triton tie at priority 5" in proc.stdout
    assert [r[:2] for r in rows(proc.stdout)] == [
        ["eligible", "cuda"],
        ["eligible", "triton"],
        ["eligible", "torch (reference)"],
    ]
    err = proc.stderr.splitlines()
    assert err[0] == "error: op 'amb.op': ambiguous: cuda, triton tie at priority 5"
    assert err[1].startswith("hint: ")
    assert "KERNREG_PIN=amb.op=" in err[1]
    data = kernreg_json(
        "-m", "clifx_ambiguous", "explain", "amb.op", "--platform", "cuda:9.0", expect=1
    )
    assert data["rule"] == "ambiguous"
    assert data["tied"] == ["cuda", "triton"]
    assert data["ok"] is False


def test_explain_nothing_eligible_exits_1() -> None:
    proc = kernreg("-m", "clifx_noref", "explain", "noref.op", "--platform", "cpu")
    assert proc.returncode == 1
    assert "-> nothing eligible (no reference implementation registered)" in proc.stdout
    assert "needs device cuda>=8.0, platform is cpu" in proc.stdout
    assert "note: no reference implementation registered" in proc.stdout
    assert proc.stderr.startswith("error: op 'noref.op': nothing eligible")


def test_explain_with_a_backend() -> None:
    data = kernreg_json(
        "-m",
        "clifx_basic",
        "explain",
        "demo.rmsnorm",
        "--backend",
        "cuda/sm90",
        "--platform",
        "cuda:9.0",
    )
    assert data["chosen"] == "cuda/sm90"
    assert data["rule"] == "explicit"
    strict = kernreg_json(
        "-m",
        "clifx_basic",
        "explain",
        "demo.rmsnorm",
        "--backend",
        "triton",
        "--platform",
        "cpu",
        expect=1,
    )
    assert strict["rule"] == "none"
    assert strict["chosen"] is None


@pytest.mark.parametrize(
    ("args", "first_line"),
    [
        (("explain", "x.y"), "error: No kernels registered for op 'x.y'"),
        (
            ("explain", "demo.gelu", "--backend", "triton"),
            "error: No 'triton' backend registered for op 'demo.gelu'; registered: torch",
        ),
    ],
)
def test_explain_lookup_errors_are_one_line_and_a_hint(
    args: tuple[str, ...], first_line: str
) -> None:
    proc = kernreg("-m", "clifx_basic", *args, "--platform", "cpu")
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[0] == first_line
    assert lines[1].startswith("hint: ")
    assert len(lines) == 2
    assert "Traceback" not in proc.stderr


# --- usage errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("list", "--platform", "cuda:"), "'cuda:'"),
        (("list", "--platform", "cuda:9.0.1"), "'cuda:9.0.1'"),
        (("list", "--dtype", "bfloat17"), "'bfloat17'"),
        (("explain", "demo.gelu", "--dtype", "fp7"), "'fp7'"),
        (("explain", "Not-An-Op"), "'Not-An-Op'"),
        (("explain", "demo.gelu", "--backend", "Triton"), "'Triton'"),
        (("check", "--platform", "gpu:?"), "'gpu:?'"),
        (("check", "--import-timeout", "0"), "0"),
        (("list", "--no-such-option"), "--no-such-option"),
        (("no-such-command",), "no-such-command"),
    ],
)
def test_usage_errors_exit_2_naming_the_value(args: tuple[str, ...], named: str) -> None:
    proc = kernreg("-m", "clifx_basic", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert named in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_help_and_version() -> None:
    proc = kernreg("--help")
    assert proc.returncode == 0
    for command in ("list", "explain", "check", "platform"):
        assert command in proc.stdout
    assert "Exit status" in proc.stdout
    version = kernreg("--version")
    assert version.returncode == 0
    assert version.stdout.startswith("kernreg, version ")


# --- platform ------------------------------------------------------------------------------


def test_platform_reports_the_override_and_the_machine() -> None:
    data = kernreg_json("platform", env={"KERNREG_PLATFORM": "hip:gfx942"})
    assert set(data) == {"platform", "override", "detected"}
    assert data["platform"]["platform"] == "hip:gfx942"
    assert data["platform"]["arch_name"] == "gfx942"
    assert data["platform"]["source"] == "KERNREG_PLATFORM"
    assert data["override"] == {"source": "KERNREG_PLATFORM", "value": "hip:gfx942"}
    assert set(data["detected"]) == set(data["platform"])
    assert data["detected"]["source"] != "KERNREG_PLATFORM"
    text = kernreg("platform", env={"KERNREG_PLATFORM": "cuda:9.0"})
    assert text.returncode == 0
    values = dict(line.split(None, 1) for line in text.stdout.splitlines()[1:])
    assert values["platform"] == "cuda:9.0"
    assert values["arch"] == "9.0"
    assert values["source"] == "KERNREG_PLATFORM"
    assert values["override"] == "KERNREG_PLATFORM=cuda:9.0"
    assert "detected" in values


def test_platform_without_override_is_detection() -> None:
    data = kernreg_json("platform")
    assert data["override"] is None
    assert data["detected"] == data["platform"]
    assert data["platform"]["source"]


def test_platform_with_an_invalid_override_is_an_error() -> None:
    proc = kernreg("platform", env={"KERNREG_PLATFORM": "cuda:"})
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("error: invalid configuration KERNREG_PLATFORM='cuda:'")
    assert lines[1].startswith("hint: ")


# --- errors --------------------------------------------------------------------------------


def test_bad_pin_is_one_line_and_a_hint() -> None:
    proc = kernreg("-m", "clifx_basic", "list", env={"KERNREG_PIN": "garbage"})
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "error: invalid configuration KERNREG_PIN='garbage': "
        "expected 'op_or_glob=backend[/variant]'",
        "hint: fix or unset that setting; `kernreg check` lists every configuration problem",
    ]


def test_module_errors_are_one_line_and_debug_shows_the_traceback() -> None:
    proc = kernreg("-m", "clifx_raises", "list")
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[0] == (
        "error: importing module 'clifx_raises' failed: RuntimeError: engine set-up failed"
    )
    assert lines[1].startswith("hint: ")
    assert len(lines) == 2
    debug = kernreg("-m", "clifx_raises", "--debug", "list")
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr
    assert 'raise RuntimeError("engine set-up failed")' in debug.stderr
    assert "error: importing module 'clifx_raises' failed" in debug.stderr
    after = kernreg("list", "-m", "clifx_raises", "--debug")
    assert after.returncode == 1
    assert "Traceback (most recent call last)" in after.stderr


def test_missing_module_hint() -> None:
    proc = kernreg("-m", "clifx_no_such_module", "list")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "error: importing module 'clifx_no_such_module' failed: ModuleNotFoundError: "
        "No module named 'clifx_no_such_module'",
        "hint: is it on PYTHONPATH, or in the current directory? (--debug shows the traceback)",
    ]


def test_conflicting_modules_name_both_origins() -> None:
    proc = kernreg("-m", "clifx_basic", "-m", "clifx_conflict", "list")
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[0].startswith(
        "error: importing module 'clifx_conflict' failed: KernelConflictError: Conflicting "
        "kernel registration for op 'demo.gelu', backend 'torch': "
        "'clifx_targets:gelu_ref' != 'clifx_targets:good'"
    )
    assert any("clifx_basic.py:31" in line for line in lines)
    assert any("clifx_conflict.py:5" in line for line in lines)
    assert lines[-1].startswith("hint: ")
    assert "Traceback" not in proc.stderr


def test_missing_extras_message() -> None:
    code = (
        "import sys; sys.modules['click'] = None; from kernreg.cli import main; "
        "raise SystemExit(main(['list']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=make_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr == "kernreg's command line needs its extras: pip install 'kernreg[cli]'\n"
    assert proc.stdout == ""


def test_the_core_does_not_import_the_command_line_dependencies() -> None:
    code = (
        "import sys, kernreg, kernreg.cli; "
        "assert not {'click', 'rich'} & set(sys.modules), sorted(sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=make_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_the_installed_script() -> None:
    assert KERNREG_SCRIPT.exists(), KERNREG_SCRIPT
    proc = kernreg("-m", "clifx_basic", "list", "--platform", "cpu", command=(str(KERNREG_SCRIPT),))
    assert proc.returncode == 0, proc.stderr
    assert row_for(proc.stdout, "demo.gelu", "torch").startswith("*")


def test_module_from_the_current_directory_with_the_script(tmp_path: Path) -> None:
    (tmp_path / "clifx_local_engine.py").write_text(
        "from kernreg import KernelSpec, register_kernel\n"
        "register_kernel(KernelSpec('local.op', 'torch', 'os:getcwd', reference=True))\n"
    )
    proc = subprocess.run(
        [str(KERNREG_SCRIPT), "-m", "clifx_local_engine", "list", "--platform", "cpu"],
        cwd=tmp_path,
        env=make_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "local.op" in proc.stdout


# --- check ---------------------------------------------------------------------------------

PROBLEM_KEYS = {"severity", "kind", "op", "backends", "message", "origins"}


def problems(data: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [p for p in data["problems"] if p["kind"] == kind]


def test_check_clean_inventory() -> None:
    proc = kernreg("-m", "clifx_basic", "check", "--platform", "cuda:9.0", "--platform", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        "kernreg check: no problems (2 ops, 4 implementations, on cuda:9.0, cpu)"
    ]
    data = kernreg_json("-m", "clifx_basic", "check", "--import-targets")
    assert data == {
        "ok": True,
        "errors": 0,
        "warnings": 0,
        "problems": [],
        "checked": {
            "ops": 2,
            "implementations": 4,
            "platforms": [],
            "targets": 4,
            "skipped_for_packages": 0,
        },
        "plugins": {
            "loaded": [],
            "failed": [],
            "skipped": [],
            "disabled": "KERNREG_PLUGINS=none",
            "conflicts": [],
        },
    }


def test_check_help_documents_severities() -> None:
    proc = kernreg("check", "--help")
    assert proc.returncode == 0
    for word in ("error", "warning", "ambiguity", "same_object", "override", "unimportable"):
        assert word in proc.stdout
    assert "Exits 0 when there is no error" in proc.stdout


def test_check_reports_ambiguity_and_missing_reference() -> None:
    proc = kernreg("-m", "clifx_ambiguous", "-m", "clifx_noref", "check")
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[-1] == (
        "kernreg check: 2 errors, 0 warnings (2 ops, 4 implementations)"
    )
    data = kernreg_json("-m", "clifx_ambiguous", "-m", "clifx_noref", "check", expect=1)
    assert data["ok"] is False
    assert data["errors"] == 2
    for problem in data["problems"]:
        assert set(problem) == PROBLEM_KEYS
    (amb,) = problems(data, "ambiguity")
    assert amb["severity"] == "error"
    assert amb["op"] == "amb.op"
    assert amb["backends"] == ["cuda", "triton"]
    assert amb["origins"] == ["clifx_ambiguous.py:9", "clifx_ambiguous.py:6"]
    assert "share priority 5" in amb["message"]
    (noref,) = problems(data, "missing_reference")
    assert noref["op"] == "noref.op"
    assert noref["origins"] == ["clifx_noref.py:5"]


def test_check_platforms() -> None:
    data = kernreg_json(
        "-m",
        "clifx_ambiguous",
        "-m",
        "clifx_noref",
        "-m",
        "clifx_partial",
        "check",
        "--platform",
        "cuda:9.0",
        "--platform",
        "cpu",
        expect=1,
    )
    assert data["checked"]["platforms"] == ["cuda:9.0", "cpu"]
    (amb,) = problems(data, "platform_ambiguous")
    assert amb["op"] == "amb.op"
    assert amb["message"] == (
        "op 'amb.op' on cuda:9.0: any dtype: ambiguous: cuda, triton tie at priority 5"
    )
    (none,) = problems(data, "platform_nothing_eligible")
    assert none["op"] == "noref.op"
    assert none["message"].startswith("op 'noref.op' on cpu: any dtype: nothing eligible")
    (partial,) = problems(data, "platform_partial")
    assert partial["severity"] == "warning"
    assert partial["op"] == "part.op"
    assert partial["message"].startswith("op 'part.op' on cpu: float16: nothing eligible")


def test_check_partial_coverage_alone_is_a_warning() -> None:
    proc = kernreg("-m", "clifx_partial", "check", "--platform", "cpu")
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.startswith("warning: [platform_partial] op 'part.op' on cpu: float16")


def test_check_import_targets_survives_crashes_and_hangs() -> None:
    data = kernreg_json(
        "-m", "clifx_badtargets", "check", "--import-targets", "--import-timeout", "2", expect=1
    )
    assert data["checked"]["targets"] == 8
    # A target whose declared package is missing is not expected to import.
    assert data["checked"]["skipped_for_packages"] == 1
    found = {p["backends"][0]: p for p in problems(data, "unimportable")}
    assert sorted(found) == ["crash", "gated", "hang", "missing", "noattr", "notcallable"]
    for problem in found.values():
        assert problem["severity"] == "error"
        assert problem["op"] == "bad.op"
        assert problem["origins"][0].startswith("clifx_badtargets.py:")
    assert found["missing"]["message"] == (
        "target 'clifx_no_such_module:fn' of op 'bad.op', backend 'missing' does not import: "
        "ModuleNotFoundError: No module named 'clifx_no_such_module'"
    )
    assert "AttributeError" in found["noattr"]["message"]
    assert found["notcallable"]["message"].endswith("imports, but is not callable (a int object)")
    assert "crashed the interpreter while importing (exit status 3)" in found["crash"]["message"]
    assert "did not finish importing within 2 s" in found["hang"]["message"]
    assert found["gated"]["message"].startswith(
        "when predicate 'clifx_no_such_module:pred' of op 'bad.op', backend 'gated'"
    )
    # Targets after the crash and the hang were still imported, and imported fine.
    assert "zlast" not in found
    assert "torch" not in found


def test_check_import_targets_does_not_wait_for_a_child_that_cannot_exit() -> None:
    # clifx_exit_hang imports fine but leaves a non-daemon thread running for 60 s: no
    # target is to blame (least of all the last one imported), and nobody waits for it.
    proc = kernreg(
        "-m", "clifx_pooled", "check", "--import-targets", "--import-timeout", "20", "--json",
        timeout=15,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert data["problems"] == []
    assert data["checked"]["targets"] == 2


def test_check_finds_a_re_exported_target() -> None:
    proc = kernreg("-m", "clifx_reexport", "check", "--import-targets")
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.startswith(
        "warning: [same_object] 'clifx_pkg.a:fn' and 'clifx_pkg.b:fn' are the same object"
    )
    data = kernreg_json("-m", "clifx_reexport", "check", "--import-targets")
    (same,) = problems(data, "same_object")
    assert same["severity"] == "warning"
    assert same["op"] == "re.op"
    assert same["backends"] == ["triton", "triton/v2"]
    assert same["origins"] == ["clifx_reexport.py:6", "clifx_reexport.py:7"]
    assert data["ok"] is True
    assert data["warnings"] == 1


def test_check_reports_overrides_as_warnings() -> None:
    data = kernreg_json("-m", "clifx_override", "check")
    (override,) = problems(data, "override")
    assert override["severity"] == "warning"
    assert override["op"] == "over.op"
    assert override["backends"] == ["triton"]
    assert override["origins"] == ["clifx_override.py:6", "clifx_override.py:7"]
    assert data["ok"] is True


def test_check_reports_configuration_problems() -> None:
    env = {"KERNREG_PIN": "garbage", "KERNREG_DENY": "Bad!", "KERNREG_STIRCT": "1"}
    proc = kernreg("-m", "clifx_basic", "check", env=env)
    assert proc.returncode == 1
    assert proc.stderr == ""
    data = kernreg_json("-m", "clifx_basic", "check", env=env, expect=1)
    config = problems(data, "config")
    assert [p["origins"] for p in config] == [["KERNREG_PIN"], ["KERNREG_DENY"]] or [
        p["origins"] for p in config
    ] == [["KERNREG_DENY"], ["KERNREG_PIN"]]
    assert any(
        p["message"].startswith("invalid configuration KERNREG_PIN='garbage'") for p in config
    )
    (unknown,) = problems(data, "unknown_variable")
    assert unknown["severity"] == "error"
    assert unknown["message"] == "unknown variable KERNREG_STIRCT; did you mean KERNREG_STRICT?"
    # The rest of the inventory was still checked.
    assert data["checked"]["ops"] == 2


def test_check_reports_a_module_that_does_not_import() -> None:
    data = kernreg_json("-m", "clifx_raises", "-m", "clifx_basic", "check", expect=1)
    (module,) = problems(data, "module")
    assert module["message"] == (
        "importing module 'clifx_raises' failed: RuntimeError: engine set-up failed"
    )
    assert data["checked"]["ops"] == 2


def _write_distribution(root: Path, name: str, entry_point: str) -> None:
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[kernreg.kernels]\n{entry_point}\n")


def test_plugin_failures_and_conflicts(tmp_path: Path) -> None:
    _write_distribution(tmp_path, "clifx-plugin-a", "conflict_a = clifx_plugin_mods:register_a")
    _write_distribution(tmp_path, "clifx-plugin-b", "conflict_b = clifx_plugin_mods:register_b")
    _write_distribution(tmp_path, "clifx-plugin-c", "broken = clifx_plugin_mods:register_broken")
    env = {"KERNREG_PLUGINS": "clifx-plugin-a,clifx-plugin-b,clifx-plugin-c"}
    data = kernreg_json("check", env=env, path=(tmp_path,), expect=1)
    (conflict,) = problems(data, "plugin_conflict")
    assert conflict["op"] == "plug.op"
    assert conflict["backends"] == ["torch"]
    assert conflict["message"].startswith(
        "Conflicting kernel registration for op 'plug.op', backend 'torch'"
    )
    assert "neither runs until you choose" in conflict["message"]
    assert conflict["origins"][0].startswith(
        "entry point 'conflict_a' = clifx_plugin_mods:register_a (distribution clifx-plugin-a 1.0)"
    )
    assert conflict["origins"][1].startswith(
        "entry point 'conflict_b' = clifx_plugin_mods:register_b (distribution clifx-plugin-b 1.0)"
    )
    (broken,) = problems(data, "plugin")
    assert broken["message"].endswith("RuntimeError: plugin set-up failed")
    assert [p["name"] for p in data["plugins"]["loaded"]] == ["conflict_a", "conflict_b"]
    assert [p["name"] for p in data["plugins"]["failed"]] == ["broken"]
    # Strict plugin mode makes no difference to the check: it lists every failure.
    strict = kernreg_json(
        "check", env={**env, "KERNREG_STRICT_PLUGINS": "1"}, path=(tmp_path,), expect=1
    )
    assert [p["kind"] for p in strict["problems"]] == ["plugin_conflict", "plugin"]
    # list goes on, with one warning line per failed plugin and per conflict; neither
    # side's implementation of the disputed op runs.
    listed = kernreg("list", "--platform", "cpu", env=env, path=(tmp_path,))
    assert listed.returncode == 0, listed.stderr
    assert "plug.op" not in listed.stdout
    warnings = [w for w in listed.stderr.splitlines() if w.startswith("warning:")]
    assert len(warnings) == 2
    assert warnings[0].startswith("warning: kernreg skipped plugin")
    assert warnings[1].startswith("warning: kernreg plugin conflict: Conflicting kernel")
    assert listed.stderr.count("KERNREG_PLUGINS_DENY=clifx-plugin-b keeps clifx-plugin-a's") == 1


def test_every_configuration_error_is_found(tmp_path: Path) -> None:
    from kernreg.cli.check import config_without_errors

    config, errors = config_without_errors(
        {
            "KERNREG_CONFIG": str(tmp_path / "missing.toml"),
            "KERNREG_PIN": "garbage",
            "KERNREG_STRICT": "1",
        }
    )
    assert sorted(e.key for e in errors) == ["KERNREG_CONFIG", "KERNREG_PIN"]
    assert config.strict == ("*",)


# --- output machinery ----------------------------------------------------------------------


def test_rich_table_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kernreg.cli import _app

    monkeypatch.setattr(_app, "is_terminal", lambda: True)
    _app.print_table(("OP", "ORIGIN"), [["a.b", "[x.py:1]"]], title="title", styles=["bold"])
    out = capsys.readouterr().out
    assert "title" in out
    assert "a.b" in out
    assert "[x.py:1]" in out  # escaped, not taken for markup


def test_plain_table_alignment(capsys: pytest.CaptureFixture[str]) -> None:
    from kernreg.cli import _app

    _app.print_table(("A", "BB", "C"), [["xxx", "y", ""], ["x", "", "z"]])
    assert capsys.readouterr().out == "A    BB  C\nxxx  y\nx        z\n"


def test_command_modules_are_listed_in_one_tuple() -> None:
    from kernreg.cli import _app

    assert _app.COMMAND_MODULES[:2] == ("kernreg.cli.inventory", "kernreg.cli.check")
    group = _app.build_cli()
    assert {"list", "explain", "platform", "check"} <= set(group.commands)
    for name in _app.COMMAND_MODULES:
        module = importlib.import_module(name)
        assert all(group.commands[command.name] is command for command in module.COMMANDS)


# --- the op pack's inventory through the CLI: check, list --layers, plans -----------------


def test_check_names_each_origin_of_a_problem_once() -> None:
    # Below SM 8.0 no Triton kernel runs: the vLLM-layout rotary has its reference alone.
    proc = kernreg_cli("check", "--platform", "cuda:7.5", "--json", env={"KERNREG_STRICT": "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    problems = json.loads(proc.stdout)["problems"]
    assert problems, "the rotary's reference-only fallback is reported under strict mode"
    for problem in problems:
        assert len(problem["origins"]) == len(set(problem["origins"])), problem


def test_list_layers_fits_100_columns_and_wide_keeps_every_detail() -> None:
    narrow = kernreg_cli("list", "--layers", env={"COLUMNS": "100"})
    assert narrow.returncode == 0, narrow.stderr
    lines = narrow.stdout.splitlines()
    assert any("LlamaRMSNorm" in line for line in lines)
    assert max(len(line) for line in lines) <= 100, narrow.stdout
    wide = kernreg_cli("list", "--layers", "--wide", env={"COLUMNS": "100"})
    assert "kernreg_ops._layers:rmsnorm_args" in wide.stdout
    assert "_layers.py:" in wide.stdout


def test_check_reports_a_loaded_plan_that_decides_nothing_here(tmp_path: Path) -> None:
    plan = tmp_path / "gpu.json"
    locked = kernreg_cli("lock", "--platform", "cuda:9.0", "-o", str(plan))
    assert locked.returncode == 0, locked.stderr
    checked = kernreg_cli(
        "check", "--json", env={"KERNREG_LOCK": str(plan), "KERNREG_PLATFORM": "cpu"}
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    kinds = [p["kind"] for p in json.loads(checked.stdout)["problems"]]
    assert kinds == ["plan_unmatched"]
    on_gpu = kernreg_cli(
        "check", "--json", "--platform", "cuda:9.0", env={"KERNREG_LOCK": str(plan)}
    )
    assert "plan_unmatched" not in on_gpu.stdout


# --- bad input on the command line or in the environment: one line, a hint, the -----------
# documented exit status, never a traceback (each case in a fresh interpreter)


MODULES = {
    "hcli_basic": """
        import kernreg
        from kernreg import KernelSpec, register_kernel
        register_kernel(KernelSpec("hcli.norm", "torch", "hcli_basic:ref", reference=True))
        register_kernel(KernelSpec("hcli.norm", "triton", "hcli_basic:fast",
                                   requires=["cuda>=8.0"], priority=10))
        register_kernel(KernelSpec("hcli.tie", "torch", "hcli_basic:ref", reference=True))
        register_kernel(KernelSpec("hcli.tie", "a", "hcli_basic:fast", priority=1))
        register_kernel(KernelSpec("hcli.tie", "b", "hcli_basic:fast2", priority=1))
        def ref(x): return x
        def fast(x): return x
        def fast2(x): return x
    """,
    "hcli_raises": "raise RuntimeError('hcli_raises fails on import')\n",
    "hcli_syntax": "def broken(:\n",
    "hcli_conflict": """
        from kernreg import KernelSpec, register_kernel
        register_kernel(KernelSpec("hcli.c", "torch", "hcli_conflict:a", reference=True))
        register_kernel(KernelSpec("hcli.c", "torch", "hcli_conflict:b", reference=True))
    """,
    "hcli_badspec": """
        from kernreg import KernelSpec, register_kernel
        register_kernel(KernelSpec("hcli.bad", "torch", "no_colon_here"))
    """,
    "hcli_exit": "import sys\nsys.exit(5)\n",
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    for name, source in MODULES.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    (root / "bad.toml").write_text("strict = 3\n")
    (root / "binary.toml").write_bytes(b"\x7fELF\x02\x01\x01\x00")
    (root / "future.lock").write_text('{"kernreg_plan": 9, "fields": [], "entries": []}\n')
    (root / "truncated.lock").write_text('{\n  "kernreg_plan": 1,\n  "fields": ["op", "plat')
    return root


def run_kernreg(
    args: tuple[str, ...], env: Mapping[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    environ["KERNREG_PLUGINS"] = "none"
    environ["KERNREG_PLATFORM"] = "cpu"
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(cwd), environ.get("PYTHONPATH")]))
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "kernreg", *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )


M = ("-m", "hcli_basic")


#: (id, arguments, environment, exit status, what the error line names)
CASES: list[tuple[str, tuple[str, ...], dict[str, str], int, tuple[str, ...]]] = [
    # usage errors: exit 2, click's one "Error:" line plus "Try ... --help"
    ("platform-flag", (*M, "explain", "hcli.norm", "--platform", "cuda:"), {}, 2, ("'cuda:'",)),
    ("platform-flag-typo", (*M, "list", "--platform", "cuda:90"), {}, 2, ("'cuda:90'",)),
    ("dtype-flag", (*M, "explain", "hcli.norm", "--dtype", "bfloat17"), {}, 2, ("'bfloat17'",)),
    ("op-argument", (*M, "explain", "HCLI.norm"), {}, 2, ("'HCLI.norm'",)),
    ("op-argument-one-word", (*M, "explain", "norm"), {}, 2, ("'norm'",)),
    ("unknown-option", (*M, "list", "--platfrom", "cpu"), {}, 2, ("--platfrom",)),
    ("unknown-command", ("lst",), {}, 2, ("'lst'",)),
    ("missing-argument", ("explain",), {}, 2, ("'OP'",)),
    ("import-timeout", ("check", "--import-timeout", "-1"), {}, 2, ("-1",)),
    ("backend-flag", (*M, "explain", "hcli.norm", "--backend", "Cuda"), {}, 2, ("'Cuda'",)),
    # errors: exit 1, "error: ..." naming the input, then "hint: ..."
    ("unknown-op", (*M, "explain", "hcli.nope"), {}, 1, ("'hcli.nope'",)),
    ("unknown-backend", (*M, "explain", "hcli.norm", "--backend", "cuda"), {}, 1, ("'cuda'",)),
    ("ambiguous", (*M, "explain", "hcli.tie"), {}, 1, ("hcli.tie",)),
    ("module-missing", ("-m", "hcli_nope", "list"), {}, 1, ("'hcli_nope'",)),
    ("module-raises", ("-m", "hcli_raises", "list"), {}, 1, ("'hcli_raises'", "RuntimeError")),
    ("module-syntax", ("-m", "hcli_syntax", "list"), {}, 1, ("'hcli_syntax'", "SyntaxError")),
    ("module-exits", ("-m", "hcli_exit", "list"), {}, 1, ("'hcli_exit'", "SystemExit")),
    (
        "module-conflict",
        ("-m", "hcli_conflict", "list"),
        {},
        1,
        ("Conflicting kernel registration",),
    ),
    ("module-bad-spec", ("-m", "hcli_badspec", "list"), {}, 1, ("'no_colon_here'",)),
    ("config-file-value", (*M, "list"), {"KERNREG_CONFIG": "bad.toml"}, 1, ("bad.toml: strict",)),
    ("config-file-binary", (*M, "list"), {"KERNREG_CONFIG": "binary.toml"}, 1, ("KERNREG_CONFIG",)),
    ("config-file-missing", (*M, "list"), {"KERNREG_CONFIG": "nope.toml"}, 1, ("nope.toml",)),
    ("lock-future", (*M, "list"), {"KERNREG_LOCK": "future.lock"}, 1, ("KERNREG_LOCK", "format 9")),
    ("lock-truncated", (*M, "list"), {"KERNREG_LOCK": "truncated.lock"}, 1, ("KERNREG_LOCK",)),
    ("lock-check-missing", (*M, "lock", "--check", "-o", "none.lock"), {}, 1, ("none.lock",)),
]


#: One bad value per variable, through the command that reads the configuration first.
BAD_VALUES = {
    "KERNREG_PLATFORM": "cuda:90",
    "KERNREG_BACKEND": "Triton",
    "KERNREG_PIN": "hcli.norm",
    "KERNREG_DENY": "Triton",
    "KERNREG_STRICT": "2",
    "KERNREG_DEMOTE": "2",
    "KERNREG_STATS_FILE": " ",
    "KERNREG_TRAITS": "Fast",
    "KERNREG_PLUGINS": "bad name",
    "KERNREG_PLUGINS_DENY": "bad!",
    "KERNREG_STRICT_PLUGINS": "sometimes",
    "KERNREG_LOCK": "missing.lock",
    "KERNREG_POLICY": "fastest",
    "KERNREG_CACHE_DIR": " ",
    "KERNREG_CONFIG": "missing.toml",
    "KERNREG_ASSUME_PACKAGES": "triton>=3.4",
}


CASES += [
    (f"env-{var}", (*M, "list"), {var: value}, 1, (var,)) for var, value in BAD_VALUES.items()
]


def test_every_variable_has_a_bad_value() -> None:
    assert set(BAD_VALUES) == set(ENV_VARS)


@pytest.mark.parametrize(
    ("args", "env", "status", "named"),
    [pytest.param(a, e, s, n, id=name) for name, a, e, s, n in CASES],
)
def test_bad_input_is_one_line_a_hint_and_the_documented_status(
    workdir: Path, args: tuple[str, ...], env: dict[str, str], status: int, named: tuple[str, ...]
) -> None:
    proc = run_kernreg(args, env, workdir)
    err = proc.stderr
    assert proc.returncode == status, err
    assert "Traceback" not in err
    assert "Traceback" not in proc.stdout
    lines = [line for line in err.splitlines() if line.strip()]
    if status == 2:
        errors = [line for line in lines if line.startswith("Error: ")]
        assert len(errors) == 1, err
        assert any(line.startswith("Try '") and "--help" in line for line in lines), err
    else:
        errors = [line for line in lines if line.startswith("error: ")]
        assert len(errors) == 1, err
        assert lines[0] == errors[0], err
        assert any(line.startswith("hint: ") for line in lines), err
        # Only the documented extra lines: a conflict's origins.
        others = [line for line in lines if not line.startswith(("error: ", "hint: "))]
        assert all(
            line.startswith("  registered") or line.startswith("  To override") for line in others
        ), err
    for text in named:
        assert text in errors[0], err


def test_debug_adds_the_traceback(workdir: Path) -> None:
    proc = run_kernreg(("--debug", "-m", "hcli_raises", "list"), {}, workdir)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr
    assert "error: importing module 'hcli_raises' failed" in proc.stderr


def test_check_reports_every_bad_variable_at_once_and_exits_1(workdir: Path) -> None:
    env = {var: value for var, value in BAD_VALUES.items() if var != "KERNREG_CONFIG"}
    proc = run_kernreg(("check",), env, workdir)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    config_lines = [line for line in proc.stdout.splitlines() if "[config]" in line]
    assert sorted(
        line.split("invalid configuration ")[1].split("=")[0] for line in config_lines
    ) == sorted(env)


# --- every device of a mixed host is checked and locked --------------------------------------

MIXED_HOST_MODULE = """
from kernreg import KernelSpec, register_kernel
register_kernel(KernelSpec("mixed.op", "torch", "json:dumps", reference=True))
register_kernel(KernelSpec("mixed.op", "hopper", "json:loads", requires=["cuda>=9.0"], priority=1))
register_kernel(KernelSpec("mixed.op", "old_a", "json:loads", requires=["cuda>=7.0,<=7.9"], priority=1))
register_kernel(KernelSpec("mixed.op", "old_b", "json:loads", requires=["cuda>=7.0,<=7.9"], priority=1))
"""


@pytest.mark.parametrize("devices", ["cuda:9.0,7.5", "cuda:7.5,9.0", "cuda:9.0,9.0,7.5"])
def test_check_and_lock_decide_on_every_device_of_a_mixed_host(
    tmp_path: Path, devices: str
) -> None:
    (tmp_path / "mixed_host.py").write_text(MIXED_HOST_MODULE)
    data = kernreg_json(
        "-m", "mixed_host", "check", "--platform", devices, path=(tmp_path,), expect=1
    )
    (ambiguous,) = problems(data, "platform_ambiguous")
    assert "on cuda:7.5" in ambiguous["message"]
    assert "old_a, old_b tie at priority 1" in ambiguous["message"]
    lock = tmp_path / "plan.json"
    written = kernreg(
        "-m", "mixed_host", "lock", "--platform", devices, "-o", str(lock), path=(tmp_path,)
    )
    assert written.returncode == 0, written.stderr
    planned = {e.platform: e.label for e in SelectionPlan.load(lock).entries()}
    assert planned == {"cuda:9.0": "hopper", "cuda:7.5": "<ambiguous>"}


# --- a process-state when predicate that raises ---------------------------------------------

RAISING_WHEN_MODULE = """
from kernreg import KernelSpec, register_kernel

def gpu_ready():
    raise OSError("no /dev/nvidia0")

register_kernel(KernelSpec("whenfx.op", "torch", "json:dumps", reference=True))
register_kernel(KernelSpec("whenfx.op", "fast", "json:loads", when=gpu_ready, priority=1))
"""


def test_a_raising_process_state_predicate_is_named_and_check_reports_it(tmp_path: Path) -> None:
    (tmp_path / "raising_when.py").write_text(RAISING_WHEN_MODULE)
    for args in (
        ("explain", "whenfx.op"),
        ("lock", "-o", str(tmp_path / "plan.json")),
        ("list", "--wide"),
    ):
        proc = kernreg("-m", "raising_when", *args, path=(tmp_path,), env={"COLUMNS": "400"})
        text = proc.stdout + proc.stderr
        assert "unexpected" not in text
        assert "when predicate 'raising_when:gpu_ready'" in text, text
        assert "op 'whenfx.op', implementation 'fast'" in text
        assert "OSError: no /dev/nvidia0" in text
    data = kernreg_json("-m", "raising_when", "check", path=(tmp_path,), expect=1)
    (problem,) = problems(data, "when_error")
    assert problem["op"] == "whenfx.op"
    assert problem["backends"] == ["fast"]
    assert "raised OSError: no /dev/nvidia0" in problem["message"]


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (("explain", "nosuch.op"), 1, "No kernels registered for op 'nosuch.op'"),
        (("explain", "demo.op", "--platform", "h100"), 2, "did you mean 'cuda:9.0'"),
        (("list", "--dtype", "float33"), 2, "float33"),
        (("lock", "--check", "missing.lock"), 1, "missing.lock"),
    ],
)
def test_a_failed_command_under_json_still_writes_json(
    args: tuple[str, ...], code: int, words: str
) -> None:
    proc = kernreg(*args, "--json")
    assert proc.returncode == code, proc.stdout + proc.stderr
    error = json.loads(proc.stdout)
    assert error["exit_code"] == code
    assert words in error["error"]
    assert words in proc.stderr  # people still read it on stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [("platform", "--json"), ("explain", "nosuch.op", "--json")])
def test_json_to_an_unwritable_stdout_is_one_error_on_stderr(args: tuple[str, ...]) -> None:
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "kernreg", *args],
            cwd=FIXTURES,
            env=make_env(),
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_platform_given_twice_is_checked_once() -> None:
    # A CI matrix that joins lists repeats a platform, in one spelling or another: each
    # problem is still one problem.
    once = kernreg_json("-m", "clifx_ambiguous", "check", "--platform", "cuda:9.0", expect=1)
    for twice in (("cuda:9.0", "cuda:9.0"), ("cuda:9.0", "cuda:sm_90")):
        args = [arg for platform in twice for arg in ("--platform", platform)]
        again = kernreg_json("-m", "clifx_ambiguous", "check", *args, expect=1)
        assert again["problems"] == once["problems"]
        assert again["checked"]["platforms"] == ["cuda:9.0"]


def test_a_mixed_host_is_not_taken_for_its_first_device() -> None:
    data = kernreg_json(
        "check", "--platform", "cuda:8.0", "--platform", "cuda:8.0,9.0", "--platform", "cpu"
    )
    assert len(data["checked"]["platforms"]) == 3  # the mixed host's str() is its first device


def test_a_required_trait_no_implementation_declares_is_reported() -> None:
    # A misspelt KERNREG_TRAITS makes every op ineligible; check must say why, not "clean".
    env = {"KERNREG_TRAITS": "determinstic"}
    data = kernreg_json("-m", "clifx_basic", "check", env=env)
    (problem,) = [p for p in data["problems"] if p["kind"] == "traits_unmatched"]
    assert problem["severity"] == "warning"
    assert "'determinstic'" in problem["message"]
    assert "did you mean 'deterministic'?" in problem["message"]
    listed = kernreg("-m", "clifx_basic", "list", env=env)
    assert "trait 'determinstic'" in listed.stderr

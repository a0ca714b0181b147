"""What a new user meets first on the command line: readable tables, suggestions for
misspelt op ids, the plan file as an argument, conflicts that say how to resolve them,
one name for the reference, and errors that name the path at fault.

Every command runs in a subprocess, as users run it (see tests/test_cli.py).
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.test_cli import FIXTURES, _write_distribution, kernreg, make_env, row_for

from _support import kernreg_cli
from kernreg import KernelRegistry, KernelSpec, OpNotFoundError
from kernreg.errors import close_op_ids
from kernreg.plan import SelectionPlan

WIDE = ("-m", "clifx_wide")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def table_lines(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "IMPLEMENTATION" in line)
    return [line for line in lines[start:] if line.strip() and not line.startswith("note:")]


# --- list fits the terminal ----------------------------------------------------------------


@pytest.mark.parametrize("columns", [80, 100, 120, 160])
def test_list_fits_the_width_in_columns(columns: int) -> None:
    proc = kernreg(*WIDE, "list", "--platform", "cpu", env={"COLUMNS": str(columns)})
    assert proc.returncode == 0, proc.stderr
    assert max(len(line) for line in proc.stdout.splitlines()) <= columns, proc.stdout
    rows = table_lines(proc.stdout)[1:]
    assert len(rows) == 9  # one line per implementation: nothing wrapped
    for op in ("layernorm.rmsnorm", "attention.paged_decode_grouped"):
        assert sum(op in row.split() for row in rows) == 3  # op ids are never cut


def test_list_fits_100_columns_without_a_terminal_or_columns() -> None:
    proc = kernreg(*WIDE, "list", "--platform", "cpu", env={"COLUMNS": None})
    assert proc.returncode == 0, proc.stderr
    assert max(len(line) for line in proc.stdout.splitlines()) <= 100


def test_list_origins_are_short() -> None:
    env = make_env({"COLUMNS": "160"})
    proc = subprocess.run(
        [sys.executable, "-m", "kernreg", *WIDE, "list", "--platform", "cpu"],
        cwd=Path("/"),  # far from the fixture: the origin must not be an absolute path
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert str(FIXTURES) not in proc.stdout
    assert "clifx_wide.py:" in proc.stdout


def test_list_wide_and_json_keep_every_detail() -> None:
    wide = kernreg(*WIDE, "list", "--platform", "cpu", "--wide", env={"COLUMNS": "80"})
    assert wide.returncode == 0, wide.stderr
    header = table_lines(wide.stdout)[0].split()
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
    assert "batch_invariant,cuda_graph_safe,deterministic" in wide.stdout
    assert "needs device cuda>=8.0, platform is cpu" in wide.stdout
    data = json.loads(kernreg(*WIDE, "list", "--platform", "cpu", "--json").stdout)
    triton = data["ops"][0]["implementations"][0]
    assert triton["label"] == "triton/persistent_v2"
    assert triton["reasons"][0] == "needs device cuda>=8.0, platform is cpu"


def test_list_fits_a_real_terminal() -> None:
    # Rich renders on a terminal: run under a pseudo-terminal 100 columns wide.
    main, child = pty.openpty()
    env = make_env({"COLUMNS": "100", "LINES": "60", "TERM": "xterm"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernreg", *WIDE, "list", "--platform", "cpu"],
        cwd=FIXTURES,
        env=env,
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
    assert proc.wait(timeout=120) == 0
    os.close(main)
    text = ANSI.sub("", b"".join(chunks).decode())
    lines = [line for line in text.splitlines() if line.strip()]
    assert max(len(line) for line in lines) <= 100, text
    assert sum("attention.paged_decode_grouped" in line for line in lines) == 3, text


def test_list_without_dtype_marks_what_real_calls_run() -> None:
    # aten accepts every dtype real calls use (float32, float16, bfloat16): it runs, not
    # the reference, though the reference would be chosen for a call of unknown dtypes.
    data = json.loads(
        kernreg(*WIDE, "list", "layernorm.rmsnorm", "--platform", "cpu", "--json").stdout
    )
    (op,) = data["ops"]
    selection = {i["label"]: i["selection"] for i in op["implementations"]}
    assert selection == {
        "triton/persistent_v2": "rejected",  # rejected on the device, whatever the dtype
        "aten": "chosen (priority)",
        "torch": "eligible",
    }
    assert op["chosen"] == "aten"
    assert op["by_dtype"] == {
        d: {"chosen": "aten", "rule": "priority"} for d in ("float32", "float16", "bfloat16")
    }
    proc = kernreg(*WIDE, "list", "layernorm.rmsnorm", "--platform", "cpu", env={"COLUMNS": "100"})
    assert proc.stdout.startswith(
        "platform cpu [--platform]; dtypes float32, float16, bfloat16, each decided"
    )
    assert row_for(proc.stdout, "layernorm.rmsnorm", "aten").startswith("*")
    assert not row_for(proc.stdout, "layernorm.rmsnorm", "(reference)").startswith("*")
    # With the dtype, list and explain agree on the choice.
    for dtype in ("bfloat16", "float64"):
        listed = kernreg_json_list("layernorm.rmsnorm", "--dtype", dtype)
        explained = json.loads(
            kernreg(
                *WIDE,
                "explain",
                "layernorm.rmsnorm",
                "--platform",
                "cpu",
                "--dtype",
                dtype,
                "--json",
            ).stdout
        )
        assert listed["ops"][0]["chosen"] == explained["chosen"] == "aten"


def kernreg_json_list(*args: str) -> dict[str, object]:
    proc = kernreg(*WIDE, "list", *args, "--platform", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


# --- did you mean ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("layernorm.rmsnrom", "'layernorm.rmsnorm'"),
        ("layernorm.rms_norm", "'layernorm.rmsnorm'"),
        ("layer_norm.rmsnorm", "'layernorm.rmsnorm'"),
        ("attention.paged_decode", "'attention.paged_decode_grouped'"),
    ],
)
def test_explain_suggests_the_op_meant(typed: str, meant: str) -> None:
    proc = kernreg(*WIDE, "explain", typed, "--platform", "cpu")
    assert proc.returncode == 1
    first = proc.stderr.splitlines()[0]
    assert first == f"error: No kernels registered for op '{typed}'; did you mean {meant}?"


def test_explain_suggests_the_op_for_a_bare_name() -> None:
    proc = kernreg(*WIDE, "explain", "rmsnorm", "--platform", "cpu")
    assert proc.returncode == 2
    assert "invalid op id 'rmsnorm'" in proc.stderr
    assert "did you mean 'layernorm.rmsnorm'?" in proc.stderr
    # A module named after the argument still counts: suggestions see what -m registered.
    late = kernreg("explain", "rmsnorm", *WIDE)
    assert late.returncode == 2
    assert "did you mean 'layernorm.rmsnorm'?" in late.stderr


def test_nothing_close_gives_no_suggestion() -> None:
    proc = kernreg(*WIDE, "explain", "zzz.qqq", "--platform", "cpu")
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[0] == "error: No kernels registered for op 'zzz.qqq'"


def test_python_errors_suggest_the_op_meant() -> None:
    registry = KernelRegistry()
    registry.register(KernelSpec("layernorm.rmsnorm", "torch", "m:f", reference=True))
    registry.register(KernelSpec("activation.silu_and_mul", "torch", "m:g", reference=True))
    with pytest.raises(OpNotFoundError) as info:
        registry.get("layernorm.rmsnrom")
    assert str(info.value) == (
        "No kernels registered for op 'layernorm.rmsnrom'; did you mean 'layernorm.rmsnorm'?"
    )
    assert info.value.suggestions == ("layernorm.rmsnorm",)
    with pytest.raises(OpNotFoundError, match=r"did you mean 'activation\.silu_and_mul'\?"):
        registry.explain("act.silu_and_mul")
    with pytest.raises(OpNotFoundError, match=r"did you mean 'layernorm\.rmsnorm'\?"):
        registry.get_backend("norm.rmsnorm", "torch")
    with pytest.raises(OpNotFoundError) as unrelated:
        registry.get("zzz.qqq")
    assert "did you mean" not in str(unrelated.value)
    assert unrelated.value.suggestions == ()


@pytest.mark.parametrize(
    ("typed", "expected"),
    [
        ("layernorm.rmsnrom", ["layernorm.rmsnorm"]),
        ("rmsnorm", ["layernorm.rmsnorm"]),
        ("rmsnrom", ["layernorm.rmsnorm"]),
        ("LAYERNORM.RMSNORM", ["layernorm.rmsnorm"]),
        ("layernorm", ["layernorm.fused_add_rmsnorm", "layernorm.rmsnorm"]),
        ("rotary", ["embedding.rotary"]),
        ("foo.bar", []),
        ("", []),
    ],
)
def test_close_op_ids(typed: str, expected: list[str]) -> None:
    known = [
        "layernorm.rmsnorm",
        "layernorm.fused_add_rmsnorm",
        "activation.silu_and_mul",
        "embedding.rotary",
    ]
    assert close_op_ids(typed, known) == expected


def test_list_with_a_group_name_hints_the_glob() -> None:
    proc = kernreg(*WIDE, "list", "layernorm", "--platform", "cpu")
    assert proc.returncode == 1
    assert "error: no op matches 'layernorm'" in proc.stderr
    assert "try 'layernorm.*'" in proc.stderr
    misspelt = kernreg(*WIDE, "list", "layernorm.rmsnrom", "--platform", "cpu")
    assert misspelt.returncode == 1
    assert "did you mean 'layernorm.rmsnorm'?" in misspelt.stderr
    assert kernreg(*WIDE, "list", "layernorm.*", "--platform", "cpu").returncode == 0
    assert kernreg(*WIDE, "list", "nothing.*", "--json").returncode == 1


# --- lock -----------------------------------------------------------------------------------


def test_lock_takes_the_plan_file_as_an_argument(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    wrote = kernreg(*WIDE, "lock", str(plan), "--platform", "cpu")
    assert wrote.returncode == 0, wrote.stderr
    assert plan.exists()
    checked = kernreg(*WIDE, "lock", "--check", str(plan))
    assert checked.returncode == 0, checked.stderr
    assert f"{plan}: up to date" in checked.stdout
    with_o = kernreg(*WIDE, "lock", "--check", "-o", str(plan))
    assert with_o.returncode == 0, with_o.stderr
    drift = kernreg("-m", "clifx_basic", "lock", "--check", str(plan))
    assert drift.returncode == 1
    both = kernreg(*WIDE, "lock", str(plan), "-o", str(tmp_path / "other.json"))
    assert both.returncode == 2
    assert "two plan files" in both.stderr


def test_lock_to_a_dash_writes_the_plan_to_stdout_not_a_file_named_dash(tmp_path: Path) -> None:
    for argv in (("lock", "-"), ("lock", "-o", "-")):
        proc = kernreg_cli(*argv, "--platform", "cpu", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert list(tmp_path.iterdir()) == []
        assert len(SelectionPlan.from_json(proc.stdout)) > 0
    both = kernreg_cli("lock", "-", "--json", cwd=tmp_path)
    assert both.returncode == 2
    assert "--json" in both.stderr


def test_lock_check_of_a_dash_reads_the_plan_from_stdin() -> None:
    written = kernreg(*WIDE, "lock", "-", "--platform", "cpu")
    assert written.returncode == 0, written.stderr
    other = kernreg("-m", "clifx_basic", "lock", "-", "--platform", "cpu").stdout
    for plan, code, said in (
        (written.stdout, 0, "-: up to date"),
        (other, 1, "decision(s) drifted"),
        ("{}", 1, "invalid selection plan <stdin>: not a kernreg plan"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "kernreg", *WIDE, "lock", "--check", "-"],
            input=plan,
            cwd=FIXTURES,
            env=make_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == code, proc.stderr
        assert said in proc.stdout + proc.stderr


def test_lock_check_of_a_missing_file_names_both_spellings(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    proc = kernreg(*WIDE, "lock", "--check", str(missing))
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"error: no plan at {missing}",
        f"hint: write one with `kernreg lock {missing}` (or `-o {missing}`)",
    ]


@pytest.mark.parametrize("where", ["missing-folder", "folder", "read-only"])
def test_lock_to_a_path_it_cannot_write_is_one_clear_line(tmp_path: Path, where: str) -> None:
    if where == "missing-folder":
        target = tmp_path / "no" / "such" / "dir" / "plan.json"
    elif where == "folder":
        target = tmp_path
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o500)
        target = folder / "plan.json"
    proc = kernreg(*WIDE, "lock", "-o", str(target), "--platform", "cpu")
    assert proc.returncode == 1
    first = proc.stderr.splitlines()[0]
    assert first.startswith(f"error: cannot write the plan to {target}: ")
    assert ".tmp-" not in proc.stderr
    assert "unexpected" not in proc.stderr
    assert "--debug" not in proc.stderr
    assert list(tmp_path.rglob("*.tmp-*")) == []


def test_lock_check_of_a_folder_is_a_clear_error(tmp_path: Path) -> None:
    proc = kernreg(*WIDE, "lock", "--check", str(tmp_path))
    assert proc.returncode == 1
    assert "unexpected" not in proc.stderr
    assert str(tmp_path) in proc.stderr.splitlines()[0]


def test_lock_help_says_the_platform_replaces_the_detected_one() -> None:
    proc = kernreg("lock", "--help", env={"COLUMNS": "200"})
    assert proc.returncode == 0
    line = next(line for line in proc.stdout.splitlines() if "--platform" in line)
    assert "instead of the detected one" in line
    assert "Also" not in line
    assert "[FILE]" in proc.stdout.splitlines()[0]


# --- plugin conflicts -----------------------------------------------------------------------


def _two_conflicting_plugins(tmp_path: Path) -> dict[str, str]:
    _write_distribution(tmp_path, "clifx-plugin-a", "conflict_a = clifx_plugin_mods:register_a")
    _write_distribution(tmp_path, "clifx-plugin-b", "conflict_b = clifx_plugin_mods:register_b")
    return {"KERNREG_PLUGINS": "clifx-plugin-a,clifx-plugin-b"}


def test_a_plugin_conflict_names_both_distributions_and_the_fix(tmp_path: Path) -> None:
    env = _two_conflicting_plugins(tmp_path)
    proc = kernreg("list", "--platform", "cpu", env=env, path=(tmp_path,))
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "distribution clifx-plugin-b conflicts with distribution clifx-plugin-a" in err
    fix = re.search(r"KERNREG_PLUGINS_DENY=(\S+) keeps clifx-plugin-a's", err)
    assert fix is not None, err
    # The value given resolves it: no warning, and clifx-plugin-a's implementation stays.
    fixed = kernreg(
        "list",
        "--platform",
        "cpu",
        env={**env, "KERNREG_PLUGINS_DENY": fix.group(1)},
        path=(tmp_path,),
    )
    assert fixed.returncode == 0
    assert fixed.stderr == ""
    assert "clifx-plugin-a:" in fixed.stdout


def test_a_plugin_conflict_in_strict_mode_names_both_and_the_fix(tmp_path: Path) -> None:
    env = {**_two_conflicting_plugins(tmp_path), "KERNREG_STRICT_PLUGINS": "1"}
    proc = kernreg("list", "--platform", "cpu", env=env, path=(tmp_path,))
    assert proc.returncode == 1
    assert "clifx-plugin-a" in proc.stderr
    assert "clifx-plugin-b" in proc.stderr
    hint = proc.stderr.splitlines()[-1]
    assert hint.startswith("hint: KERNREG_PLUGINS_DENY=clifx-plugin-b keeps clifx-plugin-a's")
    # A deny list already set is kept in the value to use.
    kept = kernreg(
        "list",
        "--platform",
        "cpu",
        env={**env, "KERNREG_PLUGINS_DENY": "other-dist"},
        path=(tmp_path,),
    )
    assert "KERNREG_PLUGINS_DENY=other-dist,clifx-plugin-b keeps" in kept.stderr


# --- one label for the reference ------------------------------------------------------------


def test_the_reference_has_one_label_in_list_explain_and_python() -> None:
    listed = kernreg(*WIDE, "list", "--platform", "cpu", "--wide")
    explained = kernreg(*WIDE, "explain", "layernorm.rmsnorm", "--platform", "cpu")
    registry = KernelRegistry()
    registry.register(KernelSpec("demo.op", "torch", "m:f", reference=True))
    text = str(registry.explain("demo.op", platform="cpu"))
    for output in (listed.stdout, explained.stdout, text):
        assert "torch (reference)" in output
        assert "(ref)" not in output
        assert "[reference]" not in output


def test_origins_follow_the_current_directory_within_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kernreg.cli._app import format_origin, short_origin
    from kernreg.spec import Origin

    origin = Origin(str(tmp_path / "pkg" / "mod.py"), 7)
    monkeypatch.chdir(tmp_path)
    assert format_origin(origin) == "pkg/mod.py:7"
    assert short_origin(origin) == "pkg/mod.py:7"
    monkeypatch.chdir("/")
    assert format_origin(origin) == f"{tmp_path}/pkg/mod.py:7"
    assert short_origin(origin) == "mod.py:7"
    plugin = Origin("/site-packages/my_kernels/plugin.py", 12, "my-kernels", "1.2")
    assert short_origin(plugin) == "my-kernels:plugin.py:12"


def test_a_seed_no_generator_can_take_is_a_usage_error() -> None:
    proc = kernreg("parity", "layernorm.rmsnorm", "--seed", "99999999999999999999999")
    assert proc.returncode == 2
    assert "Invalid value for '--seed'" in proc.stderr


@pytest.mark.parametrize("columns", [80, 100, 120, 160])
def test_the_operator_pack_lists_within_the_width(columns: int) -> None:
    pytest.importorskip("kernreg_ops")
    proc = kernreg(
        "list", "--platform", "cpu", env={"KERNREG_PLUGINS": None, "COLUMNS": str(columns)}
    )
    assert proc.returncode == 0, proc.stderr
    assert max(len(line) for line in proc.stdout.splitlines()) <= columns, proc.stdout
    rows = [line for line in table_lines(proc.stdout)[1:] if "layernorm.rmsnorm" in line.split()]
    assert len(rows) == 4
    (aten,) = [row for row in rows if "aten" in row.split()]
    assert aten.startswith("*")  # what every float32/float16/bfloat16 call on a CPU runs
    (reference,) = [row for row in rows if "(reference)" in row]
    assert reference.split()[0] == "layernorm.rmsnorm"  # not marked as running
    if columns >= 100:
        assert aten.endswith("chosen (priority)")
    if columns >= 120:
        assert "kernreg-ops" in aten  # the origin: which distribution registered it
    else:
        assert "note: ORIGIN" in proc.stdout  # left out, and said so
    assert "site-packages" not in proc.stdout
    assert "/src/kernreg_ops/" not in proc.stdout


def test_explain_on_the_command_line_says_pass_dtype_in_cli_words() -> None:
    proc = kernreg(
        *WIDE, "explain", "layernorm.rmsnorm", "--platform", "cpu", env={"COLUMNS": "250"}
    )
    assert proc.returncode == 0, proc.stderr
    (aten,) = [line for line in proc.stdout.splitlines() if line.split()[1:2] == ["aten"]]
    assert "the call's dtypes are unknown (pass --dtype)" in aten
    assert "dtypes=" not in proc.stdout


def test_two_plugins_with_a_reference_each_name_both_and_the_fix(tmp_path: Path) -> None:
    _write_distribution(tmp_path, "refs-one", "first = clifx_plugin_refs:register_first")
    _write_distribution(tmp_path, "refs-two", "second = clifx_plugin_refs:register_second")
    env = {"KERNREG_PLUGINS": "refs-one,refs-two"}
    proc = kernreg("list", "--platform", "cpu", env=env, path=(tmp_path,))
    assert proc.returncode == 0, proc.stderr
    assert "Op 'refs.op' already has a reference implementation 'torch'" in proc.stderr
    assert "distribution refs-two conflicts with distribution refs-one" in proc.stderr
    assert "KERNREG_PLUGINS_DENY=refs-two keeps refs-one's implementation" in proc.stderr


def test_tune_show_with_a_misspelt_op_suggests_the_op(tmp_path: Path) -> None:
    env = {"KERNREG_CACHE_DIR": str(tmp_path)}
    proc = kernreg(*WIDE, "tune", "layernorm.rmsnrom", "--show", env=env)
    assert proc.returncode == 1
    assert "did you mean 'layernorm.rmsnorm'?" in proc.stderr.splitlines()[0]
    known = kernreg(*WIDE, "tune", "layernorm.rmsnorm", "--show", env=env)
    assert known.returncode == 0, known.stderr
    assert known.stdout.splitlines()[-1] == "0 entries"


def test_tune_show_lists_an_empty_store_without_creating_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {"KERNREG_CACHE_DIR": str(cache)}
    shown = kernreg(*WIDE, "tune", "--show", env=env)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[-1] == "0 entries"
    as_json = kernreg(*WIDE, "tune", "--show", "--json", env=env)
    assert json.loads(as_json.stdout)["entries"] == []
    assert not cache.exists()  # listing is reading: no directory, no database, no lock file


def test_check_gives_the_deny_value_for_a_plugin_conflict(tmp_path: Path) -> None:
    env = _two_conflicting_plugins(tmp_path)
    proc = kernreg("check", "--json", env=env, path=(tmp_path,))
    assert proc.returncode == 1
    (conflict,) = [p for p in json.loads(proc.stdout)["problems"] if p["kind"] == "plugin_conflict"]
    assert conflict["message"].endswith(
        "; to resolve: KERNREG_PLUGINS_DENY=clifx-plugin-b keeps clifx-plugin-a's implementation "
        "(KERNREG_PLUGINS_DENY=clifx-plugin-a keeps clifx-plugin-b's)"
    )


# --- configured pins that match nothing ------------------------------------------------------


@pytest.mark.parametrize(
    ("pin", "expected"),
    [
        ("demo.rmsnrom=triton", "matches no registered op; did you mean 'demo.rmsnorm'?"),
        ("other.*=triton", "matches no registered op"),
        ("demo.*=trtion", "no op it matches has a 'trtion' implementation (they have: "),
        ("demo.rmsnorm=cuda/sm80", "no op it matches has a 'cuda/sm80' implementation"),
    ],
)
def test_a_pin_that_matches_nothing_is_a_warning(pin: str, expected: str) -> None:
    listing = kernreg("-m", "clifx_basic", "list", "--platform", "cpu", env={"KERNREG_PIN": pin})
    assert listing.returncode == 0, listing.stderr
    assert f"warning: pin '{pin}' (KERNREG_PIN)" in listing.stderr
    assert expected in listing.stderr
    check = kernreg("-m", "clifx_basic", "check", "--json", env={"KERNREG_PIN": pin})
    found = [p for p in json.loads(check.stdout)["problems"] if p["kind"] == "pin_unmatched"]
    assert len(found) == 1, check.stdout
    assert expected in found[0]["message"]
    assert found[0]["severity"] == "warning"


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("KERNREG_DENY", "trtion", "deny rule '*=trtion' (KERNREG_DENY): no op it matches has a"),
        ("KERNREG_DENY", "demo.*=cuda/sm80", "deny rule 'demo.*=cuda/sm80' (KERNREG_DENY): no op"),
        ("KERNREG_DENY", "dmeo.*=triton", "deny rule 'dmeo.*=triton' (KERNREG_DENY) matches no"),
        ("KERNREG_BACKEND", "trtion", "KERNREG_BACKEND=trtion: no op it matches has a 'trtion'"),
    ],
)
def test_a_deny_rule_or_backend_switch_that_names_nothing_is_a_warning(
    variable: str, value: str, expected: str
) -> None:
    # Misspelt, the switch that turns a broken kernel off (or one on) does nothing at all.
    check = kernreg("-m", "clifx_basic", "check", "--json", env={variable: value})
    found = [p for p in json.loads(check.stdout)["problems"] if p["kind"] == "pin_unmatched"]
    assert [p["message"][: len(expected)] for p in found] == [expected], check.stdout
    assert found[0]["severity"] == "warning"
    matching = {"KERNREG_DENY": "demo.*=cuda/sm90", "KERNREG_BACKEND": "triton"}[variable]
    quiet = kernreg("-m", "clifx_basic", "check", "--json", env={variable: matching})
    assert "pin_unmatched" not in {p["kind"] for p in json.loads(quiet.stdout)["problems"]}


@pytest.mark.parametrize(
    ("pin", "deny", "expected"),
    [
        ("demo.rmsnorm=triton", "triton", "demo.rmsnorm (triton) runs although denied"),
        ("demo.*=cuda", "demo.*=cuda/sm90", "demo.rmsnorm (cuda/sm90) runs although denied"),
        ("demo.rmsnorm=cuda/sm90", "cuda/other", None),
        ("demo.gelu=torch", "triton", None),
    ],
)
def test_a_pin_that_a_deny_rule_contradicts_is_a_warning(
    pin: str, deny: str, expected: str | None
) -> None:
    env = {"KERNREG_PIN": pin, "KERNREG_DENY": deny}
    check = kernreg("-m", "clifx_basic", "check", "--json", env=env)
    found = [p for p in json.loads(check.stdout)["problems"] if p["kind"] == "pin_denied"]
    if expected is None:
        assert found == [], check.stdout
        return
    assert [p["severity"] for p in found] == ["warning"], check.stdout
    assert found[0]["message"].startswith(f"pin '{pin}' (KERNREG_PIN) wins over deny rule")
    assert expected in found[0]["message"]
    listing = kernreg("-m", "clifx_basic", "list", "--platform", "cpu", env=env)
    assert expected in listing.stderr


@pytest.mark.parametrize(
    "pin", ["demo.rmsnorm=triton", "demo.*=torch", "demo.rmsnorm=cuda/sm90", "demo.*=torch/"]
)
def test_a_pin_that_matches_says_nothing(pin: str) -> None:
    check = kernreg("-m", "clifx_basic", "check", "--json", env={"KERNREG_PIN": pin})
    kinds = {p["kind"] for p in json.loads(check.stdout)["problems"]}
    assert "pin_unmatched" not in kinds
    listing = kernreg("-m", "clifx_basic", "list", "--platform", "cpu", env={"KERNREG_PIN": pin})
    assert "warning: pin" not in listing.stderr

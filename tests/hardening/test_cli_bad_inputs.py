"""Bad input on the command line or in the environment: one line, a hint, the documented
exit status, never a traceback. Every case runs ``python -m kernreg`` in a fresh
interpreter, as users run it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest

from kernreg.config import ENV_VARS

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

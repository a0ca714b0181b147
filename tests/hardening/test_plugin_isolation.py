"""Plugins that hang or crash on import, and plugins that touch each other's specs.

Covered elsewhere, and referenced from RELIABILITY.md: a plugin registering over another
one's spec without ``replace=True`` is refused naming both distributions
(tests/test_plugins.py::test_conflict_between_plugins_names_both_distributions_and_undoes_the_loser),
allow and deny lists apply before plugin code runs
(tests/test_plugins.py::test_allow_and_deny_lists_apply_before_any_plugin_code_runs), and
targets that hang or crash are reported by ``kernreg check --import-targets``
(tests/test_cli.py::test_check_import_targets_survives_crashes_and_hangs). Here: the
plugins themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

HANG = "hard-plugin-hang"
CRASH = "hard-plugin-crash"
GOOD = "hard-plugin-good"
THIEF = "hard-plugin-thief"

SOURCES = {
    "hard_plugin_hang": """
        import time
        time.sleep(3600)
        def register(registry):
            pass
    """,
    "hard_plugin_crash": """
        import os
        os._exit(7)
    """,
    "hard_plugin_good": """
        from kernreg import KernelSpec
        def register(registry):
            registry.register(KernelSpec("hardplug.op", "torch", "math:fabs", reference=True))
            registry.register(KernelSpec("hardplug.op", "fast", "math:floor", priority=5))
    """,
    "hard_plugin_thief": """
        def register(registry):
            registry.unregister("hardplug.op", "fast")
    """,
}

ENTRY_POINTS = {
    HANG: "hangs = hard_plugin_hang:register",
    CRASH: "crashes = hard_plugin_crash",
    GOOD: "good = hard_plugin_good:register",
    THIEF: "zz_thief = hard_plugin_thief:register",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory on PYTHONPATH holding the plugin modules and their .dist-info metadata."""
    root = tmp_path_factory.mktemp("plugins")
    for name, source in SOURCES.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    for dist, entry_point in ENTRY_POINTS.items():
        info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[kernreg.kernels]\n{entry_point}\n")
    return root


def run(
    site: Path, args: tuple[str, ...], env: dict[str, str], timeout: float = 60
) -> tuple[subprocess.CompletedProcess[str], float]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environ.get("PYTHONPATH")]))
    environ["KERNREG_PLATFORM"] = "cpu"
    environ.update(env)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, *args], env=environ, capture_output=True, text=True, timeout=timeout
    )
    return proc, time.monotonic() - start


def check_json(
    site: Path, plugins: str, *extra: str, expect: int = 1
) -> tuple[dict[str, Any], float]:
    proc, seconds = run(
        site,
        ("-m", "kernreg", "check", "--json", *extra),
        {"KERNREG_PLUGINS": plugins},
    )
    assert proc.returncode == expect, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    return data, seconds


def test_check_import_targets_does_not_wait_for_a_plugin_that_hangs_on_import(site: Path) -> None:
    data, seconds = check_json(site, f"{HANG},{GOOD}", "--import-targets", "--import-timeout", "2")
    assert seconds < 30  # the plugin sleeps for an hour
    (hung,) = [p for p in data["problems"] if p["kind"] == "plugin"]
    assert HANG in hung["message"]
    assert "'hangs'" in hung["message"]
    assert "did not finish importing within 2 s" in hung["message"]
    assert hung["origins"] == [
        f"entry point 'hangs' = hard_plugin_hang:register (distribution {HANG} 1.0)"
    ]
    # The other plugin loaded as usual, and its targets were checked.
    assert [p["distribution"] for p in data["plugins"]["loaded"]] == [GOOD]
    assert data["checked"]["implementations"] == 2
    assert data["errors"] == 1


def test_check_import_targets_survives_a_plugin_that_kills_the_interpreter(site: Path) -> None:
    data, _ = check_json(site, f"{CRASH},{GOOD}", "--import-targets", "--import-timeout", "10")
    (crashed,) = [p for p in data["problems"] if p["kind"] == "plugin"]
    assert CRASH in crashed["message"]
    assert "crashed the interpreter while importing (exit status 7)" in crashed["message"]
    assert [p["distribution"] for p in data["plugins"]["loaded"]] == [GOOD]


def test_a_denied_plugin_that_would_hang_never_runs(site: Path) -> None:
    # Without --import-targets the check loads plugins in this process: the deny list
    # decides before any plugin code runs, so a hanging plugin that is denied costs nothing.
    proc, seconds = run(
        site,
        ("-m", "kernreg", "check", "--json"),
        {"KERNREG_PLUGINS_DENY": f"{HANG},{CRASH},{THIEF}"},
        timeout=60,
    )
    data = json.loads(proc.stdout)
    assert seconds < 30
    skipped = {(p["distribution"], p["reason"]) for p in data["plugins"]["skipped"]}
    assert (HANG, "denied by KERNREG_PLUGINS_DENY") in skipped
    assert (CRASH, "denied by KERNREG_PLUGINS_DENY") in skipped


def test_a_plugin_removing_another_plugins_spec_is_recorded_naming_both(site: Path) -> None:
    data, _ = check_json(site, f"{GOOD},{THIEF}", expect=0)
    (override,) = data["problems"]
    assert (override["kind"], override["severity"]) == ("override", "warning")
    assert "unregistered" in override["message"]
    assert f"(distribution {GOOD} 1.0)" in override["message"]
    assert f"(distribution {THIEF} 1.0)" in override["message"]

"""The process-wide inventory: what a fresh process sees of the installed plugins' kernels
through every public reader (real subprocesses, the real op pack)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _support import kernreg_cli
from kernreg.config import ENV_VARS

# --- a fresh process sees the installed plugins' kernels ----------------------------------


def test_fresh_process_fingerprint_and_plan_see_the_plugins_kernels(tmp_path: Path) -> None:
    script = (
        "import json, kernreg\n"
        "plan = kernreg.registry.build_plan()\n"
        "print(json.dumps([kernreg.registry.fingerprint(), len(plan.entries()),"
        " sorted({e.op for e in plan.entries()})]))\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    fresh = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=base, timeout=180
    )
    assert fresh.returncode == 0, fresh.stderr
    fingerprint, entries, ops = json.loads(fresh.stdout)
    assert fingerprint != "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert entries > 0
    assert "layernorm.rmsnorm" in ops
    locked = kernreg_cli("lock", "-o", str(tmp_path / "plan.json"))
    assert locked.returncode == 0, locked.stderr
    assert fingerprint[:16] in locked.stdout


# --- every public reader of the process-wide inventory sees the installed plugins' --------
# kernels, whichever is the first thing a fresh process calls


#: First call of a fresh process -> a JSON-able value that is empty exactly when the
#: reader saw no plugin kernels.
READERS = {
    "fingerprint": "kernreg.registry.fingerprint() != EMPTY_SHA256",
    "build_plan": "len(kernreg.registry.build_plan())",
    "ops": "kernreg.default_registry().ops()",
    "all_specs": "len(kernreg.default_registry().all_specs())",
    "get": "len(kernreg.default_registry().get('layernorm.rmsnorm'))",
    "get_backend": "kernreg.default_registry().get_backend('layernorm.rmsnorm', 'aten').backend",
    "reference": "kernreg.default_registry().reference('layernorm.rmsnorm').backend",
    "has": "kernreg.default_registry().has('layernorm.rmsnorm')",
    "len": "len(kernreg.default_registry())",
    "in": "'layernorm.rmsnorm' in kernreg.default_registry()",
    "repr": "'0 ops' not in repr(kernreg.default_registry())",
    "find_ambiguities_runs_on_plugins": (
        "kernreg.registry.find_ambiguities() is not None and len(kernreg.default_registry()) > 0"
    ),
    "tuned_buckets": (
        "kernreg.default_registry().tuned_buckets('layernorm.rmsnorm', kernreg.default_registry().platform) == []"
    ),
}


PROGRAM = """
import hashlib, json, sys
import kernreg
EMPTY_SHA256 = hashlib.sha256().hexdigest()
value = {expression}
print(json.dumps(value))
"""


def _first_call(expression: str, **env: str) -> object:
    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    # The session's own tuning store, never the user's (see conftest).
    base.update(KERNREG_PLATFORM="cpu", KERNREG_CACHE_DIR=os.environ["KERNREG_CACHE_DIR"], **env)
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(expression=expression)],
        env=base,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("reader", sorted(READERS))
def test_first_reader_of_a_fresh_process_sees_plugin_kernels(reader: str) -> None:
    assert _first_call(READERS[reader]), reader


def test_plugins_none_still_means_an_empty_inventory() -> None:
    assert _first_call("len(kernreg.default_registry())", KERNREG_PLUGINS="none") == 0


def test_a_fresh_fingerprint_equals_one_taken_after_a_selection() -> None:
    after = _first_call(
        "[kernreg.default_registry().select('layernorm.rmsnorm').label, kernreg.registry.fingerprint()][1]"
    )
    assert _first_call("kernreg.registry.fingerprint()") == after


def test_the_lock_a_fresh_process_writes_has_the_plugin_entries() -> None:
    plan = _first_call("json.loads(kernreg.registry.build_plan().to_json())['entries']")
    assert isinstance(plan, list)
    assert {row[0] for row in plan} >= {"layernorm.rmsnorm"}


def test_a_plugin_reading_the_inventory_while_it_loads_does_not_recurse(tmp_path: Path) -> None:
    """A registration function that reads the inventory (and fingerprints it) sees what is
    registered so far; the host then sees both plugins' kernels."""
    (tmp_path / "reader_plugin.py").write_text(
        "import kernreg\n"
        "SEEN = []\n"
        "def register(registry):\n"
        "    SEEN.append(len(registry))\n"
        "    registry.register(kernreg.KernelSpec('demo.reader', 'torch', 'math:fabs',"
        " reference=True))\n"
        "    SEEN.extend([len(registry.ops()), 'demo.reader' in registry,"
        " len(kernreg.registry.fingerprint()), len(kernreg.registry.build_plan())])\n"
    )
    info = tmp_path / "reader_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: reader-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[kernreg.kernels]\nreader = reader_plugin:register\n")
    seen, ops = _first_call(
        "[kernreg.default_registry().ops(), __import__('reader_plugin').SEEN][::-1]",
        PYTHONPATH=str(tmp_path),
    )  # type: ignore[misc]
    assert "demo.reader" in ops
    assert "layernorm.rmsnorm" in ops
    assert seen[2] is True
    assert seen[3] == 64
    assert seen[4] >= 1

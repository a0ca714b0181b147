"""``kernreg tune``: fill the store once, measure nothing the second time, show it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")


def _kernreg(args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    env.update({"KERNREG_CACHE_DIR": str(cache), "KERNREG_PLUGINS": "kernreg-ops"})
    return subprocess.run(
        [sys.executable, "-m", "kernreg", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_tune_fills_the_store_once_and_shows_it(tmp_path: Path) -> None:
    args = ["tune", "layernorm.rmsnorm", "--quick", "--dtype", "fp32", "--json"]
    first = _kernreg(args, tmp_path)
    assert first.returncode == 0, first.stderr
    filled = json.loads(first.stdout)
    assert filled["store"] == str(tmp_path / "tuning.sqlite3")
    assert filled["measurements"] == 2  # aten and the reference are eligible for float32 on CPU
    (row,) = filled["rows"]
    assert row["op"] == "layernorm.rmsnorm"
    assert row["dtype"] == "float32"
    assert row["bucket"] == "x=16x1024"
    assert row["rule"] == "autotune"
    assert row["measured_now"] is True
    assert set(row["results"]) == {"aten", "torch"}

    second = json.loads(_kernreg(args, tmp_path).stdout)
    assert second["measurements"] == 0
    assert second["rows"][0]["measured_now"] is False
    assert second["rows"][0]["chosen"] == row["chosen"]

    shown = _kernreg(["tune", "--show", "--json"], tmp_path)
    assert shown.returncode == 0, shown.stderr
    (entry,) = json.loads(shown.stdout)["entries"]
    assert entry["key"]["op"] == "layernorm.rmsnorm"
    assert entry["key"]["bucket"] == "x=16x1024"
    assert set(entry["results"]) == {"aten", "torch"}
    table = _kernreg(["tune", "--show"], tmp_path)
    assert "layernorm.rmsnorm" in table.stdout
    assert "1 entry" in table.stdout


def test_tune_needs_an_op_or_all(tmp_path: Path) -> None:
    result = _kernreg(["tune"], tmp_path)
    assert result.returncode == 2
    assert "give one OP or --all" in result.stderr


def test_show_tells_apart_entries_of_one_device_and_keeps_the_timings(tmp_path: Path) -> None:
    from kernreg.tuning import Measurement, TuningKey, TuningStore

    store = TuningStore(tmp_path / "tuning.sqlite3")
    for platform in ("cpu|torch=-|runtime=-", "cpu|torch=2.13.0+cpu|runtime=-"):
        key = TuningKey("layernorm.rmsnorm", platform, "aten=m:a;torch=m:t", ["float32"], "x=16")
        store.put(
            key, {"aten": Measurement(16400, 1400, 15), "torch": Measurement(21000, 8000, 15)}
        )
    store.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    env.update(KERNREG_CACHE_DIR=str(tmp_path), KERNREG_PLUGINS="none", COLUMNS="80")
    table = subprocess.run(
        [sys.executable, "-m", "kernreg", "tune", "--show"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert max(len(line) for line in lines if str(tmp_path) not in line) <= 80, table.stdout
    rows = [line for line in lines if line.startswith("layernorm.rmsnorm")]
    assert len(set(rows)) == 2, table.stdout  # the torch version tells them apart
    assert "cpu, torch 2.13.0+cpu" in table.stdout
    assert table.stdout.count("aten 16.4 us, torch 21 us") == 2  # timings whole, never cut

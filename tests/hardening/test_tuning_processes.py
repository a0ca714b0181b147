"""Eight processes tune into one store at once, through the path the autotune policy uses
(``KernelRegistry.record_measurements``), and one of them is killed mid-write.

tests/test_tuning_store.py proves the store alone: 8 concurrent writers that all finish
(``test_many_processes_write_one_file``) and one writer killed repeatedly on its own
(``test_killed_writer_loses_no_returned_put``). This adds both at once, through the
registry: the killed process must cost nothing that any process confirmed.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from kernreg import Config, KernelRegistry, KernelSpec, Platform
from kernreg.tuning import Measurement, TuningStore

PROCESSES = 8
PUTS = 40
SHARED = 5
VICTIM = 3

WORKER = r"""
import json, os, sys, time
from kernreg import Config, KernelRegistry, KernelSpec, Platform
from kernreg.tuning import Measurement

cache, writer, puts, shared, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
stop = go + ".stop"  # the others keep writing until the victim is dead (bounded below)
reg = KernelRegistry(config=Config(cache_dir=cache, policy=("*",)), platform=Platform.parse("cpu"))
reg.register(KernelSpec("hmp.op", "torch", "math:fabs", reference=True))
reg.register(KernelSpec("hmp.op", "fast", "math:floor", priority=1))
plat = reg.platform
open(f"{go}.ready-{writer}", "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
i = 0
deadline = time.monotonic() + 90  # bounded in time, not count: a starved victim still gets killed mid-write
while i < puts or (not os.path.exists(stop) and time.monotonic() < deadline):
    if i % 4 == 0:
        bucket = f"shared-{(i // 4) % shared}"
        kept = reg.record_measurements("hmp.op", plat, ("float32",), bucket, {
            "torch": Measurement(1000 + writer, 1.0, 3), "fast": Measurement(500 + writer, 1.0, 3),
        })
        print(json.dumps({"shared": bucket, "kept": {k: m.describe() for k, m in kept.items()}}), flush=True)
    kept = reg.record_measurements("hmp.op", plat, ("float32",), f"w{writer}-{i}", {
        "torch": Measurement(writer * 1000 + i, 0.5, 3), "fast": Measurement(i, 0.5, 3),
    })
    assert kept["torch"].median_ns == writer * 1000 + i
    print(json.dumps({"own": i}), flush=True)
    i += 1
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH", "")]))
    return env


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_eight_tuning_processes_one_killed_mid_write(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-W",
                "error",
                "-c",
                WORKER,
                str(cache),
                str(w),
                str(10**9 if w == VICTIM else PUTS),
                str(SHARED),
                str(go),
            ],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(PROCESSES)
    ]
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("go.ready-*"))) < PROCESSES:
            assert time.monotonic() < deadline, "workers did not start"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.005)
        go.touch()  # all start at once
        victim = procs[VICTIM]
        assert victim.stdout is not None
        victim_lines = []
        for line in victim.stdout:
            victim_lines.append(line)
            if len(victim_lines) >= 15:
                break
        others_running = sum(p.poll() is None for i, p in enumerate(procs) if i != VICTIM)
        victim.send_signal(signal.SIGKILL)  # in the middle of its next write
        rest, _ = victim.communicate(timeout=30)
        Path(f"{go}.stop").touch()
        assert victim.returncode == -signal.SIGKILL
        victim_lines.extend(rest.splitlines(keepends=True))
        outputs: dict[int, list[dict[str, object]]] = {
            VICTIM: [json.loads(line) for line in victim_lines if line.endswith("\n")]
        }
        for w, proc in enumerate(procs):
            if w == VICTIM:
                continue
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            outputs[w] = [json.loads(line) for line in out.splitlines()]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    # The kill happened while others were still writing.
    assert others_running >= 1
    confirmed = {
        w: [line["own"] for line in lines if "own" in line] for w, lines in outputs.items()
    }
    for w in range(PROCESSES):
        if w != VICTIM:
            assert confirmed[w] == list(range(len(confirmed[w])))
            assert len(confirmed[w]) >= PUTS
    assert len(confirmed[VICTIM]) >= 10

    # The store opens without being set aside, and holds every confirmed measurement.
    path = cache / "tuning.sqlite3"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg = KernelRegistry(
            config=Config(cache_dir=str(cache), policy=("*",)), platform=Platform.parse("cpu")
        )
        reg.register(KernelSpec("hmp.op", "torch", "math:fabs", reference=True))
        reg.register(KernelSpec("hmp.op", "fast", "math:floor", priority=1))
        for w, numbers in confirmed.items():
            for i in numbers:
                got = reg.measurements("hmp.op", reg.platform, ("float32",), f"w{w}-{i}")
                assert got == {
                    "torch": Measurement(w * 1000 + i, 0.5, 3),
                    "fast": Measurement(i, 0.5, 3),
                }, (w, i)
        # Shared keys: one winner, and every process went on with it.
        for s in range(SHARED):
            answers = {
                json.dumps(line["kept"], sort_keys=True)
                for lines in outputs.values()
                for line in lines
                if line.get("shared") == f"shared-{s}"
            }
            assert len(answers) == 1, answers
            stored = reg.measurements("hmp.op", reg.platform, ("float32",), f"shared-{s}")
            assert stored is not None
            assert (
                json.dumps({k: m.describe() for k, m in stored.items()}, sort_keys=True) in answers
            )
            # The decision under the autotune policy reads the winner: no measuring again.
            decision = reg.explain(
                "hmp.op", dtypes=["float32"], bucket=f"shared-{s}", autotune=True
            )
            assert decision.ok
            assert not decision.tuning
        assert reg.tuning_store is not None
        entries = reg.tuning_store.entries()
        # Nothing half-written: every entry has both of its measurements.
        assert all(len(results) == 2 for _, results in entries)
        total_confirmed = sum(len(n) for n in confirmed.values())
        assert len(entries) >= total_confirmed + SHARED
    assert not [p for p in cache.iterdir() if ".corrupt-" in p.name or ".foreign-" in p.name]
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        conn.close()
    TuningStore(path).close()

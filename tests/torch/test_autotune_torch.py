"""The autotune policy on real tensors: measuring on the first call, the store shared by
processes, and in-place ops measured without touching the caller's tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import kernreg  # noqa: E402
import kernreg.torch  # noqa: E402
from kernreg import KernelRegistry, Platform  # noqa: E402
from kernreg.config import Config  # noqa: E402
from kernreg.torch import tune  # noqa: E402
from kernreg.tuning import TuningStore  # noqa: E402


def _registry(tmp_path: Path) -> KernelRegistry:
    registry = KernelRegistry(
        config=Config(), platform=Platform("cpu", torch_version=torch.__version__)
    )
    registry.use_tuning_store(TuningStore(tmp_path / "tuning.sqlite3"))
    return registry


def test_the_first_call_of_a_bucket_measures_and_the_fastest_runs(tmp_path: Path) -> None:
    registry = _registry(tmp_path)

    @kernreg.op("demo.scale", registry=registry, autotune=True)
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @scale.register("slow", priority=10)
    def slow(x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return x * 2

    before = tune.counter.value
    x = torch.ones(4, 8)
    assert torch.equal(scale(x), x * 2)
    assert tune.counter.value - before == 2  # slow and the reference, once
    decision = scale.explain_call(x)
    assert decision.rule == "autotune"
    assert decision.chosen is not None
    assert decision.chosen.backend == "torch"
    # The same bucket (5x8 rounds to 8x8, 4x8 is its own) measures nothing more.
    scale(torch.ones(4, 8))
    assert tune.counter.value - before == 2
    scale(torch.ones(5, 8))
    scale(torch.ones(7, 8))
    assert tune.counter.value - before == 4
    assert len(TuningStore(tmp_path / "tuning.sqlite3").entries()) == 2
    # Without the policy, priority decides as before.
    assert scale.explain(dtypes=["float32"]).chosen.backend == "slow"  # type: ignore[union-attr]


def test_measuring_an_in_place_op_leaves_the_callers_tensors_as_one_call_would(
    tmp_path: Path,
) -> None:
    registry = _registry(tmp_path)

    @kernreg.op("demo.add_", registry=registry, autotune=True, traits=["inplace"])
    def add_(x: torch.Tensor, y: torch.Tensor) -> None:
        x.add_(y)

    @add_.register("other", traits=["inplace"], priority=1)
    def add_other(x: torch.Tensor, y: torch.Tensor) -> None:
        x.copy_(x + y)

    x, y = torch.zeros(16), torch.ones(16)
    before = tune.counter.value
    add_(x, y)
    assert tune.counter.value - before == 2
    assert torch.equal(x, torch.ones(16))  # applied exactly once, however often it was timed


WORKER = """
import json, sys, torch
import kernreg
from kernreg.torch import tune
from kernreg_ops.ops import rmsnorm
x = torch.randn(4, 64)
w = torch.ones(64)
rmsnorm(x, w)
rmsnorm(x, w)
decision = rmsnorm.explain_call(x, w)
print(json.dumps({"measured": tune.counter.value, "rule": decision.rule,
                  "chosen": decision.chosen.label if decision.chosen else None}))
"""


def test_a_second_process_with_a_warm_store_measures_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    env.update(
        {
            "KERNREG_POLICY": "layernorm.rmsnorm",
            "KERNREG_CACHE_DIR": str(tmp_path),
            "KERNREG_PLUGINS": "kernreg-ops",
        }
    )
    runs = []
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=240
        )
        assert result.returncode == 0, result.stderr
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["measured"] >= 2  # aten and the reference are eligible on CPU for float32
    assert second["measured"] == 0
    assert first["rule"] == second["rule"] == "autotune"
    assert first["chosen"] == second["chosen"]


def test_the_core_finds_the_torch_measurer_by_its_entry_point_without_importing_it(
    tmp_path: Path,
) -> None:
    # Nothing here imports kernreg.torch: the op object looks the measurer up by name
    # (the `kernreg.measurers` entry point) when the first call needs measuring.
    code = f"""
import json, sys, time
import torch
import kernreg
from kernreg import KernelRegistry, Platform
from kernreg.config import Config
from kernreg.tuning import TuningStore

assert not any(m.startswith("kernreg.torch") for m in sys.modules)
registry = KernelRegistry(config=Config(), platform=Platform("cpu", torch_version=torch.__version__))
registry.use_tuning_store(TuningStore({str(tmp_path / "tuning.sqlite3")!r}))

@kernreg.op("demo.scale", registry=registry, autotune=True)
def scale(x):
    return x * 2

@scale.register("slow", priority=10)
def slow(x):
    time.sleep(0.002)
    return x * 2

scale(torch.ones(8))
decision = scale.explain_call(torch.ones(8))
print(json.dumps([decision.rule, decision.chosen.label, "kernreg.torch" in sys.modules]))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out.splitlines()[-1]) == ["autotune", "torch", True]


def test_tune_buckets_an_op_as_its_op_object_dispatches_it() -> None:
    # kernreg_ops.ops.rotary dispatches (and buckets) on q, not on the integer positions
    # before it: results stored by `kernreg tune` must be found by the op's calls.
    pytest.importorskip("kernreg_ops")
    from kernreg.autotune import shape_bucket
    from kernreg.torch.bench import choose_shapes
    from kernreg.torch.tune import tune_op

    rows = tune_op("embedding.rotary", quick=True, dtypes=["float32"])
    (shape,) = choose_shapes("embedding.rotary", None, True)
    generate = kernreg.torch.input_spec("embedding.rotary").load()
    args, _ = generate(torch.float32, torch.device("cpu"), shape.seed, **shape.dims)
    assert [row.bucket for row in rows] == [shape_bucket(("q",), [args[1]])]

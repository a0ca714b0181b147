"""One rank of a distributed test job: run the phases of a scenario, write what happened.

Run as ``python worker.py SCENARIO RANK WORLD INIT_FILE OUT_DIR``; the result is
``OUT_DIR/rank<RANK>.json``: phase name -> ``{"ok": value}`` or ``{"error": ..., "message": ...}``.
The environment (``KERNREG_*``) is set per rank by the test.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

import kernreg
import kernreg.torch.distributed as kd
from kernreg import KernelRegistry, KernelSpec
from kernreg.tuning import TuningStore


def register(registry: KernelRegistry) -> None:
    """A small inventory: two ops, with implementations for CPU and CUDA."""
    for spec in (
        KernelSpec("layernorm.rmsnorm", "torch", "kops.rms:torch_rms", reference=True),
        KernelSpec(
            "layernorm.rmsnorm",
            "aten",
            "kops.rms:aten_rms",
            dtypes=["bfloat16", "float16"],
            priority=10,
        ),
        KernelSpec(
            "layernorm.rmsnorm", "triton", "kops.rms:triton_rms", requires=["cuda"], priority=20
        ),
        KernelSpec("activation.silu_and_mul", "torch", "kops.act:torch_silu", reference=True),
        KernelSpec("activation.silu_and_mul", "aten", "kops.act:aten_silu", priority=5),
    ):
        registry.register(spec)


def run(results: dict[str, Any], name: str, phase: Callable[[], Any]) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            results[name] = {"ok": phase()}
        except Exception as exc:
            results[name] = {
                "error": type(exc).__name__,
                "message": str(exc),
                "mismatch": isinstance(exc, kd.RankMismatchError),
                "kernreg": isinstance(exc, kernreg.KernregError),
            }
    if caught:
        results[name]["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]


def chosen(registry: KernelRegistry | None = None) -> str:
    reg = kernreg.default_registry() if registry is None else registry
    return reg.select("layernorm.rmsnorm", dtypes=["bfloat16"]).label


def agree(rank: int, out: Path, results: dict[str, Any]) -> None:
    run(results, "verify", kd.verify)
    run(results, "local_fingerprint", kernreg.registry.fingerprint)
    own = KernelRegistry()
    register(own)
    run(
        results,
        "verify_explicit",
        lambda: kd.verify(registry=own, platforms=["cpu", "cuda:9.0"]),
    )
    # A rank that cannot compute its decisions fails; its peers raise instead of hanging.
    bad = ["not a platform!"] if rank == 1 else None
    run(results, "peer_failure", lambda: kd.verify(platforms=bad))
    run(results, "verify_again", kd.verify)
    run(results, "share_plan", lambda: kd.share_plan().fingerprint())
    run(
        results,
        "default_store_created",
        lambda: Path(TuningStore.default_path()).exists(),
    )


def mismatch(rank: int, out: Path, results: dict[str, Any]) -> None:
    run(results, "chosen_before", chosen)
    run(results, "verify", kd.verify)
    pair = dist.new_group([0, 1])
    rest = dist.new_group([2, 3])
    run(results, "verify_subgroup", lambda: kd.verify(pair if rank < 2 else rest))
    run(results, "share_bad_src", lambda: kd.share_plan(src=7))

    store = None
    if hasattr(TuningStore, "import_json"):  # the persistent store may not be there yet
        from kernreg.tuning import Measurement, TuningKey

        store = TuningStore(out / f"tuning-rank{rank}.sqlite3")
        if rank == 0:
            for bucket in ("m<=64", "m>64"):
                key = TuningKey("layernorm.rmsnorm", "cpu", "aten,torch", ["bfloat16"], bucket)
                store.put(
                    key, {"aten": Measurement(1000, 10, 20), "torch": Measurement(3000, 30, 20)}
                )
    run(results, "share_plan", lambda: kd.share_plan(src=0, store=store).to_json())
    run(results, "verify_after", kd.verify)
    run(results, "chosen_after", chosen)
    run(results, "plan_source", lambda: kernreg.default_registry().plan.source)
    if store is not None:
        run(results, "tuning_export", store.export_json)
        store.close()


def autotune(rank: int, out: Path, results: dict[str, Any]) -> None:
    """``KERNREG_POLICY=autotune``; only rank 0 has measured a shape bucket."""
    from kernreg.tuning import Measurement

    reg = kernreg.default_registry()
    if rank == 0:
        reg.record_measurements(
            "layernorm.rmsnorm",
            reg.platform,
            ("bfloat16",),
            "x=1024",
            {"aten": Measurement(5000, 50, 20), "torch": Measurement(1000, 10, 20)},
        )
    run(results, "verify", kd.verify)
    run(results, "share_plan", lambda: kd.share_plan().fingerprint())
    run(results, "verify_after", kd.verify)
    run(results, "tuned_buckets", lambda: reg.tuned_buckets("layernorm.rmsnorm", reg.platform))


def installed(rank: int, out: Path, results: dict[str, Any]) -> None:
    """Nothing registered by hand: the inventory is the installed op pack's, loaded by
    whichever reader comes first (here ``verify`` right after ``init_process_group``)."""
    run(results, "verify", kd.verify)
    run(results, "share_plan", lambda: len(kd.share_plan(src=0, check=False)))
    # KERNREG_DENY beats a plan: a rank that denies the planned kernel cannot follow it.
    run(results, "share_plan_checked", lambda: len(kd.share_plan(src=0)))


def demoted(rank: int, out: Path, results: dict[str, Any]) -> None:
    """``KERNREG_DEMOTE=layernorm.*``; only rank 1 demoted aten in one shape bucket."""
    reg = kernreg.default_registry()
    if rank == 1:
        decision = reg.explain("layernorm.rmsnorm", dtypes=["bfloat16"])
        run(results, "demote", lambda: reg.demote(decision, RuntimeError("grid"), "x=4096"))
    run(results, "verify", kd.verify)


def scale_layer(fast: Callable[..., Any] | None = None) -> tuple[Any, KernelRegistry]:
    """A layer ``Scale`` (``x * weight``, 8 features, weight ``value``) mapped to op
    ``demo.scale``, and a registry of its own: the reference and ``fast`` (priority 10;
    default ``torch.mul``)."""
    import torch

    import kernreg.torch

    class Scale(torch.nn.Module):
        def __init__(self, value: float = 2.0) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((8,), value))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    def scale_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * weight

    reg = KernelRegistry()
    reg.register(KernelSpec("demo.scale", "torch", scale_reference, reference=True))
    reg.register(KernelSpec("demo.scale", "fast", fast or torch.mul, priority=10))
    kernreg.torch.register_layer(Scale, op="demo.scale", args=lambda module, x: (x, module.weight))
    return Scale, reg


def kernelized(rank: int, out: Path, results: dict[str, Any]) -> None:
    """A model kernelized before ``share_plan``; only rank 0 pins its ``norm`` site."""
    import torch

    import kernreg.torch

    scale, reg = scale_layer()
    model = torch.nn.Sequential()
    model.add_module("norm", scale())
    model.add_module("other", scale())

    def ran() -> dict[str, str]:
        with kernreg.trace() as trace:
            model(torch.ones(2, 8))
        return {c["site"]: c["implementation"] for c in json.loads(trace.to_json())["calls"]}

    run(results, "kernelize", lambda: len(kernreg.torch.kernelize(model, registry=reg).routed))
    run(results, "ran_before", ran)
    run(results, "share_plan", lambda: kd.share_plan(src=0, registry=reg).site_pins)
    run(results, "ran_after", ran)


def kernelize_pins(rank: int, out: Path, results: dict[str, Any]) -> None:
    """Models kernelized alike (in another order), then with other pins or outcomes."""
    import torch

    import kernreg.torch

    def scale_positive(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * weight.abs()  # right for positive weights only

    scale, reg = scale_layer(scale_positive)

    def model(value: float = 2.0) -> torch.nn.Module:
        made = torch.nn.Sequential()
        made.add_module("norm", scale(value))
        made.add_module("other", scale())
        return made

    pin = {"demo.scale@norm": "torch"}
    first, second = model(), model()
    if rank == 0:
        kernreg.torch.kernelize(first, registry=reg, pin=pin)
        kernreg.torch.kernelize(second, registry=reg)
    else:  # the other order, and a model kernelized then unkernelized
        gone = model()
        kernreg.torch.kernelize(gone, registry=reg, pin={"demo.scale@other": "torch"})
        kernreg.torch.kernelize(second, registry=reg)
        kernreg.torch.kernelize(first, registry=reg, pin=pin)
        kernreg.torch.unkernelize(gone)
    run(results, "alike", lambda: kd.verify(registry=reg))
    run(results, "plan_fingerprint", lambda: kernreg.registry.fingerprint(reg))
    # Rank 1 kernelizes the first model again without its pin.
    if rank == 1:
        kernreg.torch.kernelize(first, registry=reg)
    run(results, "other_pins", lambda: kd.verify(registry=reg))
    if rank == 1:
        kernreg.torch.kernelize(first, registry=reg, pin=pin)

    # Verification rejects the swap of a negative weight: on rank 1 only (a class of its
    # own, verified first here: outcomes are kept per class and parameter shapes).
    class Gain(scale):
        pass

    kernreg.torch.register_layer(Gain, op="demo.scale", args=lambda module, x: (x, module.weight))
    third = torch.nn.Sequential()
    third.add_module("norm", Gain(2.0 if rank == 0 else -2.0))
    run(results, "outcome", lambda: kernreg.torch.kernelize(third, registry=reg).row("norm").status)
    run(results, "other_outcomes", lambda: kd.verify(registry=reg))
    kernreg.torch.unkernelize(third)
    run(results, "unkernelized", lambda: kd.verify(registry=reg))


def kernelize_copies(rank: int, out: Path, results: dict[str, Any]) -> None:
    """Deep copies of kernelized models, and parts of them kernelized again with a pin."""
    import copy

    import torch

    import kernreg.torch

    scale, reg = scale_layer()

    def model(norm_first: bool = True) -> torch.nn.Module:
        block = torch.nn.Sequential()
        block.add_module("norm", scale())
        made = torch.nn.Sequential()
        for name in ("norm", "block") if norm_first else ("block", "norm"):
            made.add_module(name, scale() if name == "norm" else block)
        return made

    pin = {"demo.scale@norm": "torch"}
    # Rank 0 keeps only a deep copy of its kernelized model: it runs the same kernels.
    kept = model()
    kernreg.torch.kernelize(kept, registry=reg)
    if rank == 0:
        kept = copy.deepcopy(kept)
    run(results, "copy_only", lambda: kd.verify(registry=reg))
    run(results, "plan_fingerprint", lambda: kernreg.registry.fingerprint(reg))
    kernreg.torch.unkernelize(kept)
    # Each rank keeps a copy and unkernelizes the original: rank 1's copy runs its pin.
    original = model()
    kernreg.torch.kernelize(original, registry=reg, pin=pin if rank == 1 else None)
    copied = copy.deepcopy(original)
    kernreg.torch.unkernelize(original)
    run(results, "copies_differ", lambda: kd.verify(registry=reg))
    kernreg.torch.unkernelize(copied)
    # A part kernelized again with a pin: the same sites run the same kernels, whatever
    # the order of the model's modules.
    whole = model(norm_first=rank == 0)
    kernreg.torch.kernelize(whole, registry=reg)
    kernreg.torch.kernelize(whole.block, registry=reg, pin=pin)
    run(results, "part_pinned", lambda: kd.verify(registry=reg))


SCENARIOS = {
    "kernelize_copies": kernelize_copies,
    "kernelize_pins": kernelize_pins,
    "kernelized": kernelized,
    "agree": agree,
    "mismatch": mismatch,
    "autotune": autotune,
    "installed": installed,
    "demoted": demoted,
}


def main() -> None:
    scenario, rank_text, world_text, init_file, out_dir = sys.argv[1:]
    rank, world, out = int(rank_text), int(world_text), Path(out_dir)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    if scenario not in ("installed", "kernelized", "kernelize_pins", "kernelize_copies"):
        register(kernreg.default_registry())
    results: dict[str, Any] = {}
    try:
        SCENARIOS[scenario](rank, out, results)
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

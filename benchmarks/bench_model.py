"""A kernelized transformers model against the unmodified one, on CPU (random weights).

Two kinds of figures:

* **kernreg overhead per decoder layer** (budget ≤ 1 µs): for each routed module of one
  decoder layer (two RMSNorms, the gated MLP), the call through the module after
  ``kernelize`` minus the same call with the module's forward written by hand around the
  same implementation (what an engine binding the kernel itself would write); the
  implementations return their input and the projections are identities, so kernel
  time and its noise stay out of the difference; summed over the layer.
* **latency ratio kernelized / unmodified** (target ≤ 1.05): a tiny Llama (hidden 256,
  4 layers), eager decode (batch 1, seq 1) and prefill (batch 4, seq 128), float32 and
  bfloat16, measured interleaved in one process (A, B, A, B, ...; the median of each);
  and the same under ``torch.compile`` (full runs only: compiling takes tens of seconds).

Needs torch, kernreg-ops and transformers (a dev dependency); the runner reports this
module as skipped without them. ``python benchmarks/bench_model.py`` prints the figures.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import transformers

from kernreg import KernelRegistry, KernelSpec, Platform
from kernreg.config import Config
from kernreg.torch import kernelize
from kernreg_ops import reference as pack_reference

OVERHEAD_BUDGET_NS = 1000.0
RATIO_TARGET = 1.05


def _llama(hidden: int, layers: int, dtype: torch.dtype) -> Any:
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1),
        vocab_size=1024,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval().to(dtype)


def _per_call_ns(func: Callable[[], Any], number: int, rounds: int) -> float:
    for _ in range(min(number, 200)):
        func()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(number):
            func()
        best = min(best, (time.perf_counter_ns() - start) / number)
    return best


def _first(x: Any, *rest: Any) -> Any:
    return x


def layer_overhead_ns(number: int, rounds: int) -> dict[str, float]:
    """kernreg's cost per routed module of one decoder layer (ns), by module name.

    The ops' chosen implementation returns its first argument and the MLP's projections
    are identities, on both sides, so what remains is what kernreg adds: the argument
    map, the table lookup and the output map.
    """
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    for op_id, reference in (
        ("layernorm.rmsnorm", pack_reference.rmsnorm),
        ("activation.silu_mul", pack_reference.silu_mul),
    ):
        registry.register(KernelSpec(op_id, "torch", reference, reference=True))
        registry.register(KernelSpec(op_id, "first", _first, priority=5))
    model = _llama(64, 1, torch.float32)
    layer = model.model.layers[0]
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(layer.mlp, name, torch.nn.Identity())
    # `_first` is no rmsnorm: the benchmark vouches for its mappings to time the route alone.
    report = kernelize(model, registry=registry, verify=False)
    x = torch.randn(1, 1, 64)
    result: dict[str, float] = {}
    with torch.no_grad():
        for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
            module = getattr(layer, name)
            row = report.row(f"model.layers.0.{name}")
            if row.status != "routed" or row.implementation != "first":
                raise RuntimeError(f"kernelize did not route {row.path}: {row.reason}")
            routed = module.forward
            if name == "mlp":

                def direct(x: Any, m: Any = module) -> Any:
                    return m.down_proj(_first(m.gate_proj(x), m.up_proj(x)))
            else:

                def direct(x: Any, m: Any = module) -> Any:
                    return _first(x, m.weight, m.variance_epsilon)

            kernelized_ns = []
            direct_ns = []
            for _ in range(rounds):  # interleaved
                module.__dict__["forward"] = routed
                kernelized_ns.append(_per_call_ns(lambda m=module: m(x), number, 1))
                module.__dict__["forward"] = direct
                direct_ns.append(_per_call_ns(lambda m=module: m(x), number, 1))
            module.__dict__["forward"] = routed
            result[name] = max(min(kernelized_ns) - min(direct_ns), 0.0)
    return result


def _interleaved_ms(
    a: Callable[[], Any], b: Callable[[], Any], rounds: int, inner: int
) -> tuple[float, float]:
    a(), b()
    times_a: list[float] = []
    times_b: list[float] = []
    for _ in range(rounds):
        for func, times in ((a, times_a), (b, times_b)):
            start = time.perf_counter()
            for _ in range(inner):
                func()
            times.append((time.perf_counter() - start) / inner * 1e3)
    return statistics.median(times_a), statistics.median(times_b)


def model_ratios(compiled: bool, rounds: int) -> list[tuple[str, float, float]]:
    """``(case, unmodified ms, kernelized ms)`` per dtype and shape."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        plain = _llama(256, 4, dtype)
        routed = copy.deepcopy(plain)
        kernelize(routed, mode="compile" if compiled else "inference")
        run_plain: Any = torch.compile(plain) if compiled else plain
        run_routed: Any = torch.compile(routed) if compiled else routed
        for shape_name, (batch, seq), inner in (
            ("decode b1 s1", (1, 1), 20),
            ("prefill b4 s128", (4, 128), 2),
        ):
            ids = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                a_ms, b_ms = _interleaved_ms(
                    lambda m=run_plain, i=ids: m(i),
                    lambda m=run_routed, i=ids: m(i),
                    rounds,
                    inner,
                )
            mode = "compiled" if compiled else "eager"
            rows.append((f"{mode} {shape_name} {str(dtype).removeprefix('torch.')}", a_ms, b_ms))
        if compiled:
            torch._dynamo.reset()
    return rows


def run(quick: bool = False) -> list[dict[str, Any]]:
    number, rounds = (2_000, 3) if quick else (20_000, 7)
    records: list[dict[str, Any]] = []
    overhead = layer_overhead_ns(number, rounds)
    total = sum(overhead.values())
    records.append(
        {
            "name": "kernelize: kernreg overhead per decoder layer (2 RMSNorm + MLP), eager CPU",
            "value": total,
            "unit": "ns",
            "budget": f"<= {OVERHEAD_BUDGET_NS:.0f} ns",
            "baseline": "hand-written forward around the same implementations",
            "ratio": None,
            "ok": total <= OVERHEAD_BUDGET_NS,
            "note": ", ".join(f"{k} {v:.0f} ns" for k, v in overhead.items()),
        }
    )
    cases = model_ratios(False, 3 if quick else 9)
    if not quick:
        cases += model_ratios(True, 7)
    for case, plain_ms, routed_ms in cases:
        ratio = routed_ms / plain_ms
        records.append(
            {
                "name": f"kernelized / unmodified Llama, {case}",
                "value": routed_ms,
                "unit": "ms",
                "budget": f"ratio <= {RATIO_TARGET}",
                "baseline": f"unmodified {plain_ms:.3f} ms",
                "ratio": ratio,
                "ok": ratio <= RATIO_TARGET,
            }
        )
    return records


if __name__ == "__main__":
    for record in run(quick=False):
        ratio = "" if record["ratio"] is None else f"  ratio {record['ratio']:.3f}"
        print(f"{record['name']}: {record['value']:.3f} {record['unit']}{ratio}  ok={record['ok']}")
        if record.get("note"):
            print(f"    {record['note']}")

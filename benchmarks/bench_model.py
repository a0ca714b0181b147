"""Kernelized transformers models against unmodified ones, on CPU (random weights).

Two kinds of figures:

* **kernreg overhead per decoder layer** (budget ≤ 1 µs): for each routed module of one
  decoder layer (the RMSNorms, Qwen3's q/k norms included, and the gated MLP), the call
  through the module after ``kernelize`` minus the same call with the module's forward
  written by hand around the same implementation (what an engine binding the kernel
  itself would write), plus the rotary route: the attention's call of
  ``apply_rotary_pos_emb`` through kernreg's dispatcher minus a direct call of the same
  implementation. The implementations return their input and the projections are
  identities, so kernel time and its noise stay out of the difference; the fastest of
  interleaved rounds each side, GC off; summed over the layer, for Llama, Qwen3 and
  Gemma.
* **latency ratio kernelized / unmodified** (budget ≤ 1.00, the median of the paired
  ratios of interleaved rounds, with their quartiles; 36 rounds eager, 24 compiled, after
  five warm-up calls a side): tiny Llama, Qwen3 and Gemma models (hidden 256, 4 layers),
  decode (batch 1, one new token on an 8-token KV cache, 10 steps a round) and prefill
  (batch 4, seq 128, 2 calls a round), float32 and bfloat16, eager; and the same under
  ``torch.compile`` (full runs only: compiling takes tens of seconds). Three sides, deep
  copies of one model sharing its weights (the same memory): the unmodified model, the
  kernelized one, and an **A/A control**, a second unmodified copy, whose ratio to the
  first is the noise floor of the measurement (a row of its own). Each round runs the
  three back to back, each side first, second and last equally often. All sides get the
  same inputs and do the same work, each on a KV cache of its own made alike; torch
  runs on one intra-op thread, GC is off while timing, and the time is this thread's CPU
  time (a shared machine's other processes are not counted). A quick run measures eager
  float32 only.

Needs torch, kernreg-ops and transformers (a dev dependency); the runner reports this
module as skipped without them. ``python benchmarks/bench_model.py`` prints the figures.
"""

from __future__ import annotations

import copy
import gc
import importlib
import inspect
import statistics
import sys
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
RATIO_TARGET = 1.00
#: family -> (config class, model class, extra config fields)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "Llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64}),
    "Gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 64}),
}
PROMPT = 8


def _model(family: str, hidden: int, layers: int, dtype: torch.dtype) -> Any:
    config_class, model_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1),
        vocab_size=1024,
        max_position_embeddings=512,
        **extra,
    )
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).eval().to(dtype)


def _llama(hidden: int, layers: int, dtype: torch.dtype) -> Any:
    return _model("Llama", hidden, layers, dtype)


def _per_call_ns(func: Callable[[], Any], number: int, rounds: int) -> float:
    """The fastest of ``rounds`` runs of ``number`` calls, per call, in this thread's CPU
    time (GC off while timed)."""
    for _ in range(min(number, 200)):
        func()
    best = float("inf")
    gc.disable()
    try:
        for _ in range(rounds):
            start = time.thread_time_ns()
            for _ in range(number):
                func()
            best = min(best, (time.thread_time_ns() - start) / number)
    finally:
        gc.enable()
    return best


def _first(x: Any, *rest: Any) -> Any:
    return x


def _first_two(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> Any:
    return q, k


def layer_overhead_ns(
    number: int, rounds: int, family: str = "Llama", backward: bool = True
) -> dict[str, float]:
    """kernreg's cost per routed module of one decoder layer (ns), by module name, and of
    its rotary route (``"rotary"``).

    The ops' chosen implementation returns its first argument(s) and the MLP's
    projections are identities, on both sides, so what remains is what kernreg adds: the
    argument map, the table lookup and the output map. ``backward``: the implementation
    declares the ``backward`` trait, as the pack's native and ATen ones do; one that
    declares none (the pack's Triton kernels) is also checked for autograd recording on
    each call (a backward through it raises).
    """
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    for op_id, reference, first in (
        ("layernorm.rmsnorm", pack_reference.rmsnorm, _first),
        ("layernorm.rmsnorm_offset", pack_reference.rmsnorm_offset, _first),
        ("activation.silu_mul", pack_reference.silu_mul, _first),
        ("activation.gelu_tanh_mul", pack_reference.gelu_tanh_mul, _first),
        ("embedding.rotary_cos_sin", pack_reference.rotary_cos_sin, _first_two),
    ):
        registry.register(KernelSpec(op_id, "torch", reference, reference=True))
        traits = ("backward",) if backward else ()
        registry.register(KernelSpec(op_id, "first", first, priority=5, traits=traits))
    model = _model(family, 64, 1, torch.float32)
    layer = model.model.layers[0]
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(layer.mlp, name, torch.nn.Identity())
    # `_first` is no rmsnorm: the benchmark vouches for its mappings to time the route alone.
    report = kernelize(model, registry=registry, verify=False)
    prefix = "model.layers.0."
    result: dict[str, float] = {}
    with torch.no_grad():
        for row in report:
            if not row.path.startswith(prefix):
                continue
            if row.status != "routed" or row.implementation != "first":
                raise RuntimeError(f"kernelize did not route {row.path}: {row.reason}")
            module = layer.get_submodule(row.path.removeprefix(prefix))
            if row.path.endswith("mlp"):
                x = torch.randn(1, 1, 64)

                def direct(x: Any, m: Any = module) -> Any:
                    return m.down_proj(_first(m.gate_proj(x), m.up_proj(x)))
            elif hasattr(module, "variance_epsilon"):
                x = torch.randn(1, 1, module.weight.shape[0])

                def direct(x: Any, m: Any = module) -> Any:
                    return _first(x, m.weight, m.variance_epsilon)
            else:  # Gemma's norms keep their epsilon as `eps`
                x = torch.randn(1, 1, module.weight.shape[0])

                def direct(x: Any, m: Any = module) -> Any:
                    return _first(x, m.weight, m.eps)

            kernelized_ns = []
            direct_ns = []
            own = module.__dict__
            module(x)  # its first call of this dtype decides it
            routed = own.get("forward")  # None: routed from its class (settled)
            for _ in range(rounds):  # interleaved
                kernelized_ns.append(_per_call_ns(lambda m=module, x=x: m(x), number, 1))
                own["forward"] = direct
                direct_ns.append(_per_call_ns(lambda m=module, x=x: m(x), number, 1))
                if routed is None:
                    del own["forward"]
                else:
                    own["forward"] = routed
            result[row.path.removeprefix(prefix)] = max(min(kernelized_ns) - min(direct_ns), 0.0)
        # The attention's routed forward names kernreg's dispatcher for the rotary function.
        forward = inspect.unwrap(layer.self_attn.forward.__func__)
        dispatcher = forward.__globals__["apply_rotary_pos_emb"]
        if getattr(dispatcher, "__kernreg_original__", None) is None:
            raise RuntimeError(f"kernelize did not route the rotary function of {family}")
        q, k = torch.randn(1, 1, 1, 64), torch.randn(1, 1, 1, 64)
        cos, sin = torch.randn(1, 1, 64), torch.randn(1, 1, 64)
        routed_ns, direct_ns = [], []
        for _ in range(rounds):
            routed_ns.append(_per_call_ns(lambda: dispatcher(q, k, cos, sin), number, 1))
            direct_ns.append(_per_call_ns(lambda: _first_two(q, k, cos, sin), number, 1))
        result["rotary"] = max(min(routed_ns) - min(direct_ns), 0.0)
    return result


#: calls of each side before timing
WARMUP = 5


def _order(i: int, n: int) -> list[int]:
    """The order round ``i`` runs ``n`` sides in: the rotations of ``0..n-1``, then the
    same reversed (for three sides, all six orders in six rounds: each side is first,
    second and last equally often)."""
    turn = [(i + k) % n for k in range(n)]
    return turn[::-1] if (i // n) % 2 else turn


def _quartiles(values: list[float]) -> tuple[float, float]:
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def _interleaved_ms(
    funcs: tuple[Callable[[], Any], ...], rounds: int, inner: int
) -> tuple[list[float], list[list[float]]]:
    """Per side, the median ms per call of ``rounds`` interleaved rounds of ``inner``
    calls each; per side after the first, the paired ratios side / first of every round.

    Each round runs every side back to back (under the same load: a shared machine's
    load drifting between rounds cancels out of the ratio), in the orders of
    :func:`_order` in turn, so no side is always first or last; :data:`WARMUP` calls
    each first (torch.compile compiles, and may recompile once, there); GC off while
    timed.

    Timed in CPU time of this thread (:func:`time.thread_time`; torch runs on this one
    thread, :data:`THREADS`): on a shared machine the time other processes hold the core
    is not counted against either side."""
    for _ in range(WARMUP):
        for func in funcs:
            func()
    times: list[list[float]] = [[] for _ in funcs]
    gc.collect()
    gc.disable()
    try:
        for i in range(rounds):
            for side in _order(i, len(funcs)):
                func = funcs[side]
                start = _clock()
                for _ in range(inner):
                    func()
                times[side].append((_clock() - start) / inner * 1e3)
    finally:
        gc.enable()
    ratios = [[b / a for a, b in zip(times[0], side, strict=True)] for side in times[1:]]
    return [statistics.median(t) for t in times], ratios


def _decode_step(model: Any, dtype: torch.dtype) -> Callable[[], Any]:
    """One new token on a KV cache of ``PROMPT`` tokens (the cache is cut back after it)."""
    prompt = torch.randint(0, 1024, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    token = torch.randint(0, 1024, (1, 1), generator=torch.Generator().manual_seed(1))
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)

    def step() -> Any:
        out = model(token, cache=cache, use_cache=True)
        cache.crop(-1)
        return out

    return step


def _copy(model: Any) -> Any:
    """A deep copy of ``model`` sharing its parameters and buffers: every side reads the
    same weights from the same memory (copies of the weights can run some percent apart
    by where they lie), and kernelize leaves weights as they are."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, shared)


#: one row of :func:`model_ratios`: case, then per side (unmodified, kernelized, the
#: unmodified copy) its median ms, then per other side the median and quartiles of its
#: paired ratios to the unmodified side
Row = tuple[str, list[float], list[tuple[float, float, float]]]


def model_ratios(
    family: str,
    compiled: bool,
    rounds: int,
    dtypes: tuple[torch.dtype, ...],
    decode_only: bool = False,
) -> list[Row]:
    """Per dtype and shape: the unmodified model, the kernelized one and the A/A control
    (a second unmodified copy, the noise floor), timed in the same rounds
    (``decode_only``: the decode case alone)."""
    rows: list[Row] = []
    for dtype in dtypes:
        original = _model(family, 256, 4, dtype)
        plain, routed, control = _copy(original), _copy(original), _copy(original)
        del original
        kernelize(routed, mode="compile" if compiled else "inference")
        sides = [torch.compile(m) if compiled else m for m in (plain, routed, control)]
        ids = torch.randint(0, 1024, (4, 128), generator=torch.Generator().manual_seed(0))
        cases: tuple[tuple[str, tuple[Callable[[], Any], ...], int], ...] = (
            ("decode b1, KV cache 8", tuple(_decode_step(m, dtype) for m in sides), 10),
            ("prefill b4 s128", tuple(lambda m=m, i=ids: m(i) for m in sides), 2),
        )
        for shape_name, funcs, inner in cases[:1] if decode_only else cases:
            with torch.no_grad():
                medians, ratios = _interleaved_ms(funcs, rounds, inner)
            mode = "compiled" if compiled else "eager"
            name = f"{mode} {shape_name} {str(dtype).removeprefix('torch.')}"
            spread = [(statistics.median(r), *_quartiles(r)) for r in ratios]
            rows.append((name, medians, spread))
        if compiled:
            torch._dynamo.reset()
    return rows


def guard_eval_us(family: str, dtype: torch.dtype, rounds: int = 7) -> tuple[float, float] | None:
    """``(unmodified, kernelized)``: the microseconds torch.compile's guards take to check
    one compiled decode call of ``family``'s model (the fastest of ``rounds`` runs of 2,000
    checks of the graph the decode step runs, against the frame it was compiled for; each
    side compiled twice, in the order unmodified, kernelized, kernelized, unmodified, the
    faster kept: the same model compiled again in one process checks a few µs slower or
    faster). ``None`` where this torch keeps its guards otherwise (the hook read is
    internal).

    Every call of a compiled model checks them before it runs the graph; what a routed
    module adds (its class, the implementations its forward reads) is kernreg's cost per
    compiled call, apart from the kernels' own time."""
    try:
        guards = importlib.import_module("torch._dynamo.guards")
    except ImportError:
        return None
    profile = getattr(guards, "profile_guard_manager", None)
    if profile is None:
        return None
    compiled: list[tuple[Any, dict[str, Any]]] = []

    def keep(manager: Any, scope: dict[str, Any], n_iters: int) -> float:
        compiled.append((manager, dict(scope)))
        return 0.0

    times: dict[bool, float] = {}
    guards.profile_guard_manager = keep
    try:
        for routed in (False, True, True, False):
            model = _model(family, 256, 4, dtype)
            if routed:
                kernelize(model, mode="compile")
            step = _decode_step(torch.compile(model), dtype)
            compiled.clear()
            with torch.no_grad():
                for _ in range(3):  # the prompt, then the decode graph (then stable)
                    step()
                manager, scope = compiled[-1]
                if not manager.check(scope):
                    return None
                best = float("inf")
                for _ in range(rounds):
                    start = time.perf_counter()
                    for _ in range(2000):
                        manager.check(scope)
                    best = min(best, (time.perf_counter() - start) / 2000 * 1e6)
            times[routed] = min(best, times.get(routed, best))
            torch._dynamo.reset()
    finally:
        guards.profile_guard_manager = profile
    return times[False], times[True]


#: torch's intra-op threads while timing: fixed, so both sides run alike and a busy
#: machine's other processes disturb fewer rounds
THREADS = 1


def _clock() -> float:
    """Seconds of CPU time of this thread (all of torch's work with one intra-op thread)."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def run(quick: bool = False) -> list[dict[str, Any]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return _run(quick)
    finally:
        torch.set_num_threads(threads)


def _run(quick: bool) -> list[dict[str, Any]]:
    # A quick run (the test suite's smoke run) times 500 calls a round: the overhead's
    # three families took 15 s of a 25 s quick run with 2,000.
    number, rounds = (500, 3) if quick else (20_000, 9)
    records: list[dict[str, Any]] = []
    for family in FAMILIES:
        overhead = layer_overhead_ns(number, rounds, family)
        total = sum(overhead.values())
        without = sum(layer_overhead_ns(number, rounds, family, backward=False).values())
        records.append(
            {
                "name": f"kernelize: kernreg overhead per {family} decoder layer "
                "(norms, MLP, rotary), eager CPU",
                "value": total,
                "unit": "ns",
                "budget": f"<= {OVERHEAD_BUDGET_NS:.0f} ns",
                "baseline": "hand-written forward around the same implementations",
                "ratio": None,
                "ok": total <= OVERHEAD_BUDGET_NS,
                "note": ", ".join(f"{k} {v:.0f} ns" for k, v in overhead.items())
                + f"; implementations declaring no backward (the pack's Triton kernels): "
                f"{without:.0f} ns",
            }
        )
    cases: list[tuple[str, Row]] = []
    everything = (torch.float32, torch.bfloat16)
    for family in ("Llama",) if quick else FAMILIES:
        eager = model_ratios(
            family, False, 6 if quick else 36, (torch.float32,) if quick else everything
        )
        cases += [(family, case) for case in eager]
        if not quick:
            cases += [(family, case) for case in model_ratios(family, True, 24, everything)]
    for family in () if quick else FAMILIES:
        found = guard_eval_us(family, torch.float32)
        if found is None:
            continue
        plain, routed = found
        records.append(
            {
                "name": f"torch.compile guard checks per decode call, {family} float32, "
                "kernelized / unmodified",
                "value": routed,
                "unit": "us",
                "budget": None,
                "baseline": f"unmodified {plain:.1f} us",
                "ratio": routed / plain,
                "ok": None,
                "note": "part of every compiled call, before its graph runs: each routed "
                "module's forward set on the instance and its site's table are guarded",
            }
        )
    for family, (case, medians, spread) in cases:
        (ratio, q1, q3), (control, c1, c3) = spread
        records.append(
            {
                "name": f"kernelized / unmodified {family}, {case}",
                "value": medians[1],
                "unit": "ms",
                "budget": f"ratio <= {RATIO_TARGET:.2f}",
                "baseline": f"unmodified {medians[0]:.3f} ms",
                "ratio": ratio,
                "ok": ratio <= RATIO_TARGET,
                "note": f"paired ratios' quartiles {q1:.3f}-{q3:.3f}; A/A control (the "
                f"unmodified model against its copy, same rounds) {control:.3f} "
                f"({c1:.3f}-{c3:.3f})",
            }
        )
        records.append(
            {
                "name": f"A/A control: unmodified copy / unmodified {family}, {case}",
                "value": medians[2],
                "unit": "ms",
                "budget": None,
                "baseline": f"unmodified {medians[0]:.3f} ms",
                "ratio": control,
                "ok": None,
                "note": f"the noise floor of the row above; quartiles {c1:.3f}-{c3:.3f}",
            }
        )
    return records


def _compiled_decode(rounds: int) -> None:
    """Print the compiled decode ratios alone (``--compiled-decode ROUNDS``): more rounds
    than a full run's 24 narrow the spread the A/A control shows."""
    torch.set_num_threads(THREADS)
    for family in FAMILIES:
        rows = model_ratios(family, True, rounds, (torch.float32, torch.bfloat16), True)
        for name, _, spread in rows:
            (ratio, q1, q3), (control, _, _) = spread
            print(
                f"{family} {name}: kernelized / unmodified {ratio:.3f} "
                f"(quartiles {q1:.3f}-{q3:.3f}), A/A control {control:.3f}"
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compiled-decode"]:
        _compiled_decode(int(sys.argv[2]) if len(sys.argv) > 2 else 120)
        sys.exit(0)
    for record in run(quick=False):
        ratio = "" if record["ratio"] is None else f"  ratio {record['ratio']:.3f}"
        print(f"{record['name']}: {record['value']:.3f} {record['unit']}{ratio}  ok={record['ok']}")
        if record.get("note"):
            print(f"    {record['note']}")

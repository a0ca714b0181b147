"""On a CUDA machine: parity of every Triton kernel of the op pack, and RMSNorm bandwidth.

Usage::

    python benchmarks/gpu_check.py [--quick] [--interpret]

Prints the detected platform, a parity table (every implementation eligible on this GPU,
Triton included, against the reference, for float32/float16/bfloat16) and a bandwidth
table for RMSNorm (bytes moved / time, timed with CUDA events, against the device's
theoretical peak memory bandwidth). Exits 0 when everything agrees; 1 on a mismatch, or
when a Triton kernel did not run on a GPU that meets its requirements (triton missing);
0 with a message on a machine without CUDA (nothing to measure there). ``--interpret``
on such a machine checks the Triton kernels' parity through Triton's interpreter instead
(the same check as ``kernreg parity --all --interpret``; no timing).

With transformers installed it also times tiny Llama, Qwen3 and Gemma models (hidden
1024, 4 layers, random weights) on the GPU, kernelized against unmodified, eager:
decode (batch 1, one token on a 64-token KV cache) and prefill (batch 4, seq 512), the
median of the paired ratios of interleaved rounds (CUDA synchronised around each round),
with an A/A control (a second unmodified copy) as the noise floor.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

PARITY_SEEDS = (0, 1, 2, 3)
PARITY_DTYPES = ("float32", "float16", "bfloat16")
SHAPES = ((4096, 4096), (16384, 8192), (32768, 4096))


def _peak_bandwidth_gbs(torch: Any) -> float | None:
    """Theoretical DRAM bandwidth: 2 (DDR) x memory clock x bus width, where torch exposes them."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * (bus_bits / 8) / 1e9


def _time_ms(torch: Any, fn: Any, iters: int) -> tuple[float, float]:
    """GPU ms per call (CUDA events), and the host's ms per call to issue it: where the
    two are alike, the host's launch, not the kernel, sets the pace."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    issued = time.perf_counter()
    for _ in range(iters):
        fn()
    issued = time.perf_counter() - issued
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / iters, issued * 1e3 / iters


def _parity(quick: bool, *, interpret: bool = False, triton_expected: bool = True) -> bool:
    """The parity table of every op of the pack; whether all agree (and, when
    ``triton_expected``, every op's Triton kernel ran for every dtype)."""
    import kernreg
    import kernreg_ops
    from kernreg.torch import check_parity

    ok = True
    # Every op's kernels, the new ones included (moe.experts has no Triton kernel).
    with_triton = {s.op for s in kernreg.default_registry().all_specs() if s.backend == "triton"}
    print(f"{'OP':<38}{'IMPLEMENTATION':<16}{'DTYPE':<10}{'STATUS':<9}{'MAX ABS ERR':<13}DETAIL")
    for op in sorted(kernreg_ops.OPS):
        report = check_parity(
            op,
            dtypes=PARITY_DTYPES,
            seeds=PARITY_SEEDS[:1] if quick else PARITY_SEEDS,
            interpret=interpret,
        )
        ok = ok and report.ok
        ran = {
            r.dtype for r in report.results if r.implementation == "triton" and r.status == "pass"
        }
        if triton_expected and op in with_triton and ran != set(PARITY_DTYPES):
            missing = ", ".join(d for d in PARITY_DTYPES if d not in ran)
            print(f"{op}: the Triton kernel did not pass for {missing}")
            ok = False
        grouped: dict[tuple[str, str], list[Any]] = {}
        for r in report.results:
            grouped.setdefault((r.implementation, r.dtype), []).append(r)
        for (impl, dtype), results in grouped.items():
            order = {"pass": 0, "skipped": 1, "fail": 2, "error": 3}
            worst = max(results, key=lambda r: order[r.status])
            errs = [r.max_abs_error for r in results if r.max_abs_error is not None]
            err = f"{max(errs):.3g}" if errs else "-"
            print(f"{op:<38}{impl:<16}{dtype:<10}{worst.status:<9}{err:<13}{worst.message[:70]}")
    return ok


def _bandwidth(torch: Any, quick: bool) -> None:
    from kernreg_ops import _aten, reference

    implementations: dict[str, Any] = {
        "torch (reference)": reference.rmsnorm,
        "aten": _aten.rmsnorm,
    }
    try:
        from kernreg_ops import _triton
    except ImportError as exc:
        print(f"triton: not measured ({exc})")
    else:
        implementations["triton"] = _triton.rmsnorm
    peak = _peak_bandwidth_gbs(torch)
    peak_text = f"{peak:.0f} GB/s" if peak else "unknown"
    print(f"\nRMSNorm bandwidth (bytes read + written / time; device peak {peak_text})")
    print(
        f"{'SHAPE':<16}{'DTYPE':<10}{'IMPLEMENTATION':<20}{'TIME (us)':<12}{'GB/s':<10}"
        f"{'% OF PEAK':<11}HOST (us)"
    )
    iters = 20 if quick else 100
    for rows, hidden in SHAPES[:1] if quick else SHAPES:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
            w = torch.randn(hidden, device="cuda", dtype=dtype)
            moved = 2 * x.numel() * x.element_size() + w.numel() * w.element_size()
            for name, fn in implementations.items():
                ms, host = _time_ms(torch, lambda fn=fn, x=x, w=w: fn(x, w, 1e-6), iters)
                gbs = moved / (ms * 1e-3) / 1e9
                share = f"{100 * gbs / peak:.0f}%" if peak else "-"
                shape = f"{rows}x{hidden}"
                dt = str(dtype).removeprefix("torch.")
                print(
                    f"{shape:<16}{dt:<10}{name:<20}{ms * 1e3:<12.1f}{gbs:<10.0f}{share:<11}"
                    f"{host * 1e3:.1f}"
                )


def _model_latency(torch: Any, quick: bool) -> bool:
    """Kernelized / unmodified latency on the GPU; whether kernelized logits match."""
    try:
        import bench_model
    except ImportError as exc:  # transformers missing
        print(f"\nmodel latency: not measured ({exc})")
        return True
    import statistics

    from kernreg.torch import kernelize

    ok = True
    rounds, prompt = (5 if quick else 15), 64
    print("\nKernelized / unmodified latency on the GPU (eager; A/A: a second unmodified copy)")
    print(f"{'CASE':<40}{'UNMODIFIED (ms)':<17}{'RATIO':<8}{'A/A':<8}ROUTED")
    for family in ("Llama", "Qwen3", "Gemma"):
        for dtype in (torch.bfloat16, torch.float32):
            original = bench_model._model(family, 1024, 4, dtype).to("cuda")
            sides = [bench_model._copy(original) for _ in range(3)]
            report = kernelize(sides[1])
            routed = [f"{op}={impl}" for op, impl in report.summary()]
            rejected = [r for r in report.rows if r.status == "rejected"]
            for r in rejected:
                print(f"{family} {dtype}: {r.path} rejected: {r.reason}")
            ids = torch.randint(0, 1024, (4, 512), device="cuda")
            with torch.no_grad():
                want, got = sides[0](ids).logits.float(), sides[1](ids).logits.float()
            error = float((want - got).abs().max())
            tolerance = 1e-3 if dtype == torch.float32 else 0.25
            if error > tolerance:
                print(f"{family} {dtype}: kernelized logits differ by {error:.3g}")
                ok = False
            cases = {
                "decode b1, KV cache 64": ([_decode(torch, m, prompt) for m in sides], 20),
                "prefill b4 s512": ([lambda m=m, i=ids: m(i) for m in sides], 3),
            }
            for case, (funcs, inner) in cases.items():
                times: list[list[float]] = [[], [], []]
                with torch.no_grad():
                    for func in funcs:
                        for _ in range(3):
                            func()
                    for i in range(rounds):
                        for side in bench_model._order(i, 3):
                            torch.cuda.synchronize()
                            start = time.perf_counter()
                            for _ in range(inner):
                                funcs[side]()
                            torch.cuda.synchronize()
                            times[side].append((time.perf_counter() - start) / inner * 1e3)
                ratio, control = (
                    statistics.median(b / a for a, b in zip(times[0], times[k], strict=True))
                    for k in (1, 2)
                )
                name = f"{family} {case} {str(dtype).removeprefix('torch.')}"
                base = statistics.median(times[0])
                print(f"{name:<40}{base:<17.3f}{ratio:<8.3f}{control:<8.3f}{', '.join(routed)}")
            del original, sides
    _breakdown(torch, rounds)
    return ok


#: Llama decode, bfloat16: what each route costs (one op pinned to another implementation)
BREAKDOWN = {
    "every op on its default": {},
    "layernorm.rmsnorm=aten": {"layernorm.rmsnorm@*": "aten"},
    "activation.silu_mul=torch": {"activation.silu_mul@*": "torch"},
    "embedding.rotary_cos_sin=torch": {"embedding.rotary_cos_sin@*": "torch"},
    "every op on its reference": {"*@*": "torch"},
}


def _breakdown(torch: Any, rounds: int) -> None:
    """Llama decode on the GPU with each op pinned in turn, against the unmodified model:
    which route gains, which costs (the reference pins measure kernreg's routing alone)."""
    import statistics

    import bench_model
    from kernreg.torch import kernelize

    original = bench_model._model("Llama", 1024, 4, torch.bfloat16).to("cuda")
    sides = [bench_model._copy(original) for _ in range(len(BREAKDOWN) + 1)]
    for model, pins in zip(sides[1:], BREAKDOWN.values(), strict=True):
        kernelize(model, pin=pins)
    funcs = [_decode(torch, m, 64) for m in sides]
    times: list[list[float]] = [[] for _ in sides]
    with torch.no_grad():
        for func in funcs:
            for _ in range(3):
                func()
        for i in range(rounds):
            for side in bench_model._order(i, len(sides)):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(20):
                    funcs[side]()
                torch.cuda.synchronize()
                times[side].append((time.perf_counter() - start) / 20 * 1e3)
    print(
        "\nLlama decode b1 bfloat16 (KV cache 64), one op pinned at a time: kernelized / unmodified"
    )
    for name, side in zip(BREAKDOWN, times[1:], strict=True):
        ratio = statistics.median(b / a for a, b in zip(times[0], side, strict=True))
        print(f"{name:<40}{ratio:.3f}")
    # Host time per call of one RMSNorm at the decode shape (1 token, hidden 1024).
    from kernreg_ops import _aten

    norm = original.model.layers[0].input_layernorm
    routed = sides[1].model.layers[0].input_layernorm
    x = torch.randn(1, 1, norm.weight.shape[0], device="cuda", dtype=torch.bfloat16)
    calls = {
        "own forward (unmodified)": lambda: norm(x),
        "kernelized module": lambda: routed(x),
        "aten implementation, direct": lambda: _aten.rmsnorm(x, norm.weight, 1e-6),
    }
    try:
        from kernreg_ops import _triton
    except ImportError:  # said above: the Triton kernels cannot run here
        pass
    else:
        calls["triton implementation, direct"] = lambda: _triton.rmsnorm(x, norm.weight, 1e-6)
    print("RMSNorm at the decode shape (1x1x1024 bfloat16): host us per call")
    with torch.no_grad():
        for name, call in calls.items():
            _, host = _time_ms(torch, call, 2000)
            print(f"{name:<40}{host * 1e3:.1f}")


def _decode(torch: Any, model: Any, prompt: int) -> Any:
    """One new token on a KV cache of ``prompt`` tokens (cut back after each step)."""
    import inspect

    import transformers

    cache = transformers.DynamicCache(config=model.config)
    # ``cache`` since transformers 5.2x; ``past_key_values`` before (now deprecated)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    token = torch.randint(0, 1024, (1, 1), device="cuda")
    with torch.no_grad():
        prompt_ids = torch.randint(0, 1024, (1, prompt), device="cuda")
        model(prompt_ids, use_cache=True, **{name: cache})

    def step() -> Any:
        out = model(token, use_cache=True, **{name: cache})
        cache.crop(-1)
        return out

    return step


def _interpreted(quick: bool) -> int:
    """Parity of the Triton kernels through Triton's interpreter, on CPU."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        print("gpu_check --interpret: triton is not installed (pip install triton)")
        return 1
    from kernreg.torch.parity import INTERPRETED_NOTE, enable_triton_interpreter

    enable_triton_interpreter()
    print(f"no CUDA device: Triton kernels {INTERPRETED_NOTE}")
    ok = _parity(quick, interpret=True)
    print("\nparity: " + ("every Triton kernel agrees with the reference" if ok else "MISMATCH"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases and iterations")
    parser.add_argument(
        "--interpret",
        action="store_true",
        help="without a CUDA device: check the Triton kernels through Triton's interpreter",
    )
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed; nothing to check on this machine")
        return 0
    if not torch.cuda.is_available():
        if args.interpret:
            return _interpreted(args.quick)
        print(
            "gpu_check: no CUDA device available, so nothing to measure on this machine "
            "(--interpret checks the Triton kernels' parity through Triton's interpreter)"
        )
        return 0
    import kernreg

    platform = kernreg.Platform.detect()
    name = torch.cuda.get_device_name()
    print(f"platform: {platform} [{platform.source}] {name}, torch {torch.__version__}")
    try:
        import triton

        print(f"triton {triton.__version__}")
        has_triton = True
    except ImportError:
        print("triton is not installed: the Triton kernels cannot run (pip install triton)")
        has_triton = False
    # The pack's Triton kernels need SM 8.0+; below that their rows are skipped, rightly.
    capable = platform.device == "cuda" and (platform.arch or (0, 0)) >= (8, 0)
    ok = _parity(args.quick, triton_expected=capable) and (has_triton or not capable)
    _bandwidth(torch, args.quick)
    ok = _model_latency(torch, args.quick) and ok
    print("\nparity: " + ("all implementations agree with the reference" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

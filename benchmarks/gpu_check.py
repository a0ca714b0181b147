"""On a CUDA machine: parity of every Triton kernel of the op pack, and RMSNorm bandwidth.

Usage::

    python benchmarks/gpu_check.py [--quick] [--interpret] [--max-seconds N]

Prints the detected platform, a parity table (every implementation eligible on this GPU,
Triton included, against the reference, for float32/float16/bfloat16) and a bandwidth
table for RMSNorm (bytes moved / time, timed with CUDA events, against the device's
theoretical peak memory bandwidth). Exits 0 when everything agrees; 1 on a mismatch, or
when a Triton kernel did not run on a GPU that meets its requirements (triton missing);
0 with a message on a machine without CUDA (nothing to measure there). ``--interpret``
on such a machine checks the Triton kernels' parity through Triton's interpreter instead
(the same check as ``kernreg parity --all --interpret``; no timing).

With transformers installed it also times tiny Llama, Qwen3 and Gemma models (hidden
1024, 4 layers, random weights) on the GPU, kernelized against unmodified, eager and then
under ``torch.compile``: decode (batch 1, one token on a 64-token KV cache) and prefill
(batch 4, seq 512), the median of the paired ratios of interleaved rounds (CUDA
synchronised around each round), with an A/A control (a second unmodified copy) as the
noise floor in eager mode; then Llama decode with one op pinned at a time. Compiling
takes tens of seconds a case: ``--max-seconds`` begins no model case after that many
seconds and names the ones it left out.
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


def _paired_ratios(torch: Any, funcs: list[Any], rounds: int, inner: int) -> list[float]:
    """Per side after the first: the median of its paired ratios to the first side over
    ``rounds`` interleaved rounds of ``inner`` calls (CUDA synchronised around each), and
    the first side's median ms up front."""
    import statistics

    import bench_model

    times: list[list[float]] = [[] for _ in funcs]
    with torch.no_grad():
        for func in funcs:
            for _ in range(3):
                func()
        for i in range(rounds):
            for side in bench_model._order(i, len(funcs)):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(inner):
                    funcs[side]()
                torch.cuda.synchronize()
                times[side].append((time.perf_counter() - start) / inner * 1e3)
    return [statistics.median(times[0])] + [
        statistics.median(b / a for a, b in zip(times[0], side, strict=True)) for side in times[1:]
    ]


def _model_latency(torch: Any, quick: bool, deadline: float) -> bool:
    """Kernelized / unmodified latency on the GPU, eager then compiled; whether kernelized
    logits match. Cases not begun by ``deadline`` (``time.monotonic()``) are named, not run."""
    try:
        import bench_model  # noqa: F401 (imports transformers)
    except ImportError as exc:  # transformers missing
        print(f"\nmodel latency: not measured ({exc})")
        return True
    ok = True
    rounds, prompt = (5 if quick else 15), 64
    print(
        "\nKernelized / unmodified latency on the GPU (A/A: a second unmodified copy, eager "
        "only; compiled: torch.compile of both, kernelize(mode='compile'))"
    )
    print(f"{'CASE':<48}{'UNMODIFIED (ms)':<17}{'RATIO':<8}{'A/A':<8}ROUTED")
    for compiled in (False, True):
        for family in ("Llama", "Qwen3", "Gemma"):
            for dtype in (torch.bfloat16, torch.float32):
                name = f"{'compiled' if compiled else 'eager'} {family}"
                name += f" {str(dtype).removeprefix('torch.')}"
                if time.monotonic() > deadline:
                    print(f"{name:<48}not measured: --max-seconds reached")
                    continue
                ok = _model_case(torch, family, dtype, compiled, rounds, prompt) and ok
                if compiled:
                    torch._dynamo.reset()
    if time.monotonic() < deadline:
        _breakdown(torch, rounds)
    return ok


def _model_case(
    torch: Any, family: str, dtype: Any, compiled: bool, rounds: int, prompt: int
) -> bool:
    """One family and dtype: decode and prefill rows; whether the logits matched."""
    import bench_model
    from kernreg.torch import kernelize

    original = bench_model._model(family, 1024, 4, dtype).to("cuda")
    sides = [bench_model._copy(original) for _ in range(2 if compiled else 3)]
    report = kernelize(sides[1], mode="compile" if compiled else "inference")
    routed = [f"{op}={impl}" for op, impl in report.summary()]
    for r in report.rows:
        if r.status == "rejected":
            print(f"{family} {dtype}: {r.path} rejected: {r.reason}")
    ids = torch.randint(0, 1024, (4, 512), device="cuda")
    ok = True
    with torch.no_grad():
        want, got = sides[0](ids).logits.float(), sides[1](ids).logits.float()
    error = float((want - got).abs().max())
    tolerance = 1e-3 if dtype == torch.float32 else 0.25
    if error > tolerance:
        print(f"{family} {dtype}: kernelized logits differ by {error:.3g}")
        ok = False
    if compiled:
        sides = [torch.compile(m) for m in sides]
    cases = {
        "decode b1, KV cache 64": ([_decode(torch, m, prompt) for m in sides], 20),
        "prefill b4 s512": ([lambda m=m, i=ids: m(i) for m in sides], 3),
    }
    mode = "compiled" if compiled else "eager"
    for case, (funcs, inner) in cases.items():
        base, ratio, *control = _paired_ratios(torch, funcs, rounds, inner)
        name = f"{mode} {family} {case} {str(dtype).removeprefix('torch.')}"
        aa = f"{control[0]:.3f}" if control else "-"
        print(f"{name:<48}{base:<17.3f}{ratio:<8.3f}{aa:<8}{', '.join(routed)}")
    return ok


#: Llama decode, bfloat16: what each route costs (one op pinned to another implementation)
BREAKDOWN = {
    "every op on its default": {},
    "layernorm.rmsnorm=triton": {"layernorm.rmsnorm@*": "triton"},
    "activation.silu_mul=triton": {"activation.silu_mul@*": "triton"},
    "embedding.rotary_cos_sin=native": {"embedding.rotary_cos_sin@*": "native"},
    "every op on its reference": {"*@*": "torch"},
}


def _breakdown(torch: Any, rounds: int) -> None:
    """Llama decode on the GPU with each op pinned in turn, against the unmodified model:
    which route gains, which costs (the reference pins measure kernreg's routing alone)."""
    import bench_model
    from kernreg import KernregError
    from kernreg.torch import kernelize

    original = bench_model._model("Llama", 1024, 4, torch.bfloat16).to("cuda")
    sides, names = [bench_model._copy(original)], []
    print(
        "\nLlama decode b1 bfloat16 (KV cache 64), one op pinned at a time: kernelized / unmodified"
    )
    for name, pins in BREAKDOWN.items():
        model = bench_model._copy(original)
        try:
            kernelize(model, pin=pins)
        except KernregError as exc:  # a pinned implementation cannot run here (no triton)
            print(f"{name:<40}not measured: {str(exc).splitlines()[0]}")
            continue
        sides.append(model)
        names.append(name)
    _, *ratios = _paired_ratios(torch, [_decode(torch, m, 64) for m in sides], rounds, 20)
    for name, ratio in zip(names, ratios, strict=True):
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
        "--max-seconds",
        type=float,
        default=None,
        help="begin no model case after this many seconds (the rest are named, not run)",
    )
    parser.add_argument(
        "--interpret",
        action="store_true",
        help="without a CUDA device: check the Triton kernels through Triton's interpreter",
    )
    args = parser.parse_args(argv)
    if args.max_seconds is not None and not args.max_seconds >= 0:  # NaN and negatives
        parser.error(f"--max-seconds takes a number of seconds >= 0, not {args.max_seconds}")
    started = time.monotonic()
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
    limited = args.max_seconds is not None  # 0: no model case at all
    deadline = started + args.max_seconds if limited else float("inf")
    ok = _model_latency(torch, args.quick, deadline) and ok
    print("\nparity: " + ("all implementations agree with the reference" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

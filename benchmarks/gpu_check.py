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
"""

from __future__ import annotations

import argparse
import sys
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


def _time_ms(torch: Any, fn: Any, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / iters


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
    print(f"{'SHAPE':<16}{'DTYPE':<10}{'IMPLEMENTATION':<20}{'TIME (us)':<12}{'GB/s':<10}% OF PEAK")
    iters = 20 if quick else 100
    for rows, hidden in SHAPES[:1] if quick else SHAPES:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
            w = torch.randn(hidden, device="cuda", dtype=dtype)
            moved = 2 * x.numel() * x.element_size() + w.numel() * w.element_size()
            for name, fn in implementations.items():
                ms = _time_ms(torch, lambda fn=fn, x=x, w=w: fn(x, w, 1e-6), iters)
                gbs = moved / (ms * 1e-3) / 1e9
                share = f"{100 * gbs / peak:.0f}%" if peak else "-"
                shape = f"{rows}x{hidden}"
                dt = str(dtype).removeprefix("torch.")
                print(f"{shape:<16}{dt:<10}{name:<20}{ms * 1e3:<12.1f}{gbs:<10.0f}{share}")


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
    print("\nparity: " + ("all implementations agree with the reference" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""``kernelize(model)`` wall time, side by side with Hugging Face ``kernels``' ``kernelize``.

Usage::

    python benchmarks/bench_kernelize.py [--quick] [--cache-dir DIR] [--no-install]

Figures, on the tiny Llama of ``bench_model`` (hidden 256, 4 layers, random weights, CPU):

* **kernreg, ``verify=False``** against **HF ``kernels`` 0.17.2** on the same model
  (budget: no slower), both the median of repeated calls on a model already kernelized
  once (what a second ``kernelize`` costs; the first also imports the implementations),
  each timed in its thread's CPU time with GC off; the ratio is the median of the rounds'
  paired ratios (each round runs HF's side, then kernreg's), with their range.
  HF's side maps the layers transformers tags in Llama (``RMSNorm`` and the
  ``rotary_pos_emb`` function) to layers defined in its script, so it swaps forwards like
  kernreg does instead of falling back. kernreg routes more (the gated MLPs too) and
  writes a report row per site.
* **kernreg, ``verify=True``**: the first call in a fresh process (every swap verified on
  probe inputs) for 4 and 32 decoder layers; the 32-layer one may cost at most 2x the
  4-layer one (verification is cached per layer kind, not per layer); and a repeated call.

HF ``kernels`` 0.17.2 runs only with transformers <= 5.22 (newer ones disable it), so
its side runs in an environment of its own, created under the cache directory
(``KERNREG_BENCH_CACHE``, else ``~/.cache/kernreg-bench``) by
``python benchmarks/bench_kernelize.py``: ``pip install kernels==0.17.2
'transformers<=5.22' torch`` with torch constrained to this process's build exactly
(``torch==2.13.0+cpu``, so pip never fetches a CUDA build); where a step fails the
figure says which and why. ``benchmarks/run.py`` never installs: without
that environment (or where installing failed), the comparison row says it was skipped and
why, and carries kernreg's figure alone.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import transformers

from kernreg.torch import kernelize, unkernelize

HF_KERNELS = "kernels==0.17.2"
HF_TRANSFORMERS = "transformers<=5.22"
DEPTH_GROWTH_BUDGET = 2.0
#: the model both sides kernelize (bench_model's tiny Llama)
CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
}

#: HF's side, run with the interpreter of its own environment: argv = config JSON, calls
HF_SCRIPT = r'''
import gc, json, logging, statistics, sys, time, warnings
warnings.simplefilter("ignore")
logging.disable(logging.WARNING)
import torch, transformers
from kernels import Mode, kernelize, use_kernel_mapping


class RMSNorm(torch.nn.Module):
    def forward(self, hidden_states):
        return torch.nn.functional.rms_norm(
            hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon
        )


class Rotary(torch.nn.Module):
    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

        def rotate(x):
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((-x2, x1), dim=-1)

        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


class InProcess:
    """A layer repository whose layer is defined here (nothing downloaded)."""

    def __init__(self, layer):
        self.layer = layer

    def load(self):
        return self.layer

    def __hash__(self):
        return hash(self.layer)

    def __eq__(self, other):
        return isinstance(other, InProcess) and other.layer is self.layer


config = transformers.LlamaConfig(**json.loads(sys.argv[1]))
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).eval()
mapping = {"RMSNorm": {"cpu": InProcess(RMSNorm)}, "rotary_pos_emb": {"cpu": InProcess(Rotary)}}
with use_kernel_mapping(mapping):
    kernelize(model, mode=Mode.INFERENCE, device="cpu")
    times = []
    gc.collect()
    gc.disable()  # as on kernreg's side: the same clock, GC off while timed
    for _ in range(int(sys.argv[2])):
        start = time.thread_time()
        kernelize(model, mode=Mode.INFERENCE, device="cpu")
        times.append(time.thread_time() - start)
    gc.enable()
assert model.model.norm.forward.__func__ is RMSNorm.forward, "HF kernelize swapped nothing"
print(json.dumps({"ms": statistics.median(times) * 1e3}))
'''

#: kernreg's first kernelize in a fresh process: argv = config JSON; prints ms
COLD_SCRIPT = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
import torch, transformers
from kernreg.torch import kernelize
torch.set_num_threads(1)  # the probes' ops, alike from run to run on a shared machine
config = transformers.LlamaConfig(**json.loads(sys.argv[1]))
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).eval()
kernelize(transformers.LlamaForCausalLM(transformers.LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
    num_key_value_heads=1, vocab_size=64)), verify=False)  # imports the implementations
start = time.perf_counter()
report = kernelize(model)
ms = (time.perf_counter() - start) * 1e3
assert report.rejected == () and len(report.routed) == len(report.rows), str(report)
print(json.dumps({"ms": ms}))
"""


def default_cache_dir() -> Path:
    env = os.environ.get("KERNREG_BENCH_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kernreg-bench"


def hf_python(cache_dir: Path) -> Path:
    return cache_dir / "hf-kernels-0.17.2" / "bin" / "python"


def hf_environment(cache_dir: Path, install: bool) -> tuple[Path | None, str]:
    """HF's interpreter, or ``None`` and why there is none (installing it if asked).

    The environment gets this process's torch build exactly (``torch==2.13.0+cpu`` here,
    through a constraints file), never whatever pip would pick for ``torch`` (a CUDA build
    of several GB): where pip cannot find that build (no local wheel, no index carrying
    it) the reason says so and how to point pip at one.
    """
    root = cache_dir / "hf-kernels-0.17.2"
    python = hf_python(cache_dir)
    ready = root / "ready"
    if ready.is_file() and python.is_file():
        return python, ""
    if not install:
        return None, (
            f"HF {HF_KERNELS} has no environment in {cache_dir} "
            "(create it with: python benchmarks/bench_kernelize.py)"
        )
    torch_pin = f"torch=={torch.__version__}"  # the local build (+cpu), not CUDA's
    steps = [
        ("create a venv", [sys.executable, "-m", "venv", str(root)]),
        (
            f"pip install {HF_KERNELS} '{HF_TRANSFORMERS}' with {torch_pin}",
            [
                str(python),
                "-m",
                "pip",
                "install",
                "-q",
                "-c",
                str(root / "constraints.txt"),
                HF_KERNELS,
                HF_TRANSFORMERS,
                "torch",
            ],
        ),
        ("import kernels", [str(python), "-c", HF_CHECK, torch.__version__]),
    ]
    root.mkdir(parents=True, exist_ok=True)
    (root / "constraints.txt").write_text(torch_pin + "\n", encoding="utf-8")
    for what, step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"could not create HF's environment ({what}): {exc}"
        if done.returncode != 0:
            return None, f"could not create HF's environment ({what}): {_why(done, torch_pin)}"
    ready.write_text(f"{HF_KERNELS} {HF_TRANSFORMERS} {torch_pin}\n", encoding="utf-8")
    return python, ""


#: run in HF's environment once installed: argv = the torch version it must have
HF_CHECK = r"""
import sys, warnings
warnings.simplefilter("ignore")
import kernels, torch, transformers
assert torch.__version__ == sys.argv[1], f"torch {torch.__version__}, not {sys.argv[1]}"
print(kernels.__version__, transformers.__version__, torch.__version__)
"""


def _why(done: subprocess.CompletedProcess[str], torch_pin: str) -> str:
    """The telling line of a failed step's output (pip's ``ERROR:`` line, else the last)."""
    lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    why = (errors or lines or ["(no output)"])[0 if errors else -1]
    if "torch" in why and ("No matching distribution" in why or "Could not find" in why):
        why += (
            f" (pip cannot find this process's {torch_pin}: put its wheel in PIP_FIND_LINKS,"
            " or set PIP_EXTRA_INDEX_URL to an index carrying it, e.g."
            " https://download.pytorch.org/whl/cpu)"
        )
    return why


def hf_kernelize_ms(python: Path, calls: int) -> tuple[float | None, str]:
    """HF's median ``kernelize`` time on the tiny Llama, or ``None`` and why not."""
    try:
        done = subprocess.run(
            [str(python), "-c", HF_SCRIPT, json.dumps(CONFIG), str(calls)],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"HF's kernelize did not run: {exc}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None, f"HF's kernelize failed: {last}"
    return float(json.loads(done.stdout.strip().splitlines()[-1])["ms"]), ""


def _llama(layers: int = 4) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": layers})
    return transformers.LlamaForCausalLM(config).eval()


def kernreg_kernelize_ms(model: Any, verify: bool, calls: int) -> float:
    """kernreg's median ``kernelize`` time on ``model`` (kernelized once before), in this
    thread's CPU time with GC off, as HF's side is timed."""
    kernelize(model, verify=verify)
    times = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(calls):
            start = time.thread_time()
            kernelize(model, verify=verify)
            times.append(time.thread_time() - start)
    finally:
        gc.enable()
    return statistics.median(times) * 1e3


def kernreg_fresh_ms(model: Any, calls: int) -> float:
    """kernreg's median ``kernelize(model, verify=False)`` on ``model`` unkernelized before
    each call (untimed): every site made anew, nothing of the model's routing kept; what
    the process learnt before (decisions, loaded implementations) still counts. Timed as
    :func:`kernreg_kernelize_ms`."""
    kernelize(model, verify=False)
    times = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(calls):
            unkernelize(model)
            start = time.thread_time()
            kernelize(model, verify=False)
            times.append(time.thread_time() - start)
    finally:
        gc.enable()
    return statistics.median(times) * 1e3


def cold_kernelize_ms(layers: int) -> float:
    """kernreg's first ``kernelize(model)`` (verification on) in a fresh process."""
    config = {**CONFIG, "num_hidden_layers": layers}
    done = subprocess.run(
        [sys.executable, "-c", COLD_SCRIPT, json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return float(json.loads(done.stdout.strip().splitlines()[-1])["ms"])


def compare(cache_dir: Path, *, quick: bool, install: bool) -> list[dict[str, Any]]:
    """The records; a quick run measures kernreg in this process only (no HF side, no
    fresh processes)."""
    calls, rounds = (50, 1) if quick else (200, 5)
    model = _llama()
    python, why = hf_environment(cache_dir, install)
    if quick:
        python, why = None, "not measured in a quick run"
    ours: list[float] = []
    fresh: list[float] = []
    theirs: list[float] = []
    for _ in range(rounds):  # interleaved: HF, kernreg, HF, kernreg, ...
        if python is not None:
            hf_ms, why = hf_kernelize_ms(python, calls)
            if hf_ms is None:
                python = None
            else:
                theirs.append(hf_ms)
        ours.append(kernreg_kernelize_ms(model, False, calls))
        fresh.append(kernreg_fresh_ms(model, calls))
    ms = statistics.median(ours)
    fresh_ms = statistics.median(fresh)
    name = "kernelize() of a tiny Llama (4 layers), verify=False"
    # Each round's ratio pairs the two sides measured back to back (under the same load).
    paired = [a / b for a, b in zip(ours, theirs, strict=False)]
    paired_fresh = [a / b for a, b in zip(fresh, theirs, strict=False)]
    if theirs:
        hf = statistics.median(theirs)
        vs_hf: dict[str, Any] = {
            "name": f"{name}, vs HF {HF_KERNELS}",
            "value": ms,
            "unit": "ms",
            "budget": "<= HF kernels",
            "baseline": f"HF kernelize = {hf:.3f} ms",
            "ratio": statistics.median(paired),
            "ok": statistics.median(paired) <= 1.0,
            "note": f"median of the paired ratios of {rounds} interleaved rounds of {calls} "
            f"calls each (range {min(paired):.2f}-{max(paired):.2f}); both sides timed in "
            "their thread's CPU time, GC off",
        }
    else:
        vs_hf = {
            "name": f"{name}, vs HF {HF_KERNELS}",
            "value": ms,
            "unit": "ms",
            "budget": None,
            "baseline": None,
            "ratio": None,
            "ok": None,
            "note": f"HF side skipped: {why}",
        }
    warm_verified = kernreg_kernelize_ms(model, True, calls // 5)
    hf_median = statistics.median(theirs) if theirs else None
    records = [
        vs_hf,
        {
            "name": f"{name}, model not kernelized before (after unkernelize)",
            "value": fresh_ms,
            "unit": "ms",
            "budget": None if hf_median is None else "<= HF kernels",
            "baseline": vs_hf["baseline"],
            "ratio": None if hf_median is None else statistics.median(paired_fresh),
            "ok": None if hf_median is None else statistics.median(paired_fresh) <= 1.0,
            "note": "every site made anew (HF's kernelize always does its whole work)"
            + (
                f"; paired ratios' range {min(paired_fresh):.2f}-{max(paired_fresh):.2f}"
                if paired_fresh
                else ""
            ),
        },
        {
            "name": "kernelize() of a tiny Llama (4 layers), verify=True, again",
            "value": warm_verified,
            "unit": "ms",
            "budget": None,
            "baseline": f"verify=False = {ms:.3f} ms",
            "ratio": warm_verified / ms,
            "ok": None,
        },
    ]
    if quick:
        return records
    # The median of three fresh processes a depth, interleaved (4, 32, 4, 32, ...).
    runs: dict[int, list[float]] = {4: [], 32: []}
    for _ in range(3):
        for layers, times in runs.items():
            times.append(cold_kernelize_ms(layers))
    cold = {layers: statistics.median(times) for layers, times in runs.items()}
    growth = cold[32] / cold[4]
    return [
        *records,
        {
            "name": "kernelize() of a tiny Llama, verify=True, first call, 32 layers",
            "value": cold[32],
            "unit": "ms",
            "budget": f"<= {DEPTH_GROWTH_BUDGET:g}x 4 layers",
            "baseline": f"4 layers = {cold[4]:.1f} ms",
            "ratio": growth,
            "ok": growth <= DEPTH_GROWTH_BUDGET,
            "note": "median of 3 fresh processes each (one intra-op thread), implementations "
            "imported first; every swap verified",
        },
    ]


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Records for ``benchmarks/run.py`` (HF's environment is never installed here)."""
    return compare(default_cache_dir(), quick=quick, install=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="kernreg only: few calls, one round")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where HF's venv is kept")
    parser.add_argument(
        "--no-install", action="store_true", help="skip HF's side unless its venv exists"
    )
    args = parser.parse_args(argv)
    cache_dir = args.cache_dir or default_cache_dir()
    for record in compare(cache_dir, quick=args.quick, install=not args.no_install):
        ratio = "" if record["ratio"] is None else f"  ratio {record['ratio']:.2f}"
        baseline = "" if record["baseline"] is None else f"  ({record['baseline']})"
        print(f"{record['name']}: {record['value']:.3f} {record['unit']}{baseline}{ratio}")
        if record.get("note"):
            print(f"    {record['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

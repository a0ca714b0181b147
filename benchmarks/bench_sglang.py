"""kernreg against sglang's kernel registry, side by side in one process.

Usage::

    python benchmarks/bench_sglang.py [--quick] [--cache-dir DIR] [--json out.json]

The peer is the ``sglang/kernels/`` registry of the sglang 0.5.23 wheel: its modules
``spec``, ``registry``, ``selector`` and ``fused_op`` (with ``kernel_api_logging``, which
``fused_op`` imports). The first run fetches the wheel with ``pip download --no-deps``
into the cache directory (``KERNREG_BENCH_CACHE``, else ``~/.cache/kernreg-bench``),
unpacks only ``sglang/kernels/``, and installs ``msgspec`` there with ``pip install
--target`` when the running interpreter lacks it; nothing is installed into the
environment. The package ``__init__`` files are replaced by empty module objects, so
only those modules are loaded; the lazy platform hooks of ``fused_op`` that reach into
``sglang.srt`` are answered with "no platform forward", as on a plain CPU box.

Method: both systems do the same work (same op ids, same target strings, the same
capability/requirement objects shared between specs), every result is checked before
it is timed, and the two are measured in interleaved rounds (A, B, A, B, ...), keeping
each one's best round. Per-call figures use ``bench_core.per_call_ns`` (empty loop
subtracted, GC off); bulk figures are wall-clock per spec with the GC paused; memory is
what ``tracemalloc`` still sees allocated after the registry is filled, per spec (the
strings the specs are built from exist before the measurement starts).

``benchmarks/run.py`` includes these figures when the peer is already in the cache;
otherwise it reports this module as skipped (it never downloads).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import tracemalloc
import types
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernreg
from bench_core import per_call_ns
from kernreg import KernelRegistry, KernelSpec, Platform, Requirement
from kernreg.config import Config

PEER = "sglang"
PEER_VERSION = "0.5.23"
PEER_MODULES = ("spec", "registry", "selector", "kernel_api_logging", "fused_op")
KERNELS_MODULE = "kernreg_bench_peer_kernels"
CPU = Platform.parse("cpu", source="benchmark")


def default_cache_dir() -> Path:
    env = os.environ.get("KERNREG_BENCH_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kernreg-bench"


def peer_dir(cache_dir: Path) -> Path:
    return cache_dir / f"{PEER}-{PEER_VERSION}"


def peer_is_cached(cache_dir: Path) -> bool:
    """The peer's modules are unpacked and their one dependency, ``msgspec``, can be imported."""
    root = peer_dir(cache_dir)
    kernels = root / "sglang" / "kernels"
    unpacked = (kernels / "ops" / "__init__.py").is_file() and all(
        (kernels / f"{m}.py").is_file() for m in PEER_MODULES
    )
    has_msgspec = (root / "site" / "msgspec").is_dir() or (
        importlib.util.find_spec("msgspec") is not None
    )
    return unpacked and has_msgspec


def fetch_peer(cache_dir: Path) -> Path:
    """Download and unpack the peer's registry modules (once); returns their root folder."""
    root = peer_dir(cache_dir)
    if not peer_is_cached(cache_dir):
        wheels = root / "wheel"
        wheels.mkdir(parents=True, exist_ok=True)
        if not list(wheels.glob("*.whl")):
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--only-binary=:all:",
                    f"{PEER}=={PEER_VERSION}",
                    "-d",
                    str(wheels),
                ],
                check=True,
            )
        (wheel,) = wheels.glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            # The whole kernels package: its ops/ groups register the shipped inventory.
            for name in archive.namelist():
                if name.startswith("sglang/kernels/") and name.endswith(".py"):
                    archive.extract(name, root)
    try:
        import msgspec  # noqa: F401
    except ImportError:
        site = root / "site"
        if not (site / "msgspec").is_dir():
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "--target", str(site), "msgspec"],
                check=True,
            )
    return root


def load_peer(root: Path, *, with_ops: bool) -> types.SimpleNamespace:
    """Import the peer's registry modules under stub packages (no sglang ``__init__`` runs)."""
    site = root / "site"
    if site.is_dir() and str(site) not in sys.path:
        sys.path.append(str(site))
    for name, path in (
        ("sglang", root / "sglang"),
        ("sglang.kernels", root / "sglang" / "kernels"),
    ):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package
    peer = types.SimpleNamespace(
        spec=importlib.import_module("sglang.kernels.spec"),
        registry=importlib.import_module("sglang.kernels.registry"),
        selector=importlib.import_module("sglang.kernels.selector"),
        fused_op=None,
    )
    # The peer detects its platform through torch; both systems decide for a CPU box.
    peer.selector._platform = lambda: peer.spec.PlatformInfo()
    if with_ops:
        fused_op = importlib.import_module("sglang.kernels.fused_op")
        fused_op._platform_key = lambda: ""  # no sglang.srt: no platform forward
        fused_op._oot_dispatch_key = lambda: None  # in-tree platform
        fused_op._platform = peer.selector._platform
        fused_op.set_fused_op_backend(None)
        peer.fused_op = fused_op
    return peer


# --- the shared workload ---------------------------------------------------------------------


def _impl(x: Any, weight: Any) -> Any:
    return x


def _impl_other(x: Any, weight: Any) -> Any:
    return weight


def _kernels_module() -> types.ModuleType:
    """The module both systems' string targets point at (``module:attr``)."""
    module = sys.modules.get(KERNELS_MODULE)
    if module is None:
        module = types.ModuleType(KERNELS_MODULE)
        module.impl = _impl  # type: ignore[attr-defined]
        module.impl_other = _impl_other  # type: ignore[attr-defined]
        sys.modules[KERNELS_MODULE] = module
    return module


BACKENDS = ("torch", "triton", "aot", "jit")


def names(count: int) -> list[tuple[str, tuple[str, ...]]]:
    """``count // 4`` op ids, each with one target string per backend."""
    return [
        (
            f"bench.op_{i}",
            tuple(f"bench_kernels.{backend}_ops:op_{i}" for backend in BACKENDS),
        )
        for i in range(count // 4)
    ]


class Workload:
    """The same inventory, spelled for each system: four backends per op."""

    def __init__(self, peer: types.SimpleNamespace) -> None:
        spec = peer.spec
        cap = spec.CapabilityRequirement
        self.peer = peer
        self.peer_backends = tuple(spec.KernelBackend(b) for b in BACKENDS)
        self.peer_caps = (
            frozenset(),
            frozenset({cap.CUDA}),
            frozenset({cap.cuda(min_sm=(9, 0))}),
            frozenset({cap.CUDA, cap.HIP}),
        )
        self.requires = (
            (),
            (Requirement.parse("cuda"),),
            (Requirement.parse("cuda>=9.0"),),
            (Requirement.parse("cuda"), Requirement.parse("rocm")),
        )

    def peer_specs(self, items: list[tuple[str, tuple[str, ...]]]) -> list[Any]:
        make = self.peer.spec.KernelSpec
        b0, b1, b2, b3 = self.peer_backends
        c0, c1, c2, c3 = self.peer_caps
        out = []
        append = out.append
        for op, (t0, t1, t2, t3) in items:
            append(make(op=op, backend=b0, target=t0, capabilities=c0))
            append(make(op=op, backend=b1, target=t1, capabilities=c1))
            append(make(op=op, backend=b2, target=t2, capabilities=c2))
            append(make(op=op, backend=b3, target=t3, capabilities=c3))
        return out

    def kernreg_specs(self, items: list[tuple[str, tuple[str, ...]]]) -> list[KernelSpec]:
        _r0, r1, r2, r3 = self.requires
        out = []
        append = out.append
        for op, (t0, t1, t2, t3) in items:
            append(KernelSpec(op, "torch", t0, reference=True))
            append(KernelSpec(op, "triton", t1, requires=r1, priority=10))
            append(KernelSpec(op, "aot", t2, requires=r2, priority=20))
            append(KernelSpec(op, "jit", t3, requires=r3, priority=15))
        return out


def _kernreg_registry() -> KernelRegistry:
    return KernelRegistry(config=Config(), platform=CPU)


@contextmanager
def _gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# --- registration: time and memory ------------------------------------------------------------


def _register_round(
    system: str, work: Workload, items: list[tuple[str, tuple[str, ...]]], prebuilt: bool
) -> tuple[float, int]:
    """Seconds for one pass (construct + register, or register only) and the specs stored."""
    peer = work.peer
    with _gc_paused():
        specs = None
        if prebuilt:
            specs = work.peer_specs(items) if system == PEER else work.kernreg_specs(items)
        started = time.perf_counter()
        if specs is None:
            specs = work.peer_specs(items) if system == PEER else work.kernreg_specs(items)
        if system == PEER:
            registry = peer.registry.KernelRegistry()
            for spec in specs:
                registry.register(spec)
            elapsed = time.perf_counter() - started
            stored = len(registry.all_specs())
        else:
            kr = _kernreg_registry()
            for spec in specs:
                kr.register(spec)
            elapsed = time.perf_counter() - started
            stored = len(kr)
    return elapsed, stored


def _retained_bytes(system: str, work: Workload, items: list[tuple[str, tuple[str, ...]]]) -> int:
    """Bytes still allocated once the registry holds every spec (specs built inside)."""
    peer = work.peer
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        if system == PEER:
            registry: Any = peer.registry.KernelRegistry()
            for spec in work.peer_specs(items):
                registry.register(spec)
        else:
            registry = _kernreg_registry()
            for spec in work.kernreg_specs(items):
                registry.register(spec)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert registry is not None
    return after - before


def bench_registration(work: Workload, sizes: tuple[int, ...], rounds: int) -> list[dict[str, Any]]:
    rows = []
    for count in sizes:
        items = names(count)
        for prebuilt in (False, True):
            best = {PEER: float("inf"), "kernreg": float("inf")}
            for _ in range(rounds):
                for system in (PEER, "kernreg"):
                    elapsed, stored = _register_round(system, work, items, prebuilt)
                    assert stored == count, (system, stored, count)
                    best[system] = min(best[system], elapsed)
            what = "register only, specs built" if prebuilt else "construct + register"
            rows.append(
                _row(
                    f"{what}, {count:,} specs (per spec)",
                    best[PEER] / count * 1e9,
                    best["kernreg"] / count * 1e9,
                    "ns",  # not a budget: validation and origins, once at start-up
                )
            )
    count = sizes[-1]
    items = names(count)
    memory = {system: _retained_bytes(system, work, items) / count for system in (PEER, "kernreg")}
    rows.append(
        _row(
            f"retained memory per registered spec ({count:,} specs)",
            memory[PEER],
            memory["kernreg"],
            "B",
            target=1.5,
        )
    )
    return rows


# --- lookups -----------------------------------------------------------------------------------


def bench_lookups(work: Workload, number: int, rounds: int) -> list[dict[str, Any]]:
    """Warm ``get_kernel``/``select_kernel`` on both process-wide registries."""
    peer = work.peer
    _kernels_module()
    op = "bench.lookup"
    target = f"{KERNELS_MODULE}:impl"
    other = f"{KERNELS_MODULE}:impl_other"
    spec_mod = peer.spec
    backend = spec_mod.KernelBackend
    cuda_only = frozenset({spec_mod.CapabilityRequirement.CUDA})
    # torch runs anywhere, triton needs CUDA: on this CPU box both systems choose torch,
    # whether asked for the op or for the torch backend by name.
    peer.registry.registry.register(
        spec_mod.KernelSpec(op=op, backend=backend.TORCH, target=target)
    )
    peer.registry.registry.register(
        spec_mod.KernelSpec(op=op, backend=backend.TRITON, target=other, capabilities=cuda_only)
    )
    torch_backend = backend.TORCH
    with kernreg.default_registry().scoped():
        kernreg.default_registry().configure(Config(), platform=CPU)
        kernreg.default_registry().register(KernelSpec(op, "torch", target, reference=True))
        kernreg.default_registry().register(
            KernelSpec(op, "triton", other, requires=(Requirement.parse("cuda"),), priority=10)
        )
        get_k, select_k = kernreg.get_kernel, kernreg.select_kernel
        peer_get, peer_select = peer.selector.get_kernel, peer.selector.select_kernel
        # Check every result before timing it.
        assert get_k(op) is _impl
        assert peer_get(op) is _impl
        assert get_k(op, "torch") is _impl
        assert peer_get(op, torch_backend) is _impl
        assert select_k(op, "torch").target == target == peer_select(op, torch_backend).target
        assert get_k(op, "torch")(1, 2) == 1 == peer_get(op, torch_backend)(1, 2)
        ns = {
            "get_k": get_k,
            "select_k": select_k,
            "peer_get": peer_get,
            "peer_select": peer_select,
            "op": op,
            "b": "torch",
            "pb": torch_backend,
            "x": 1,
            "w": 2,
        }
        t = per_call_ns(
            {
                "k_get": "get_k(op)",
                "p_get": "peer_get(op)",
                "k_get_b": "get_k(op, b)",
                "p_get_b": "peer_get(op, pb)",
                "k_sel_b": "select_k(op, b)",
                "p_sel_b": "peer_select(op, pb)",
                "k_call": "get_k(op, b)(x, w)",
                "p_call": "peer_get(op, pb)(x, w)",
            },
            ns,
            number=number,
            rounds=rounds,
        )
    return [
        _row("warm get_kernel(op)", t["p_get"], t["k_get"], "ns", target=1.25),
        _row("warm get_kernel(op, backend)", t["p_get_b"], t["k_get_b"], "ns", target=1.25),
        _row("select_kernel(op, backend)", t["p_sel_b"], t["k_sel_b"], "ns", target=1.25),
        _row("resolve by id per call, get_kernel(op, b)(x, w)", t["p_call"], t["k_call"], "ns"),
    ]


# --- op objects ----------------------------------------------------------------------------------


def bench_op_objects(work: Workload, number: int, rounds: int) -> list[dict[str, Any]]:
    """kernreg op objects against sglang's op pattern (a module-level BaseFusedOp instance
    behind a plain function), static and gated per call, with real torch tensors."""
    import torch

    fused_op = work.peer.fused_op
    assert fused_op is not None
    backend_cls = work.peer.spec.KernelBackend
    any_device = {backend_cls.TRITON: frozenset()}

    class StaticOp(fused_op.BaseFusedOp):  # type: ignore[misc, name-defined]
        op = "bench.static_rmsnorm"
        capabilities = any_device

        def forward_native(self, x: Any, w: Any) -> Any:
            return w

        def forward_triton(self, x: Any, w: Any) -> Any:
            return x

    class GatedOp(StaticOp):
        op = "bench.gated_rmsnorm"

        def backend_eligible(self, backend: Any, x: Any, w: Any) -> bool:
            return x.dtype == torch.float32 and x.device.type == "cpu"

    static_instance, gated_instance = StaticOp(), GatedOp()

    def peer_static(x: Any, w: Any) -> Any:
        return static_instance(x, w)

    def peer_gated(x: Any, w: Any) -> Any:
        return gated_instance(x, w)

    registry = _kernreg_registry()

    @kernreg.op("bench.static_rmsnorm", registry=registry)
    def k_static(x: Any, w: Any) -> Any:
        return w

    @kernreg.op("bench.gated_rmsnorm", registry=registry)
    def k_gated(x: Any, w: Any) -> Any:
        return w

    k_static.register("triton", _impl, priority=10)
    k_gated.register("triton", _impl, requires=["cpu"], dtypes=["float32"], priority=10)

    x = torch.zeros(4)
    w = torch.ones(4)
    for f in (peer_static, peer_gated, k_static, k_gated):
        assert f(x, w) is x, f
    t = per_call_ns(
        {
            "direct": "impl(x, w)",
            "p_static": "peer_static(x, w)",
            "k_static": "k_static(x, w)",
            "p_gated": "peer_gated(x, w)",
            "k_gated": "k_gated(x, w)",
        },
        {
            "impl": _impl,
            "peer_static": peer_static,
            "peer_gated": peer_gated,
            "k_static": k_static,
            "k_gated": k_gated,
            "x": x,
            "w": w,
        },
        number=number,
        rounds=rounds,
    )
    d = t["direct"]
    return [
        # Side by side only: the budget is kernreg's own cost over a direct call (below).
        _row("op call, static decision, f(x, w)", t["p_static"], t["k_static"], "ns"),
        _row("op call, gated per call, f(x, w)", t["p_gated"], t["k_gated"], "ns"),
        _row(
            "gated op call over a direct call (torch tensors)",
            None,
            t["k_gated"] - d,
            "ns",
            note=f"direct impl(x, w) = {d:.0f} ns; budget +250 ns",
            ok=t["k_gated"] - d <= 250,
        ),
    ]


# --- start-up to first decision --------------------------------------------------------------

#: The machine both systems decide for, simulated (neither detects anything).
STARTUP_PLATFORM = "cuda:9.0"

_DUMP_INVENTORY = """
import json, sys, types
package = types.ModuleType("sglang")
package.__path__ = [sys.argv[1] + "/sglang"]
sys.modules["sglang"] = package
import sglang.kernels  # its ops/ groups register the shipped inventory
json.dump(
    [
        {
            "op": s.op,
            "backend": s.backend.value,
            "target": s.target,
            "capabilities": sorted(
                ([c.device.value, c.min_cuda_arch, c.max_cuda_arch] for c in s.capabilities),
                key=str,
            ),
        }
        for s in sglang.kernels.registry.all_specs()
    ],
    sys.stdout,
)
"""


def _child_env(root: Path, path: Path | None = None) -> dict[str, str]:
    """The environment of a measured process: no KERNREG_* of the caller's, msgspec found,
    and byte-code caches written as a user's are (the warm-up round writes them)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KERNREG_") and k != "PYTHONDONTWRITEBYTECODE"
    }
    paths = [str(p) for p in (path, root / "site") if p is not None and p.is_dir()]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def shipped_inventory(root: Path) -> list[dict[str, Any]]:
    """sglang's shipped inventory, as ``import sglang.kernels`` registers it (read once, in a
    child process, since it imports torch; kept beside the wheel)."""
    cached = root / "inventory.json"
    if not cached.is_file():
        out = subprocess.run(
            [sys.executable, "-c", _DUMP_INVENTORY, str(root)],
            check=True,
            capture_output=True,
            text=True,
            env=_child_env(root),
        ).stdout
        cached.write_text(out, encoding="utf-8")
    return list(json.loads(cached.read_text(encoding="utf-8")))


def _requirement(device: str, lo: list[int] | None, hi: list[int] | None) -> str:
    """sglang's ``CapabilityRequirement`` spelled as a kernreg requirement string."""
    if lo is not None and lo == hi:
        return f"{device}=={lo[0]}.{lo[1]}"
    bounds = [f"{op}{arch[0]}.{arch[1]}" for op, arch in ((">=", lo), ("<=", hi)) if arch]
    return device + ",".join(bounds)


def _capability(device: str, lo: list[int] | None, hi: list[int] | None) -> str:
    if lo is None and hi is None:
        return f"C.{device.upper()}"
    window = ", ".join(f"{k}={tuple(v)}" for k, v in (("min_sm", lo), ("max_sm", hi)) if v)
    return f"C.cuda({window})"


_DECIDE_EVERY_OP = """
registered = time.perf_counter()
chosen = 0
for op in OPS:
    try:
        select_kernel(op)
        chosen += 1
    except (ValueError, LookupError):  # ambiguous, or nothing eligible: decided all the same
        pass
decided = time.perf_counter()
"""


def write_startup_modules(root: Path, inventory: list[dict[str, Any]]) -> Path:
    """Two modules that register the same inventory, one per system, and decide every op."""
    folder = root / "startup"
    folder.mkdir(exist_ok=True)
    ops = sorted({s["op"] for s in inventory})
    ours = [
        '"""Generated from sglang\'s shipped inventory by benchmarks/bench_sglang.py."""',
        "import time",
        "started = time.perf_counter()",
        "from kernreg import KernelSpec, register_kernel, select_kernel",
    ]
    peer = [
        '"""Generated from sglang\'s shipped inventory by benchmarks/bench_sglang.py."""',
        "import time",
        "started = time.perf_counter()",
        "import sys, types",
        f"for name, path in (('sglang', {str(root / 'sglang')!r}),"
        f" ('sglang.kernels', {str(root / 'sglang' / 'kernels')!r})):",
        "    sys.modules[name] = types.ModuleType(name)",
        "    sys.modules[name].__path__ = [path]",
        "from sglang.kernels import selector",
        "from sglang.kernels.registry import register_kernel",
        "from sglang.kernels.spec import CapabilityRequirement as C",
        "from sglang.kernels.spec import KernelBackend as B, KernelSpec, PlatformInfo",
        "from sglang.kernels.selector import select_kernel",
        "selector._platform = lambda: PlatformInfo('cuda', 9, 0)",
    ]
    for s in inventory:
        caps = s["capabilities"]
        requires = [_requirement(*c) for c in caps]
        reference = ", reference=True" if s["backend"] == "torch" else ""
        ours.append(
            f"register_kernel(KernelSpec({s['op']!r}, {s['backend'].lower()!r}, "
            f"{s['target']!r}, requires={requires!r}{reference}))"
        )
        capabilities = "frozenset({" + ", ".join(_capability(*c) for c in caps) + "})"
        peer.append(
            f"register_kernel(KernelSpec(op={s['op']!r}, backend=B({s['backend']!r}), "
            f"target={s['target']!r}, capabilities={capabilities}))"
        )
    for lines, name in ((ours, "startup_kernreg"), (peer, "startup_sglang")):
        text = "\n".join([*lines, f"OPS = {tuple(ops)!r}", _DECIDE_EVERY_OP])
        (folder / f"{name}.py").write_text(text, encoding="utf-8")
    return folder


def _startup_round(root: Path, folder: Path, system: str) -> dict[str, float]:
    """One fresh interpreter: import, register the inventory, decide every op once."""
    script = (
        f"import json, startup_{system} as m; print(json.dumps({{"
        "'total': m.decided - m.started, 'decide': m.decided - m.registered, "
        "'chosen': m.chosen, 'ops': len(m.OPS)}))"
    )
    env = _child_env(root, folder)
    env.update(KERNREG_PLATFORM=STARTUP_PLATFORM, KERNREG_PLUGINS="none")
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True, env=env
    ).stdout
    return dict(json.loads(out.splitlines()[-1]))


def bench_startup(root: Path, rounds: int) -> list[dict[str, Any]]:
    """Start-up to first decision of sglang's shipped inventory, in fresh processes."""
    inventory = shipped_inventory(root)
    folder = write_startup_modules(root, inventory)
    best: dict[str, dict[str, float]] = {}
    for index in range(rounds + 1):  # the first round compiles the modules: not counted
        for system in (PEER, "kernreg"):
            result = _startup_round(root, folder, system)
            if index and result["total"] < best.get(system, {"total": float("inf")})["total"]:
                best[system] = result
            if index:
                best[system]["decide"] = min(best[system]["decide"], result["decide"])
    ops = int(best[PEER]["ops"])
    per_op = {system: best[system]["decide"] / ops * 1e6 for system in best}
    what = f"{len(inventory)} specs, {ops} ops, {STARTUP_PLATFORM}"
    return [
        _row(
            f"start-up to first decision ({what}): import, register, decide every op",
            best[PEER]["total"] * 1e3,
            best["kernreg"]["total"] * 1e3,
            "ms",
            target=3.0,
        ),
        _row(
            f"first decision per op ({ops} ops; chosen: sglang {best[PEER]['chosen']:.0f}, "
            f"kernreg {best['kernreg']['chosen']:.0f})",
            per_op[PEER],
            per_op["kernreg"],
            "µs",
            note="≤ 5 µs per op",
            ok=per_op["kernreg"] <= 5,
        ),
    ]


# --- the table ---------------------------------------------------------------------------------


def _row(
    path: str,
    peer: float | None,
    ours: float,
    unit: str,
    *,
    target: float | None = None,
    note: str | None = None,
    ok: bool | None = None,
) -> dict[str, Any]:
    """One compared path; ``ratio`` is kernreg / sglang (below 1: kernreg is cheaper)."""
    ratio = None if not peer else ours / peer
    goal = None
    if target is not None and ratio is not None:
        goal, ok = f"≤ {target:g}x sglang", ratio <= target
    return {
        "path": path,
        "sglang": peer,
        "kernreg": ours,
        "unit": unit,
        "ratio": ratio,
        "goal": goal or note,
        "ok": ok,
    }


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f} {unit}" if value >= 100 else f"{value:.1f} {unit}"


def render(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    header = ("path", "sglang", "kernreg", "kernreg/sglang", "target", "met")
    table = [header]
    for r in rows:
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        met = "—" if r["ok"] is None else ("yes" if r["ok"] else "NO")
        table.append(
            (
                r["path"],
                _fmt(r["sglang"], r["unit"]),
                _fmt(r["kernreg"], r["unit"]),
                ratio,
                r["goal"] or "",
                met,
            )
        )
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|---|---:|---:|---:|---|---|"]
        lines += ["| " + " | ".join(row) + " |" for row in table[1:]]
        return "\n".join(lines) + "\n"
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = []
    for index, row in enumerate(table):
        lines.append(
            "  ".join(
                c.rjust(widths[i]) if i in (1, 2, 3) else c.ljust(widths[i])
                for i, c in enumerate(row)
            ).rstrip()
        )
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def compare(cache_dir: Path, *, quick: bool, fetch: bool = True) -> list[dict[str, Any]]:
    """Every compared path, both systems measured in this process."""
    root = fetch_peer(cache_dir) if fetch else peer_dir(cache_dir)
    try:
        import torch  # noqa: F401

        has_torch = True
    except ImportError:
        has_torch = False
    peer = load_peer(root, with_ops=has_torch)
    work = Workload(peer)
    sizes = (1_000, 10_000) if quick else (1_000, 10_000, 100_000)
    number, rounds = (5_000, 3) if quick else (200_000, 9)
    rows = bench_startup(root, rounds=3 if quick else 9)
    rows += bench_registration(work, sizes, rounds=2 if quick else 5)
    rows += bench_lookups(work, number, rounds)
    if has_torch:
        rows += bench_op_objects(work, number // 4, rounds)
    return rows


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Records for ``benchmarks/run.py`` (the peer must already be cached: no download here)."""
    cache_dir = default_cache_dir()
    rows = compare(cache_dir, quick=quick, fetch=False)
    return [
        {
            "name": f"vs sglang {PEER_VERSION}: {r['path']}",
            "value": float(r["kernreg"]),
            "unit": r["unit"],
            "budget": r["goal"],
            "baseline": None if r["sglang"] is None else f"sglang = {_fmt(r['sglang'], r['unit'])}",
            "ratio": r["ratio"],
            "ok": r["ok"],
        }
        for r in rows
    ]


if __name__ != "__main__" and not peer_is_cached(default_cache_dir()):
    # Imported by benchmarks/run.py: skipped (run.py reports import errors as skips).
    raise ModuleNotFoundError(
        f"{PEER} {PEER_VERSION} is not in {default_cache_dir()}; "
        "fetch it with: python benchmarks/bench_sglang.py"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the peer is kept")
    parser.add_argument(
        "--startup", action="store_true", help="only start-up to first decision (fresh processes)"
    )
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = parser.parse_args(argv)
    cache_dir = args.cache_dir or default_cache_dir()
    if args.startup:
        rows = bench_startup(fetch_peer(cache_dir), rounds=3 if args.quick else 9)
    else:
        rows = compare(cache_dir, quick=args.quick)
    print(render(rows, markdown=args.markdown), end="")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

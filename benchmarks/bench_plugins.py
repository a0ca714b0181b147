"""Plugin discovery and loading with 100 installed distributions (budget: < 100 ms).

Method
------
* 100 small distributions are written as wheels and installed by pip into one
  directory (three in four name a registration function, every fourth a module that
  registers on import; two specs each). The directory is compiled (``compileall``) and
  cached under the system temp dir, so only the first run pays the ~10 s of pip.
* Every figure comes from fresh interpreters whose ``PYTHONPATH`` is that directory
  (besides the environment's own site-packages), with no ``KERNREG_*`` variable set;
  each is the median over several interpreters:

  - ``discover()``, cold: the first call in the process, *including* the import of
    ``importlib.metadata`` that kernreg defers until plugins are needed;
  - ``load_plugins()``, cold: the whole first load into the process-wide registry
    (discovery, importing the 100 plugin modules, registering 200 specs);
  - ``discover()``, warm: the median of repeated calls in one process, next to the
    same for ``importlib.metadata.entry_points(group="kernreg.kernels")`` (the baseline:
    what reading the entry points costs without kernreg's attribution and sorting).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

DISTRIBUTIONS = 100
BUDGET_MS = 100.0
PREFIX = "kernreg-bench-plugin-"
WHEELS_HELPER = Path(__file__).resolve().parent.parent / "tests" / "plugin_fixtures" / "wheels.py"
CACHE = Path(tempfile.gettempdir()) / (
    f"kernreg-bench-plugins-{DISTRIBUTIONS}-py{sys.version_info[0]}{sys.version_info[1]}-v1"
)

_SOURCE = """\
from kernreg import KernelSpec

KERNREG_PLUGIN_API = 1


def kernel(x):
    return x


def register(registry):
    registry.register(KernelSpec("{op}", "torch", "{module}:kernel", reference=True))
    registry.register(KernelSpec("{op}", "triton", "{module}:kernel", priority={index}))
"""

_MODULE_SOURCE = """\
import kernreg

KERNREG_PLUGIN_API = 1


def kernel(x):
    return x


kernreg.register_kernel(kernreg.KernelSpec("{op}", "torch", "{module}:kernel", reference=True))
kernreg.register_kernel(kernreg.KernelSpec("{op}", "triton", "{module}:kernel", priority={index}))
"""

_PROBE = textwrap.dedent(
    """
    import json, statistics, sys, time

    mode, repeat, prefix = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    import kernreg
    from kernreg.plugins import ENTRY_POINT_GROUP, discover

    out = {}
    if mode == "discover":
        start = time.perf_counter()
        infos = discover()
        out["cold_ms"] = (time.perf_counter() - start) * 1e3
        out["found"] = sum(i.distribution.startswith(prefix) for i in infos)
        import importlib.metadata

        def warm(fn):
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)

        out["warm_ms"] = warm(discover)
        out["baseline_ms"] = warm(lambda: importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    else:
        start = time.perf_counter()
        report = kernreg.plugins.load_plugins()
        out["cold_ms"] = (time.perf_counter() - start) * 1e3
        out["found"] = sum(i.distribution.startswith(prefix) for i, _ in report.loaded)
        out["specs"] = sum(n for i, n in report.loaded if i.distribution.startswith(prefix))
        out["failed"] = [str(f) for f in report.failed]
    print(json.dumps(out))
    """
)


def _wheels_helper() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_kernreg_fixture_wheels", WHEELS_HELPER)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {WHEELS_HELPER}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def installed_distributions() -> Path:
    """The directory holding the 100 installed distributions, built on first use."""
    site = CACHE / "site"
    if (CACHE / "READY").is_file():
        return site
    helper = _wheels_helper()
    work = Path(tempfile.mkdtemp(prefix="kernreg-bench-plugins-"))
    try:
        wheels = []
        for index in range(DISTRIBUTIONS):
            name = f"{PREFIX}{index:03d}"
            module = name.replace("-", "_")
            module_style = index % 4 == 3
            source = (_MODULE_SOURCE if module_style else _SOURCE).format(
                op=f"bench.op_{index:03d}", module=module, index=index
            )
            value = module if module_style else f"{module}:register"
            wheels.append(
                helper.write_wheel(
                    work / "wheels",
                    name,
                    "1.0",
                    {f"{module}/__init__.py": source},
                    {f"bench_{index:03d}": value},
                )
            )
        job = helper.install(wheels, work / "site")
        output, _ = job.communicate()
        if job.returncode != 0:
            raise RuntimeError(f"pip install failed:\n{output.decode()}")
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(work / "site")], check=True)
        CACHE.mkdir(parents=True, exist_ok=True)
        if not (CACHE / "READY").is_file():
            shutil.rmtree(site, ignore_errors=True)
            os.replace(work / "site", site)
            (CACHE / "READY").write_text("ok\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return site


def _probe(site: Path, mode: str, repeat: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = str(site)
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, mode, str(repeat), PREFIX],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"plugin probe ({mode}) failed:\n{result.stderr}")
    out: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    if out["found"] != DISTRIBUTIONS or out.get("failed"):
        raise RuntimeError(f"plugin probe ({mode}) saw {out['found']} distributions: {out}")
    return out


def _record(
    name: str,
    value: float,
    *,
    budget: bool = False,
    baseline: str | None = None,
    baseline_value: float | None = None,
    note: str | None = None,
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "name": name,
        "value": value,
        "unit": "ms",
        "budget": f"< {BUDGET_MS:g} ms" if budget else None,
        "baseline": baseline,
        "ratio": value / baseline_value if baseline_value else None,
        "ok": value < BUDGET_MS if budget else None,
    }
    if note:
        record["note"] = note
    return record


def run(quick: bool = False) -> list[dict[str, Any]]:
    site = installed_distributions()
    processes = 3 if quick else 9
    repeat = 5 if quick else 20
    _probe(site, "discover", 1)  # warm the file-system cache once
    discovered = [_probe(site, "discover", repeat) for _ in range(processes)]
    loaded = [_probe(site, "load", 1) for _ in range(processes)]
    cold_discover = statistics.median(d["cold_ms"] for d in discovered)
    cold_load = statistics.median(d["cold_ms"] for d in loaded)
    warm_discover = statistics.median(d["warm_ms"] for d in discovered)
    warm_baseline = statistics.median(d["baseline_ms"] for d in discovered)
    specs = loaded[0]["specs"]
    return [
        _record(
            f"plugin discovery, {DISTRIBUTIONS} distributions: discover() cold",
            cold_discover,
            budget=True,
            note=f"median of {processes} fresh interpreters; includes importing importlib.metadata",
        ),
        _record(
            f"plugin discovery, {DISTRIBUTIONS} distributions: load_plugins() cold",
            cold_load,
            budget=True,
            note=(
                f"median of {processes} fresh interpreters; discovery, {DISTRIBUTIONS} plugin "
                f"imports and {specs} registrations"
            ),
        ),
        _record(
            f"plugin discovery, {DISTRIBUTIONS} distributions: discover() warm",
            warm_discover,
            baseline=f"entry_points(group=...) warm: {warm_baseline:.2f} ms",
            baseline_value=warm_baseline,
        ),
    ]


if __name__ == "__main__":
    for row in run("--quick" in sys.argv):
        print(f"{row['name']}: {row['value']:.2f} {row['unit']} (budget {row['budget']})")

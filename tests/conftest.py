"""Shared fixtures: a fresh registry on a simulated Hopper GPU, and importable kernel modules."""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from _support import BAD_INPUT_MODULE, BAD_INPUT_OP, BAD_INPUT_TARGET
from kernreg import KernelRegistry, KernelSpec, Platform
from kernreg.config import ENV_VARS, Config

# One intra-op thread in every process of the run (the workers and the interpreters they
# start inherit it; torch reads it on import): the suite's tensors are tiny, and with one
# pytest-xdist worker per core, torch's default of one thread per core oversubscribes the
# machine, its threads spinning for work (tests/torch/test_transformers_models.py took 71 s
# of CPU with two threads, 40 s with one). Set before any test module imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

#: Modules with the run's longest tests (a fixture shared by a module's tests counts once,
#: in its first test): interpreting every Triton kernel, exporting a program, the
#: benchmarks' quick runs, process groups, compiling. They run first, so that the worker
#: running one is never the last one still busy while the others have nothing left to
#: take (pytest-xdist's worksteal takes tests from the end of a worker's queue).
_LONGEST_FIRST = (
    "torch/test_triton_interpreted.py",
    "torch/test_custom_op_export.py",
    "test_benchmarks_smoke.py",
    "torch/test_distributed.py",
    "torch/test_cli_newcomer_torch.py",
)


#: What makes a GPU visible to a process (NVML, the CUDA runtime, torch, ROCm).
_GPU_VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gpu",
        action="store_true",
        help="run only the tests of this machine's GPU (marked gpu), with the GPU visible",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Without --gpu the suite runs as on a machine without a GPU, whatever this one has:
    # its tests assert the decisions made for CPU tensors on the detected platform. The
    # processes they start inherit the hiding. Set before any test module imports torch.
    if not config.getoption("--gpu"):
        for name in _GPU_VARIABLES:
            os.environ[name] = ""
        return
    # --gpu asks for the GPU's own tests: no GPU here is an error, not a skip
    try:
        import torch
    except ImportError:
        raise pytest.UsageError("--gpu: torch is not installed") from None
    if not torch.cuda.is_available():
        hidden = {n: os.environ[n] for n in _GPU_VARIABLES if n in os.environ}
        raise pytest.UsageError(
            f"--gpu: torch {torch.__version__} sees no CUDA or ROCm GPU here"
            + (f" ({', '.join(f'{k}={v!r}' for k, v in hidden.items())})" if hidden else "")
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--gpu"):
        selected = [item for item in items if item.get_closest_marker("gpu")]
        config.hook.pytest_deselected(items=[i for i in items if i not in selected])
        items[:] = selected
    here = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        module = item.path.relative_to(here).as_posix() if item.path.is_relative_to(here) else ""
        return _LONGEST_FIRST.index(module) if module in _LONGEST_FIRST else len(_LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within each module, and of the others, is kept


@pytest.fixture(scope="session")
def _test_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernreg-cache")


@pytest.fixture(scope="session")
def once_per_session(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    """``once_per_session(name, compute)``: ``compute()`` (a JSON value) computed once in the
    whole run, by whichever pytest-xdist worker asks first; the others wait for it and read
    it (a module-scoped fixture is rebuilt on every worker that runs one of its tests)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if base.name.startswith("popen-gw") else base

    def get(name: str, compute: Callable[[], Any]) -> Any:
        path = shared / f"{name}.json"
        with open(shared / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                path.write_text(json.dumps(compute()), encoding="utf-8")
        return json.loads(path.read_text(encoding="utf-8"))

    return get


def _clean_environment(monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    for var in list(ENV_VARS):
        monkeypatch.delenv(var, raising=False)
    # pytest-xdist's workers export COLUMNS=80 and LINES=24; a CLI run in a subprocess would
    # fit its tables to that instead of the width it has without a terminal.
    for var in ("COLUMNS", "LINES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KERNREG_CACHE_DIR", str(cache_dir))
    # Child processes started without the KERNREG_* variables find the default store
    # under the session's folder too.
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_dir / "xdg"))


@pytest.fixture(scope="session", autouse=True)
def _clean_session_environment(_test_cache_dir: Path) -> Iterator[None]:
    """The same for the interpreters that session and module fixtures start, before any
    test's own clean-up runs."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _clean_environment(monkeypatch, _test_cache_dir)
        yield


@pytest.fixture(autouse=True)
def _clean_kernreg_environment(monkeypatch: pytest.MonkeyPatch, _test_cache_dir: Path) -> None:
    """No test sees the developer's KERNREG_* variables or terminal size, and none measures
    into the user's tuning store (``KERNREG_CACHE_DIR`` points at the session's own folder;
    a test of the default location removes it)."""
    _clean_environment(monkeypatch, _test_cache_dir)


@pytest.fixture
def registry() -> KernelRegistry:
    """An empty registry with the default configuration, deciding for ``cuda:9.0``."""
    return KernelRegistry(config=Config(), platform=Platform.parse("cuda:9.0"))


@pytest.fixture
def make_registry() -> Callable[..., KernelRegistry]:
    """Build an empty registry: ``make_registry(platform="hip:gfx942", config=Config(...))``."""

    def make(platform: str | Platform = "cuda:9.0", config: Config | None = None) -> KernelRegistry:
        plat = Platform.parse(platform) if isinstance(platform, str) else platform
        return KernelRegistry(config=Config() if config is None else config, platform=plat)

    return make


@pytest.fixture
def write_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[str, str], str]]:
    """Write ``name.py`` with ``source`` to an importable directory; return the module name.

    Modules written this way are removed from ``sys.modules`` after the test.
    """
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(name: str, source: str) -> str:
        path = tmp_path.joinpath(*name.split("."))
        for parent in list(path.parents)[: name.count(".")]:
            parent.mkdir(parents=True, exist_ok=True)
            init = parent / "__init__.py"
            if not init.exists():
                init.write_text("")
        path.with_suffix(".py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        written.append(name)
        return name

    yield write
    for name in written:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[loaded]
        root = name.split(".")[0]
        sys.modules.pop(root, None)


@pytest.fixture
def targets(write_module: Callable[[str, str], str]) -> None:
    """Importable target modules of the bad-input corpus: ``hard_targets`` (good targets of
    every kind), ``hard_raises`` (raises on import) and ``hard_exits`` (exits on import)."""
    write_module("hard_targets", BAD_INPUT_MODULE)
    write_module("hard_raises", "raise RuntimeError('hard_raises fails on import')\n")
    write_module("hard_exits", "import sys\nsys.exit(4)\n")


@pytest.fixture
def populated(targets: None) -> KernelRegistry:
    """A registry with a reference, a gated fast path, an override and a decision cached."""
    reg = KernelRegistry(config=Config(), platform=Platform.parse("cuda:9.0"))
    reg.register(KernelSpec(BAD_INPUT_OP, "torch", "hard_targets:ref", reference=True))
    reg.register(
        KernelSpec(BAD_INPUT_OP, "triton", BAD_INPUT_TARGET, requires=["cuda>=8.0"], priority=10)
    )
    reg.register(
        KernelSpec(BAD_INPUT_OP, "triton", BAD_INPUT_TARGET, requires=["cuda>=8.0"], priority=20),
        replace=True,
    )
    reg.register(KernelSpec("hard.other", "torch", "hard_targets:ref", reference=True))
    reg.select(BAD_INPUT_OP)
    return reg

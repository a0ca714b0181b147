"""GPU detection through the drivers (stub driver libraries built here), per-device platforms."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import kernreg
from kernreg import ConfigError, KernelRegistry, Platform
from kernreg._devices import gfx_name, probe_gpus, torch_build
from kernreg.config import Config
from kernreg.platform import suggest_platform

_SRC = str(Path(kernreg.__file__).resolve().parent.parent)

_LIBCUDA = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static const int majors[] = {MAJORS}, minors[] = {MINORS};
#define N ((int)(sizeof(majors) / sizeof(majors[0])))
int cuDriverGetVersion(int *v) { *v = 12040; return 0; }
int cuInit(unsigned flags) {
    const char *log = getenv("STUB_CUINIT_LOG");
    if (log) { FILE *f = fopen(log, "a"); if (f) { fprintf(f, "%d\n", (int)getpid()); fclose(f); } }
    return 0;
}
int cuDeviceGetCount(int *count) { *count = N; return 0; }
int cuDeviceGet(int *dev, int i) { if (i < 0 || i >= N) return 101; *dev = i; return 0; }
int cuDeviceGetAttribute(int *v, int attr, int dev) {
    if (dev < 0 || dev >= N) return 101;
    if (attr == 75) *v = majors[dev]; else if (attr == 76) *v = minors[dev]; else return 1;
    return 0;
}
"""

_NVML = r"""
#include <stdio.h>
#include <stdlib.h>
static const int majors[] = {MAJORS}, minors[] = {MINORS};
#define N ((unsigned)(sizeof(majors) / sizeof(majors[0])))
int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned *count) { *count = N; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **h) {
    if (i >= N) return 2; *h = (void *)(long)(i + 1); return 0;
}
int nvmlDeviceGetCudaComputeCapability(void *h, int *major, int *minor) {
    long i = (long)h - 1; *major = majors[i]; *minor = minors[i]; return 0;
}
int nvmlDeviceGetUUID(void *h, char *buf, unsigned len) {
    snprintf(buf, len, "GPU-%08ld-1111-2222-3333-444444444444", (long)h - 1); return 0;
}
int nvmlSystemGetCudaDriverVersion(int *v) { *v = 12080; return 0; }
int nvmlDeviceGetMigMode(void *h, unsigned *current, unsigned *pending) {
    *current = *pending = getenv("STUB_MIG") != NULL; return 0;
}
"""


def _compile(tmp_path: Path, name: str, source: str, archs: list[tuple[int, int]]) -> str:
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler to build a stub driver library")
    code = source.replace("MAJORS", ", ".join(str(a[0]) for a in archs)).replace(
        "MINORS", ", ".join(str(a[1]) for a in archs)
    )
    (tmp_path / f"{name}.c").write_text(code)
    out = tmp_path / f"{name}.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(out), str(tmp_path / f"{name}.c")],
        check=True,
        capture_output=True,
    )
    return str(out)


def _detect(
    environ: dict[str, str], *, with_torch: bool = False, **libraries: str
) -> dict[str, Any]:
    """``Platform.detect(**libraries)`` in a fresh interpreter; with its pid and whether
    torch got imported."""
    # CUDA_VISIBLE_DEVICES stays: the suite hides this machine's GPUs (tests/conftest.py)
    # from this process's torch and from the interpreter alike.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KERNREG_", "CUDA_")) or k == "CUDA_VISIBLE_DEVICES"
    }
    env.update(environ)
    env["PYTHONPATH"] = _SRC
    code = (
        "import json, os, sys\n"
        "from kernreg import Platform\n"
        f"p = Platform.detect(**{libraries!r})\n"
        "print(json.dumps({**p.describe(), 'pid': os.getpid(),"
        " 'torch_imported': 'torch' in sys.modules}))\n"
    )
    flags = [] if with_torch else ["-S"]
    out = subprocess.run(
        [sys.executable, *flags, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def _archs(result: dict[str, Any]) -> list[str | None]:
    return [d["platform"] for d in result["devices"]]


def test_libcuda_reports_every_device_from_a_child_process(tmp_path: Path) -> None:
    lib = _compile(tmp_path, "libcuda", _LIBCUDA, [(8, 0), (9, 0)])
    log = tmp_path / "cuinit.log"
    result = _detect({"STUB_CUINIT_LOG": str(log)}, cuda_library=lib)
    assert result["platform"] == "cuda:8.0"
    assert result["index"] == 0
    assert _archs(result) == ["cuda:8.0", "cuda:9.0"]
    assert [d["index"] for d in result["devices"]] == [0, 1]
    assert result["driver_version"] == "12.4"
    assert result["source"] == "libcuda"
    assert result["torch_imported"] is False
    pids = log.read_text().split()
    assert len(pids) == 1
    assert int(pids[0]) != result["pid"]  # cuInit ran in a child: this process's CUDA is untouched


def test_driver_detection_reads_torch_versions_without_importing_torch(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    lib = _compile(tmp_path, "libcuda", _LIBCUDA, [(9, 0)])
    result = _detect({}, with_torch=True, cuda_library=lib)
    assert result["torch_imported"] is False
    assert result["torch_version"] == str(torch.__version__)
    assert result["runtime_version"] == torch.version.cuda  # the CUDA runtime torch was built with


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, ["cuda:9.0", "cuda:9.0", "cuda:9.0"]),
        ("1,2", ["cuda:9.0", "cuda:9.0"]),
        ("2", ["cuda:9.0"]),
        ("0,7,1", ["cuda:9.0"]),  # an index that names no device ends the list, as in CUDA
        ("1,1", ["cuda:9.0"]),
        ("GPU-00000002", ["cuda:9.0"]),
        ("GPU-0000000", []),  # an ambiguous UUID prefix names no device
        ("-1", []),
        ("", []),
    ],
)
def test_nvml_applies_cuda_visible_devices(
    tmp_path: Path, visible: str | None, expected: list[str]
) -> None:
    nvml = _compile(tmp_path, "libnvml", _NVML, [(9, 0)] * 3)
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    report = probe_gpus(env, nvml_library=nvml, cuda_library="none", kfd_topology=str(tmp_path))
    assert report is not None
    assert [str(Platform("cuda", arch=a)) for _, a, _ in report.gpus] == expected
    assert [i for i, _, _ in report.gpus] == list(range(len(expected)))
    if expected:
        assert (report.device, report.driver_version, report.source) == ("cuda", "12.8", "NVML")


def test_mixed_architectures_take_cudas_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML numbers GPUs by PCI bus; CUDA puts the fastest first unless told otherwise."""
    nvml = _compile(tmp_path, "libnvml", _NVML, [(8, 0), (9, 0)])
    cuda = _compile(tmp_path, "libcuda", _LIBCUDA, [(9, 0), (8, 0)])
    no_kfd = str(tmp_path / "none")
    report = probe_gpus({}, nvml_library=nvml, cuda_library=cuda, kfd_topology=no_kfd)
    assert report is not None
    assert (report.source, [a for _, a, _ in report.gpus]) == ("libcuda", [(9, 0), (8, 0)])
    pci = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    report = probe_gpus(pci, nvml_library=nvml, cuda_library=cuda, kfd_topology=no_kfd)
    assert report is not None
    assert (report.source, [a for _, a, _ in report.gpus]) == ("NVML", [(8, 0), (9, 0)])
    one = {**pci, "CUDA_VISIBLE_DEVICES": "1"}
    report = probe_gpus(one, nvml_library=nvml, cuda_library=cuda, kfd_topology=no_kfd)
    assert report is not None
    assert report.gpus == ((0, (9, 0), None),)
    # MIG instances are what CUDA numbers: libcuda answers.
    monkeypatch.setenv("STUB_MIG", "1")  # read by the stub NVML, loaded in this process
    report = probe_gpus(pci, nvml_library=nvml, cuda_library=cuda, kfd_topology=no_kfd)
    monkeypatch.delenv("STUB_MIG")
    assert report is not None
    assert report.source == "libcuda"
    # Neither library can tell: no answer (detection then asks torch, where installed).
    assert probe_gpus({}, nvml_library=nvml, cuda_library="none", kfd_topology=no_kfd) is None


def test_missing_driver_libraries_are_no_answer_not_an_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "libnothing.so")
    assert probe_gpus({}, nvml_library=missing, cuda_library=missing, kfd_topology=missing) is None
    result = _detect({}, cuda_library=missing, nvml_library=missing)
    assert result["platform"] == "cpu"
    assert result["torch_imported"] is False


def _kfd(tmp_path: Path, targets: list[int]) -> str:
    root = tmp_path / "nodes"
    for i, target in enumerate(targets):
        (root / str(i)).mkdir(parents=True)
        (root / str(i) / "properties").write_text(
            f"cpu_cores_count {0 if target else 16}\nsimd_count 0\n"
            f"gfx_target_version {target}\nunique_id {1000 + i if target else 0}\n"
        )
    return str(root)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, ["gfx942", "gfx90a", "gfx1100"]),
        ({"HIP_VISIBLE_DEVICES": "1"}, ["gfx90a"]),
        ({"CUDA_VISIBLE_DEVICES": "2,0"}, ["gfx1100", "gfx942"]),
        ({"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "2"}, ["gfx942"]),
        ({"ROCR_VISIBLE_DEVICES": "2,1", "HIP_VISIBLE_DEVICES": "1"}, ["gfx90a"]),
        ({"ROCR_VISIBLE_DEVICES": f"GPU-{1003:016x}"}, ["gfx1100"]),
        ({"HIP_VISIBLE_DEVICES": ""}, []),
    ],
)
def test_rocm_devices_from_the_kfd_topology(
    tmp_path: Path, environ: dict[str, str], expected: list[str]
) -> None:
    topology = _kfd(tmp_path, [0, 90402, 90010, 110000])
    report = probe_gpus(environ, nvml_library="none", cuda_library="none", kfd_topology=topology)
    assert report is not None
    assert [name for _, _, name in report.gpus] == expected
    if expected:
        assert report.device == "hip"


@pytest.mark.parametrize(
    ("target", "name"),
    [
        (90402, "gfx942"),
        (90010, "gfx90a"),
        (90008, "gfx908"),
        (110001, "gfx1101"),
        (100300, "gfx1030"),
        (90500, "gfx950"),
    ],
)
def test_gfx_name(target: int, name: str) -> None:
    assert gfx_name(target) == name


def test_driver_and_torch_agree_on_this_machine() -> None:
    """Where both can answer, detection without torch equals torch's own answer."""
    torch = pytest.importorskip("torch")
    from kernreg.platform import _detect_with_torch

    by_drivers = _detect({}, with_torch=True)
    assert by_drivers["torch_imported"] is False
    by_torch = _detect_with_torch()
    assert by_drivers["platform"] == str(by_torch)
    assert by_drivers["torch_version"] == by_torch.torch_version == str(torch.__version__)
    assert by_drivers["runtime_version"] == by_torch.runtime_version
    assert _archs(by_drivers) == [str(d) for d in by_torch.devices]
    assert by_drivers["device"] == by_torch.device


@pytest.mark.gpu
@pytest.mark.skipif(
    not (shutil.which("nvidia-smi") or os.path.exists("/dev/kfd")), reason="needs a GPU"
)
def test_driver_and_torch_agree_on_every_gpu() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    from kernreg.platform import _detect_with_torch

    by_drivers = _detect({}, with_torch=True)
    by_torch = _detect_with_torch()
    assert _archs(by_drivers) == [str(d) for d in by_torch.devices]
    assert by_drivers["device"] == by_torch.device


# --- per-device platforms --------------------------------------------------------------------


def test_several_devices_parse_into_per_device_platforms() -> None:
    host = Platform.parse("cuda:8.0,9.0", source="KERNREG_PLATFORM")
    assert (str(host), host.index) == ("cuda:8.0", None)
    assert [(d.index, str(d)) for d in host.devices] == [(0, "cuda:8.0"), (1, "cuda:9.0")]
    assert Platform.parse("hip:gfx942, gfx90a").devices[1].arch_name == "gfx90a"
    assert Platform.parse("cuda:sm_90a,8.0").devices[0].arch_name == "sm_90a"
    # Devices take no part in equality: device 0 decides like a one-device cuda:8.0 host.
    single = Platform.parse(str(host))
    assert host == single
    assert hash(host) == hash(single)
    assert pickle.loads(pickle.dumps(host)).devices == host.devices
    for text in ("cuda:8.0,", "cuda:8.0,,9.0", "cuda:8.0,ampere", "hip:gfx942,9.0x"):
        with pytest.raises(kernreg.InvalidSpecError):
            Platform.parse(text)


_HOST = Platform.parse("cuda:8.0,9.0", source="test host")


class _CupyDevice:
    def __init__(self, ident: int) -> None:
        self.id = ident


_CupyDevice.__name__ = _CupyDevice.__qualname__ = "Device"
_CupyDevice.__module__ = "cupy.cuda.device"


class _JaxDevice:
    def __init__(self, platform: str, ident: int) -> None:
        self.platform = platform
        self.id = ident


class _Hostile:
    @property
    def type(self) -> str:
        raise RuntimeError("no")

    def __repr__(self) -> str:
        raise RuntimeError("no repr either")


@pytest.mark.parametrize(
    ("device", "expected", "index"),
    [
        ("cuda:1", "cuda:9.0", 1),
        ("CUDA:0", "cuda:8.0", 0),
        ("cuda:0", "cuda:8.0", 0),
        (" cuda:1 ", "cuda:9.0", 1),
        ("cuda", "cuda:8.0", None),
        (1, "cuda:9.0", 1),
        (0, "cuda:8.0", 0),
        ("cpu", "cpu", None),
        ("TFRT_CPU_0", "cpu", None),
        ("gpu:1", "cuda:9.0", 1),
        (_CupyDevice(1), "cuda:9.0", 1),
        (_JaxDevice("gpu", 1), "cuda:9.0", 1),
        (_JaxDevice("cpu", 0), "cpu", None),
        ("mps", "mps", None),
        ("cuda:5", "cuda", 5),  # not among the detected devices: architecture unknown
        (-1, "unknown", None),
        (True, "unknown", None),
        (3.5, "unknown", None),
        (object(), "unknown", None),
        (_Hostile(), "unknown", None),
        ("💥", "unknown", None),
        (None, "cuda:8.0", None),
    ],
)
def test_for_device_maps_every_spelling(device: object, expected: str, index: int | None) -> None:
    plat = _HOST.for_device(device)
    assert (str(plat), plat.index) == (expected, index)
    if expected == "unknown":
        assert "unrecognised device" in plat.source
    if expected == "cuda":
        assert "not among the 2 devices" in plat.source


def test_for_device_with_torch_devices() -> None:
    torch = pytest.importorskip("torch")
    assert _HOST.for_device(torch.device("cuda", 1)) == _HOST.devices[1]
    assert _HOST.for_device(torch.device("cuda:0")) == _HOST.devices[0]
    assert str(_HOST.for_device(torch.device("cpu"))) == "cpu"
    assert str(_HOST.for_device(torch.device("meta"))) == "meta"
    # A one-device description (parsed or simulated) decides every index alike.
    assert Platform.parse("cuda:9.0").for_device(torch.device("cuda", 3)) == Platform.parse(
        "cuda:9.0"
    )
    # ROCm tensors live on 'cuda'.
    rocm = Platform.parse("hip:gfx942,gfx90a")
    assert rocm.for_device(torch.device("cuda", 1)).arch_name == "gfx90a"


class _Array:
    """An array of another library: a real torch dtype and any device object."""

    def __init__(self, dtype: Any, device: object) -> None:
        self.dtype = dtype
        self.device = device


@pytest.fixture
def host_op() -> Any:
    registry = KernelRegistry(config=Config(), platform=_HOST)

    def ref(x):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op("kr_test.rms", registry=registry)(ref)
    op.register("hopper", lambda x: "hopper", requires=["cuda>=9.0"], priority=20)
    op.register("ampere", lambda x: "ampere", requires=["cuda>=8.0"], priority=10)
    op.register("cpu_kernel", lambda x: "cpu", requires=["cpu"], dtypes=["float32"], priority=5)
    return op


def test_gated_calls_decide_for_their_devices_architecture(host_op: Any) -> None:
    torch = pytest.importorskip("torch")
    for _ in range(3):  # first calls decide, later ones hit the per-call cache
        assert host_op(_Array(torch.float32, torch.device("cuda", 1))) == "hopper"
        assert host_op(_Array(torch.float32, torch.device("cuda", 0))) == "ampere"
        assert host_op(torch.ones(2)) == "cpu"
        assert host_op(torch.ones(2, dtype=torch.float64)) == "ref"
        assert host_op(_Array(torch.float32, "cuda:1")) == "hopper"
        assert host_op(_Array(torch.float32, _CupyDevice(1))) == "hopper"
        assert host_op(_Array(torch.float32, 0)) == "ampere"
        assert host_op(_Array(torch.float32, "TFRT_CPU_0")) == "cpu"
        assert host_op(_Array(torch.float32, object())) == "ref"
    decision = host_op.explain_call(_Array(torch.float32, torch.device("cuda", 1)))
    assert (str(decision.platform), decision.platform.index) == ("cuda:9.0", 1)
    strange = host_op.explain_call(_Array(torch.float32, _Hostile()))
    assert strange.platform.device == "unknown"
    assert "unrecognised device" in strange.platform.source
    assert strange.chosen is not None
    assert strange.chosen.reference
    assert "on unknown [call on an unrecognised device <_Hostile object> (" in str(strange)


# --- misspelt device names ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "suggestion"),
    [
        ("gpu", "cuda"),
        ("gpu:9.0", "cuda:9.0"),
        ("nvidia:sm_90", "cuda:sm_90"),
        ("rocm:gfx942", "hip:gfx942"),
        ("amd", "hip"),
        ("sm_90", "cuda:9.0"),
        ("sm_90a", "cuda:sm_90a"),
        ("sm90", "cuda:9.0"),
        ("sm_100a", "cuda:sm_100a"),
        ("gfx942", "hip:gfx942"),
        ("cdua:9.0", "cuda:9.0"),
        ("CDUA", "cuda"),
        ("cuda_", "cuda"),
        ("hpi", "hip"),
        ("cpuu", "cpu"),
    ],
)
def test_misspelt_devices_get_a_suggestion(text: str, suggestion: str) -> None:
    assert suggest_platform(text) == suggestion


@pytest.mark.parametrize(
    "text",
    [
        "cpu",
        "cuda:9.0",
        "hip:gfx942",
        "mps",
        "xpu",
        "npu",
        "tpu",
        "xla",
        "meta",
        "hpu",
        "mlu",
        "musa",
        "myaccel",
        "vendorchip:v2",
    ],
)
def test_open_device_names_are_not_mistakes(text: str) -> None:
    assert suggest_platform(text) is None


def test_a_device_the_inventory_mentions_is_not_a_mistake() -> None:
    assert suggest_platform("gpu", known={"gpu"}) is None
    assert suggest_platform("cdua:1.0", known={"cdua"}) is None
    assert suggest_platform("myaccell", known={"myaccel"}) == "myaccel"


def test_kernreg_platform_misspelt_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KERNREG_PLATFORM", "cdua:9.0")
    with pytest.raises(ConfigError, match=r"did you mean 'cuda:9\.0'\?"):
        kernreg.config.load_config()
    # Detection never raises: it ignores the misspelt override and describes the machine.
    assert Platform.detect().device != "cdua"


def _cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Any:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "kernreg", *args],
        env=environ,
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("value", "suggestion"),
    [
        ("gpu", "cuda"),
        ("rocm:gfx942", "hip:gfx942"),
        ("sm_90", "cuda:9.0"),
        ("cdua:9.0", "cuda:9.0"),
    ],
)
def test_cli_rejects_misspelt_platforms(value: str, suggestion: str) -> None:
    done = _cli("list", "--platform", value)
    assert done.returncode == 2
    assert f"did you mean '{suggestion}'?" in done.stderr


def test_cli_misspelt_kernreg_platform(tmp_path: Path) -> None:
    done = _cli("list", env={"KERNREG_PLATFORM": "cdua:9.0"})
    assert done.returncode != 0
    assert "KERNREG_PLATFORM" in done.stderr
    assert "did you mean 'cuda:9.0'?" in done.stderr


def test_cli_accepts_a_device_that_a_module_registers(tmp_path: Path) -> None:
    (tmp_path / "kr_gpu_kernels.py").write_text(
        "from kernreg import KernelSpec, register_kernel\n"
        "register_kernel(KernelSpec('kr_gpu.op', 'ref', 'kr_gpu_kernels:f', reference=True))\n"
        "register_kernel(KernelSpec('kr_gpu.op', 'fast', 'kr_gpu_kernels:f', requires=['gpu']))\n"
        "def f(x): return x\n"
    )
    env = {"KERNREG_PLUGINS": "none"}
    for args in (
        ("explain", "kr_gpu.op", "--platform", "gpu", "-m", "kr_gpu_kernels"),
        ("-m", "kr_gpu_kernels", "explain", "kr_gpu.op", "--platform", "gpu"),
    ):
        done = _cli(*args, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "-> fast" in done.stdout


def test_cli_platform_and_explain_show_every_device() -> None:
    env = {"KERNREG_PLATFORM": "cuda:8.0,9.0"}
    done = _cli("platform", "--json", env=env)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    shown = [(d["index"], d["platform"]) for d in data["platform"]["devices"]]
    assert shown == [(0, "cuda:8.0"), (1, "cuda:9.0")]
    assert data["override"]["value"] == "cuda:8.0,9.0"
    table = _cli("platform", env=env)
    assert "device 1" in table.stdout
    assert "cuda:9.0" in table.stdout
    explain = _cli("explain", "layernorm.rmsnorm", "--dtype", "float32", env=env)
    assert explain.returncode == 0, explain.stderr
    assert "device 0 (cuda:8.0)" in explain.stdout
    assert "device 1 (cuda:9.0)" in explain.stdout
    as_json = json.loads(
        _cli("explain", "layernorm.rmsnorm", "--json", "--platform", "cuda:8.0,9.0").stdout
    )
    assert [d["platform"] for d in as_json["devices"]] == ["cuda:8.0", "cuda:9.0"]


@pytest.mark.parametrize(
    "args",
    [
        ("list",),
        ("explain", "layernorm.rmsnorm", "--dtype", "bfloat16"),
        ("platform",),
        ("platform", "--json"),
        ("lock", "-o", "{tmp}/plan.json"),
        ("check",),
    ],
)
def test_cli_commands_on_the_detected_platform_import_no_torch(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    pytest.importorskip("torch")  # installed, so importing it would be possible
    argv = ["kernreg", *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    code = (
        "import runpy, sys\n"
        f"sys.argv = {argv!r}\n"
        "try:\n"
        "    runpy.run_module('kernreg', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    status = exc.code\n"
        "print('RESULT', status, 'torch' in sys.modules, 'numpy' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.splitlines()[-1] == "RESULT 0 False False", done.stderr


def test_torch_build_while_another_thread_is_importing_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    half = types.ModuleType("torch")  # what sys.modules holds before torch/__init__ ran
    half.__spec__ = torch.__spec__
    monkeypatch.setitem(sys.modules, "torch", half)
    build = torch_build()
    assert build is not None
    assert (build.version, build.cuda, build.hip) == (
        str(torch.__version__),
        torch.version.cuda,
        torch.version.hip,
    )

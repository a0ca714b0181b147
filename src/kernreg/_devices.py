"""The GPUs of this machine as their drivers report them, without importing torch.

NVIDIA GPUs are read through NVML, which creates no CUDA context (the process may still fork
CUDA workers), else through ``libcuda`` in a child interpreter; AMD GPUs from ROCm's KFD sysfs.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

__all__ = ["GpuReport", "TorchBuild", "driver_version", "probe_gpus", "torch_build"]

NVML_LIBRARY = "libnvidia-ml.so.1"
CUDA_LIBRARY = "libcuda.so.1"
KFD_TOPOLOGY = "/sys/class/kfd/kfd/topology/nodes"
AMDGPU_VERSION = "/sys/module/amdgpu/version"
#: Files whose presence says an NVIDIA kernel driver is loaded (Linux, WSL).
_NVIDIA_HINTS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg")
_PROBE_TIMEOUT_S = 30.0

#: One GPU: its index as the runtime numbers it, and its architecture.
Gpu = tuple[int, tuple[int, int] | None, str | None]


class GpuReport(NamedTuple):
    """What the drivers said: the vendor's device kind, the visible GPUs, where it came from."""

    device: str | None  # "cuda", "hip", or None: no GPU
    gpus: tuple[Gpu, ...]
    driver_version: str | None
    source: str


class TorchBuild(NamedTuple):
    """The torch build installed here, read from ``torch/version.py`` without importing torch."""

    version: str | None
    cuda: str | None
    hip: str | None
    xpu: str | None


_VERSION_LINE = re.compile(
    r"^(__version__|cuda|hip|xpu)\s*(?::[^=\n]*)?=\s*(?:'([^'\n]*)'|\"([^\"\n]*)\"|None)\s*$",
    re.MULTILINE,
)


def torch_build() -> TorchBuild | None:
    """The installed torch's version and GPU runtime versions (an imported torch's, else read
    from its ``version.py`` as text); ``None`` without torch."""
    torch = sys.modules.get("torch")
    # __version__ is set early in torch/__init__, with torch.version.
    if torch is not None and hasattr(torch, "__version__"):
        version = getattr(torch, "version", None)
        found = [torch.__version__, *(getattr(version, k, None) for k in ("cuda", "hip", "xpu"))]
        return TorchBuild(*(None if value is None else str(value) for value in found))
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):  # a half-imported torch may lack __spec__
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folders = spec.submodule_search_locations
    texts = (_read_text(os.path.join(folder, "version.py")) for folder in folders)
    source = next((text for text in texts if text), "")
    values: dict[str, str | None] = {}
    for match in _VERSION_LINE.finditer(source):
        values.setdefault(match[1], match[2] if match[2] is not None else match[3])
    return TorchBuild(*(values.get(name) for name in ("__version__", "cuda", "hip", "xpu")))


def probe_gpus(
    environ: Mapping[str, str] | None = None,
    *,
    nvml_library: str | None = None,
    cuda_library: str | None = None,
    kfd_topology: str | None = None,
    prefer: str = "cuda",
) -> GpuReport | None:
    """The visible GPUs of this machine (none is an answer), or ``None`` when no driver could tell.
    NVIDIA libraries given (``"none"``: skip) are asked, driver loaded or not; ``prefer`` first."""
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux"):
        return None
    probes: list[Callable[[], GpuReport | None]] = [
        lambda: _probe_nvidia(env, nvml_library, cuda_library),
        lambda: _probe_kfd(env, kfd_topology or KFD_TOPOLOGY),
    ]
    reports = []
    for probe in reversed(probes) if prefer == "hip" else probes:
        report = probe()
        if report is not None and report.gpus:
            return report
        reports.append(report)
    if None in reports:
        return None
    return GpuReport(None, (), None, "no GPU: " + "; ".join(r.source for r in reports if r))


# --- NVIDIA ---------------------------------------------------------------------------------


def _probe_nvidia(env: Mapping[str, str], nvml: str | None, cuda: str | None) -> GpuReport | None:
    if nvml is None and cuda is None:
        if not any(os.path.exists(hint) for hint in _NVIDIA_HINTS):
            return GpuReport(None, (), None, "no NVIDIA driver")
        nvml, cuda = NVML_LIBRARY, CUDA_LIBRARY
    nvml, cuda = (None if lib is None or lib.lower() == "none" else lib for lib in (nvml, cuda))
    if nvml is None and cuda is None:
        return GpuReport(None, (), None, "NVIDIA driver libraries not asked")
    report = None if nvml is None else _probe_nvml(env, nvml)
    return report if report is not None or cuda is None else _probe_libcuda(env, cuda)


def _visible(value: str | None, count: int, uuids: Sequence[str] = ()) -> list[int] | None:
    """Indices named by a ``*_VISIBLE_DEVICES`` value, in its order; ``None``: not mappable.
    As in CUDA, an entry that names no device ends the list; ``GPU-`` entries are UUID prefixes."""
    if value is None:
        return list(range(count))
    chosen: list[int] = []
    for token in value.split(","):
        token = token.strip()
        index: int | None = None
        if token.isdigit():
            index = int(token)
        elif token[:4].upper() == "GPU-" and uuids:
            hits = [i for i, uuid in enumerate(uuids) if uuid.lower().startswith(token.lower())]
            index = hits[0] if len(hits) == 1 else None
        elif token[:4].upper() in ("GPU-", "MIG-"):
            return None
        if index is None or index >= count or index in chosen:
            break
        chosen.append(index)
    return chosen


def _cuda_version(number: int | None) -> str | None:
    """``12040`` -> ``"12.4"`` (the CUDA version a driver supports)."""
    return f"{number // 1000}.{number % 1000 // 10}" if number and number > 0 else None


def _probe_nvml(env: Mapping[str, str], library: str) -> GpuReport | None:
    from ctypes import CDLL, byref, c_int, c_uint, c_void_p, create_string_buffer

    try:
        lib = CDLL(library)
        if lib.nvmlInit_v2() != 0:
            return None
    except (OSError, AttributeError):
        return None
    try:  # every call returns 0 on success
        count = c_uint()
        if lib.nvmlDeviceGetCount_v2(byref(count)):
            return None
        archs: list[tuple[int, int]] = []
        uuids: list[str] = []
        for i in range(count.value):
            handle, major, minor, mode, pending = c_void_p(), c_int(), c_int(), c_uint(), c_uint()
            if lib.nvmlDeviceGetHandleByIndex_v2(c_uint(i), byref(handle)) or (
                lib.nvmlDeviceGetCudaComputeCapability(handle, byref(major), byref(minor))
            ):
                return None
            mig = getattr(lib, "nvmlDeviceGetMigMode", lambda *_: 1)  # 1: no MIG support
            if mig(handle, byref(mode), byref(pending)) == 0 and mode.value == 1:
                return None  # MIG instances are CUDA's devices: libcuda counts them
            archs.append((major.value, minor.value))
            uuid = create_string_buffer(96)
            ok = lib.nvmlDeviceGetUUID(handle, uuid, c_uint(96)) == 0
            uuids.append(uuid.value.decode("ascii", "replace") if ok else "")
        number = c_int()
        version = getattr(lib, "nvmlSystemGetCudaDriverVersion", None)
        ok = version is not None and version(byref(number)) == 0
    except (OSError, AttributeError, ValueError):
        return None
    finally:
        with contextlib.suppress(OSError, AttributeError):
            lib.nvmlShutdown()
    # NVML numbers GPUs in PCI bus order; CUDA's default order (fastest first) is CUDA's to
    # tell, unless every GPU has the same architecture and only their number matters.
    if len(set(archs)) > 1 and env.get("CUDA_DEVICE_ORDER", "").strip().upper() != "PCI_BUS_ID":
        return None
    chosen = _visible(env.get("CUDA_VISIBLE_DEVICES"), len(archs), uuids)
    if chosen is None:
        return None
    gpus = tuple((n, archs[i], None) for n, i in enumerate(chosen))
    driver = _cuda_version(number.value if ok else None)
    return GpuReport("cuda", gpus, driver, "NVML" if gpus else "NVML: no visible GPU")


# Any failure leaves stdout without JSON: no answer. cuInit's 100 is "no device".
_CUDA_PROBE = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
version, count = ctypes.c_int(), ctypes.c_int()
driver = version.value if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 else None
rc = lib.cuInit(0)
if rc not in (0, 100) or (rc == 0 and lib.cuDeviceGetCount(ctypes.byref(count))):
    sys.exit("cuInit or cuDeviceGetCount failed")
gpus = []
for i in range(count.value):
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if (
        lib.cuDeviceGet(ctypes.byref(dev), i)
        or lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)
        or lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
    ):
        sys.exit("cuDeviceGetAttribute failed for device %d" % i)
    gpus.append([major.value, minor.value])
print(json.dumps({"driver": driver, "gpus": gpus}))
"""


def _probe_libcuda(env: Mapping[str, str], library: str) -> GpuReport | None:
    """Ask ``libcuda`` in a child interpreter, so that this process's CUDA stays uninitialised."""
    import json
    import subprocess

    command = [sys.executable, "-S", "-E", "-c", _CUDA_PROBE, library]
    try:
        done = subprocess.run(
            command, env=dict(env), capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S
        )
        answer = json.loads(done.stdout)
        gpus = tuple((n, (major, minor), None) for n, (major, minor) in enumerate(answer["gpus"]))
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    source = "libcuda" if gpus else "libcuda: no visible GPU"
    return GpuReport("cuda", gpus, _cuda_version(answer["driver"]), source)


# --- AMD ------------------------------------------------------------------------------------


def gfx_name(target_version: int) -> str:
    """KFD's ``gfx_target_version`` as a gfx name: ``90402`` -> ``gfx942``, ``90010`` -> ``gfx90a``."""
    major, minor, step = target_version // 10000, target_version // 100 % 100, target_version % 100
    return f"gfx{major}{minor:x}{step:x}"


def _probe_kfd(env: Mapping[str, str], topology: str) -> GpuReport | None:
    try:
        nodes = sorted((int(name), name) for name in os.listdir(topology) if name.isdigit())
    except OSError:
        return GpuReport(None, (), None, "no ROCm driver")
    names: list[str] = []
    uuids: list[str] = []
    for _, name in nodes:
        try:
            with open(os.path.join(topology, name, "properties"), encoding="ascii") as file:
                props = dict(
                    line.split(None, 1) for line in file.read(65536).splitlines() if " " in line
                )
            target = int(props.get("gfx_target_version", "0"))
            unique = int(props.get("unique_id", "0"))
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        if target > 0:
            names.append(gfx_name(target))
            uuids.append(f"GPU-{unique:016x}" if unique else "")
    if not names:
        return GpuReport("hip", (), None, "ROCm KFD topology: no GPU")
    indices = _visible(env.get("ROCR_VISIBLE_DEVICES"), len(names), uuids)
    hip = env.get("HIP_VISIBLE_DEVICES", env.get("CUDA_VISIBLE_DEVICES"))
    if indices is not None and hip is not None:
        picked = _visible(hip, len(indices))
        indices = None if picked is None else [indices[i] for i in picked]
    if indices is None:
        return None
    gpus = tuple((n, None, names[i]) for n, i in enumerate(indices))
    source = "ROCm KFD topology" if gpus else "ROCm KFD topology: no visible GPU"
    return GpuReport("hip", gpus, _read_text(AMDGPU_VERSION).strip() or None, source)


def driver_version() -> str | None:
    """The NVIDIA or AMD GPU kernel driver's version, read from /proc or /sys (Linux)."""
    nvidia = _read_text("/proc/driver/nvidia/version")
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]*)", nvidia)
    if match:
        return f"nvidia {match[1]}"
    amdgpu = _read_text(AMDGPU_VERSION).strip()
    return f"amdgpu {amdgpu}" if amdgpu else None


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read(65536)
    except (OSError, ValueError):
        return ""

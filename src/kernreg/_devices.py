"""The GPUs of this machine as their drivers report them, without importing torch.

NVIDIA GPUs are read through NVML (``libnvidia-ml.so.1``), which creates no CUDA
context and leaves the process's CUDA state untouched, so a process may still fork
workers that use CUDA. Where NVML is missing, or cannot tell CUDA's device order (GPUs
of different architectures, ``CUDA_DEVICE_ORDER`` not ``PCI_BUS_ID``, MIG entries in
``CUDA_VISIBLE_DEVICES``), ``libcuda.so.1`` answers in a short-lived child interpreter:
``cuInit`` there applies ``CUDA_VISIBLE_DEVICES`` and CUDA's own order, and this
process's driver state stays uninitialised. AMD GPUs are read from the ROCm KFD topology
in sysfs. The libraries are found as the dynamic loader finds them (``LD_LIBRARY_PATH``
included), and only where an NVIDIA kernel driver is loaded; :func:`probe_gpus` takes
other paths (tests point it at stub libraries).

Visible devices follow the runtimes: CUDA reads ``CUDA_VISIBLE_DEVICES`` (indices or
``GPU-`` UUID prefixes; an empty value hides every GPU; an entry that names no device
ends the list, as in CUDA); ROCm reads ``ROCR_VISIBLE_DEVICES`` first, then
``HIP_VISIBLE_DEVICES``, else ``CUDA_VISIBLE_DEVICES``, with the same rules.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence

__all__ = ["GpuReport", "TorchBuild", "probe_gpus", "torch_build"]

NVML_LIBRARY = "libnvidia-ml.so.1"
CUDA_LIBRARY = "libcuda.so.1"
KFD_TOPOLOGY = "/sys/class/kfd/kfd/topology/nodes"
#: Files whose presence says an NVIDIA kernel driver is loaded (Linux, WSL).
_NVIDIA_HINTS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg")
_PROBE_TIMEOUT_S = 30.0

#: One GPU: its index as the runtime numbers it, and its architecture.
Gpu = tuple[int, tuple[int, int] | None, str | None]


class GpuReport:
    """What the drivers said: the vendor's device kind, the visible GPUs, where it came from."""

    __slots__ = ("device", "gpus", "driver_version", "source")

    def __init__(
        self, device: str | None, gpus: Sequence[Gpu], driver_version: str | None, source: str
    ) -> None:
        self.device = device  # "cuda", "hip", or None: no GPU
        self.gpus = tuple(gpus)
        self.driver_version = driver_version
        self.source = source

    def __repr__(self) -> str:
        return (
            f"GpuReport({self.device!r}, {self.gpus!r}, {self.driver_version!r}, {self.source!r})"
        )


class TorchBuild:
    """The torch build installed here, read from ``torch/version.py`` without importing torch."""

    __slots__ = ("version", "cuda", "hip", "xpu")

    def __init__(
        self, version: str | None, cuda: str | None, hip: str | None, xpu: str | None
    ) -> None:
        self.version = version
        self.cuda = cuda
        self.hip = hip
        self.xpu = xpu


_VERSION_LINE = re.compile(
    r"^(__version__|cuda|hip|xpu)\s*(?::[^=\n]*)?=\s*(?:'([^'\n]*)'|\"([^\"\n]*)\"|None)\s*$",
    re.MULTILINE,
)


def torch_build() -> TorchBuild | None:
    """The installed torch's version and GPU runtime versions; ``None`` without torch.

    An imported torch answers itself; otherwise (or while another thread is still
    importing it) its ``version.py`` is read as text.
    """
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    if hasattr(torch, "__version__"):  # set early in torch/__init__, with torch.version

        def text(value: object) -> str | None:
            return None if value is None else str(value)

        return TorchBuild(
            text(getattr(torch, "__version__", None)),
            text(getattr(version, "cuda", None)),
            text(getattr(version, "hip", None)),
            text(getattr(version, "xpu", None)),
        )
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):  # a half-imported torch may lack __spec__
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    values: dict[str, str | None] = {}
    for folder in spec.submodule_search_locations:
        try:
            with open(os.path.join(folder, "version.py"), encoding="utf-8") as file:
                source = file.read(65536)
        except OSError:
            continue
        for match in _VERSION_LINE.finditer(source):
            values.setdefault(match[1], match[2] if match[2] is not None else match[3])
        break
    return TorchBuild(
        values.get("__version__"), values.get("cuda"), values.get("hip"), values.get("xpu")
    )


def probe_gpus(
    environ: Mapping[str, str] | None = None,
    *,
    nvml_library: str | None = None,
    cuda_library: str | None = None,
    kfd_topology: str | None = None,
    prefer: str = "cuda",
) -> GpuReport | None:
    """The visible GPUs of this machine, or ``None`` when no driver could tell.

    A report with no GPUs is an answer (no GPU driver, or none visible). ``environ``
    defaults to ``os.environ``. ``nvml_library`` and ``cuda_library`` are paths of the
    NVIDIA libraries to ask (``"none"`` skips one); when either is given, only the given
    ones are asked, driver loaded or not. ``kfd_topology`` replaces the sysfs folder of
    the ROCm topology. ``prefer`` ("cuda" or "hip") says which vendor wins on a machine
    with both.
    """
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux"):
        return None
    probes: list[Callable[[], GpuReport | None]] = [
        lambda: _probe_nvidia(env, nvml_library, cuda_library),
        lambda: _probe_kfd(env, kfd_topology or KFD_TOPOLOGY),
    ]
    if prefer == "hip":
        probes.reverse()
    unanswered = False
    found: list[str] = []
    for probe in probes:
        report = probe()
        if report is None:
            unanswered = True
        elif report.gpus:
            return report
        else:
            found.append(report.source)
    if unanswered:
        return None
    return GpuReport(None, (), None, "no GPU: " + "; ".join(found))


# --- NVIDIA ---------------------------------------------------------------------------------


def _probe_nvidia(
    env: Mapping[str, str], nvml_library: str | None, cuda_library: str | None
) -> GpuReport | None:
    nvml, cuda = nvml_library, cuda_library
    if nvml is None and cuda is None:
        if not any(os.path.exists(hint) for hint in _NVIDIA_HINTS):
            return GpuReport(None, (), None, "no NVIDIA driver")
        nvml, cuda = NVML_LIBRARY, CUDA_LIBRARY
    asked = False
    if nvml is not None and nvml.lower() != "none":
        asked = True
        report = _probe_nvml(env, nvml)
        if report is not None:
            return report
    if cuda is not None and cuda.lower() != "none":
        return _probe_libcuda(env, cuda)
    return None if asked else GpuReport(None, (), None, "NVIDIA driver libraries not asked")


def _visible(value: str | None, count: int, uuids: Sequence[str] = ()) -> list[int] | None:
    """Indices named by a ``*_VISIBLE_DEVICES`` value, in its order; ``None``: not mappable.

    As in CUDA, an entry that names no device (out of range, repeated, malformed) ends
    the list. ``GPU-`` entries are UUID prefixes matched against ``uuids``.
    """
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


def _cuda_version(number: int) -> str | None:
    """``12040`` -> ``"12.4"`` (the CUDA version a driver supports)."""
    return f"{number // 1000}.{number % 1000 // 10}" if number > 0 else None


def _probe_nvml(env: Mapping[str, str], library: str) -> GpuReport | None:
    import ctypes

    try:
        lib = ctypes.CDLL(library)
        if lib.nvmlInit_v2() != 0:
            return None
    except (OSError, AttributeError):
        return None
    try:
        count = ctypes.c_uint()
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        archs: list[tuple[int, int]] = []
        uuids: list[str] = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            major, minor = ctypes.c_int(), ctypes.c_int()
            if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(handle)) != 0:
                return None
            if lib.nvmlDeviceGetCudaComputeCapability(
                handle, ctypes.byref(major), ctypes.byref(minor)
            ):
                return None
            current, pending = ctypes.c_uint(), ctypes.c_uint()
            mig = getattr(lib, "nvmlDeviceGetMigMode", None)
            if (
                mig is not None
                and mig(handle, ctypes.byref(current), ctypes.byref(pending)) == 0
                and current.value == 1
            ):
                return None  # MIG instances are CUDA's devices: libcuda counts them
            archs.append((major.value, minor.value))
            buffer = ctypes.create_string_buffer(96)
            ok = lib.nvmlDeviceGetUUID(handle, buffer, ctypes.c_uint(96)) == 0
            uuids.append(buffer.value.decode("ascii", "replace") if ok else "")
        number = ctypes.c_int()
        driver = None
        version = getattr(lib, "nvmlSystemGetCudaDriverVersion", None)
        if version is not None and version(ctypes.byref(number)) == 0:
            driver = _cuda_version(number.value)
    except (OSError, AttributeError, ValueError):
        return None
    finally:
        with contextlib.suppress(OSError, AttributeError):
            lib.nvmlShutdown()
    value = env.get("CUDA_VISIBLE_DEVICES")
    if len(set(archs)) <= 1:
        # One architecture: which GPUs are visible does not matter, only how many.
        chosen = _visible(value, len(archs), uuids)
    elif env.get("CUDA_DEVICE_ORDER", "").strip().upper() == "PCI_BUS_ID":
        chosen = _visible(value, len(archs), uuids)  # NVML numbers GPUs in PCI bus order too
    else:
        return None  # CUDA's default order (fastest first) is CUDA's to tell
    if chosen is None:
        return None
    gpus = [(n, archs[i], None) for n, i in enumerate(chosen)]
    return GpuReport("cuda", gpus, driver, "NVML" if gpus else "NVML: no visible GPU")


_CUDA_PROBE = r"""
import ctypes, json, sys
out = {}
try:
    lib = ctypes.CDLL(sys.argv[1])
    version = ctypes.c_int()
    if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
        out["driver"] = version.value
    rc = lib.cuInit(0)
    if rc == 100:
        out["gpus"] = []
    elif rc != 0:
        out["error"] = "cuInit returned %d" % rc
    else:
        count = ctypes.c_int()
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            raise RuntimeError("cuDeviceGetCount failed")
        gpus = []
        for i in range(count.value):
            dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
            if (
                lib.cuDeviceGet(ctypes.byref(dev), i)
                or lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)
                or lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
            ):
                raise RuntimeError("cuDeviceGetAttribute failed for device %d" % i)
            gpus.append([major.value, minor.value])
        out["gpus"] = gpus
except Exception as exc:
    out["error"] = "%s: %s" % (type(exc).__name__, exc)
print(json.dumps(out))
"""


def _probe_libcuda(env: Mapping[str, str], library: str) -> GpuReport | None:
    """Ask ``libcuda`` in a child interpreter, so that this process's CUDA stays uninitialised."""
    import json
    import subprocess

    try:
        done = subprocess.run(
            [sys.executable, "-S", "-E", "-c", _CUDA_PROBE, library],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
        answer = json.loads(done.stdout)
        if not isinstance(answer, dict) or "error" in answer:
            return None
        gpus: list[Gpu] = []
        for n, (major, minor) in enumerate(answer["gpus"]):
            if type(major) is not int or type(minor) is not int or major < 0 or minor < 0:
                return None
            gpus.append((n, (major, minor), None))
        driver = answer.get("driver")
        return GpuReport(
            "cuda",
            gpus,
            _cuda_version(driver) if type(driver) is int else None,
            "libcuda" if gpus else "libcuda: no visible GPU",
        )
    except (OSError, ValueError, TypeError, KeyError, subprocess.SubprocessError):
        return None


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
    indices: list[int] | None = list(range(len(names)))
    rocr = env.get("ROCR_VISIBLE_DEVICES")
    if rocr is not None:
        indices = _visible(rocr, len(names), uuids)
    hip = env.get("HIP_VISIBLE_DEVICES", env.get("CUDA_VISIBLE_DEVICES"))
    if indices is not None and hip is not None:
        picked = _visible(hip, len(indices))
        indices = None if picked is None else [indices[i] for i in picked]
    if indices is None:
        return None
    driver = None
    try:
        with open("/sys/module/amdgpu/version", encoding="ascii") as file:
            driver = file.read(100).strip() or None
    except (OSError, UnicodeDecodeError):
        pass
    gpus = [(n, None, names[i]) for n, i in enumerate(indices)]
    source = "ROCm KFD topology" if gpus else "ROCm KFD topology: no visible GPU"
    return GpuReport("hip", gpus, driver, source)

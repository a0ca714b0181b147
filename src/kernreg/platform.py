"""What a kernel needs (:class:`Requirement`) and what a machine offers (:class:`Platform`)."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import TYPE_CHECKING

from kernreg._frozen import Frozen
from kernreg._names import NAME_RE, check_name
from kernreg.errors import InvalidSpecError

if TYPE_CHECKING:
    from kernreg._devices import Gpu, GpuReport, TorchBuild

__all__ = [
    "GPU_MODELS",
    "Arch",
    "Platform",
    "PlatformLike",
    "Requirement",
    "parse_platform",
    "suggest_platform",
]

Arch = tuple[int, int]

# re.ASCII: \d would take any script's digits, which int() reads ("cuda:\uff19.0" as 9.0).
_ARCH_RE = re.compile(r"(\d+)\.(\d+)", re.ASCII)
_SM_RE = re.compile(r"sm_(\d+)(\d)([a-z]?)", re.ASCII)
_REQ_RE = re.compile(
    r"(?P<device>[a-z][a-z0-9_]*)"
    r"(?:(?P<window>(?:\s*(?:>=|<=|==)\s*\d+\.\d+)(?:\s*,\s*(?:>=|<=)\s*\d+\.\d+)?)"
    r"|:(?P<names>[a-z0-9_]+(?:\|[a-z0-9_]+)*))?",
    re.ASCII,
)
_BOUND_RE = re.compile(r"(>=|<=|==)\s*(\d+\.\d+)", re.ASCII)


def parse_arch(value: object, field_name: str = "arch") -> Arch:
    """Accept ``(9, 0)``, ``"9.0"`` or ``"sm_90"`` and return ``(9, 0)``."""
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and all(type(v) is int and v >= 0 for v in value)
    ):
        return (value[0], value[1])
    if isinstance(value, str):
        text = value.strip()
        match = _ARCH_RE.fullmatch(text) or _SM_RE.fullmatch(text)
        if match:
            with contextlib.suppress(ValueError):  # more digits than int() converts
                return (int(match[1]), int(match[2]))
    why = "expected an architecture like (9, 0), '9.0' or 'sm_90'"
    raise InvalidSpecError(field_name, value, why)


def format_arch(arch: Arch) -> str:
    return f"{arch[0]}.{arch[1]}"


def _cuda_runs(names: Iterable[str], arch: Arch) -> bool:
    """Whether code built for one of the CUDA targets ``names`` runs on compute capability
    ``arch``: ``sm_90`` and the arch-specific ``sm_90a`` on 9.0 (what an H100 reports: its
    name is ``sm_90``), the family-specific ``sm_100f`` on 10.x from 10.0."""
    for name in names:
        match = _SM_RE.fullmatch(name)
        if match is None:
            continue
        target, suffix = (int(match[1]), int(match[2])), match[3]
        if suffix in ("", "a") and arch == target:
            return True
        if suffix == "f" and arch[0] == target[0] and arch >= target:
            return True
    return False


def cuda_arch_name(arch: Arch) -> str:
    """The CUDA name of a compute capability: ``(9, 0)`` -> ``sm_90``."""
    return f"sm_{arch[0]}{arch[1]}"


class Requirement(Frozen):
    """A device, optionally restricted to an inclusive architecture window or exact arch names
    (``Requirement("hip", archs={"gfx942"})``); a spec's requirements are alternatives."""

    __slots__ = ("device", "min_arch", "max_arch", "archs", "_hash")
    device: str
    min_arch: Arch | None
    max_arch: Arch | None
    archs: frozenset[str]
    _hash: int

    def __hash__(self) -> int:
        return self._hash

    def __init__(
        self,
        device: str,
        *,
        min_arch: Arch | str | None = None,
        max_arch: Arch | str | None = None,
        archs: Iterable[str] = (),
    ) -> None:
        self._set("device", check_name(device, "requirement device"))
        if device.startswith(("sm", "gfx")) and (spelling := _bare_arch(device, "==")):
            why = f"an architecture is not a device; write {spelling!r}"
            raise InvalidSpecError("requirement device", device, why)
        for field, arch in (("min_arch", min_arch), ("max_arch", max_arch)):
            self._set(field, None if arch is None else parse_arch(arch, f"requirement {field}"))
        if isinstance(archs, str) or not isinstance(archs, Iterable):
            why = "expected a collection of arch names"
            raise InvalidSpecError("requirement archs", archs, why)
        names = tuple(archs)
        for name in names:  # checked before hashing: a list in there is an error, not a TypeError
            if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
                why = "expected an arch name like 'sm_90a' or 'gfx942'"
                raise InvalidSpecError("requirement archs", name, why)
        self._set("archs", frozenset(names))
        # Every spec construction hashes its requirements (the requirement-set cache key):
        # hashed once, 0.4 µs instead of 4 µs, a tenth of registering 100,000 specs.
        self._set("_hash", hash(self._key()))
        lo, hi = self.min_arch, self.max_arch
        if lo is not None and hi is not None and lo > hi:
            why = "min_arch is above max_arch, so nothing can match"
            raise InvalidSpecError("requirement", str(self), why)
        if device == "hip" and (lo is not None or hi is not None):
            # A ROCm platform has a gfx name and no version: a window would never match.
            why = "a ROCm GPU is matched by its gfx name, e.g. 'hip:gfx942|gfx950'"
            raise InvalidSpecError("requirement", str(self), why)

    @classmethod
    def parse(cls, text: str) -> Requirement:
        """Parse ``cuda``, ``cuda>=8.0``, ``cuda>=8.0,<=9.0``, ``cuda==9.0`` or ``hip:gfx942|gfx950``."""
        if not isinstance(text, str):
            raise InvalidSpecError(
                "requirement", text, "expected a requirement string such as 'cuda>=8.0'"
            )
        match = _REQ_RE.fullmatch(text.strip())
        if match is None:
            forms = "'device>=M.m', 'device>=M.m,<=M.m', 'device==M.m' or 'device:name|name'"
            raise InvalidSpecError("requirement", text, f"expected 'device', {forms}")
        lo: Arch | None = None
        hi: Arch | None = None
        for op, arch_text in _BOUND_RE.findall(match["window"] or ""):
            sets_lo, sets_hi = op != "<=", op != ">="  # "==" sets both
            if (sets_lo and lo is not None) or (sets_hi and hi is not None):
                why = f"the bound {op}{arch_text} is given twice"
                raise InvalidSpecError("requirement", text, why)
            arch = parse_arch(arch_text, "requirement")
            lo, hi = (arch if sets_lo else lo), (arch if sets_hi else hi)
        names = frozenset(match["names"].split("|")) if match["names"] else frozenset()
        return cls(match["device"], min_arch=lo, max_arch=hi, archs=names)

    @classmethod
    def coerce(cls, value: Requirement | str) -> Requirement:
        return value if isinstance(value, Requirement) else cls.parse(value)

    def allows(self, platform: Platform) -> bool:
        """Whether ``platform`` satisfies this requirement (:meth:`matches` says why not)."""
        arch, lo, hi = platform.arch, self.min_arch, self.max_arch
        return (
            platform.device == self.device
            and (lo is None or (arch is not None and arch >= lo))
            and (hi is None or (arch is not None and arch <= hi))
            and (
                not self.archs
                or platform.arch_name in self.archs
                or (arch is not None and self.device == "cuda" and _cuda_runs(self.archs, arch))
            )
        )

    def matches(self, platform: Platform) -> str | None:
        """``None`` if ``platform`` satisfies this requirement, else the reason it does not."""
        arch, lo, hi = platform.arch, self.min_arch, self.max_arch
        if self.allows(platform):
            return None
        if platform.device != self.device:
            return f"needs device {self}, platform is {platform.device}"
        if arch is None and (lo is not None or hi is not None):
            return f"needs {self}, platform architecture unknown"
        if arch is not None and ((lo is not None and arch < lo) or (hi is not None and arch > hi)):
            return f"needs {self}, platform is {format_arch(arch)}"
        return f"needs {self}, platform arch is {platform.arch_name or 'unknown'}"

    def __str__(self) -> str:
        lo, hi = self.min_arch, self.max_arch
        if lo is not None and lo == hi:
            text = f"{self.device}=={format_arch(lo)}"
        else:
            bounds = (f"{op}{format_arch(a)}" for op, a in ((">=", lo), ("<=", hi)) if a)
            text = self.device + ",".join(bounds)
        if self.archs:
            text += ":" + "|".join(sorted(self.archs))
        return text

    def sort_key(self) -> tuple[str, Arch, Arch, tuple[str, ...]]:
        lo, hi = self.min_arch or (-1, -1), self.max_arch or (-1, -1)
        return (self.device, lo, hi, tuple(sorted(self.archs)))


class Platform(Frozen):
    """The machine a decision is made for: device kind, architecture and runtime versions;
    ``source``, ``devices`` (one platform per device index) and ``driver_version`` not compared."""

    __slots__ = (
        "device",
        "arch",
        "arch_name",
        "index",
        "torch_version",
        "runtime_version",
        "source",
        "devices",
        "driver_version",
        "_hash",
    )
    _hidden = ("source", "devices", "driver_version")
    device: str
    arch: Arch | None
    arch_name: str | None
    index: int | None
    torch_version: str | None
    runtime_version: str | None
    source: str
    devices: tuple[Platform, ...]
    driver_version: str | None
    _hash: int

    def __init__(
        self,
        device: str,
        *,
        arch: Arch | str | None = None,
        arch_name: str | None = None,
        index: int | None = None,
        torch_version: str | None = None,
        runtime_version: str | None = None,
        source: str = "",
        devices: Iterable[Platform] = (),
        driver_version: str | None = None,
    ) -> None:
        self._set("device", check_name(device, "platform device"))
        self._set("arch", None if arch is None else parse_arch(arch, "platform arch"))
        if device == "hip" and self.arch is not None:
            why = "a ROCm GPU is named by its gfx name: Platform('hip', arch_name='gfx942')"
            raise InvalidSpecError("platform arch", arch, why)
        if arch_name is None and device == "cuda" and self.arch is not None:
            arch_name = cuda_arch_name(self.arch)
        if arch_name is not None and (
            not isinstance(arch_name, str) or NAME_RE.fullmatch(arch_name) is None
        ):
            raise InvalidSpecError("platform arch_name", arch_name, "expected a name like 'gfx942'")
        self._set("arch_name", arch_name)
        self._set("index", index)
        self._set("torch_version", torch_version)
        self._set("runtime_version", runtime_version)
        self._set("source", source)
        listed = tuple(devices)
        for item in listed:
            if not isinstance(item, Platform):
                raise InvalidSpecError("platform devices", item, "expected a Platform per device")
        self._set("devices", listed)
        self._set("driver_version", driver_version)
        # Platforms key every cached decision: hashed once, 0.3 µs a look-up instead of 2.4 µs.
        self._set("_hash", hash(self._key()))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def parse(cls, text: str, *, source: str = "") -> Platform:
        """Parse ``cpu``, ``cuda:9.0``, ``cuda:sm_90a``, ``hip:gfx942``, ``mps``; ``cuda:8.0,9.0``
        is one GPU per index: device 0's platform, with every device in :attr:`devices`."""
        if not isinstance(text, str):
            raise InvalidSpecError("platform", text, "expected a string such as 'cuda:9.0'")
        device, sep, rest = text.strip().lower().partition(":")
        if NAME_RE.fullmatch(device) is None or (sep and not rest):
            why = "expected 'device' or 'device:arch', e.g. 'cpu', 'cuda:9.0', 'hip:gfx942'"
            raise InvalidSpecError("platform", text, why)
        if not sep:
            return cls(device, source=source)

        def one(arch: str, index: int | None) -> Platform:
            numeric = _ARCH_RE.fullmatch(arch) and device != "hip"
            if numeric or (device == "cuda" and _SM_RE.fullmatch(arch)):
                name = arch if arch.startswith("sm_") else None
                return cls(
                    device, arch=parse_arch(arch), arch_name=name, index=index, source=source
                )
            # A typo must not quietly reject every GPU kernel: CUDA and ROCm names are checked.
            if device == "cuda":
                why = "a CUDA architecture is 'M.m' or 'sm_XY[a]', e.g. 'cuda:9.0'"
            elif device == "hip" and not arch.startswith("gfx"):
                why = "a ROCm architecture is a gfx name, e.g. 'hip:gfx942'"
            elif NAME_RE.fullmatch(arch):
                return cls(device, arch_name=arch, index=index, source=source)
            else:
                why = f"cannot read the architecture {arch!r}"
            raise InvalidSpecError("platform", text, why)

        parts = [part.strip() for part in rest.split(",")]
        if len(parts) > 1 and not all(parts):
            why = "expected one architecture per device, e.g. 'cuda:8.0,9.0'"
            raise InvalidSpecError("platform", text, why)
        # Like a one-device text, the platform itself has no index: str() parses back to it.
        platform = one(parts[0], None)
        if len(parts) == 1:
            return platform
        return platform.replace(devices=tuple(one(part, i) for i, part in enumerate(parts)))

    @classmethod
    def detect(
        cls,
        *,
        nvml_library: str | None = None,
        cuda_library: str | None = None,
        kfd_topology: str | None = None,
    ) -> Platform:
        """Describe this machine and every GPU in it (``KERNREG_PLATFORM`` if valid, else the GPU
        drivers without importing torch, else torch). Never raises."""
        override = os.environ.get("KERNREG_PLATFORM", "").strip()
        if override and suggest_platform(override) is None:
            # A bad value is configuration's to report: detection must not fail.
            with contextlib.suppress(InvalidSpecError):
                return cls.parse(override, source="KERNREG_PLATFORM")
        try:
            return _detect(nvml_library, cuda_library, kfd_topology)
        except Exception as exc:  # a broken driver or torch install must not break start-up
            return cls("cpu", source=f"detection failed ({type(exc).__name__}: {exc})")

    def on_device(self, device_type: str) -> Platform:
        """The platform for a call whose tensors live on ``device_type``."""
        return self.for_device(device_type)

    def for_device(self, device: object) -> Platform:
        """The platform a call runs on, from the ``device`` of its arguments (torch, cupy or jax
        device, ``'cuda:1'``, a CUDA index). Never raises: an unreadable one is ``unknown``."""
        if device is None:
            return self
        try:
            kind, index = _device_parts(device)
        except Exception:
            kind, index = None, None
        if kind is None or NAME_RE.fullmatch(kind) is None:
            source = f"call on an unrecognised device {_shown(device)}"
            return Platform("unknown", torch_version=self.torch_version, source=source)
        if kind != self.device and not (kind == "cuda" and self.device == "hip"):
            return Platform(kind, torch_version=self.torch_version, source=f"call on {kind}")
        if index is None or index == self.index or not self.devices:
            return self
        for each in self.devices:
            if each.index == index:
                return each.replace(devices=self.devices)
        return Platform(
            self.device,
            index=index,
            torch_version=self.torch_version,
            runtime_version=self.runtime_version,
            source=(
                f"call on {kind}:{index}, not among the {len(self.devices)} devices "
                f"of {self.source or 'this platform'}; architecture unknown"
            ),
        )

    def with_source(self, source: str) -> Platform:
        return self.replace(source=source)

    def __str__(self) -> str:
        implied = cuda_arch_name(self.arch) if self.device == "cuda" and self.arch else None
        if self.arch_name is not None and self.arch_name != implied:
            return f"{self.device}:{self.arch_name}"
        if self.arch is not None:
            return f"{self.device}:{format_arch(self.arch)}"
        return self.device

    def describe(self) -> dict[str, object]:
        """A JSON-ready description, for the CLI and for plans."""
        return {
            "platform": str(self),
            "device": self.device,
            "arch": format_arch(self.arch) if self.arch else None,
            "arch_name": self.arch_name,
            "index": self.index,
            "torch_version": self.torch_version,
            "runtime_version": self.runtime_version,
            "driver_version": self.driver_version,
            "source": self.source,
            "devices": [
                {key: info[key] for key in ("index", "platform", "arch", "arch_name")}
                for info in map(Platform.describe, self.devices)
            ],
        }


# --- calls' devices -------------------------------------------------------------------------

_DEVICE_TEXT_RE = re.compile(r"(?:tfrt_|xla_)?([a-z][a-z0-9_]*?)(?:[:_](\d+))?")
_NON_LETTERS = re.compile(r"[^a-z]+")


def _device_parts(device: object) -> tuple[str | None, int | None]:
    """``(kind, index)`` of a call's device object; kind ``None`` when it cannot be read."""
    if isinstance(device, bool):
        return None, None
    if isinstance(device, int):
        return ("cuda", device) if device >= 0 else (None, None)
    if isinstance(device, str):
        match = _DEVICE_TEXT_RE.fullmatch(device.strip().lower()[:64])
        if match is None:
            return None, None
        return _kind(match[1]), None if match[2] is None else int(match[2])
    kind = getattr(device, "type", None)
    if isinstance(kind, str):  # torch.device and look-alikes
        return _kind(kind), _index(getattr(device, "index", None))
    platform = getattr(device, "platform", None)
    if isinstance(platform, str):  # jax devices
        ident = getattr(device, "local_hardware_id", None)
        return _kind(platform), _index(ident if type(ident) is int else getattr(device, "id", None))
    # Last resort, for cupy's ``<CUDA Device 0>`` and look-alikes with an ``id``: the first
    # known kind the text names (a ``str()`` that raises is for_device's to catch).
    for word in _NON_LETTERS.split(str(device)[:80].lower()):
        kind = _DEVICE_ALIASES.get(word, word)
        if kind in _COMMON_DEVICES:
            return kind, _index(getattr(device, "id", None))
    return None, None


def _index(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _kind(name: str) -> str:
    name = name.strip().lower()
    return _DEVICE_ALIASES.get(name, name)


def _shown(device: object) -> str:
    """A short, safe text of what a call carried as its device."""
    try:
        text = repr(device)
    except Exception:
        text = f"<{type(device).__name__} object>"
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(device).__module__}.{type(device).__qualname__})"


# --- misspelt device names ------------------------------------------------------------------

#: Device kinds kernreg and torch name; never reported as misspellings.
KNOWN_DEVICES = frozenset(
    {
        "cpu", "cuda", "hip", "mps", "xpu", "npu", "tpu", "xla", "meta", "hpu", "ipu",
        "mtia", "maia", "ve", "fpga", "lazy", "vulkan", "privateuseone", "mkldnn",
        "opengl", "opencl", "ideep", "mlu", "musa", "gcu", "unknown",
    }
)  # fmt: skip
#: The device names people most often mean.
_COMMON_DEVICES = ("cuda", "hip", "cpu", "mps", "xpu", "npu")
#: What people and other libraries call a device that kernreg names otherwise.
_DEVICE_ALIASES = MappingProxyType({
    "gpu": "cuda", "nvidia": "cuda", "nv": "cuda", "rocm": "hip", "amd": "hip", "amdgpu": "hip",
    "apple": "mps", "metal": "mps", "intel": "xpu", "ascend": "npu", "tfrt_cpu": "cpu",
})  # fmt: skip


#: GPU models and architecture families people give as a device, and the platform they
#: mean (the model's architecture: the platform kernreg decides for).
GPU_MODELS = MappingProxyType({
    # NVIDIA, by compute capability
    "v100": "cuda:7.0", "volta": "cuda:7.0", "t4": "cuda:7.5", "turing": "cuda:7.5",
    "a100": "cuda:8.0", "a800": "cuda:8.0", "a30": "cuda:8.0", "ampere": "cuda:8.0",
    "a10": "cuda:8.6", "a10g": "cuda:8.6", "a40": "cuda:8.6", "a6000": "cuda:8.6",
    "a5000": "cuda:8.6", "a4000": "cuda:8.6", "a16": "cuda:8.6", "a2": "cuda:8.6",
    "rtx3090": "cuda:8.6", "rtx3080": "cuda:8.6", "rtx3070": "cuda:8.6",
    "l4": "cuda:8.9", "l40": "cuda:8.9", "l40s": "cuda:8.9", "l20": "cuda:8.9",
    "ada": "cuda:8.9", "rtx4090": "cuda:8.9", "rtx4080": "cuda:8.9", "rtx6000": "cuda:8.9",
    "h100": "cuda:9.0", "h200": "cuda:9.0", "h800": "cuda:9.0", "h20": "cuda:9.0",
    "gh200": "cuda:9.0", "hopper": "cuda:9.0",
    "b100": "cuda:10.0", "b200": "cuda:10.0", "gb200": "cuda:10.0", "b300": "cuda:10.3",
    "gb300": "cuda:10.3", "blackwell": "cuda:10.0", "rtx5090": "cuda:12.0",
    "rtx5080": "cuda:12.0",
    # AMD, by gfx target
    "mi50": "hip:gfx906", "mi60": "hip:gfx906", "mi100": "hip:gfx908",
    "mi200": "hip:gfx90a", "mi210": "hip:gfx90a", "mi250": "hip:gfx90a",
    "mi250x": "hip:gfx90a", "mi300": "hip:gfx942", "mi300x": "hip:gfx942",
    "mi300a": "hip:gfx942", "mi325x": "hip:gfx942", "mi350x": "hip:gfx950",
    "mi355x": "hip:gfx950",
    # Apple
    "m1": "mps", "m2": "mps", "m3": "mps", "m4": "mps",
})  # fmt: skip

_SM_NAME = re.compile(r"sm_?(\d+)(\d)([a-z]?)", re.ASCII)
_GFX_NAME = re.compile(r"gfx[0-9a-f]{3,5}")
#: Words around a model name that say nothing about the device (``nvidia_h100_sxm``).
_MODEL_NOISE = frozenset({"nvidia", "amd", "tesla", "geforce", "instinct", "radeon", "apple"})


def _gpu_model(device: str) -> str | None:
    """The platform a GPU model name means (``h100``, ``nvidia_h100_80gb``, ``rtx_4090``)."""
    words = [w for w in device.replace("-", "_").split("_") if w and w not in _MODEL_NOISE]
    if len(words) > 1 and words[0] in ("rtx", "gtx"):
        words = [words[0] + words[1], *words[2:]]
    return GPU_MODELS.get(words[0]) if words else None


def _bare_arch(device: str, version_op: str = ":") -> str | None:
    """What a bare architecture given as a device means (``sm_90a``: ``cuda:sm_90a``);
    ``version_op`` joins ``cuda`` and a compute capability (``cuda:9.0`` or ``cuda==9.0``)."""
    if sm := _SM_NAME.fullmatch(device):
        return f"cuda:sm_{sm[1]}{sm[2]}{sm[3]}" if sm[3] else f"cuda{version_op}{sm[1]}.{sm[2]}"
    return f"hip:{device}" if _GFX_NAME.fullmatch(device) else None


def suggest_platform(text: str, known: Iterable[str] = ()) -> str | None:
    """What ``text`` meant if its device, unknown and not in ``known``, is an alias (``gpu``), a
    GPU model, a bare architecture (``sm_90``) or a misspelling (``cdua``); else ``None``."""
    if not isinstance(text, str):
        return None  # type: ignore[unreachable]
    device, sep, rest = text.strip().lower().partition(":")
    known_names = set(known)
    if device in KNOWN_DEVICES or device in known_names or not device:
        return None
    if model := _gpu_model(device):
        return model
    if bare := _bare_arch(device):
        return bare
    arch = sep + rest
    if device in _DEVICE_ALIASES:
        return _DEVICE_ALIASES[device] + arch
    limit = 1 if len(device) <= 4 else 2
    candidates = [*_COMMON_DEVICES, *sorted(known_names - set(_COMMON_DEVICES))]
    best = min(candidates, key=lambda name: _edits(device, name))
    return best + arch if _edits(device, best) <= limit else None


def parse_platform(
    text: str, *, source: str = "", known: Callable[[], Iterable[str]] | None = None
) -> Platform:
    """:meth:`Platform.parse`, refusing a mistaken device name (:func:`suggest_platform`)
    unless ``known()`` (asked only then) lists it."""
    try:
        platform = Platform.parse(text, source=source)
    except InvalidSpecError as exc:
        suggestion = suggest_platform(text)
        if suggestion is None:
            raise
        why = f"{exc.why}; did you mean {suggestion!r}?"
        raise InvalidSpecError(source or "platform", text, why) from None
    suggestion = suggest_platform(text) and suggest_platform(text, known() if known else ())
    if suggestion is None:
        return platform
    what = f"unknown device {platform.device!r}"
    if _gpu_model(platform.device):
        what = f"{platform.device!r} is a GPU model, not a device"
    why = f"{what} (no registered kernel mentions it); did you mean {suggestion!r}?"
    raise InvalidSpecError(source or "platform", text, why)


def _edits(a: str, b: str) -> int:
    """Edits (insert, delete, replace, swap two neighbours) that turn ``a`` into ``b``."""
    if abs(len(a) - len(b)) > 2:
        return 3
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            cost = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, previous2[j - 2] + 1)
            current.append(cost)
        previous2, previous = previous, current
    return previous[-1]


# --- detection ------------------------------------------------------------------------------


def _detect(nvml_library: str | None, cuda_library: str | None, kfd: str | None) -> Platform:
    import importlib.util

    from kernreg import _devices

    build = _devices.torch_build()
    report = _devices.probe_gpus(
        nvml_library=nvml_library,
        cuda_library=cuda_library,
        kfd_topology=kfd,
        prefer="hip" if build is not None and build.hip else "cuda",
    )
    if report is not None and report.device is not None and report.gpus:
        return _from_report(report, build)
    # Only torch describes the devices no driver probe reads: Apple's, Intel's, Ascend's.
    if build is not None and (
        report is None
        or "torch" in sys.modules
        or sys.platform == "darwin"
        or bool(build.xpu)
        or os.path.exists("/dev/davinci_manager")
        or importlib.util.find_spec("torch_npu") is not None
    ):
        try:
            return _detect_with_torch()
        except Exception as exc:  # a broken torch install must not break start-up
            why = f"torch failed during detection ({type(exc).__name__}: {exc})"
            return Platform("cpu", torch_version=build.version, source=why)
    why = "GPU drivers could not tell" if report is None else report.source
    if build is None:
        return Platform("cpu", source=f"{why}; torch not installed")
    return Platform("cpu", torch_version=build.version, source=why)


def _from_report(report: GpuReport, build: TorchBuild | None, current: int = 0) -> Platform:
    """The platform of GPU ``current`` of ``report``, with every GPU in its devices."""
    assert report.device is not None
    runtime = None if build is None else (build.hip if report.device == "hip" else build.cuda)
    devices = tuple(
        Platform(
            report.device,
            arch=arch,
            arch_name=name,
            index=index,
            torch_version=None if build is None else build.version,
            runtime_version=runtime,
            source=report.source,
            driver_version=report.driver_version,
        )
        for index, arch, name in report.gpus
    )
    base = next((each for each in devices if each.index == current), devices[0])
    return base.replace(devices=devices)


def _detect_with_torch() -> Platform:
    import torch

    from kernreg._devices import GpuReport, TorchBuild

    version = str(torch.__version__)
    if torch.cuda.is_available():
        current = torch.cuda.current_device()
        hip = getattr(torch.version, "hip", None)
        gpus: list[Gpu] = []
        for i in range(torch.cuda.device_count()):
            if hip:
                name = str(getattr(torch.cuda.get_device_properties(i), "gcnArchName", ""))
                gpus.append((i, None, name.split(":")[0] or None))
            else:
                gpus.append((i, torch.cuda.get_device_capability(i), None))
        source = "torch.cuda (ROCm)" if hip else "torch.cuda"
        report = GpuReport("hip" if hip else "cuda", tuple(gpus), None, source)
        runtime = str(hip or torch.version.cuda)
        return _from_report(report, TorchBuild(version, runtime, runtime, None), current)
    for kind in ("xpu", "npu"):
        backend = getattr(torch, kind, None)
        if backend is not None and backend.is_available():
            index = backend.current_device()
            return Platform(kind, index=index, torch_version=version, source=f"torch.{kind}")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return Platform("mps", torch_version=version, source="torch.backends.mps")
    return Platform("cpu", torch_version=version, source="torch (no accelerator available)")


#: A ``platform=`` argument: a Platform, its text form (``"cuda:9.0"``) or ``None`` (here).
PlatformLike = Platform | str | None

"""What a kernel needs (:class:`Requirement`) and what a machine offers (:class:`Platform`)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Iterable

from kernreg._frozen import Frozen
from kernreg._names import NAME_RE, check_name
from kernreg.errors import InvalidSpecError

__all__ = ["Arch", "Platform", "Requirement"]

Arch = tuple[int, int]

_ARCH_RE = re.compile(r"(\d+)\.(\d+)")
_SM_RE = re.compile(r"sm_(\d+)(\d)([a-z]?)")
_ARCH_NAME_RE = re.compile(r"[a-z][a-z0-9_]*")
_REQ_RE = re.compile(
    r"(?P<device>[a-z][a-z0-9_]*)"
    r"(?:(?P<window>(?:\s*(?:>=|<=|==)\s*\d+\.\d+)(?:\s*,\s*(?:>=|<=)\s*\d+\.\d+)?)"
    r"|:(?P<names>[a-z0-9_]+(?:\|[a-z0-9_]+)*))?"
)
_BOUND_RE = re.compile(r"(>=|<=|==)\s*(\d+\.\d+)")


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
        match = _ARCH_RE.fullmatch(text)
        if match:
            return (int(match[1]), int(match[2]))
        sm = _SM_RE.fullmatch(text)
        if sm:
            return (int(sm[1]), int(sm[2]))
    raise InvalidSpecError(
        field_name, value, "expected an architecture like (9, 0), '9.0' or 'sm_90'"
    )


def format_arch(arch: Arch) -> str:
    return f"{arch[0]}.{arch[1]}"


def cuda_arch_name(arch: Arch) -> str:
    """The CUDA name of a compute capability: ``(9, 0)`` -> ``sm_90``."""
    return f"sm_{arch[0]}{arch[1]}"


class Requirement(Frozen):
    """A device, optionally restricted to an inclusive architecture window or exact arch names.

    ``Requirement("cuda", min_arch=(8, 0))`` accepts every CUDA GPU from SM 8.0 on;
    ``Requirement("hip", archs={"gfx942"})`` only MI300-class GPUs. A spec's
    requirements are alternatives: it may run where any of them holds.
    """

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
        self._set(
            "min_arch", None if min_arch is None else parse_arch(min_arch, "requirement min_arch")
        )
        self._set(
            "max_arch", None if max_arch is None else parse_arch(max_arch, "requirement max_arch")
        )
        if isinstance(archs, str) or not isinstance(archs, Iterable):
            raise InvalidSpecError(
                "requirement archs", archs, "expected a collection of arch names"
            )
        names = tuple(archs)
        for name in names:  # checked before hashing: a list in there is an error, not a TypeError
            if not isinstance(name, str) or _ARCH_NAME_RE.fullmatch(name) is None:
                raise InvalidSpecError(
                    "requirement archs", name, "expected an arch name like 'sm_90a' or 'gfx942'"
                )
        self._set("archs", frozenset(names))
        self._set("_hash", hash(self._key()))
        if (
            self.min_arch is not None
            and self.max_arch is not None
            and self.min_arch > self.max_arch
        ):
            raise InvalidSpecError(
                "requirement", str(self), "min_arch is above max_arch, so nothing can match"
            )

    @classmethod
    def parse(cls, text: str) -> Requirement:
        """Parse ``cuda``, ``cuda>=8.0``, ``cuda>=8.0,<=9.0``, ``cuda==9.0`` or ``hip:gfx942|gfx950``."""
        if not isinstance(text, str):
            raise InvalidSpecError(
                "requirement", text, "expected a requirement string such as 'cuda>=8.0'"
            )
        match = _REQ_RE.fullmatch(text.strip())
        if match is None:
            raise InvalidSpecError(
                "requirement",
                text,
                "expected 'device', 'device>=M.m', 'device>=M.m,<=M.m', 'device==M.m' "
                "or 'device:name|name'",
            )
        lo: Arch | None = None
        hi: Arch | None = None
        for op, arch_text in _BOUND_RE.findall(match["window"] or ""):
            arch = parse_arch(arch_text, "requirement")
            if op in (">=", "==") and lo is None:
                lo = arch
            elif op in ("<=", "==") and hi is None:
                hi = arch
            else:
                raise InvalidSpecError(
                    "requirement", text, f"the bound {op}{arch_text} is given twice"
                )
            if op == "==":
                hi = arch
        names = frozenset(match["names"].split("|")) if match["names"] else frozenset()
        return cls(match["device"], min_arch=lo, max_arch=hi, archs=names)

    @classmethod
    def coerce(cls, value: Requirement | str) -> Requirement:
        if isinstance(value, Requirement):
            return value
        return cls.parse(value)

    def matches(self, platform: Platform) -> str | None:
        """``None`` if ``platform`` satisfies this requirement, else the reason it does not."""
        if platform.device != self.device:
            return f"needs device {self}, platform is {platform.device}"
        if self.min_arch is not None or self.max_arch is not None:
            if platform.arch is None:
                return f"needs {self}, platform architecture unknown"
            if self.min_arch is not None and platform.arch < self.min_arch:
                return f"needs {self}, platform is {format_arch(platform.arch)}"
            if self.max_arch is not None and platform.arch > self.max_arch:
                return f"needs {self}, platform is {format_arch(platform.arch)}"
        if self.archs and platform.arch_name not in self.archs:
            return f"needs {self}, platform arch is {platform.arch_name or 'unknown'}"
        return None

    def __str__(self) -> str:
        text = self.device
        if self.min_arch is not None and self.min_arch == self.max_arch:
            text += f"=={format_arch(self.min_arch)}"
        else:
            bounds = []
            if self.min_arch is not None:
                bounds.append(f">={format_arch(self.min_arch)}")
            if self.max_arch is not None:
                bounds.append(f"<={format_arch(self.max_arch)}")
            text += ",".join(bounds)
        if self.archs:
            text += ":" + "|".join(sorted(self.archs))
        return text

    def sort_key(self) -> tuple[str, Arch, Arch, tuple[str, ...]]:
        return (
            self.device,
            self.min_arch or (-1, -1),
            self.max_arch or (-1, -1),
            tuple(sorted(self.archs)),
        )


class Platform(Frozen):
    """The machine a decision is made for: device kind, architecture and runtime versions.

    ``source`` says where the description came from (detection, ``KERNREG_PLATFORM``,
    a command-line flag) and takes no part in equality.
    """

    __slots__ = (
        "device",
        "arch",
        "arch_name",
        "index",
        "torch_version",
        "runtime_version",
        "source",
        "_hash",
    )
    _hidden = ("source",)
    device: str
    arch: Arch | None
    arch_name: str | None
    index: int | None
    torch_version: str | None
    runtime_version: str | None
    source: str
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
    ) -> None:
        self._set("device", check_name(device, "platform device"))
        self._set("arch", None if arch is None else parse_arch(arch, "platform arch"))
        if arch_name is None and device == "cuda" and self.arch is not None:
            arch_name = cuda_arch_name(self.arch)
        if arch_name is not None and (
            not isinstance(arch_name, str) or _ARCH_NAME_RE.fullmatch(arch_name) is None
        ):
            raise InvalidSpecError("platform arch_name", arch_name, "expected a name like 'gfx942'")
        self._set("arch_name", arch_name)
        self._set("index", index)
        self._set("torch_version", torch_version)
        self._set("runtime_version", runtime_version)
        self._set("source", source)
        # Platforms key every cached decision: hash once.
        self._set("_hash", hash(self._key()))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def parse(cls, text: str, *, source: str = "") -> Platform:
        """Parse ``cpu``, ``cuda:9.0``, ``cuda:sm_90a``, ``hip:gfx942``, ``mps``, ``xpu`` ..."""
        if not isinstance(text, str):
            raise InvalidSpecError("platform", text, "expected a string such as 'cuda:9.0'")
        device, sep, rest = text.strip().lower().partition(":")
        if NAME_RE.fullmatch(device) is None or (sep and not rest):
            raise InvalidSpecError(
                "platform",
                text,
                "expected 'device' or 'device:arch', e.g. 'cpu', 'cuda:9.0', 'hip:gfx942'",
            )
        if not sep:
            return cls(device, source=source)
        if _ARCH_RE.fullmatch(rest):
            return cls(device, arch=parse_arch(rest), source=source)
        sm = _SM_RE.fullmatch(rest)
        if sm and device == "cuda":
            return cls(device, arch=(int(sm[1]), int(sm[2])), arch_name=rest, source=source)
        # A typo must not quietly reject every GPU kernel: CUDA and ROCm names are checked.
        if device == "cuda":
            raise InvalidSpecError(
                "platform", text, "a CUDA architecture is 'M.m' or 'sm_XY[a]', e.g. 'cuda:9.0'"
            )
        if device == "hip" and not rest.startswith("gfx"):
            raise InvalidSpecError(
                "platform", text, "a ROCm architecture is a gfx name, e.g. 'hip:gfx942'"
            )
        if _ARCH_NAME_RE.fullmatch(rest):
            return cls(device, arch_name=rest, source=source)
        raise InvalidSpecError("platform", text, f"cannot read the architecture {rest!r}")

    @classmethod
    def detect(cls) -> Platform:
        """Describe this machine. Never raises.

        ``KERNREG_PLATFORM`` wins when set and valid. Otherwise torch is asked, if it
        is installed, and only now: importing kernreg never imports torch.
        """
        override = os.environ.get("KERNREG_PLATFORM", "").strip()
        if override:
            try:
                return cls.parse(override, source="KERNREG_PLATFORM")
            except InvalidSpecError:
                pass  # configuration reports the bad value; detection must not fail
        try:
            if "torch" in sys.modules or importlib.util.find_spec("torch") is not None:
                return _detect_with_torch()
        except Exception as exc:  # a broken torch install must not break start-up
            return cls("cpu", source=f"torch failed during detection ({type(exc).__name__}: {exc})")
        return cls("cpu", source="torch not installed")

    def on_device(self, device_type: str) -> Platform:
        """The platform for a call whose tensors live on ``device_type``."""
        if device_type == self.device or (device_type == "cuda" and self.device == "hip"):
            return self
        return Platform(
            device_type, torch_version=self.torch_version, source=f"call on {device_type}"
        )

    def with_source(self, source: str) -> Platform:
        clone: Platform = self.replace(source=source)
        return clone

    def __str__(self) -> str:
        if self.arch_name is not None and not (
            self.device == "cuda"
            and self.arch is not None
            and self.arch_name == cuda_arch_name(self.arch)
        ):
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
            "source": self.source,
        }


def _detect_with_torch() -> Platform:
    import torch

    version = str(torch.__version__)
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        if getattr(torch.version, "hip", None):
            props = torch.cuda.get_device_properties(index)
            gcn = str(getattr(props, "gcnArchName", "")).split(":")[0] or None
            return Platform(
                "hip",
                arch_name=gcn,
                index=index,
                torch_version=version,
                runtime_version=str(torch.version.hip),
                source="torch.cuda (ROCm)",
            )
        major, minor = torch.cuda.get_device_capability(index)
        return Platform(
            "cuda",
            arch=(major, minor),
            index=index,
            torch_version=version,
            runtime_version=str(torch.version.cuda),
            source="torch.cuda",
        )
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return Platform(
            "xpu", index=xpu.current_device(), torch_version=version, source="torch.xpu"
        )
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return Platform(
            "npu", index=npu.current_device(), torch_version=version, source="torch.npu"
        )
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return Platform("mps", torch_version=version, source="torch.backends.mps")
    return Platform("cpu", torch_version=version, source="torch (no accelerator available)")

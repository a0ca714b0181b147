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
    for public in (
        kernreg.config.Config,
        kernreg.Decision,
        kernreg.Op,
        kernreg.op,
        kernreg.dispatcher,
    ):
        typing.get_type_hints(public)
    call = typing.get_type_hints(kernreg.Op.__call__)
    assert set(call) == {"args", "kwargs", "return"}
    assert typing.get_type_hints(kernreg.registry.fingerprint)["return"] is str
    assert "registry" in typing.get_type_hints(kernreg.registry.build_plan)
    assert "entry_points" in typing.get_type_hints(kernreg.plugins.load_plugins)
    for name in kernreg.__all__:
        obj = getattr(kernreg, name)
        if callable(obj):
            typing.get_type_hints(obj)
            for attr in vars(obj).values() if isinstance(obj, type) else ():
                if callable(attr) and getattr(attr, "__module__", "").startswith("kernreg"):
                    typing.get_type_hints(attr)


def test_type_hints_of_every_public_module_evaluate() -> None:
    """Every name a public module exports (``__all__``) has hints that resolve, and so do
    its public methods: no annotation names a type imported only for the type checker."""
    import importlib
    import importlib.util
    import inspect
    import pkgutil
    import typing
    import warnings

    import kernreg

    torch_here = importlib.util.find_spec("torch") is not None
    failures = []
    for found in pkgutil.walk_packages(kernreg.__path__, "kernreg."):
        name = found.name
        if any(part.startswith("_") for part in name.split(".")):
            continue
        if not torch_here and name.startswith(("kernreg.torch", "kernreg.distributed")):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            module = importlib.import_module(name)
        for attr in getattr(module, "__all__", ()):
            obj = getattr(module, attr)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            methods = [
                (f"{attr}.{n}", f)
                for n, f in (vars(obj).items() if inspect.isclass(obj) else ())
                if inspect.isfunction(f) and not n.startswith("_")
            ]
            for label, target in [(attr, obj), *methods]:
                try:
                    typing.get_type_hints(target)
                except Exception as exc:
                    failures.append(f"{name}.{label}: {exc!r}")
    assert failures == []


def test_selection_imports_no_kernel_module_and_no_torch() -> None:
    code = (
        "import kernreg\n"
        "kernreg.register_kernel(kernreg.KernelSpec('a.b', 'triton', 'kr_nowhere.k:rms', requires=['cuda>=8.0']))\n"
        "print(kernreg.select_kernel('a.b').label)\n"
    )
    modules = _imported_after(code, KERNREG_PLATFORM="cuda:9.0", KERNREG_PLUGINS="none")
    assert "kr_nowhere" not in modules
    assert "torch" not in modules


@pytest.mark.parametrize(
    "first",
    [
        "from kernreg.torch.kernelize import KernelizeWarning",
        "import kernreg.torch.kernelize",
        "import kernreg.torch",
    ],
)
def test_kernreg_torch_kernelize_is_the_function_whatever_was_imported_first(first: str) -> None:
    pytest.importorskip("torch")
    code = (
        f"{first}\n"
        "import kernreg.torch\n"
        "from kernreg.torch import kernelize\n"
        "print(callable(kernreg.torch.kernelize), kernelize is kernreg.torch.kernelize)\n"
        "from kernreg.torch import KernelizeVerificationError, KernelizeWarning\n"
        "from kernreg.torch.kernelize import KernelizeWarning as Same\n"
        "print(Same is KernelizeWarning, {'kernelize', 'KernelizeWarning'} <= set(dir(kernreg.torch)))\n"
    )
    assert _python(code).split() == ["True", "True", "True", "True"]


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
        "print(kernreg.default_registry().config.unknown)\n"
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
    assert issubclass(kernreg.errors.DuplicateReferenceError, ValueError)
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


def test_the_top_level_holds_the_everyday_names() -> None:
    assert len(kernreg.__all__) <= 27  # kernreg.stats joined the 26 (issue 20 names it)
    assert {"KernregError", "op", "get_kernel", "explain", "KernelSpec"} <= set(kernreg.__all__)


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("Config", "kernreg.config"),
        ("fingerprint", "kernreg.registry"),
        ("load_plugins", "kernreg.plugins"),
        ("SelectionPlan", "kernreg.plan"),
        ("PluginLoadError", "kernreg.errors"),
        ("Override", "kernreg.inventory"),
        ("Trace", "kernreg.tracing"),
    ],
)
def test_a_name_moved_off_the_top_level_still_works_with_a_deprecation_warning(
    name: str, module: str
) -> None:
    import importlib

    with pytest.warns(DeprecationWarning, match=rf"use `from {module} import {name}`"):
        moved = getattr(kernreg, name)
    assert moved is getattr(importlib.import_module(module), name)


def test_from_import_of_a_moved_name_warns_too() -> None:
    out = _python(
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from kernreg import build_plan\n"
        "print(caught[0].category.__name__, caught[0].filename == '<string>')\n"
    )
    assert out.split() == ["DeprecationWarning", "True"]


def test_an_unknown_top_level_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        kernreg.no_such_name  # noqa: B018

"""Configuration: every KERNREG_* variable, the TOML file, and errors naming key and value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kernreg import ENV_VARS, Config, ConfigError, Pin, Platform, load_config
from kernreg._packages import AssumedPackage


def test_empty_environment_is_the_default_config() -> None:
    assert load_config({}) == Config()
    assert load_config({"PATH": "/bin", "HOME": "/root"}) == Config()


def test_every_variable_is_documented() -> None:
    for var, (toml_key, meaning) in ENV_VARS.items():
        assert var.startswith("KERNREG_")
        assert meaning
        assert toml_key or var == "KERNREG_CONFIG"


# One good and one bad example per variable; the tests below check that none is missed.
GOOD: list[tuple[str, str, str, Any]] = [
    ("KERNREG_PLATFORM", "cuda:9.0", "platform", Platform.parse("cuda:9.0")),
    ("KERNREG_PLATFORM", "hip:gfx942", "platform", Platform.parse("hip:gfx942")),
    ("KERNREG_PLATFORM", "cpu", "platform", Platform("cpu")),
    ("KERNREG_BACKEND", "torch", "backend", "torch"),
    ("KERNREG_BACKEND", " triton ", "backend", "triton"),
    ("KERNREG_BACKEND", "", "backend", None),
    (
        "KERNREG_PIN",
        "layernorm.*=torch,activation.silu_and_mul=triton/v2",
        "pins",
        (Pin("layernorm.*", "torch"), Pin("activation.silu_and_mul", "triton", "v2")),
    ),
    ("KERNREG_PIN", " a.b = triton/ ", "pins", (Pin("a.b", "triton", ""),)),
    ("KERNREG_PIN", "a.b=torch,a.b=torch", "pins", (Pin("a.b", "torch"), Pin("a.b", "torch"))),
    ("KERNREG_PIN", "", "pins", ()),
    ("KERNREG_DENY", "triton", "deny", (Pin("*", "triton"),)),
    (
        "KERNREG_DENY",
        "triton/v2, layernorm.*=jit",
        "deny",
        (Pin("*", "triton", "v2"), Pin("layernorm.*", "jit")),
    ),
    ("KERNREG_STRICT", "1", "strict", ("*",)),
    ("KERNREG_STRICT", "true", "strict", ("*",)),
    ("KERNREG_STRICT", "ON", "strict", ("*",)),
    ("KERNREG_STRICT", "0", "strict", ()),
    ("KERNREG_STRICT", "no", "strict", ()),
    ("KERNREG_STRICT", "", "strict", ()),
    (
        "KERNREG_STRICT",
        "layernorm.*,activation.silu_and_mul",
        "strict",
        ("layernorm.*", "activation.silu_and_mul"),
    ),
    (
        "KERNREG_TRAITS",
        "deterministic, batch_invariant",
        "traits",
        frozenset({"deterministic", "batch_invariant"}),
    ),
    ("KERNREG_TRAITS", "", "traits", frozenset()),
    ("KERNREG_PLUGINS", "auto", "plugins", "auto"),
    ("KERNREG_PLUGINS", "NONE", "plugins", "none"),
    ("KERNREG_PLUGINS", "", "plugins", "auto"),
    (
        "KERNREG_PLUGINS",
        "vendor-kernels,other_kernels",
        "plugins",
        ("vendor-kernels", "other_kernels"),
    ),
    ("KERNREG_PLUGINS_DENY", "broken-kernels", "plugins_deny", ("broken-kernels",)),
    ("KERNREG_PLUGINS_DENY", "", "plugins_deny", ()),
    ("KERNREG_STRICT_PLUGINS", "1", "strict_plugins", True),
    ("KERNREG_STRICT_PLUGINS", "off", "strict_plugins", False),
    ("KERNREG_POLICY", "autotune", "policy", ("*",)),
    ("KERNREG_POLICY", "priority", "policy", ()),
    (
        "KERNREG_POLICY",
        "layernorm.*,activation.silu_and_mul",
        "policy",
        ("layernorm.*", "activation.silu_and_mul"),
    ),
    ("KERNREG_CACHE_DIR", "/var/cache/kernreg", "cache_dir", "/var/cache/kernreg"),
    ("KERNREG_LOCK", "", "plan", None),
    (
        "KERNREG_ASSUME_PACKAGES",
        "triton==3.4, Flashinfer_Python==0.7",
        "assume_packages",
        (AssumedPackage("flashinfer-python", "0.7"), AssumedPackage("triton", "3.4")),
    ),
]

BAD: list[tuple[str, str]] = [
    ("KERNREG_PLATFORM", "cuda:"),
    ("KERNREG_PLATFORM", "not a platform"),
    ("KERNREG_PLATFORM", "cuda:9"),
    ("KERNREG_BACKEND", "Triton"),
    ("KERNREG_BACKEND", "tri-ton"),
    ("KERNREG_PIN", "bad"),
    ("KERNREG_PIN", "layernorm.*"),
    ("KERNREG_PIN", "layernorm.*=Torch"),
    ("KERNREG_PIN", "Layernorm.*=torch"),
    ("KERNREG_PIN", "layernorm=torch"),
    ("KERNREG_PIN", "layernorm.*=torch/V2"),
    ("KERNREG_PIN", "a.b=torch,a.b=triton"),
    ("KERNREG_PIN", "=torch"),
    ("KERNREG_DENY", "Triton"),
    ("KERNREG_DENY", "layernorm.*=Jit"),
    ("KERNREG_DENY", "a b=jit"),
    ("KERNREG_STRICT", "maybe"),
    ("KERNREG_STRICT", "2"),
    ("KERNREG_STRICT", "Layernorm.*"),
    ("KERNREG_TRAITS", "Deterministic"),
    ("KERNREG_TRAITS", "batch-invariant"),
    ("KERNREG_PLUGINS", ","),
    ("KERNREG_PLUGINS", "vendor kernels"),
    ("KERNREG_PLUGINS_DENY", "bad name!"),
    ("KERNREG_PLUGINS_DENY", "-dash"),
    ("KERNREG_STRICT_PLUGINS", "maybe"),
    ("KERNREG_STRICT_PLUGINS", "2"),
    ("KERNREG_CONFIG", "/nonexistent/kernreg.toml"),
    ("KERNREG_POLICY", "fastest"),
    ("KERNREG_POLICY", "Layernorm.*"),
    ("KERNREG_CACHE_DIR", "  "),
    ("KERNREG_LOCK", "/nonexistent/kernreg.lock"),
    ("KERNREG_ASSUME_PACKAGES", "triton=3.4"),
    ("KERNREG_ASSUME_PACKAGES", "triton"),
    ("KERNREG_ASSUME_PACKAGES", "triton==three"),
    ("KERNREG_ASSUME_PACKAGES", "tri ton==3.4"),
    ("KERNREG_ASSUME_PACKAGES", "triton==3.4,triton==3.5"),
]


@pytest.mark.parametrize(("var", "raw", "field", "parsed"), GOOD)
def test_good_values(var: str, raw: str, field: str, parsed: Any) -> None:
    config = load_config({var: raw})
    assert getattr(config, field) == parsed
    assert config.unknown == ()


@pytest.mark.parametrize(("var", "raw"), BAD)
def test_bad_values_name_variable_and_value(var: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({var: raw})
    assert isinstance(info.value, ValueError)
    assert info.value.key == var
    assert str(info.value).startswith(f"invalid configuration {var}=")
    assert repr(raw) in str(info.value) or raw in str(info.value)


def test_every_variable_has_good_and_bad_examples() -> None:
    assert {var for var, *_ in GOOD} | {"KERNREG_CONFIG"} == set(ENV_VARS)
    assert {var for var, _ in BAD} == set(ENV_VARS)


def test_pin_sources_name_the_variable() -> None:
    (pin,) = load_config({"KERNREG_PIN": "a.b=torch"}).pins
    assert pin.source == "KERNREG_PIN"
    assert str(pin) == "a.b=torch"
    assert str(Pin("a.b", "triton", "v2")) == "a.b=triton/v2"
    assert str(Pin("a.b", "triton", "")) == "a.b=triton/"
    assert load_config({"KERNREG_PLATFORM": "cpu"}).platform.source == "KERNREG_PLATFORM"  # type: ignore[union-attr]


def test_unknown_variables_are_collected_not_fatal() -> None:
    config = load_config({"KERNREG_PLATFROM": "cpu", "KERNREG_X": "1", "OTHER": "1"})
    assert config.unknown == ("KERNREG_PLATFROM", "KERNREG_X")
    from kernreg.config import unknown_variable_hint

    assert "did you mean KERNREG_PLATFORM?" in unknown_variable_hint("KERNREG_PLATFROM")


@pytest.mark.parametrize(
    ("pins", "op", "expected"),
    [
        (("layernorm.*=torch", "layernorm.rmsnorm=triton"), "layernorm.rmsnorm", "triton"),
        (("layernorm.rmsnorm=triton", "layernorm.*=torch"), "layernorm.rmsnorm", "triton"),
        (("layernorm.*=torch", "layernorm.rmsnorm=triton"), "layernorm.fused_add", "torch"),
        (("*=jit", "layernorm.*=torch"), "layernorm.rmsnorm", "jit"),
        (("layernorm.*=torch",), "activation.silu", None),
        (("layernorm.rms?orm=torch",), "layernorm.rmsnorm", "torch"),
    ],
)
def test_pin_for_prefers_exact_over_glob(
    pins: tuple[str, ...], op: str, expected: str | None
) -> None:
    pin = load_config({"KERNREG_PIN": ",".join(pins)}).pin_for(op)
    assert (pin.backend if pin else None) == expected


@pytest.mark.parametrize(
    ("deny", "op", "backend", "variant", "denied"),
    [
        ("triton", "a.b", "triton", "", True),
        ("triton", "a.b", "triton", "v2", True),
        ("triton/v2", "a.b", "triton", "v2", True),
        ("triton/v2", "a.b", "triton", "", False),
        ("layernorm.*=jit", "layernorm.rmsnorm", "jit", "", True),
        ("layernorm.*=jit", "activation.silu", "jit", "", False),
        ("layernorm.*=jit", "layernorm.rmsnorm", "triton", "", False),
    ],
)
def test_denied(deny: str, op: str, backend: str, variant: str, denied: bool) -> None:
    assert (load_config({"KERNREG_DENY": deny}).denied(op, backend, variant) is not None) is denied


@pytest.mark.parametrize(
    ("strict", "op", "expected"),
    [
        ("1", "a.b", True),
        ("0", "a.b", False),
        ("layernorm.*", "layernorm.rms", True),
        ("layernorm.*", "a.b", False),
    ],
)
def test_is_strict(strict: str, op: str, expected: bool) -> None:
    assert load_config({"KERNREG_STRICT": strict}).is_strict(op) is expected


@pytest.mark.parametrize(
    ("plugins", "deny", "dist", "allowed"),
    [
        ("auto", "", "vendor-kernels", True),
        ("none", "", "vendor-kernels", False),
        ("vendor_kernels", "", "Vendor-Kernels", True),
        ("other", "", "vendor-kernels", False),
        ("auto", "vendor.kernels", "vendor-kernels", False),
    ],
)
def test_plugin_allowed(plugins: str, deny: str, dist: str, allowed: bool) -> None:
    config = load_config({"KERNREG_PLUGINS": plugins, "KERNREG_PLUGINS_DENY": deny})
    assert (config.plugin_allowed(dist) is None) is allowed


# --- the TOML file ---------------------------------------------------------------------------


def _toml(tmp_path: Path, text: str, name: str = "kernreg.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_toml_file_with_every_key(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        """
        platform = "hip:gfx942"
        backend = "triton"
        pin = "layernorm.*=torch"
        deny = ["jit", "activation.*=aot/sm90a"]
        strict = true
        traits = ["deterministic"]
        plugins = ["vendor-kernels"]
        plugins_deny = ["broken-kernels"]
        strict_plugins = true
        """.replace("\n        ", "\n"),
    )
    config = load_config({"KERNREG_CONFIG": path})
    assert config == Config(
        platform=Platform.parse("hip:gfx942"),
        backend="triton",
        pins=(Pin("layernorm.*", "torch"),),
        deny=(Pin("*", "jit"), Pin("activation.*", "aot", "sm90a")),
        strict=("*",),
        traits=frozenset({"deterministic"}),
        plugins=("vendor-kernels",),
        plugins_deny=("broken-kernels",),
        strict_plugins=True,
    )
    assert config.pins[0].source == f"{path}: pin"


def test_toml_pin_table(tmp_path: Path) -> None:
    path = _toml(
        tmp_path, '[pin]\n"layernorm.*" = "torch"\n"activation.silu_and_mul" = "triton/v2"\n'
    )
    assert load_config({"KERNREG_CONFIG": path}).pins == (
        Pin("layernorm.*", "torch"),
        Pin("activation.silu_and_mul", "triton", "v2"),
    )


def test_toml_strict_globs(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'strict = ["layernorm.*"]\n')
    assert load_config({"KERNREG_CONFIG": path}).strict == ("layernorm.*",)


def test_environment_overrides_file_key_by_key(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'backend = "triton"\nplatform = "hip:gfx942"\n')
    config = load_config({"KERNREG_CONFIG": path, "KERNREG_BACKEND": "torch"})
    assert config.backend == "torch"
    assert config.platform == Platform.parse("hip:gfx942")


def test_pyproject_tool_table(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        '[project]\nname = "engine"\n\n[tool.black]\nline-length = 100\n\n'
        '[tool.kernreg]\nbackend = "torch"\nstrict = ["layernorm.*"]\n',
        name="pyproject.toml",
    )
    config = load_config({"KERNREG_CONFIG": path})
    assert config.backend == "torch"
    assert config.strict == ("layernorm.*",)


def test_pyproject_without_kernreg_table_is_empty(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        '[project]\nname = "engine"\n\n[tool.black]\nline-length = 100\n',
        "pyproject.toml",
    )
    assert load_config({"KERNREG_CONFIG": path}) == Config()


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ('platfrom = "cpu"\n', "platfrom", "did you mean 'platform'?"),
        ("zzz = 1\n", "zzz", "known keys: assume_packages, backend, cache_dir"),
        ("tool = 1\n", "tool", "unknown configuration key"),
        ('[tool.kernreg]\nbakend = "torch"\n', "bakend", "did you mean 'backend'?"),
        ("platform = 9\n", "platform", "expected a platform string"),
        ('platform = "cuda:"\n', "platform", "invalid platform"),
        ("backend = 1\n", "backend", "expected a backend name"),
        ('backend = "Torch"\n', "backend", "invalid"),
        ('pin = "layernorm.*"\n', "pin", "expected 'op_or_glob=backend[/variant]'"),
        ("pin = 3\n", "pin", "comma-separated"),
        ('[pin]\n"layernorm.*" = 1\n', "pin.layernorm.*", "expected 'backend'"),
        ('deny = ["Triton"]\n', "deny", "invalid"),
        ('strict = "maybe"\n', "strict", "op globs"),
        ("strict = 2\n", "strict", "comma-separated"),
        ("traits = [1]\n", "traits", "comma-separated"),
        ("plugins = 1\n", "plugins", "comma-separated"),
        ("plugins_deny = [2]\n", "plugins_deny", "comma-separated"),
        ('strict_plugins = "maybe"\n', "strict_plugins", "expected 1/0"),
        ('[tool]\nkernreg = "x"\n', "tool.kernreg", "expected a table"),
    ],
)
def test_bad_file_keys_name_file_key_and_value(
    tmp_path: Path, text: str, key: str, fragment: str
) -> None:
    path = _toml(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config({"KERNREG_CONFIG": path})
    assert info.value.key == f"{path}: {key}"
    assert str(info.value).startswith(f"invalid configuration {path}: {key}=")
    assert fragment in str(info.value)


@pytest.mark.parametrize("text", ["backend = \n", "[[[", 'a = "unterminated\n'])
def test_unreadable_toml(tmp_path: Path, text: str) -> None:
    path = _toml(tmp_path, text)
    with pytest.raises(ConfigError, match="cannot read TOML") as info:
        load_config({"KERNREG_CONFIG": path})
    assert info.value.key == "KERNREG_CONFIG"
    assert info.value.value == path


def test_config_file_path_is_stripped(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'backend = "torch"\n')
    assert load_config({"KERNREG_CONFIG": f"  {path} "}).backend == "torch"


def test_load_config_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNREG_BACKEND", "torch")
    assert load_config().backend == "torch"


def test_config_is_a_frozen_value() -> None:
    config = Config(pins=(Pin("a.b", "torch"),))
    assert config == Config(pins=(Pin("a.b", "torch", source="elsewhere"),))
    assert hash(config) == hash(Config(pins=(Pin("a.b", "torch"),)))
    with pytest.raises(AttributeError):
        config.backend = "x"  # type: ignore[misc]


# --- a bad value surfaces at first use of the process-wide registry ---------------------------

_FIRST_USE = """
import kernreg
from kernreg import KernelSpec
kernreg.register_kernel(KernelSpec("layernorm.rmsnorm", "torch", print, reference=True))
print("imported and registered", flush=True)
try:
    kernreg.select_kernel("layernorm.rmsnorm")
except kernreg.ConfigError as exc:
    print("ConfigError:", exc.key, "|", exc)
else:
    print("selected")
"""


def _run(code: str, **env: str) -> str:
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


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("KERNREG_PIN", "bad"),
        ("KERNREG_PLATFORM", "cuda:"),
        ("KERNREG_STRICT", "maybe"),
        ("KERNREG_BACKEND", "Torch"),
        ("KERNREG_CONFIG", "/nonexistent/kernreg.toml"),
    ],
)
def test_bad_environment_fails_at_first_use_not_at_import(var: str, value: str) -> None:
    out = _run(_FIRST_USE, **{var: value})
    first, second = out.splitlines()
    assert first == "imported and registered"
    assert second.startswith(f"ConfigError: {var} | invalid configuration {var}={value!r}")


def test_good_environment_is_used_by_the_process_wide_registry() -> None:
    code = _FIRST_USE + "print(kernreg.registry.platform, kernreg.registry.config.strict)\n"
    out = _run(code, KERNREG_PLATFORM="hip:gfx942", KERNREG_STRICT="1")
    assert out.splitlines()[1:] == ["selected", "hip:gfx942 ('*',)"]


# --- Config(...) in code reads list-valued fields by the environment's rule -----------

#: Each list-valued Config field and the variable that sets it.
LIST_FIELDS = {
    "pins": "KERNREG_PIN",
    "deny": "KERNREG_DENY",
    "strict": "KERNREG_STRICT",
    "traits": "KERNREG_TRAITS",
    "plugins": "KERNREG_PLUGINS",
    "plugins_deny": "KERNREG_PLUGINS_DENY",
    "policy": "KERNREG_POLICY",
    "assume_packages": "KERNREG_ASSUME_PACKAGES",
}


def test_every_list_valued_field_is_in_the_table() -> None:
    hints = Config.__annotations__  # strings: the module uses postponed annotations
    listed = {
        name
        for name in Config.__slots__
        if any(t in str(hints[name]) for t in ("tuple[", "frozenset["))
    }
    assert listed - {"unknown"} == set(LIST_FIELDS)


@pytest.mark.parametrize(
    ("field", "raw"),
    [(field, raw) for field, var in LIST_FIELDS.items() for v, raw, _, _ in GOOD if v == var],
)
def test_config_keyword_string_means_what_the_variable_means(field: str, raw: str) -> None:
    expected = getattr(load_config({LIST_FIELDS[field]: raw}), field)
    assert getattr(Config(**{field: raw}), field) == expected
    items = [item for item in raw.split(",") if item.strip()]
    if field not in ("strict", "policy", "plugins") or len(items) > 1:
        assert getattr(Config(**{field: items}), field) == expected  # a list: the same


@pytest.mark.parametrize(
    ("field", "raw"),
    [(field, raw) for field, var in LIST_FIELDS.items() for v, raw in BAD if v == var],
)
def test_config_keyword_rejects_what_the_variable_rejects(field: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=rf"Config\({field}=\.\.\.\)"):
        Config(**{field: raw})


@pytest.mark.parametrize(
    ("kwargs", "op_or_dist", "check"),
    [
        ({"strict": "layernorm.*"}, "activation.silu_and_mul", "not strict"),
        ({"plugins_deny": "evil-kernels"}, "evil-kernels", "denied"),
        ({"plugins": "trusted-kernels"}, "other-kernels", "denied"),
        ({"traits": "deterministic"}, "", "deterministic"),
    ],
)
def test_the_strings_that_used_to_split_into_characters(
    kwargs: dict[str, str], op_or_dist: str, check: str
) -> None:
    config = Config(**kwargs)  # type: ignore[arg-type]
    if check == "not strict":
        assert not config.is_strict(op_or_dist)
        assert config.is_strict("layernorm.rmsnorm")
    elif check == "denied":
        assert config.plugin_allowed(op_or_dist) is not None
        assert config.plugin_allowed("trusted-kernels") is None
    else:
        assert config.traits == frozenset({"deterministic"})


def test_pin_objects_and_rule_strings_mix() -> None:
    config = Config(
        pins=(Pin("a.b", "torch"), "c.*=triton/v2"), deny=["triton", Pin("x.y", "aten")]
    )
    assert config.pins == (Pin("a.b", "torch"), Pin("c.*", "triton", "v2"))
    assert config.deny == (Pin("*", "triton"), Pin("x.y", "aten"))
    with pytest.raises(ConfigError, match="expected Pin objects"):
        Config(pins=(3,))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="expected a string or a list"):
        Config(traits=3)  # type: ignore[arg-type]


# --- packages installed while the process runs ----------------------------------------------


@pytest.mark.parametrize("assume", ["", "other-package==1.0"])
def test_a_package_installed_at_run_time_is_seen_after_configure(
    tmp_path: Path, assume: str
) -> None:
    import subprocess
    import sys

    script = f"""
import os, sys, kernreg
from kernreg import KernelRegistry, KernelSpec
sys.path.insert(0, {str(tmp_path)!r})
reg = KernelRegistry()
reg.register(KernelSpec("demo.op", "torch", "json:dumps", reference=True))
reg.register(KernelSpec("demo.op", "ext", "json:loads", packages=["late-ext>=1.0"], priority=1))
before = reg.select("demo.op", platform="cpu").backend
info = os.path.join({str(tmp_path)!r}, "late_ext-1.2.dist-info")
os.mkdir(info)
with open(os.path.join(info, "METADATA"), "w") as f:
    f.write("Metadata-Version: 2.1\\nName: late-ext\\nVersion: 1.2\\n")
reg.configure()
print(before, reg.select("demo.op", platform="cpu").backend)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    env.update(KERNREG_PLUGINS="none")
    if assume:
        env["KERNREG_ASSUME_PACKAGES"] = assume
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["torch", "ext"]


# --- a configuration file that holds other tools' tables -------------------------------------


def test_a_pyproject_without_a_kernreg_table_configures_nothing(tmp_path: Path) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text('[project]\nname = "engine"\n\n[build-system]\nrequires = ["setuptools"]\n')
    assert load_config({"KERNREG_CONFIG": str(path)}).pins == ()


@pytest.mark.parametrize("name", ["kernreg.toml", "pyproject.toml"])
def test_kernreg_keys_beside_other_tools_tables_are_an_error_not_ignored(
    tmp_path: Path, name: str
) -> None:
    path = tmp_path / name
    path.write_text('pin = "demo.op=fast"\n\n[tool.ruff]\nline-length = 100\n')
    with pytest.raises(ConfigError, match=r"move pin under \[tool.kernreg\]"):
        load_config({"KERNREG_CONFIG": str(path)})


def test_tool_kernreg_is_read_beside_other_tools_tables(tmp_path: Path) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text(
        '[project]\nname = "engine"\n\n[tool.ruff]\nline-length = 100\n\n'
        '[tool.kernreg]\npin = "demo.op=fast"\n'
    )
    (pin,) = load_config({"KERNREG_CONFIG": str(path)}).pins
    assert str(pin) == "demo.op=fast"

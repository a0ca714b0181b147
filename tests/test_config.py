"""Configuration: every KERNREG_* variable, the TOML file, and errors naming key and value."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _support import DEEP, LONG_INT, PARSER_EXAMPLES
from kernreg import ConfigError, KernelRegistry, Platform
from kernreg._packages import AssumedPackage
from kernreg.config import ENV_VARS, MAX_CONFIG_BYTES, Config, Pin, load_config
from kernreg.plan import SelectionPlan


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
    ("KERNREG_DEMOTE", "1", "demote", ("*",)),
    ("KERNREG_DEMOTE", "off", "demote", ()),
    ("KERNREG_DEMOTE", "layernorm.*,activation.*", "demote", ("layernorm.*", "activation.*")),
    ("KERNREG_STATS_FILE", "/tmp/stats-{pid}.json", "stats_file", "/tmp/stats-{pid}.json"),
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
    ("KERNREG_DEMOTE", "maybe"),
    ("KERNREG_DEMOTE", "Layernorm.*"),
    ("KERNREG_STATS_FILE", " "),
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


def test_the_benchmarks_variables_are_not_unknown() -> None:
    config = load_config({"KERNREG_BENCH_CACHE": "/tmp/x", "KERNREG_BENCHCACHE": "1"})
    assert config.unknown == ("KERNREG_BENCHCACHE",)


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


@pytest.mark.parametrize("value", ["auto", "none", "ALL", "vendor-kernels,auto"])
def test_a_mode_word_in_the_deny_list_is_an_error_not_a_distribution(value: str) -> None:
    with pytest.raises(ConfigError, match="is not a distribution; to load no plugin") as info:
        load_config({"KERNREG_PLUGINS_DENY": value})
    assert info.value.key == "KERNREG_PLUGINS_DENY"
    assert load_config({"KERNREG_PLUGINS_DENY": "vendor-kernels"}).plugins_deny == (
        "vendor-kernels",
    )


@pytest.mark.parametrize(
    "value", ["vendor-kernels,auto", "auto,vendor-kernels", "a, AUTO", "x,none"]
)
def test_auto_or_none_in_a_list_of_plugins_is_an_error_not_a_distribution(value: str) -> None:
    word = "none" if "none" in value else "auto"
    with pytest.raises(ConfigError, match=f"'{word}' stands alone") as info:
        load_config({"KERNREG_PLUGINS": value})
    assert info.value.key == "KERNREG_PLUGINS"
    with pytest.raises(ConfigError, match="stands alone"):
        Config(plugins=value.split(","))


@pytest.mark.parametrize("word", ["auto", "none"])
def test_a_toml_list_of_one_plugins_keyword_means_the_keyword(tmp_path: Path, word: str) -> None:
    path = _toml(tmp_path, f'plugins = ["{word.upper()}"]')
    assert load_config({"KERNREG_CONFIG": path}).plugins == word
    assert Config(plugins=[word]).plugins == word


@pytest.mark.parametrize(
    ("key", "word"),
    [
        ("policy", "autotune"),
        ("policy", "Priority"),
        ("strict", "1"),
        ("strict", "off"),
        ("demote", "yes"),
        ("demote", "0"),
        ("plugins", "none"),
    ],
)
def test_a_toml_list_of_one_keyword_means_what_the_variable_set_to_it_means(
    tmp_path: Path, key: str, word: str
) -> None:
    """``policy = ["autotune"]`` is ``KERNREG_POLICY=autotune``, as ``plugins = ["auto"]``
    is ``KERNREG_PLUGINS=auto``: a variable's list is its comma-separated items."""
    var = next(var for var, (toml_key, _) in ENV_VARS.items() if toml_key == key)
    path = _toml(tmp_path, f'{key} = ["{word}"]')
    expected = getattr(load_config({var: word}), key)
    assert getattr(load_config({"KERNREG_CONFIG": path}), key) == expected
    assert getattr(Config(**{key: [word]}), key) == expected
    with pytest.raises(ConfigError, match=key):  # a keyword among globs, as in the variable
        load_config({"KERNREG_CONFIG": _toml(tmp_path, f'{key} = ["{word}", "a.*"]')})


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


def test_paths_in_the_file_are_relative_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    SelectionPlan().save(str(project / "kernreg.lock"))
    text = 'lock = "kernreg.lock"\ncache_dir = "cache"\nstats_file = "stats-{pid}.json"\n'
    path = _toml(project, text, name="kernreg.toml")
    monkeypatch.chdir(tmp_path)  # started elsewhere: a worker, a test runner
    config = load_config({"KERNREG_CONFIG": path})
    assert config.plan is not None
    assert config.plan.source == str(project / "kernreg.lock")
    assert config.cache_dir == str(project / "cache")
    assert config.stats_file == str(project / "stats-{pid}.json")
    assert load_config({"KERNREG_CONFIG": path, "KERNREG_CACHE_DIR": "here"}).cache_dir == "here"


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
    code = (
        _FIRST_USE
        + "print(kernreg.default_registry().platform, kernreg.default_registry().config.strict)\n"
    )
    out = _run(code, KERNREG_PLATFORM="hip:gfx942", KERNREG_STRICT="1")
    assert out.splitlines()[1:] == ["selected", "hip:gfx942 ('*',)"]


# --- Config(...) in code reads list-valued fields by the environment's rule -----------

#: Each list-valued Config field and the variable that sets it.
LIST_FIELDS = {
    "pins": "KERNREG_PIN",
    "deny": "KERNREG_DENY",
    "strict": "KERNREG_STRICT",
    "demote": "KERNREG_DEMOTE",
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
    if field not in ("strict", "demote", "policy", "plugins") or len(items) > 1:
        assert getattr(Config(**{field: items}), field) == expected  # a list: the same


@pytest.mark.parametrize(
    ("field", "items", "raw"),
    [
        ("pins", ["a.b=torch", ""], "a.b=torch,"),
        ("pins", ["a.b=torch", Pin("a.b", "torch")], "a.b=torch,a.b=torch"),
        ("assume_packages", ["a==1", "a==1"], "a==1,a==1"),
        ("assume_packages", ["", AssumedPackage("a", "1")], "a==1"),
    ],
)
def test_config_keyword_list_with_blank_or_repeated_items(
    field: str, items: list[object], raw: str
) -> None:
    assert getattr(Config(**{field: items}), field) == getattr(
        load_config({LIST_FIELDS[field]: raw}), field
    )


def test_config_keyword_list_items_that_disagree_are_refused() -> None:
    with pytest.raises(ConfigError, match="pinned twice"):
        Config(pins=["a.b=torch", Pin("a.b", "triton")])
    with pytest.raises(ConfigError, match="assumed twice"):
        Config(assume_packages=[AssumedPackage("a", "1"), "a==2"])


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


# --- TOML that the parser cannot read -----------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "traits = " + "[" * 100_000 + "]" * 100_000,
        "traits = " + "{b = " * 5000 + "1" + "}" * 5000,
        "strict = " + "9" * 5000,
    ],
)
def test_hostile_toml_named_by_kernreg_config_cannot_be_read(text: str, tmp_path: Path) -> None:
    from kernreg import ConfigError
    from kernreg.config import load_config

    path = tmp_path / "kernreg.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="cannot read TOML"):
        load_config({"KERNREG_CONFIG": str(path)})


# --- bad environment values and TOML keys: a ConfigError naming the variable or key -------


BAD_ENV: list[tuple[str, str]] = [
    ("KERNREG_PLATFORM", "cuda:"),
    ("KERNREG_PLATFORM", "cuda:90"),
    ("KERNREG_PLATFORM", "gpu:9.0:x"),
    ("KERNREG_BACKEND", "Triton"),
    ("KERNREG_BACKEND", "triton/v2"),
    ("KERNREG_PIN", "layernorm.rmsnorm"),
    ("KERNREG_PIN", "=torch"),
    ("KERNREG_PIN", "layernorm=torch"),
    ("KERNREG_PIN", "layernorm.*=Torch"),
    ("KERNREG_PIN", "layernorm.*=torch/V2"),
    ("KERNREG_PIN", "a.b=torch,a.b=triton"),
    ("KERNREG_DENY", "Triton"),
    ("KERNREG_DENY", "layernorm=jit"),
    ("KERNREG_DENY", "a.*=jit/V"),
    ("KERNREG_STRICT", "2"),
    ("KERNREG_STRICT", "maybe"),
    ("KERNREG_STRICT", "Layernorm.*"),
    ("KERNREG_TRAITS", "Deterministic"),
    ("KERNREG_TRAITS", "batch-invariant"),
    ("KERNREG_PLUGINS", "my plugin"),
    ("KERNREG_PLUGINS", "-bad"),
    ("KERNREG_PLUGINS", ","),
    ("KERNREG_PLUGINS_DENY", "bad name!"),
    ("KERNREG_STRICT_PLUGINS", "2"),
    ("KERNREG_STRICT_PLUGINS", "sometimes"),
    ("KERNREG_LOCK", "/nonexistent/kernreg.lock"),
    ("KERNREG_LOCK", "/"),
    ("KERNREG_LOCK", "plan\x00.lock"),
    ("KERNREG_POLICY", "fastest"),
    ("KERNREG_POLICY", "Layernorm.*"),
    ("KERNREG_CACHE_DIR", "   "),
    ("KERNREG_CACHE_DIR", "cache\x00dir"),
    ("KERNREG_DEMOTE", "sometimes"),
    ("KERNREG_DEMOTE", "Layernorm.*"),
    ("KERNREG_STATS_FILE", "  "),
    ("KERNREG_STATS_FILE", "stats\x00.json"),
    ("KERNREG_CONFIG", "/nonexistent/kernreg.toml"),
    ("KERNREG_CONFIG", "/"),
    ("KERNREG_CONFIG", "conf\x00.toml"),
    ("KERNREG_ASSUME_PACKAGES", "triton"),
    ("KERNREG_ASSUME_PACKAGES", "triton>=3.4"),
    ("KERNREG_ASSUME_PACKAGES", "triton==3.4,triton==3.5"),
    ("KERNREG_ASSUME_PACKAGES", "triton==3.4\x00"),
]


def test_the_env_corpus_covers_every_variable() -> None:
    assert {var for var, _ in BAD_ENV} == set(ENV_VARS)


@pytest.mark.parametrize(("var", "value"), BAD_ENV)
def test_a_bad_environment_value_is_a_config_error_naming_the_variable(
    var: str, value: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config({var: value})
    assert isinstance(info.value, ValueError)
    assert info.value.key == var
    assert str(info.value).startswith(f"invalid configuration {var}={value!r}")
    if "\x00" in value:
        return  # the process environment itself cannot hold a NUL byte
    # The registry reports it at first use, and keeps reporting it: never a half-read config.
    monkeypatch.setenv(var, value)
    reg = KernelRegistry()
    for _ in range(2):
        with pytest.raises(ConfigError, match=var):
            reg.config  # noqa: B018
        with pytest.raises(ConfigError, match=var):
            reg.select("hard.anything")


BAD_TOML: list[tuple[str, str, str]] = [
    # (id, the file's text, the key the error names)
    ("platform-type", "platform = 3", "platform"),
    ("platform-value", 'platform = "cuda:"', "platform"),
    ("backend-type", "backend = 1", "backend"),
    ("backend-value", 'backend = "B"', "backend"),
    ("pin-type", "pin = 3", "pin"),
    ("pin-list-of-int", "pin = [1]", "pin"),
    ("pin-table-value", 'pin = {"a.b" = 3}', "pin.a.b"),
    ("pin-table-glob", 'pin = {"A" = "torch"}', "pin"),
    ("pin-bare-op", 'pin = ["a.b"]', "pin"),
    ("pin-twice", 'pin = "a.b=t,a.b=u"', "pin"),
    ("deny-type", "deny = 3", "deny"),
    ("deny-table", 'deny = {"a.b" = "x"}', "deny"),
    ("strict-type", "strict = 3", "strict"),
    ("strict-glob", 'strict = ["A"]', "strict"),
    ("traits-type", "traits = 3", "traits"),
    ("traits-name", 'traits = ["A"]', "traits"),
    ("plugins-type", "plugins = 3", "plugins"),
    ("plugins-empty-list", "plugins = []", "plugins"),
    ("plugins-name", 'plugins = ["a b"]', "plugins"),
    ("plugins-deny-type", "plugins_deny = 3", "plugins_deny"),
    ("strict-plugins-type", "strict_plugins = 3", "strict_plugins"),
    ("strict-plugins-value", 'strict_plugins = "maybe"', "strict_plugins"),
    ("lock-type", "lock = 3", "lock"),
    ("lock-missing", 'lock = "/nonexistent.lock"', "lock"),
    ("policy-type", "policy = 3", "policy"),
    ("policy-glob", 'policy = ["A"]', "policy"),
    ("cache-dir-type", "cache_dir = 3", "cache_dir"),
    ("cache-dir-empty", 'cache_dir = ""', "cache_dir"),
    ("demote-type", "demote = 3", "demote"),
    ("demote-glob", 'demote = ["A"]', "demote"),
    ("stats-file-type", "stats_file = 3", "stats_file"),
    ("assume-packages-type", "assume_packages = 3", "assume_packages"),
    ("assume-packages-item", 'assume_packages = ["triton>=3.4"]', "assume_packages"),
    ("unknown-key", "plaform = 'cpu'", "plaform"),
    ("tool-kernreg-not-a-table", "[tool]\nkernreg = 3", "tool.kernreg"),
    ("pyproject-bad-value", "[tool.kernreg]\nstrict = 3", "strict"),
]


def test_the_toml_corpus_covers_every_key() -> None:
    keys = {key for toml_key, _ in ENV_VARS.values() if (key := toml_key)}
    assert keys <= {key.partition(".")[0] for _, _, key in BAD_TOML}


@pytest.mark.parametrize(
    ("text", "key"), [pytest.param(text, key, id=name) for name, text, key in BAD_TOML]
)
def test_a_bad_toml_value_is_a_config_error_naming_file_and_key(
    tmp_path: Path, text: str, key: str
) -> None:
    path = tmp_path / "kernreg.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as info:
        load_config({"KERNREG_CONFIG": str(path)})
    assert info.value.key == f"{path}: {key}"
    assert str(info.value).startswith(f"invalid configuration {path}: {key}=")


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"platform = ", "cannot read TOML"),
        (b"x = [", "cannot read TOML"),
        (b"platform = 'cpu'\nplatform = 'cpu'\n", "cannot read TOML"),
        (b"\xff\xfe\x00garbage", "cannot read TOML"),
        (b"\x7fELF\x02\x01\x01\x00\x00", "cannot read TOML"),
    ],
    ids=["truncated", "unclosed", "duplicate-key", "not-utf8", "binary"],
)
def test_an_unreadable_toml_file_is_a_config_error_naming_kernreg_config(
    tmp_path: Path, content: bytes, why: str
) -> None:
    path = tmp_path / "kernreg.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config({"KERNREG_CONFIG": str(path)})
    assert info.value.key == "KERNREG_CONFIG"
    assert str(path) in str(info.value)
    assert why in str(info.value)


# --- properties: any environment is a Config or a ConfigError naming the variable ---------


# Text as people type it and as it breaks: the value grammar's characters, plus anything.
_GRAMMAR = st.text(alphabet="abcxyz_.*?[]!-=/,: 019TRUEtrue ", max_size=30)
_VALUES = _GRAMMAR | st.text(max_size=30)


@pytest.fixture
def in_an_empty_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fuzzed paths (KERNREG_LOCK, KERNREG_CONFIG) resolve against an empty directory."""
    monkeypatch.chdir(tmp_path)


@pytest.mark.usefixtures("in_an_empty_directory")
@settings(max_examples=PARSER_EXAMPLES, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(ENV_VARS)), _VALUES, min_size=1))
def test_load_config_returns_a_config_or_names_the_variable(env: dict[str, str]) -> None:
    try:
        config = load_config(env)
    except ConfigError as exc:
        error = exc
    else:
        assert isinstance(config, Config)
        assert config.unknown == ()
        return
    assert isinstance(error, ValueError)
    # A TOML file's error names the file and key; the variable pointing at it is set.
    assert error.key in env or "KERNREG_CONFIG" in env, (error.key, env)
    assert str(error).startswith(f"invalid configuration {error.key}=")


@pytest.mark.usefixtures("in_an_empty_directory")
@settings(max_examples=PARSER_EXAMPLES // 2, deadline=None)
@given(st.dictionaries(st.text(max_size=12).map(lambda s: "KERNREG_" + s), _VALUES))
def test_unknown_variables_are_collected_never_fatal(env: dict[str, str]) -> None:
    with contextlib.suppress(ConfigError):
        config = load_config(env)
        assert set(config.unknown) == {
            v for v in env if v not in ENV_VARS and v != "KERNREG_CONFIG"
        }


# --- hostile TOML files and environment values --------------------------------------------


HOSTILE_TOML = {
    "nested arrays": "strict = " + "[" * DEEP + "]" * DEEP,
    "nested inline tables": "x = " + "{a=" * 50_000 + "1" + "}" * 50_000,
    "nested arrays, shallow enough for the parser": "strict = " + "[" * 500 + "]" * 500,
    "deep dotted key": "a" + ".a" * 3_000 + " = 1",
    "integer of 5,000 digits": f"strict = {LONG_INT}",
    "huge float": "strict = 1e999",
    "nan": "strict = nan",
    "duplicate key": 'strict = "a.b"\nstrict = "c.d"',
    "not UTF-8": b"strict = '\xff'",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TOML))
def test_hostile_toml_is_a_config_error(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "kernreg.toml"
    text = HOSTILE_TOML[name]
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    monkeypatch.setenv("KERNREG_CONFIG", str(path))
    with pytest.raises(ConfigError, match="invalid configuration"):
        load_config()


def test_deep_tables_of_other_tools_in_a_pyproject_are_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text("[tool.other]\n" + "a" + ".a" * 500 + ' = 1\n[tool.kernreg]\nstrict = "a.*"\n')
    monkeypatch.setenv("KERNREG_CONFIG", str(path))
    assert load_config().strict == ("a.*",)


def test_an_over_size_or_device_config_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "big.toml"
    path.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    monkeypatch.setenv("KERNREG_CONFIG", str(path))
    with pytest.raises(ConfigError, match="larger than"):
        load_config()
    if os.path.exists("/dev/zero"):
        monkeypatch.setenv("KERNREG_CONFIG", "/dev/zero")
        with pytest.raises(ConfigError, match="not a regular file"):
            load_config()


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("KERNREG_PLATFORM", f"cuda:{LONG_INT}.0"),
        ("KERNREG_PLATFORM", f"cuda:sm_{LONG_INT}"),
        ("KERNREG_STRICT", "a." + "b" * 100_000 + "B"),
        ("KERNREG_PIN", "a.b=" + "t" * 100_000 + "/V"),
        ("KERNREG_TRAITS", "x," * 100_000 + "Y"),
        ("KERNREG_CACHE_DIR", "a\0b"),
    ],
)
def test_hostile_environment_values_are_config_errors(var: str, value: str) -> None:
    with pytest.raises(ConfigError, match=var):
        load_config({var: value})


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


@pytest.mark.parametrize("kind", ["directory", "symlink-loop", "no-permission"])
def test_an_unopenable_config_path_says_why_without_a_file_descriptor(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "kernreg.toml"
    if kind == "directory":
        path.mkdir()
    elif kind == "symlink-loop":
        path.symlink_to(path)
    else:
        if os.geteuid() == 0:
            pytest.skip("root reads any file")
        path.write_text("strict = 1\n")
        path.chmod(0)
    with pytest.raises(ConfigError) as info:
        load_config({"KERNREG_CONFIG": str(path)})
    message = str(info.value)
    # The reason is the OS's words, not "[Errno 21] Is a directory: 3" (3: the descriptor).
    assert message.endswith(f"cannot read TOML ({os.strerror(info.value.__context__.errno)})")


@pytest.mark.parametrize(
    ("text", "field", "value"),
    [
        ("strict = 1", "strict", ("*",)),
        ("strict = 0", "strict", ()),
        ("demote = 1", "demote", ("*",)),
        ("strict_plugins = 1", "strict_plugins", True),
        ("strict_plugins = 0", "strict_plugins", False),
    ],
)
def test_a_toml_switch_takes_the_integers_its_variable_takes(
    tmp_path: Path, text: str, field: str, value: object
) -> None:
    # The table says "1: ..." and the error says "expected 1/0": a TOML 1 is that 1.
    path = tmp_path / "kernreg.toml"
    path.write_text(text + "\n")
    assert getattr(load_config({"KERNREG_CONFIG": str(path)}), field) == value

"""Configuration from ``KERNREG_*`` environment variables over an optional TOML file, key by
key, validated when read: a bad value fails at start-up with the variable and value named."""

from __future__ import annotations

import difflib
import os
import re
import stat
import sys
from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase
from types import MappingProxyType
from typing import Any

from kernreg._frozen import Frozen
from kernreg._names import check_name, check_op_glob
from kernreg._packages import DIST_NAME_RE, AssumedPackage, parse_assumed
from kernreg.errors import ConfigError, InvalidSpecError
from kernreg.pins import Pin, as_items, parse_pins, parse_rule
from kernreg.plan import SelectionPlan
from kernreg.platform import Platform, parse_platform

__all__ = ["ENV_VARS", "Config", "ConfigWarning", "Pin", "load_config"]

#: Every environment variable kernreg reads, with its TOML key and meaning: the one table
#: that the parser, the CLI and the README follow.
ENV_VARS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "KERNREG_PLATFORM": (
            "platform",
            "simulate a platform: cpu, cuda:9.0, cuda:sm_90a, hip:gfx942; cuda:8.0,9.0 per device",
        ),
        "KERNREG_BACKEND": (
            "backend",
            "debugging switch: use this backend wherever it is eligible",
        ),
        "KERNREG_PIN": ("pin", "strict pins: layernorm.*=torch,activation.silu_and_mul=triton/v2"),
        "KERNREG_DENY": ("deny", "backends never chosen: triton or per op glob: layernorm.*=jit"),
        "KERNREG_STRICT": ("strict", "1: falling back to the reference is an error; or op globs"),
        "KERNREG_DEMOTE": (
            "demote",
            "1 or op globs: an implementation that raises is demoted and its calls fall back",
        ),
        "KERNREG_TRAITS": ("traits", "traits every chosen implementation must declare"),
        "KERNREG_PLUGINS": ("plugins", "auto (default), none, or distributions allowed to load"),
        "KERNREG_PLUGINS_DENY": ("plugins_deny", "distributions whose plugins never load"),
        "KERNREG_STRICT_PLUGINS": ("strict_plugins", "1: a plugin that fails to load is an error"),
        "KERNREG_LOCK": (
            "lock",
            "path of a selection plan (kernreg lock) that every selection follows",
        ),
        "KERNREG_POLICY": ("policy", "priority (default), autotune, or op globs to autotune"),
        "KERNREG_CACHE_DIR": (
            "cache_dir",
            "directory of the tuning store (default: the user cache dir)",
        ),
        "KERNREG_ASSUME_PACKAGES": (
            "assume_packages",
            "package gates see these versions: triton==3.4,flashinfer-python==0.7",
        ),
        "KERNREG_STATS_FILE": (
            "stats_file",
            "write kernreg.stats() there at exit ({pid}: the process id); kernreg stats reads it",
        ),
        "KERNREG_CONFIG": ("", "path of a TOML file with the same keys (without the prefix)"),
    }
)

#: The ``Config`` keywords taken as given; the others (but ``unknown``) are parsed as lists.
_PLAIN_FIELDS = ("platform", "backend", "strict_plugins", "plan", "cache_dir", "stats_file")
#: The TOML keys whose ``Config`` field is named otherwise.
_FIELD_OF = MappingProxyType({"pin": "pins", "lock": "plan"})

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


class ConfigWarning(UserWarning):
    """A configuration problem that does not stop kernreg (an unknown variable name)."""


class Config(Frozen):
    """The validated configuration (``Config()``: nothing pinned or denied). A list-valued
    keyword takes what its variable takes (``pins="a.b=torch"``) or a list of such items."""

    __slots__ = (
        "platform",
        "backend",
        "pins",
        "deny",
        "strict",
        "demote",
        "traits",
        "plugins",
        "plugins_deny",
        "strict_plugins",
        "plan",
        "policy",
        "cache_dir",
        "assume_packages",
        "stats_file",
        "unknown",
    )
    platform: Platform | None
    backend: str | None
    pins: tuple[Pin, ...]
    deny: tuple[Pin, ...]
    strict: tuple[str, ...]
    #: Op globs under the demotion policy (``KERNREG_DEMOTE``, docs/fallbacks.md).
    demote: tuple[str, ...]
    traits: frozenset[str]
    plugins: str | tuple[str, ...]
    plugins_deny: tuple[str, ...]
    strict_plugins: bool
    #: The :class:`kernreg.plan.SelectionPlan` that ``KERNREG_LOCK`` names.
    plan: Any
    policy: tuple[str, ...]
    cache_dir: str | None
    #: Package versions the package gates see instead of the installed ones.
    assume_packages: tuple[AssumedPackage, ...]
    stats_file: str | None
    unknown: tuple[str, ...]

    def __init__(
        self,
        *,
        platform: Platform | None = None,
        backend: str | None = None,
        pins: str | Iterable[Pin | str] = (),
        deny: str | Iterable[Pin | str] = (),
        strict: bool | str | Iterable[str] = (),
        demote: bool | str | Iterable[str] = (),
        traits: str | Iterable[str] = frozenset(),
        plugins: str | Iterable[str] = "auto",
        plugins_deny: str | Iterable[str] = (),
        strict_plugins: bool = False,
        plan: Any = None,
        policy: str | Iterable[str] = (),
        cache_dir: str | None = None,
        assume_packages: str | Iterable[AssumedPackage | str] = (),
        stats_file: str | None = None,
        unknown: str | Iterable[str] = (),
    ) -> None:
        given = dict(locals())  # the keywords, named as the fields
        for name in self.__slots__:
            value = given[name]
            if name == "unknown":
                value = (value,) if isinstance(value, str) else tuple(value)
            elif name not in _PLAIN_FIELDS:
                value = _list_field(name, value)
            self._set(name, value)

    def pin_for(self, op: str) -> Pin | None:
        """The pin that applies to ``op``: an exact pin first, else the first matching glob."""
        matching = [pin for pin in self.pins if pin.site is None and pin.matches(op)]
        return min(matching, key=lambda pin: not pin.exact, default=None)

    def denied(self, op: str, backend: str, variant: str) -> Pin | None:
        """The deny rule that excludes ``backend/variant`` for ``op``, if any."""
        for rule in self.deny:
            if rule.backend == backend and rule.variant in (None, variant) and rule.matches(op):
                return rule
        return None

    def autotuned(self, op: str) -> bool:
        """Whether the autotune policy decides ``op`` (``KERNREG_POLICY``)."""
        return _matches(op, self.policy)

    def is_strict(self, op: str) -> bool:
        return _matches(op, self.strict)

    def demotes(self, op: str) -> bool:
        """Whether the demotion policy applies to ``op`` (``KERNREG_DEMOTE``)."""
        return _matches(op, self.demote)

    def plugin_allowed(self, distribution: str) -> str | None:
        """``None`` if plugins of ``distribution`` may load, else why not."""
        name = normalize_distribution(distribution)
        if name in map(normalize_distribution, self.plugins_deny):
            return "denied by KERNREG_PLUGINS_DENY"
        if self.plugins == "none":
            return "plugins disabled (KERNREG_PLUGINS=none)"
        if self.plugins != "auto" and name not in map(normalize_distribution, self.plugins):
            return "not in KERNREG_PLUGINS"
        return None


def _matches(op: str, patterns: tuple[str, ...]) -> bool:
    # Most configurations set no globs: no generator for them (every first decision asks).
    return bool(patterns) and any(fnmatchcase(op, pattern) for pattern in patterns)


def _list_field(field: str, value: Any) -> Any:
    """A list-valued ``Config`` keyword read by its variable's rule (``"a,b"`` is two items);
    ``Pin`` and ``AssumedPackage`` objects pass as they are, strings among them are parsed."""
    name, key = ("pin" if field == "pins" else field), f"Config({field}=...)"
    items: Any = value
    if isinstance(value, set | frozenset):
        items = sorted(value, key=str)
    elif isinstance(value, Iterable) and not isinstance(value, str | bytes | Mapping):
        items = list(value)
    elif not isinstance(value, str | bool):
        raise ConfigError(key, value, "expected a string or a list of strings")
    if field not in ("pins", "deny", "assume_packages") or not isinstance(items, list):
        return _parse_value(name, key, items)
    kind = AssumedPackage if field == "assume_packages" else Pin
    if any(not isinstance(item, kind | str) for item in items):
        example = "'op_or_glob=backend' strings" if kind is Pin else "'name==version'"
        raise ConfigError(key, value, f"expected {kind.__name__} objects or {example}")
    given: list[Any] = []
    for item in items:  # each string by the variable's rule: a blank one is no item
        given.extend([item] if isinstance(item, kind) else _parse_value(name, key, [item]))
    _parse_value(name, key, [str(item) for item in given])  # the rules across items
    if kind is Pin:
        return tuple(given)
    return tuple(sorted(dict.fromkeys(given), key=lambda item: item.name))


def normalize_distribution(name: str) -> str:
    """``name`` as PEP 503 normalizes it: ``Foo__Bar.baz`` is ``foo-bar-baz``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _flag(value: Any) -> bool | None:
    """``value`` as a boolean if it is one or spells one (1/0, true/false, ...), else None."""
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):  # a TOML file's `strict = 1`
        return value == 1
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    return None


def _alone(value: Any) -> Any:
    """A list of one item stands for the item, as a variable's value without a comma does:
    ``policy = ["autotune"]`` in the file is ``KERNREG_POLICY=autotune``."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _op_globs(key: str, value: Any, expected: str) -> tuple[str, ...]:
    try:
        return tuple(check_op_glob(glob, key) for glob in as_items(key, value))
    except InvalidSpecError:
        raise ConfigError(key, value, expected) from None


def _parse_distributions(key: str, value: Any) -> tuple[str, ...]:
    names = as_items(key, value)
    for name in names:
        if DIST_NAME_RE.fullmatch(name) is None:
            raise ConfigError(key, value, f"{name!r} is not a distribution name")
    return tuple(names)


def _parse_value(name: str, key: str, value: Any) -> Any:
    """Parse the value of TOML key ``name``; ``key`` is how errors name it (variable or file key)."""
    try:
        return _parse_key(name, key, value)
    except ConfigError:
        raise
    except ValueError as exc:  # a name, plan or version refused, or an int() of 5,000 digits
        why = str(exc)
        if name == "platform" and "integer string" in why:
            why = "the architecture has too many digits"
        raise ConfigError(key, value, why) from None


def _parse_key(name: str, key: str, value: Any) -> Any:
    if name == "platform":
        if not isinstance(value, str):
            raise ConfigError(key, value, "expected a platform string such as 'cuda:9.0'")
        return parse_platform(value, source=key)
    if name == "backend":
        if not isinstance(value, str):
            raise ConfigError(key, value, "expected a backend name")
        return check_name(value.strip(), key) if value.strip() else None
    if name == "pin":
        return parse_pins(key, value)
    if name == "deny":
        return tuple(parse_rule(key, item, default_pattern="*") for item in as_items(key, value))
    if name in ("strict", "demote"):  # the same grammar: 1/0 or op globs
        flag = _flag(_alone(value))
        if flag is not None:
            return ("*",) if flag else ()
        return _op_globs(key, value, "expected 1/0 or a list of op globs like 'layernorm.*'")
    if name == "traits":
        return frozenset(check_name(t, key) for t in as_items(key, value))
    if name == "plugins":
        word = _alone(value)
        if isinstance(word, str) and word.strip().lower() in ("auto", "none", ""):
            return word.strip().lower() or "auto"
        names = _parse_distributions(key, value)
        if not names:
            raise ConfigError(key, value, "expected 'auto', 'none' or distribution names")
        keywords = [name.lower() for name in names if name.lower() in ("auto", "none")]
        if keywords:  # not a distribution: 'auto' allows every plugin, 'none' none
            why = f"{keywords[0]!r} stands alone; to allow only some distributions, list just them"
            raise ConfigError(key, value, why)
        return names
    if name == "plugins_deny":
        names = _parse_distributions(key, value)
        keywords = [name for name in names if name.lower() in ("auto", "none", "all")]
        if keywords:  # KERNREG_PLUGINS=auto|none reads as a mode; a deny list has none
            why = f"{keywords[0]!r} is not a distribution; to load no plugin, set plugins to 'none'"
            raise ConfigError(key, value, why)
        return names
    if name == "strict_plugins":
        flag = _flag(value)
        if flag is None:
            raise ConfigError(key, value, "expected 1/0, true/false, yes/no or on/off")
        return flag
    if name == "lock":
        if not isinstance(value, str):
            raise ConfigError(key, value, "expected the path of a plan written by `kernreg lock`")
        if not value.strip():
            return None
        if "\0" in value:  # expanduser("~\0") raises ValueError
            raise ConfigError(key, value, "a path has no NUL byte")
        return SelectionPlan.load(os.path.expanduser(value.strip()))
    if name == "policy":
        word = _alone(value)
        if isinstance(word, str) and word.strip().lower() in ("", "priority", "autotune"):
            return ("*",) if word.strip().lower() == "autotune" else ()
        return _op_globs(key, value, "expected 'priority', 'autotune' or op globs to autotune")
    if name in ("cache_dir", "stats_file"):
        if not isinstance(value, str) or not value.strip() or "\0" in value:
            what = "directory" if name == "cache_dir" else "file"
            raise ConfigError(key, value, f"expected a {what} path")
        return os.path.expanduser(value.strip())
    if name == "assume_packages":
        return parse_assumed(as_items(key, value), source=key)
    raise ConfigError(key, value, "unknown configuration key")


#: The largest configuration file read (a pyproject.toml is a few kilobytes).
MAX_CONFIG_BYTES = 16 * 1024 * 1024

#: How deeply lists and tables may nest in kernreg's part of a configuration file (its
#: keys need 2; other tools' tables in a pyproject.toml are not looked at).
MAX_CONFIG_NESTING = 64

_TOML_KEYS = frozenset(toml_key for toml_key, _ in ENV_VARS.values() if toml_key)


def _read_toml(path: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below).
        with open(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise ConfigError("KERNREG_CONFIG", path, "not a regular file")
            raw = handle.read(MAX_CONFIG_BYTES + 1)  # a device or FIFO would never end
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(
                "KERNREG_CONFIG", path, f"larger than {MAX_CONFIG_BYTES} bytes: not a config file"
            )
        data = tomllib.loads(raw.decode("utf-8-sig"))
    except ConfigError:
        raise
    except FileNotFoundError:
        raise ConfigError("KERNREG_CONFIG", path, "file not found") from None
    except RecursionError:
        raise ConfigError("KERNREG_CONFIG", path, "cannot read TOML (nested too deeply)") from None
    except OSError as exc:  # its str() names a file descriptor or repeats the path
        raise ConfigError(
            "KERNREG_CONFIG", path, f"cannot read TOML ({exc.strerror or exc})"
        ) from None
    except ValueError as exc:  # TOMLDecodeError, not UTF-8, a NUL byte
        why = "a number has too many digits" if "integer string" in str(exc) else exc
        raise ConfigError("KERNREG_CONFIG", path, f"cannot read TOML ({why})") from None
    # Accept a dedicated file, or a pyproject.toml (by its name, or because it holds other
    # tools' [tool.*] tables): there only [tool.kernreg] is ours, and nothing else is read.
    table: Any = data
    tool = data.get("tool")
    if isinstance(tool, dict) or os.path.basename(path) == "pyproject.toml":
        table = tool.get("kernreg", {}) if isinstance(tool, dict) else {}
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: tool.kernreg", table, "expected a table")
        stray = sorted(key for key in data if key in _TOML_KEYS)
        if stray:  # kernreg's keys outside [tool.kernreg] would be silently ignored
            raise ConfigError(
                f"{path}: {stray[0]}",
                data[stray[0]],
                "this file holds [tool.*] tables, so only [tool.kernreg] is read: "
                f"move {', '.join(stray)} under [tool.kernreg]",
            )
    for key, value in table.items():
        if _nesting(value) > MAX_CONFIG_NESTING:  # before any message shows the value
            raise ConfigError(
                f"{path}: {key}", f"<nested over {MAX_CONFIG_NESTING} levels>", "nested too deeply"
            )
        if key not in _TOML_KEYS:
            close = difflib.get_close_matches(key, sorted(_TOML_KEYS), n=1)
            known = f"known keys: {', '.join(sorted(_TOML_KEYS))}"
            hint = f"did you mean '{close[0]}'?" if close else known
            raise ConfigError(f"{path}: {key}", value, f"unknown configuration key; {hint}")
    return dict(table)


def _nesting(value: Any) -> int:
    """How deeply lists and tables nest in ``value`` (counted without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            if depth <= MAX_CONFIG_NESTING:
                stack.extend((child, depth + 1) for child in item)
    return deepest


def load_config(environ: Mapping[str, str] | None = None) -> Config:
    """Read and validate the configuration from ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    path = env.get("KERNREG_CONFIG", "").strip()
    if path:
        for key, raw in _read_toml(path).items():
            if key in ("lock", "cache_dir", "stats_file") and isinstance(raw, str) and raw.strip():
                # A path in the file is relative to the file, wherever the process starts.
                raw = os.path.join(os.path.dirname(path), os.path.expanduser(raw.strip()))
            values[_FIELD_OF.get(key, key)] = _parse_value(key, f"{path}: {key}", raw)
    variables = [var for var in sorted(env) if var.startswith("KERNREG_")]
    # KERNREG_BENCH_*: the variables of kernreg's own benchmarks, which run this code too.
    unknown = [v for v in variables if v not in ENV_VARS and not v.startswith("KERNREG_BENCH_")]
    for var in variables:
        if var in ENV_VARS and var != "KERNREG_CONFIG":
            key = ENV_VARS[var][0]
            values[_FIELD_OF.get(key, key)] = _parse_value(key, var, env[var])
    return Config(**values, unknown=tuple(unknown))


def unknown_variable_hint(var: str) -> str:
    close = difflib.get_close_matches(var, sorted(ENV_VARS), n=1)
    return f"unknown variable {var}" + (f"; did you mean {close[0]}?" if close else "")

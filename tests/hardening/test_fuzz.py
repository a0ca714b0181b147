"""Property-based fuzzing: the parsers take any string, and the registry follows a plain
model through any sequence of registrations, replacements, removals, scoped blocks
(some ending in an exception) and freezes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kernreg import (
    Config,
    ConfigError,
    DuplicateReferenceError,
    InvalidSpecError,
    KernelConflictError,
    KernelRegistry,
    KernelSpec,
    OpNotFoundError,
    Platform,
    RegistryFrozenError,
    Requirement,
    load_config,
)
from kernreg.config import ENV_VARS

#: Examples per property; the figures RELIABILITY.md quotes.
PARSER_EXAMPLES = 400
MACHINE_EXAMPLES = 60
MACHINE_STEPS = 40


@pytest.fixture(autouse=True)
def _in_an_empty_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Fuzzed paths (KERNREG_LOCK, KERNREG_CONFIG) resolve against an empty directory.
    monkeypatch.chdir(tmp_path)


# --- configuration --------------------------------------------------------------------------

# Text as people type it and as it breaks: the value grammar's characters, plus anything.
_GRAMMAR = st.text(alphabet="abcxyz_.*?[]!-=/,: 019TRUEtrue ", max_size=30)
_VALUES = _GRAMMAR | st.text(max_size=30)


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


@settings(max_examples=PARSER_EXAMPLES // 2, deadline=None)
@given(st.dictionaries(st.text(max_size=12).map(lambda s: "KERNREG_" + s), _VALUES))
def test_unknown_variables_are_collected_never_fatal(env: dict[str, str]) -> None:
    with contextlib.suppress(ConfigError):
        config = load_config(env)
        assert set(config.unknown) == {
            v for v in env if v not in ENV_VARS and v != "KERNREG_CONFIG"
        }


# --- platforms and requirements -------------------------------------------------------------

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


# --- the registry against a model -----------------------------------------------------------


def _impl(name: str) -> Callable[..., Any]:
    def impl(*args: Any) -> str:
        return name

    impl.__name__ = impl.__qualname__ = name
    return impl


IMPLS = [_impl(f"impl{i}") for i in range(4)]
OPS = ("fz.a", "fz.b")
BACKENDS = ("torch", "fast", "faster")
VARIANTS = ("", "v2")
PLATFORMS = [Platform.parse(p) for p in ("cuda:9.0", "cuda:7.0", "cpu")]

specs = st.builds(
    lambda op, backend, variant, impl, requires, priority, reference: KernelSpec(
        op,
        backend,
        impl,
        variant=variant,
        requires=requires,
        priority=priority,
        reference=reference,
    ),
    st.sampled_from(OPS),
    st.sampled_from(BACKENDS),
    st.sampled_from(VARIANTS),
    st.sampled_from(IMPLS),
    st.sampled_from([(), ("cuda>=8.0",), ("cpu",), ("cuda>=8.0", "cpu")]),
    st.integers(0, 2),
    st.booleans(),
)
keys = st.tuples(st.sampled_from(OPS), st.sampled_from(BACKENDS), st.sampled_from(VARIANTS))


class Model:
    """What the registry should hold: spec per key, and the overrides in order."""

    def __init__(self) -> None:
        self.specs: dict[tuple[str, str, str], KernelSpec] = {}
        self.overrides: list[tuple[str, KernelSpec, KernelSpec | None]] = []
        self.frozen = False

    def copy(self) -> Model:
        other = Model()
        other.specs = dict(self.specs)
        other.overrides = list(self.overrides)
        other.frozen = self.frozen
        return other

    def reference(self, op: str) -> KernelSpec | None:
        found = [s for s in self.specs.values() if s.op == op and s.reference]
        assert len(found) <= 1
        return found[0] if found else None

    def register(self, spec: KernelSpec, replace: bool) -> type[Exception] | None:
        """Apply ``register``; return the error it must raise (and then change nothing)."""
        old = self.specs.get(spec.key)
        if old is not None and old == spec:
            return None
        if self.frozen:
            return RegistryFrozenError
        if old is not None and not replace:
            return KernelConflictError
        ref = self.reference(spec.op)
        if spec.reference and ref is not None and ref.key != spec.key:
            return DuplicateReferenceError
        self.specs[spec.key] = spec
        if old is not None:
            self.overrides.append(("replace", old, spec))
        return None

    def unregister(self, key: tuple[str, str, str]) -> type[Exception] | None:
        if self.frozen:
            return RegistryFrozenError
        if key not in self.specs:
            return OpNotFoundError if not any(k[0] == key[0] for k in self.specs) else KeyError
        self.overrides.append(("unregister", self.specs.pop(key), None))
        return None


class _BoomError(Exception):
    pass


def _decisions(registry: KernelRegistry) -> dict[Any, Any]:
    out = {}
    for op in registry.ops():
        for platform in PLATFORMS:
            d = registry.explain(op, platform=platform)
            out[op, platform] = (
                d.rule,
                None if d.chosen is None else d.chosen.key,
                tuple((c.spec.key, c.status, c.reasons) for c in d.candidates),
                tuple(c.spec.key for c in d.tied),
            )
    return out


class RegistryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.registry = KernelRegistry(config=Config(), platform=PLATFORMS[0])
        self.model = Model()

    def _apply(self, action: Callable[[], object], expected: type[Exception] | None) -> None:
        if expected is None:
            action()
        else:
            with pytest.raises(expected):
                action()

    def _register(self, spec: KernelSpec, replace: bool) -> None:
        expected = self.model.register(spec, replace)
        self._apply(lambda: self.registry.register(spec, replace=replace), expected)

    def _unregister(self, key: tuple[str, str, str]) -> None:
        expected = self.model.unregister(key)
        self._apply(lambda: self.registry.unregister(*key), expected)

    @rule(spec=specs)
    def register(self, spec: KernelSpec) -> None:
        self._register(spec, replace=False)

    @rule(spec=specs)
    def register_replace(self, spec: KernelSpec) -> None:
        self._register(spec, replace=True)

    @rule(key=keys)
    def unregister(self, key: tuple[str, str, str]) -> None:
        self._unregister(key)

    @rule(data=st.data())
    def register_existing_again(self, data: st.DataObject) -> None:
        """Registering an equal spec is a no-op, even frozen (module reloads)."""
        if self.model.specs:
            spec = data.draw(
                st.sampled_from(sorted(self.model.specs.values(), key=lambda s: s.key))
            )
            self._register(KernelSpec(**{f: getattr(spec, f) for f in KernelSpec._compare}), False)

    @rule(
        steps=st.lists(st.tuples(st.sampled_from(["reg", "replace", "unreg"]), specs), max_size=6),
        fail=st.booleans(),
    )
    def scoped_block(self, steps: list[tuple[str, KernelSpec]], fail: bool) -> None:
        saved = self.model.copy()
        try:
            with self.registry.scoped():
                self.model.frozen = False  # a scoped block accepts changes on a frozen registry
                for kind, spec in steps:
                    if kind == "unreg":
                        self._unregister(spec.key)
                    else:
                        self._register(spec, replace=kind == "replace")
                    self.check_equal()
                if fail:
                    raise _BoomError
        except _BoomError:
            pass
        self.model = saved

    @precondition(lambda self: not self.model.frozen)
    @rule()
    def freeze(self) -> None:
        self.registry.freeze()
        self.model.frozen = True

    @invariant()
    def check_equal(self) -> None:
        reg, model = self.registry, self.model
        held = {spec.key: spec for spec in reg.all_specs()}
        assert held == model.specs
        assert len(reg) == len(model.specs)
        assert reg.frozen == model.frozen
        assert list(reg.ops()) == sorted({k[0] for k in model.specs})
        for op in reg.ops():
            assert reg.reference(op) == model.reference(op)
            assert list(reg.get(op)) == sorted(
                (s for s in model.specs.values() if s.op == op), key=KernelSpec.sort_key
            )
        assert [(o.kind, o.old, o.new) for o in reg.overrides()] == model.overrides

    @invariant()
    def decisions_match_a_fresh_registry(self) -> None:
        fresh = KernelRegistry(config=Config(), platform=PLATFORMS[0])
        for spec in sorted(self.model.specs.values(), key=lambda s: s.key, reverse=True):
            fresh.register(spec)
        assert _decisions(self.registry) == _decisions(fresh)


TestRegistryMachine = RegistryMachine.TestCase
TestRegistryMachine.settings = settings(
    max_examples=MACHINE_EXAMPLES,
    stateful_step_count=MACHINE_STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_the_model_checks_run_in_a_clean_environment() -> None:
    # Only the cache folder is set (tests/conftest.py): it steers no decision.
    assert [v for v in os.environ if v.startswith("KERNREG_")] == ["KERNREG_CACHE_DIR"]

"""Selection in the documented order, explain(), and the static ambiguity check."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from typing import Any

import pytest

import kernreg
from kernreg import (
    AmbiguousKernelError,
    BackendNotFoundError,
    Decision,
    KernelRegistry,
    KernelSpec,
    NoEligibleKernelError,
    Platform,
    StrictFallbackError,
    explain,
    select_kernel,
    use_backend,
)
from kernreg.config import Config, Pin
from kernreg.registry import find_ambiguities
from kernreg.spec import Origin

RMS = "layernorm.rmsnorm"


def impl(label: str, *, op: str = RMS, **kw: Any) -> KernelSpec:
    """A spec from a label such as ``triton`` or ``triton/v2``; ``ref`` marks the reference."""
    backend, _, variant = label.partition("/")
    if backend == "ref":
        backend, kw["reference"] = "torch", True
    return KernelSpec(op, backend, f"pkg.{backend}:{variant or 'impl'}", variant=variant, **kw)


REF = impl("ref")


def build(specs: list[KernelSpec], platform: str = "cuda:9.0", **config: Any) -> KernelRegistry:
    registry = KernelRegistry(config=Config(**config), platform=Platform.parse(platform))
    for spec in specs:
        registry.register(spec)
    return registry


# Each row: id, specs, platform, config, select() keywords, expected label and rule.
CHOICES: list[tuple[str, list[KernelSpec], str, dict[str, Any], dict[str, Any], str, str]] = [
    ("only-reference", [REF], "cuda:9.0", {}, {}, "torch", "reference"),
    ("ungated-beats-reference", [REF, impl("triton")], "cpu", {}, {}, "triton", "priority"),
    (
        "device-match",
        [REF, impl("triton", requires=["cuda"])],
        "cuda:9.0",
        {},
        {},
        "triton",
        "priority",
    ),
    (
        "device-mismatch",
        [REF, impl("triton", requires=["cuda"])],
        "hip:gfx942",
        {},
        {},
        "torch",
        "reference",
    ),
    ("cpu-mismatch", [REF, impl("triton", requires=["cuda"])], "cpu", {}, {}, "torch", "reference"),
    (
        "any-of-requirements",
        [REF, impl("triton", requires=["cuda", "hip"])],
        "hip:gfx942",
        {},
        {},
        "triton",
        "priority",
    ),
    (
        "arch-min-ok",
        [REF, impl("triton", requires=["cuda>=8.0"])],
        "cuda:8.0",
        {},
        {},
        "triton",
        "priority",
    ),
    (
        "arch-min-low",
        [REF, impl("triton", requires=["cuda>=8.0"])],
        "cuda:7.5",
        {},
        {},
        "torch",
        "reference",
    ),
    (
        "arch-unknown",
        [REF, impl("triton", requires=["cuda>=8.0"])],
        "cuda",
        {},
        {},
        "torch",
        "reference",
    ),
    (
        "window-in",
        [REF, impl("triton", requires=["cuda>=8.0,<=8.9"])],
        "cuda:8.6",
        {},
        {},
        "triton",
        "priority",
    ),
    (
        "window-above",
        [REF, impl("triton", requires=["cuda>=8.0,<=8.9"])],
        "cuda:9.0",
        {},
        {},
        "torch",
        "reference",
    ),
    (
        "exact-arch",
        [REF, impl("triton", requires=["cuda==9.0"])],
        "cuda:sm_90a",
        {},
        {},
        "triton",
        "priority",
    ),
    (
        "arch-name-match",
        [REF, impl("aot/sm90a", requires=["cuda:sm_90a"])],
        "cuda:sm_90a",
        {},
        {},
        "aot/sm90a",
        "priority",
    ),
    (
        "arch-name-mismatch",
        [REF, impl("aot/sm90a", requires=["cuda:sm_90a"])],
        "cuda:10.0",  # arch-specific code runs on its compute capability only
        {},
        {},
        "torch",
        "reference",
    ),
    (
        "hip-names",
        [REF, impl("aiter", requires=["hip:gfx942|gfx950"])],
        "hip:gfx950",
        {},
        {},
        "aiter",
        "priority",
    ),
    (
        "hip-names-miss",
        [REF, impl("aiter", requires=["hip:gfx942|gfx950"])],
        "hip:gfx90a",
        {},
        {},
        "torch",
        "reference",
    ),
    (
        "priority",
        [REF, impl("triton", priority=10), impl("cuda", priority=20)],
        "cuda:9.0",
        {},
        {},
        "cuda",
        "priority",
    ),
    ("negative-priority", [REF, impl("jit", priority=-5)], "cuda:9.0", {}, {}, "jit", "priority"),
    (
        "tie-one-ineligible",
        [REF, impl("triton"), impl("cuda", requires=["hip"])],
        "cuda:9.0",
        {},
        {},
        "triton",
        "priority",
    ),
    (
        "dtype-match",
        [REF, impl("triton", dtypes=["bf16"])],
        "cuda:9.0",
        {},
        {"dtypes": ["bf16"]},
        "triton",
        "priority",
    ),
    (
        "dtype-alias",
        [REF, impl("triton", dtypes=["bfloat16"])],
        "cuda:9.0",
        {},
        {"dtypes": ["torch.bfloat16"]},
        "triton",
        "priority",
    ),
    (
        "dtype-mismatch",
        [REF, impl("triton", dtypes=["bf16"])],
        "cuda:9.0",
        {},
        {"dtypes": ["fp32"]},
        "torch",
        "reference",
    ),
    (
        "dtype-one-of-two",
        [REF, impl("triton", dtypes=["bf16"])],
        "cuda:9.0",
        {},
        {"dtypes": ["bf16", "fp32"]},
        "torch",
        "reference",
    ),
    (
        "dtype-unknown",
        [REF, impl("triton", dtypes=["bf16"])],
        "cuda:9.0",
        {},
        {},
        "torch",
        "reference",
    ),
    (
        "package-installed",
        [REF, impl("triton", packages=["pytest>=1"])],
        "cuda:9.0",
        {},
        {},
        "triton",
        "priority",
    ),
    (
        "package-too-old",
        [REF, impl("triton", packages=["pytest>=999"])],
        "cuda:9.0",
        {},
        {},
        "torch",
        "reference",
    ),
    (
        "package-missing",
        [REF, impl("triton", packages=["kr-surely-not-installed>=1"])],
        "cuda:9.0",
        {},
        {},
        "torch",
        "reference",
    ),
    (
        "package-marker-off",
        [REF, impl("triton", packages=["kr-surely-not-installed; python_version<'3'"])],
        "cuda:9.0",
        {},
        {},
        "triton",
        "priority",
    ),
    (
        "traits-argument",
        [
            REF.replace(traits=frozenset({"deterministic"})),
            impl("triton", traits=["deterministic"]),
            impl("cuda", priority=5),
        ],
        "cuda:9.0",
        {},
        {"traits": ["deterministic"]},
        "triton",
        "priority",
    ),
    (
        "traits-config",
        [
            REF.replace(traits=frozenset({"deterministic"})),
            impl("triton", traits=["deterministic"]),
            impl("cuda", priority=5),
        ],
        "cuda:9.0",
        {"traits": frozenset({"deterministic"})},
        {},
        "triton",
        "priority",
    ),
    (
        "traits-fallback",
        [REF.replace(traits=frozenset({"deterministic"})), impl("cuda", priority=5)],
        "cuda:9.0",
        {"traits": frozenset({"deterministic"})},
        {},
        "torch",
        "reference",
    ),
    (
        "explicit",
        [REF, impl("triton", priority=10), impl("cuda", priority=20)],
        "cuda:9.0",
        {},
        {"backend": "triton"},
        "triton",
        "explicit",
    ),
    (
        "explicit-reference",
        [REF, impl("triton")],
        "cuda:9.0",
        {},
        {"backend": "torch"},
        "torch",
        "explicit",
    ),
    (
        "explicit-best-variant",
        [REF, impl("triton", priority=1), impl("triton/v2", priority=2)],
        "cuda:9.0",
        {},
        {"backend": "triton"},
        "triton/v2",
        "explicit",
    ),
    (
        "explicit-variant",
        [REF, impl("triton", priority=1), impl("triton/v2", priority=2)],
        "cuda:9.0",
        {},
        {"backend": "triton", "variant": ""},
        "triton",
        "explicit",
    ),
    (
        "explicit-beats-pin",
        [REF, impl("triton")],
        "cuda:9.0",
        {"pins": (Pin("*", "torch"),)},
        {"backend": "triton"},
        "triton",
        "explicit",
    ),
    (
        "pin-glob",
        [REF, impl("triton")],
        "cuda:9.0",
        {"pins": (Pin("layernorm.*", "torch"),)},
        {},
        "torch",
        "pin",
    ),
    (
        "pin-exact-beats-glob",
        [REF, impl("triton"), impl("cuda")],
        "cuda:9.0",
        {"pins": (Pin("layernorm.*", "cuda"), Pin(RMS, "triton"))},
        {},
        "triton",
        "pin",
    ),
    (
        "pin-variant",
        [REF, impl("triton", priority=3), impl("triton/v2")],
        "cuda:9.0",
        {"pins": (Pin(RMS, "triton", "v2"),)},
        {},
        "triton/v2",
        "pin",
    ),
    (
        "pin-glob-absent-backend",
        [REF, impl("triton", priority=3), impl("cuda")],
        "cuda:9.0",
        {"pins": (Pin("layernorm.*", "jit"),)},
        {},
        "triton",
        "priority",
    ),
    (
        "pin-other-op",
        [REF, impl("triton")],
        "cuda:9.0",
        {"pins": (Pin("activation.*", "torch"),)},
        {},
        "triton",
        "priority",
    ),
    (
        "pin-beats-env-backend",
        [REF, impl("triton"), impl("cuda")],
        "cuda:9.0",
        {"pins": (Pin(RMS, "cuda"),), "backend": "triton"},
        {},
        "cuda",
        "pin",
    ),
    (
        "pin-ignores-deny",
        [REF, impl("triton")],
        "cuda:9.0",
        {"pins": (Pin(RMS, "triton"),), "deny": (Pin("*", "triton"),)},
        {},
        "triton",
        "pin",
    ),
    (
        "env-backend",
        [REF, impl("triton", priority=1), impl("cuda", priority=9)],
        "cuda:9.0",
        {"backend": "triton"},
        {},
        "triton",
        "env_backend",
    ),
    (
        "env-backend-reference",
        [REF, impl("triton")],
        "cuda:9.0",
        {"backend": "torch"},
        {},
        "torch",
        "env_backend",
    ),
    (
        "env-backend-ineligible",
        [REF, impl("triton", requires=["hip"]), impl("cuda")],
        "cuda:9.0",
        {"backend": "triton"},
        {},
        "cuda",
        "priority",
    ),
    (
        "env-backend-absent",
        [REF, impl("cuda")],
        "cuda:9.0",
        {"backend": "triton"},
        {},
        "cuda",
        "priority",
    ),
    (
        "deny-global",
        [REF, impl("triton", priority=1), impl("cuda", priority=9)],
        "cuda:9.0",
        {"deny": (Pin("*", "cuda"),)},
        {},
        "triton",
        "priority",
    ),
    (
        "deny-per-op",
        [REF, impl("triton", priority=1), impl("cuda", priority=9)],
        "cuda:9.0",
        {"deny": (Pin("layernorm.*", "cuda"),)},
        {},
        "triton",
        "priority",
    ),
    (
        "deny-other-op",
        [REF, impl("triton", priority=1), impl("cuda", priority=9)],
        "cuda:9.0",
        {"deny": (Pin("activation.*", "cuda"),)},
        {},
        "cuda",
        "priority",
    ),
    (
        "deny-variant",
        [REF, impl("triton", priority=1), impl("triton/v2", priority=9)],
        "cuda:9.0",
        {"deny": (Pin("*", "triton", "v2"),)},
        {},
        "triton",
        "priority",
    ),
    (
        "deny-all-but-reference",
        [REF, impl("triton")],
        "cuda:9.0",
        {"deny": (Pin("*", "triton"),)},
        {},
        "torch",
        "reference",
    ),
    (
        "deny-breaks-tie",
        [REF, impl("triton"), impl("cuda")],
        "cuda:9.0",
        {"deny": (Pin("*", "cuda"),)},
        {},
        "triton",
        "priority",
    ),
    (
        "strict-other-op",
        [REF, impl("triton", requires=["hip"])],
        "cuda:9.0",
        {"strict": ("activation.*",)},
        {},
        "torch",
        "reference",
    ),
    ("strict-only-reference", [REF], "cuda:9.0", {"strict": ("*",)}, {}, "torch", "reference"),
    (
        "strict-false-overrides",
        [REF, impl("triton", requires=["hip"])],
        "cuda:9.0",
        {"strict": ("*",)},
        {"strict": False},
        "torch",
        "reference",
    ),
    (
        "when-without-call",
        [REF, impl("triton", when="pkg.k:pred", priority=5), impl("cuda")],
        "cuda:9.0",
        {},
        {},
        "cuda",
        "priority",
    ),
]


@pytest.mark.parametrize(
    ("specs", "platform", "config", "kwargs", "label", "rule"),
    [row[1:] for row in CHOICES],
    ids=[row[0] for row in CHOICES],
)
def test_choice(
    specs: list[KernelSpec],
    platform: str,
    config: dict[str, Any],
    kwargs: dict[str, Any],
    label: str,
    rule: str,
) -> None:
    registry = build(specs, platform, **config)
    chosen = select_kernel(RMS, registry=registry, **kwargs)
    assert chosen.label == label
    decision = explain(
        RMS,
        registry=registry,
        **{
            k: v
            for k, v in kwargs.items()
            if k in ("dtypes", "backend", "variant", "traits", "strict")
        },
    )
    assert decision.rule == rule
    assert decision.chosen is chosen
    assert decision.ok
    assert decision.candidate(chosen.backend, chosen.variant).status == "chosen"
    # The same inventory registered in the opposite order gives the same answer.
    assert select_kernel(RMS, registry=build(specs[::-1], platform, **config), **kwargs) == chosen


# Each row: id, specs, platform, config, select() keywords, the error and words of its message.
FAILURES: list[
    tuple[str, list[KernelSpec], str, dict[str, Any], dict[str, Any], type[Exception], str]
] = [
    (
        "tie",
        [REF, impl("triton"), impl("cuda")],
        "cuda:9.0",
        {},
        {},
        AmbiguousKernelError,
        "'cuda', 'triton' are all eligible with priority 0",
    ),
    (
        "tie-variants",
        [REF, impl("triton/v1", priority=3), impl("triton/v2", priority=3)],
        "cuda:9.0",
        {},
        {},
        AmbiguousKernelError,
        "'triton/v1', 'triton/v2'",
    ),
    (
        "tie-no-reference",
        [impl("triton"), impl("cuda")],
        "cuda:9.0",
        {},
        {},
        AmbiguousKernelError,
        "KERNREG_PIN=layernorm.rmsnorm=<backend>",
    ),
    (
        "explicit-tie",
        [REF, impl("triton/v1"), impl("triton/v2")],
        "cuda:9.0",
        {},
        {"backend": "triton"},
        AmbiguousKernelError,
        "'triton/v1', 'triton/v2'",
    ),
    (
        "explicit-ineligible",
        [REF, impl("triton", requires=["hip"])],
        "cuda:9.0",
        {},
        {"backend": "triton"},
        NoEligibleKernelError,
        "backend=triton is strict: no fallback",
    ),
    (
        "explicit-variant-ineligible",
        [REF, impl("triton"), impl("triton/v2", requires=["hip"])],
        "cuda:9.0",
        {},
        {"backend": "triton", "variant": "v2"},
        NoEligibleKernelError,
        "backend=triton, variant=v2 is strict",
    ),
    (
        "explicit-absent",
        [REF],
        "cuda:9.0",
        {},
        {"backend": "triton"},
        BackendNotFoundError,
        "No 'triton' backend registered for op 'layernorm.rmsnorm'",
    ),
    (
        "explicit-absent-variant",
        [REF, impl("triton")],
        "cuda:9.0",
        {},
        {"backend": "triton", "variant": "v9"},
        BackendNotFoundError,
        "No 'triton/v9' backend registered",
    ),
    (
        "pin-ineligible",
        [REF, impl("triton", requires=["hip"])],
        "cuda:9.0",
        {"pins": (Pin("layernorm.*", "triton"),)},
        {},
        NoEligibleKernelError,
        "pin layernorm.*=triton is strict: no fallback",
    ),
    (
        "pin-exact-absent",
        [REF, impl("triton")],
        "cuda:9.0",
        {"pins": (Pin(RMS, "jit"),)},
        {},
        NoEligibleKernelError,
        "no implementation of op 'layernorm.rmsnorm' has backend 'jit'",
    ),
    (
        "nothing-eligible",
        [impl("triton", requires=["hip"])],
        "cuda:9.0",
        {},
        {},
        NoEligibleKernelError,
        "no reference implementation registered",
    ),
    (
        "reference-ineligible",
        [
            REF.replace(requires=frozenset({kernreg.Requirement("cpu")})),
            impl("triton", requires=["hip"]),
        ],
        "cuda:9.0",
        {},
        {},
        NoEligibleKernelError,
        "the reference implementation is not eligible either",
    ),
    (
        "required-trait-everywhere-missing",
        [REF, impl("triton")],
        "cuda:9.0",
        {"traits": frozenset({"deterministic"})},
        {},
        NoEligibleKernelError,
        "lacks required traits: deterministic",
    ),
    (
        "strict-all",
        [REF, impl("triton", requires=["hip"])],
        "cuda:9.0",
        {"strict": ("*",)},
        {},
        StrictFallbackError,
        "Strict mode: op 'layernorm.rmsnorm' would fall back to its reference 'torch'",
    ),
    (
        "strict-glob",
        [REF, impl("triton", dtypes=["bf16"])],
        "cuda:9.0",
        {"strict": ("layernorm.*",)},
        {"dtypes": ["fp32"]},
        StrictFallbackError,
        "fallback forbidden by strict mode",
    ),
    (
        "strict-argument",
        [REF, impl("triton", requires=["hip"])],
        "cuda:9.0",
        {},
        {"strict": True},
        StrictFallbackError,
        "strict mode (KERNREG_STRICT or strict=True) forbids",
    ),
    (
        "strict-denied",
        [REF, impl("triton")],
        "cuda:9.0",
        {"strict": ("*",), "deny": (Pin("*", "triton"),)},
        {},
        StrictFallbackError,
        "denied by deny (*=triton)",
    ),
]


@pytest.mark.parametrize(
    ("specs", "platform", "config", "kwargs", "error", "words"),
    [row[1:] for row in FAILURES],
    ids=[row[0] for row in FAILURES],
)
def test_failure(
    specs: list[KernelSpec],
    platform: str,
    config: dict[str, Any],
    kwargs: dict[str, Any],
    error: type[Exception],
    words: str,
) -> None:
    registry = build(specs, platform, **config)
    with pytest.raises(error) as info:
        select_kernel(RMS, registry=registry, **kwargs)
    assert type(info.value) is error
    assert words in str(info.value)
    if isinstance(info.value, (NoEligibleKernelError, AmbiguousKernelError)):
        decision = info.value.decision
        assert isinstance(decision, Decision)
        assert decision.op == RMS
        assert not decision.ok
        assert str(decision) in str(info.value)  # the error carries the whole table
        assert {c.spec for c in decision.candidates} == set(specs)
    with pytest.raises(error):
        kernreg.get_kernel(RMS, registry=registry, **kwargs)


def test_ambiguity_names_both_and_lists_tied(registry: KernelRegistry) -> None:
    for spec in (
        REF,
        impl("triton", priority=2),
        impl("cuda", priority=2),
        impl("jit", priority=1),
    ):
        registry.register(spec)
    decision = registry.explain(RMS)
    assert decision.rule == "ambiguous"
    assert decision.chosen is None
    assert [c.spec.label for c in decision.tied] == ["cuda", "triton"]
    assert "-> ambiguous: cuda, triton" in str(decision)


def test_strict_error_is_a_no_eligible_error_with_the_decision(registry: KernelRegistry) -> None:
    registry.register(REF)
    registry.register(impl("triton", requires=["hip"]))
    with pytest.raises(NoEligibleKernelError) as info:
        registry.select(RMS, strict=True)
    assert isinstance(info.value, StrictFallbackError)
    decision = info.value.decision
    assert decision.strict_error
    assert not decision.ok
    assert decision.chosen == REF
    assert decision.candidate("torch").status == "eligible"
    headline = str(decision).splitlines()[0]
    assert "(rule:" not in headline  # nothing is presented as chosen
    assert "strict" in headline


# --- explain ---------------------------------------------------------------------------------


def test_explain_lists_every_candidate_with_reasons() -> None:
    registry = build(
        [
            REF,
            impl("cuda", requires=["cuda>=10.0"], priority=30),
            impl("aiter", requires=["hip:gfx942"], priority=25),
            impl("triton", dtypes=["bf16"], priority=20),
            impl("jit", packages=["kr-surely-not-installed"], priority=15),
            impl("aot", traits=["deterministic"], priority=10),
            impl("flashinfer", priority=10, traits=["deterministic"], requires=["cuda"]),
            impl("deepgemm", priority=5),
        ],
        deny=(Pin("*", "deepgemm"),),
    )
    decision = explain(RMS, registry=registry, dtypes=["fp16"], traits=["deterministic"])
    by_label = {c.spec.label: c for c in decision.candidates}
    assert [c.spec.label for c in decision.candidates] == [
        "cuda",
        "aiter",
        "triton",
        "jit",
        "aot",
        "flashinfer",
        "deepgemm",
        "torch",
    ]
    assert decision.rule == "ambiguous"  # aot and flashinfer tie
    expectations = {
        "cuda": (False, "needs cuda>=10.0, platform is 9.0"),
        "aiter": (False, "needs device hip:gfx942, platform is cuda"),
        "triton": (False, "accepts only bfloat16, not float16"),
        "jit": (False, "package kr-surely-not-installed is not installed"),
        "deepgemm": (False, "denied by deny (*=deepgemm)"),
        "torch": (False, "lacks required traits: deterministic"),
    }
    for label, (eligible, reason) in expectations.items():
        cand = by_label[label]
        assert cand.eligible is eligible
        assert cand.status == "rejected"
        assert any(reason in r for r in cand.reasons), (label, cand.reasons)
    assert by_label["aot"].eligible
    assert by_label["flashinfer"].eligible
    text = str(decision)
    assert text.splitlines()[0] == f"op {RMS} on cuda:9.0, float16 -> ambiguous: aot, flashinfer"
    assert len(text.splitlines()) == 1 + len(decision.candidates)
    assert "torch (reference)" in text
    assert decision.describe()["tied"] == ["aot", "flashinfer"]


def test_explain_str_of_a_choice(registry: KernelRegistry) -> None:
    registry.register(REF)
    registry.register(impl("triton", priority=10))
    registry.register(impl("cuda", requires=["hip"], priority=20))
    decision = registry.explain(RMS)
    lines = str(decision).splitlines()
    assert lines[0] == f"op {RMS} on cuda:9.0, any dtype -> triton (rule: priority)"
    assert lines[1].split()[:4] == ["rejected", "cuda", "priority", "20"]
    assert lines[2].split()[:4] == ["chosen", "triton", "priority", "10"]
    assert "highest priority among eligible" in lines[2]
    assert lines[3].split()[:5] == ["eligible", "torch", "(reference)", "priority", "0"]
    assert "reference, not needed" in lines[3]
    described = decision.describe()
    assert (described["chosen"], described["rule"], described["ok"]) == ("triton", "priority", True)
    assert [c["label"] for c in described["candidates"]] == ["cuda", "triton", "torch"]  # type: ignore[index]


def test_the_explanation_tells_the_state_the_decision_saw(registry: KernelRegistry) -> None:
    # A process-state predicate is read once, when deciding: the table built later from the
    # same decision shows what it saw, not what holds when the table is read.
    state = {"enabled": True}

    def enabled() -> bool:
        return state["enabled"]

    registry.register(REF)
    registry.register(impl("triton", priority=10, when=enabled))
    decision = registry.explain(RMS)
    state["enabled"] = False
    assert decision.chosen is not None
    assert decision.chosen.backend == "triton"
    assert decision.candidate("triton").status == "chosen"
    kernreg.registry.process_state_changed()
    assert registry.explain(RMS).candidate("triton").status == "rejected"


def test_a_decision_pickles_with_its_explanation(registry: KernelRegistry) -> None:
    import pickle

    registry.register(REF)
    registry.register(impl("triton", priority=10))
    registry.register(impl("cuda", requires=["hip"], priority=20))
    decision = registry.explain(RMS)
    copy = pickle.loads(pickle.dumps(decision))
    assert copy == decision
    assert str(copy) == str(decision)
    assert [c.status for c in copy.candidates] == ["rejected", "chosen", "eligible"]


def test_decisions_made_from_threads_explain_themselves_alike(registry: KernelRegistry) -> None:
    registry.register(REF)
    registry.register(impl("triton", priority=10))
    registry.register(impl("jit", priority=10, requires=["hip"]))
    decision = registry.explain(RMS)
    tables: list[str] = []
    threads = [threading.Thread(target=lambda: tables.append(str(decision))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(tables)) == 1
    assert "needs device hip" in tables[0]


def test_explain_is_cached_until_a_mutation(registry: KernelRegistry) -> None:
    registry.register(REF)
    first = registry.explain(RMS)
    assert registry.explain(RMS) is first
    registry.register(impl("triton"))
    second = registry.explain(RMS)
    assert second is not first
    assert second.chosen is not None
    assert second.chosen.backend == "triton"
    registry.configure(Config(deny=(Pin("*", "triton"),)), platform=Platform.parse("cpu"))
    third = registry.explain(RMS)
    assert third.chosen == REF
    assert str(third.platform) == "cpu"


def test_explain_for_another_platform_and_dtype(registry: KernelRegistry) -> None:
    registry.register(REF)
    registry.register(impl("aiter", requires=["hip:gfx942"], dtypes=["bf16"]))
    assert registry.explain(RMS).chosen == REF
    assert explain(RMS, registry=registry, platform="hip:gfx942", dtypes=["bf16"]).chosen == impl(
        "aiter", requires=["hip:gfx942"], dtypes=["bf16"]
    )
    assert (
        explain(RMS, registry=registry, platform=Platform.parse("hip:gfx942"), dtypes="bf16").chosen
        is not None
    )
    with pytest.raises(kernreg.InvalidSpecError):
        explain(RMS, registry=registry, dtypes=["bfloat17"])
    with pytest.raises(kernreg.InvalidSpecError):
        explain(RMS, registry=registry, platform="cuda:")


def test_conditional_candidates_are_reported(registry: KernelRegistry) -> None:
    def big(x: int) -> bool:
        return x > 10

    registry.register(REF)
    registry.register(impl("triton", when=big, priority=5))
    decision = registry.explain(RMS)
    assert decision.chosen == REF
    assert decision.conditional == (impl("triton", when=big, priority=5),)
    assert decision.candidate("triton").status == "conditional"
    assert "checked per call" in decision.candidate("triton").reasons[0]
    assert registry.select(RMS, call=((11,), {})).backend == "triton"
    assert registry.select(RMS, call=((1,), {})).backend == "torch"
    rejected = registry.explain(RMS, call=((1,), {})).candidate("triton")
    assert rejected.reasons == ("when predicate is false for this call",)


def test_when_predicates_tie_at_call_time(registry: KernelRegistry) -> None:
    registry.register(REF)
    registry.register(impl("triton", when=lambda x: x > 0))
    registry.register(impl("cuda", when=lambda x: x > 5))
    assert registry.select(RMS, call=((1,), {})).backend == "triton"
    with pytest.raises(AmbiguousKernelError, match="'cuda', 'triton'"):
        registry.select(RMS, call=((6,), {}))
    assert registry.select(RMS, call=((0,), {})).backend == "torch"


# --- scoped pins -----------------------------------------------------------------------------


def test_use_backend_pins_within_the_block(registry: KernelRegistry) -> None:
    registry.register(REF)
    registry.register(impl("triton"))
    registry.register(impl("cuda", priority=5))
    registry.register(impl("triton", op="activation.silu"))
    registry.register(impl("cuda", op="activation.silu", priority=5))
    assert registry.select(RMS).backend == "cuda"
    with use_backend("layernorm.*", "triton") as pin:
        assert pin == Pin("layernorm.*", "triton")
        decision = registry.explain(RMS)
        assert (decision.chosen.backend, decision.rule) == ("triton", "scoped_pin")  # type: ignore[union-attr]
        with use_backend(RMS, "torch"):
            assert registry.select(RMS).backend == "torch"
        assert registry.select(RMS).backend == "triton"
        assert registry.select("activation.silu").backend == "cuda"  # the pin does not match
    assert registry.select(RMS).backend == "cuda"


def test_use_backend_beats_configured_pin(make_registry: Callable[..., KernelRegistry]) -> None:
    registry = make_registry(config=Config(pins=(Pin(RMS, "cuda"),)))
    for spec in (REF, impl("triton"), impl("cuda")):
        registry.register(spec)
    assert registry.select(RMS).backend == "cuda"
    with use_backend(RMS, "triton"):
        assert registry.select(RMS).backend == "triton"


def test_use_backend_is_strict_and_glob_pins_can_miss(registry: KernelRegistry) -> None:
    registry.register(REF)
    registry.register(impl("triton", requires=["hip"]))
    with use_backend(RMS, "triton"), pytest.raises(NoEligibleKernelError, match="use_backend"):
        registry.select(RMS)
    with use_backend("layernorm.*", "jit"):  # no jit implementation: the glob does not apply
        decision = registry.explain(RMS)
        assert decision.chosen == REF
        assert any("does not apply" in note for note in decision.notes)


def test_use_backend_does_not_leak_into_other_threads(registry: KernelRegistry) -> None:
    registry.register(REF)
    registry.register(impl("triton"))
    entered, checked = threading.Event(), threading.Event()
    seen: list[str] = []

    def other_thread() -> None:
        entered.wait(10)
        seen.append(registry.select(RMS).backend)
        checked.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with use_backend(RMS, "torch"):
        entered.set()
        checked.wait(10)
        seen.append(registry.select(RMS).backend)
    worker.join(10)
    assert seen == ["triton", "torch"]


@pytest.mark.parametrize(
    ("pattern", "backend", "variant"),
    [
        ("Layernorm.*", "torch", None),
        ("layernorm.*", "Torch", None),
        ("layernorm.*", "torch", "V2"),
        ("layernorm", "torch", None),
    ],
)
def test_use_backend_validates(pattern: str, backend: str, variant: str | None) -> None:
    with pytest.raises(kernreg.InvalidSpecError), use_backend(pattern, backend, variant):
        pass


# --- find_ambiguities ------------------------------------------------------------------------

OVERLAPS: list[tuple[str, dict[str, Any], dict[str, Any], str | None]] = [
    ("no-gates", {}, {}, "devices: any; dtypes: any"),
    ("one-anywhere", {"requires": ["cuda"]}, {}, "devices: one runs anywhere"),
    ("same-device", {"requires": ["cuda"]}, {"requires": ["cuda"]}, "devices: cuda & cuda"),
    ("other-device", {"requires": ["cuda"]}, {"requires": ["hip"]}, None),
    (
        "some-device-shared",
        {"requires": ["cuda", "xpu"]},
        {"requires": ["hip", "xpu"]},
        "devices: xpu & xpu",
    ),
    (
        "windows-overlap",
        {"requires": ["cuda>=8.0,<=9.0"]},
        {"requires": ["cuda>=9.0"]},
        "cuda>=9.0 & cuda>=8.0,<=9.0",
    ),
    ("windows-disjoint", {"requires": ["cuda>=8.0,<=8.9"]}, {"requires": ["cuda>=9.0"]}, None),
    (
        "exact-in-window",
        {"requires": ["cuda==9.0"]},
        {"requires": ["cuda>=8.0"]},
        "cuda>=8.0 & cuda==9.0",
    ),
    ("exact-outside", {"requires": ["cuda==9.0"]}, {"requires": ["cuda>=10.0"]}, None),
    (
        "names-shared",
        {"requires": ["hip:gfx942|gfx950"]},
        {"requires": ["hip:gfx950"]},
        "hip:gfx950 & hip:gfx942|gfx950",
    ),
    ("names-disjoint", {"requires": ["hip:gfx942"]}, {"requires": ["hip:gfx950"]}, None),
    (
        "name-in-window",
        {"requires": ["cuda:sm_90a"]},
        {"requires": ["cuda>=9.0"]},
        "cuda>=9.0 & cuda:sm_90a",
    ),
    ("name-outside-window", {"requires": ["cuda:sm_90a"]}, {"requires": ["cuda>=10.0"]}, None),
    ("name-vs-device", {"requires": ["hip:gfx942"]}, {"requires": ["hip"]}, "hip & hip:gfx942"),
    # CUDA target names overlap where they run on one capability, as decisions find them.
    (
        "generic-and-arch-specific",
        {"requires": ["cuda:sm_90"]},
        {"requires": ["cuda:sm_90a"]},
        "cuda:sm_90a & cuda:sm_90",
    ),
    (
        "family-in-window",
        {"requires": ["cuda:sm_100f"]},
        {"requires": ["cuda>=10.3"]},
        "cuda>=10.3 & cuda:sm_100f",
    ),
    (
        "family-and-member",
        {"requires": ["cuda:sm_100f"]},
        {"requires": ["cuda:sm_103"]},
        "cuda:sm_103 & cuda:sm_100f",
    ),
    ("family-and-other-major", {"requires": ["cuda:sm_100f"]}, {"requires": ["cuda:sm_120"]}, None),
    ("family-below-window", {"requires": ["cuda:sm_100f"]}, {"requires": ["cuda>=11.0"]}, None),
    ("dtypes-shared", {"dtypes": ["bf16", "fp16"]}, {"dtypes": ["fp16"]}, "dtypes: float16"),
    ("dtypes-disjoint", {"dtypes": ["bf16"]}, {"dtypes": ["fp16"]}, None),
    ("dtypes-one-open", {"dtypes": ["bf16"]}, {}, "dtypes: bfloat16"),
    (
        "devices-disjoint-dtypes-shared",
        {"requires": ["cuda"], "dtypes": ["bf16"]},
        {"requires": ["hip"], "dtypes": ["bf16"]},
        None,
    ),
    (
        "when-counts",
        {"when": "pkg.k:small"},
        {"when": "pkg.k:big"},
        "when predicates may both hold",
    ),
    (
        "when-one-side",
        {"when": "pkg.k:small", "dtypes": ["bf16"]},
        {},
        "when predicates may both hold",
    ),
    (
        "when-cannot-rescue-devices",
        {"when": "pkg.k:small", "requires": ["cuda"]},
        {"requires": ["hip"]},
        None,
    ),
]


@pytest.mark.parametrize(
    ("first", "second", "reason"), [row[1:] for row in OVERLAPS], ids=[row[0] for row in OVERLAPS]
)
def test_find_ambiguities(
    registry: KernelRegistry, first: dict[str, Any], second: dict[str, Any], reason: str | None
) -> None:
    a = registry.register(impl("triton", priority=3, **first))
    b = registry.register(
        impl("cuda", priority=3, **second, origin=Origin("vendor.py", 9, "vendor-kernels", "1.0"))
    )
    registry.register(impl("jit", priority=2, **first))  # other priority: never ambiguous
    registry.register(REF)
    found = find_ambiguities(registry)
    if reason is None:
        assert found == ()
        return
    (ambiguity,) = found
    assert (ambiguity.op, ambiguity.first, ambiguity.second) == (RMS, b, a)
    assert reason in ambiguity.reason
    text = str(ambiguity)
    assert text.startswith(
        f"op '{RMS}': 'cuda' (vendor.py:9 (distribution vendor-kernels 1.0)) and 'triton' ({a.origin}) share priority 3"
    )
    assert ambiguity.describe()["second_origin"] == str(a.origin)


def test_find_ambiguities_excludes_references_and_other_ops(registry: KernelRegistry) -> None:
    registry.register(REF)
    registry.register(impl("triton", op="activation.silu"))
    registry.register(impl("ref", op="activation.silu"))
    assert find_ambiguities(registry) == ()
    registry.register(impl("cuda", op="activation.silu"))
    registry.register(impl("triton/v2", op="activation.silu"))
    found = find_ambiguities(registry)
    assert [(a.first.label, a.second.label) for a in found] == [
        ("cuda", "triton"),
        ("cuda", "triton/v2"),
        ("triton", "triton/v2"),
    ]


def test_find_ambiguities_defaults_to_the_process_wide_registry() -> None:
    with kernreg.default_registry().scoped():
        kernreg.register_kernel(impl("triton", op="kr_test.ambiguous"))
        kernreg.register_kernel(impl("cuda", op="kr_test.ambiguous"))
        found = [a for a in find_ambiguities() if a.op.startswith("kr_test.")]
        assert [(a.first.backend, a.second.backend) for a in found] == [("cuda", "triton")]


# --- a first decision without its explanation --------------------------------------------------


def _row(rows: Any, op: str) -> list[tuple[str, str, str, int]]:
    return [(rule, impl, cause, n) for o, rule, impl, cause, n in rows if o == op]


@pytest.mark.parametrize(
    ("specs", "chosen", "rule"),
    [
        ([impl("ref")], "torch", "reference"),
        ([impl("cuda", requires=["cuda>=9.0"]), impl("ref")], "cuda", "priority"),
        (
            [impl("triton", priority=5), impl("cuda", requires=["hip"]), impl("ref")],
            "triton",
            "priority",
        ),
        ([impl("cuda", requires=["cuda>=10.0"]), impl("ref")], "torch", "reference"),
        ([impl("a", dtypes=["float16"]), impl("ref")], "torch", "reference"),
    ],
)
def test_a_first_selection_agrees_with_its_explanation_and_is_counted(
    make_registry: Callable[..., KernelRegistry],
    specs: list[KernelSpec],
    chosen: str,
    rule: str,
) -> None:
    op = f"quick.case_{chosen}_{rule}_{len(specs)}"
    registry = make_registry()
    for spec in specs:
        registry.register(spec.replace(op=op))
    before = _row(kernreg.stats().counts, op)
    assert select_kernel(op, registry=registry).label == chosen
    assert select_kernel(op, registry=registry).label == chosen  # kept: counted once
    decision = registry.explain(op)
    assert (decision.chosen.label if decision.chosen else None, decision.rule) == (chosen, rule)
    assert [c.spec.label for c in decision.candidates] == [s.label for s in registry.get(op)]
    assert all(c.reasons for c in decision.candidates if not c.eligible)
    counted = {(r, i, c): n for r, i, c, n in _row(kernreg.stats().counts, op)}
    old = {(r, i, c): n for r, i, c, n in before}
    cause = "" if rule == "priority" or len(specs) == 1 else "no eligible implementation"
    if len(specs) > 1 and specs[0].dtypes:
        cause = "dtype"
    assert counted[(rule, chosen, cause)] - old.get((rule, chosen, cause), 0) == 1


def test_a_first_selection_follows_every_configured_rule(
    make_registry: Callable[..., KernelRegistry],
) -> None:
    specs = [impl("triton", priority=5), impl("cuda"), impl("ref")]
    configs = {
        "cuda": Config(backend="cuda"),
        "torch": Config(deny=[f"{RMS}=triton", f"{RMS}=cuda"]),
    }
    for expected, config in configs.items():
        registry = make_registry(config=config)
        for spec in specs:
            registry.register(spec)
        assert select_kernel(RMS, registry=registry).label == expected
        assert registry.explain(RMS).chosen.label == expected
    registry = make_registry(config=Config(pins=[f"{RMS}=cuda"]))
    for spec in specs:
        registry.register(spec)
    assert select_kernel(RMS, registry=registry).label == "cuda"
    with use_backend(RMS, "torch"):
        assert select_kernel(RMS, registry=registry).label == "torch"
    assert select_kernel(RMS, registry=registry).label == "cuda"


def test_a_first_selection_with_a_state_predicate_runs_what_explain_shows(
    make_registry: Callable[..., KernelRegistry],
) -> None:
    state = {"on": True, "calls": 0}

    def switch() -> bool:
        state["calls"] += 1
        return state["on"]

    registry = make_registry()
    registry.register(impl("fast", when=switch, priority=5))
    registry.register(impl("ref"))
    assert select_kernel(RMS, registry=registry).label == "fast"
    state["on"] = False  # no process_state_changed(): the decision made stands, and is shown
    assert registry.explain(RMS).chosen.label == "fast"
    assert select_kernel(RMS, registry=registry).label == "fast"
    assert state["calls"] == 1


@pytest.mark.parametrize(
    ("specs", "error", "headline"),
    [
        ([impl("a"), impl("b")], AmbiguousKernelError, "Ambiguous kernel selection for op"),
        ([impl("a", requires=["hip"])], NoEligibleKernelError, "No eligible kernel for op"),
        ([impl("ref", requires=["hip"])], NoEligibleKernelError, "No eligible kernel for op"),
    ],
)
def test_a_first_selection_that_fails_says_what_explain_says(
    make_registry: Callable[..., KernelRegistry],
    specs: list[KernelSpec],
    error: type[Exception],
    headline: str,
) -> None:
    registry = make_registry()
    for spec in specs:
        registry.register(spec)
    with pytest.raises(error) as caught:
        select_kernel(RMS, registry=registry)
    registry.register(impl("late", priority=50))  # after the error: not in its decision
    decision = caught.value.decision  # type: ignore[attr-defined]
    assert isinstance(decision, Decision)
    assert [c.spec.label for c in decision.candidates] == [s.label for s in specs]
    assert decision.chosen is None
    assert decision.rule in ("ambiguous", "none")
    assert str(caught.value).startswith(headline)
    assert str(decision) in str(caught.value)
    assert caught.value.args[0] is decision
    assert repr(caught.value).startswith(f"{error.__name__}(")
    again = pickle.loads(pickle.dumps(caught.value))
    assert type(again) is error
    assert str(again) == str(caught.value)
    assert again.decision == decision  # type: ignore[attr-defined]


def test_an_unread_failed_selection_pickles_with_its_decision(registry: KernelRegistry) -> None:
    registry.register(impl("a"))
    registry.register(impl("b"))
    with pytest.raises(AmbiguousKernelError) as caught:
        select_kernel(RMS, registry=registry)
    assert isinstance(caught.value.args[0], Decision)  # args read first carry it too
    again = pickle.loads(pickle.dumps(caught.value))
    assert again.decision.tied == registry.explain(RMS).tied
    counted = _row(kernreg.stats().counts, RMS)
    assert any(rule == "ambiguous" and impl == "" for rule, impl, _, _ in counted)

"""KernelSpec: validation of every field, value semantics, lazy loading and origins."""

from __future__ import annotations

import copy
import json
import pickle
import sys
from collections.abc import Callable
from typing import Any

import pytest

import kernreg
from _support import BAD_INPUT_OP, BAD_INPUT_TARGET, assert_fails_cleanly
from kernreg import InvalidSpecError, KernelLoadError, KernelRegistry, KernelSpec, Requirement
from kernreg.spec import Origin


def rms(x: Any) -> Any:
    return x


def other(x: Any) -> Any:
    return x


def _line_of(marker: str) -> int:
    """Line number of the line in this file that contains ``marker``."""
    with open(__file__, encoding="utf-8") as handle:
        return next(
            i for i, line in enumerate(handle, 1) if marker in line and "_line_of" not in line
        )


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"op": "layernorm"}, "op", "layernorm"),
        ({"op": "Layernorm.rms"}, "op", "Layernorm.rms"),
        ({"op": ""}, "op", ""),
        ({"op": None}, "op", None),
        ({"backend": "Triton"}, "backend", "Triton"),
        ({"backend": "tri-ton"}, "backend", "tri-ton"),
        ({"backend": ""}, "backend", ""),
        ({"backend": 1}, "backend", 1),
        ({"variant": "V2"}, "variant", "V2"),
        ({"variant": "-v"}, "variant", "-v"),
        ({"variant": None}, "variant", None),
        ({"target": "pkg.mod"}, "target", "pkg.mod"),
        ({"target": "pkg.mod:"}, "target", "pkg.mod:"),
        ({"target": ":rms"}, "target", ":rms"),
        ({"target": "pkg.mod:rms:x"}, "target", "pkg.mod:rms:x"),
        ({"target": "pkg mod:rms"}, "target", "pkg mod:rms"),
        ({"target": "1pkg:rms"}, "target", "1pkg:rms"),
        ({"target": "pkg.mod:1rms"}, "target", "pkg.mod:1rms"),
        ({"target": 42}, "target", 42),
        ({"target": None}, "target", None),
        ({"when": "not a target"}, "when", "not a target"),
        ({"when": 3}, "when", 3),
        ({"requires": "cuda"}, "requires", "cuda"),
        ({"requires": Requirement("cuda")}, "requires", Requirement("cuda")),
        ({"requires": 3}, "requires", 3),
        ({"requires": ["cuda>8.0"]}, "requirement", "cuda>8.0"),
        ({"requires": ["CUDA"]}, "requirement", "CUDA"),
        ({"requires": [7]}, "requirement", 7),
        ({"dtypes": "bf16"}, "dtypes", "bf16"),
        ({"dtypes": ["bfloat17"]}, "dtypes", "bfloat17"),
        ({"dtypes": [16]}, "dtypes", 16),
        ({"dtypes": 16}, "dtypes", 16),
        ({"packages": "flashinfer-python>=0.2"}, "packages", "flashinfer-python>=0.2"),
        ({"packages": ["flashinfer python"]}, "packages", "flashinfer python"),
        ({"packages": ["pkg>=>1"]}, "packages", "pkg>=>1"),
        ({"packages": [3]}, "packages", 3),
        ({"traits": "deterministic"}, "traits", "deterministic"),
        ({"traits": ["Deterministic"]}, "traits", "Deterministic"),
        ({"traits": ["batch-invariant"]}, "traits", "batch-invariant"),
        ({"priority": 1.0}, "priority", 1.0),
        ({"priority": "1"}, "priority", "1"),
        ({"priority": True}, "priority", True),
        ({"priority": None}, "priority", None),
        ({"reference": 1}, "reference", 1),
        ({"reference": "yes"}, "reference", "yes"),
        ({"description": 3}, "description", 3),
    ],
)
def test_invalid_fields_are_named(kwargs: dict[str, Any], field: str, value: object) -> None:
    args: dict[str, Any] = {"op": "layernorm.rmsnorm", "backend": "triton", "target": "pkg.k:rms"}
    args.update(kwargs)
    op, backend, target = args.pop("op"), args.pop("backend"), args.pop("target")
    with pytest.raises(InvalidSpecError) as info:
        KernelSpec(op, backend, target, **args)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field
    assert info.value.value == value
    assert str(info.value).startswith(f"invalid {field} {value!r}: ")


@pytest.mark.parametrize(
    "target",
    [
        "pkg.k:rms",
        "pkg:rms",
        "pkg.sub.k:Kernels.rms",
        "pkg.k:Outer.Inner.call",
        "_private._mod:_fn",
        "Pkg.K:Rms",
        rms,
        print,
        len,
        (lambda x: x),
        KernelRegistry,
    ],
)
def test_valid_targets(target: Any) -> None:
    spec = KernelSpec("layernorm.rmsnorm", "triton", target)
    assert spec.target is target


@pytest.mark.parametrize(
    ("field", "given", "stored"),
    [
        ("dtypes", ["bf16", "fp16", "bfloat16"], frozenset({"bfloat16", "float16"})),
        ("dtypes", ("torch.float32",), frozenset({"float32"})),
        ("dtypes", [], frozenset()),
        (
            "requires",
            ["cuda>=8.0", Requirement("hip")],
            frozenset({Requirement("cuda", min_arch=(8, 0)), Requirement("hip")}),
        ),
        ("requires", ("cuda", "cuda"), frozenset({Requirement("cuda")})),
        (
            "traits",
            ["deterministic", "deterministic", "inplace"],
            frozenset({"deterministic", "inplace"}),
        ),
        ("traits", iter(["my_own_trait"]), frozenset({"my_own_trait"})),
        (
            "packages",
            ["flashinfer-python>=0.2", "triton; python_version>'3'"],
            frozenset({"flashinfer-python>=0.2", "triton; python_version>'3'"}),
        ),
    ],
)
def test_collections_normalise_to_frozensets(
    field: str, given: Any, stored: frozenset[Any]
) -> None:
    spec = KernelSpec("layernorm.rmsnorm", "triton", "pkg.k:rms", **{field: given})
    value = getattr(spec, field)
    assert type(value) is frozenset
    assert value == stored


def test_defaults() -> None:
    spec = KernelSpec("layernorm.rmsnorm", "triton", "pkg.k:rms")
    assert spec.key == ("layernorm.rmsnorm", "triton", "")
    assert spec.label == "triton"
    assert (spec.variant, spec.priority, spec.reference, spec.description) == ("", 0, False, "")
    assert spec.requires == spec.dtypes == spec.packages == spec.traits == frozenset()
    assert spec.when is None
    assert spec.origin is None
    assert not spec.gated


@pytest.mark.parametrize(
    ("kwargs", "gated"),
    [
        ({}, False),
        ({"priority": 5, "traits": ["deterministic"], "packages": ["pytest"]}, False),
        ({"requires": ["cuda"]}, True),
        ({"dtypes": ["bf16"]}, True),
        ({"when": "pkg.k:is_big"}, True),
        ({"when": rms}, True),
    ],
)
def test_gated(kwargs: dict[str, Any], gated: bool) -> None:
    assert KernelSpec("a.b", "triton", "pkg.k:rms", **kwargs).gated is gated


def test_label_and_key_with_variant() -> None:
    spec = KernelSpec("activation.silu_and_mul", "triton", "pkg.k:silu", variant="v2")
    assert spec.label == "triton/v2"
    assert spec.key == ("activation.silu_and_mul", "triton", "v2")


def test_equality_and_hash_ignore_origin() -> None:
    a = KernelSpec("a.b", "triton", "pkg.k:rms", dtypes=["bf16"], requires=["cuda>=8.0"])
    b = KernelSpec("a.b", "triton", "pkg.k:rms", dtypes=("bfloat16",), requires={"cuda>=8.0"})
    b = b.with_origin(Origin("elsewhere.py", 99, "dist", "1.0"))
    assert a.origin != b.origin
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"backend": "cuda"},
        {"variant": "v2"},
        {"target": "pkg.k:other"},
        {"requires": ["cuda"]},
        {"dtypes": ["bf16"]},
        {"when": "pkg.k:pred"},
        {"packages": ["pytest"]},
        {"traits": ["inplace"]},
        {"priority": 1},
        {"reference": True},
        {"description": "fast"},
    ],
)
def test_every_other_field_takes_part_in_equality(change: dict[str, Any]) -> None:
    base: dict[str, Any] = {"backend": "triton", "target": "pkg.k:rms"}
    first = KernelSpec("a.b", base["backend"], base["target"])
    merged = {**base, **change}
    second = KernelSpec("a.b", merged.pop("backend"), merged.pop("target"), **merged)
    assert first != second


def test_callable_targets_compare_by_identity() -> None:
    assert KernelSpec("a.b", "torch", rms) == KernelSpec("a.b", "torch", rms)
    assert KernelSpec("a.b", "torch", rms) != KernelSpec("a.b", "torch", other)


def test_spec_is_frozen_and_copies_are_itself() -> None:
    spec = KernelSpec("a.b", "triton", "pkg.k:rms")
    with pytest.raises(AttributeError):
        spec.priority = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del spec.op
    assert copy.copy(spec) is spec
    assert copy.deepcopy(spec) is spec
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_describe_is_json_ready() -> None:

    spec = KernelSpec(
        "a.b",
        "triton",
        "pkg.k:rms",
        variant="v2",
        requires=["cuda>=8.0", "hip:gfx942"],
        dtypes=["fp16", "bf16"],
        traits=["inplace", "deterministic"],
        priority=3,
    ).with_origin(Origin("f.py", 7))
    described = spec.describe()
    assert json.loads(json.dumps(described)) == described
    assert described["requires"] == ["cuda>=8.0", "hip:gfx942"]
    assert described["dtypes"] == ["bfloat16", "float16"]
    assert described["traits"] == ["deterministic", "inplace"]
    assert described["target"] == "pkg.k:rms"
    assert described["origin"] == {"file": "f.py", "line": 7, "distribution": None, "version": None}
    assert KernelSpec("a.b", "torch", rms).describe()["target"] == f"{__name__}:rms"


# --- lazy loading ----------------------------------------------------------------------------


def test_load_is_lazy_and_returns_the_attribute(write_module: Callable[[str, str], str]) -> None:
    name = write_module(
        "kr_lazy_kernels",
        """
        class Kernels:
            @staticmethod
            def rms(x):
                return ("rms", x)
        """,
    )
    spec = KernelSpec("layernorm.rmsnorm", "triton", f"{name}:Kernels.rms")
    assert name not in sys.modules  # registration is metadata only
    impl = spec.load()
    assert name in sys.modules
    assert impl is sys.modules[name].Kernels.rms
    assert impl(1) == ("rms", 1)


def test_callable_target_loads_as_itself() -> None:
    assert KernelSpec("a.b", "torch", rms).load() is rms


@pytest.mark.parametrize(
    ("source", "attr", "cause"),
    [
        (None, "rms", "ModuleNotFoundError"),
        ("x = 1\n", "rms", "AttributeError"),
        ("class K:\n    pass\n", "K.rms", "AttributeError"),
        ("rms = 42\n", "rms", "TypeError: int object is not callable"),
        ("raise RuntimeError('no GPU here')\n", "rms", "RuntimeError: no GPU here"),
        ("import kr_module_that_does_not_exist\n", "rms", "ModuleNotFoundError"),
        ("def rms(:\n", "rms", "SyntaxError"),
    ],
)
def test_load_failures_name_op_backend_and_target(
    write_module: Callable[[str, str], str], source: str | None, attr: str, cause: str
) -> None:
    module = "kr_absent_kernels" if source is None else write_module("kr_broken_kernels", source)
    target = f"{module}:{attr}"
    registry = KernelRegistry()
    spec = registry.register(KernelSpec("layernorm.rmsnorm", "triton", target, variant="v2"))
    with pytest.raises(KernelLoadError) as info:
        spec.load()
    message = str(info.value)
    assert isinstance(info.value, ImportError)
    assert message.startswith(
        f"Cannot load kernel for op 'layernorm.rmsnorm', backend 'triton/v2': target '{target}' failed with "
    )
    assert cause in message
    assert f"registered at {spec.origin}" in message
    assert __file__ in message
    assert info.value.spec is spec


@pytest.mark.parametrize(
    ("source", "cause"),
    [
        (None, "ModuleNotFoundError"),
        ("x = 1\n", "AttributeError"),
        ("pred = 'yes'\n", "not callable"),
    ],
)
def test_load_when_failures(
    write_module: Callable[[str, str], str], source: str | None, cause: str
) -> None:
    module = "kr_absent_preds" if source is None else write_module("kr_preds", source)
    spec = KernelSpec("a.b", "triton", rms, when=f"{module}:pred")
    with pytest.raises(KernelLoadError, match=cause) as info:
        spec.load_when()
    assert "op 'a.b', backend 'triton'" in str(info.value)


def test_load_when(write_module: Callable[[str, str], str]) -> None:
    module = write_module("kr_good_preds", "def big(x):\n    return x > 10\n")
    spec = KernelSpec("a.b", "triton", rms, when=f"{module}:big")
    predicate = spec.load_when()
    assert predicate is sys.modules[module].big
    assert KernelSpec("a.b", "triton", rms, when=rms).load_when() is rms
    assert KernelSpec("a.b", "triton", rms).load_when() is None


# --- origins ---------------------------------------------------------------------------------


def test_origin_is_the_registering_call(registry: KernelRegistry) -> None:
    stored = registry.register(KernelSpec("a.b", "triton", rms))  # origin: direct
    assert stored.origin == Origin(__file__, _line_of("# origin: direct"))
    assert str(stored.origin) == f"{__file__}:{_line_of('# origin: direct')}"


def test_explicit_origin_is_kept(registry: KernelRegistry) -> None:
    origin = Origin("plugin.py", 3, "vendor-kernels", "1.2")
    stored = registry.register(KernelSpec("a.b", "triton", rms, origin=origin))
    assert stored.origin is origin
    assert str(origin) == "plugin.py:3 (distribution vendor-kernels 1.2)"


def test_origin_through_register_kernel() -> None:
    with kernreg.default_registry().scoped():
        stored = kernreg.register_kernel(KernelSpec("a.b", "triton", rms))  # origin: global
        assert stored.origin == Origin(__file__, _line_of("# origin: global"))


def test_origin_through_op_decorators(registry: KernelRegistry) -> None:
    @kernreg.op("a.b", registry=registry)  # origin: op-decorator
    def ref(x: Any) -> Any:
        return x

    @ref.register("triton")  # origin: register-decorator
    def fast(x: Any) -> Any:
        return x

    ref.register("cuda", "pkg.k:rms")  # origin: register-call-form

    assert registry.get_backend("a.b", "torch").origin == Origin(
        __file__, _line_of("# origin: op-decorator")
    )
    assert registry.get_backend("a.b", "triton").origin == Origin(
        __file__, _line_of("# origin: register-decorator")
    )
    assert registry.get_backend("a.b", "cuda").origin == Origin(
        __file__, _line_of("# origin: register-call-form")
    )


def test_origin_of_replace_and_unregister(registry: KernelRegistry) -> None:
    registry.register(KernelSpec("a.b", "triton", rms))
    registry.register(KernelSpec("a.b", "triton", other), replace=True)  # origin: replace
    registry.unregister("a.b", "triton")  # origin: unregister
    replaced, removed = registry.overrides()
    assert replaced.origin == Origin(__file__, _line_of("# origin: replace"))
    assert removed.origin == Origin(__file__, _line_of("# origin: unregister"))


def test_origins_are_exact_for_every_line_of_generated_code(registry: KernelRegistry) -> None:
    # One code object, many call sites: each origin names its own line.
    source = "\n".join(
        f"registry.register(KernelSpec('gen.op_{i}', 'triton', rms))" for i in range(60)
    )
    code = compile(source, "generated_specs.py", "exec")
    exec(code, {"registry": registry, "KernelSpec": KernelSpec, "rms": rms})
    for i in range(60):
        origin = registry.get_backend(f"gen.op_{i}", "triton").origin
        assert origin == Origin("generated_specs.py", i + 1)
        assert str(origin) == f"generated_specs.py:{i + 1}"


def test_origins_in_a_long_module_name_the_line_python_reports(registry: KernelRegistry) -> None:
    # Multi-line calls, comments, blank lines, loops and nested functions in one long code
    # object: each origin is the line the interpreter itself gives the registering frame.
    said: list[int] = []

    def watch(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is KernelRegistry.register.__code__:
            said.append(frame.f_back.f_lineno)

    parts = []
    for i in range(1500):
        kind = i % 5
        if kind == 0:
            parts.append(f"register(KernelSpec('long.op_{i}', 'triton', rms))")
        elif kind == 1:
            parts.append(
                f"register(\n    KernelSpec(\n        'long.op_{i}',\n        'triton', rms)\n)"
            )
        elif kind == 2:
            parts.append(
                f"# a comment\n\nx = [\n    1,\n]\nregister(KernelSpec('long.op_{i}', 'cuda', rms))"
            )
        elif kind == 3:
            parts.append(
                f"for j in range(1):\n    register(KernelSpec('long.op_{i}', 'triton', rms))"
            )
        else:
            parts.append(
                f"def f_{i}():\n    register(KernelSpec('long.op_{i}', 'triton', rms))\nf_{i}()"
            )
    code = compile("\n".join(parts), "long_module.py", "exec")
    sys.setprofile(watch)
    try:
        exec(code, {"register": registry.register, "KernelSpec": KernelSpec, "rms": rms})
    finally:
        sys.setprofile(None)
    origins = [registry.get(f"long.op_{i}")[0].origin for i in range(1500)]
    assert origins == [Origin("long_module.py", line) for line in said]


def test_origins_of_one_call_site_are_equal_and_survive_pickling(
    registry: KernelRegistry,
) -> None:
    specs = [KernelSpec(f"a.op_{i}", "triton", rms) for i in range(3)]
    stored = [registry.register(spec) for spec in specs]  # origin: loop
    first = stored[0].origin
    assert first is not None
    assert all(s.origin == first for s in stored)
    assert first == Origin(__file__, _line_of("# origin: loop"))
    assert hash(first) == hash(Origin(__file__, _line_of("# origin: loop")))
    assert repr(first) == repr(Origin(__file__, _line_of("# origin: loop")))
    copied = pickle.loads(pickle.dumps(stored[1]))
    assert copied == stored[1]
    assert copied.origin == first
    assert (copied.origin.file, copied.origin.line) == (__file__, _line_of("# origin: loop"))
    described = stored[2].describe()["origin"]
    assert described == {
        "file": __file__,
        "line": _line_of("# origin: loop"),
        "distribution": None,
        "version": None,
    }


@pytest.mark.parametrize("item", [["cuda"], {"device": "cuda"}, 3])
def test_unhashable_or_wrong_requirement_items_are_named(item: object) -> None:
    # Equal requirement tuples share one validated set; an item that cannot be hashed
    # is still reported as the invalid requirement it is.
    for _ in range(2):
        with pytest.raises(InvalidSpecError, match="invalid requirement"):
            KernelSpec("a.b", "triton", rms, requires=(item,))  # type: ignore[arg-type]


def test_equal_collections_give_equal_validated_sets() -> None:
    a = KernelSpec("a.b", "triton", rms, requires=("cuda>=8.0",), dtypes=["bf16"])
    b = KernelSpec("a.c", "triton", rms, requires=["cuda>=8.0"], dtypes=("bfloat16",))
    assert a.requires == b.requires
    assert a.dtypes == b.dtypes == frozenset({"bfloat16"})
    assert a.requires == frozenset({Requirement.parse("cuda>=8.0")})


def test_an_origin_beyond_the_stack_is_unknown() -> None:
    from kernreg.registry import caller_origin

    origin = caller_origin(10_000)
    assert (origin.file, origin.line) == ("<unknown>", 0)


# --- malformed spec fields: an InvalidSpecError naming the field and the value ------------


SPEC_FIELDS: list[tuple[str, dict[str, Any], str, str]] = [
    # (id, the bad keyword arguments, the field the error names, how the value is quoted)
    ("op-none", {"op": None}, "op", "None"),
    ("op-empty", {"op": ""}, "op", "''"),
    ("op-one-segment", {"op": "layernorm"}, "op", "'layernorm'"),
    ("op-upper", {"op": "LayerNorm.rms"}, "op", "'LayerNorm.rms'"),
    ("op-trailing-dot", {"op": "a.b."}, "op", "'a.b.'"),
    ("op-space", {"op": "a. b"}, "op", "'a. b'"),
    ("op-digit-first", {"op": "1a.b"}, "op", "'1a.b'"),
    ("op-bytes", {"op": b"a.b"}, "op", "b'a.b'"),
    ("op-unicode", {"op": "a.b\u00e9"}, "op", "'a.b\u00e9'"),
    ("op-list", {"op": ["a.b"]}, "op", "['a.b']"),
    ("backend-empty", {"backend": ""}, "backend", "''"),
    ("backend-upper", {"backend": "Triton"}, "backend", "'Triton'"),
    ("backend-dash", {"backend": "my-backend"}, "backend", "'my-backend'"),
    ("backend-slash", {"backend": "triton/v2"}, "backend", "'triton/v2'"),
    ("backend-int", {"backend": 3}, "backend", "3"),
    ("backend-none", {"backend": None}, "backend", "None"),
    ("variant-none", {"variant": None}, "variant", "None"),
    ("variant-upper", {"variant": "V2"}, "variant", "'V2'"),
    ("variant-space", {"variant": "v 2"}, "variant", "'v 2'"),
    ("variant-leading-dash", {"variant": "-v2"}, "variant", "'-v2'"),
    ("variant-int", {"variant": 2}, "variant", "2"),
    ("target-no-colon", {"target": "hard_targets.impl"}, "target", "'hard_targets.impl'"),
    ("target-no-module", {"target": ":impl"}, "target", "':impl'"),
    ("target-no-attr", {"target": "hard_targets:"}, "target", "'hard_targets:'"),
    ("target-two-colons", {"target": "a:b:c"}, "target", "'a:b:c'"),
    ("target-dash", {"target": "my-pkg.k:f"}, "target", "'my-pkg.k:f'"),
    ("target-trailing-dot", {"target": "a.b:c."}, "target", "'a.b:c.'"),
    ("target-space", {"target": "a.b: c"}, "target", "'a.b: c'"),
    ("target-empty", {"target": ""}, "target", "''"),
    ("target-int", {"target": 3}, "target", "3"),
    ("target-none", {"target": None}, "target", "None"),
    ("when-no-colon", {"when": "pred"}, "when", "'pred'"),
    ("when-int", {"when": 1}, "when", "1"),
    ("requires-str", {"requires": "cuda"}, "requires", "'cuda'"),
    ("requires-int", {"requires": 3}, "requires", "3"),
    ("requires-bad-string", {"requires": ["cuda>=eight"]}, "requirement", "'cuda>=eight'"),
    ("requires-none-item", {"requires": [None]}, "requirement", "None"),
    ("requires-window-reversed", {"requires": ["cuda>=9.0,<=8.0"]}, "requirement", "9.0"),
    ("requires-bound-twice", {"requires": ["cuda>=8.0,>=9.0"]}, "requirement", "'cuda>=8.0,>=9.0'"),
    ("requires-device-upper", {"requires": ["CUDA"]}, "requirement", "'CUDA'"),
    ("dtypes-str", {"dtypes": "bfloat16"}, "dtypes", "'bfloat16'"),
    ("dtypes-unknown", {"dtypes": ["bfloat17"]}, "dtypes", "'bfloat17'"),
    ("dtypes-int", {"dtypes": [16]}, "dtypes", "16"),
    ("dtypes-nested", {"dtypes": [["bf16"]]}, "dtypes", "['bf16']"),
    ("dtypes-empty-name", {"dtypes": [""]}, "dtypes", "''"),
    ("dtypes-none", {"dtypes": None}, "dtypes", "None"),
    ("packages-str", {"packages": "triton"}, "packages", "'triton'"),
    ("packages-not-pep508", {"packages": ["triton>>2"]}, "packages", "'triton>>2'"),
    ("packages-int", {"packages": [2]}, "packages", "2"),
    (
        "packages-extra-marker",
        {"packages": ["triton>=2; extra == 'gpu'"]},
        "packages",
        "\"triton>=2; extra == 'gpu'\"",
    ),
    ("traits-upper", {"traits": ["Deterministic"]}, "traits", "'Deterministic'"),
    ("traits-str", {"traits": "deterministic"}, "traits", "'deterministic'"),
    ("priority-float", {"priority": 1.5}, "priority", "1.5"),
    ("priority-str", {"priority": "10"}, "priority", "'10'"),
    ("priority-bool", {"priority": True}, "priority", "True"),
    ("priority-none", {"priority": None}, "priority", "None"),
    ("reference-int", {"reference": 1}, "reference", "1"),
    ("reference-str", {"reference": "yes"}, "reference", "'yes'"),
    ("description-int", {"description": 3}, "description", "3"),
    ("origin-str", {"origin": "file.py:3"}, "origin", "'file.py:3'"),
]


@pytest.mark.parametrize(
    ("bad", "field", "quoted"),
    [pytest.param(bad, field, quoted, id=name) for name, bad, field, quoted in SPEC_FIELDS],
)
def test_a_malformed_spec_field_is_refused_naming_field_and_value(
    populated: KernelRegistry, bad: dict[str, Any], field: str, quoted: str
) -> None:
    fields: dict[str, Any] = {
        "op": BAD_INPUT_OP,
        "backend": "cuda",
        "target": BAD_INPUT_TARGET,
        **bad,
    }

    def register() -> None:
        populated.register(KernelSpec(**fields))

    error = assert_fails_cleanly(
        populated, register, InvalidSpecError, ValueError, f"invalid {field} ", quoted
    )
    assert isinstance(error, InvalidSpecError)
    assert error.field == field


# --- subclasses and when predicates -------------------------------------------------------


def _double(x: int) -> int:
    return 2 * x


class _TaggedSpec(KernelSpec):
    __slots__ = ("tag",)
    tag: str

    def __init__(self, *args: object, tag: str = "", **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._set("tag", tag)


def test_with_origin_keeps_a_subclass_and_its_fields() -> None:
    spec = _TaggedSpec("round.tagged", "torch", _double, tag="fast")
    moved = spec.with_origin(Origin("elsewhere.py", 3))
    assert type(moved) is _TaggedSpec
    assert moved.tag == "fast"
    assert moved == spec
    assert moved.origin == Origin("elsewhere.py", 3)


class _AtLeast:
    """A ``when`` predicate comparing by value, as a dataclass would."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, x: int) -> bool:
        return x >= self.n

    def __eq__(self, other: object) -> bool:
        return type(other) is _AtLeast and other.n == self.n

    def __hash__(self) -> int:
        return hash(self.n)


def test_a_spec_keeps_its_own_when_predicate_when_an_equal_one_was_seen() -> None:
    first, second = _AtLeast(5), _AtLeast(5)
    a = KernelSpec("round.when", "torch", _double, when=first)
    b = KernelSpec("round.when", "torch", _double, when=second)
    c = a.replace(when=second)
    assert a.when is first
    assert b.when is second
    assert c.when is second
    assert a == b
    second.n = 100  # the user's own predicate object: a change reaches its spec only
    assert b.when(50) is False
    assert a.when(50) is True

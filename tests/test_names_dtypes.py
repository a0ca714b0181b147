"""Op ids, backend and variant names, labels, and the dtype table with its aliases."""

from __future__ import annotations

import pytest

import kernreg
from kernreg import ConfigError, InvalidSpecError, KernelSpec
from kernreg.config import load_config
from kernreg.dtypes import DTYPES, dtype_name, normalize_dtype


@pytest.mark.parametrize(
    "op_id",
    ["layernorm.rmsnorm", "a.b", "activation.silu_and_mul", "x1.y_2.z3", "attention.flash.v2"],
)
def test_valid_op_ids(op_id: str) -> None:
    assert KernelSpec(op_id, "torch", "m:f").op == op_id


@pytest.mark.parametrize(
    "op_id",
    [
        "layernorm",
        "",
        "Layernorm.rmsnorm",
        "layernorm.RMSNorm",
        "layernorm..rmsnorm",
        ".layernorm",
        "layernorm.",
        "1norm.rms",
        "layernorm.1rms",
        "layer-norm.rms",
        "layernorm.rms norm",
        " layernorm.rmsnorm",
        "_a.b",
        None,
        42,
        ("a", "b"),
    ],
)
def test_invalid_op_ids(op_id: object) -> None:
    with pytest.raises(InvalidSpecError) as info:
        KernelSpec(op_id, "torch", "m:f")  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert info.value.field == "op"
    assert info.value.value == op_id
    assert repr(op_id) in str(info.value)


@pytest.mark.parametrize("name", ["torch", "torch_compile", "triton", "a", "cute_dsl", "x86"])
def test_valid_names(name: str) -> None:
    assert KernelSpec("a.b", name, "m:f").backend == name


@pytest.mark.parametrize("name", ["", "Triton", "1x", "tri-ton", "tri.ton", "_x", "a b", None, 3])
def test_invalid_names(name: object) -> None:
    with pytest.raises(InvalidSpecError, match="invalid backend") as info:
        KernelSpec("a.b", name, "m:f")  # type: ignore[arg-type]
    assert info.value.field == "backend"
    assert info.value.value == name


@pytest.mark.parametrize("variant", ["", "v2", "2", "sm90a", "hopper-only", "v2.1", "a_b"])
def test_valid_variants(variant: str) -> None:
    assert KernelSpec("a.b", "triton", "m:f", variant=variant).variant == variant


@pytest.mark.parametrize("variant", ["V2", "-x", ".x", "_x", "v 2", "v/2", None, 2])
def test_invalid_variants(variant: object) -> None:
    with pytest.raises(InvalidSpecError, match="invalid variant") as info:
        KernelSpec("a.b", "triton", "m:f", variant=variant)  # type: ignore[arg-type]
    assert info.value.value == variant


@pytest.mark.parametrize(
    "glob",
    ["layernorm.*", "*", "layernorm.rmsnorm", "*.rmsnorm", "layernorm.rms?orm", "[ab].x", "a*"],
)
def test_valid_op_globs(glob: str) -> None:
    (pin,) = load_config({"KERNREG_PIN": f"{glob}=torch"}).pins
    assert pin.pattern == glob


@pytest.mark.parametrize(
    "glob",
    ["", "Layernorm.*", "layer norm.*", "a=b", "layernorm", "2", "maybe", None],
)
def test_invalid_op_globs(glob: object) -> None:
    # A pattern without wildcards can only ever match itself, so it must be an op id.
    with pytest.raises(InvalidSpecError) as info, kernreg.use_backend(glob, "torch"):  # type: ignore[arg-type]
        pass
    assert info.value.field == "use_backend pattern"
    assert info.value.value == glob


@pytest.mark.parametrize(
    ("backend", "variant", "shown"),
    [("triton", "", "triton"), ("triton", "v2", "triton/v2"), ("aot", "sm90a", "aot/sm90a")],
)
def test_label_and_parse_label(backend: str, variant: str, shown: str) -> None:
    assert KernelSpec("a.b", backend, "m:f", variant=variant).label == shown
    (pin,) = load_config({"KERNREG_PIN": f"a.*={shown}"}).pins
    assert pin.backend == backend
    assert pin.variant == (variant or None)


@pytest.mark.parametrize("text", ["Triton", "triton/V2", "/v2", "triton/-x", ""])
def test_parse_label_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="KERNREG_PIN"):
        load_config({"KERNREG_PIN": f"a.*={text}"})


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("bf16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("f16", "float16"),
        ("fp32", "float32"),
        ("float", "float32"),
        ("double", "float64"),
        ("fp8", "float8_e4m3fn"),
        ("fp8_e5m2", "float8_e5m2"),
        ("long", "int64"),
        ("torch.bfloat16", "bfloat16"),
        (" bfloat16 ", "bfloat16"),
        ("cfloat", "complex64"),
    ],
)
def test_dtype_aliases_normalise(alias: str, canonical: str) -> None:
    assert normalize_dtype(alias) == canonical
    assert canonical in DTYPES


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_canonical_dtypes_are_fixed_points(name: str) -> None:
    assert normalize_dtype(name) == name


@pytest.mark.parametrize("name", ["bfloat17", "", "tensor", "float8", None, 16, ["bf16"]])
def test_unknown_dtypes_are_rejected(name: object) -> None:
    with pytest.raises(InvalidSpecError, match="unknown dtype") as info:
        normalize_dtype(name, "dtypes")
    assert info.value.field == "dtypes"
    assert info.value.value == name


class _TorchLikeDtype:
    """Prints like ``torch.bfloat16``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


class _UnhashableDtype:
    __hash__ = None  # type: ignore[assignment]

    def __str__(self) -> str:
        return "float16"


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        (_TorchLikeDtype("bfloat16"), "bfloat16"),
        (_TorchLikeDtype("float16"), "float16"),
        ("bfloat16", "bfloat16"),
        ("bf16", "bfloat16"),
        ("my_exotic_type", "my_exotic_type"),
        (_UnhashableDtype(), "float16"),
    ],
)
def test_dtype_name_of_objects(dtype: object, name: str) -> None:
    assert dtype_name(dtype) == name
    assert dtype_name(dtype) == name  # cached answer is the same


# --- bad dtype names ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["", " ", "bfloat17", "bf", "torch.", "float8", "Float33", "int128", "fp4", None, 16, ["bf16"]],
)
def test_bad_dtype_names(name: object) -> None:
    with pytest.raises(InvalidSpecError) as info:
        kernreg.dtypes.normalize_dtype(name)
    assert info.value.field == "dtype"
    assert repr(name) in str(info.value)

"""The op pack: its inventory, its real entry point, and the contracts of its ops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
kernreg_ops = pytest.importorskip("kernreg_ops")

import kernreg  # noqa: E402
from kernreg import KernelRegistry, Platform  # noqa: E402
from kernreg._packages import missing_reason  # noqa: E402
from kernreg.config import Config  # noqa: E402
from kernreg.selection import decide  # noqa: E402
from kernreg_ops import _inputs, _plugin, reference  # noqa: E402
from kernreg_ops.ops import (  # noqa: E402
    fused_add_rmsnorm,
    gelu_and_mul,
    rmsnorm,
    rotary,
    silu_and_mul,
)

OPS = (
    "activation.gelu_and_mul",
    "activation.gelu_tanh_mul",
    "activation.silu_and_mul",
    "activation.silu_mul",
    "embedding.rotary",
    "embedding.rotary_cos_sin",
    "embedding.rotary_cos_sin_interleaved",
    "layernorm.add_rmsnorm",
    "layernorm.fused_add_rmsnorm",
    "layernorm.layernorm",
    "layernorm.rmsnorm",
    "layernorm.rmsnorm_offset",
    "moe.experts",
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    env.update(extra)
    return env


def test_entry_point_registers_the_pack_as_its_distribution() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kernreg", "list", "--json"],
        capture_output=True,
        text=True,
        env=_env(),
        check=True,
    )
    listing = json.loads(out.stdout)
    ops = {entry["op"]: entry for entry in listing["ops"]}
    assert set(OPS) <= set(ops)
    for op in OPS:
        origins = {impl["origin"]["distribution"] for impl in ops[op]["implementations"]}
        assert origins == {"kernreg-ops"}


def test_registration_imports_no_torch() -> None:
    code = (
        "import sys, kernreg, kernreg_ops\n"
        "from kernreg_ops import _plugin\n"
        "registry = kernreg.KernelRegistry(platform=kernreg.Platform.parse('cpu'))\n"
        "_plugin.register(registry)\n"
        "registry.explain('layernorm.rmsnorm', dtypes=['bfloat16'])\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print(len(registry))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), check=True
    )
    assert out.stdout.strip() == "50"


INVENTORY = {
    # op: {backend: priority}; Triton ranks behind a path of one or two ATen calls
    "layernorm.rmsnorm": {"triton": 12, "aten": 20, "torch_compile": 10, "torch": 0},
    "layernorm.fused_add_rmsnorm": {"triton": 30, "native": 15, "torch_compile": 10, "torch": 0},
    "activation.silu_and_mul": {"triton": 12, "native": 15, "torch_compile": 10, "torch": 0},
    "activation.gelu_and_mul": {"triton": 12, "native": 15, "torch_compile": 10, "torch": 0},
    "embedding.rotary": {"triton": 30, "torch_compile": 10, "torch": 0},
    "layernorm.add_rmsnorm": {"triton": 30, "native": 15, "torch_compile": 10, "torch": 0},
    "activation.silu_mul": {"triton": 12, "native": 15, "torch_compile": 10, "torch": 0},
    "embedding.rotary_cos_sin": {"triton": 30, "native": 15, "torch_compile": 10, "torch": 0},
    "layernorm.rmsnorm_offset": {"triton": 30, "native": 15, "torch_compile": 10, "torch": 0},
    "layernorm.layernorm": {"triton": 12, "aten": 20, "torch_compile": 10, "torch": 0},
    "activation.gelu_tanh_mul": {"triton": 12, "native": 15, "torch_compile": 10, "torch": 0},
    "embedding.rotary_cos_sin_interleaved": {
        "triton": 30,
        "native": 15,
        "torch_compile": 10,
        "torch": 0,
    },
    "moe.experts": {"native": 15, "torch_compile": 10, "torch": 0},
}


@pytest.mark.parametrize("op", sorted(INVENTORY))
def test_inventory(op: str) -> None:
    specs = {s.backend: s for s in kernreg.default_registry().get(op)}
    assert {b: s.priority for b, s in specs.items()} == INVENTORY[op]
    assert specs["torch"].reference
    if "triton" in specs:
        triton = specs["triton"]
        assert [str(r) for r in triton.requires] == ["cuda>=8.0"]
        assert triton.dtypes == {"float16", "bfloat16", "float32"}
        assert triton.packages == {"triton>=2.1"}
    if "native" in specs:  # plain torch ops, eligible on any device
        assert not specs["native"].requires
    assert specs["torch_compile"].when == "kernreg_ops._policy:compile_allowed"
    inplace = op == "layernorm.fused_add_rmsnorm"
    assert all(("inplace" in s.traits) == inplace for s in specs.values())


def test_the_package_docstring_says_where_each_backend_runs() -> None:
    import kernreg_ops

    doc = " ".join((kernreg_ops.__doc__ or "").split())
    natives = [s for s in kernreg.default_registry().all_specs() if s.backend == "native"]
    assert natives
    assert not any(s.requires for s in natives)
    assert "``native`` (any device," in doc
    assert "``triton`` (CUDA SM 8.0+," in doc


def test_each_spec_names_the_line_that_declares_it() -> None:
    # Through the installed distribution's entry point, as `kernreg list` shows it.
    out = subprocess.run(
        [sys.executable, "-m", "kernreg", "list", "--json"],
        capture_output=True,
        text=True,
        env=_env(),
        check=True,
    )
    listing = {entry["op"]: entry for entry in json.loads(out.stdout)["ops"]}
    lines: dict[int, str] = {}
    for op in OPS:
        for impl in listing[op]["implementations"]:
            origin = impl["origin"]
            assert origin["file"].endswith("_plugin.py"), origin
            lines[origin["line"]] = f"{op} {impl['backend']}"
    source = Path(_plugin.__file__).read_text(encoding="utf-8").splitlines()
    specs = [s for s in _plugin.specs() if s.op in OPS]
    assert len(lines) == len(specs)  # one line per spec, none shared
    helpers = {"torch": "_reference(", "aten": "_aten(", "native": "_native(",
               "torch_compile": "_compiled(", "triton": "_triton("}  # fmt: skip
    for line, what in lines.items():
        declared = " ".join(source[line - 1 : line + 3])
        op, backend = what.split()
        assert declared.lstrip().startswith("add("), (line, declared)
        assert helpers[backend] in declared, (what, declared)
        constant = next(name for name, value in vars(_plugin).items() if value == op)
        assert constant in declared, (what, declared)


def _pack_registry(platform: str) -> KernelRegistry:
    registry = KernelRegistry(config=Config(), platform=Platform.parse(platform))
    _plugin.register(registry)
    return registry


def test_explain_on_hopper_says_why_triton_is_chosen_or_not() -> None:
    registry = _pack_registry("cuda:9.0")
    rotary = registry.explain("embedding.rotary_cos_sin", dtypes=["bfloat16"])
    norm = registry.explain("layernorm.rmsnorm", dtypes=["bfloat16"])
    assert rotary.chosen is not None
    assert norm.chosen is not None
    # One ATen call computes an RMSNorm: that outranks a Triton launch, installed or not.
    assert norm.chosen.backend == "aten"
    if missing_reason("triton>=2.1") is None:  # the test install has triton
        assert rotary.chosen.backend == "triton"
        assert rotary.candidate("triton").status == "chosen"
        assert norm.candidate("triton").status == "eligible"
        assert "outranked by aten" in norm.candidate("triton").reasons[0]
        return
    assert rotary.chosen.backend == "native"
    for decision in (rotary, norm):
        triton = decision.candidate("triton")
        assert triton.status == "rejected"
        assert triton.reasons == ("package triton is not installed (needs triton>=2.1)",)


def test_triton_is_chosen_on_hopper_when_installed() -> None:
    specs = _pack_registry("cuda:9.0").get("embedding.rotary_cos_sin")
    decision = decide(
        "embedding.rotary_cos_sin",
        specs,
        platform=Platform.parse("cuda:9.0"),
        config=Config(),
        dtypes=("bfloat16",),
        packages_reason=lambda requirement: None,  # as if triton were installed
    )
    assert decision.chosen is not None
    assert decision.chosen.backend == "triton"
    older = decide(
        "embedding.rotary_cos_sin",
        specs,
        platform=Platform.parse("cuda:7.5"),
        config=Config(),
        dtypes=("bfloat16",),
        packages_reason=lambda requirement: None,
    )
    assert older.chosen is not None
    assert older.chosen.backend == "native"


def test_compiled_implementations_are_opt_in() -> None:
    registry = _pack_registry("cuda:7.5")  # the rotary: no native, no triton
    decision = registry.explain("embedding.rotary", dtypes=["float32"])
    assert decision.chosen is not None
    assert decision.chosen.backend == "torch"
    assert decision.candidate("torch_compile").reasons == (
        "when predicate is false (process state, checked when deciding)",
    )
    assert not decision.conditional  # decided now, never per call
    with kernreg_ops.allow_compile():
        chosen = registry.explain("embedding.rotary", dtypes=["float32"]).chosen
        assert chosen is not None
        assert chosen.backend == "torch_compile"
    assert not kernreg_ops.compile_allowed()
    assert registry.explain("embedding.rotary", dtypes=["float32"]).chosen.backend == "torch"


def test_rmsnorm_uses_aten_on_cpu() -> None:
    x, w = torch.randn(4, 32), torch.randn(32)
    assert rmsnorm.select(dtypes=["float32"]).backend == "aten"
    torch.testing.assert_close(rmsnorm(x, w), reference.rmsnorm(x, w))
    torch.testing.assert_close(
        rmsnorm(x, w), torch.nn.functional.rms_norm(x, (32,), w, 1e-6), rtol=0, atol=0
    )


@pytest.mark.parametrize(
    ("x_dtype", "weight_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
    ],
)
def test_aten_rmsnorm_promotes_mixed_dtypes_like_the_reference(
    x_dtype: torch.dtype, weight_dtype: torch.dtype
) -> None:
    from kernreg_ops import _aten

    x, w = torch.randn(4, 32).to(x_dtype), torch.randn(32).to(weight_dtype)
    expected = reference.rmsnorm(x, w)
    actual = _aten.rmsnorm(x, w)
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rmsnorm_in_place_contract(dtype: torch.dtype) -> None:
    x = torch.randn(5, 64).to(dtype)
    residual = torch.randn(5, 64).to(dtype)
    weight = torch.randn(64).to(dtype)
    x0, r0 = x.clone(), residual.clone()
    result = fused_add_rmsnorm(x, residual, weight, 1e-5)
    assert result is None
    expected_residual = (x0.float() + r0.float()).to(dtype)
    assert torch.equal(residual, expected_residual)
    assert torch.equal(x, reference.rmsnorm(expected_residual, weight, 1e-5))
    assert x.data_ptr() != residual.data_ptr()


def test_activations() -> None:
    x = torch.randn(3, 2, 10)
    a, b = x[..., :5], x[..., 5:]
    torch.testing.assert_close(silu_and_mul(x), torch.nn.functional.silu(a) * b)
    torch.testing.assert_close(gelu_and_mul(x), torch.nn.functional.gelu(a) * b)
    torch.testing.assert_close(
        gelu_and_mul(x, approximate="tanh"),
        torch.nn.functional.gelu(a, approximate="tanh") * b,
    )
    assert silu_and_mul(x).shape == (3, 2, 5)


def test_rotary_layouts() -> None:
    tokens, heads, head_dim = 3, 2, 8
    positions = torch.tensor([0, 1, 5])
    q = torch.randn(tokens, heads, head_dim)
    k = torch.randn(tokens, 1, head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(8).float()[:, None] * inv_freq
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = rotary(positions, q, k, cache)
    assert torch.equal(q, q0)
    assert torch.equal(k, k0)
    torch.testing.assert_close(q_out[0], q[0])  # position 0: identity
    # NeoX: feature i pairs with i + head_dim/2.
    cos, sin = angles[5].cos(), angles[5].sin()
    x1, x2 = q[2, :, :4], q[2, :, 4:]
    torch.testing.assert_close(q_out[2], torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1))
    # GPT-J: feature 2i pairs with 2i + 1.
    q_j, _ = rotary(positions, q, k, cache, is_neox=False)
    y1, y2 = q[2, :, 0::2], q[2, :, 1::2]
    expected = torch.stack((y1 * cos - y2 * sin, y2 * cos + y1 * sin), -1).flatten(-2)
    torch.testing.assert_close(q_j[2], expected)
    # Rotation keeps each pair's norm.
    torch.testing.assert_close(q_out.norm(dim=-1), q.norm(dim=-1))
    assert k_out.shape == k.shape


# --- the ops that model one transformers layer equal that layer ------------------------------

transformers = pytest.importorskip("transformers")

#: Half-precision comparisons of computations that round differently (float32 inside vs the
#: model's own dtype): the parity harness's tolerances.
_LOOSE = {torch.bfloat16: (1e-2, 1.6e-2), torch.float16: (1e-3, 2e-3)}


def _perturb(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random parameters: an initial weight (zeros for Gemma, ones elsewhere) hides errors."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(0.5 * torch.randn(param.shape, generator=g) + 0.2)
    return module


def _x(*shape: int, dtype: torch.dtype, seed: int = 0, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) + shift).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_rmsnorm_offset_reference_equals_gemmas_rmsnorm(family: str, dtype: torch.dtype) -> None:
    import importlib

    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    norm_class = getattr(modeling, f"{family.capitalize()}RMSNorm")
    norm = _perturb(norm_class(40, eps=1e-6), 1).to(dtype)
    x = _x(3, 7, 40, dtype=dtype)
    with torch.no_grad():
        expected = norm(x)
    actual = reference.rmsnorm_offset(x, norm.weight, norm.eps)
    assert torch.equal(actual, expected)
    # The plain RMSNorm of the same weight is not Gemma's: the offset matters.
    assert not torch.allclose(reference.rmsnorm(x, norm.weight, norm.eps).float(), expected.float())


def _layer_norms() -> list[tuple[str, Any, Any]]:
    """(name, module, (weight, bias, eps) of it) of the LayerNorm kinds transformers uses."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    torch_ln = _perturb(torch.nn.LayerNorm(48, eps=1e-5), 2)  # GPT-NeoX, Phi
    cohere = _perturb(CohereLayerNorm(48, eps=1e-5), 3)
    olmo = OlmoLayerNorm(48)
    return [
        ("nn.LayerNorm", torch_ln, lambda m: (m.weight, m.bias, m.eps)),
        ("CohereLayerNorm", cohere, lambda m: (m.weight, None, m.variance_epsilon)),
        ("OlmoLayerNorm", olmo, lambda m: (None, None, 1e-5)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layernorm_reference_equals_transformers_layer_norms(dtype: torch.dtype) -> None:
    from kernreg_ops import _aten

    x = _x(5, 9, 48, dtype=dtype, shift=2.0)
    for name, module, params in _layer_norms():
        module = module.to(dtype) if name != "CohereLayerNorm" else module
        with torch.no_grad():
            expected = module(x)
        actual = reference.layernorm(x, *params(module))
        assert actual.dtype == expected.dtype == dtype
        # Every one computes in float32 and rounds once; the fused kernel sums in its own
        # order, so float32 agrees to its rounding and half precision to one unit.
        if dtype == torch.float32:
            torch.testing.assert_close(actual, expected, rtol=2e-6, atol=2e-6, msg=name)
        else:
            ulp = torch.finfo(dtype).eps * expected.float().abs().clamp_min(1.0)
            assert bool(((actual.float() - expected.float()).abs() <= ulp).all()), name
        aten = _aten.layernorm(x, *params(module))
        assert aten.dtype == dtype
        if name == "nn.LayerNorm":  # the aten implementation is what nn.LayerNorm runs
            assert torch.equal(aten, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gelu_tanh_mul_reference_equals_gemmas_mlp(dtype: torch.dtype) -> None:
    from transformers.models.gemma.configuration_gemma import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    config = GemmaConfig(hidden_size=32, intermediate_size=48, hidden_act="gelu_pytorch_tanh")
    mlp = _perturb(GemmaMLP(config), 4).to(dtype)
    x = _x(2, 5, 32, dtype=dtype)
    with torch.no_grad():
        expected = mlp(x)
        actual = mlp.down_proj(reference.gelu_tanh_mul(mlp.gate_proj(x), mlp.up_proj(x)))
    assert torch.equal(actual, expected)


def _cos_sin(rotary: Any, x: torch.Tensor, positions: torch.Tensor) -> tuple[Any, Any]:
    with torch.no_grad():
        return rotary(x, positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["gpt_neox", "phi3"])
def test_partial_rotary_reference_equals_transformers(family: str, dtype: torch.dtype) -> None:
    import importlib

    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    q = _x(2, 4, 7, 32, dtype=dtype, seed=1)
    k = _x(2, 2, 7, 32, dtype=dtype, seed=2)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 9, 27, 81, 100, 200, 500]])
    angles = positions[..., None].float() * (1.0 / 10000 ** (torch.arange(0, 12, 2) / 12.0))
    emb = torch.cat((angles, angles), dim=-1)  # 12 of 32 features rotate
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    expected = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    actual = reference.rotary_cos_sin(q, k, cos, sin)
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype == dtype
        assert torch.equal(a[..., 12:], e[..., 12:])  # passed through untouched
        if dtype == torch.float32:
            assert torch.equal(a, e)
        else:  # the model rounds each product in its dtype; the reference rounds once
            atol, rtol = _LOOSE[dtype]
            torch.testing.assert_close(a, e, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_interleaved_rotary_reference_equals_coheres(dtype: torch.dtype) -> None:
    from transformers.models.cohere.configuration_cohere import CohereConfig
    from transformers.models.cohere.modeling_cohere import (
        CohereRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = CohereConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    rotary_embedding = CohereRotaryEmbedding(config)
    q = _x(2, 4, 6, 16, dtype=dtype, seed=1)
    k = _x(2, 2, 6, 16, dtype=dtype, seed=2)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 70, 700, 1000, 1500, 2047]])
    cos, sin = _cos_sin(rotary_embedding, q, positions)
    expected = apply_rotary_pos_emb(q, k, cos, sin)
    actual = reference.rotary_cos_sin_interleaved(q, k, cos, sin)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)
    # The half-split rotary of the same inputs is not Cohere's.
    half = reference.rotary_cos_sin(q, k, cos, sin)
    assert not torch.allclose(half[0].float(), expected[0].float(), atol=1e-2)


def _moe_config(family: str, act: str) -> Any:
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = {"hidden_size": 32, "num_experts_per_tok": 2, "hidden_act": act}
    if family == "mixtral":
        config = MixtralConfig(intermediate_size=24, num_local_experts=5, **common)
    elif family == "qwen2_moe":
        config = Qwen2MoeConfig(moe_intermediate_size=24, num_experts=5, **common)
    else:
        config = Qwen3MoeConfig(moe_intermediate_size=24, num_experts=5, **common)
    return config


_ACT_NAMES = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("family", "act"),
    [
        *(("mixtral", act) for act in sorted(_ACT_NAMES)),
        ("qwen2_moe", "silu"),
        ("qwen3_moe", "silu"),
    ],
)
def test_experts_reference_equals_transformers_experts(
    family: str, act: str, dtype: torch.dtype
) -> None:
    import importlib

    from kernreg_ops import _native

    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    prefix = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe"}[family]
    config = _moe_config(family, act)
    experts = _perturb(getattr(modeling, f"{prefix}Experts")(config), 5).to(dtype)
    router = _perturb(getattr(modeling, f"{prefix}TopKRouter")(config), 6).to(dtype)
    hidden = _x(11, 32, dtype=dtype, seed=3)
    with torch.no_grad():
        _, weights, index = router(hidden)
        args = (hidden, index, weights, experts.gate_up_proj, experts.down_proj, _ACT_NAMES[act])
        ours = reference.experts(*args)
        # The native implementation batches per expert, in the reference's order.
        assert torch.equal(_native.experts(*args), ours)
        # transformers' default (what a model built from its config runs): the experts'
        # weighted outputs summed in float32, rounded once, as the reference does.
        config._experts_implementation = "grouped_mm"
        grouped = experts(hidden, index, weights)
        # The eager loop rounds its running sum after each expert.
        config._experts_implementation = "eager"
        eager = experts(hidden, index, weights)
    if dtype == torch.float32:  # grouped_mm multiplies through another GEMM path
        torch.testing.assert_close(ours, grouped, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours, eager, rtol=1e-6, atol=1e-6)
    else:  # one rounding of the dtype at most, where the float32 sums' orders differ
        ulp = torch.finfo(dtype).eps * grouped.float().abs().clamp_min(2**-6)
        assert bool(((ours.float() - grouped.float()).abs() <= ulp).all())


def test_experts_skip_the_no_expert_id_and_refuse_others() -> None:
    from kernreg_ops import _native

    (x, index, weights, gate_up, down), _ = _inputs.experts(torch.float32, torch.device("cpu"), 0)
    num_experts = gate_up.shape[0]
    routed = index.clone()
    routed[:, 1] = num_experts  # every token's second slot goes nowhere
    one_slot = reference.experts(x, routed[:, :1], weights[:, :1], gate_up, down)
    for impl in (reference.experts, _native.experts):
        torch.testing.assert_close(impl(x, routed, weights, gate_up, down), one_slot)
    bad = index.clone()
    bad[0, 0] = num_experts + 1
    with pytest.raises(ValueError, match=r"top_k_index holds expert 7, but there are 6 experts"):
        _native.experts(x, bad, weights, gate_up, down)
    with pytest.raises(ValueError, match=r"act must be one of 'silu', 'gelu', 'gelu_tanh', not"):
        reference.experts(x, index, weights, gate_up, down, act="relu")
    with pytest.raises(ValueError, match="act must be one of"):
        _native.experts(x, index, weights, gate_up, down, act="swish")
    # No tokens: an empty result of the right shape.
    empty = x[:0]
    for impl in (reference.experts, _native.experts):
        out = impl(empty, index[:0], weights[:0], gate_up, down)
        assert out.shape == (0, x.shape[1])


def test_experts_take_int32_expert_ids_and_refuse_bad_ids_alike() -> None:
    # vLLM's and sglang's routers give int32 ids: the native implementation took them and
    # the reference (the fallback, and the oracle) raised one_hot's RuntimeError; an id
    # out of range was a ValueError from one and a RuntimeError from the other.
    from kernreg_ops import _native

    (x, index, weights, gate_up, down), _ = _inputs.experts(torch.float32, torch.device("cpu"), 0)
    expected = reference.experts(x, index, weights, gate_up, down)
    for impl in (reference.experts, _native.experts):
        torch.testing.assert_close(impl(x, index.int(), weights, gate_up, down), expected)
    for bad_id in (-1, 7):
        bad = index.clone()
        bad[0, 0] = bad_id
        for impl in (reference.experts, _native.experts):
            with pytest.raises(ValueError, match=rf"top_k_index holds expert {bad_id}, but there"):
                impl(x, bad, weights, gate_up, down)
    for impl in (reference.experts, _native.experts):
        with pytest.raises(ValueError, match="top_k_index must be an integer tensor"):
            impl(x, index.float(), weights, gate_up, down)


def test_experts_native_gradients_equal_the_reference() -> None:
    from kernreg_ops import _native

    (x, index, weights, gate_up, down), _ = _inputs.experts(torch.float32, torch.device("cpu"), 1)
    grads = []
    for impl in (reference.experts, _native.experts):
        leaves = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
        out = impl(leaves[0], index, leaves[1], leaves[2], leaves[3])
        out.pow(2).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_the_new_ops_dispatch_to_the_cpu_implementations() -> None:
    from kernreg_ops import ops

    chosen = {
        "rmsnorm_offset": "native",
        "layernorm": "aten",
        "gelu_tanh_mul": "native",
        "rotary_cos_sin_interleaved": "native",
        "experts": "native",
    }
    for name, backend in chosen.items():
        for dtype in ("float32", "bfloat16", "float16", "float64"):
            assert getattr(ops, name).select(dtypes=[dtype]).backend == backend, (name, dtype)
    x = _x(4, 16, dtype=torch.bfloat16)
    w = _x(16, dtype=torch.bfloat16, seed=1)
    assert torch.equal(ops.rmsnorm_offset(x, w), reference.rmsnorm_offset(x, w))
    assert ops.layernorm(x, w, None).dtype == torch.bfloat16
    assert ops.layernorm(x, None).shape == x.shape

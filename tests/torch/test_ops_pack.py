"""The op pack: its inventory, its real entry point, and the contracts of its ops."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
kernreg_ops = pytest.importorskip("kernreg_ops")

import kernreg  # noqa: E402
from kernreg import Config, KernelRegistry, Platform  # noqa: E402
from kernreg._packages import missing_reason  # noqa: E402
from kernreg.selection import decide  # noqa: E402
from kernreg_ops import _plugin, reference  # noqa: E402
from kernreg_ops.ops import (  # noqa: E402
    fused_add_rmsnorm,
    gelu_and_mul,
    rmsnorm,
    rotary,
    silu_and_mul,
)

OPS = (
    "activation.gelu_and_mul",
    "activation.silu_and_mul",
    "activation.silu_mul",
    "embedding.rotary",
    "embedding.rotary_cos_sin",
    "layernorm.add_rmsnorm",
    "layernorm.fused_add_rmsnorm",
    "layernorm.rmsnorm",
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
    assert out.stdout.strip() == "31"


INVENTORY = {
    # op: {backend: priority}
    "layernorm.rmsnorm": {"triton": 30, "aten": 20, "torch_compile": 10, "torch": 0},
    "layernorm.fused_add_rmsnorm": {"triton": 30, "native": 15, "torch_compile": 10, "torch": 0},
    "activation.silu_and_mul": {"triton": 30, "native": 15, "torch_compile": 10, "torch": 0},
    "activation.gelu_and_mul": {"triton": 30, "native": 15, "torch_compile": 10, "torch": 0},
    "embedding.rotary": {"triton": 30, "torch_compile": 10, "torch": 0},
    "layernorm.add_rmsnorm": {"triton": 30, "native": 15, "torch_compile": 10, "torch": 0},
    "activation.silu_mul": {"triton": 30, "native": 15, "torch_compile": 10, "torch": 0},
    "embedding.rotary_cos_sin": {"triton": 30, "native": 15, "torch_compile": 10, "torch": 0},
}


@pytest.mark.parametrize("op", sorted(INVENTORY))
def test_inventory(op: str) -> None:
    specs = {s.backend: s for s in kernreg.registry.get(op)}
    assert {b: s.priority for b, s in specs.items()} == INVENTORY[op]
    assert specs["torch"].reference
    if "triton" in specs:
        triton = specs["triton"]
        assert [str(r) for r in triton.requires] == ["cuda>=8.0"]
        assert triton.dtypes == {"float16", "bfloat16", "float32"}
        assert triton.packages == {"triton>=2.1"}
    if "native" in specs:
        assert [str(r) for r in specs["native"].requires] == ["cpu"]
    assert specs["torch_compile"].when == "kernreg_ops._policy:compile_allowed"
    inplace = op == "layernorm.fused_add_rmsnorm"
    assert all(("inplace" in s.traits) == inplace for s in specs.values())


def _pack_registry(platform: str) -> KernelRegistry:
    registry = KernelRegistry(config=Config(), platform=Platform.parse(platform))
    _plugin.register(registry)
    return registry


def test_explain_on_hopper_says_why_triton_is_chosen_or_not() -> None:
    decision = _pack_registry("cuda:9.0").explain("layernorm.rmsnorm", dtypes=["bfloat16"])
    assert decision.chosen is not None
    triton = decision.candidate("triton")
    if missing_reason("triton>=2.1") is None:  # the test install has triton
        assert decision.chosen.backend == "triton"
        assert triton.status == "chosen"
        return
    assert decision.chosen.backend == "aten"
    assert triton.status == "rejected"
    assert triton.reasons == ("package triton is not installed (needs triton>=2.1)",)


def test_triton_is_chosen_on_hopper_when_installed() -> None:
    specs = _pack_registry("cuda:9.0").get("layernorm.rmsnorm")
    decision = decide(
        "layernorm.rmsnorm",
        specs,
        platform=Platform.parse("cuda:9.0"),
        config=Config(),
        dtypes=("bfloat16",),
        packages_reason=lambda requirement: None,  # as if triton were installed
    )
    assert decision.chosen is not None
    assert decision.chosen.backend == "triton"
    older = decide(
        "layernorm.rmsnorm",
        specs,
        platform=Platform.parse("cuda:7.5"),
        config=Config(),
        dtypes=("bfloat16",),
        packages_reason=lambda requirement: None,
    )
    assert older.chosen is not None
    assert older.chosen.backend == "aten"


def test_compiled_implementations_are_opt_in() -> None:
    registry = _pack_registry("cuda:7.5")  # no native (CPU) implementation, no triton
    decision = registry.explain("activation.silu_and_mul", dtypes=["float32"])
    assert decision.chosen is not None
    assert decision.chosen.backend == "torch"
    assert decision.candidate("torch_compile").reasons == (
        "when predicate is false (process state, checked when deciding)",
    )
    assert not decision.conditional  # decided now, never per call
    with kernreg_ops.allow_compile():
        chosen = registry.explain("activation.silu_and_mul", dtypes=["float32"]).chosen
        assert chosen is not None
        assert chosen.backend == "torch_compile"
    assert not kernreg_ops.compile_allowed()
    assert registry.explain("activation.silu_and_mul", dtypes=["float32"]).chosen.backend == "torch"


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

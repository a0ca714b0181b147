"""Layer mappings of the pack for transformers' Llama family (no transformers import).

``kernreg.torch.kernelize(model)`` routes these layers through the pack's ops, weights
untouched (the checkpoint keys stay the same):

* ``*RMSNorm`` -> ``layernorm.rmsnorm(hidden_states, weight, variance_epsilon)``;
* ``*MLP`` (SiLU-gated) -> ``down_proj(activation.silu_mul(gate_proj(x), up_proj(x)))``;
* the modeling module's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (a
  function the attention calls, not a layer) -> ``embedding.rotary_cos_sin``, same
  arguments (a function mapping: kernelize swaps the module global while in use).
"""

from __future__ import annotations

from typing import Any

__all__ = ["FAMILIES", "mlp_applies", "mlp_args", "mlp_output", "register_layers", "rmsnorm_args"]

#: transformers model families whose RMSNorm and gated MLP the pack maps.
FAMILIES: dict[str, str] = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}

_SILU = frozenset({"SiLU", "SiLUActivation"})


def rmsnorm_args(module: Any, hidden_states: Any) -> tuple[Any, ...]:
    """``(x, weight, eps)`` of an RMSNorm layer."""
    return (hidden_states, module.weight, module.variance_epsilon)


def mlp_args(module: Any, x: Any) -> tuple[Any, ...]:
    """``(gate, up)`` of a gated MLP: its two projections of ``x``."""
    return (module.gate_proj(x), module.up_proj(x))


def mlp_output(module: Any, result: Any, x: Any) -> Any:
    """The MLP's output: its down projection of ``silu(gate) * up``."""
    return module.down_proj(result)


def mlp_applies(module: Any) -> str | None:
    """``None`` for a SiLU-gated MLP, else why the mapping does not fit it."""
    name = type(getattr(module, "act_fn", None)).__name__
    if name not in _SILU:
        return f"activation is {name}, not SiLU"
    return None


def register_layers() -> None:
    """Register the mappings (target strings only: nothing is imported)."""
    from kernreg.torch.layers import register_function, register_layer

    for package, prefix in FAMILIES.items():
        module = f"transformers.models.{package}.modeling_{package}"
        register_layer(
            f"{module}:{prefix}RMSNorm",
            op="layernorm.rmsnorm",
            args="kernreg_ops._layers:rmsnorm_args",
            description="RMSNorm over the last dimension",
        )
        register_layer(
            f"{module}:{prefix}MLP",
            op="activation.silu_mul",
            args="kernreg_ops._layers:mlp_args",
            output="kernreg_ops._layers:mlp_output",
            applies="kernreg_ops._layers:mlp_applies",
            description="gated MLP: down(silu(gate(x)) * up(x)), weights unfused",
        )
        register_function(
            f"{module}:apply_rotary_pos_emb",
            op="embedding.rotary_cos_sin",
            description="rotary embedding of q and k, [batch, heads, seq, dim] with cos/sin",
        )

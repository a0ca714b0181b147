"""Layer mappings of the pack for transformers models (no transformers import).

``kernreg.torch.kernelize(model)`` routes these layers through the pack's ops, weights
untouched (the checkpoint keys stay the same). Each known family has exact mappings
(:data:`FAMILIES`); any other family of ``transformers.models``, or loaded with
``trust_remote_code`` (``transformers_modules``), is served by the pattern mappings below
when its layers look alike, and ``kernelize``'s verification rejects those that only look
alike:

==========================================  ==============================================
layer (class or function)                   op
==========================================  ==============================================
``*RMSNorm``                                ``layernorm.rmsnorm`` (``x * w``) or
                                            ``layernorm.rmsnorm_offset`` (``x * (1 + w)``)
``*LayerNorm``, ``torch.nn.LayerNorm``      ``layernorm.layernorm``, or (``*LayerNorm``
                                            of T5 and its kin, an RMSNorm by another
                                            name) ``layernorm.rmsnorm``
``*MLP``: gate/up/down projections          ``activation.silu_mul`` (SiLU) or
                                            ``activation.gelu_tanh_mul`` (GELU-tanh)
``*MLP``: fused ``gate_up_proj``            ``activation.silu_and_mul``
``*Experts`` (Mixtral, Qwen-MoE)            ``moe.experts``
``apply_rotary_pos_emb``                    ``embedding.rotary_cos_sin`` (halves, partial
                                            rotary included) or
                                            ``embedding.rotary_cos_sin_interleaved``
==========================================  ==============================================

The rotary function is called by the attention modules of a model: ``kernelize`` routes
it for that model only.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "FAMILIES",
    "experts_applies",
    "experts_args",
    "experts_probe",
    "fused_mlp_applies",
    "fused_mlp_args",
    "gelu_tanh_mlp_applies",
    "layernorm_applies",
    "layernorm_args",
    "mlp_applies",
    "mlp_args",
    "mlp_output",
    "norm_args",
    "register_layers",
    "rmsnorm_applies",
    "rmsnorm_args",
    "rmsnorm_eps_args",
    "rotary_output_in_input_dtype",
    "rotary_probe",
]

#: family (the ``transformers.models`` package) -> (class prefix, norm op, MLP form,
#: rotary op); ``None``: the family has no such layer the pack serves.
FAMILIES: dict[str, tuple[str, str | None, str | None, str | None]] = {
    "llama": ("Llama", "layernorm.rmsnorm", "silu", "embedding.rotary_cos_sin"),
    "qwen2": ("Qwen2", "layernorm.rmsnorm", "silu", "embedding.rotary_cos_sin"),
    "mistral": ("Mistral", "layernorm.rmsnorm", "silu", "embedding.rotary_cos_sin"),
    "qwen3": ("Qwen3", "layernorm.rmsnorm", "silu", "embedding.rotary_cos_sin"),
    "qwen3_moe": ("Qwen3Moe", "layernorm.rmsnorm", "experts", "embedding.rotary_cos_sin"),
    "mixtral": ("Mixtral", "layernorm.rmsnorm", "experts", "embedding.rotary_cos_sin"),
    "olmo2": ("Olmo2", "layernorm.rmsnorm", "silu", "embedding.rotary_cos_sin"),
    "granite": ("Granite", "layernorm.rmsnorm", "silu", "embedding.rotary_cos_sin"),
    "phi3": ("Phi3", "layernorm.rmsnorm", "fused", "embedding.rotary_cos_sin"),
    "gemma": ("Gemma", "layernorm.rmsnorm_offset", "gelu_tanh", "embedding.rotary_cos_sin"),
    "gemma2": ("Gemma2", "layernorm.rmsnorm_offset", "gelu_tanh", "embedding.rotary_cos_sin"),
    "gemma3": ("Gemma3", "layernorm.rmsnorm_offset", "gelu_tanh", "embedding.rotary_cos_sin"),
    "cohere": (
        "Cohere",
        "layernorm.layernorm",
        "silu",
        "embedding.rotary_cos_sin_interleaved",
    ),
    "gpt_neox": ("GPTNeoX", None, None, "embedding.rotary_cos_sin"),
    "phi": ("Phi", None, None, "embedding.rotary_cos_sin"),
}

_SILU = frozenset({"SiLU", "SiLUActivation"})
_GELU_TANH = frozenset({"GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh"})
_ACT_NAMES = {"SiLU": "silu", "SiLUActivation": "silu", "GELUActivation": "gelu", "GELU": "gelu"}
_ACT_NAMES.update(dict.fromkeys(_GELU_TANH, "gelu_tanh"))
_HERE = "kernreg_ops._layers"
#: the attributes an MLP or experts module keeps its activation layer in
_ACT_ATTRIBUTES = ("act_fn", "activation_fn")


def _eps(module: Any) -> Any:
    eps = getattr(module, "variance_epsilon", None)
    return module.eps if eps is None else eps


# The argument maps are one ``return (...)`` each: kernelize compiles that expression into
# the routed forward (no call of the map per forward), so each family's map names its
# norm's epsilon attribute directly.
def rmsnorm_args(module: Any, hidden_states: Any) -> tuple[Any, ...]:
    """``(x, weight, eps)`` of an RMSNorm layer keeping its epsilon as ``variance_epsilon``
    (Llama and most families)."""
    return (hidden_states, module.weight, module.variance_epsilon)


def rmsnorm_eps_args(module: Any, x: Any) -> tuple[Any, ...]:
    """``(x, weight, eps)`` of an RMSNorm layer keeping its epsilon as ``eps`` (Gemma)."""
    return (x, module.weight, module.eps)


def norm_args(module: Any, hidden_states: Any) -> tuple[Any, ...]:
    """``(x, weight, eps)`` of any RMSNorm layer (``variance_epsilon`` or ``eps``)."""
    return (hidden_states, module.weight, _eps(module))


def rmsnorm_applies(module: Any) -> str | None:
    """``None`` for a norm with a 1-D weight and an epsilon, else why not."""
    weight = _attribute(module, "weight")
    if weight is None or getattr(weight, "dim", lambda: 0)() != 1:
        return "no 1-D weight"
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module, "eps", None)
    if not isinstance(eps, float):
        return "no float epsilon (variance_epsilon or eps)"
    return None


def layernorm_args(module: Any, hidden_states: Any) -> tuple[Any, ...]:
    """``(x, weight, bias, eps)`` of a LayerNorm (``bias`` may be ``None``)."""
    return (hidden_states, module.weight, getattr(module, "bias", None), _eps(module))


def layernorm_applies(module: Any) -> str | None:
    """``None`` for an affine LayerNorm over the last dimension, else why not."""
    shape = getattr(module, "normalized_shape", None)
    if shape is not None and len(shape) != 1:
        return f"normalizes over {len(shape)} dimensions, not the last one"
    return rmsnorm_applies(module)


def mlp_args(module: Any, x: Any) -> tuple[Any, ...]:
    """``(gate, up)`` of a gated MLP: its two projections of ``x``."""
    return (module.gate_proj(x), module.up_proj(x))


def mlp_output(module: Any, result: Any, x: Any) -> Any:
    """The MLP's output: its down projection of ``act(gate) * up``."""
    return module.down_proj(result)


def _attribute(module: Any, name: str) -> Any:
    """``getattr(module, name, None)``, a submodule or parameter read from its table first (an
    ``nn.Module``'s ``__getattr__`` costs about 0.5 µs, a third of kernelize's time on an
    MLP's mapping)."""
    try:
        found = module._modules.get(name)
        if found is None:
            found = module._parameters.get(name)
    except AttributeError:  # not an nn.Module
        found = None
    return getattr(module, name, None) if found is None else found


def _activation(module: Any) -> str:
    act = _attribute(module, "act_fn")
    if act is None:
        act = _attribute(module, "activation_fn")
    return type(act).__name__


def _gated(module: Any) -> str | None:
    for name in ("gate_proj", "up_proj", "down_proj"):
        if _attribute(module, name) is None:
            return "not a gated MLP with gate_proj, up_proj and down_proj"
    return None


def mlp_applies(module: Any) -> str | None:
    """``None`` for a SiLU-gated MLP, else why the mapping does not fit it."""
    name = _activation(module)
    return _gated(module) or (None if name in _SILU else f"activation is {name}, not SiLU")


def gelu_tanh_mlp_applies(module: Any) -> str | None:
    """``None`` for a GELU(tanh)-gated MLP, else why not."""
    name = _activation(module)
    if name in _GELU_TANH:
        return _gated(module)
    return _gated(module) or f"activation is {name}, not GELU (tanh approximation)"


def fused_mlp_args(module: Any, hidden_states: Any) -> tuple[Any, ...]:
    """``(gate_up,)`` of an MLP whose gate and up projections are one ``gate_up_proj``."""
    return (module.gate_up_proj(hidden_states),)


def fused_mlp_applies(module: Any) -> str | None:
    """``None`` for a SiLU MLP with a fused ``gate_up_proj``, else why not."""
    if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj")):
        return "no fused gate_up_proj and down_proj"
    name = _activation(module)
    return None if name in _SILU else f"activation is {name}, not SiLU"


def _experts_act(module: Any) -> str | None:
    """The ``act`` of ``moe.experts`` the experts' activation computes, ``None`` if none:
    ``torch.nn.GELU`` is the tanh approximation when its ``approximate`` says so."""
    act = _attribute(module, "act_fn")
    if act is None:
        act = _attribute(module, "activation_fn")
    name = _ACT_NAMES.get(type(act).__name__)
    if name == "gelu" and getattr(act, "approximate", "none") != "none":
        return "gelu_tanh" if act.approximate == "tanh" else None
    return name


def experts_args(
    module: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any
) -> tuple[Any, ...]:
    """``moe.experts``' arguments from an experts module and its forward's."""
    act = _experts_act(module) or "silu"
    return (
        hidden_states,
        top_k_index,
        top_k_weights,
        module.gate_up_proj,
        module.down_proj,
        act,
    )


def experts_applies(module: Any) -> str | None:
    """``None`` for experts stored as ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj``
    ``[E, H, I]`` without biases, with a known activation; else why not."""
    gate_up: Any = getattr(module, "gate_up_proj", None)
    down: Any = getattr(module, "down_proj", None)
    if getattr(gate_up, "dim", lambda: 0)() != 3 or getattr(down, "dim", lambda: 0)() != 3:
        return "no 3-D gate_up_proj and down_proj expert weights"
    (experts, two_inter, hidden), (down_experts, down_hidden, inter) = gate_up.shape, down.shape
    if (down_experts, down_hidden, 2 * inter) != (experts, hidden, two_inter):
        return (
            f"gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} are not "
            "[experts, 2 * intermediate, hidden] and [experts, hidden, intermediate]"
        )
    if getattr(module, "gate_up_proj_bias", None) is not None:
        return "expert projections have biases"
    # A layer of the experts' own beyond the activation (MuseSpark's post_expert_norm) is
    # part of their computation: moe.experts computes none.
    children = module.named_children() if hasattr(module, "named_children") else ()
    others = [name for name, _ in children if name not in _ACT_ATTRIBUTES]
    if others:
        return f"the experts also run {', '.join(map(repr, others))}, which moe.experts does not"
    if _experts_act(module) is None:
        return f"activation is {_activation(module)}, not one moe.experts knows"
    return None


def experts_probe(module: Any, seq_len: int, dtype: Any, device: Any) -> Any:
    """``(hidden_states, top_k_index, top_k_weights)`` for ``2 * seq_len`` tokens routed
    to two distinct experts each."""
    import torch

    experts, _, hidden = module.gate_up_proj.shape
    tokens = 2 * seq_len
    generator = torch.Generator().manual_seed(seq_len)
    x = torch.randn(tokens, hidden, generator=generator)
    scores = torch.randn(tokens, experts, generator=generator)
    weights, index = torch.topk(scores.softmax(-1), min(2, experts), dim=-1)
    return (x.to(device=device, dtype=dtype), index.to(device), weights.to(device, dtype)), {}


def rotary_probe(model: Any, function: Any, seq_len: int, dtype: Any, device: Any) -> Any:
    """``(q, k, cos, sin)`` as a transformers attention calls ``apply_rotary_pos_emb``:
    ``cos``/``sin`` from the model's own rotary embedding module; ``q``/``k`` of the full
    head dim when ``function`` rotates a leading part itself (GPT-NeoX), else of the rotated
    part only (Phi's attention splits it off before the call). ``None`` when the model has
    no rotary embedding module (or its config gives no head count)."""
    import torch

    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not heads or not hidden:
        return None
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    rotary = next(
        (m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None
    )
    if rotary is None:
        return None
    generator = torch.Generator().manual_seed(seq_len)
    x = torch.randn(2, seq_len, hidden, generator=generator).to(device=device, dtype=dtype)
    positions = torch.arange(seq_len, device=device).unsqueeze(0).expand(2, -1)
    try:
        cos, sin = rotary(x, positions)
    except TypeError:  # Gemma 3: one rotary per layer type
        layer_types = getattr(config, "layer_types", None) or ("full_attention",)
        cos, sin = rotary(x, positions, layer_types[0])
    q = torch.randn(2, heads, seq_len, head_dim, generator=generator).to(device, dtype)
    k = torch.randn(2, kv_heads, seq_len, head_dim, generator=generator).to(device, dtype)
    if cos.shape[-1] < head_dim:
        try:
            function(q, k, cos, sin)
        except RuntimeError:  # shapes do not broadcast: the caller passes the part only
            q, k = q[..., : cos.shape[-1]].contiguous(), k[..., : cos.shape[-1]].contiguous()
    return (q, k, cos, sin), {}


def rotary_output_in_input_dtype(result: Any, q: Any, k: Any, *args: Any, **kwargs: Any) -> Any:
    """``(q_embed, k_embed)`` rounded to ``q``'s and ``k``'s dtypes (OLMo2's rotary computes
    in the promoted dtype of ``q`` and ``cos``, then casts back)."""
    q_embed, k_embed = result
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


def _norm(layer: str, op: str, args: str = "norm_args") -> dict[str, Any]:
    if op == "layernorm.layernorm":
        hooks = {"args": f"{_HERE}:layernorm_args", "applies": f"{_HERE}:layernorm_applies"}
        description = "LayerNorm over the last dimension"
    else:
        hooks = {"args": f"{_HERE}:{args}", "applies": f"{_HERE}:rmsnorm_applies"}
        description = (
            "RMSNorm with a weight offset: x * (1 + w)"
            if op.endswith("_offset")
            else "RMSNorm over the last dimension"
        )
    return {"layer": layer, "op": op, "description": description, **hooks}


def _mlp(layer: str, form: str) -> dict[str, Any]:
    if form == "fused":
        return {
            "layer": layer,
            "op": "activation.silu_and_mul",
            "args": f"{_HERE}:fused_mlp_args",
            "output": f"{_HERE}:mlp_output",
            "applies": f"{_HERE}:fused_mlp_applies",
            "description": "gated MLP with a fused gate_up_proj: down(silu(gate) * up)",
        }
    if form == "experts":
        return {
            "layer": layer,
            "op": "moe.experts",
            "args": f"{_HERE}:experts_args",
            "applies": f"{_HERE}:experts_applies",
            "probe": f"{_HERE}:experts_probe",
            "description": "MoE experts: each token through its top-k gated MLPs, weighted",
        }
    op, applies, act = {
        "silu": ("activation.silu_mul", "mlp_applies", "silu"),
        "gelu_tanh": ("activation.gelu_tanh_mul", "gelu_tanh_mlp_applies", "gelu_tanh"),
    }[form]
    return {
        "layer": layer,
        "op": op,
        "args": f"{_HERE}:mlp_args",
        "output": f"{_HERE}:mlp_output",
        "applies": f"{_HERE}:{applies}",
        "description": f"gated MLP: down({act}(gate(x)) * up(x)), weights unfused",
    }


def _rotary(function: str, op: str) -> dict[str, Any]:
    convention = "interleaved pairs" if op.endswith("_interleaved") else "halves"
    mapping = {
        "function": function,
        "op": op,
        "probe": f"{_HERE}:rotary_probe",
        "description": f"rotary embedding of q and k ({convention}) with cos/sin, "
        "[batch, heads, seq, dim]",
    }
    if function.endswith("modeling_olmo2:apply_rotary_pos_emb"):
        mapping["output"] = f"{_HERE}:rotary_output_in_input_dtype"
        mapping["description"] += ", results cast back to the inputs' dtypes"
    return mapping


def register_layers() -> None:
    """Register the mappings (target strings only: nothing is imported)."""
    from kernreg.torch.layers import register_function, register_layer

    for package, (prefix, norm, mlp, rotary) in FAMILIES.items():
        module = f"transformers.models.{package}.modeling_{package}"
        if norm is not None:
            kind = "LayerNorm" if norm == "layernorm.layernorm" else "RMSNorm"
            # Gemma's norms keep their epsilon as `eps`, the others' as `variance_epsilon`.
            args = "rmsnorm_eps_args" if prefix.startswith("Gemma") else "rmsnorm_args"
            register_layer(**_norm(f"{module}:{prefix}{kind}", norm, args))
        if mlp == "experts":
            register_layer(**_mlp(f"{module}:{prefix}Experts", mlp))
        elif mlp is not None:
            register_layer(**_mlp(f"{module}:{prefix}MLP", mlp))
        if rotary is not None:
            register_function(**_rotary(f"{module}:apply_rotary_pos_emb", rotary))
    register_layer(**_norm("torch.nn.modules.normalization:LayerNorm", "layernorm.layernorm"))
    # Any other family, of transformers or loaded with trust_remote_code (its modeling
    # files are imported as `transformers_modules.*`): the pattern mappings, verification
    # deciding.
    for models in ("transformers.models.*", "transformers_modules.*"):
        for op in ("layernorm.rmsnorm", "layernorm.rmsnorm_offset"):
            register_layer(**_norm(f"{models}:*RMSNorm", op))
        register_layer(**_norm(f"{models}:*LayerNorm", "layernorm.layernorm"))
        register_layer(**_norm(f"{models}:*LayerNorm", "layernorm.rmsnorm"))  # T5's
        for form in ("silu", "gelu_tanh", "fused"):
            register_layer(**_mlp(f"{models}:*MLP", form))
        register_layer(**_mlp(f"{models}:*Experts", "experts"))
        for op in ("embedding.rotary_cos_sin", "embedding.rotary_cos_sin_interleaved"):
            register_function(**_rotary(f"{models}:apply_rotary_pos_emb", op))

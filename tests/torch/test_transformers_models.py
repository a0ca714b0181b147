"""Real transformers models (tiny configs, random weights) kernelized in one line."""

from __future__ import annotations

import copy
import gc
import importlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kernreg_ops")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    transformers = pytest.importorskip("transformers")

from _support import routed_forward  # noqa: E402
from kernreg.torch import kernelize, unkernelize  # noqa: E402
from kernreg.torch.kernelize import KernelizeWarning  # noqa: E402

VOCAB = 96

#: family -> (config class, model class, config fields beyond the common ones); tiny
#: configs, random weights, nothing downloaded
_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"pad_token_id": 0}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"pad_token_id": 0}),
    # Partial rotary: a quarter (GPT-NeoX) and a half (Phi) of the head dim rotates.
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.5}),
    "phi": ("PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5}),
}
FAMILIES = sorted(_FAMILIES)
#: the first families kernreg served: a spy on their SiLU MLPs sees every call
SILU_FAMILIES = ["llama", "mistral", "qwen2"]
#: ten families, every op and layout among them (torch.compile costs seconds per model)
COMPILE_FAMILIES = [
    "cohere",
    "gemma",
    "gemma3",
    "gpt_neox",
    "granite",
    "llama",
    "olmo2",
    "phi",
    "phi3",
    "qwen3_moe",
]


def _config(family: str) -> Any:
    config_class, _, extra = _FAMILIES[family]
    fields: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        **extra,
    }
    if family == "gpt_neox":
        del fields["num_key_value_heads"]
    return getattr(transformers, config_class)(**fields)


def _model(family: str, dtype: Any = None) -> Any:
    """A tiny random model, its norm weights perturbed (a zero offset weight would hide
    the difference between ``x * w`` and Gemma's ``x * (1 + w)``)."""
    torch.manual_seed(0)
    model = getattr(transformers, _FAMILIES[family][1])(_config(family)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter) * 0.5)
    return model if dtype is None else model.to(dtype)


def _ids(batch: int = 2, seq: int = 9) -> Any:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


#: family -> the activation layer transformers tags that no pack op serves (a plain MLP's)
_UNMAPPED = {"gpt_neox": "GELUActivation", "phi": "NewGELUActivation"}


def _kernelize(model: Any, family: str, mode: str = "inference") -> Any:
    """``kernelize(model, mode=mode)``, expecting the warning for the layers left out."""
    unmapped = _UNMAPPED.get(family)
    if mode == "compile" and family in ("mixtral", "qwen3_moe"):
        unmapped = "SiLUActivation"  # the experts have no compile-safe implementation
    if unmapped is None:
        return kernelize(model, mode=mode)
    with pytest.warns(KernelizeWarning, match=f"{unmapped} looks like a"):
        report = kernelize(model, mode=mode)
    assert [u.layer.rpartition(":")[2] for u in report.unmapped] == [unmapped]
    return report


def _rotary_site(model: Any) -> str:
    """The report row of the modeling module's rotary function."""
    return f"{type(model).__module__}:apply_rotary_pos_emb"


def _expected_paths(model: Any, mode: str = "inference") -> set[str]:
    """What the pack routes: every norm, every gated MLP (GPT-NeoX's and Phi's plain MLPs
    have no op), the experts (no compile-safe implementation yet) and the rotary."""
    paths = {_rotary_site(model)}
    for name, module in model.named_modules():
        kind = type(module).__name__
        if (
            kind.endswith(("RMSNorm", "LayerNorm"))
            or (
                kind.endswith("MLP")
                and any(hasattr(module, g) for g in ("gate_proj", "gate_up_proj"))
            )
            or (kind.endswith("Experts") and mode != "compile")
        ):
            paths.add(name)
    return paths


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap() -> Iterator[None]:
    """What exists before this module's first test (torch, transformers, the modules of
    earlier tests) is left out of its garbage collections: a full collection of that heap
    costs 0.3 s, once per test below; what the tests build is still collected."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _no_routed_functions_left(_frozen_heap: None) -> None:
    """Every test starts with the modeling modules' own functions (earlier models gone)."""
    gc.collect()
    for family in FAMILIES:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        assert not hasattr(module.apply_rotary_pos_emb, "__kernreg_original__")


@pytest.mark.parametrize("family", FAMILIES)
def test_kernelized_model_computes_what_the_unmodified_model_computes(family: str) -> None:
    model = _model(family)
    ids = _ids()
    keys = list(model.state_dict())
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = model(ids).logits
        expected_tokens = model.generate(ids[:1, :5], **kwargs)
    report = _kernelize(model, family)
    assert set(report.routed) == _expected_paths(model)
    assert report.rejected == ()
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(model.generate(ids[:1, :5], **kwargs), expected_tokens)
    assert unkernelize(model) > 0
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "gemma", "qwen3"])
def test_kernelize_again_keeps_what_did_not_change_and_reroutes_what_did(family: str) -> None:
    model = _model(family)
    ids = _ids()
    with torch.no_grad():
        expected = model(ids).logits
    first = kernelize(model, verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left out: no warning the second time
        again = kernelize(model, verify=False)
    assert str(again) == str(first)
    assert again.unmapped == first.unmapped == ()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
    # A module replaced since is routed; a model moved to another dtype is decided again.
    layer = model.model.layers[0]
    layer.mlp = type(layer.mlp)(model.config)
    report = kernelize(model, verify=False)
    assert "model.layers.0.mlp" in report.routed
    assert routed_forward(layer.mlp) is not None
    plain = copy.deepcopy(model)
    unkernelize(plain)
    with torch.no_grad():
        expected = plain(ids).logits
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
    model.to(torch.bfloat16)
    report = kernelize(model)
    assert set(report.routed) == _expected_paths(model)
    assert report.rejected == ()
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), expected, rtol=0.1, atol=0.1)
    assert unkernelize(model) > 0
    assert unkernelize(model) == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_error_is_no_worse_than_the_unmodified_bfloat16_model(family: str) -> None:
    model = _model(family)
    ids = _ids()
    with torch.no_grad():
        exact = model(ids).logits
        model.to(torch.bfloat16)
        unmodified = (model(ids).logits.float() - exact).abs().mean()
        report = _kernelize(model, family)
        assert set(report.routed) == _expected_paths(model)
        kernelized = (model(ids).logits.float() - exact).abs().mean()
    # Within the rounding noise of the unmodified model's own bfloat16 error.
    assert kernelized <= 1.25 * unmodified, (float(kernelized), float(unmodified))


@pytest.mark.parametrize("family", FAMILIES)
def test_training_mode_gradients_match_the_unmodified_model(family: str) -> None:
    model = _model(family).train()
    ids = _ids()
    model(ids).logits.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    report = _kernelize(model, family, "training")
    assert set(report.routed) == _expected_paths(model)
    model(ids).logits.sum().backward()
    for name, grad in grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", SILU_FAMILIES)
def test_routed_modules_really_run_the_chosen_implementation(family: str) -> None:
    import kernreg_ops._native as native

    model = _model(family)
    kernelize(model)
    calls: list[Any] = []
    original = native.silu_mul

    def spy(gate: Any, up: Any) -> Any:
        calls.append(gate.shape)
        return original(gate, up)

    # The binding is made at kernelize time: re-kernelize with the spy in place.
    native.silu_mul = spy
    try:
        kernelize(model)
        calls.clear()  # verification may have run it on probe inputs
        with torch.no_grad():
            model(_ids())
    finally:
        native.silu_mul = original
        unkernelize(model)
    assert len(calls) == 2  # one per decoder layer's MLP


@pytest.mark.parametrize("family", COMPILE_FAMILIES)
def test_compiles_fullgraph_without_graph_breaks(family: str) -> None:
    model = _model(family)
    ids = _ids()
    with torch.no_grad():
        expected = model(ids).logits
    report = _kernelize(model, family, "compile")
    assert set(report.routed) == _expected_paths(model, "compile")
    torch._dynamo.reset()
    # fullgraph=True raises at the first graph break; the eager backend keeps it quick.
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, expected, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


def test_experts_kept_in_compile_mode_say_why_no_implementation_is_eligible() -> None:
    model = _model("mixtral")
    report = _kernelize(model, "mixtral", "compile")
    row = report.row("model.layers.0.mlp.experts")
    assert row.status == "kept"
    assert row.reason.endswith(
        "(native, torch_compile, torch: lacks required traits: compile_safe)"
    ), row.reason


def test_experts_with_torch_tanh_gelu_run_the_tanh_approximation() -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=4)
    torch.manual_seed(0)
    experts = MixtralExperts(config).eval()
    experts.act_fn = torch.nn.GELU(approximate="tanh")
    with torch.no_grad():  # small weights: the exact GELU would pass the probes too
        experts.gate_up_proj.normal_(0, 0.05)
        experts.down_proj.normal_(0, 0.05)
    assert kernelize(experts).routed == ("",)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(24, 32, generator=generator) * 10
    weights, index = torch.topk(torch.randn(24, 4, generator=generator).softmax(-1), 2)
    with torch.no_grad():
        expected = type(experts).forward(experts, x, index, weights)
        torch.testing.assert_close(experts(x, index, weights), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("family", "shapes"),
    [
        # identity ("zero") experts have gate_up_proj rows but no down_proj
        ("longcat_flash", "gate_up_proj [6, 32, 32] and down_proj [4, 32, 16]"),
        # weights stored as (in, out): [experts, hidden, 2 * intermediate]
        ("aria", "gate_up_proj [4, 32, 32] and down_proj [4, 16, 32]"),
    ],
)
def test_experts_of_another_weight_layout_are_skipped_with_their_shapes(
    family: str, shapes: str
) -> None:
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    if family == "aria":
        config = transformers.AriaTextConfig(
            hidden_size=32, intermediate_size=16, moe_num_experts=4
        )
        experts = modeling.AriaExperts(config)
    else:
        config = transformers.LongcatFlashConfig(
            hidden_size=32, expert_ffn_hidden_size=16, n_routed_experts=4, zero_expert_num=2
        )
        experts = modeling.LongcatFlashExperts(config)
    model = torch.nn.ModuleDict({"experts": experts}).eval()
    with pytest.warns(KernelizeWarning, match="SiLUActivation looks like a"):  # its act_fn
        row = kernelize(model, strict=True).row("experts")
    assert row.status == "skipped"
    assert row.reason == (
        f"{shapes} are not [experts, 2 * intermediate, hidden] and [experts, hidden, intermediate]"
    )


def test_experts_running_a_layer_of_their_own_are_skipped_naming_it() -> None:
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts

    config = transformers.MuseSparkTextConfig(
        hidden_size=32,
        moe_hidden_size=32,
        moe_intermediate_size=16,
        num_local_experts=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )
    model = torch.nn.ModuleDict({"experts": MuseSparkExperts(config)}).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelizeWarning)  # its act_fn is left out
        row = kernelize(model).row("experts")
    assert row.status == "skipped"
    assert row.reason == ("the experts also run 'post_expert_norm', which moe.experts does not")


@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_state_dict_and_save_pretrained_round_trip(family: str, tmp_path: Path) -> None:
    model = _model(family)
    keys = list(model.state_dict())
    kernelize(model)
    assert list(model.state_dict()) == keys
    ids = _ids()
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = getattr(transformers, _FAMILIES[family][1]).from_pretrained(tmp_path).eval()
    assert list(loaded.state_dict()) == keys
    kernelize(loaded)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_report_names_every_routed_module_as_table_and_json() -> None:
    import json

    model = _model("llama")
    report = kernelize(model)
    text = str(report)
    data = json.loads(report.to_json())
    paths = _expected_paths(model)
    assert {row["path"] for row in data["modules"]} == paths
    assert _rotary_site(model) == "transformers.models.llama.modeling_llama:apply_rotary_pos_emb"
    assert report.row(_rotary_site(model)).op == "embedding.rotary_cos_sin"
    for path in paths:
        assert path in text
    assert data["mode"] == "inference"
    assert report.row("model.norm").op == "layernorm.rmsnorm"
    assert report.row("model.layers.0.mlp").op == "activation.silu_mul"
    assert f"{len(paths)} of {len(paths)} mapped modules routed" in text


def test_non_silu_mlp_is_left_alone_with_the_reason() -> None:
    config = _config("llama")
    config.hidden_act = "gelu"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with pytest.warns(KernelizeWarning, match="GELUActivation looks like a GeLU layer"):
        report = kernelize(model)
    assert [u.layer for u in report.unmapped] == ["transformers.activations:GELUActivation"]
    row = report.row("model.layers.0.mlp")
    assert row.status == "skipped"
    assert "not SiLU" in row.reason
    assert "model.layers.0.mlp" not in report.routed


def test_t5s_layer_norm_an_rmsnorm_by_another_name_is_routed_to_the_rmsnorm() -> None:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:  # weights of ones would hide a wrong norm
                parameter.add_(torch.randn_like(parameter) * 0.3)
    ids = _ids()
    inputs = {"input_ids": ids, "decoder_input_ids": ids[:, :4]}
    with torch.no_grad():
        expected = model(**inputs).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelizeWarning)  # its GELU MLPs are unmapped
        report = kernelize(model)
    norms = [r for r in report.rows if r.path.endswith("layer_norm")]
    assert len(norms) == 7
    assert {(r.op, r.status) for r in norms} == {("layernorm.rmsnorm", "routed")}
    assert "rejected before it: layernorm.layernorm" in norms[0].reason
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, expected, atol=1e-4, rtol=1e-4)
    unkernelize(model)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, expected)


def _modeling(model: Any) -> Any:
    return importlib.import_module(type(model).__module__)


@pytest.mark.parametrize("family", SILU_FAMILIES)
def test_rotary_function_really_runs_the_chosen_implementation(family: str) -> None:
    import kernreg_ops._native as native

    calls: list[Any] = []
    original = native.rotary_cos_sin

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    model = _model(family)
    native.rotary_cos_sin = spy
    try:
        report = kernelize(model)
        assert report.row(_rotary_site(model)).implementation == "native"
        calls.clear()  # verification may have run it on probe inputs
        with torch.no_grad():
            model(_ids())
    finally:
        native.rotary_cos_sin = original
        unkernelize(model)
    assert len(calls) == 2  # one per decoder layer's attention


def test_the_rotary_function_is_routed_per_model_never_in_its_module() -> None:
    import kernreg_ops._native as native

    first, second = _model("llama"), _model("llama")
    modeling = _modeling(first)
    own = modeling.apply_rotary_pos_emb
    calls: list[Any] = []
    original = native.rotary_cos_sin

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    native.rotary_cos_sin = spy
    try:
        kernelize(first)
        assert modeling.apply_rotary_pos_emb is own  # the module global is untouched
        calls.clear()
        with torch.no_grad():
            second(_ids())  # never kernelized: makes no kernreg call
        assert calls == []
        with torch.no_grad():
            first(_ids())
        assert len(calls) == 2
    finally:
        native.rotary_cos_sin = original
    assert unkernelize(first) > 0
    assert modeling.apply_rotary_pos_emb is own


def test_rotary_decisions_are_traced_with_the_function_site() -> None:
    import kernreg

    model = _model("qwen2")
    kernelize(model)
    with kernreg.trace() as trace, torch.no_grad():
        model(_ids())
    sites = {(call.op, call.site) for call in trace.calls}
    assert ("embedding.rotary_cos_sin", _rotary_site(model)) in sites
    unkernelize(model)


def test_function_mapping_conflict_names_both_origins() -> None:
    from kernreg.torch import LayerConflictError, layer_mappings, register_function

    layer_mappings()  # the pack's mappings are registered (its plugin loaded) first
    site = "transformers.models.llama.modeling_llama:apply_rotary_pos_emb"
    with pytest.raises(LayerConflictError) as info:
        register_function(site, op="embedding.rotary_cos_sin", args=lambda *a: a)
    message = str(info.value)
    assert f"Conflicting function mapping for '{site}'" in message
    assert "kernreg_ops/_layers.py" in message.replace("\\", "/")
    assert "test_transformers_models.py" in message


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_save_of_a_kernelized_model_loads_with_its_own_forward(
    dtype: str, tmp_path: Path
) -> None:
    model = _model("llama", getattr(torch, dtype))
    ids = _ids()
    with torch.no_grad():
        expected = model(ids).logits
    kernelize(model)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    unkernelize(model)
    del model
    gc.collect()
    norm = loaded.model.norm
    assert norm.forward.__func__ is type(norm).forward  # its own forward, not the routed one
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)
    # Kernelizing the loaded model routes it again.
    report = kernelize(loaded)
    assert set(report.routed) == _expected_paths(loaded)
    with torch.no_grad():
        tol = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=tol, atol=tol)
    assert unkernelize(loaded) >= len(report.routed)


def test_a_registry_without_the_rotary_op_leaves_the_function_alone() -> None:
    from kernreg import KernelRegistry
    from kernreg_ops._plugin import specs

    registry = KernelRegistry()
    for spec in specs():
        if spec.op == "layernorm.rmsnorm":
            registry.register(spec)
    model = _model("llama")
    own = _modeling(model).apply_rotary_pos_emb
    # The MLPs are not routed (no activation op here): their SiLU layers are left out.
    with pytest.warns(KernelizeWarning, match="SiLUActivation looks like a SiLU layer"):
        report = kernelize(model, registry=registry)
    row = report.row(_rotary_site(model))
    assert row.status == "skipped"
    assert "embedding.rotary_cos_sin" in row.reason
    assert _modeling(model).apply_rotary_pos_emb is own
    assert "model.norm" in report.routed
    unkernelize(model)


def test_trace_opened_outside_a_fullgraph_compile_records_its_decisions() -> None:
    import kernreg

    model = _model("qwen2")
    ids = _ids(1, 8)
    with torch.no_grad():
        expected = model(ids).logits
        kernelize(model)
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        with kernreg.trace() as recorded:
            out = compiled(ids).logits
    torch.testing.assert_close(out, expected)
    assert recorded.implementations("layernorm.rmsnorm")
    assert recorded.implementations("activation.silu_mul")


def _readme_mapping(module: Any, x: Any) -> tuple[Any, ...]:
    """The README's ``register_layer`` example: it fits GemmaRMSNorm's attribute names."""
    return (x, module.weight, module.eps)


def test_a_mapping_that_only_looks_right_is_rejected_never_applied() -> None:
    from kernreg import KernelRegistry
    from kernreg.torch import register_layer, unregister_layer
    from kernreg.torch.kernelize import KernelizeVerificationError
    from kernreg_ops._plugin import specs

    layer = "transformers.models.gemma.modeling_gemma:GemmaRMSNorm"
    model = _model("gemma")
    ids = _ids()
    with torch.no_grad():
        expected = model(ids).logits
    # Gemma computes x * (1 + w): the plain rmsnorm is wrong for it, whatever the names say.
    register_layer(layer, op="layernorm.rmsnorm", args=_readme_mapping)
    try:
        report = kernelize(model)
        row = report.row("model.norm")
        assert (row.status, row.op) == ("routed", "layernorm.rmsnorm_offset")
        assert "layernorm.rmsnorm: verification failed" in row.reason  # tried first, in op order
        assert "implementation tried" in row.reason
        assert "own forward kept" not in row.reason  # the rejection says what it tried only
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
        # Where the right op is missing, the wrong mapping is rejected: own forward kept.
        registry = KernelRegistry()
        for spec in specs():
            if spec.op == "layernorm.rmsnorm":
                registry.register(spec)
        with pytest.warns(KernelizeWarning):  # the MLPs' activations: no op in this registry
            report = kernelize(model, registry=registry)
        row = report.row("model.norm")
        assert row.status == "rejected"
        assert "verification failed" in row.reason
        assert "differs" in row.reason
        assert row.implementation is not None
        assert row.implementation in row.reason
        assert "model.norm" in report.rejected
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
        with pytest.raises(
            KernelizeVerificationError, match=r"module 'model\.layers\.0\.input_layer"
        ):
            kernelize(model, registry=registry, strict=True)
        # verify=False: the caller vouches for the mapping, and gets what they asked for.
        with pytest.warns(KernelizeWarning):
            kernelize(model, registry=registry, verify=False)
        with torch.no_grad():
            assert not torch.allclose(model(ids).logits, expected, rtol=1e-3, atol=1e-3)
    finally:
        unkernelize(model)
        unregister_layer(layer, "layernorm.rmsnorm")


def test_a_rotary_of_another_convention_is_rejected() -> None:
    from kernreg.torch import register_function, unregister_function

    site = "transformers.models.cohere.modeling_cohere:apply_rotary_pos_emb"
    model = _model("cohere")
    ids = _ids()
    with torch.no_grad():
        expected = model(ids).logits
    # Cohere rotates interleaved pairs: the halves rotary has the same signature.
    register_function(
        site,
        op="embedding.rotary_cos_sin",
        probe="kernreg_ops._layers:rotary_probe",
        replace=True,
    )
    try:
        report = kernelize(model)
        row = report.row(site)
        assert (row.status, row.op) == ("routed", "embedding.rotary_cos_sin_interleaved")
        assert "embedding.rotary_cos_sin: verification failed" in row.reason
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
    finally:
        unkernelize(model)
        unregister_function(site, "embedding.rotary_cos_sin")


def test_the_report_ends_with_a_per_op_summary() -> None:
    model = _model("qwen3")
    report = kernelize(model)
    lines = str(report).splitlines()
    summary = lines[lines.index(next(line for line in lines if line.startswith("op "))) :]
    counts = {tuple(line.split()[:2]): int(line.split()[2]) for line in summary[1:]}
    assert counts == report.summary()
    assert counts[("layernorm.rmsnorm", "aten")] == 2 * 4 + 1  # q, k and two layer norms
    assert summary[0].split() == ["op", "implementation", "count"]
    unkernelize(model)


#: two norms a new family may bring: Gemma's computation, and one no pack op computes
_NEW_NORMS = """

class {name}OffsetRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class {name}ScaledRMSNorm({name}RMSNorm):
    def forward(self, hidden_states):
        return 2.0 * super().forward(hidden_states)
"""


def _new_family(tmp_path: Path, package: str, name: str) -> Any:
    """A family no mapping names: Llama's modeling file with its classes renamed, imported
    from a file as ``<package>.modeling_<name>`` (``transformers_modules.*``: a model
    loaded with ``trust_remote_code``), plus two norms of its own."""
    import importlib.util
    import inspect
    import sys

    import transformers.models.llama.modeling_llama as llama

    source = inspect.getsource(llama).replace("from ...", "from transformers.")
    source = source.replace("Llama", name).replace(
        f"from .configuration_llama import {name}Config",
        f"from transformers import LlamaConfig as {name}Config",
    )
    path = tmp_path / f"modeling_{name.lower()}.py"
    path.write_text(source + _NEW_NORMS.format(name=name))
    module_name = f"{package}.modeling_{name.lower()}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "package", ["transformers.models.toyfam", "transformers_modules.someone.toy_repo"]
)
def test_a_family_no_mapping_names_is_routed_where_its_layers_compute_alike(
    package: str, tmp_path: Path
) -> None:
    import sys

    from kernreg.torch.kernelize import KernelizeVerificationError

    modeling = _new_family(tmp_path, package, "Toy")
    try:
        torch.manual_seed(0)
        model = modeling.ToyForCausalLM(_config("llama")).eval()
        model.model.norm = modeling.ToyOffsetRMSNorm(64)  # computes as Gemma's does
        layer = model.model.layers[1]
        layer.post_attention_layernorm = modeling.ToyScaledRMSNorm(64)  # as no op does
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "norm" in name:
                    parameter.add_(torch.randn_like(parameter) * 0.5)
        ids = _ids()
        with torch.no_grad():
            expected = model(ids).logits
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every layer kind is mapped: nothing to warn
            report = kernelize(model)
        assert report.unmapped == ()
        site = f"{package}.modeling_toy:apply_rotary_pos_emb"
        assert report.row(site).op == "embedding.rotary_cos_sin"
        assert report.row("model.layers.0.mlp").op == "activation.silu_mul"
        assert report.row("model.layers.0.input_layernorm").op == "layernorm.rmsnorm"
        offset = report.row("model.norm")
        assert (offset.op, offset.status) == ("layernorm.rmsnorm_offset", "routed")
        assert "layernorm.rmsnorm: verification failed" in offset.reason
        assert "own forward kept" not in offset.reason  # it was routed
        assert report.rejected == ("model.layers.1.post_attention_layernorm",)
        scaled = report.row("model.layers.1.post_attention_layernorm")
        assert "verification failed" in scaled.reason
        assert "implementation tried" in scaled.reason
        assert len(report.routed) == 7  # two MLPs, four norms, the rotary
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
        with pytest.raises(
            KernelizeVerificationError, match=r"module 'model\.layers\.1\.post_attention"
        ):
            kernelize(model, strict=True)
        assert unkernelize(model) > 0
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
    finally:
        del sys.modules[modeling.__name__]


def test_verification_cost_grows_with_the_kinds_of_layer_not_with_depth() -> None:
    import kernreg_ops._native as native

    calls: list[str] = []
    originals = {name: getattr(native, name) for name in ("silu_mul", "rotary_cos_sin")}

    def spy(name: str) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return originals[name](*args, **kwargs)

        return run

    def probes(layers: int, hidden: int) -> list[str]:
        # Sizes no other test uses: the verification of this kind of layer is not cached.
        config = _config("llama")
        config.num_hidden_layers, config.hidden_size = layers, hidden
        config.head_dim = hidden // config.num_attention_heads
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
        calls.clear()
        report = kernelize(model)
        assert len(report.routed) == 3 * layers + 2  # MLPs, two norms a layer, norm, rotary
        assert report.rejected == ()
        found = sorted(calls)
        with torch.no_grad():
            model(_ids())
        assert calls.count("silu_mul") - found.count("silu_mul") == layers  # routed
        unkernelize(model)
        return found

    for name in originals:
        setattr(native, name, spy(name))
    try:
        deep, shallow = probes(32, 40), probes(4, 56)
    finally:
        for name, original in originals.items():
            setattr(native, name, original)
    assert deep  # the swaps were verified, on probe inputs, ...
    assert deep == shallow  # ... once per kind of layer, whatever the depth

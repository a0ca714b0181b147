"""Real transformers models (tiny configs, random weights) kernelized in one line."""

from __future__ import annotations

import gc
import importlib
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kernreg_ops")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    transformers = pytest.importorskip("transformers")

from kernreg.torch import kernelize, unkernelize  # noqa: E402
from kernreg.torch.kernelize import KernelizeWarning  # noqa: E402

VOCAB = 96


def _config(family: str) -> Any:
    common = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.MistralConfig(**common, sliding_window=None)


_MODELS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
FAMILIES = sorted(_MODELS)


def _model(family: str, dtype: Any = None) -> Any:
    torch.manual_seed(0)
    model = getattr(transformers, _MODELS[family])(_config(family)).eval()
    return model if dtype is None else model.to(dtype)


def _ids(batch: int = 2, seq: int = 9) -> Any:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def _rotary_site(model: Any) -> str:
    """The report row of the modeling module's rotary function."""
    return f"{type(model).__module__}:apply_rotary_pos_emb"


def _expected_paths(model: Any) -> set[str]:
    return {
        name
        for name, module in model.named_modules()
        if type(module).__name__.endswith(("RMSNorm", "MLP"))
    } | {_rotary_site(model)}


@pytest.fixture(autouse=True)
def _no_routed_functions_left() -> None:
    """Every test starts with the modeling modules' own functions (earlier models gone)."""
    gc.collect()
    for family in FAMILIES:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        assert not hasattr(module.apply_rotary_pos_emb, "__kernreg_original__")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_match_the_unmodified_model(family: str, dtype: str) -> None:
    torch_dtype = getattr(torch, dtype)
    model = _model(family, torch_dtype)
    ids = _ids()
    with torch.no_grad():
        expected = model(ids).logits
    report = kernelize(model)
    assert set(report.routed) == _expected_paths(model)
    for row in report:
        assert row.status == "routed"
        assert row.implementation in {"aten", "native"}
        assert "routed" in row.describe()["status"]
    with torch.no_grad():
        actual = model(ids).logits
    tol = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)
    unkernelize(model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
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


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_gives_identical_tokens(family: str) -> None:
    model = _model(family)
    ids = _ids(batch=1, seq=5)
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
    kernelize(model)
    with torch.no_grad():
        actual = model.generate(ids, **kwargs)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_compiles_fullgraph_without_graph_breaks(family: str) -> None:
    model = _model(family)
    ids = _ids()
    with torch.no_grad():
        expected = model(ids).logits
    report = kernelize(model, mode="compile")
    assert set(report.routed) == _expected_paths(model)
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(ids)
    assert explained.graph_break_count == 0
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, expected, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_and_save_pretrained_round_trip(family: str, tmp_path: Path) -> None:
    model = _model(family)
    keys = list(model.state_dict())
    kernelize(model)
    assert list(model.state_dict()) == keys
    ids = _ids()
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = getattr(transformers, _MODELS[family]).from_pretrained(tmp_path).eval()
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


def test_training_mode_routes_differentiable_implementations() -> None:
    model = _model("llama")
    model.train()
    ids = _ids()
    expected = model(ids).logits
    expected.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    report = kernelize(model, mode="training")
    assert set(report.routed) == _expected_paths(model)
    model(ids).logits.sum().backward()
    for name, grad in grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-4, atol=1e-5)


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


def _modeling(model: Any) -> Any:
    return importlib.import_module(type(model).__module__)


@pytest.mark.parametrize("family", FAMILIES)
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

"""kernelize where its features meet, on real tiny transformers models (random weights,
nothing downloaded): hooks set or removed around it, dtypes changed after it under a pin
and in threads, site pins, lock files, copies, pickles, two models, strict and verify."""

from __future__ import annotations

import copy
import functools
import gc
import io
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kernreg_ops")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    transformers = pytest.importorskip("transformers")

import kernreg  # noqa: E402
from kernreg import KernelRegistry, KernelSpec, KernregError, Platform  # noqa: E402
from kernreg.config import Config  # noqa: E402
from kernreg.errors import DemotionWarning  # noqa: E402
from kernreg.torch import kernelize, register_layer, unkernelize, unregister_layer  # noqa: E402
from kernreg.torch.kernelize import KernelizeVerificationError, KernelizeWarning  # noqa: E402

VOCAB = 96
ROOT = Path(__file__).resolve().parents[2]


def _llama(dtype: Any = None, layers: int = 2) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter) * 0.5)
    return model if dtype is None else model.to(dtype)


def _gemma() -> Any:
    torch.manual_seed(0)
    config = transformers.GemmaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = transformers.GemmaForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter) * 0.5)  # a zero offset hides x*(1+w)
    return model


def _ids(batch: int = 2, seq: int = 7) -> Any:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def _logits(model: Any, ids: Any) -> Any:
    with torch.no_grad():
        return model(ids).logits


def _calls(model: Any, ids: Any) -> list[tuple[str, str]]:
    with kernreg.trace() as trace, torch.no_grad():
        model(ids)
    return [(call.op, call.implementation) for call in trace.calls]


def _own_attributes(model: Any) -> dict[str, dict[str, Any]]:
    keys = ("forward", "_old_forward", "_kernreg_site")
    return {
        path: {k: m.__dict__[k] for k in keys if k in m.__dict__}
        for path, m in model.named_modules()
    }


# What accelerate's add_hook_to_module / remove_hook_from_module do to a module.
def _add_hook(module: Any, seen: list[str]) -> None:
    module._old_forward = module.forward

    def new_forward(module: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append("hook")
        return module._old_forward(*args, **kwargs)

    module.forward = functools.update_wrapper(
        functools.partial(new_forward, module), module._old_forward
    )


def _remove_hook(module: Any) -> None:
    module.forward = module._old_forward
    del module._old_forward


# -- instance-level forward wrappers set or removed after kernelize -----------------------


def test_a_hook_set_after_kernelize_survives_kernelize_again_and_unkernelize() -> None:
    model, ids = _llama(), _ids()
    expected = _logits(model, ids)
    kernelize(model)
    seen: list[str] = []
    for module in model.modules():
        _add_hook(module, seen)
    plain: list[str] = []
    unrouted = _llama()
    for module in unrouted.modules():
        _add_hook(module, plain)
    _logits(unrouted, ids)
    assert len(_calls(model, ids)) == 9
    hooks = len(seen)  # every module called: the routed ones are, their activations not
    assert hooks == len(plain) - 2
    # kernelize again (a new pin, a new registry, or the same): every hook still runs
    report = kernelize(model, pin={"layernorm.rmsnorm@model.norm": "torch"})
    assert report.row("model.norm").implementation == "torch"
    seen.clear()
    calls = _calls(model, ids)
    assert ("layernorm.rmsnorm", "torch") in calls
    assert len(calls) == 9
    assert len(seen) == hooks  # the hooks of the routed modules too
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    assert unkernelize(model) == 9
    seen.clear()
    assert _calls(model, ids) == []
    assert len(seen) == len(plain)  # unkernelize gives each hook its own forward back
    torch.testing.assert_close(_logits(model, ids), expected, rtol=0, atol=0)
    for module in model.modules():  # and the hook removes cleanly: the class forward back
        _remove_hook(module)
        assert getattr(module.forward, "__func__", None) is type(module).forward


def test_a_hook_removed_after_kernelize_leaves_unkernelize_exact() -> None:
    model, ids = _llama(), _ids()
    expected = _logits(model, ids)
    seen: list[str] = []
    for module in model.modules():
        _add_hook(module, seen)
    report = kernelize(model)
    assert len(report.routed) == 8
    for module in model.modules():
        _remove_hook(module)
    assert len(_calls(model, ids)) == 9  # the routed forward it put back still routes
    again = kernelize(model)
    assert again.routed == report.routed
    assert len(_calls(model, ids)) == 9
    assert unkernelize(model) == 9
    assert _calls(model, ids) == []  # nothing routed is left behind
    assert all("_old_forward" not in vars(m) for m in model.modules())  # nor a hook's slot
    torch.testing.assert_close(_logits(model, ids), expected, rtol=0, atol=0)


# -- dtype change after kernelize, under a pin, in threads --------------------------------


def test_bfloat16_after_kernelize_first_called_under_a_pin_in_threads() -> None:
    model, ids = _llama(), _ids()
    unmodified = _llama(torch.bfloat16)
    report = kernelize(model)
    model.to(torch.bfloat16)
    results: list[Any] = []

    def first_call() -> None:
        with kernreg.use_backend("layernorm.rmsnorm", "torch"), torch.no_grad():
            results.append(model(ids).logits)

    threads = [threading.Thread(target=first_call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3
    # the block did not become the model's routing, in this thread or any other
    chosen = kernreg.default_registry().explain("layernorm.rmsnorm", dtypes=["bfloat16"])
    calls = _calls(model, ids)
    assert ("layernorm.rmsnorm", chosen.chosen.label) in calls
    assert ("layernorm.rmsnorm", "torch") not in calls
    reference = _llama()
    exact = _logits(reference, ids)
    own_error = (_logits(unmodified, ids).float() - exact).abs().max()
    for logits in results:
        assert (logits.float() - exact).abs().max() <= own_error * 1.5 + 1e-2
    assert report.undo() == 9


def test_a_site_pin_glob_routes_only_its_sites_and_a_later_kernelize_drops_it() -> None:
    model, ids = _llama(), _ids()
    report = kernelize(model, pin={"layernorm.rmsnorm@model.layers.*": "torch"})
    pinned = {r.path for r in report if r.implementation == "torch"}
    assert pinned == {
        f"model.layers.{i}.{n}"
        for i in (0, 1)
        for n in ("input_layernorm", "post_attention_layernorm")
    }
    assert report.row("model.norm").implementation != "torch"
    assert all("pinned at this site" in report.row(p).reason for p in pinned)
    calls = _calls(model, ids)
    assert calls.count(("layernorm.rmsnorm", "torch")) == 4
    unpinned = kernelize(model)
    assert all(r.implementation != "torch" for r in unpinned)
    assert ("layernorm.rmsnorm", "torch") not in _calls(model, ids)
    unkernelize(model)


def test_a_site_pin_that_cannot_run_raises_and_changes_nothing() -> None:
    model = _llama()
    kernelize(model)
    before = _own_attributes(model)
    with pytest.raises(KernregError):
        kernelize(model, pin={"activation.silu_mul@model.layers.1.mlp": "nosuch"})
    assert _own_attributes(model) == before
    with pytest.warns(KernelizeWarning, match="did you mean"):
        kernelize(model, pin={"layernorm.rmsnorm@model.nrom": "torch"})
    unkernelize(model)


def test_a_module_shared_at_two_paths_is_reported_and_pinned_at_both() -> None:
    model, ids = _llama(), _ids()
    shared = model.model.layers[0].input_layernorm
    model.model.layers[1].input_layernorm = shared
    expected = _logits(model, ids)
    first, second = "model.layers.0.input_layernorm", "model.layers.1.input_layernorm"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second path is a module of this model
        report = kernelize(model, pin={f"layernorm.rmsnorm@{second}": "torch"})
    assert report.row(first).implementation == report.row(second).implementation == "torch"
    assert f"the same module as '{first}'" in report.row(second).reason
    torch.testing.assert_close(_logits(model, ids), expected)
    before = _own_attributes(model)
    with pytest.raises(KernregError, match="disagree on one module shared at several paths"):
        kernelize(model, pin={f"layernorm.rmsnorm@{first}": "aten", second: "torch"})
    assert _own_attributes(model) == before
    unkernelize(model)
    assert "forward" not in vars(shared)


def _replicate(network: Any) -> Any:
    """One replica of ``network`` as ``nn.DataParallel`` makes it (torch's
    ``parallel.replicate``, which needs GPUs, on this device): a shallow copy of each
    module, linked to each other, holding copies of the parameters (here: norm weights
    halved, so that a forward reading the original's weights shows)."""
    modules = list(network.modules())
    copies = {id(m): m._replicate_for_data_parallel() for m in modules}
    for module in modules:
        replica = copies[id(module)]
        for key, child in module._modules.items():
            setattr(replica, key, None if child is None else copies[id(child)])
        for key, param in module._parameters.items():
            scale = 0.5 if "norm" in type(module).__name__.lower() else 1.0
            setattr(replica, key, None if param is None else param.detach() * scale)
    return copies[id(network)]


def test_a_data_parallel_replica_runs_its_own_weights() -> None:
    model, ids = _llama(), _ids()
    kernelize(model)
    routed = _replicate(model)
    for path, module in routed.named_modules():
        forward = vars(module).get("forward")
        if forward is not None:
            assert forward.__self__ is module, path
    plain = _replicate(model)
    unkernelize(plain)
    with torch.no_grad():
        torch.testing.assert_close(routed(ids).logits, plain(ids).logits)
    unkernelize(model)
    assert "_replicate_for_data_parallel" not in vars(model.model.norm)


def test_a_model_whose_op_left_the_registry_runs_its_own_forward_and_says_so() -> None:
    model, strict, ids = _llama(), _llama(), _ids()
    expected = _logits(model, ids)
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    with registry.scoped():  # the op exists only inside the block
        for spec in kernreg.default_registry().get("layernorm.rmsnorm"):
            registry.register(spec)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the layers of the other ops are left out
            assert kernelize(model, registry=registry).row("model.norm").status == "routed"
            kernelize(strict, registry=registry, strict=True)
    again = "runs its own forward again: No kernels registered for op 'layernorm.rmsnorm'"
    with pytest.warns(KernelizeWarning, match=again) as said:
        torch.testing.assert_close(_logits(model, ids), expected)
    assert any("'model.norm'" in str(w.message) for w in said)
    with pytest.raises(KernregError, match=r"No kernels registered for op 'layernorm\.rmsnorm'"):
        _logits(strict, ids)  # strict: a decision that fails raises, here at the call
    unkernelize(model)
    unkernelize(strict)


# -- lock files and the two-argument ops --------------------------------------------------


def _run(script: str, env: dict[str, str], timeout: float = 120) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env={**os.environ, "KERNREG_PLATFORM": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_a_lock_file_decides_what_a_kernelized_model_runs(tmp_path: Path) -> None:
    from kernreg.registry import build_plan

    plan = json.loads(build_plan().to_json())
    for entry in plan["entries"]:  # the two-argument op and a norm, for float32, to torch
        if entry[0] in ("activation.silu_mul", "layernorm.rmsnorm") and entry[2] == ["float32"]:
            entry[3] = "torch"
            entry[6] = "kernreg_ops.reference:" + entry[0].split(".")[1]
    lock = tmp_path / "kernreg.lock"
    lock.write_text(json.dumps(plan))
    out = _run(
        f"""
        import sys, warnings
        warnings.simplefilter("ignore")
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch, kernreg
        from test_kernelize_attacks import _llama, _ids, _calls, _finished
        from kernreg.torch import kernelize
        model = _llama()
        report = kernelize(model)
        rows = {{(r.op, r.implementation, r.rule) for r in report}}
        print(sorted(rows))
        calls = _calls(model, _ids())
        print(sorted(set(calls)))
        model.to(torch.bfloat16)
        print(sorted(set(_calls(model, _ids()))))
        """,
        {"KERNREG_LOCK": str(lock)},
    )
    rows, float32, bfloat16 = out.strip().splitlines()[-3:]
    assert "('activation.silu_mul', 'torch', 'plan')" in rows
    assert "('layernorm.rmsnorm', 'torch', 'plan')" in rows
    assert "('activation.silu_mul', 'torch')" in float32
    assert "('layernorm.rmsnorm', 'torch')" in float32
    assert "'torch')" not in bfloat16  # the lock's bfloat16 entries are the pack's own


def test_a_lock_files_site_pins_decide_what_a_kernelized_model_runs() -> None:
    from kernreg.registry import build_plan
    from kernreg_ops._plugin import specs

    def registry(pins: str = "") -> KernelRegistry:
        made = KernelRegistry(config=Config(pins=pins), platform=Platform.parse("cpu"))
        for spec in specs():
            made.register(spec)
        return made

    # `kernreg lock` run with KERNREG_PIN=layernorm.rmsnorm@model.norm=torch records it
    plan = build_plan(registry("layernorm.rmsnorm@model.norm=torch"))
    assert plan.site_pins == ("layernorm.rmsnorm@model.norm=torch",)
    deployed = registry()  # a process given KERNREG_LOCK alone follows the plan
    deployed.use_plan(plan)
    model, ids = _llama(), _ids()
    report = kernelize(model, registry=deployed)
    assert report.row("model.norm").implementation == "torch"
    assert report.row("model.layers.0.input_layernorm").implementation != "torch"
    assert _calls(model, ids).count(("layernorm.rmsnorm", "torch")) == 1
    unkernelize(model)


def test_a_lock_entry_that_cannot_run_here_is_named_in_the_row_it_did_not_decide() -> None:
    from kernreg.plan import PlanWarning, SelectionPlan
    from kernreg.registry import build_plan
    from kernreg_ops._plugin import specs

    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    for spec in specs():
        registry.register(spec)
    plan = json.loads(build_plan(registry).to_json())
    for entry in plan["entries"]:  # a lock made for a GPU: triton for float32 norms
        if entry[0] == "layernorm.rmsnorm" and entry[2] == ["float32"]:
            entry[3], entry[6] = "triton", "kernreg_ops._triton:rmsnorm"
    registry.use_plan(SelectionPlan.from_json(json.dumps(plan)))
    model = _llama()
    with pytest.warns(PlanWarning, match="planned triton is not available"):
        report = kernelize(model, registry=registry)
    row = report.row("model.norm")
    assert row.status == "routed"
    assert row.rule != "plan"
    assert "planned triton is not available here" in row.reason
    unkernelize(model)


# -- copies, state dicts, pickles ---------------------------------------------------------


def test_deepcopy_state_dict_and_pickle_of_a_kernelized_model() -> None:
    model, ids = _llama(), _ids()
    expected = _logits(model, ids)
    keys = list(model.state_dict())
    kernelize(model)
    clone = copy.deepcopy(model)
    torch.testing.assert_close(_logits(clone, ids), expected, rtol=1e-4, atol=1e-4)
    assert len(_calls(clone, ids)) == 9
    assert unkernelize(clone) == 9
    assert _calls(clone, ids) == []
    assert len(_calls(model, ids)) == 9
    other = _llama()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    kernelize(other)
    other.load_state_dict(model.state_dict())
    assert list(other.state_dict()) == keys
    torch.testing.assert_close(_logits(other, ids), expected, rtol=1e-4, atol=1e-4)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert _calls(loaded, ids) == []  # routing is process state: its own forward runs
    torch.testing.assert_close(_logits(loaded, ids), expected, rtol=0, atol=1e-6)
    assert len(kernelize(loaded).routed) == 8
    assert len(_calls(loaded, ids)) == 9
    unkernelize(loaded)
    assert _calls(loaded, ids) == []
    unkernelize(model)
    unkernelize(other)


def test_a_deep_copy_keeps_routing_new_dtypes_once_its_original_is_gone() -> None:
    model, ids = _llama(), _ids()
    kernelize(model)
    clone = copy.deepcopy(model)
    del model
    gc.collect()
    assert len(_calls(clone, ids)) == 9  # a trace opened: every site decides again
    clone.to(torch.bfloat16)
    assert len(_calls(clone, ids)) == 9  # bfloat16 verified on the copy itself
    own_error = (_logits(_llama(torch.bfloat16), ids).float() - _logits(_llama(), ids)).abs()
    routed_error = (_logits(clone, ids).float() - _logits(_llama(), ids)).abs()
    assert routed_error.max() <= own_error.max() * 1.5 + 1e-2
    assert unkernelize(clone) == 9


def test_a_deep_copy_compiles_after_its_original_is_unkernelized_and_vice_versa() -> None:
    ids = _ids()
    expected = _logits(_llama(), ids)
    for unrouted in ("original", "copy"):
        model = _llama()
        kernelize(model, mode="compile")
        clone = copy.deepcopy(model)
        gone, kept = (model, clone) if unrouted == "original" else (clone, model)
        assert unkernelize(gone) == 9
        compiled = torch.compile(kept, backend="eager", fullgraph=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids).logits, expected, rtol=1e-4, atol=1e-4)
        assert len(_calls(kept, ids)) == 9
        assert unkernelize(kept) == 9
        torch._dynamo.reset()


def test_a_private_registry_is_freed_with_the_model_kernelized_with_it() -> None:
    import weakref

    reference, aten = "kernreg_ops.reference:rmsnorm", "kernreg_ops._aten:rmsnorm"

    def kernelized() -> tuple[Any, Any]:
        registry = KernelRegistry()
        registry.register(KernelSpec("layernorm.rmsnorm", "torch", reference, reference=True))
        registry.register(KernelSpec("layernorm.rmsnorm", "fast", aten, priority=10))
        model = _llama(layers=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KernelizeWarning)  # its MLP's op is not in it
            assert kernelize(model, registry=registry, verify=False).routed
        return weakref.ref(model), weakref.ref(registry)

    model, registry = kernelized()
    gc.collect()
    assert model() is None
    assert registry() is None  # not held by what verify() reads of kernelized models


def test_a_kernelized_model_dropped_without_unkernelize_leaves_no_module_behind() -> None:
    from kernreg.torch.kernelize import NAMESPACE_PREFIX

    def routed_modules() -> set[str]:
        gc.collect()
        return {name for name in sys.modules if name.startswith(NAMESPACE_PREFIX)}

    before = routed_modules()
    model = _llama()
    kernelize(model)
    assert len(routed_modules() - before) == 1  # the rotary callers' copy of the globals
    del model
    assert routed_modules() == before


def test_kernelize_twice_is_idempotent_and_a_submodule_then_its_parent() -> None:
    model, ids = _llama(), _ids()
    expected = _logits(model, ids)
    first = kernelize(model)
    before = _own_attributes(model)
    second = kernelize(model)
    assert [r.describe() for r in second] == [r.describe() for r in first]
    assert _own_attributes(model) == before  # nothing re-bound
    unkernelize(model)
    sub = kernelize(model.model.layers[0])
    assert set(sub.routed) >= {"mlp", "input_layernorm", "post_attention_layernorm"}
    whole = kernelize(model)
    assert len(whole.routed) == 8
    assert len(_calls(model, ids)) == 9
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    assert unkernelize(model) == 9
    assert all(not ({"forward", "_kernreg_site"} & set(vars(m))) for m in model.modules())


# -- two models, a third never kernelized -------------------------------------------------


def test_two_models_in_different_modes_and_a_third_makes_no_kernreg_call() -> None:
    a, b, c, ids = _llama(), _llama(), _llama(), _ids()
    expected = _logits(c, ids)
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    from kernreg_ops._plugin import specs

    for spec in specs():
        registry.register(spec)
    ra = kernelize(a, mode="training")
    rb = kernelize(b, registry=registry, mode="compile", pin={"embedding.*@*": "torch"})
    rotary = "transformers.models.llama.modeling_llama:apply_rotary_pos_emb"
    assert ra.row(rotary).implementation != "torch"
    assert rb.row(rotary).implementation == "torch"
    assert _calls(c, ids) == []
    torch.testing.assert_close(_logits(c, ids), expected, rtol=0, atol=0)
    assert ("embedding.rotary_cos_sin", "torch") in _calls(b, ids)
    assert ("embedding.rotary_cos_sin", "torch") not in _calls(a, ids)
    for model in (a, b):
        torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    unkernelize(a)
    unkernelize(b)


# -- verification, strict, and a failing kernelize ----------------------------------------


def _readme_mapping(module: Any, x: Any) -> tuple[Any, ...]:
    return (x, module.weight, module.eps)


def test_strict_rejection_names_the_path_and_leaves_a_routed_model_as_it_was() -> None:
    model, ids = _gemma(), _ids()
    expected = _logits(model, ids)
    kernelize(model)
    before = _own_attributes(model)
    layer = "transformers.models.gemma.modeling_gemma:GemmaRMSNorm"
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    registry.register(
        KernelSpec("layernorm.rmsnorm", "torch", "kernreg_ops.reference:rmsnorm", reference=True)
    )
    registry.register(
        KernelSpec("layernorm.rmsnorm", "aten", "kernreg_ops._aten:rmsnorm", priority=20)
    )
    register_layer(layer, op="layernorm.rmsnorm", args=_readme_mapping)
    try:
        with pytest.raises(KernelizeVerificationError) as raised:
            kernelize(model, registry=registry, strict=True)
        assert isinstance(raised.value, KernregError)
        assert raised.value.path.startswith("model.")
        assert raised.value.path in str(raised.value)
        assert _own_attributes(model) == before
        torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    finally:
        unregister_layer(layer, "layernorm.rmsnorm")
    unkernelize(model)


def test_a_kernelize_whose_warning_is_raised_as_an_error_changes_nothing() -> None:
    model, ids = _llama(), _ids()
    kernelize(model, pin={"layernorm.rmsnorm@model.norm": "torch"})
    before = _own_attributes(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelizeWarning)  # as `pytest -W error` runs it
        with pytest.raises(KernelizeWarning, match="matches no module"):
            kernelize(model, pin={"layernorm.rmsnorm@model.nrom": "torch"})
    assert _own_attributes(model) == before  # still routed as it was, pin and all
    assert ("layernorm.rmsnorm", "torch") in _calls(model, ids)
    unkernelize(model)


def test_a_kernelize_that_fails_counts_no_decision_and_one_that_succeeds_counts_each_site() -> None:
    model = _llama()

    def counted() -> int:
        return sum(n for op, *_, n in kernreg.stats().counts if op == "layernorm.rmsnorm")

    before = counted()
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelizeWarning)
        with pytest.raises(KernelizeWarning, match="matches no module"):
            kernelize(model, pin={"layernorm.rmsnorm@model.nrom": "torch"})
    assert counted() == before  # nothing was routed, so nothing was decided for a call
    report = kernelize(model)
    norms = [r for r in report.rows if r.op == "layernorm.rmsnorm" and r.status == "routed"]
    assert counted() == before + len(norms) == before + 5  # one per site bound
    unkernelize(model)


def test_a_kernelize_that_fails_with_a_trace_open_counts_no_decision_there_either() -> None:
    model = _llama()

    def counted(counts: Any) -> int:
        return sum(n for op, *_, n in counts if op == "layernorm.rmsnorm")

    before = counted(kernreg.stats().counts)
    with kernreg.trace() as trace:
        with warnings.catch_warnings():
            warnings.simplefilter("error", KernelizeWarning)
            with pytest.raises(KernelizeWarning, match="matches no module"):
                kernelize(model, pin={"layernorm.rmsnorm@model.nrom": "torch"})
        assert counted(kernreg.stats().counts) == before
        assert counted(trace.stats.counts) == 0
        kernelize(model)
    assert counted(kernreg.stats().counts) == before + 5  # one per site bound
    assert counted(trace.stats.counts) == 5
    unkernelize(model)


def test_an_unmapped_layer_kind_warns_once_per_class_per_call() -> None:
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        rotary_pct=0.5,
    )
    model = transformers.GPTNeoXForCausalLM(config).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = kernelize(model)
    mine = [w for w in caught if issubclass(w.category, KernelizeWarning)]
    assert len(mine) == 1, [str(w.message) for w in mine]
    assert "GELUActivation" in str(mine[0].message)
    (entry,) = report.unmapped
    assert len(entry.paths) == 3
    unkernelize(model)


# -- training, compile, generate ----------------------------------------------------------


def test_training_gradients_compile_and_generate_after_a_dtype_round_trip() -> None:
    ids = _ids()
    plain = _llama()
    model = _llama()
    kernelize(model, mode="training")
    model.to(torch.float64).to(torch.float32)  # a new dtype and back, losslessly
    model.train()
    plain.train()
    for m in (model, plain):
        m(ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    model.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(
            model.generate(ids, max_new_tokens=5, do_sample=False),
            plain.generate(ids, max_new_tokens=5, do_sample=False),
        )
    compiled = _llama()
    kernelize(compiled, mode="compile")
    explained = torch._dynamo.explain(compiled)(ids)
    assert explained.graph_break_count == 0
    unkernelize(model)
    unkernelize(compiled)


def _finished(pid: int, seconds: float) -> bool:
    """Whether the forked child ``pid`` exits with status 0 within ``seconds`` (it is
    killed otherwise): run inside the scripts below."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return False


# -- fork while another thread kernelizes a real model ------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_thread_kernelizes_a_real_model_finishes() -> None:
    out = _run(
        f"""
        import os, sys, threading, time, warnings
        warnings.simplefilter("ignore")
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_kernelize_attacks import _llama, _ids, _calls, _finished
        from kernreg.torch import kernelize
        models = [_llama() for _ in range(2)]
        stop = threading.Event()
        def loop():
            while not stop.is_set():
                for m in models:
                    kernelize(m, pin={{"layernorm.rmsnorm@model.norm": "torch"}})
                    kernelize(m)
        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        time.sleep(0.3)
        ok = 0
        for _ in range(5):
            pid = os.fork()
            if pid == 0:
                model = _llama()
                kernelize(model)
                os._exit(0 if len(_calls(model, _ids())) == 9 else 3)
            ok += _finished(pid, 30)
        stop.set()
        thread.join()
        print("finished", ok)
        """,
        {},
        timeout=170,
    )
    assert out.strip().splitlines()[-1] == "finished 5"


# -- a model made on the meta device (accelerate's init_empty_weights) --------------------


def test_a_model_on_the_meta_device_is_reported_then_kernelized_once_loaded() -> None:
    source, ids = _llama(), _ids()
    expected = _logits(source, ids)
    model = _llama().to("meta")  # what init_empty_weights makes: shapes, no data
    with pytest.warns(KernelizeWarning, match="SiLUActivation"):  # no CPU kernel on meta
        report = kernelize(model)  # verification has nothing to run on: it says so
    norm = report.row("model.norm")
    assert norm.status == "rejected"
    assert "meta device" in norm.reason
    assert "model.norm" in report.rejected
    assert not report.routed
    from kernreg_ops._plugin import specs

    norms = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    for spec in specs():
        if spec.op == "layernorm.rmsnorm":
            norms.register(spec)
    with pytest.raises(KernelizeVerificationError, match=r"module 'model\.layers\.0\.") as raised:
        kernelize(model, registry=norms, strict=True)
    assert "meta device" in str(raised.value)
    model.to_empty(device="cpu")
    model.load_state_dict(source.state_dict())
    model.model.rotary_emb.inv_freq.copy_(source.model.rotary_emb.inv_freq)
    loaded = kernelize(model)
    assert len(loaded.routed) == 8
    assert len(_calls(model, ids)) == 9
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    unkernelize(model)


def test_a_layer_kept_because_it_was_decided_on_the_meta_device_says_so() -> None:
    from kernreg_ops import reference
    from kernreg_ops._plugin import specs

    # The pack's reference, and kernels that need a CPU: none of them runs on meta.
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    for spec in specs():
        if spec.backend == "torch":
            registry.register(spec)
    for op, kernel in (
        ("layernorm.rmsnorm", reference.rmsnorm),
        ("activation.silu_mul", reference.silu_mul),
        ("embedding.rotary_cos_sin", reference.rotary_cos_sin),
    ):
        registry.register(KernelSpec(op, "cpu_kernel", kernel, requires=("cpu",), priority=40))
    model = _llama().to("meta")
    with pytest.warns(KernelizeWarning, match="SiLUActivation"):  # in the MLP that is kept
        report = kernelize(model, verify=False, registry=registry)
    for path in ("model.layers.0.mlp", "model.norm", "transformers.models.llama.modeling_llama:"):
        row = next(row for row in report.rows if row.path.startswith(path))
        assert row.status == "kept"
        assert "decided for the meta device: kernelize once the weights are loaded" in row.reason
    unkernelize(model)


def test_a_layer_decided_on_the_meta_device_is_not_routed_with_that_decision() -> None:
    from kernreg.plugins import load_plugins
    from kernreg_ops import reference

    # The pack's native implementations run on any device, meta included; a kernel that
    # needs a CPU would outrank them once the weights are loaded on one.
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    load_plugins(registry=registry)
    ran = []

    def cpu_silu_mul(gate: Any, up: Any, *, out: Any = None) -> Any:
        ran.append(gate.device.type)
        return reference.silu_mul(gate, up, out=out)

    registry.register(
        KernelSpec(
            "activation.silu_mul", "cpu_kernel", cpu_silu_mul, requires=("cpu",), priority=40
        )
    )
    source, ids = _llama(), _ids()
    model = _llama().to("meta")
    with pytest.warns(KernelizeWarning, match="SiLUActivation"):  # in the MLP that is kept
        report = kernelize(model, verify=False, registry=registry)
    for path in ("model.layers.0.mlp", "model.norm", "transformers.models.llama.modeling_llama:"):
        row = next(row for row in report.rows if row.path.startswith(path))
        assert row.status == "kept", row
        assert "decided for the meta device: kernelize once the weights are loaded" in row.reason
    with pytest.raises(KernelizeVerificationError, match="meta device"):
        kernelize(model, verify=False, registry=registry, strict=True)
    # Loaded as accelerate and transformers load weights: no Module._apply to follow.
    model.load_state_dict(source.state_dict(), assign=True)
    model.model.rotary_emb = source.model.rotary_emb
    _logits(model, ids)
    assert not ran  # the own forward ran, not what was decided for meta
    loaded = kernelize(model, verify=False, registry=registry)
    assert loaded.row("model.layers.0.mlp").implementation == "cpu_kernel"
    _logits(model, ids)
    assert ran == ["cpu", "cpu"]
    unkernelize(model)


# -- traces around kernelize, and demotions under a trace ---------------------------------


def test_a_trace_open_around_kernelize_records_the_calls_it_binds() -> None:
    model, ids = _llama(), _ids()
    with kernreg.trace() as trace, torch.no_grad():
        report = kernelize(model)
        model(ids)
    assert len(trace.calls) == 9
    sites = {call.site for call in trace.calls}
    assert sites == set(report.routed)
    unkernelize(model)


def test_calls_in_a_demoted_bucket_are_traced_under_the_fallback(tmp_path: Path) -> None:
    from kernreg_ops import reference
    from kernreg_ops._plugin import specs

    config = Config(demote="layernorm.*", cache_dir=str(tmp_path))
    registry = KernelRegistry(config=config, platform=Platform.parse("cpu"))
    for spec in specs():
        registry.register(spec)

    def flaky(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        if x.shape[-2] > 20:
            raise RuntimeError("too many rows for the launch grid")
        return reference.rmsnorm(x, weight, eps)

    registry.register(KernelSpec("layernorm.rmsnorm", "flaky", flaky, priority=50))
    model, plain, long = _llama(), _llama(), _ids(seq=32)
    assert kernelize(model, registry=registry).row("model.norm").implementation == "flaky"
    with pytest.warns(DemotionWarning, match="flaky raised RuntimeError"):
        torch.testing.assert_close(_logits(model, long), _logits(plain, long))
    norms = [c for c in _calls(model, long) if c[0] == "layernorm.rmsnorm"]
    assert norms == [("layernorm.rmsnorm", "aten")] * 5  # what answered, not nothing
    short = [c for c in _calls(model, _ids(seq=5)) if c[0] == "layernorm.rmsnorm"]
    assert short == [("layernorm.rmsnorm", "flaky")] * 5  # other buckets still run it
    unkernelize(model)


# -- custom ops: the first import, and a fork while another thread defines one ------------


#: Two checks in one interpreter (each starts torch: seconds): the first import of
#: ``as_custom_op`` is the one that imports torch; then a child forked while another thread
#: defines custom ops finishes. Prints one line for each.
CUSTOM_OPS = f"""
import os, sys, threading, time, warnings
assert "torch" not in sys.modules
from kernreg.torch import as_custom_op  # its module is the first to import torch
import torch
import kernreg_ops
norm = as_custom_op("layernorm.rmsnorm")
print(type(torch.ops.kernreg).__name__, tuple(norm(torch.ones(2, 8), torch.ones(8)).shape))

if not hasattr(os, "fork"):
    print("finished", None)
    sys.exit()
warnings.simplefilter("ignore")
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_kernelize_attacks import _finished
stop, numbers = threading.Event(), iter(range(10**6))
def define():
    while not stop.is_set():
        try:
            as_custom_op("layernorm.rmsnorm", namespace="kr_parent", name=f"n{{next(numbers)}}")
        except RuntimeError:  # torch's own registration, racing the forks
            pass
thread = threading.Thread(target=define, daemon=True)
thread.start()
time.sleep(0.3)
finished = 0
for i in range(6):
    pid = os.fork()
    if pid == 0:
        as_custom_op("layernorm.rmsnorm", namespace="kr_child", name=f"c{{i}}")
        os._exit(0)
    finished += _finished(pid, 5)
stop.set()
thread.join()
print("finished", finished)
"""


@pytest.fixture(scope="module")
def custom_ops(once_per_session: Callable[..., Any]) -> list[str]:
    """The two lines :data:`CUSTOM_OPS` prints, once per test run."""
    lines = once_per_session(
        "custom_op_children", lambda: _run(CUSTOM_OPS, {}, timeout=120).strip().splitlines()
    )
    return list(lines[-2:])


def test_as_custom_op_imported_before_torch_is(custom_ops: list[str]) -> None:
    assert custom_ops[0].split() == ["_Namespace", "(2,", "8)"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_thread_defines_a_custom_op_finishes(
    custom_ops: list[str],
) -> None:
    # Each child waited for the lock the defining thread held (none finished); a child
    # can still meet one of torch's own registration locks held at the fork (rarely).
    assert int(custom_ops[1].split()[1]) >= 4


def test_a_routed_module_whose_forward_attributes_were_deleted_is_routed_again() -> None:
    model, ids = _llama(), _ids()
    seen: list[str] = []
    for module in model.modules():
        _add_hook(module, seen)
    kernelize(model)
    for module in model.modules():  # both gone: the class forward runs
        del module.forward
        del module._old_forward
    assert _calls(model, ids) == []
    assert len(kernelize(model).routed) == 8
    assert len(_calls(model, ids)) == 9
    assert unkernelize(model) == 9
    assert all(not ({"forward", "_old_forward"} & set(vars(m))) for m in model.modules())
    assert _calls(model, ids) == []


# -- a dtype first seen while torch.compile traces ----------------------------------------


def _counting_registry(seen: list[Any]) -> Any:
    """The pack's implementations and a compile-safe rmsnorm of top priority that notes the
    shape of each input it runs on outside a trace."""
    from kernreg_ops import reference
    from kernreg_ops._plugin import specs

    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    for spec in specs():
        registry.register(spec)

    def counted(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        if not torch.compiler.is_compiling():
            seen.append(tuple(x.shape))
        return reference.rmsnorm(x, weight, eps)

    traits = ("compile_safe", "backward")
    registry.register(
        KernelSpec("layernorm.rmsnorm", "counted", counted, priority=99, traits=traits)
    )
    return registry


def test_a_dtype_first_seen_while_compiling_is_routed_on_its_next_eager_call() -> None:
    seen: list[Any] = []
    model, ids = _llama(), _ids(seq=5)  # 5: not a probe length
    report = kernelize(model, mode="compile", registry=_counting_registry(seen))
    assert report.row("model.norm").implementation == "counted"
    model.to(torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        compiled(ids)  # bfloat16 decided while tracing: nothing can be verified there
    seen.clear()
    with torch.no_grad():
        model(ids)
    # the eager call verifies bfloat16 for real and routes it (it kept the own forward)
    assert seen.count((2, 5, 64)) == 5
    unkernelize(model)


# -- decided while torch.compile traces: verified there, run by the graph ------------------

_OPAQUE_RUNS: list[tuple[int, ...]] = []


@torch.library.custom_op("kernreg_attacks::opaque_rmsnorm", mutates_args=())
def _opaque_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _OPAQUE_RUNS.append(tuple(x.shape))
    from kernreg_ops import reference

    return reference.rmsnorm(x, weight, eps)


@_opaque_rmsnorm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


def _opaque(x: Any, weight: Any, eps: float = 1e-6) -> Any:
    """An rmsnorm a compiled graph keeps as one opaque call: each real run is noted."""
    return _opaque_rmsnorm(x, weight, eps)


def _wrong(x: Any, weight: Any, eps: float = 1e-6) -> Any:
    return _opaque_rmsnorm(x, weight, eps) * 2


def _pack_registry() -> Any:
    from kernreg_ops._plugin import specs

    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    for spec in specs():
        registry.register(spec)
    return registry


def _opaque_spec(impl: Any = _opaque, backend: str = "opaque", priority: int = 99) -> Any:
    traits = ("compile_safe", "backward")
    return KernelSpec("layernorm.rmsnorm", backend, impl, priority=priority, traits=traits)


def test_a_dtype_first_seen_while_compiling_runs_its_kernel_in_the_compiled_graph() -> None:
    registry = _pack_registry()
    registry.register(_opaque_spec())
    model, ids = _llama(), _ids(seq=5)  # 5: not a probe length
    kernelize(model, mode="compile", registry=registry)
    model.to(torch.bfloat16)
    expected = _logits(_llama(torch.bfloat16), ids)  # (a copy would share the routing)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        compiled(ids)  # bfloat16 decided (and verified) while tracing
        _OPAQUE_RUNS.clear()
        got = compiled(ids).logits
    # the graph runs the kernel at the five norms (two layers of two, the final one)
    assert _OPAQUE_RUNS == [(2, 5, 64)] * 5
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02)
    unkernelize(model)


def test_a_compiled_kernelized_model_follows_a_registry_change_with_verified_kernels() -> None:
    registry = _pack_registry()
    model, ids = _llama(), _ids(seq=5)
    kernelize(model, mode="compile", registry=registry)
    expected = _logits(model, ids)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        compiled(ids)
    registry.register(_opaque_spec())  # after the model was compiled
    with torch.no_grad():
        compiled(ids)  # traced again: the new kernel decided and verified there
        _OPAQUE_RUNS.clear()
        got = compiled(ids).logits
    assert _OPAQUE_RUNS == [(2, 5, 64)] * 5
    torch.testing.assert_close(got, expected)
    assert ("model.norm", "layernorm.rmsnorm", "routed", "opaque") in _norm_routes(registry)
    # a wrong kernel registered since is rejected there too: the graph keeps the own forward
    registry.register(_opaque_spec(_wrong, "wrong", priority=100))
    with torch.no_grad(), pytest.warns(KernelizeWarning, match="implementation tried: wrong"):
        torch.testing.assert_close(compiled(ids).logits, expected)
    assert ("model.norm", "layernorm.rmsnorm", "rejected", "wrong") in _norm_routes(registry)
    unkernelize(model)


def _norm_routes(registry: Any) -> set[tuple[str, ...]]:
    from kernreg.torch.kernelize import routing_of

    return {row[1:5] for row in routing_of(registry) if row[2] == "layernorm.rmsnorm"}

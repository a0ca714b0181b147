"""A routed module runs its routed forward from its class, not from its instance: a
subclass named as its own class, shared by the modules of one kind in one state, so
torch.compile guards it once per graph, not once per module. What that must keep: every
route the instance forward had (a registry change, a forward held elsewhere, pickles,
copies, hooks, a failed kernelize), and ``unkernelize`` giving the class back."""

from __future__ import annotations

import copy
import importlib
import io
import pickle
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kernreg_ops")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    transformers = pytest.importorskip("transformers")

from test_kernelize_attacks import _calls, _ids, _llama, _logits  # noqa: E402

import kernreg  # noqa: E402
from kernreg import KernelRegistry, KernelSpec, Platform  # noqa: E402
from kernreg.config import Config  # noqa: E402
from kernreg.torch import kernelize, register_layer, unkernelize, unregister_layer  # noqa: E402

LlamaRMSNorm = transformers.models.llama.modeling_llama.LlamaRMSNorm


def _norms(model: Any) -> list[Any]:
    layers = model.model.layers
    return [
        layers[0].input_layernorm,
        layers[1].input_layernorm,
        layers[0].post_attention_layernorm,
        model.model.norm,
    ]


def test_modules_of_one_kind_run_one_forward_from_one_class() -> None:
    model, ids = _llama(), _ids()
    expected = _logits(model, ids)
    kernelize(model)
    norms = _norms(model)
    assert len({type(norm) for norm in norms}) == 1
    cls = type(norms[0])
    assert cls is not LlamaRMSNorm
    assert issubclass(cls, LlamaRMSNorm)
    assert (cls.__name__, cls.__qualname__, cls.__module__) == (
        "LlamaRMSNorm",
        "LlamaRMSNorm",
        LlamaRMSNorm.__module__,
    )
    assert cls.forward.__closure__ is None  # nothing read per module
    assert all("forward" not in vars(norm) for norm in norms)
    layers = model.model.layers
    assert type(layers[0].mlp) is type(layers[1].mlp)
    assert type(layers[0].self_attn) is type(layers[1].self_attn)  # the rotary's callers
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    assert unkernelize(model) == 9
    assert all(type(norm) is LlamaRMSNorm for norm in norms)
    assert all(not ({"forward", "_kernreg_site"} & set(vars(m))) for m in model.modules())


def _guard_count(manager: Any) -> int:
    count = len(manager.get_leaf_guards())
    for child in manager.get_child_managers():
        count += _guard_count(child)
    for key, value in getattr(manager, "get_key_value_managers", dict)().values():
        count += sum(_guard_count(m) for m in (key, value) if m is not None)
    return count


def test_a_compiled_kernelized_model_adds_no_guards_per_layer() -> None:
    """What a compiled call checks before it runs its graph grows with the model's depth
    as the unmodified model's does: kernreg's routes are guarded once per graph."""
    guards = importlib.import_module("torch._dynamo.guards")
    profile = getattr(guards, "profile_guard_manager", None)
    if profile is None:
        pytest.skip("this torch keeps its guards otherwise")
    found: list[Any] = []
    guards.profile_guard_manager = lambda manager, scope, n: found.append(manager) or 0.0
    counts = {}
    try:
        for layers in (1, 2):
            for routed in (False, True):
                model, ids = _llama(layers=layers), _ids(1, 5)
                if routed:
                    kernelize(model, mode="compile")
                found.clear()
                with torch.no_grad():
                    torch.compile(model, fullgraph=True)(ids)
                counts[(layers, routed)] = _guard_count(found[-1])
                torch._dynamo.reset()
    finally:
        guards.profile_guard_manager = profile
    one = counts[(1, True)] - counts[(1, False)]
    two = counts[(2, True)] - counts[(2, False)]
    assert two <= one, counts  # the second layer's routes (4 modules, the rotary) add none


def _counting_registry() -> tuple[KernelRegistry, list[str]]:
    calls: list[str] = []
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    reference = "kernreg_ops.reference:rmsnorm"
    registry.register(KernelSpec("layernorm.rmsnorm", "torch", reference, reference=True))

    def first(x: Any, weight: Any, eps: float) -> Any:
        calls.append("first")
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)

    registry.register(KernelSpec("layernorm.rmsnorm", "first", first, priority=5))
    return registry, calls


def _llama_on(registry: KernelRegistry) -> Any:
    """A tiny Llama kernelized with ``registry``, which serves its norms alone."""
    model = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the MLP's and the rotary's ops are not in it
        kernelize(model, registry=registry)
    return model


def test_a_forward_held_from_a_routed_module_runs_what_a_registry_change_decides() -> None:
    registry, calls = _counting_registry()
    model = _llama_on(registry)
    calls.clear()  # verification's probes
    norm = model.model.norm
    held = norm.forward  # what a wrapper set up after kernelize keeps
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        expected = LlamaRMSNorm.forward(norm, x)
        torch.testing.assert_close(held(x), expected)
    assert calls == ["first"]

    def second(x: Any, weight: Any, eps: float) -> Any:
        calls.append("second")
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)

    registry.register(KernelSpec("layernorm.rmsnorm", "second", second, priority=9))
    calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(held(x), expected)  # decided again, verified
        torch.testing.assert_close(norm(x), expected)
        torch.testing.assert_close(held(x), expected)
    assert calls[-2:] == ["second", "second"]
    assert "first" not in calls
    unkernelize(model)


def test_a_routed_model_pickles_as_its_own_classes_and_deep_copies_as_routed() -> None:
    model, ids = _llama(), _ids()
    expected = _logits(model, ids)
    kernelize(model)
    routed = type(model.model.norm)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert type(loaded.model.norm) is LlamaRMSNorm
    assert pickle.loads(pickle.dumps(routed)) is LlamaRMSNorm
    assert _calls(loaded, ids) == []  # its own forward: routing is process state
    torch.testing.assert_close(_logits(loaded, ids), expected, rtol=1e-4, atol=1e-4)
    # A trace opened and closed meanwhile routed the model through its instance forwards
    # (to record each call); its next call settles it in the class it had, not a new one.
    assert type(model.model.norm) is LlamaRMSNorm
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    assert type(model.model.norm) is routed
    twin = copy.deepcopy(model)
    assert type(twin.model.norm) is routed
    with torch.no_grad():
        twin.model.norm.weight.mul_(2)  # its own weights, not the original's
    assert ("layernorm.rmsnorm", "aten") in _calls(twin, ids)
    assert not torch.allclose(_logits(twin, ids), expected)
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    unkernelize(model)
    assert type(twin.model.norm) is routed  # a copy is routed on its own
    assert unkernelize(twin) == 9
    assert type(twin.model.norm) is LlamaRMSNorm


def test_a_hook_set_on_a_routed_module_runs_and_unkernelize_restores_beneath_it() -> None:
    model, ids = _llama(), _ids()
    expected = _logits(model, ids)
    kernelize(model)
    norm = model.model.norm
    seen: list[str] = []
    norm._old_forward = norm.forward  # what accelerate's add_hook_to_module does

    def hooked(*args: Any, **kwargs: Any) -> Any:
        seen.append("hook")
        return norm._old_forward(*args, **kwargs)

    norm.forward = hooked
    assert ("layernorm.rmsnorm", "aten") in _calls(model, ids)
    assert seen
    kernreg.registry.process_state_changed()  # every table emptied, decided again
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    unkernelize(model)
    assert type(norm) is LlamaRMSNorm
    seen.clear()
    assert _calls(model, ids) == []  # the hook runs the norm's own forward again
    assert seen == ["hook"]
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)


class RefusingNorm(torch.nn.Module):
    """An RMSNorm whose class no subclass can be made of (``__init_subclass__`` raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + torch.randn(8) * 0.1)
        self.eps = 1e-6

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise TypeError("no subclasses of RefusingNorm")

    def forward(self, x: Any) -> Any:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def test_a_class_that_refuses_subclasses_is_routed_through_its_instance() -> None:
    register_layer(RefusingNorm, op="layernorm.rmsnorm", args=lambda m, x: (x, m.weight, m.eps))
    try:
        model = torch.nn.Sequential(RefusingNorm())
        x = torch.randn(3, 8)
        with torch.no_grad():
            expected = model(x)
        assert kernelize(model).routed == ("0",)
        assert type(model[0]) is RefusingNorm
        assert "forward" in vars(model[0])
        assert ("layernorm.rmsnorm", "aten") in _calls(model, x)
        with torch.no_grad():
            torch.testing.assert_close(model(x), expected)
        assert unkernelize(model) == 1
        assert "forward" not in vars(model[0])
    finally:
        unregister_layer(RefusingNorm, "layernorm.rmsnorm")


# -- generated forwards --

#: read by the argument map below from this module's globals, at each call
_WEIGHT_SCALE = 1.0


class ScaledNorm(torch.nn.Module):
    """An RMSNorm whose weight is scaled by a module-level constant."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + torch.randn(8) * 0.1)
        self.eps = 1e-6

    def forward(self, x: Any) -> Any:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * _WEIGHT_SCALE * (x * torch.rsqrt(variance + self.eps))


def _scaled_norm_args(module: Any, x: Any) -> tuple[Any, ...]:
    return (x, module.weight * _WEIGHT_SCALE, module.eps)


def test_a_global_an_argument_map_reads_is_read_as_it_is_at_each_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    register_layer(ScaledNorm, op="layernorm.rmsnorm", args=_scaled_norm_args)
    try:
        model = torch.nn.Sequential(ScaledNorm())
        x = torch.randn(3, 8)
        assert kernelize(model).routed == ("0",)
        assert type(type(model[0])).__name__ == "Settled"
        monkeypatch.setitem(globals(), "_WEIGHT_SCALE", 2.0)  # rebound after kernelize
        with torch.no_grad():
            expected = ScaledNorm.forward(model[0], x)
            torch.testing.assert_close(model(x), expected)
            kernreg.registry.process_state_changed()  # settled again, on a new forward
            torch.testing.assert_close(model(x), expected)
            monkeypatch.setitem(globals(), "_WEIGHT_SCALE", 3.0)
            torch.testing.assert_close(model(x), ScaledNorm.forward(model[0], x))
        assert ("layernorm.rmsnorm", "aten") in _calls(model, x)
        assert unkernelize(model) == 1
    finally:
        unregister_layer(ScaledNorm, "layernorm.rmsnorm")


def test_a_held_routed_forward_runs_the_own_one_on_a_new_dtype_after_unkernelize() -> None:
    model = _llama()
    kernelize(model)
    norm = model.model.norm
    held = norm.forward  # what a wrapper set up after kernelize keeps
    unkernelize(model)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(held(x), LlamaRMSNorm.forward(norm, x))


class _Doubled(torch.nn.Module):
    def forward(self, weight: Any) -> Any:
        return weight * 2


def test_a_parametrization_registered_on_a_routed_module_is_kept_through_its_reroutes() -> None:
    """``register_parametrization`` makes the module's class a subclass of the one it runs
    as (its settled class): a registry change, a new dtype and unkernelize keep what that
    class adds (the parametrized ``weight``), and removing the parametrization works."""
    parametrize = torch.nn.utils.parametrize
    model, twin, ids = _llama(), _llama(), _ids()
    parametrize.register_parametrization(twin.model.norm, "weight", _Doubled())
    expected = _logits(twin, ids)
    kernelize(model)
    norm = model.model.norm
    parametrize.register_parametrization(norm, "weight", _Doubled())
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    with torch.no_grad():  # a new dtype, verified against the module's own forward
        torch.testing.assert_close(norm(x), LlamaRMSNorm.forward(norm, x))
    assert ("layernorm.rmsnorm", "aten") in _calls(norm, x)
    kernreg.registry.process_state_changed()  # every table emptied, decided again
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    assert parametrize.type_before_parametrizations(norm) is LlamaRMSNorm
    assert ("layernorm.rmsnorm", "aten") in _calls(model, ids)
    assert unkernelize(model) == 9
    assert parametrize.is_parametrized(norm, "weight")
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    parametrize.remove_parametrizations(norm, "weight")
    assert type(norm) is LlamaRMSNorm
    assert "forward" not in vars(norm)
    with torch.no_grad():
        torch.testing.assert_close(norm.weight, twin.model.norm.weight)


def test_a_module_made_from_the_class_of_a_routed_one_is_not_routed() -> None:
    registry, calls = _counting_registry()
    model = _llama_on(registry)
    fresh = type(model.model.norm)(64)  # as code making a module like another does
    assert type(fresh) is LlamaRMSNorm
    calls.clear()
    with torch.no_grad():
        fresh(torch.randn(2, 64))
    assert calls == []
    unkernelize(model)

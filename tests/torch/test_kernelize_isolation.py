"""Each kernelized model runs its own decisions: not a pin open around a call, not another
device's, another registry's or another model's, and nothing half done after an error,
beneath an instance's own forward wrapper, or in a child forked meanwhile."""

from __future__ import annotations

import copy
import os
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kernreg_ops")

import kernreg  # noqa: E402
from _support import routed_forward  # noqa: E402
from kernreg import KernelRegistry, KernelSpec, Platform  # noqa: E402
from kernreg.config import Config  # noqa: E402
from kernreg.torch import (  # noqa: E402
    kernelize,
    register_function,
    register_layer,
    unkernelize,
    unregister_function,
    unregister_layer,
)
from kernreg.torch.kernelize import KernelizeWarning  # noqa: E402


class Norm(torch.nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.eps = 1e-6

    def forward(self, x: Any) -> Any:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, self.eps) * self.weight


class Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Norm()
        self.second = Norm()

    def forward(self, x: Any) -> Any:
        return self.second(self.first(x))


NORM = f"{__name__}:Norm"


def norm_args(module: Any, x: Any) -> tuple[Any, ...]:
    return (x, module.weight, module.eps)


def _rms(x: Any, weight: Any, eps: float = 1e-6) -> Any:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps) * weight


@pytest.fixture
def mapped() -> Iterator[None]:
    register_layer(NORM, op="layernorm.rmsnorm", args=norm_args)
    try:
        yield
    finally:
        unregister_layer(NORM)


def _counting(name: str, calls: list[str]) -> Any:
    def impl(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        calls.append(name)
        return _rms(x, weight, eps)

    impl.__name__ = name
    return impl


def _registry(calls: list[str]) -> KernelRegistry:
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    registry.register(KernelSpec("layernorm.rmsnorm", "torch", _rms, reference=True))
    registry.register(KernelSpec("layernorm.rmsnorm", "fast", _counting("fast", calls), priority=5))
    registry.register(KernelSpec("layernorm.rmsnorm", "slow", _counting("slow", calls), priority=1))
    return registry


def test_a_use_backend_block_around_a_new_dtypes_first_call_is_not_kept(mapped: None) -> None:
    calls: list[str] = []
    registry = _registry(calls)
    model = Pair()
    kernelize(model, registry=registry)
    x = torch.randn(2, 8, dtype=torch.bfloat16)  # a dtype kernelize has not decided yet
    with kernreg.use_backend("layernorm.rmsnorm", "slow"):
        model(x)
    assert "slow" not in calls  # the model runs what kernelize decides, never the block
    calls.clear()
    seen: list[list[str]] = []

    def other_thread() -> None:
        model(x)
        seen.append(list(calls))

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert seen == [["fast", "fast"]]
    assert registry.explain("layernorm.rmsnorm", dtypes=["bfloat16"]).chosen.backend == "fast"


def test_a_use_backend_block_around_kernelize_warns_and_names_the_pin_to_pass(
    mapped: None,
) -> None:
    calls: list[str] = []
    registry = _registry(calls)
    model = Pair()
    with (
        kernreg.use_backend("layernorm.*", "slow"),
        kernreg.use_backend("activation.*", "x"),
        pytest.warns(KernelizeWarning) as caught,
    ):
        report = kernelize(model, registry=registry)
    assert [str(w.message) for w in caught] == [
        "kernelize: the use_backend block open around it (layernorm.*=slow) does not decide "
        "what this model runs (a kernelized model runs what kernelize decided); pass "
        "pin={'layernorm.*@*': 'slow'} to pin its layers"
    ]  # the block naming no op of the model says nothing
    assert report.row("first").implementation == "fast"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = kernelize(model, registry=registry, pin={"layernorm.*@*": "slow"})
    assert report.row("first").implementation == "slow"
    unkernelize(model)


class _FakeTensor:
    """A parameter on a GPU this machine does not have: a dtype and a device."""

    def __init__(self, device: str) -> None:
        self.dtype = torch.float32
        self.device = torch.device(device)


class _OnGpu(torch.Tensor):
    """A tensor that says it is on a GPU this machine does not have."""

    @property
    def device(self) -> Any:  # type: ignore[override]
        return self.gpu

    def __deepcopy__(self, memo: dict[int, Any]) -> _OnGpu:
        return _on_gpu(self.as_subclass(torch.Tensor).clone(), self.gpu)


def _on_gpu(tensor: Any, device: Any) -> _OnGpu:
    moved = torch.Tensor._make_subclass(_OnGpu, tensor)
    moved.gpu = torch.device(device)
    return moved


class OnDevice(torch.nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.register_buffer("where", _on_gpu(torch.zeros(1), device))

    def forward(self, x: Any) -> Any:
        return "own forward"


def test_a_module_on_the_second_gpu_runs_what_that_gpu_was_decided_for() -> None:
    layer = f"{__name__}:OnDevice"
    register_layer(layer, op="kr_test.gpu_norm", args=lambda module, x: (x,))
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cuda:9.0,8.0"))
    registry.register(KernelSpec("kr_test.gpu_norm", "torch", lambda x: "ref", reference=True))
    registry.register(
        KernelSpec("kr_test.gpu_norm", "hopper", lambda x: "hopper", requires=("cuda>=9.0",))
    )
    registry.register(
        KernelSpec(
            "kr_test.gpu_norm", "ampere", lambda x: "ampere", requires=("cuda>=8.0",), priority=-1
        )
    )
    model = torch.nn.ModuleDict({"zero": OnDevice("cuda:0"), "one": OnDevice("cuda:1")})
    try:
        report = kernelize(model, registry=registry, verify=False)  # probes need a real GPU
    finally:
        unregister_layer(layer)
    assert report.row("zero").implementation == "hopper"
    assert report.row("one").implementation == "ampere"
    x = _FakeTensor("cuda:1")
    assert (model["zero"](x), model["one"](x)) == ("hopper", "ampere")


def rope(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> Any:
    """transformers' ``apply_rotary_pos_emb``, as a module of this file calls it."""
    from kernreg_ops import reference

    return reference.rotary_cos_sin(q, k, cos, sin, unsqueeze_dim)


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, q: Any, k: Any, cos: Any, sin: Any) -> Any:
        q, k = rope(self.proj(q), k, cos, sin)
        return q + k


def rope_probe(model: Any, function: Any, seq_len: int, dtype: Any, device: Any) -> Any:
    g = torch.Generator().manual_seed(seq_len)
    q, k = (torch.randn(1, 2, seq_len, 8, generator=g).to(device, dtype) for _ in range(2))
    cos, sin = (torch.randn(1, seq_len, 8, generator=g).to(device, dtype) for _ in range(2))
    return (q, k, cos, sin), {}


@pytest.fixture
def rope_mapped() -> Iterator[None]:
    register_function(f"{__name__}:rope", op="embedding.rotary_cos_sin", probe=rope_probe)
    try:
        yield
    finally:
        unregister_function(f"{__name__}:rope")


def _rope_inputs() -> tuple[Any, ...]:
    return rope_probe(None, rope, 5, torch.float32, torch.device("cpu"))[0]  # type: ignore[no-any-return]


def test_a_model_on_the_default_registry_ignores_another_models_private_one(
    rope_mapped: None,
) -> None:
    private = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    private.register(KernelSpec("embedding.rotary_cos_sin", "torch", rope, reference=True))
    private.register(
        KernelSpec("embedding.rotary_cos_sin", "wrong", lambda q, k, *rest: (q, k), priority=9)
    )
    first, second = Attention(), Attention()
    second.load_state_dict(first.state_dict())
    inputs = _rope_inputs()
    with torch.no_grad():
        expected = first(*inputs)
    report = kernelize(first, registry=private, verify=False)  # "wrong" is vouched for
    assert report.row(f"{__name__}:rope").implementation == "wrong"
    own = kernelize(second)
    assert own.row(f"{__name__}:rope").implementation == "native"
    with torch.no_grad():
        torch.testing.assert_close(second(*inputs), expected)
        assert not torch.allclose(first(*inputs), expected)
    unkernelize(first)
    unkernelize(second)


def test_a_failed_kernelize_leaves_the_model_exactly_as_it_was(
    mapped: None, rope_mapped: None
) -> None:
    model = torch.nn.ModuleDict({"norm": Pair(), "attention": Attention()})
    with pytest.raises(kernreg.BackendNotFoundError):  # decided last, after everything else
        kernelize(model, pin={"layernorm.rmsnorm@norm.second": "nosuch"})
    assert all(routed_forward(m) is None for m in model.modules())
    kernelize(model)
    before = {path: (type(m), dict(vars(m))) for path, m in model.named_modules()}
    routed = {path for path, m in model.named_modules() if routed_forward(m) is not None}
    assert routed == {"norm.first", "norm.second", "attention"}
    with pytest.raises(kernreg.BackendNotFoundError):
        kernelize(model, mode="training", pin={"embedding.*@*": "nosuch"})
    assert {path: (type(m), dict(vars(m))) for path, m in model.named_modules()} == before
    with kernreg.trace() as trace, torch.no_grad():
        model["norm"](torch.randn(2, 8))
        model["attention"](*_rope_inputs())
    assert {call.site for call in trace.calls} == {
        "norm.first",
        "norm.second",
        f"{__name__}:rope",
    }
    assert unkernelize(model) == 3


def _hooked(module: Any, seen: list[str]) -> None:
    """What accelerate's ``add_hook_to_module`` does: keep the forward as
    ``_old_forward`` and set a wrapper that runs the hook around it."""
    module._old_forward = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        seen.append("hook")
        return module._old_forward(*args, **kwargs)

    module.forward = forward


def test_instance_level_forward_wrappers_still_run(mapped: None) -> None:
    calls: list[str] = []
    registry = _registry(calls)
    model = Pair()
    _hooked(model.first, calls)
    model.second.forward = lambda x: Norm.forward(model.second, x) + 0  # not a hook
    x = torch.randn(2, 8)
    expected = model(x)
    report = kernelize(model, registry=registry)
    assert report.row("first").status == "routed"
    second = report.row("second")
    assert second.status == "kept"
    assert "instance-level forward" in second.reason
    calls.clear()
    torch.testing.assert_close(model(x), expected)
    assert calls == ["hook", "fast"]  # the hook runs, then the routed implementation
    assert unkernelize(model) == 1
    calls.clear()
    model(x)
    assert calls == ["hook"]


def test_a_forward_set_on_a_routed_module_since_is_kept_by_kernelize_and_unkernelize(
    mapped: None,
) -> None:
    # A patch binding its own forward to a routed module (as liger-kernel's do) was
    # overwritten by the next kernelize (its row "routed") and deleted by unkernelize.
    calls: list[str] = []
    model = Pair()
    x = torch.randn(2, 8)
    expected = model(x)
    assert kernelize(model, registry=_registry(calls)).row("first").status == "routed"

    def patched(self: Any, x: Any) -> Any:
        calls.append("patched")
        return Norm.forward(self, x)

    model.first.forward = patched.__get__(model.first)
    again = kernelize(model, registry=_registry(calls))
    row = again.row("first")
    assert row.status == "kept"
    assert "instance-level forward" in row.reason
    assert again.row("second").status == "routed"
    calls.clear()
    torch.testing.assert_close(model(x), expected)
    assert calls == ["patched", "fast"]
    assert unkernelize(model) == 1
    calls.clear()
    torch.testing.assert_close(model(x), expected)
    assert calls == ["patched"]
    del model.first.forward
    kernelize(model, registry=_registry(calls))  # routed first, patched after it
    model.first.forward = patched.__get__(model.first)
    assert unkernelize(model) == 2
    assert vars(model.first)["forward"].__func__ is patched


def _forked_child_finishes(work: Any) -> bool:
    """Fork now; the child runs ``work()`` and exits 0. Whether it finished in time."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            work()
        finally:
            os._exit(0)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return False


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_another_thread_kernelizes_does_not_hang() -> None:
    entered, release = threading.Event(), threading.Event()

    def applies(module: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait(30)
        return None

    register_layer(NORM, op="layernorm.rmsnorm", args=norm_args, applies=applies)
    try:
        thread = threading.Thread(target=kernelize, args=(Pair(),))
        thread.start()
        assert entered.wait(30)
        try:
            assert _forked_child_finishes(lambda: kernelize(Pair(), verify=False))
        finally:
            release.set()
            thread.join()
    finally:
        unregister_layer(NORM)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_another_thread_uses_the_tuning_store_does_not_hang(
    tmp_path: Any,
) -> None:
    import sqlite3

    from kernreg.measurement import Measurement
    from kernreg.tuning import TuningKey, TuningStore

    path = tmp_path / "tuning.sqlite3"
    store = TuningStore(path, timeout=10)
    key = TuningKey("layernorm.rmsnorm", "cpu", "aten,torch", ("float32",), "shape=1")
    other_process = sqlite3.connect(path, isolation_level=None)
    other_process.execute("BEGIN EXCLUSIVE")  # the thread's put waits inside the store
    thread = threading.Thread(target=store.put, args=(key, {"aten": Measurement(1.0, 0.0, 3)}))
    thread.start()
    time.sleep(0.5)
    try:
        assert _forked_child_finishes(lambda: store.get(key))
    finally:
        other_process.execute("ROLLBACK")
        other_process.close()
        thread.join()
    assert store.get(key) is not None
    store.close()


def test_a_family_nobody_mapped_is_reported_not_silently_skipped() -> None:
    class TotallyNewRMSNorm(Norm):
        pass

    model = torch.nn.Sequential(TotallyNewRMSNorm())
    with pytest.warns(KernelizeWarning, match="TotallyNewRMSNorm looks like a RMSNorm layer"):
        report = kernelize(model)
    assert [u.kind for u in report.unmapped] == ["RMSNorm"]
    assert report.unmapped[0].paths == ("0",)


TAGGED_MODULE = """
import torch


def use_kernel_forward_from_hub(name):
    return lambda obj: obj


def other_decorator(**kwargs):
    return lambda obj: obj


@use_kernel_forward_from_hub("RMSNorm")
# Copied from transformers.models.llama.modeling_llama.LlamaRMSNorm with Llama->Odd
class OddNormA(torch.nn.Module):
    def forward(self, x):
        return x


@use_kernel_forward_from_hub(
    "RMSNorm"
)
@other_decorator(
    intro="written over several lines",
)
class OddNormB(torch.nn.Module):
    def forward(self, x):
        return x


class Untagged(torch.nn.Module):
    @use_kernel_forward_from_hub("MLP")  # a method's decorator tags no class
    def forward(self, x):
        return x
"""


def test_tags_are_read_across_comment_lines_and_decorators_over_several_lines(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As transformers' modeling files write them (qwen2_vl: a "# Copied from" line).
    (tmp_path / "kr_tagged_family.py").write_text(TAGGED_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import kr_tagged_family as family

    model = torch.nn.Sequential(family.OddNormA(), family.OddNormB(), family.Untagged())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = kernelize(model)
    assert {u.layer: u.kind for u in report.unmapped} == {
        "kr_tagged_family:OddNormA": "RMSNorm",
        "kr_tagged_family:OddNormB": "RMSNorm",
    }
    assert len([w for w in caught if issubclass(w.category, KernelizeWarning)]) == 2


def test_a_subclass_of_a_mapped_class_is_reported_unmapped_and_keeps_its_forward(
    mapped: None,
) -> None:
    class Doubled(Norm):  # no known name ending, no tag: only its base is mapped
        def forward(self, x: Any) -> Any:
            return super().forward(x) * 2

    calls: list[str] = []
    model = torch.nn.Sequential(Norm(), Doubled(), Doubled())
    x = torch.randn(2, 8)
    expected = model(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = kernelize(model, registry=_registry(calls))
    assert report.routed == ("0",)
    (entry,) = report.unmapped
    assert entry.layer.endswith("Doubled")
    assert entry.paths == ("1", "2")
    assert entry.kind == "layernorm.rmsnorm"
    assert f"subclasses {NORM} (mapped to op 'layernorm.rmsnorm')" in entry.reason
    assert "no mapping covers the subclass itself" in entry.reason
    assert entry.describe()["reason"] == entry.reason
    assert entry.reason in str(report)
    mine = [str(w.message) for w in caught if issubclass(w.category, KernelizeWarning)]
    assert len(mine) == 1, mine
    assert "Doubled subclasses" in mine[0]
    calls.clear()  # verification ran the implementation on probes
    torch.testing.assert_close(model(x), expected)  # its own forward, doubled
    assert calls == ["fast"]  # the mapped Norm only


def scale(x: Any, *, factor: float = 2.0) -> Any:
    """A module-level function with a keyword-only parameter (called with it)."""
    return x * factor


class Scaler(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: Any) -> Any:
        return scale(x * self.weight, factor=3.0)


def test_a_routed_function_called_with_keywords_runs_under_a_trace() -> None:
    register_function(f"{__name__}:scale", op="kr_test.scale")
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    registry.register(KernelSpec("kr_test.scale", "torch", scale, reference=True))
    registry.register(KernelSpec("kr_test.scale", "fast", lambda x, factor: x * factor, priority=5))
    model = Scaler()
    try:
        report = kernelize(model, registry=registry, verify=False)  # no probe: vouched for
        assert report.row(f"{__name__}:scale").implementation == "fast"
        x = torch.ones(4)
        with kernreg.trace() as trace:
            torch.testing.assert_close(model(x), x * 3.0)
        assert [(c.op, c.implementation) for c in trace.calls] == [("kr_test.scale", "fast")]
        torch.testing.assert_close(model(x), x * 3.0)
    finally:
        unkernelize(model)
        unregister_function(f"{__name__}:scale")


def _to_gpu(device: str) -> Any:
    """What ``module.to(device)`` applies to each tensor, for a GPU this machine lacks."""

    return lambda tensor: _on_gpu(tensor.detach().clone(), device)


def _mixed_gpu_registry(op: str) -> KernelRegistry:
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cuda:9.0,8.0"))
    registry.register(KernelSpec(op, "torch", lambda x: "ref", reference=True))
    registry.register(KernelSpec(op, "hopper", lambda x: "hopper", requires=("cuda>=9.0",)))
    registry.register(
        KernelSpec(op, "ampere", lambda x: "ampere", requires=("cuda>=8.0",), priority=-1)
    )
    return registry


@pytest.fixture
def on_device_mapped() -> Iterator[None]:
    register_layer(f"{__name__}:OnDevice", op="kr_test.moved", args=lambda module, x: (x,))
    try:
        yield
    finally:
        unregister_layer(f"{__name__}:OnDevice")


def test_a_module_moved_after_kernelize_runs_what_its_new_device_was_decided_for(
    on_device_mapped: None,
) -> None:
    registry = _mixed_gpu_registry("kr_test.moved")
    model = torch.nn.Sequential(OnDevice("cuda:0"))
    report = kernelize(model, registry=registry, verify=False)  # probes need a real GPU
    assert report.row("0").implementation == "hopper"
    model._apply(_to_gpu("cuda:1"))  # what model.to("cuda:1") does
    assert model(_FakeTensor("cuda:1")) == "ampere"
    model._apply(_to_gpu("cuda:0"))
    assert model(_FakeTensor("cuda:0")) == "hopper"
    model._apply(lambda t: t)  # not moved: the route it has is kept
    assert model(_FakeTensor("cuda:0")) == "hopper"
    assert unkernelize(model) == 1
    assert all("_apply" not in vars(m) and "forward" not in vars(m) for m in model.modules())
    assert model(_FakeTensor("cuda:0")) == "own forward"


def test_a_copy_moved_to_another_gpu_leaves_the_original_on_its_kernel(
    on_device_mapped: None,
) -> None:
    registry = _mixed_gpu_registry("kr_test.moved")
    model = torch.nn.Sequential(OnDevice("cuda:0"))
    kernelize(model, registry=registry, verify=False)
    assert model(_FakeTensor("cuda:0")) == "hopper"
    replica = copy.deepcopy(model)
    replica._apply(_to_gpu("cuda:1"))
    for _ in range(2):  # whichever runs first, each runs its own device's kernel
        assert replica(_FakeTensor("cuda:1")) == "ampere"
        assert model(_FakeTensor("cuda:0")) == "hopper"
    registry.register(KernelSpec("kr_test.moved", "later", lambda x: "later", priority=-5))
    assert replica(_FakeTensor("cuda:1")) == "ampere"  # decided again after a change


def tag(x: Any) -> Any:
    """A module-level function that a layer of this file calls."""
    return "own function"


class TagCaller(OnDevice):
    def forward(self, x: Any) -> Any:
        return tag(x)


def test_a_caller_of_a_routed_function_moved_after_kernelize_follows_its_device() -> None:
    register_function(f"{__name__}:tag", op="kr_test.tag")
    registry = _mixed_gpu_registry("kr_test.tag")
    model = torch.nn.ModuleDict({"a": TagCaller("cuda:0"), "b": TagCaller("cuda:0")})
    try:
        report = kernelize(model, registry=registry, verify=False)
        assert report.row(f"{__name__}:tag").implementation == "hopper"
        model["b"]._apply(_to_gpu("cuda:1"))
        assert model["a"](_FakeTensor("cuda:0")) == "hopper"
        assert model["b"](_FakeTensor("cuda:1")) == "ampere"
        model._apply(_to_gpu("cuda:1"))
        assert model["a"](_FakeTensor("cuda:1")) == "ampere"
        assert tag(None) == "own function"  # the module of this file is untouched
    finally:
        unkernelize(model)
        unregister_function(f"{__name__}:tag")
    assert model["a"](_FakeTensor("cuda:1")) == "own function"


def test_a_moved_kernelized_model_saves_and_loads_with_its_own_forward(
    mapped: None, tmp_path: Any
) -> None:
    model = Pair()
    kernelize(model)
    model.to("cpu", torch.float64).to(torch.float32)
    x = torch.randn(2, 8)
    expected = model(x)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    torch.testing.assert_close(loaded(x), expected)
    loaded.to("cpu")
    unkernelize(loaded)
    assert all("_apply" not in vars(m) for m in loaded.modules())


def test_a_function_probe_that_raises_is_reported_with_its_message() -> None:
    def failing_probe(model: Any, function: Any, seq_len: int, dtype: Any, device: Any) -> Any:
        raise IndexError("index 1 is out of bounds for dimension 1 with size 1")

    register_function(f"{__name__}:rope", op="embedding.rotary_cos_sin", probe=failing_probe)
    try:
        report = kernelize(Attention())
    finally:
        unregister_function(f"{__name__}:rope")
    row = report.row(f"{__name__}:rope")
    assert row.status == "rejected"
    assert (
        f"the probe of '{__name__}:rope' raised IndexError: index 1 is out of bounds" in row.reason
    )

"""Every swap is verified before it is made, once per kind of layer; what kernelize leaves
out, or is asked for and cannot find, is said."""

from __future__ import annotations

import copy
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kernreg_ops")

import kernreg  # noqa: E402
from kernreg import KernelRegistry, KernelSpec, Platform  # noqa: E402
from kernreg.config import Config  # noqa: E402
from kernreg.torch import kernelize, register_layer, unkernelize, unregister_layer  # noqa: E402
from kernreg.torch.kernelize import KernelizeError, KernelizeWarning  # noqa: E402


class Norm(torch.nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.eps = 1e-6

    def forward(self, x: Any) -> Any:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, self.eps) * self.weight


NORM = f"{__name__}:Norm"


def norm_args(module: Any, x: Any) -> tuple[Any, ...]:
    return (x, module.weight, module.eps)


@pytest.fixture
def mapped() -> Iterator[None]:
    register_layer(NORM, op="layernorm.rmsnorm", args=norm_args)
    try:
        yield
    finally:
        unregister_layer(NORM)


def _registry(impl: Any) -> KernelRegistry:
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    registry.register(
        KernelSpec("layernorm.rmsnorm", "torch", lambda x, w, eps: impl(x, w, eps), reference=True)
    )
    registry.register(KernelSpec("layernorm.rmsnorm", "fast", impl, priority=5))
    return registry


def test_verification_runs_once_per_kind_of_layer_not_per_layer(mapped: None) -> None:
    calls: list[int] = []

    def counting(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        calls.append(x.shape[-2] if x.dim() > 1 else 1)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps) * weight

    registry = _registry(counting)
    shallow = torch.nn.Sequential(*(Norm() for _ in range(2)))
    report = kernelize(shallow, registry=registry)
    assert len(report.routed) == 2
    verified = len(calls)
    assert verified == 3  # one probe per sequence length: 1, 7, 16
    calls.clear()
    deep = torch.nn.Sequential(*(Norm() for _ in range(16)))
    assert len(kernelize(deep, registry=registry).routed) == 16
    assert calls == []  # the same kind of layer: already verified
    wider = torch.nn.Sequential(Norm(12))
    assert kernelize(wider, registry=registry).routed == ("0",)
    assert len(calls) == verified  # other parameter shapes are verified again


def test_an_implementation_replaced_since_it_was_verified_is_verified_again(
    mapped: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def right(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps) * weight

    def wrong(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        return right(x, weight, eps) * 2

    # A target string: kernelize imports it again on each call, so a module attribute
    # replaced since (a patch, a reload) is what it binds.
    impls = types.ModuleType("kernreg_test_replaced_impls")
    impls.fast = right  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, impls.__name__, impls)
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    registry.register(KernelSpec("layernorm.rmsnorm", "torch", right, reference=True))
    registry.register(KernelSpec("layernorm.rmsnorm", "fast", f"{impls.__name__}:fast", priority=5))
    model = torch.nn.Sequential(Norm())
    x = torch.randn(3, 8)
    expected = model(x)
    assert kernelize(model, registry=registry).routed == ("0",)
    unkernelize(model)
    impls.fast = wrong  # type: ignore[attr-defined]
    row = kernelize(model, registry=registry).row("0")
    assert row.status == "rejected"
    assert "implementation tried: fast" in row.reason
    torch.testing.assert_close(model(x), expected)
    unkernelize(model)


def test_a_class_whose_forward_changed_since_it_was_verified_is_verified_again(
    mapped: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def offset_forward(self: Any, x: Any) -> Any:  # Gemma's x * (1 + w)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, self.eps) * (1 + self.weight)

    model = torch.nn.Sequential(Norm())
    assert kernelize(model).routed == ("0",)
    unkernelize(model)
    monkeypatch.setattr(Norm, "forward", offset_forward)
    x = torch.randn(3, 8)
    expected = model(x)
    assert kernelize(model).row("0").status == "rejected"
    torch.testing.assert_close(model(x), expected)
    unkernelize(model)


class LayoutNorm(Norm):
    """A norm over the last dimension, or over the one before it (``channels_first``), as
    ConvNext's layer norm chooses per instance: one class, one weight shape, two results."""

    def __init__(self, data_format: str) -> None:
        super().__init__()
        self.data_format = data_format

    def forward(self, x: Any) -> Any:
        if self.data_format == "channels_first":
            return super().forward(x.transpose(-1, -2)).transpose(-1, -2)
        return super().forward(x)


LAYOUT_NORM = f"{__name__}:LayoutNorm"


@pytest.mark.parametrize("first", ["channels_last", "channels_first"])
def test_instances_of_one_class_set_up_otherwise_are_verified_each(first: str) -> None:
    second = {"channels_last": "channels_first", "channels_first": "channels_last"}[first]
    register_layer(LAYOUT_NORM, op="layernorm.rmsnorm", args=norm_args)
    try:
        model = torch.nn.Sequential(LayoutNorm(first), LayoutNorm(second))
        x = torch.randn(2, 8, 8)
        with torch.no_grad():
            expected = model(x)
        report = kernelize(model)
        with torch.no_grad():
            torch.testing.assert_close(model(x), expected)
        last = "0" if first == "channels_last" else "1"
        assert report.routed == (last,)
        assert [row.path for row in report.rows if row.status == "rejected"] == [
            "1" if last == "0" else "0"
        ]
    finally:
        unregister_layer(LAYOUT_NORM)


class GroupedNorm(Norm):
    """An RMSNorm over groups of ``group_size`` of the last dimension (Zamba2's, Qwen's
    hyper-connection norms): one class, one weight shape, as many results as group sizes."""

    def __init__(self, group_size: int, layer_idx: int = 0) -> None:
        super().__init__()
        self.group_size = group_size
        self.layer_idx = layer_idx

    def forward(self, x: Any) -> Any:
        groups = x.reshape(*x.shape[:-1], -1, self.group_size)
        normed = torch.nn.functional.rms_norm(groups, (self.group_size,), None, self.eps)
        return normed.flatten(-2) * self.weight


def test_instances_with_other_integer_settings_are_verified_each() -> None:
    # The outcome of the whole-row instance was reused for the grouped one (integers were
    # left out of what tells instances apart): routed, 1.2 off, "verified".
    name = f"{__name__}:GroupedNorm"
    register_layer(name, op="layernorm.rmsnorm", args=norm_args)
    try:
        model = torch.nn.Sequential(GroupedNorm(8), GroupedNorm(8, layer_idx=1), GroupedNorm(2))
        x = torch.randn(2, 8)
        with torch.no_grad():
            expected = model[2](x)
        report = kernelize(model)
        assert report.routed == ("0", "1")
        assert report.rejected == ("2",)
        with torch.no_grad():
            torch.testing.assert_close(model[2](x), expected)
    finally:
        unkernelize(model)
        unregister_layer(name)


class OffsetNorm(Norm):
    """An RMSNorm scaling by ``offset + weight``, its offset a one-element buffer (0: Llama's
    norm, 1: Gemma's)."""

    def __init__(self, offset: float) -> None:
        super().__init__()
        self.register_buffer("offset", torch.tensor(offset))

    def forward(self, x: Any) -> Any:
        normed = torch.nn.functional.rms_norm(x, (x.shape[-1],), None, self.eps)
        return normed * (self.offset + self.weight)


def test_instances_with_other_values_in_a_one_element_buffer_are_verified_each() -> None:
    # Buffers were left out of what tells instances apart: the offset-1 norm reused the
    # offset-0 one's passing outcome and was routed, 2.6 off.
    name = f"{__name__}:OffsetNorm"
    register_layer(name, op="layernorm.rmsnorm", args=norm_args)
    try:
        model = torch.nn.Sequential(OffsetNorm(0.0), OffsetNorm(1.0))
        x = torch.randn(2, 8)
        with torch.no_grad():
            expected = model(x)
        report = kernelize(model)
        assert (report.routed, report.rejected) == (("0",), ("1",))
        with torch.no_grad():
            torch.testing.assert_close(model(x), expected)
    finally:
        unkernelize(model)
        unregister_layer(name)


class BiasedNorm(torch.nn.Module):
    """An RMSNorm with a bias, as a new layer starts: a weight of ones, a bias of zeros."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.bias = torch.nn.Parameter(torch.zeros(hidden))
        self.eps = 1e-6

    def forward(self, x: Any) -> Any:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps) + self.bias


def test_a_mapping_right_only_for_a_new_layers_weights_is_rejected_before_they_load() -> None:
    # Verified on the weights a new layer starts with (the way engines kernelize: build,
    # kernelize, load), a mapping that drops the bias passed, and the loaded weights ran it.
    def rms(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)

    registry = _registry(rms)
    name = f"{__name__}:BiasedNorm"
    trained = {"weight": 1 + torch.randn(8), "bias": torch.randn(8)}
    x = torch.randn(3, 8)
    register_layer(name, op="layernorm.rmsnorm", args=norm_args)  # drops the bias
    try:
        model = torch.nn.Sequential(BiasedNorm())
        report = kernelize(model, registry=registry)
        assert report.rejected == ("0",)
        assert "constant parameters" in report.row("0").reason
        model[0].load_state_dict(trained)
        with torch.no_grad():
            assert torch.equal(model(x), BiasedNorm.forward(model[0], x))
    finally:
        unregister_layer(name)
    register_layer(
        name,
        op="layernorm.rmsnorm",
        args=norm_args,
        output=lambda module, y, x: y + module.bias,
    )
    try:
        model = torch.nn.Sequential(BiasedNorm())
        assert kernelize(model, registry=registry).routed == ("0",)
        model[0].load_state_dict(trained)
        with torch.no_grad():
            torch.testing.assert_close(model(x), BiasedNorm.forward(model[0], x))
    finally:
        unregister_layer(name)


def test_a_weight_of_another_dtype_than_the_input_is_verified_as_it_is(mapped: None) -> None:
    def in_input_dtype(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps) * weight.to(x.dtype)

    registry = _registry(in_input_dtype)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    same = torch.nn.Sequential(Norm().to(torch.bfloat16))  # exact when all is bfloat16
    assert kernelize(same, registry=registry).routed == ("0",)
    mixed = torch.nn.Sequential(Norm())  # a float32 weight, bfloat16 inputs: the own
    kernelize(mixed, registry=registry)  # forward's result is promoted to float32
    expected = Norm.forward(mixed[0], x)
    assert expected.dtype == torch.float32
    with pytest.warns(KernelizeWarning, match="'0' runs its own forward for bfloat16"):
        assert mixed(x).dtype == torch.float32  # the bfloat16 verdict of `same` is not reused
    torch.testing.assert_close(mixed(x), expected)
    same[0].float()  # the weight made float32 after its bfloat16 calls were routed
    with pytest.warns(KernelizeWarning, match="'0' runs its own forward for bfloat16"):
        assert same(x).dtype == torch.float32
    torch.testing.assert_close(same(x), Norm.forward(same[0], x))
    unkernelize(same)
    unkernelize(mixed)


class _RightForwardWrongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Any, weight: Any, eps: float) -> Any:
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps) * weight

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        x, weight = ctx.saved_tensors  # as if the normalisation had no gradient
        return grad * weight, (grad * x).reshape(-1, x.shape[-1]).sum(0), None


def _applying(function: Any) -> Any:
    """An rmsnorm implementation running the autograd function ``function``."""

    def fast(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        return function.apply(x, weight, eps)

    return fast


def _training_registry(fast: Any) -> KernelRegistry:
    """A registry whose rmsnorm has a right reference and ``fast`` above it (both train)."""

    def right(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps) * weight

    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    registry.register(
        KernelSpec("layernorm.rmsnorm", "torch", right, reference=True, traits=("backward",))
    )
    registry.register(
        KernelSpec("layernorm.rmsnorm", "fast", fast, priority=5, traits=("backward",))
    )
    return registry


def test_training_mode_rejects_an_implementation_whose_gradients_are_wrong(mapped: None) -> None:
    def wrong_backward(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        return _RightForwardWrongBackward.apply(x, weight, eps)

    registry = _training_registry(wrong_backward)
    model, plain = torch.nn.Sequential(Norm()), torch.nn.Sequential(Norm())
    plain.load_state_dict(model.state_dict())
    assert kernelize(model, registry=registry).routed == ("0",)  # its forward is right
    row = kernelize(model, registry=registry, mode="training").row("0")
    assert row.status == "rejected"
    assert "gradient" in row.reason
    assert "implementation tried: fast" in row.reason
    x = torch.randn(3, 5, 8)
    for m in (model, plain):
        (m(x) * torch.arange(8.0)).sum().backward()
    torch.testing.assert_close(model[0].weight.grad, plain[0].weight.grad)
    unkernelize(model)


def test_training_mode_checks_the_gradients_of_frozen_weights_too(mapped: None) -> None:
    # Frozen when kernelized, unfrozen later (or another model of the kind, trained whole):
    # the wrong weight gradient must not run for either.
    registry = _training_registry(_applying(_WrongWeightGradient))
    model, plain = torch.nn.Sequential(Norm()), torch.nn.Sequential(Norm())
    plain.load_state_dict(model.state_dict())
    model[0].weight.requires_grad_(False)
    row = kernelize(model, registry=registry, mode="training").row("0")
    assert row.status == "rejected"
    assert "gradients of layernorm.rmsnorm (fast) differ" in row.reason
    assert model[0].weight.requires_grad is False  # verification leaves it frozen
    model[0].weight.requires_grad_(True)
    x = torch.randn(3, 5, 8)
    for m in (model, plain):
        (m(x) * torch.arange(8.0)).sum().backward()
    torch.testing.assert_close(model[0].weight.grad, plain[0].weight.grad)
    other = torch.nn.Sequential(Norm())
    assert kernelize(other, registry=registry, mode="training").row("0").status == "rejected"
    unkernelize(model)
    unkernelize(other)


def _no_backward_rmsnorm(x: Any, weight: Any, eps: float = 1e-6) -> Any:
    """A kernel writing into its own buffer, outside autograd, declaring no backward: once
    trained, the layers before it would get no gradient at all (grad None, which AdamW
    skips without a word)."""
    out = torch.empty_like(x)
    with torch.no_grad():
        out.copy_(torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps) * weight)
    return out


def _kernelized_without_backward() -> tuple[Any, Any, KernelRegistry]:
    """``(model, plain, registry)``: a Linear then a Norm routed (for inference) to
    :func:`_no_backward_rmsnorm`, the same unmodified, and the registry."""
    fast = _no_backward_rmsnorm
    registry = _training_registry(fast)
    registry.register(KernelSpec("layernorm.rmsnorm", "fast", fast, priority=5), replace=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Norm())
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), Norm())
    plain.load_state_dict(model.state_dict())
    assert kernelize(model, registry=registry).routed == ("1",)
    return model, plain, registry


def test_a_model_kernelized_for_inference_refuses_a_backward_through_a_kernel_without_one(
    mapped: None,
) -> None:
    model, plain, registry = _kernelized_without_backward()
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x))
    torch.testing.assert_close(model(x), plain(x))  # a forward with gradients on runs too
    with pytest.raises(KernelizeError, match=r"'1' ran layernorm.rmsnorm \(fast\), which "):
        model(x).sum().backward()
    # Kernelized for training, the module keeps its own forward and trains.
    model.zero_grad()
    assert kernelize(model, registry=registry, mode="training").row("1").status == "kept"
    for m in (model, plain):
        m(x).sum().backward()
    torch.testing.assert_close(model[0].weight.grad, plain[0].weight.grad)
    unkernelize(model)


def test_a_compiled_model_kernelized_for_inference_trains_through_the_ops_reference(
    mapped: None,
) -> None:
    # torch.compile cannot trace a backward that raises: where autograd records, the
    # compiled graph runs the op's reference in place of the kernel declaring none, and
    # the layers before it get their gradients (before, they got none, without a word).
    model, plain, _ = _kernelized_without_backward()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(3, 5, 8)
    for m in (compiled, plain):
        (m(x) * torch.arange(8.0)).sum().backward()
    torch.testing.assert_close(model[0].weight.grad, plain[0].weight.grad)
    torch.testing.assert_close(model[1].weight.grad, plain[1].weight.grad)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), plain(x))  # inference still runs the kernel
    unkernelize(model)
    torch._dynamo.reset()


def _rmsnorm_backward(ctx: Any, grad: Any) -> Any:
    """The gradients of ``rms_norm(x) * weight``, in torch ops (differentiable again)."""
    x, weight = ctx.saved_tensors
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ctx.eps)
    scaled = grad * weight
    grad_x = rstd * scaled - x * rstd.pow(3) * (scaled * x).mean(-1, keepdim=True)
    return grad_x, (grad * x * rstd).reshape(-1, x.shape[-1]).sum(0), None


class _RightForwardRightBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Any, weight: Any, eps: float) -> Any:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps) * weight

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return _rmsnorm_backward(ctx, grad)


class _OnceDifferentiable(_RightForwardRightBackward):
    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Any) -> Any:
        return _rmsnorm_backward(ctx, grad)


class _WrongWeightGradient(_RightForwardRightBackward):
    """The input's gradient right, the weight's twice what it should be."""

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        grad_x, grad_weight, _ = _rmsnorm_backward(ctx, grad)
        return grad_x, 2 * grad_weight, None


class _NotDifferentiableAgain(_RightForwardRightBackward):
    """Right gradients, computed outside the graph: differentiating them again sees none."""

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        with torch.no_grad():
            return _rmsnorm_backward(ctx, grad)


@pytest.mark.parametrize("function", [_NotDifferentiableAgain, _OnceDifferentiable])
def test_training_mode_rejects_a_backward_whose_gradients_are_silently_not_differentiable(
    mapped: None, function: Any
) -> None:
    # A gradient penalty (create_graph=True) through a backward computed outside the graph
    # would leave the layer's second-order terms out, its weight without a gradient. One
    # that says it is differentiable once raises at double backward instead: it is routed.
    registry = _training_registry(_applying(function))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Norm())
    plain = copy.deepcopy(model)
    row = kernelize(model, registry=registry, mode="training").row("1")
    if function is _OnceDifferentiable:
        assert row.status == "routed", row.reason
        unkernelize(model)
        return
    assert row.status == "rejected"
    assert "second-order gradient" in row.reason
    for m in (model, plain):
        x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
        (grad,) = torch.autograd.grad((m(x) * torch.arange(8.0)).sum(), x, create_graph=True)
        grad.pow(2).sum().backward()
    torch.testing.assert_close(model[1].weight.grad, plain[1].weight.grad)
    unkernelize(model)


def test_a_dtype_first_seen_inside_gradient_checkpointing_is_verified_without_breaking_it(
    mapped: None,
) -> None:
    # Its gradients are verified inside the checkpointed forward: the checkpoint must not
    # count the probes' saved tensors among the forward's.
    registry = _training_registry(_applying(_RightForwardRightBackward))
    model, plain = torch.nn.Sequential(Norm()), torch.nn.Sequential(Norm())
    plain.load_state_dict(model.state_dict())
    assert kernelize(model, registry=registry, mode="training").routed == ("0",)
    x = torch.randn(3, 5, 8, dtype=torch.float64)  # decided and verified on its first call
    for m in (model, plain):
        out = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False)
        (out * torch.arange(8.0)).sum().backward()
    torch.testing.assert_close(model[0].weight.grad, plain[0].weight.grad)
    with kernreg.trace() as trace:
        model(x)
    assert [call.implementation for call in trace.calls] == ["fast"]
    unkernelize(model)


@pytest.mark.parametrize("function", [_RightForwardRightBackward, _RightForwardWrongBackward])
def test_training_mode_checks_gradients_even_when_kernelized_under_inference_mode(
    mapped: None, function: Any
) -> None:
    registry = _training_registry(_applying(function))
    model = torch.nn.Sequential(Norm())
    with torch.inference_mode():  # the probes are inference tensors
        row = kernelize(model, registry=registry, mode="training").row("0")
    if function is _RightForwardRightBackward:
        assert row.status == "routed", row.reason
    else:
        assert row.status == "rejected"
        assert "the gradients of layernorm.rmsnorm (fast) differ" in row.reason
    unkernelize(model)


def test_a_wrong_implementation_is_rejected_with_its_error(mapped: None) -> None:
    def wrong(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps) * (1 + weight)

    model = torch.nn.Sequential(Norm())
    x = torch.randn(3, 8)
    expected = model(x)
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    registry.register(KernelSpec("layernorm.rmsnorm", "torch", wrong, reference=True))
    registry.register(KernelSpec("layernorm.rmsnorm", "wrong", wrong, priority=5))
    row = kernelize(model, registry=registry).row("0")
    assert row.status == "rejected"
    assert row.reason.startswith("verification failed: layernorm.rmsnorm (wrong) differs")
    assert "implementation tried: wrong" in row.reason
    torch.testing.assert_close(model(x), expected)
    assert "forward" not in vars(model[0])


def test_pins_that_match_nothing_warn_with_what_was_meant(mapped: None) -> None:
    model = torch.nn.ModuleDict({"norm": Norm()})
    with pytest.warns(KernelizeWarning, match=r"matches no op .*did you mean 'layernorm.rmsnorm'"):
        kernelize(model, pin={"layernorm.rmsnrom@norm": "torch"})
    with pytest.warns(KernelizeWarning, match=r"matches no module .*did you mean 'norm'"):
        kernelize(model, pin={"layernorm.rmsnorm@nrom": "torch"})
    unkernelize(model)


def test_a_pin_whose_op_and_module_never_meet_warns(mapped: None) -> None:
    model = torch.nn.ModuleDict({"norm": Norm()})
    # the op exists, the module exists, but the module is not routed through that op
    with pytest.warns(KernelizeWarning, match=r"'activation.silu_mul@norm' matches no module"):
        report = kernelize(model, pin={"activation.silu_mul@norm": "torch"})
    assert report.row("norm").implementation != "torch"
    unkernelize(model)


def test_a_pin_keyed_by_an_op_alone_says_how_to_pin_that_op(mapped: None) -> None:
    model = torch.nn.ModuleDict({"norm": Norm()})
    # a key without '@' is a module glob: the op's name matches no module
    with pytest.warns(KernelizeWarning, match=r"did you mean 'layernorm.rmsnorm@\*'"):
        report = kernelize(model, pin={"layernorm.rmsnorm": "torch"})
    assert report.row("norm").implementation != "torch"
    unkernelize(model)


def test_a_kernreg_pin_naming_no_op_warns_with_what_was_meant(mapped: None) -> None:
    from kernreg.config import load_config

    model = torch.nn.ModuleDict({"norm": Norm()})
    config = load_config({"KERNREG_PIN": "layernorm.rmsnrom=torch"})
    registry = KernelRegistry(config=config, platform=Platform.parse("cpu"))
    rms_norm = torch.nn.functional.rms_norm
    impl = lambda x, w, eps: rms_norm(x, (x.shape[-1],), None, eps) * w  # noqa: E731
    registry.register(KernelSpec("layernorm.rmsnorm", "torch", impl, reference=True))
    # An op-wide pin of configuration whose op is misspelt pins nothing: said, not silent.
    with pytest.warns(
        KernelizeWarning,
        match=r"pin 'layernorm.rmsnrom=torch' \(KERNREG_PIN\) matches no op .*"
        r"did you mean 'layernorm.rmsnorm'",
    ):
        kernelize(model, registry=registry)
    unkernelize(model)


def test_a_mapping_naming_a_missing_class_is_reported(mapped: None) -> None:
    modeling = types.ModuleType("kr_test_modeling")
    # Not a subclass of the mapped Norm (that is reported as an unmapped subclass).
    modeling.Norm = type("Norm", (torch.nn.Identity,), {"__module__": "kr_test_modeling"})  # type: ignore[attr-defined]
    sys.modules["kr_test_modeling"] = modeling
    register_layer("kr_test_modeling:NromRMSNorm", op="layernorm.rmsnorm", args=norm_args)
    try:
        model = torch.nn.Sequential(modeling.Norm())  # type: ignore[attr-defined]
        with pytest.warns(KernelizeWarning, match="kr_test_modeling:NromRMSNorm"):
            report = kernelize(model)
        assert report.unresolved == (
            "kr_test_modeling:NromRMSNorm (op 'layernorm.rmsnorm'): no such layer",
        )
        assert "unresolved mapping: kr_test_modeling:NromRMSNorm" in str(report)
    finally:
        unregister_layer("kr_test_modeling:NromRMSNorm")
        del sys.modules["kr_test_modeling"]


def _seed_oss_with_dropout() -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.SeedOssConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=96,
        max_position_embeddings=64,
        pad_token_id=0,
        residual_dropout=0.5,
    )
    torch.manual_seed(0)
    return transformers.SeedOssForCausalLM(config)


def test_training_mode_keeps_an_mlp_whose_forward_applies_dropout() -> None:
    model = _seed_oss_with_dropout().train()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(3)
    expected = model(ids).logits
    with pytest.warns(KernelizeWarning, match="SiLUActivation looks like a"):
        report = kernelize(model, mode="training")  # the MLPs' activations are left out
    mlps = [row for row in report.rows if row.path.endswith(".mlp")]
    assert [row.status for row in mlps] == ["rejected", "rejected"]
    torch.manual_seed(3)
    torch.testing.assert_close(model(ids).logits, expected)
    unkernelize(model)


def test_an_mlp_routed_for_inference_applies_its_dropout_again_once_trained() -> None:
    model = _seed_oss_with_dropout().eval()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    report = kernelize(model)
    mlps = [row for row in report.rows if row.path.endswith(".mlp")]
    assert [row.status for row in mlps] == ["routed", "routed"]
    assert all("computes otherwise in training mode" in row.reason for row in mlps)
    model.train()
    torch.manual_seed(3)
    routed = model(ids).logits
    unkernelize(model)
    torch.manual_seed(3)
    torch.testing.assert_close(routed, model(ids).logits)
    # Back in eval mode the route runs again, and agrees with the own forward.
    model.eval()
    expected = model(ids).logits
    kernelize(model)
    torch.testing.assert_close(model(ids).logits, expected)
    unkernelize(model)


class BatchNormed(Norm):
    """A norm whose forward also runs a batch norm (which counts nothing in the output)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x: Any) -> Any:
        y = super().forward(x)
        return y + 0 * self.bn(y.reshape(-1, 8)).reshape(y.shape)


def test_verifying_in_training_mode_leaves_batch_norm_statistics_alone() -> None:
    register_layer(f"{__name__}:BatchNormed", op="layernorm.rmsnorm", args=norm_args)
    try:
        for mode in ("inference", "training"):
            model = torch.nn.Sequential(BatchNormed()).eval()
            before = {k: v.clone() for k, v in model.state_dict().items()}
            kernelize(model, mode=mode)  # type: ignore[arg-type]
            after = model.state_dict()
            assert all(torch.equal(before[k], after[k]) for k in before), mode
            unkernelize(model)
    finally:
        unregister_layer(f"{__name__}:BatchNormed")


class GatedMLP(torch.nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.up_proj = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.down_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: Any) -> Any:
        gate = torch.nn.functional.silu(self.gate_proj(x))
        return self.down_proj(gate * self.up_proj(x))


def gated_mlp_args(module: Any, x: Any) -> tuple[Any, ...]:
    return (module.gate_proj(x), module.up_proj(x))


def gated_mlp_output(module: Any, result: Any, x: Any) -> Any:
    return module.down_proj(result)


def _silu_mul(gate: Any, up: Any) -> Any:
    return torch.nn.functional.silu(gate) * up


def _silu_mul_in_bfloat16(gate: Any, up: Any) -> Any:
    # Right for bfloat16 inputs; rounds float32 ones to bfloat16.
    return _silu_mul(gate.bfloat16(), up.bfloat16()).to(gate.dtype)


def test_a_swap_kernelized_inside_an_autocast_region_is_verified_for_the_models_dtype() -> None:
    # Autocast rounds the probes' projections to bfloat16, where an implementation that
    # computes in bfloat16 agrees with the own forward: float32 calls would then run it.
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    registry.register(KernelSpec("activation.silu_mul", "torch", _silu_mul, reference=True))
    registry.register(KernelSpec("activation.silu_mul", "bf16", _silu_mul_in_bfloat16, priority=5))
    layer = f"{__name__}:GatedMLP"
    register_layer(layer, op="activation.silu_mul", args=gated_mlp_args, output=gated_mlp_output)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(GatedMLP())
        x = torch.randn(2, 5, 16)
        expected = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            row = kernelize(model, registry=registry).row("0")
        assert row.status == "rejected"
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
        # Nor does an outcome found under autocast serve a kernelize outside it.
        unkernelize(model)
        assert kernelize(model, registry=registry).row("0").status == "rejected"
        unkernelize(model)
    finally:
        unregister_layer(layer)


# -- verification while the model's other threads call it ---------------------------------


class FreshNorm(torch.nn.Module):
    """A norm as a new layer starts: weights of ones (verified again with them perturbed),
    and a dropout its forward applies in training mode only."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.eps = 1e-6
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x: Any) -> Any:
        if self.training and PROBING.probing and not PROBING.inside.is_set():
            PROBING.inside.set()  # verification runs this forward in training mode
            PROBING.called.wait(10)
        y = torch.nn.functional.rms_norm(x, (x.shape[-1],), None, self.eps) * self.weight
        return self.dropout(y)


class _Probing:
    def __init__(self) -> None:
        self.probing = False
        self.inside = threading.Event()  # verification is in the window
        self.called = threading.Event()  # the other thread's call is made


PROBING = _Probing()


def _while_verifying(model: Any, x: Any) -> dict[str, Any]:
    """The outcome of ``model(x)`` called in another thread while ``kernelize`` verifies a
    swap of its layer (held in the window where verification runs the layer otherwise than
    the model does: perturbed weights, training mode)."""
    seen: dict[str, Any] = {}

    def other() -> None:
        PROBING.inside.wait(10)
        seen["output"] = model(x)
        seen["training"] = model[0].training
        seen["weight"] = model[0].weight.detach().clone()
        PROBING.called.set()

    def blocking(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        if not bool((weight == 1).all()) and not PROBING.inside.is_set():
            PROBING.inside.set()  # the pass with the weights perturbed
            PROBING.called.wait(10)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps) * weight

    thread = threading.Thread(target=other)
    thread.start()
    try:
        kernelize(model, registry=_registry(blocking))
    finally:
        PROBING.inside.set()
        thread.join()
    return seen


@pytest.fixture
def fresh() -> Iterator[None]:
    register_layer(f"{__name__}:FreshNorm", op="layernorm.rmsnorm", args=norm_args)
    PROBING.__init__()  # type: ignore[misc]
    try:
        yield
    finally:
        unregister_layer(f"{__name__}:FreshNorm")


@pytest.mark.parametrize("window", ["perturbed weights", "training mode"])
def test_a_call_in_another_thread_while_kernelize_verifies_runs_the_model_as_it_is(
    fresh: None, window: str
) -> None:
    model = torch.nn.Sequential(FreshNorm()).eval()
    x = torch.randn(2, 3, 8)
    expected = model(x)
    PROBING.probing = window == "training mode"
    seen = _while_verifying(model, x)
    assert PROBING.called.is_set()  # the call was made inside the window
    assert seen["training"] is False
    assert torch.equal(seen["weight"], torch.ones(8))
    torch.testing.assert_close(seen["output"], expected, rtol=0, atol=0)
    assert not model[0].training
    assert not model[0].dropout.training
    torch.testing.assert_close(model(x), expected)

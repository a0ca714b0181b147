"""The layer contract and ``kernelize`` on small hand-written modules (no model library)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kernreg_ops")

import kernreg  # noqa: E402
from kernreg import KernelRegistry, KernelSpec, Platform, StrictFallbackError  # noqa: E402
from kernreg.config import Config  # noqa: E402
from kernreg.torch import (  # noqa: E402
    LayerConflictError,
    kernelize,
    layer,
    layer_mapping,
    register_layer,
    unkernelize,
    unregister_layer,
)
from kernreg.torch.kernelize import (  # noqa: E402
    KernelizeError,
    KernelizeVerificationError,
    KernelizeWarning,
    routing_of,
)


def _python(code: str, env: dict[str, str], *options: str) -> str:
    """What ``python [options] -c code`` prints in a fresh process with ``env``."""
    done = subprocess.run(
        [sys.executable, *options, "-c", code], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


class Norm(torch.nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.eps = 1e-6

    def forward(self, x: Any) -> Any:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * (
            self.weight
        )


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = Norm()
        self.proj = torch.nn.Linear(16, 16)
        self.norm2 = Norm()

    def forward(self, x: Any) -> Any:
        return self.norm2(self.proj(self.norm1(x)))


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


def _cpu(*specs: KernelSpec) -> KernelRegistry:
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))
    for spec in specs:
        registry.register(spec)
    return registry


def _ref(x: Any, weight: Any, eps: float = 1e-6) -> Any:
    return Norm.forward(_Holder(weight, eps), x)


class _Holder:
    def __init__(self, weight: Any, eps: float) -> None:
        self.weight, self.eps = weight, eps


def _fast(x: Any, weight: Any, eps: float = 1e-6) -> Any:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps) * weight


def test_routes_keeps_state_dict_and_undoes(mapped: None) -> None:
    model = Block()
    x = torch.randn(3, 16)
    expected = model(x)
    keys = list(model.state_dict())
    report = kernelize(model)
    assert report.routed == ("norm1", "norm2")
    assert report.row("norm1").implementation == "aten"
    assert report.row("norm1").rule == "priority"
    # Routed from a subclass named as its class is (the forward is not set on the
    # instance: dynamo guards that per module and per compiled call).
    assert isinstance(model.norm1, Norm)
    assert type(model.norm1).__name__ == "Norm"
    assert type(model.norm1).forward is not Norm.forward
    torch.testing.assert_close(model(x), expected)
    assert list(model.state_dict()) == keys
    clone = copy.deepcopy(model)
    torch.testing.assert_close(clone(x), expected)
    assert clone.norm1.forward.__self__ is clone.norm1
    assert report.undo() == 2
    assert "forward" not in vars(model.norm1)
    assert type(model.norm1) is Norm
    assert unkernelize(model) == 0


class NamedInput(Norm):
    """A norm whose forward names its input otherwise than the mapping's argument map."""

    def forward(self, hidden: Any) -> Any:
        return super().forward(hidden)


def test_a_routed_module_takes_its_input_by_the_name_its_own_forward_gives_it(
    mapped: None,
) -> None:
    # torch.nn.LayerNorm's forward names its input `input`; the pack's map, `hidden_states`.
    model = torch.nn.ModuleDict({"ln": torch.nn.LayerNorm(16), "norm": NamedInput()})
    x = torch.randn(3, 16)
    expected = (model.ln(input=x), model.norm(hidden=x))
    register_layer(f"{__name__}:NamedInput", op="layernorm.rmsnorm", args=norm_args)
    try:
        assert kernelize(model).routed == ("ln", "norm")
        torch.testing.assert_close((model.ln(input=x), model.norm(hidden=x)), expected)
        torch.testing.assert_close((model.ln(x), model.norm(x)), expected)
        unkernelize(model)
        lambda_args = {"args": lambda module, x: (x, module.weight, module.eps)}
        register_layer(
            f"{__name__}:NamedInput", op="layernorm.rmsnorm", replace=True, **lambda_args
        )
        # A map whose expression cannot be compiled in is called: the names hold too.
        assert kernelize(model).routed == ("ln", "norm")
        torch.testing.assert_close(model.norm(hidden=x), expected[1])
    finally:
        unkernelize(model)
        unregister_layer(f"{__name__}:NamedInput")


def _norm_and_routing_args(module: Any, x: Any, top_k_index: Any) -> tuple[Any, ...]:
    return (x, module.weight, module.eps)


def test_a_mapping_needing_inputs_the_forward_does_not_take_is_skipped_not_rejected() -> None:
    # Llama 4's experts take the tokens already dispatched; the pattern mapping of the
    # experts also wants their routing: no call of the forward could feed it.
    model = torch.nn.ModuleDict({"norm": NamedInput()})
    register_layer(f"{__name__}:NamedInput", op="layernorm.rmsnorm", args=_norm_and_routing_args)
    try:
        row = kernelize(model, strict=True).row("norm")
    finally:
        unregister_layer(f"{__name__}:NamedInput")
    assert row.status == "skipped"
    assert row.reason == (
        "the mapping's argument map takes 'top_k_index', which its forward does not take: "
        "own forward kept"
    )
    assert "forward" not in vars(model.norm)


class ResidualNorm(Norm):
    """A norm whose forward takes an optional input the mapping's argument map does not pass."""

    def forward(self, x: Any, residual: Any = None, *, scale: float = 1.0) -> Any:
        if residual is not None:
            x = x + residual
        return super().forward(x) * scale


class MaskedNorm(Norm):
    """A norm whose forward takes a required input the mapping's argument map does not pass."""

    def forward(self, x: Any, mask: Any) -> Any:
        return super().forward(x * mask)


@pytest.mark.parametrize("maps", ["function", "lambda"])
def test_a_module_runs_its_own_forward_for_inputs_the_mapping_does_not_pass(maps: str) -> None:
    # forward(self, x, residual=None) mapped with args (module, x) was routed, and every
    # call that passed residual raised TypeError.
    calls: list[Any] = []

    def fast(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        calls.append(x)
        return _ref(x, weight, eps)

    registry = _cpu(
        KernelSpec("layernorm.rmsnorm", "torch", _ref, reference=True),
        KernelSpec("layernorm.rmsnorm", "fast", fast, priority=5),
    )
    args = norm_args if maps == "function" else lambda module, x: (x, module.weight, module.eps)
    names = [f"{__name__}:ResidualNorm", f"{__name__}:MaskedNorm"]
    for name in names:
        register_layer(name, op="layernorm.rmsnorm", args=args)
    model = torch.nn.ModuleDict({"norm": ResidualNorm(), "masked": MaskedNorm()})
    x, residual, mask = torch.randn(3, 16), torch.randn(3, 16), torch.ones(3, 16)
    expected = [
        model.norm(x),
        model.norm(x, residual),
        model.norm(x, residual=residual, scale=2.0),
        model.masked(x, mask),
    ]
    try:
        report = kernelize(model, registry=registry)
        row = report.row("norm")
        assert row.status == "routed"
        assert row.reason.endswith(
            "; a call that passes 'residual' or 'scale' runs the own forward"
        )
        masked = report.row("masked")
        assert (masked.status, masked.reason) == (
            "skipped",
            "its forward takes 'mask', which the mapping's argument map does not pass: "
            "own forward kept",
        )
        calls.clear()
        got = [
            model.norm(x),
            model.norm(x, residual),
            model.norm(x, residual=residual, scale=2.0),
            model.masked(x, mask),
        ]
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b)
        assert len(calls) == 1  # the call without residual and scale, routed
    finally:
        unkernelize(model)
        for name in names:
            unregister_layer(name)


class GatheringNorm(Norm):
    """An engine-style norm whose forward gathers its inputs and returns a tuple when
    given a residual."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._norm(*args, **kwargs)

    def _norm(self, x: Any, residual: Any = None) -> Any:
        if residual is None:
            return super().forward(x)
        x = x + residual
        return super().forward(x), x


def test_a_module_whose_forward_gathers_its_inputs_runs_its_own_for_other_calls(
    mapped: None,
) -> None:
    # forward(self, *args, **kwargs) was routed with a forward taking the map's input
    # alone: norm(x, residual) and norm(x, residual=r) raised TypeError once kernelized.
    name = f"{__name__}:GatheringNorm"
    register_layer(name, op="layernorm.rmsnorm", args=norm_args)
    model = torch.nn.ModuleDict({"norm": GatheringNorm()})
    x, residual = torch.randn(3, 16), torch.randn(3, 16)
    calls = [
        lambda: model.norm(x),
        lambda: model.norm(x, residual),
        lambda: model.norm(x, residual=residual),
        lambda: model.norm(x=x),
    ]
    expected = [call() for call in calls]
    try:
        row = kernelize(model).row("norm")
        assert row.status == "routed"
        assert row.reason.endswith(
            "; a call with other inputs than the mapping's 1, positionally, runs the own forward"
        )
        for call, want in zip(calls, expected, strict=True):
            torch.testing.assert_close(call(), want)
    finally:
        unkernelize(model)
        unregister_layer(name)


def test_reference_only_keeps_the_model_forward(mapped: None) -> None:
    registry = _cpu(KernelSpec("layernorm.rmsnorm", "torch", _ref, reference=True))
    model = Block()
    report = kernelize(model, registry=registry)
    assert report.routed == ()
    row = report.row("norm2")
    assert (row.status, row.implementation, row.rule) == ("kept", "torch", "reference")
    assert "only the reference is eligible" in row.reason
    assert "forward" not in vars(model.norm2)
    with pytest.raises(StrictFallbackError):
        kernelize(model, registry=registry, strict=True)


def test_the_autotune_policy_is_said_not_silently_ignored(mapped: None) -> None:
    """Under ``KERNREG_POLICY`` an op call is measured per shape; a kernelized layer runs
    the priority choice, and the report and a warning say so."""
    specs = (
        KernelSpec("layernorm.rmsnorm", "torch", _ref, reference=True),
        KernelSpec("layernorm.rmsnorm", "fast", _fast, priority=5),
    )
    registry = _cpu(*specs)
    registry.configure(Config(policy="layernorm.*"), platform=Platform.parse("cpu"))
    model = Block()
    with pytest.warns(KernelizeWarning, match="'layernorm.rmsnorm': the autotune"):
        report = kernelize(model, registry=registry)
    row = report.row("norm1")
    assert (row.status, row.implementation, row.rule) == ("routed", "fast", "priority")
    assert "autotune policy measures calls of the op, not kernelized layers" in row.reason
    pinned = kernelize(model, registry=registry, pin={"layernorm.rmsnorm@*": "fast"})
    assert "autotune" not in pinned.row("norm1").reason
    other = _cpu(*specs)  # without the policy: nothing said
    assert "autotune" not in kernelize(model, registry=other).row("norm1").reason


def test_a_module_two_models_hold_is_said_to_run_one_decision(mapped: None) -> None:
    """One module held by two kernelized models has one forward: the second kernelize
    warns that its decision now holds in both; a deep copy's modules are its own."""
    specs = (
        KernelSpec("layernorm.rmsnorm", "torch", _ref, reference=True),
        KernelSpec("layernorm.rmsnorm", "fast", _fast, priority=5),
    )
    registry = _cpu(*specs)
    first, second = Block(), Block()
    second.norm1 = first.norm1
    kernelize(first, registry=registry)
    copied = copy.deepcopy(first)
    assert kernelize(copied, registry=registry).routed == ("norm1", "norm2")  # no warning
    with pytest.warns(KernelizeWarning, match=r"1 module\(s\) of this model \('norm1'\)"):
        report = kernelize(second, registry=registry, pin={"layernorm.rmsnorm@norm1": "torch"})
    assert report.row("norm1").implementation == "torch"
    with kernreg.trace() as trace:
        first(torch.randn(2, 16))
    assert [(c.implementation, c.site) for c in trace.calls] == [
        ("torch", "norm1"),
        ("fast", "norm2"),
    ]


def test_modes_require_their_traits(mapped: None) -> None:
    registry = _cpu(
        KernelSpec("layernorm.rmsnorm", "torch", _ref, reference=True),
        KernelSpec("layernorm.rmsnorm", "fast", _fast, priority=5, traits=("compile_safe",)),
    )
    model = Block()
    assert kernelize(model, registry=registry).routed == ("norm1", "norm2")
    assert kernelize(model, mode="compile", registry=registry).routed == ("norm1", "norm2")
    assert kernelize(model, mode="torch.compile", registry=registry).mode == "compile"
    training = kernelize(model, mode="training", registry=registry)
    assert training.routed == ()
    assert training.mode == "training"
    with pytest.raises(KernelizeError, match="mode 'fast' is not one of"):
        kernelize(model, mode="fast", registry=registry)  # type: ignore[arg-type]


def test_a_compile_safe_region_leaves_layers_as_kernelize_bound_them(mapped: None) -> None:
    """kernelize decides when it runs (in a fresh context): a region open then or around a
    later call changes no layer; mode="compile" is how a compiled model asks for them."""
    from kernreg.pins import compile_region

    registry = _cpu(
        KernelSpec("layernorm.rmsnorm", "torch", _ref, reference=True),
        KernelSpec("layernorm.rmsnorm", "fast", _fast, priority=5),
    )
    model, x = Block(), torch.randn(3, 16)
    with compile_region():
        assert kernelize(model, registry=registry).row("norm1").implementation == "fast"
        with kernreg.trace() as recorded:
            model(x)
    assert recorded.implementations("layernorm.rmsnorm") == {"fast": 2}
    assert kernelize(model, mode="compile", registry=registry).routed == ()


def test_site_pin_from_code_touches_only_that_site(mapped: None) -> None:
    model = Block()
    report = kernelize(model, pin={"layernorm.rmsnorm@norm2": "torch"})
    assert report.row("norm1").implementation == "aten"
    assert report.row("norm2").implementation == "torch"
    assert report.row("norm2").status == "routed"  # a pin is explicit, even to the reference
    assert "pinned" in report.row("norm2").reason
    # A glob without an op applies to every op at matching paths.
    assert kernelize(model, pin={"norm*": "torch"}).row("norm1").implementation == "torch"
    with pytest.raises(kernreg.BackendNotFoundError):
        kernelize(model, pin={"norm1": "nosuch"})


def test_site_pin_from_the_environment() -> None:
    code = (
        "import torch, kernreg\n"
        "from kernreg.torch import kernelize, register_layer\n"
        "from tests.torch.test_kernelize import Block, norm_args\n"
        "register_layer('tests.torch.test_kernelize:Norm', op='layernorm.rmsnorm', args=norm_args)\n"
        "r = kernelize(Block())\n"
        "print(r.row('norm1').implementation, r.row('norm2').implementation)\n"
        "print(kernreg.select_kernel('layernorm.rmsnorm', dtypes=['float32']).backend)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    env["KERNREG_PIN"] = "layernorm.rmsnorm@norm2=torch"
    assert _python(code, env).split() == [
        "aten",
        "torch",
        "aten",
    ]  # the op's own decision is unpinned


def test_conflicting_mapping_names_both_origins(mapped: None) -> None:
    # The same mapping again is a no-op.
    assert register_layer(NORM, op="layernorm.rmsnorm", args=norm_args) == layer_mapping(NORM)
    with pytest.raises(LayerConflictError) as info:
        register_layer(NORM, op="layernorm.rmsnorm", args=_Holder)
    message = str(info.value)
    assert message.startswith(
        f"Conflicting layer mapping for '{NORM}' (op 'layernorm.rmsnorm'): op 'layernorm.rmsnorm'"
    )
    assert message.count("test_kernelize.py:") == 2
    assert isinstance(info.value, ValueError)
    register_layer(NORM, op="layernorm.rmsnorm", args=_Holder, replace=True)
    mapping = layer_mapping(Norm)
    assert mapping is not None
    assert mapping.args is _Holder


def test_a_class_can_map_to_several_ops_and_the_verified_one_routes(mapped: None) -> None:
    # A second op for the same class is a second candidate, tried in op order.
    register_layer(NORM, op="activation.silu_mul", args=norm_args)
    assert layer_mapping(NORM, "activation.silu_mul") is not None
    assert layer_mapping(NORM, "layernorm.rmsnorm") is not None
    model = Block()
    report = kernelize(model)
    row = report.row("norm1")
    assert (row.status, row.op) == ("routed", "layernorm.rmsnorm")
    # silu_mul is tried first (op order) and fails verification: the report says so.
    assert "activation.silu_mul" in row.reason
    assert "verification failed" in row.reason


def test_class_decorator_and_lazy_names() -> None:
    @layer("layernorm.rmsnorm", args=norm_args)
    class Owned(Norm):
        pass

    try:
        mapping = layer_mapping(Owned)
        assert mapping is not None
        assert mapping.layer == f"{__name__}:test_class_decorator_and_lazy_names.<locals>.Owned"
        # Exact classes only: the parent is not mapped by its subclass's mapping.
        assert layer_mapping(Norm) is None
        model = torch.nn.Sequential(Owned(), Norm())
        assert kernelize(model).routed == ("0",)
    finally:
        unregister_layer(Owned)
    with pytest.raises(kernreg.InvalidSpecError):
        register_layer("no_colon", op="layernorm.rmsnorm", args=norm_args)


def test_registration_imports_nothing_and_cli_lists_layers() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    code = (
        "import sys, kernreg\n"
        "from kernreg.torch import layer_mappings\n"
        "names = [m.layer for m in layer_mappings()]\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "print(len(names))\n"
    )
    assert int(_python(code, env)) >= 6
    listed = subprocess.run(
        [sys.executable, "-m", "kernreg", "list", "--layers", "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    layers = {entry["layer"]: entry for entry in json.loads(listed.stdout)["layers"]}
    llama = layers["transformers.models.llama.modeling_llama:LlamaRMSNorm"]
    assert llama["op"] == "layernorm.rmsnorm"
    assert llama["kind"] == "layer"
    assert "kernreg-ops" in llama["origin"]
    rotary = layers["transformers.models.llama.modeling_llama:apply_rotary_pos_emb"]
    assert rotary["kind"] == "function"
    assert rotary["op"] == "embedding.rotary_cos_sin"
    assert rotary["args"] is None  # the call's arguments pass through


def test_new_dtype_is_decided_on_first_call_and_registry_change_rebinds(mapped: None) -> None:
    calls: list[str] = []

    def counting(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        calls.append(str(x.dtype))
        return _fast(x, weight, eps)

    registry = _cpu(
        KernelSpec("layernorm.rmsnorm", "torch", _ref, reference=True),
        KernelSpec("layernorm.rmsnorm", "fast", counting, priority=5, dtypes=("float32",)),
    )
    model = Block()
    kernelize(model, registry=registry)
    assert calls  # verification ran the implementation on probe inputs
    calls.clear()
    model.norm1(torch.randn(2, 16))
    assert calls == ["torch.float32"]
    # bfloat16 is not in the fast implementation's dtypes: the reference runs for it.
    model.norm1(torch.randn(2, 16, dtype=torch.bfloat16))
    assert calls == ["torch.float32"]
    registry.unregister("layernorm.rmsnorm", "fast")
    model.norm1(torch.randn(2, 16))
    assert calls == ["torch.float32"]


def _wrong(x: Any, weight: Any, eps: float = 1e-6) -> Any:
    return _fast(x, weight, eps) + 1


def test_a_swap_decided_again_after_kernelize_is_verified_said_and_strict(mapped: None) -> None:
    registry = _cpu(
        KernelSpec("layernorm.rmsnorm", "torch", _ref, reference=True),
        KernelSpec("layernorm.rmsnorm", "fast", _fast, priority=5),
    )
    model, strict = Block(), Block()
    strict.load_state_dict(model.state_dict())
    x = torch.randn(2, 16)
    expected = model(x)
    kernelize(model, registry=registry)
    kernelize(strict, registry=registry, strict=True)
    # Registered after kernelize: decided on the next call, verified there, and failing.
    registry.register(KernelSpec("layernorm.rmsnorm", "wrong", _wrong, priority=10))
    with pytest.warns(KernelizeWarning, match="runs its own forward for float32: ") as said:
        torch.testing.assert_close(model(x), expected)
    messages = [str(w.message) for w in said]
    assert [m.split("'")[1] for m in messages] == ["norm1", "norm2"]
    assert all("implementation tried: wrong" in m for m in messages)
    model(x)  # said once
    with pytest.raises(KernelizeVerificationError, match=r"module 'norm1'.*tried: wrong"):
        strict(x)
    registry.unregister("layernorm.rmsnorm", "wrong")
    registry.unregister("layernorm.rmsnorm", "fast")  # only the reference is left
    torch.testing.assert_close(model(x), expected)  # the own forward, as kernelize keeps it
    with pytest.raises(StrictFallbackError, match=r"'norm1'.*only the reference"):
        strict(x)


def test_a_registry_change_while_a_site_is_decided_is_followed(mapped: None) -> None:
    # The change comes while the implementation is verified (another thread's, in a real
    # program): neither kernelize nor a first call may keep what was decided before it.
    ran: list[str] = []
    registry = _cpu(KernelSpec("layernorm.rmsnorm", "torch", _ref, reference=True))

    def unregistering(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        ran.append("fast")
        if len(ran) == 1:
            registry.unregister("layernorm.rmsnorm", "fast")
        return _fast(x, weight, eps)

    fast = KernelSpec("layernorm.rmsnorm", "fast", unregistering, priority=5)
    registry.register(fast)
    model = Block()
    report = kernelize(model, registry=registry)
    assert report.routed == ()
    ran.clear()
    model(torch.randn(2, 16))
    assert ran == []
    registry.register(fast)
    kernelize(model, registry=registry, verify=False)
    model.double()  # float64 is decided and verified on the first call
    model(torch.randn(2, 16, dtype=torch.float64))
    ran.clear()
    model(torch.randn(2, 16, dtype=torch.float64))
    assert ran == []
    assert {row[4] for row in routing_of(registry)} == {"<own forward>"}


def test_trace_records_carry_the_site(mapped: None) -> None:
    model = Block()
    kernelize(model, pin={"layernorm.rmsnorm@norm2": "torch"})
    x = torch.randn(2, 16)
    model(x)  # bound without recording
    with kernreg.trace() as t:
        model(x)
    sites = [(c.site, c.implementation) for c in t.calls]
    assert sites == [("norm1", "aten"), ("norm2", "torch")]
    assert json.loads(t.to_json())["calls"][0]["site"] == "norm1"
    with kernreg.trace() as after:
        pass
    model(x)  # recording stops with the last trace
    assert len(after) == 0


def test_a_failing_plugin_leaves_no_layer_mapping_behind(tmp_path: Path) -> None:
    dist = tmp_path / "half_layers-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: half-layers\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kernreg.kernels]\nhalf = half_layers:register\n")
    (tmp_path / "half_layers.py").write_text(
        "from kernreg.torch import register_function, register_layer\n"
        "def register(registry):\n"
        "    register_layer('half_models:Norm', op='layernorm.rmsnorm', args='m:f')\n"
        "    register_function('half_models:rope', op='embedding.rotary_cos_sin')\n"
        "    raise RuntimeError('broken half way')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    code = (
        "import warnings\n"
        "warnings.simplefilter('ignore')\n"
        "from kernreg.torch import layer_mapping, layer_mappings\n"
        "names = {m.layer for m in layer_mappings()}\n"
        "assert layer_mapping('half_models:Norm') is None, names\n"
        "assert 'half_models:rope' not in names, names\n"
        "assert 'transformers.models.llama.modeling_llama:LlamaRMSNorm' in names\n"
        "print('ok')\n"
    )
    assert _python(code, env).strip() == "ok"


def test_argument_maps_run_as_imported_even_when_their_source_changed_since(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A plain one-return map is compiled into the routed forward from its source: a
    # source file edited after the import must not change what runs.
    (tmp_path / "edited_maps.py").write_text(
        "def scale(module):\n"
        "    return module.eps\n\n\n"
        "def args(module, x):\n"
        "    return (x, module.weight, scale(module))\n\n\n"
        "def doubled(module, result, x):\n"
        "    return result * 2\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import edited_maps  # type: ignore[import-not-found]

    (tmp_path / "edited_maps.py").write_text(
        "def scale(module):\n"
        "    return module.eps\n\n\n"
        "def args(module, x):\n"
        "    return (x, module.weight, scale(module))\n\n\n"
        "def doubled(module, result, x):\n"
        "    return result * 3\n",
        encoding="utf-8",
    )
    register_layer(NORM, op="layernorm.rmsnorm", args=edited_maps.args, output=edited_maps.doubled)
    try:
        model = Block()
        x = torch.randn(3, 16)
        expected = model.norm1(x) * 2
        report = kernelize(model, verify=False)
        assert report.routed == ("norm1", "norm2")
        torch.testing.assert_close(model.norm1(x), expected)
        # The same maps in a file left as imported: compiled in, same result.
        register_layer(NORM, op="layernorm.rmsnorm", args=norm_args, output=_twice, replace=True)
        kernelize(model, verify=False)
        torch.testing.assert_close(model.norm1(x), expected)
    finally:
        unregister_layer(NORM)
        unkernelize(model)


def _twice(module: Any, result: Any, x: Any) -> Any:
    return result * 2


def _counting(name: str, ran: list[str]) -> Any:
    def impl(x: Any, weight: Any, eps: float = 1e-6) -> Any:
        ran.append(name)
        return _ref(x, weight, eps)

    return impl


def test_a_compiled_kernelized_model_runs_what_each_registry_change_decides(
    mapped: None,
) -> None:
    # A graph traced through a site's first lookup kept the implementation decided then:
    # after a second registry change, the compiled model ran the first change's choice.
    ran: list[str] = []
    registry = _cpu(
        KernelSpec("layernorm.rmsnorm", "torch", _ref, reference=True),
        KernelSpec("layernorm.rmsnorm", "a", _counting("a", ran), priority=5),
    )
    model = torch.nn.Sequential(Norm())
    kernelize(model, registry=registry, verify=False)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 16)
    # Inference: where autograd records, a compiled graph runs the op's reference in
    # place of these kernels, which declare no backward.
    with torch.no_grad():
        compiled(x)
        for priority, name in enumerate(["b", "c", "d"], 10):
            registry.register(
                KernelSpec("layernorm.rmsnorm", name, _counting(name, ran), priority=priority)
            )
            ran.clear()
            compiled(x)
            compiled(x)
            assert ran == [name, name]


def test_a_plugins_mapping_replaced_or_removed_before_plugins_load_stays_so() -> None:
    # Overriding the op pack's LayerNorm mapping at start-up (before anything read the
    # registry) failed the whole pack, and removing it removed nothing: the pack loaded
    # its mapping back later.
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "import torch, kernreg\n"
        "from kernreg.torch import kernelize, layer_mapping, register_layer, unregister_layer\n"
        "LN = torch.nn.LayerNorm\n"
        "def args(module, x): return (x, module.weight, module.bias, module.eps)\n"
        "register_layer(LN, op='layernorm.layernorm', args=args, replace=True)\n"
        "print(layer_mapping(LN).args is args, 'layernorm.rmsnorm' in kernreg.default_registry())\n"
        "print(kernelize(torch.nn.Sequential(LN(8))).row('0').status)\n"
        "print(unregister_layer(LN) is not None, layer_mapping(LN))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    env["KERNREG_PLATFORM"] = "cpu"
    assert _python(code, env).split() == ["True", "True", "routed", "True", "None"]
    code = (
        "import torch\n"
        "from kernreg.torch import kernelize, unregister_layer\n"
        "unregister_layer(torch.nn.LayerNorm)\n"
        "report = kernelize(torch.nn.Sequential(torch.nn.LayerNorm(8)))\n"
        "print(len(report.routed), [u.layer for u in report.unmapped])\n"
    )
    listed = _python(code, env, "-W", "ignore").split()
    assert listed == ["0", "['torch.nn.modules.normalization:LayerNorm']"]

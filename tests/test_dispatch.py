"""get_kernel, select_kernel and op objects: the call path a user's code runs."""

from __future__ import annotations

import contextlib
import inspect
import pickle
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

import kernreg
from _support import (
    BAD_INPUT_TARGET,
    FakeDevice,
    FakeTensor,
    assert_fails_cleanly,
    cuda_registry,
    recording_impl,
    run_python,
)
from kernreg import (
    AmbiguousKernelError,
    InvalidSpecError,
    KernelLoadError,
    KernelRegistry,
    KernelSpec,
    NoEligibleKernelError,
    Platform,
    StrictFallbackError,
    get_kernel,
    use_backend,
)
from kernreg.config import Config

RMS = "layernorm.rmsnorm"


class Device:
    """Like ``torch.device``: a ``type`` and an index."""

    def __init__(self, type: str, index: int | None = None) -> None:
        self.type = type
        self.index = index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and (self.type, self.index) == (other.type, other.index)

    def __hash__(self) -> int:
        return hash((self.type, self.index))


class DType:
    """Like ``torch.bfloat16``: prints with a ``torch.`` prefix."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


BF16, FP16, FP32 = DType("bfloat16"), DType("float16"), DType("float32")
CUDA, CPU = Device("cuda", 0), Device("cpu")


class Tensor:
    def __init__(
        self, dtype: Any = FP32, device: Any = CUDA, shape: tuple[int, ...] = (2, 3)
    ) -> None:
        self.dtype = dtype
        self.device = device
        self.shape = shape


def _impl(name: str) -> Callable[..., Any]:
    def impl(*args: Any, **kwargs: Any) -> Any:
        return name

    impl.__qualname__ = impl.__name__ = name
    return impl


# --- get_kernel / select_kernel --------------------------------------------------------------


def test_get_kernel_returns_the_implementation_itself(registry: KernelRegistry) -> None:
    ref, fast = _impl("ref"), _impl("fast")
    registry.register(KernelSpec(RMS, "torch", ref, reference=True))
    registry.register(KernelSpec(RMS, "triton", fast, requires=["cuda>=8.0"]))
    assert get_kernel(RMS, registry=registry) is fast
    assert get_kernel(RMS, registry=registry) is fast
    assert get_kernel(RMS, "torch", registry=registry) is ref
    assert get_kernel(RMS, registry=registry, platform="cuda:7.0") is ref
    assert registry.get_kernel(RMS) is fast
    assert kernreg.select_kernel(RMS, registry=registry).target is fast


def test_get_kernel_imports_string_targets_once(
    registry: KernelRegistry, write_module: Callable[[str, str], str]
) -> None:
    module = write_module("kr_dispatch_kernels", "def rms(x):\n    return ('rms', x)\n")
    registry.register(KernelSpec(RMS, "triton", f"{module}:rms"))
    assert module not in sys.modules
    kernel = get_kernel(RMS, registry=registry)
    assert kernel is sys.modules[module].rms
    sys.modules[module].rms = _impl("swapped")  # a cached decision does not look again
    assert get_kernel(RMS, registry=registry) is kernel


def test_get_kernel_load_error(registry: KernelRegistry) -> None:
    registry.register(KernelSpec(RMS, "triton", "kr_no_such_module:rms"))
    with pytest.raises(kernreg.KernelLoadError, match=r"op 'layernorm\.rmsnorm', backend 'triton'"):
        get_kernel(RMS, registry=registry)


@pytest.mark.parametrize("mutation", ["unregister", "replace", "higher_priority", "configure"])
def test_get_kernel_is_never_stale(registry: KernelRegistry, mutation: str) -> None:
    ref, first, second = _impl("ref"), _impl("first"), _impl("second")
    registry.register(KernelSpec(RMS, "torch", ref, reference=True))
    registry.register(KernelSpec(RMS, "triton", first))
    assert get_kernel(RMS, registry=registry) is first
    expected = {
        "unregister": lambda: registry.unregister(RMS, "triton") and ref,
        "replace": lambda: (
            registry.register(KernelSpec(RMS, "triton", second), replace=True) and second
        ),
        "higher_priority": lambda: (
            registry.register(KernelSpec(RMS, "cuda", second, priority=1)) and second
        ),
        "configure": lambda: (
            registry.configure(
                Config(deny=(kernreg.config.Pin("*", "triton"),)), platform=Platform.parse("cpu")
            )
            or ref
        ),
    }[mutation]()
    assert get_kernel(RMS, registry=registry) is expected


def test_get_kernel_in_scoped_pin(registry: KernelRegistry) -> None:
    ref, fast = _impl("ref"), _impl("fast")
    registry.register(KernelSpec(RMS, "torch", ref, reference=True))
    registry.register(KernelSpec(RMS, "triton", fast))
    with use_backend(RMS, "torch"):
        assert get_kernel(RMS, registry=registry) is ref
    assert get_kernel(RMS, registry=registry) is fast


def test_warm_lookups_follow_blocks_opened_and_closed_anywhere(registry: KernelRegistry) -> None:
    """The warm get_kernel/select_kernel path reads whether a block is open as a global:
    it must see every block open and close (nested, other threads), with the answer of
    the caller's own context."""
    ref, fast = _impl("ref"), _impl("fast")
    registry.register(KernelSpec(RMS, "torch", ref, reference=True))
    registry.register(KernelSpec(RMS, "triton", fast))
    assert kernreg.select_kernel(RMS, registry=registry).backend == "triton"
    assert get_kernel(RMS, registry=registry) is fast
    entered, release = threading.Event(), threading.Event()
    seen: list[Any] = []

    def pinned_elsewhere() -> None:
        with use_backend(RMS, "torch"):
            seen.append(get_kernel(RMS, registry=registry))
            entered.set()
            release.wait(10)

    worker = threading.Thread(target=pinned_elsewhere)
    worker.start()
    assert entered.wait(10)
    try:  # a block open in another thread: this context keeps its answer
        assert get_kernel(RMS, registry=registry) is fast
        assert kernreg.select_kernel(RMS, registry=registry).backend == "triton"
        with use_backend(RMS, "torch"):
            assert get_kernel(RMS, registry=registry) is ref
            assert kernreg.select_kernel(RMS, registry=registry).backend == "torch"
            with use_backend(RMS, "triton"):
                assert get_kernel(RMS, registry=registry) is fast
            assert get_kernel(RMS, registry=registry) is ref
    finally:
        release.set()
        worker.join(10)
    assert seen == [ref]
    assert get_kernel(RMS, registry=registry) is fast
    assert kernreg.select_kernel(RMS, registry=registry).backend == "triton"


def test_a_gated_call_runs_only_the_generated_lookup_between_op_and_implementation(
    registry: KernelRegistry,
) -> None:
    """While the decision depends on the call, the op object calls one generated lookup
    with the reference's signature, which calls the implementation: no other layer."""
    callers: list[tuple[Any, Any]] = []

    def traced(name: str) -> Callable[..., Any]:
        def impl(x: Any) -> str:
            callers.append((sys._getframe(1).f_code, sys._getframe(2).f_code))
            return name

        return impl

    op = kernreg.op(RMS, registry=registry)(traced("ref"))
    op.register("bf16", traced("bf16"), dtypes=["bfloat16"], priority=5)
    op.register("gpu", traced("gpu"), requires=["cuda"], priority=3)
    cases = [(Tensor(BF16, CPU), "bf16"), (Tensor(FP32, CUDA), "gpu"), (Tensor(FP32, CPU), "ref")]
    for _ in range(3):  # cold, then warm
        for x, expected in cases:
            callers.clear()
            assert op(x) == expected
    lookup = callers[0][0]
    assert lookup.co_name == "gated_layernorm_rmsnorm"
    assert callers == [(lookup, op.__code__)]  # the last call, warm
    # The shape of the lookup changes (dtype+device -> dtype), then no lookup at all.
    registry.unregister(RMS, "gpu")
    for x, expected in [(Tensor(BF16, CUDA), "bf16"), (Tensor(FP32, CUDA), "ref")] * 2:
        assert op(x) == expected
    callers.clear()
    assert op(Tensor(BF16, CPU)) == "bf16"
    assert callers[0][0].co_name == "gated_layernorm_rmsnorm"
    assert callers[0][1] is op.__code__
    registry.unregister(RMS, "bf16")
    for x in (Tensor(BF16, CPU), Tensor(FP32, CUDA), 1):
        assert op(x) == "ref"
    registry.register(KernelSpec(RMS, "gpu", traced("gpu"), requires=["cuda"], priority=3))
    # An argument without a device runs on the registry's platform (a simulated GPU).
    assert [op(x) for x in (Tensor(BF16, CUDA), Tensor(BF16, CPU), 1)] == ["gpu", "ref", "gpu"]


# --- op objects: signature and forwarding ----------------------------------------------------


def ref_plain(x, y, z=3):  # type: ignore[no-untyped-def]
    return ("ref", x, y, z)


def ref_posonly(x, /, y, *, eps=1e-6, out=None):  # type: ignore[no-untyped-def]
    return ("ref", x, y, eps, out)


def ref_star(x, *rest, scale=1.0, **extra):  # type: ignore[no-untyped-def]
    return ("ref", x, rest, scale, extra)


def ref_only_star(*args, **kwargs):  # type: ignore[no-untyped-def]
    return ("ref", args, kwargs)


def ref_noargs():  # type: ignore[no-untyped-def]
    return ("ref",)


def ref_annotated(x: int, weight: list[int] | None = None, *, eps: float = 1e-5) -> tuple[Any, ...]:
    return ("ref", x, weight, eps)


SIGNATURES: list[tuple[Callable[..., Any], list[tuple[tuple[Any, ...], dict[str, Any]]]]] = [
    (ref_plain, [((1, 2), {}), ((1, 2, 4), {}), ((1,), {"y": 2}), ((), {"x": 1, "y": 2, "z": 5})]),
    (ref_posonly, [((1, 2), {}), ((1,), {"y": 2, "eps": 0.5}), ((1, 2), {"out": "o"})]),
    (ref_star, [((1,), {}), ((1, 2, 3), {"scale": 2.0}), ((1,), {"a": 1, "values": 2, "self": 3})]),
    (ref_only_star, [((), {}), ((1, 2), {"k": 3}), ((), {"self": 1, "values": 2})]),
    (ref_noargs, [((), {})]),
    (ref_annotated, [((1,), {}), ((1, [2]), {"eps": 0.1})]),
]


@pytest.mark.parametrize(
    ("reference", "calls"), SIGNATURES, ids=[r.__name__ for r, _ in SIGNATURES]
)
@pytest.mark.parametrize("mode", ["static", "gated", "pinned"])
def test_op_keeps_the_signature_and_forwards_everything(
    registry: KernelRegistry,
    reference: Callable[..., Any],
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]],
    mode: str,
) -> None:
    wrapped = kernreg.op("kr_test.sig", registry=registry)(reference)
    assert inspect.signature(wrapped, follow_wrapped=False) == inspect.signature(reference)
    assert wrapped.__name__ == reference.__name__
    assert wrapped.__doc__ == reference.__doc__
    assert wrapped.__wrapped__ is reference  # type: ignore[attr-defined]
    assert wrapped.reference is reference
    assert wrapped.op_id == "kr_test.sig"
    if mode == "gated":  # a per-call gate that never matches these plain values
        wrapped.register("triton", _impl("triton"), dtypes=["bf16"], requires=["cuda"])
    # While any use_backend block is open, calls take the generic per-call path.
    with use_backend("kr_test.*", "torch") if mode == "pinned" else contextlib.nullcontext():
        for args, kwargs in calls:
            assert wrapped(*args, **kwargs) == reference(*args, **kwargs)
        for args, kwargs in calls:  # again, through whatever was cached
            assert wrapped(*args, **kwargs) == reference(*args, **kwargs)
        for args, kwargs in [((), {"bogus_keyword": 1}), (tuple(range(6)), {})]:
            assert _outcome(wrapped, args, kwargs) == _outcome(reference, args, kwargs)


def _outcome(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return ("returned", func(*args, **kwargs))
    except TypeError:
        return ("TypeError", None)


def test_op_rejects_bad_definitions(registry: KernelRegistry) -> None:
    with pytest.raises(kernreg.InvalidSpecError):
        kernreg.op("Bad", registry=registry)
    with pytest.raises(kernreg.InvalidSpecError):
        kernreg.op("a.b", backend="Torch", registry=registry)
    with pytest.raises(kernreg.InvalidSpecError, match="dispatch_args"):
        kernreg.op("a.b", dispatch_args=("nope",), registry=registry)(ref_plain)
    with pytest.raises(kernreg.InvalidSpecError, match="dispatch_args"):
        kernreg.op("a.c", dispatch_args=("rest",), registry=registry)(ref_star)

    def reserved(_kr_box):  # type: ignore[no-untyped-def]
        return None

    with pytest.raises(kernreg.InvalidSpecError, match="reserved"):
        kernreg.op("a.d", registry=registry)(reserved)


def test_op_registers_its_reference(registry: KernelRegistry) -> None:
    rms = kernreg.op(RMS, registry=registry, traits=["deterministic"], description="plain torch")(
        ref_plain
    )
    (spec,) = registry.get(RMS)
    assert (spec.backend, spec.target, spec.reference) == ("torch", ref_plain, True)
    assert spec.traits == {"deterministic"}
    assert spec.description == "plain torch"
    assert rms.specs() == (spec,)
    assert rms.registry is registry
    aten = kernreg.op("a.b", backend="aten", registry=registry)(ref_plain)
    assert aten.specs()[0].backend == "aten"


def test_register_forms(registry: KernelRegistry, write_module: Callable[[str, str], str]) -> None:
    module = write_module("kr_op_kernels", "def rms(x, y, z=3):\n    return ('lazy', x)\n")
    rms = kernreg.op(RMS, registry=registry)(ref_plain)

    def fast(x, y, z=3):  # type: ignore[no-untyped-def]
        return ("fast", x)

    decorated = rms.register("triton", priority=1, traits=["deterministic"])(fast)
    assert decorated is fast  # the decorator hands back the function itself
    stored = rms.register("cuda", f"{module}:rms", variant="v2", priority=2, description="lazy")
    assert isinstance(stored, KernelSpec)
    assert module not in sys.modules
    assert rms(1, 2) == ("lazy", 1)
    assert rms.select().label == "cuda/v2"
    assert rms.get_kernel() is sys.modules[module].rms
    assert rms.get_kernel("triton") is fast
    assert rms.explain(backend="triton").rule == "explicit"
    with pytest.raises(kernreg.KernelConflictError):
        rms.register("triton", _impl("other"))
    rms.register("triton", _impl("other"), replace=True)
    assert registry.overrides()[0].new.target.__name__ == "other"  # type: ignore[union-attr]
    with pytest.raises(kernreg.InvalidSpecError):
        rms.register("Triton")
    with pytest.raises(kernreg.InvalidSpecError):
        rms.register("triton", variant="V2")


# --- op objects: static and gated dispatch ---------------------------------------------------


def test_static_op_calls_the_chosen_implementation_directly(registry: KernelRegistry) -> None:
    rms = kernreg.op(RMS, registry=registry)(ref_plain)
    fast, callers = recording_impl("fast")
    rms.register("triton", fast, traits=["compile_safe"])
    assert rms(1, 2) == "fast"
    assert rms(1, 2) == "fast"
    assert callers[-1] is rms.__code__  # no layer between the op object and fast


GATED = [
    # (first argument, chosen implementation)
    (Tensor(BF16, CUDA), "triton_bf16"),
    (Tensor(FP16, CUDA), "cuda_any"),
    (Tensor(FP32, CUDA), "cuda_any"),
    (Tensor(BF16, CPU), "cpu_bf16"),
    (Tensor(FP32, CPU), "ref"),
    (Tensor(BF16, "cuda:1"), "triton_bf16"),
    (Tensor(FP32, "cpu"), "ref"),
    (Tensor(BF16, Device("meta")), "ref"),
    (Tensor("bf16", "cuda"), "triton_bf16"),
    (Tensor(BF16, None), "triton_bf16"),  # no device: the registry's platform
    # Plain values have no device: the registry's platform (cuda:9.0) applies.
    (3, "cuda_any"),
    ("text", "cuda_any"),
    (None, "cuda_any"),
    ([1, 2], "cuda_any"),
]


@pytest.fixture
def gated_op(registry: KernelRegistry) -> Any:
    def ref(x, scale=1.0):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry)(ref)
    op.register(
        "triton", _impl("triton_bf16"), dtypes=["bf16"], requires=["cuda>=8.0"], priority=10
    )
    op.register("cuda", _impl("cuda_any"), requires=["cuda"], priority=5)
    op.register("cpu_kernels", _impl("cpu_bf16"), dtypes=["bf16"], requires=["cpu"])
    return op


@pytest.mark.parametrize(("arg", "chosen"), GATED)
def test_gated_op_decides_per_call(gated_op: Any, arg: Any, chosen: str) -> None:
    for _ in range(3):
        assert gated_op(arg) == chosen
        assert gated_op(arg, scale=2.0) == chosen
        assert gated_op(x=arg) == chosen


def test_gated_op_interleaved_calls(gated_op: Any) -> None:
    for _ in range(3):
        for arg, chosen in GATED:
            assert gated_op(arg) == chosen


def test_gated_op_on_another_platform(make_registry: Callable[..., KernelRegistry]) -> None:
    registry = make_registry("hip:gfx942")

    def ref(x):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry)(ref)
    op.register("aiter", _impl("aiter"), requires=["hip:gfx942"])
    op.register("triton", _impl("triton"), requires=["cuda>=8.0"], priority=5)
    assert op(Tensor(BF16, Device("cuda", 0))) == "aiter"  # ROCm tensors live on 'cuda'
    assert op(Tensor(BF16, CPU)) == "ref"


def test_dispatch_args(registry: KernelRegistry) -> None:
    def ref(weight, x, *, out=None):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry, dispatch_args=("x", "out"))(ref)
    op.register("triton", _impl("triton"), dtypes=["bf16"])
    assert op(Tensor(FP32), Tensor(BF16), out=Tensor(BF16)) == "triton"
    assert op(Tensor(BF16), Tensor(BF16), out=Tensor(FP32)) == "ref"
    assert op(Tensor(BF16), Tensor(FP32), out=Tensor(BF16)) == "ref"
    assert op(None, x=Tensor(BF16), out=Tensor(BF16)) == "triton"


def test_an_op_on_star_args_dispatches_on_its_first_positional_argument(
    registry: KernelRegistry,
) -> None:
    """A reference taking only ``*args`` (a decorator's wrapper without ``functools.wraps``,
    a C function): its op object gates on the first positional argument, as it gates on the
    first parameter of any other reference; a call without one is decided without dtypes."""

    def ref(*args, **kwargs):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry)(ref)
    op.register("triton", _impl("triton"), dtypes=["bf16"])
    assert op(Tensor(BF16), Tensor(FP32)) == "triton"
    assert op(Tensor(FP32), Tensor(BF16)) == "ref"
    assert op(Tensor(BF16)) == "triton"  # cached
    assert op() == "ref"
    assert op(args=Tensor(BF16)) == "ref"  # a keyword belongs to **kwargs
    assert op.explain_call(Tensor(BF16)).chosen.backend == "triton"
    with kernreg.trace() as recorded:
        op(Tensor(BF16))
    assert [(c.implementation, c.dtypes) for c in recorded.calls] == [("triton", ("bfloat16",))]


@pytest.fixture
def two_argument_op(registry: KernelRegistry) -> Any:
    """Gated on dtype and device, dispatching on both ``x`` and ``w``."""

    def ref(x, w):  # type: ignore[no-untyped-def]
        return "torch"

    op = kernreg.op(RMS, registry=registry, dispatch_args=("x", "w"))(ref)
    op.register("triton", _impl("triton"), dtypes=["bf16"], requires=["cuda"], priority=10)
    op.register("cpu_kernels", _impl("cpu_kernels"), requires=["cpu"], priority=5)
    return op


def test_the_cache_key_holds_every_dtype_and_the_first_device(two_argument_op: Any) -> None:
    op = two_argument_op
    calls = [
        # The first argument's device decides, whatever the second one's is.
        ((Tensor(BF16, CUDA), Tensor(BF16, CPU)), "triton"),
        ((Tensor(BF16, CPU), Tensor(BF16, CUDA)), "cpu_kernels"),
        ((Tensor(BF16, CUDA), Tensor(BF16, Device("cuda", 1))), "triton"),
        ((Tensor(BF16, CUDA), Tensor(FP32, CUDA)), "torch"),  # not every dtype is bf16
        ((Tensor(FP32, CPU), Tensor(BF16, CUDA)), "cpu_kernels"),
    ]
    for _ in range(3):
        for args, chosen in calls:
            assert op(*args) == chosen, args
            assert op.explain_call(*args).chosen.backend == chosen


@pytest.mark.parametrize("first", [None, 2.0, Tensor(BF16, None)], ids=["none", "float", "nodev"])
def test_a_first_argument_without_a_device_is_decided_every_call(
    two_argument_op: Any, first: Any
) -> None:
    """The second argument's device decides then; the key has no device to hold, so such
    calls are never stored (one key would stand for calls on different devices)."""
    op = two_argument_op
    for _ in range(3):
        assert op(first, Tensor(BF16, CUDA)) == "triton"
        assert op(first, Tensor(BF16, CPU)) == "cpu_kernels"
        assert op(Tensor(BF16, CUDA), Tensor(BF16, CPU)) == "triton"  # cached: unaffected


def test_a_device_gate_alone_keys_on_the_first_device(registry: KernelRegistry) -> None:
    def ref(x, w):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry, dispatch_args=("x", "w"))(ref)
    op.register("triton", _impl("triton"), requires=["cuda"])
    for _ in range(2):
        assert op(Tensor(BF16, CUDA), Tensor(BF16, CPU)) == "triton"
        assert op(Tensor(BF16, CPU), Tensor(BF16, CUDA)) == "ref"
        assert op(None, Tensor(BF16, CUDA)) == "triton"
        assert op(None, Tensor(BF16, CPU)) == "ref"


def test_an_autotuned_op_keys_on_every_shape_and_the_first_device(
    make_registry: Callable[..., KernelRegistry],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
) -> None:
    registry = make_registry(config=Config(cache_dir=str(tmp_path)))  # its own tuning store
    measured: list[Any] = []  # a measurer that records nothing: priority decides

    def measure(op_id: str, candidates: Any, args: Any, kwargs: Any, /, **_: Any) -> Any:
        measured.append(args)
        return {}

    monkeypatch.setattr("kernreg.measurement._measurer", [measure])

    def ref(x, w):  # type: ignore[no-untyped-def]
        return "torch"

    op = kernreg.op(RMS, registry=registry, dispatch_args=("x", "w"), autotune=True)(ref)
    op.register("triton", _impl("triton"), requires=["cuda"], priority=10)
    calls = [
        (Tensor(BF16, CUDA, (2, 3)), Tensor(BF16, CPU, (3,))),
        (Tensor(BF16, CPU, (2, 3)), Tensor(BF16, CUDA, (3,))),
        (None, Tensor(BF16, CUDA, (3,))),
    ]
    for _ in range(2):
        assert [op(*args) for args in calls] == ["triton", "torch", "triton"]
    assert measured  # the tuned path ran


def test_keyword_only_dispatch_argument_with_default(registry: KernelRegistry) -> None:
    def ref(x, *rest, out=None):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry, dispatch_args=("out",))(ref)
    op.register("triton", _impl("triton"), dtypes=["bf16"])
    assert op(Tensor(FP32), Tensor(BF16), Tensor(BF16)) == "ref"  # out is None, not rest[1]
    assert op.explain_call(Tensor(FP32), Tensor(BF16), Tensor(BF16)).dtypes is None
    assert op(Tensor(FP32), out=Tensor(BF16)) == "triton"

    # The per-call path is used while any pin is open, even one that matches no op (which
    # says so when its block ends).
    def pinned_calls() -> list[Any]:
        with use_backend("kr_unregistered.*", "torch"):
            return [
                op(Tensor(FP32), Tensor(BF16), Tensor(BF16)),
                op(Tensor(FP32), out=Tensor(BF16)),
            ]

    with pytest.warns(kernreg.config.ConfigWarning, match="pinned nothing"):
        results = pinned_calls()
    assert results == ["ref", "triton"]


def test_positional_only_dispatch_argument_and_kwargs_of_the_same_name(
    registry: KernelRegistry,
) -> None:
    def ref(x, /, **options):  # type: ignore[no-untyped-def]
        return ("ref", options)

    op = kernreg.op(RMS, registry=registry)(ref)
    op.register("triton", lambda x, /, **o: ("triton", o), dtypes=["bf16"])
    t32 = Tensor(FP32)
    assert op(Tensor(BF16), x=t32) == ("triton", {"x": t32})  # dispatch on the first argument
    assert op(Tensor(FP32), x=Tensor(BF16))[0] == "ref"
    assert op.explain_call(Tensor(BF16), x=Tensor(FP32)).dtypes == ("bfloat16",)


def test_unhashable_devices_are_decided_every_call(registry: KernelRegistry) -> None:
    class ListDevice(list):  # type: ignore[type-arg]
        type = "cuda"

    def ref(x):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry)(ref)
    op.register("triton", _impl("triton"), requires=["cuda"])
    for _ in range(3):
        assert op(Tensor(BF16, ListDevice())) == "triton"
        assert op(Tensor(BF16, CPU)) == "ref"


def test_when_predicates_chosen_per_call(registry: KernelRegistry) -> None:
    def ref(n):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry)(ref)
    op.register("small", _impl("small"), when=lambda n: n < 10, priority=5)
    op.register("large", _impl("large"), when=lambda n: n > 1000, priority=5)
    op.register("medium", _impl("medium"), priority=1)
    assert [op(n) for n in (1, 500, 5000, 2, 5000)] == [
        "small",
        "medium",
        "large",
        "small",
        "large",
    ]
    assert op.explain_call(1).chosen.backend == "small"  # type: ignore[union-attr]
    assert op.explain_call(500).chosen.backend == "medium"  # type: ignore[union-attr]
    assert op.explain().conditional == tuple(
        s for s in registry.get(RMS) if s.backend in ("large", "small")
    )


def test_when_predicate_given_as_target(
    registry: KernelRegistry, write_module: Callable[[str, str], str]
) -> None:
    module = write_module("kr_when_preds", "def big(x):\n    return x > 10\n")

    def ref(x):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry)(ref)
    op.register("triton", _impl("triton"), when=f"{module}:big")
    assert module not in sys.modules
    assert (op(1), op(11)) == ("ref", "triton")


def test_when_predicates_with_dtype_gates(registry: KernelRegistry) -> None:
    def ref(x):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry)(ref)
    op.register("triton", _impl("triton"), dtypes=["bf16"], when=lambda x: x.shape[0] > 4)
    assert op(Tensor(BF16, shape=(8,))) == "triton"
    assert op(Tensor(BF16, shape=(2,))) == "ref"
    assert op(Tensor(FP32, shape=(8,))) == "ref"


def test_ambiguous_when_predicates_raise_at_call(registry: KernelRegistry) -> None:
    def ref(n):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry)(ref)
    op.register("a", _impl("a"), when=lambda n: n > 0)
    op.register("b", _impl("b"), when=lambda n: n > 5)
    assert op(1) == "a"
    assert op(-1) == "ref"
    with pytest.raises(AmbiguousKernelError, match="'a', 'b'"):
        op(6)


def test_conditional_candidate_tied_with_a_firm_one(registry: KernelRegistry) -> None:
    def ref(n):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry)(ref)
    op.register("firm", _impl("firm"))
    op.register("maybe", _impl("maybe"), when=lambda n: n > 5)
    assert op(1) == "firm"
    with pytest.raises(AmbiguousKernelError):
        op(6)


def test_ambiguous_op_raises_at_call(registry: KernelRegistry) -> None:
    op = kernreg.op(RMS, registry=registry)(ref_plain)
    op.register("a", _impl("a"))
    op.register("b", _impl("b"))
    with pytest.raises(AmbiguousKernelError):
        op(1, 2)


@pytest.mark.parametrize(
    ("strict_op", "config"),
    [(True, Config()), (None, Config(strict=("*",))), (None, Config(strict=("layernorm.*",)))],
)
def test_strict_op_raises(
    make_registry: Callable[..., KernelRegistry], strict_op: bool | None, config: Config
) -> None:
    registry = make_registry(config=config)

    def ref(x):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry, strict=strict_op)(ref)
    assert op(Tensor(FP32)) == "ref"  # only the reference: not a fallback
    op.register("triton", _impl("triton"), dtypes=["bf16"])
    assert op(Tensor(BF16)) == "triton"
    with pytest.raises(StrictFallbackError) as info:
        op(Tensor(FP32))
    assert info.value.decision.op == RMS
    with pytest.raises(StrictFallbackError):
        op.select(dtypes=["fp32"])


def test_non_strict_op_falls_back(registry: KernelRegistry) -> None:
    def ref(x):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry, strict=False)(ref)
    op.register("triton", _impl("triton"), requires=["hip"])
    assert op(1) == "ref"


def test_nothing_eligible_raises_at_call(registry: KernelRegistry) -> None:
    def ref(x):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry)(ref)
    registry.unregister(RMS, "torch")
    registry.register(KernelSpec(RMS, "triton", _impl("triton"), requires=["hip"]))
    with pytest.raises(NoEligibleKernelError) as info:
        op(1)
    assert "needs device hip" in str(info.value)


# --- mutations and scoped pins ---------------------------------------------------------------


@pytest.mark.parametrize("gated", [False, True])
def test_mutations_are_visible_at_the_next_call(registry: KernelRegistry, gated: bool) -> None:
    def ref(x):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry)(ref)
    gate: dict[str, Any] = {"dtypes": ["bf16"]} if gated else {}
    arg = Tensor(BF16)
    assert op(arg) == "ref"
    op.register("triton", _impl("v1"), **gate)
    assert op(arg) == "v1"
    op.register("triton", _impl("v2"), replace=True, **gate)
    assert op(arg) == "v2"
    op.register("cuda", _impl("cuda"), priority=3, **gate)
    assert op(arg) == "cuda"
    registry.unregister(RMS, "cuda")
    assert op(arg) == "v2"
    registry.configure(
        Config(deny=(kernreg.config.Pin("*", "triton"),)), platform=Platform.parse("cuda:9.0")
    )
    assert op(arg) == "ref"
    registry.configure(Config(), platform=Platform.parse("cuda:9.0"))
    assert op(arg) == "v2"
    with registry.scoped():
        registry.unregister(RMS, "triton")
        assert op(arg) == "ref"
    assert op(arg) == "v2"


def test_use_backend_affects_op_calls_inside_the_block_only(registry: KernelRegistry) -> None:
    def ref(x):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry)(ref)
    fast, callers = recording_impl("fast")
    op.register("triton", fast)
    assert op(1) == "fast"
    other_thread: list[str] = []
    with use_backend(RMS, "torch"):
        assert op(1) == "ref"
        with use_backend("layernorm.*", "triton"):
            assert op(1) == "fast"
        assert op(1) == "ref"
        worker = threading.Thread(target=lambda: other_thread.append(op(1)))
        worker.start()
        worker.join(10)
    assert other_thread == ["fast"]
    assert op(1) == "fast"
    assert op(1) == "fast"
    assert callers[-1] is op.__code__  # called directly again once the blocks are over


def test_explain_call(registry: KernelRegistry) -> None:
    def ref(x, n=0):  # type: ignore[no-untyped-def]
        return "ref"

    op = kernreg.op(RMS, registry=registry)(ref)
    op.register("triton", _impl("triton"), dtypes=["bf16"], requires=["cuda"])
    op.register("big", _impl("big"), when=lambda x, n=0: n > 100, priority=9)
    decision = op.explain_call(Tensor(BF16, CPU))
    assert decision.chosen.backend == "torch"  # type: ignore[union-attr]
    assert str(decision.platform) == "cpu"
    assert decision.dtypes == ("bfloat16",)
    assert "needs device cuda, platform is cpu" in decision.candidate("triton").reasons[0]
    assert op.explain_call(Tensor(BF16, CUDA)).chosen.backend == "triton"  # type: ignore[union-attr]
    assert op.explain_call(Tensor(BF16, CUDA), n=101).chosen.backend == "big"  # type: ignore[union-attr]
    assert op.explain_call(Tensor(BF16, CUDA), 101).chosen.backend == "big"  # type: ignore[union-attr]
    assert op.explain(platform="cpu", dtypes=["bf16"]).chosen.backend == "torch"  # type: ignore[union-attr]


def test_explain_call_agrees_with_the_call_whatever_way_arguments_are_passed(
    registry: KernelRegistry,
) -> None:
    def ref(x, mode="prefill", *, scale=1.0):  # type: ignore[no-untyped-def]
        return "torch"

    op = kernreg.op(RMS, registry=registry)(ref)
    # A predicate reads the call as the implementation gets it: defaults filled in, the
    # parameters before the keyword-only ones by position.
    op.register("decode", _impl("decode"), when=lambda *a, **k: a[1:] == ("decode",), priority=5)
    op.register("scaled", _impl("scaled"), when=lambda *a, **k: k["scale"] > 1, priority=3)
    calls = [
        ((1,), {}),
        ((1, "decode"), {}),
        ((1,), {"mode": "decode"}),
        ((), {"x": 1, "mode": "decode"}),
        ((1,), {"scale": 2.0}),
        ((), {"scale": 2.0, "x": 1, "mode": "prefill"}),
    ]
    for args, kwargs in calls:
        assert op.explain_call(*args, **kwargs).chosen.backend == op(*args, **kwargs)  # type: ignore[union-attr]
    assert [op(*args, **kwargs) for args, kwargs in calls] == [
        "torch",
        "decode",
        "decode",
        "decode",
        "scaled",
        "scaled",
    ]


# --- op objects given bad registrations or failing targets --------------------------------


OP_OBJECT_REGISTRATIONS: list[tuple[str, dict[str, Any], str]] = [
    ("backend", {"backend": "Bad"}, "'Bad'"),
    ("variant", {"backend": "fast", "variant": "V"}, "'V'"),
    ("requires", {"backend": "fast", "requires": ["cuda>>8"]}, "'cuda>>8'"),
    ("dtypes", {"backend": "fast", "dtypes": ["halfish"]}, "'halfish'"),
    ("priority", {"backend": "fast", "priority": "high"}, "'high'"),
    ("target", {"backend": "fast", "target": "no_colon"}, "'no_colon'"),
    ("when", {"backend": "fast", "when": 3}, "3"),
]


@pytest.mark.parametrize(
    ("kwargs", "quoted"),
    [pytest.param(kwargs, quoted, id=name) for name, kwargs, quoted in OP_OBJECT_REGISTRATIONS],
)
def test_op_object_register_refuses_bad_arguments_before_changing_anything(
    registry: KernelRegistry, kwargs: dict[str, Any], quoted: str
) -> None:
    @kernreg.op("hard.scale", registry=registry)
    def scale(x: Any) -> str:
        return "ref"

    def register() -> None:
        target = kwargs.pop("target", None)
        registration = scale.register(**kwargs) if target is None else None
        if target is not None:
            scale.register(target=target, **kwargs)
        elif callable(registration):
            registration(lambda x: "fast")

    assert_fails_cleanly(registry, register, InvalidSpecError, ValueError, quoted)
    assert scale(1) == "ref"


def test_an_op_object_whose_target_fails_raises_on_every_call_and_recovers(
    registry: KernelRegistry, targets: None
) -> None:
    @kernreg.op("hard.calls", registry=registry)
    def calls(x: Any) -> str:
        return "ref"

    calls.register("cuda", "hard_no_such_module:impl", priority=5)
    for _ in range(3):
        with pytest.raises(KernelLoadError, match="hard_no_such_module"):
            calls(1)
    calls.register("cuda", BAD_INPUT_TARGET, priority=5, replace=True)
    assert calls(1) == "impl"


# --- op ids, generated code, device objects of other libraries, pickling ------------------


@pytest.mark.parametrize("op_id", ["bitwise.and", "logical.not", "logical.or", "demo.class"])
def test_op_ids_ending_in_a_keyword_work(op_id: str) -> None:
    registry = cuda_registry()

    @kernreg.op(op_id, registry=registry)
    def reference(x: Any) -> str:
        return "reference"

    reference.register("fast", lambda x: "fast", dtypes=["bfloat16"], priority=2)
    assert reference(FakeTensor("bfloat16")) == "fast"
    assert reference(FakeTensor("float32")) == "reference"
    assert reference.__name__ == "reference"
    made = kernreg.dispatcher(op_id, registry=registry)
    assert made(FakeTensor("bfloat16")) == "fast"


def test_a_failed_op_definition_leaves_nothing_registered() -> None:
    registry = cuda_registry()

    @kernreg.op("demo.first", registry=registry)
    def first(x: Any) -> str:
        return "first"

    before = registry.all_specs()
    with pytest.raises(kernreg.KernelConflictError):

        @kernreg.op("demo.first", registry=registry)
        def other(x: Any) -> str:
            return "other"

    assert registry.all_specs() == before
    assert first(1) == "first"


def test_parameters_named_like_builtins_the_generated_code_uses() -> None:
    registry = cuda_registry()

    @kernreg.op("demo.builtins", registry=registry)
    def shadow(  # the generated code's builtins, shadowed on purpose
        getattr: Any,
        Exception: Any = None,  # noqa: N803
        box: Any = None,
        cache: Any = None,
    ) -> str:
        return "reference"

    shadow.register("fast", lambda *a, **k: "fast", dtypes=["bfloat16"], priority=2)
    assert shadow(FakeTensor("bfloat16")) == "fast"
    assert shadow(FakeTensor("float32"), 1, box=2, cache=3) == "reference"
    assert shadow(object()) == "reference"  # no dtype: the miss path, through getattr
    with kernreg.use_backend("demo.builtins", "torch"):
        assert shadow(FakeTensor("bfloat16")) == "reference"


class CupyDevice:
    """What cupy.cuda.Device looks like: an ``id``, no ``type``."""

    def __init__(self, id: int) -> None:
        self.id = id

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


class JaxDevice:
    platform = "cpu"

    def __str__(self) -> str:
        return "TFRT_CPU_0"


class Opaque:
    def __repr__(self) -> str:
        return "<strange accelerator>"


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        (CupyDevice(0), "gpu"),
        ("CUDA:0", "gpu"),
        ("cuda:1", "gpu"),
        (0, "gpu"),
        ("TFRT_CPU_0", "reference"),
        (JaxDevice(), "reference"),
        ("cpu", "reference"),
        (FakeDevice("CUDA"), "gpu"),
        (Opaque(), "reference"),
        (FakeDevice("hpu"), "reference"),
        ("", "reference"),
        (None, "reference"),
    ],
)
def test_device_objects_of_other_libraries_never_make_a_call_raise(
    device: object, expected: str
) -> None:
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))

    @kernreg.op("demo.device", registry=registry)
    def on(x: Any) -> str:
        return "reference"

    on.register("gpu", lambda x: "gpu", requires=["cuda"], priority=3)
    x = FakeTensor("float32")
    x.device = device
    assert on(x) == expected
    assert on(x) == expected  # cached
    assert on.explain_call(x).chosen.backend == ("gpu" if expected == "gpu" else "torch")


def test_an_unknown_device_is_named_in_explain() -> None:
    registry = KernelRegistry(config=Config(), platform=Platform.parse("cpu"))

    @kernreg.op("demo.unknown", registry=registry)
    def on(x: Any) -> str:
        return "reference"

    on.register("gpu", lambda x: "gpu", requires=["cuda"], priority=3)
    x = FakeTensor("float32", Opaque())
    decision = on.explain_call(x)
    assert decision.platform.device == "unknown"
    assert "strange accelerator" in decision.platform.source
    x.device = FakeDevice("hpu")  # a device type with no alias is kept as it is
    assert on.explain_call(x).platform.device == "hpu"


def _pickled_op() -> Any:
    @kernreg.op("pickling.by_reference")
    def by_reference(x: int, y: int = 1) -> int:
        return x + y

    return by_reference


def test_op_objects_of_the_process_wide_registry_pickle_by_reference() -> None:
    made = _pickled_op()
    try:
        for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
            assert pickle.loads(pickle.dumps(made, protocol)) is made
        assert made.__name__ == "by_reference"
        assert made(1) == 2
        again = kernreg.dispatcher("pickling.by_reference")
        assert again is made  # same op id and options: the same op object
        strict = kernreg.dispatcher("pickling.by_reference", strict=True)
        assert strict is not made
        assert pickle.loads(pickle.dumps(strict)) is strict
    finally:
        kernreg.default_registry().unregister("pickling.by_reference", "torch")


@pytest.mark.parametrize("first", ["key", "get", "keep", "find", "make"])
def test_an_op_id_that_begins_like_a_helper_pickles(first: str) -> None:
    """Pickle reads ``op_objects.<first segment>``: no helper of the table may answer it."""
    op_id = f"{first}.probe"

    @kernreg.op(op_id)
    def probe(x: int) -> int:
        return x + 1

    try:
        assert pickle.loads(pickle.dumps(probe)) is probe
        assert pickle.loads(pickle.dumps(kernreg.dispatcher(op_id, strict=True)))(1) == 2
    finally:
        kernreg.default_registry().unregister(op_id, "torch")


def test_the_op_pack_op_pickles_into_a_fresh_process(tmp_path: Any) -> None:
    pytest.importorskip("kernreg_ops")
    from kernreg_ops.ops import rmsnorm

    path = tmp_path / "op.pickle"
    path.write_bytes(pickle.dumps({"norm": rmsnorm}))
    result = run_python(
        f"""
        import pickle, sys
        loaded = pickle.loads(open({str(path)!r}, "rb").read())["norm"]
        assert "kernreg_ops.ops" not in sys.modules
        from kernreg_ops.ops import rmsnorm
        print(loaded.op_id, loaded is rmsnorm)
        """,
        plugins="auto",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["layernorm.rmsnorm", "True"]


class NormHolder:
    """A module-like object holding an op object and its weight (pickled by torch.save)."""

    def __init__(self, op: Any) -> None:
        import torch

        self.weight = torch.ones(8)
        self.op = op


def test_torch_save_of_a_module_holding_a_pack_op_round_trips(tmp_path: Any) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("kernreg_ops")
    from kernreg_ops.ops import rmsnorm

    path = tmp_path / "norm.pt"
    torch.save(NormHolder(rmsnorm), path)
    loaded = torch.load(path, weights_only=False)
    assert loaded.op is rmsnorm
    x = torch.randn(2, 8)
    torch.testing.assert_close(loaded.op(x, loaded.weight, 1e-6), rmsnorm(x, loaded.weight, 1e-6))
    torch.save({"op": rmsnorm}, tmp_path / "op.pt")
    fresh = run_python(
        f"""
        import torch
        op = torch.load({str(tmp_path / "op.pt")!r}, weights_only=False)["op"]
        x = torch.ones(2, 4)
        print(op.op_id, float(op(x, torch.ones(4), 1e-6).sum()))
        """,
        plugins="auto",
    )
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert fresh.stdout.split()[0] == "layernorm.rmsnorm"


def test_an_op_objects_repr_names_the_op_and_its_implementations() -> None:
    registry = kernreg.default_registry()
    with registry.scoped():

        @kernreg.op("demo.reprd")
        def reprd(x: Any) -> Any:
            return x

        assert "demo.reprd (1 implementation: torch reference)" in repr(reprd)

        @reprd.register("fast", priority=3)
        def fast(x: Any) -> Any:
            return x

        kernreg.register_kernel(kernreg.KernelSpec("demo.reprd", "other", fast, variant="v2"))
        assert "demo.reprd (3 implementations: fast, other/v2, torch reference)" in repr(reprd)
        for protocol in range(pickle.HIGHEST_PROTOCOL + 1):  # the name still finds it
            assert pickle.loads(pickle.dumps(reprd, protocol=protocol)) is reprd

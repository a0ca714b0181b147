"""Op objects and lookups inside torch.compile(fullgraph=True): cold and warm decision
caches, pins and compile-safe regions around the compiled call, size-keyed choices and the
derived torch_compile implementation (sglang's compile behaviours, restated)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

torch = pytest.importorskip("torch")
kernreg_ops = pytest.importorskip("kernreg_ops")

import kernreg  # noqa: E402
from kernreg import KernelRegistry  # noqa: E402
from kernreg.torch import as_custom_op  # noqa: E402
from kernreg_ops import reference  # noqa: E402
from kernreg_ops.ops import fused_add_rmsnorm, rmsnorm  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _gated_op(registry: KernelRegistry) -> Any:
    """An op whose choice depends on the dtype: float32 calls get 'fast' (+100)."""

    @kernreg.op("demo.scale", registry=registry)
    def scale(x: Any, factor: float = 2.0) -> Any:
        return x * factor

    @scale.register("fast", dtypes=["float32"], priority=5)
    def fast(x: Any, factor: float = 2.0) -> Any:
        return x * factor + 100

    return scale


def _static_op(registry: KernelRegistry) -> Any:
    @kernreg.op("demo.shift", registry=registry)
    def shift(x: Any) -> Any:
        return x - 1

    return shift


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fullgraph_runs_the_selected_implementation(
    cpu_registry: KernelRegistry, warm: bool, backend: str
) -> None:
    scale, shift = _gated_op(cpu_registry), _static_op(cpu_registry)

    def f(x: Any) -> Any:
        return scale(x) + shift(x) + scale(x.double()).float()

    x = torch.ones(3)
    if warm:
        f(x)
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    expected = torch.full((3,), 102.0 + 0.0 + 2.0)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), expected)
    assert _graphs() == 1  # no recompilation once traced
    torch.testing.assert_close(f(x), expected)  # eager calls still decide as before


def test_a_registration_after_compiling_is_picked_up(cpu_registry: KernelRegistry) -> None:
    scale = _gated_op(cpu_registry)
    compiled = torch.compile(lambda x: scale(x), fullgraph=True, backend="eager")
    x = torch.ones(2)
    torch.testing.assert_close(compiled(x), torch.full((2,), 102.0))

    @scale.register("faster", dtypes=["float32"], priority=9)
    def faster(x: Any, factor: float = 2.0) -> Any:
        return x * factor + 1000

    torch.testing.assert_close(compiled(x), torch.full((2,), 1002.0))
    torch.testing.assert_close(scale(x), torch.full((2,), 1002.0))


def test_when_predicates_are_evaluated_while_tracing() -> None:
    from kernreg_ops.ops import silu_and_mul

    x = torch.randn(4, 16)
    with kernreg_ops.allow_compile():
        compiled = torch.compile(lambda x: silu_and_mul(x) * 2, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x), reference.silu_and_mul(x) * 2)


def test_pack_ops_with_inductor() -> None:
    from kernreg_ops.ops import silu_and_mul

    def mlp_in(x: Any, weight: Any) -> Any:
        return silu_and_mul(rmsnorm(x, weight, 1e-6))

    x, weight = torch.randn(4, 64), torch.randn(64)
    out = torch.compile(mlp_in, fullgraph=True)(x, weight)
    torch.testing.assert_close(out, mlp_in(x, weight))


def test_in_place_pack_op_under_aot_eager() -> None:
    # (Inductor's CPU code generation fails on this in-place pattern in torch 2.13.)
    def block(x: Any, residual: Any, weight: Any) -> Any:
        fused_add_rmsnorm(x, residual, weight, 1e-6)
        return rmsnorm(x, weight, 1e-6)

    x, residual, weight = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    x_eager, r_eager = x.clone(), residual.clone()
    expected = block(x_eager, r_eager, weight)
    out = torch.compile(block, fullgraph=True, backend="aot_eager")(x, residual, weight)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x, x_eager)
    torch.testing.assert_close(residual, r_eager)


def test_the_private_torch_names_kernreg_reads_exist_in_the_checked_torch_versions() -> None:
    """kernreg._compile reads torch's private names without importing torch; this fails
    when a torch release changes one of them (checked with torch 2.13)."""
    from kernreg._compile import CHECKED_TORCH_VERSIONS

    assert CHECKED_TORCH_VERSIONS == ("2.13",)
    if not torch.__version__.startswith(CHECKED_TORCH_VERSIONS):
        pytest.skip(f"torch {torch.__version__} is not one of {CHECKED_TORCH_VERSIONS}")

    def probe() -> int:
        return 1

    torch.compiler.assume_constant_result(probe)
    assert probe._dynamo_marked_constant is True  # type: ignore[attr-defined]
    assert isinstance(torch.compiler._is_compiling_flag, bool)
    assert issubclass(torch._dynamo.exc.UserError, Exception)
    error = torch._dynamo.exc.UserError(torch._dynamo.exc.UserErrorType.INVALID_INPUT, "x")
    assert hasattr(error, "real_stack")
    import torch._dynamo.variables.functions as functions

    assert "_torchdynamo_inline" in inspect.getsource(functions)


def test_as_custom_op_is_opaque_and_passes_opcheck() -> None:
    rms = as_custom_op(rmsnorm)
    assert as_custom_op(rmsnorm) is rms
    assert str(rms._opoverload._schema).startswith(
        "kernreg::layernorm_rmsnorm(Tensor x, Tensor weight"
    )
    x, weight = torch.randn(4, 32), torch.randn(32)
    torch.library.opcheck(rms, (x, weight, 1e-6))
    torch.testing.assert_close(torch.ops.kernreg.layernorm_rmsnorm(x, weight), rmsnorm(x, weight))

    graphs: list[Any] = []

    def capture(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda x, w: rms(x, w) * 2, fullgraph=True, backend=capture)
    torch.testing.assert_close(compiled(x, weight), rmsnorm(x, weight) * 2)
    (graph,) = graphs
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert "kernreg.layernorm_rmsnorm.default" in targets


def test_as_custom_op_name_of_another_op_is_an_error() -> None:
    rms = as_custom_op(rmsnorm, name="rms_taken")
    with pytest.raises(
        ValueError,
        match=r"^torch\.ops\.kernreg\.rms_taken already runs op 'layernorm\.rmsnorm'; "
        r"give op 'layernorm\.fused_add_rmsnorm' another name=$",
    ):
        as_custom_op(fused_add_rmsnorm, name="rms_taken")
    assert as_custom_op(rmsnorm, name="rms_taken") is rms


def test_as_custom_op_in_place() -> None:
    fused = as_custom_op("layernorm.fused_add_rmsnorm")
    x, residual, weight = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    torch.library.opcheck(fused, (x.clone(), residual.clone(), weight, 1e-6))
    x2, r2 = x.clone(), residual.clone()
    reference.fused_add_rmsnorm(x2, r2, weight)
    compiled = torch.compile(lambda a, b, w: fused(a, b, w), fullgraph=True, backend="aot_eager")
    assert compiled(x, residual, weight) is None
    torch.testing.assert_close(x, x2)
    torch.testing.assert_close(residual, r2)


# --- control from outside the compiled call -------------------------------------------------


def _pinnable_op(registry: KernelRegistry) -> Any:
    scale = _gated_op(registry)

    @scale.register("other")
    def other(x: Any, factor: float = 2.0) -> Any:
        return x * factor + 1000

    return scale


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_use_backend_outside_a_fullgraph_call(cpu_registry: KernelRegistry, warm: bool) -> None:
    scale = _pinnable_op(cpu_registry)

    def f(x: Any) -> Any:
        return scale(x) * 1

    x = torch.ones(2)
    if warm:
        f(x)
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    with kernreg.use_backend("demo.scale", "other"):
        explained = torch._dynamo.explain(f)(x)
        assert explained.graph_break_count == 0
        torch.testing.assert_close(compiled(x), torch.full((2,), 1002.0))
        with kernreg.use_backend("demo.*", "torch"):  # the innermost block wins
            torch.testing.assert_close(compiled(x), torch.full((2,), 2.0))
        torch.testing.assert_close(compiled(x), torch.full((2,), 1002.0))
    torch.testing.assert_close(compiled(x), torch.full((2,), 102.0))  # closed: guards fail


def test_a_block_in_another_thread_leaves_this_threads_compilation_alone(
    cpu_registry: KernelRegistry,
) -> None:
    import threading

    scale = _pinnable_op(cpu_registry)
    opened, release = threading.Event(), threading.Event()

    def hold() -> None:
        with kernreg.use_backend("demo.scale", "other"):
            opened.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert opened.wait(30)
        compiled = torch.compile(lambda x: scale(x) + 0, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(torch.ones(2)), torch.full((2,), 102.0))
    finally:
        release.set()
        thread.join(30)


def test_trace_outside_a_fullgraph_call_records_the_traced_decisions(
    cpu_registry: KernelRegistry,
) -> None:
    scale = _pinnable_op(cpu_registry)

    def f(x: Any) -> Any:
        return scale(x) + scale(x.double()).float()

    x = torch.ones(2)
    with kernreg.trace() as recorded:
        explained = torch._dynamo.explain(f)(x)
        assert explained.graph_break_count == 0
        out = torch.compile(f, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(out, torch.full((2,), 102.0 + 1002.0))
    decisions = {(c.op, c.implementation, c.dtypes, c.compiled) for c in recorded.calls}
    assert ("demo.scale", "fast", ("float32",), True) in decisions
    assert ("demo.scale", "other", ("float64",), True) in decisions


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_traces_opened_and_closed_never_exhaust_the_recompile_limit(
    cpu_registry: KernelRegistry, warm: bool
) -> None:
    """torch.compile compiles a function at most 8 times (then fails under fullgraph): a
    function compiled around op objects, or an op object compiled itself, is compiled once
    more for the first trace (which records its decisions) and reused by the later ones;
    the eager calls of every trace are recorded."""
    scale, shift = _gated_op(cpu_registry), _static_op(cpu_registry)
    around = torch.compile(lambda x: scale(x) + shift(x), fullgraph=True, backend="eager")
    itself = torch.compile(shift, fullgraph=True, backend="eager")
    x = torch.ones(2)
    if warm:
        scale(x), shift(x)
    around(x), itself(x)
    with kernreg.trace() as first:
        around(x), itself(x)
    assert {(c.op, c.implementation) for c in first.calls if c.compiled} == {
        ("demo.scale", "fast"),
        ("demo.shift", "torch"),
    }
    for _ in range(10):
        with kernreg.trace() as recorded:
            torch.testing.assert_close(around(x), torch.full((2,), 102.0))
            torch.testing.assert_close(itself(x), torch.zeros(2))
            scale(x), shift(x), scale(x.double())
        around(x), itself(x)
    assert _graphs() == 4  # each: once without a trace, once with
    assert recorded.implementations("demo.scale") == {"fast": 1, "torch": 1}
    assert recorded.implementations("demo.shift") == {"torch": 1}
    assert [(c.rule, c.dtypes) for c in recorded.calls if c.op == "demo.scale"] == [
        ("priority", ("float32",)),
        ("reference", ("float64",)),
    ]
    assert recorded.stats.counts  # each trace counts the decisions its calls made


def test_pins_and_traces_around_a_compiled_function_compile_it_once_each(
    cpu_registry: KernelRegistry,
) -> None:
    scale = _pinnable_op(cpu_registry)
    compiled = torch.compile(lambda x: scale(x) + 0, fullgraph=True, backend="eager")
    x = torch.ones(2)
    compiled(x)
    for _ in range(10):
        with kernreg.use_backend("demo.scale", "other"):
            with kernreg.trace() as recorded:
                torch.testing.assert_close(compiled(x), torch.full((2,), 1002.0))
                torch.testing.assert_close(scale(x), torch.full((2,), 1002.0))
            compiled(x)
        torch.testing.assert_close(compiled(x), torch.full((2,), 102.0))
    assert _graphs() == 2  # without the pin, with it
    assert [(c.implementation, c.rule) for c in recorded.calls] == [("other", "scoped_pin")]


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_function_compiled_in_a_trace_after_eager_calls_records_its_decisions(
    cpu_registry: KernelRegistry, warm: bool
) -> None:
    """Eager calls in a trace record each call; a function compiled in the same trace then
    traces the implementation, not the recording (which dynamo cannot trace), and records
    the decisions it traces, whatever was decided before the trace."""
    scale, shift = _gated_op(cpu_registry), _static_op(cpu_registry)
    x = torch.ones(2)
    if warm:
        scale(x), shift(x)
    with kernreg.trace() as recorded:
        scale(x), shift(x)
        compiled = torch.compile(lambda x: scale(x) + shift(x), fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x), torch.full((2,), 102.0))
        torch.testing.assert_close(compiled(x), torch.full((2,), 102.0))
    calls = [(c.op, c.implementation, c.compiled) for c in recorded.calls]
    assert calls == [
        ("demo.scale", "fast", False),
        ("demo.shift", "torch", False),
        ("demo.scale", "fast", True),
        ("demo.shift", "torch", True),
    ]


def test_a_compiled_kernelized_model_stays_within_the_recompile_limit_across_traces(
    cpu_registry: KernelRegistry,
) -> None:
    from kernreg.torch import kernelize, register_layer, unregister_layer

    class Norm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x: Any) -> Any:
            return reference.rmsnorm(x, self.weight, 1e-6)

    norm = kernreg.op("layernorm.rmsnorm", registry=cpu_registry)(reference.rmsnorm)
    norm.register("fast", priority=5)(lambda x, weight, eps=1e-6: reference.rmsnorm(x, weight, eps))
    register_layer(Norm, op="layernorm.rmsnorm", args=lambda m, x: (x, m.weight, 1e-6))
    try:
        model, x = torch.nn.Sequential(Norm(), Norm()), torch.randn(2, 8)
        assert kernelize(model, registry=cpu_registry).row("0").implementation == "fast"
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        with torch.no_grad():
            compiled(x)
            traces = []
            for _ in range(10):
                with kernreg.trace() as trace:
                    torch.testing.assert_close(compiled(x), model(x))
                traces.append(trace)
                compiled(x)
    finally:
        unregister_layer(Norm)
    assert _graphs() <= 2
    # The first trace records the decisions the graph was compiled with, at their sites.
    recorded = {(c.site, c.implementation) for c in traces[0].calls if c.compiled}
    assert recorded == {("0", "fast"), ("1", "fast")}


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_kernreg_errors_surface_under_compile_with_their_type(
    cpu_registry: KernelRegistry, warm: bool
) -> None:
    @kernreg.op("demo.strict", registry=cpu_registry, strict=True)
    def strict(x: Any) -> Any:
        return x

    strict.register("gpu", requires=["cuda"])(lambda x: x)

    def gpu_only(x: Any) -> Any:
        return x

    cpu_registry.register(kernreg.KernelSpec("demo.empty", "gpu", gpu_only, requires=["cuda"]))
    empty = kernreg.dispatcher("demo.empty", like=gpu_only, registry=cpu_registry)
    x = torch.ones(2)
    for op_object, error in (
        (strict, kernreg.StrictFallbackError),
        (empty, kernreg.NoEligibleKernelError),
    ):
        if warm:
            with pytest.raises(error):
                op_object(x)
        compiled = torch.compile(lambda x, o=op_object: o(x) + 1, fullgraph=True, backend="eager")
        with pytest.raises(error, match=op_object.op_id) as info:
            compiled(x)
        assert info.value.decision.op == op_object.op_id
    with kernreg.use_backend("demo.strict", "torch"):  # pinned: no fallback, no error
        compiled = torch.compile(lambda x: strict(x) + 1, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x), torch.full((2,), 2.0))


def test_blocks_opened_and_closed_many_times_never_hit_the_recompile_limit(
    cpu_registry: KernelRegistry,
) -> None:
    scale = _pinnable_op(cpu_registry)
    cpu_registry.register(kernreg.KernelSpec("other.op", "torch", torch.neg, reference=True))
    compiled = torch.compile(lambda x: scale(x) * 1, fullgraph=True, backend="eager")
    x = torch.ones(2)
    for _ in range(3 * torch._dynamo.config.recompile_limit):
        torch.testing.assert_close(compiled(x), torch.full((2,), 102.0))
        with kernreg.use_backend("other.*", "torch"):  # a block for other ops
            torch.testing.assert_close(compiled(x), torch.full((2,), 102.0))
        with kernreg.use_backend("demo.scale", "other"):
            torch.testing.assert_close(compiled(x), torch.full((2,), 1002.0))


def test_an_ambiguous_decision_surfaces_under_compile_with_its_type(
    cpu_registry: KernelRegistry,
) -> None:
    @kernreg.op("demo.tied", registry=cpu_registry)
    def tied(x: Any) -> Any:
        return x

    tied.register("a", priority=3)(lambda x: x + 1)
    tied.register("b", priority=3)(lambda x: x + 2)
    compiled = torch.compile(lambda x: tied(x) * 2, fullgraph=True, backend="eager")
    with pytest.raises(kernreg.AmbiguousKernelError, match="'a', 'b' are all eligible"):
        compiled(torch.ones(2))


def test_a_failed_first_lookup_under_compile_carries_its_decision(
    cpu_registry: KernelRegistry,
) -> None:
    # select_kernel's first decision makes no Decision; the error passing through the
    # compiler still carries the whole one.
    cpu_registry.register(kernreg.KernelSpec("demo.pair", "a", "m:f"))
    cpu_registry.register(kernreg.KernelSpec("demo.pair", "b", "m:g"))

    def step(x: Any) -> Any:
        kernreg.select_kernel("demo.pair", registry=cpu_registry)
        return x + 1

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    with pytest.raises(kernreg.AmbiguousKernelError, match="'a', 'b' are all eligible") as info:
        compiled(torch.ones(2))
    assert info.value.decision == cpu_registry.explain("demo.pair")
    assert [c.spec.label for c in info.value.decision.tied] == ["a", "b"]


def _lookup_op(registry: KernelRegistry) -> Any:
    @kernreg.op("demo.lookup", registry=registry)
    def lookup(x: Any) -> Any:
        return x * 2

    @lookup.register("fast", priority=10)
    def fast(x: Any) -> Any:
        return x * 3

    return lookup


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("registry_argument", [False, True], ids=["default", "explicit"])
def test_public_lookups_under_fullgraph(
    cpu_registry: KernelRegistry, warm: bool, registry_argument: bool
) -> None:
    """The selector of sglang's registry, restated: ``get_kernel(op)``,
    ``get_kernel(op, backend)`` and ``select_kernel`` inside a fullgraph compile, with a
    cold or a warm cache, trace into the chosen implementation with no graph break."""
    registry = cpu_registry if registry_argument else kernreg.default_registry()
    with registry.scoped():
        _lookup_op(registry)

        def f(x: Any) -> Any:
            by_priority = kernreg.get_kernel("demo.lookup", registry=registry)(x)
            by_backend = kernreg.get_kernel("demo.lookup", "torch", registry=registry)(x)
            spec = kernreg.select_kernel("demo.lookup", registry=registry)
            return by_priority + by_backend + spec.priority

        x = torch.ones(2)
        if warm:
            f(x)
        assert torch._dynamo.explain(f)(x).graph_break_count == 0
        compiled = torch.compile(f, fullgraph=True, backend="eager")
        for _ in range(2):
            torch.testing.assert_close(compiled(x), torch.full((2,), 3.0 + 2.0 + 10.0))


@pytest.mark.parametrize(
    ("op", "backend", "error"),
    [
        ("demo.unknown", None, kernreg.OpNotFoundError),
        ("demo.lookup", "missing", kernreg.BackendNotFoundError),
        ("demo.tied", None, kernreg.AmbiguousKernelError),
    ],
    ids=["unknown-op", "unregistered-backend", "ambiguous"],
)
def test_lookup_errors_surface_under_fullgraph_with_their_type(
    cpu_registry: KernelRegistry, op: str, backend: str | None, error: type[Exception]
) -> None:
    """sglang's selector raises for an unknown op, an unregistered backend and several
    eligible backends; restated: inside a fullgraph compile, get_kernel and select_kernel
    raise the error an eager call raises, with its type and message."""
    _lookup_op(cpu_registry)
    cpu_registry.register(kernreg.KernelSpec("demo.tied", "a", torch.neg, priority=3))
    cpu_registry.register(kernreg.KernelSpec("demo.tied", "b", torch.abs, priority=3))
    with pytest.raises(error) as eager:
        kernreg.get_kernel(op, backend, registry=cpu_registry)
    for lookup in (kernreg.get_kernel, kernreg.select_kernel):

        def f(x: Any, lookup: Any = lookup) -> Any:
            lookup(op, backend, registry=cpu_registry)
            return x + 1

        with pytest.raises(error) as compiled:
            torch.compile(f, fullgraph=True, backend="eager")(torch.ones(2))
        assert str(compiled.value).startswith(str(eager.value))  # dynamo may add a hint


def test_a_compiled_lookup_follows_registry_changes_and_pins(cpu_registry: KernelRegistry) -> None:
    lookup = _lookup_op(cpu_registry)

    def f(x: Any) -> Any:
        return kernreg.get_kernel("demo.lookup", registry=cpu_registry)(x)

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    x = torch.ones(2)
    torch.testing.assert_close(compiled(x), torch.full((2,), 3.0))

    @lookup.register("faster", priority=20)
    def faster(x: Any) -> Any:
        return x * 4

    torch.testing.assert_close(compiled(x), torch.full((2,), 4.0))  # traced again
    with kernreg.use_backend("demo.lookup", "torch"):
        torch.testing.assert_close(compiled(x), torch.full((2,), 2.0))
    torch.testing.assert_close(compiled(x), torch.full((2,), 4.0))


def _size_keyed_op(registry: KernelRegistry) -> Any:
    """``demo.norm``: ``x * 2``, or ``fused`` (``x * 2 + 100``) for a single row."""

    @kernreg.op("demo.norm", dispatch_args=("x",), registry=registry)
    def norm(x: Any) -> Any:
        return x * 2

    @norm.register("fused", priority=10, when=lambda x: x.shape[0] == 1)
    def fused(x: Any) -> Any:
        return x * 2 + 100

    return norm


def test_a_size_keyed_choice_under_compile(cpu_registry: KernelRegistry) -> None:
    """sglang's per-op compile hook keyed by the number of tokens, restated with a ``when``
    predicate on a dispatch argument: decode (one token) keeps the fused kernel, prefill
    traces the reference; each size is its own graph, and eager calls decide alike."""
    norm = _size_keyed_op(cpu_registry)
    graphs: list[Any] = []

    def counting(graph: Any, example_inputs: Any) -> Any:
        graphs.append(graph)
        return graph

    compiled = torch.compile(lambda x: norm(x), fullgraph=True, backend=counting)
    decode, prefill = torch.ones(1, 4), torch.ones(8, 4)
    assert torch._dynamo.explain(lambda x: norm(x))(prefill).graph_break_count == 0
    for _ in range(4):
        torch.testing.assert_close(compiled(decode), torch.full((1, 4), 102.0))
        torch.testing.assert_close(compiled(prefill), torch.full((8, 4), 2.0))
    assert len(graphs) == 2  # one per size, never traced again
    torch.testing.assert_close(norm(decode), compiled(decode))
    torch.testing.assert_close(norm(prefill), compiled(prefill))
    fused_row = next(
        c
        for c in kernreg.explain("demo.norm", registry=cpu_registry).candidates
        if c.spec.backend == "fused"
    )
    assert "when predicate" in " ".join(fused_row.reasons)


@pytest.fixture
def constants_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """dynamo as before torch 2.13: a function marked to run for real while it traces is
    passed only Python constants (2.13 also passes objects, guarded by identity; 2.11 raised
    "UserDefinedObjectVariable(KernelRegistry) is not a constant")."""
    from torch._dynamo.variables import functions

    try:
        from torch._dynamo.variables.user_defined import UserDefinedObjectVariable

        passing = functions.invoke_and_store_as_constant
    except (ImportError, AttributeError) as exc:  # dynamo's internals moved
        pytest.skip(f"this torch has no dynamo internals to emulate it with ({exc})")

    def strict(tx: Any, fn: Any, name: str, args: Any, kwargs: Any) -> Any:
        for arg in (*args, *kwargs.values()):
            assert not isinstance(arg, UserDefinedObjectVariable), (name, arg)
        return passing(tx, fn, name, args, kwargs)

    monkeypatch.setattr(functions, "invoke_and_store_as_constant", strict)


@pytest.mark.usefixtures("constants_only")
def test_lookups_under_compile_pass_dynamo_only_constants(cpu_registry: KernelRegistry) -> None:
    _lookup_op(cpu_registry)
    sized = _size_keyed_op(cpu_registry)

    def f(x: Any) -> Any:
        looked_up = kernreg.get_kernel("demo.lookup", registry=cpu_registry)(x)
        spec = kernreg.select_kernel("demo.lookup", "torch", registry=cpu_registry)
        return looked_up + spec.priority + sized(x)

    # Decided eagerly first, where the predicate holds for no call: the compiled call then
    # loads the implementation it chooses while dynamo traces.
    torch.testing.assert_close(sized(torch.ones(4, 2)), torch.full((4, 2), 2.0))
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(torch.ones(1, 2)), torch.full((1, 2), 3.0 + 102.0))
    torch.testing.assert_close(compiled(torch.ones(4, 2)), torch.full((4, 2), 3.0 + 2.0))


def test_an_op_opts_in_to_a_derived_torch_compile_implementation(
    cpu_registry: KernelRegistry,
) -> None:
    """sglang derives a torch_compile backend from every op's native forward; here an op
    opts in: the reference compiled on first call, compile_safe, below hand-written kernels."""

    @kernreg.op("demo.derived", torch_compile=True, registry=cpu_registry)
    def derived(x: Any) -> Any:
        return x * 2 + 1

    spec = cpu_registry.get_backend("demo.derived", "torch_compile")
    assert "compile_safe" in spec.traits
    assert spec.priority < 0
    x = torch.arange(4.0)
    with kernreg.trace() as calls:
        torch.testing.assert_close(derived(x), x * 2 + 1)
    assert calls.implementations("demo.derived") == {"torch_compile": 1}
    # Inside an outer compiled region it traces the reference: no graph break.
    assert torch._dynamo.explain(lambda t: derived(t) - 1)(x).graph_break_count == 0

    @derived.register("hand_written", priority=0)
    def hand_written(x: Any) -> Any:
        return x * 2 + 1

    assert kernreg.select_kernel("demo.derived", registry=cpu_registry).backend == "hand_written"


def test_the_derived_implementation_compiles_once_on_its_first_call(
    cpu_registry: KernelRegistry,
) -> None:
    """sglang's forward_torch_compile compiles the native forward on first use and keeps
    it; restated, also through an explicit backend as sglang's ``backend=TORCH_COMPILE``."""

    @kernreg.op("demo.lazy", torch_compile=True, registry=cpu_registry)
    def lazy(x: Any) -> Any:
        return x * 3

    lazy.register("fused", lambda x: x * 3, priority=5)
    compiled = lazy.get_kernel("torch_compile")
    assert _graphs() == 0  # registered and looked up: nothing compiled yet
    x = torch.arange(3.0)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), x * 3)
    assert _graphs() == 1


def test_an_op_without_the_opt_in_has_no_derived_implementation(
    cpu_registry: KernelRegistry,
) -> None:
    @kernreg.op("demo.plain", registry=cpu_registry)
    def plain(x: Any) -> Any:
        return x

    assert [s.backend for s in cpu_registry.get("demo.plain")] == ["torch"]


# --- a compile-safe region around an outer torch.compile ------------------------------------


def _opaque(x: Any) -> Any:
    """A fast kernel dynamo cannot trace (as an extension's kernel): a graph break."""
    torch._dynamo.graph_break()
    return x * 2 + 100


def _region_model(registry: KernelRegistry) -> Any:
    """A model of two ops, each with an opaque fast kernel: ``demo.norm`` also has a
    hand-written compile-safe one (+10), ``demo.act`` (``x - 1``) the derived torch_compile
    one; the fast kernels add 100 and 1000."""

    @kernreg.op("demo.norm", registry=registry)
    def norm(x: Any) -> Any:
        return x * 2

    norm.register("fused", _opaque, priority=10)
    norm.register("traced", lambda x: x * 2 + 10, priority=5, traits=["compile_safe"])

    @kernreg.op("demo.act", torch_compile=True, registry=registry)
    def act(x: Any) -> Any:
        return x - 1

    act.register("fused", lambda x: _opaque(x * 0) + x + 899, priority=10)  # x + 999

    class Block(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return act(norm(x))

    return Block()


_EAGER = 102.0 + 999  # fused norm, then fused act
_COMPILE_SAFE = 12.0 - 1  # traced norm, then the derived torch_compile act


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_model_compiles_fullgraph_inside_a_region_and_runs_its_fast_kernels_outside(
    cpu_registry: KernelRegistry, warm: bool
) -> None:
    """sglang's ``patch_model``, restated: ops switched to their compile-safe paths while
    the model is compiled, eager calls elsewhere untouched."""
    from kernreg.pins import compile_region

    model = _region_model(cpu_registry)
    x = torch.ones(3)
    if warm:
        torch.testing.assert_close(model(x), torch.full((3,), _EAGER))
    assert torch._dynamo.explain(model)(x).graph_break_count >= 1  # opaque outside
    with compile_region():
        assert torch._dynamo.explain(model)(x).graph_break_count == 0
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        for _ in range(2):
            torch.testing.assert_close(compiled(x), torch.full((3,), _COMPILE_SAFE))
        torch.testing.assert_close(model(x), torch.full((3,), _COMPILE_SAFE))
    torch.testing.assert_close(model(x), torch.full((3,), _EAGER))
    assert cpu_registry.select("demo.norm").backend == "fused"


def test_a_function_compiled_in_a_region_is_traced_again_outside_it(
    cpu_registry: KernelRegistry,
) -> None:
    """The compiled graph guards on the regions open: called outside, the function is
    traced again with what eager calls run there, never the region's graph; entering a
    region again reuses the region's graph."""
    from kernreg.pins import compile_region

    model = _region_model(cpu_registry)
    x = torch.ones(3)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with compile_region():
        torch.testing.assert_close(compiled(x), torch.full((3,), _COMPILE_SAFE))
    # Outside, the opaque kernels run: with fullgraph=True they cannot be compiled.
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled(x)
    torch._dynamo.utils.counters.clear()
    with compile_region():
        torch.testing.assert_close(compiled(x), torch.full((3,), _COMPILE_SAFE))
    assert _graphs() == 0  # the region's graph again: nothing traced
    # Without fullgraph, the function compiles outside with breaks around the fast kernels.
    # (dynamo keeps one cache per code object: both compiled functions share it.)
    lenient = torch.compile(model, backend="eager")
    torch.testing.assert_close(lenient(x), torch.full((3,), _EAGER))


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_public_lookups_inside_a_region_under_fullgraph(
    cpu_registry: KernelRegistry, warm: bool
) -> None:
    from kernreg.pins import compile_region

    _region_model(cpu_registry)

    def f(x: Any) -> Any:
        kernel = kernreg.get_kernel("demo.norm", registry=cpu_registry)
        spec = kernreg.select_kernel("demo.act", registry=cpu_registry)
        return kernel(x) + spec.priority

    x = torch.ones(2)
    if warm:
        with pytest.raises(torch._dynamo.exc.Unsupported):
            torch.compile(f, fullgraph=True, backend="eager")(x)
    with compile_region():
        assert torch._dynamo.explain(f)(x).graph_break_count == 0
        compiled = torch.compile(f, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x), torch.full((2,), 12.0 - 100))
    assert kernreg.get_kernel("demo.norm", registry=cpu_registry) is _opaque


@torch.library.custom_op("kernreg_tests::fused_prefill", mutates_args=())
def _fused_prefill(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 100


@_fused_prefill.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_a_size_keyed_compile_safe_kernel_stays_inside_a_region(
    cpu_registry: KernelRegistry,
) -> None:
    """sglang's TopK and fused MoE keep their optimized path under compile for more than
    one token (their compile hook returns None there); restated: a kernel exposed as a
    torch.library custom op (an opaque node dynamo traces) declares ``compile_safe`` and
    a ``when`` on the size, so a region keeps it for prefill and traces the reference for
    decode; the opaque kernel of decode outside the region is not taken inside it."""
    from kernreg.pins import compile_region

    @kernreg.op("demo.topk", registry=cpu_registry)
    def topk(x: Any) -> Any:
        return x * 2

    topk.register("decode", _opaque, priority=20, when=lambda x: x.shape[0] == 1)
    topk.register(
        "fused", _fused_prefill, priority=10, when=lambda x: x.shape[0] > 1, traits=["compile_safe"]
    )
    graphs: list[Any] = []

    def capture(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    decode, prefill = torch.ones(1, 4), torch.ones(8, 4)
    with compile_region():
        compiled = torch.compile(lambda x: topk(x) + 0, fullgraph=True, backend=capture)
        torch.testing.assert_close(compiled(prefill), torch.full((8, 4), 102.0))
        torch.testing.assert_close(compiled(decode), torch.full((1, 4), 2.0))
    prefill_graph = graphs[0]
    targets = [str(n.target) for n in prefill_graph.graph.nodes if n.op == "call_function"]
    assert "kernreg_tests.fused_prefill.default" in targets
    torch.testing.assert_close(topk(decode), torch.full((1, 4), 102.0))  # eager: the fast path
    torch.testing.assert_close(topk(prefill), torch.full((8, 4), 102.0))

"""The autotune policy's torch-free parts: buckets, keys, the measured choice, the decision."""

from __future__ import annotations

import pytest

from kernreg import KernelRegistry, KernelSpec, Platform
from kernreg.autotune import choose_measured, implementations_key, platform_key, shape_bucket
from kernreg.config import Config
from kernreg.spec import Origin
from kernreg.tuning import Measurement

OP = "demo.norm"


class Shaped:
    def __init__(self, *shape: int) -> None:
        self.shape = shape


@pytest.mark.parametrize(
    ("values", "bucket"),
    [
        ((Shaped(1, 4096),), "x=1x4096"),
        ((Shaped(3, 4000),), "x=4x4096"),
        ((Shaped(0, 5),), "x=0x8"),
        ((Shaped(),), "x="),
        ((1.0,), "-"),
        ((Shaped(17), Shaped(2, 2)), "x=32,w=2x2"),
    ],
)
def test_shape_buckets_round_dimensions_up_to_powers_of_two(
    values: tuple[object, ...], bucket: str
) -> None:
    names = ("x", "w")[: len(values)]
    assert shape_bucket(names, values) == bucket


def test_keys_name_versions_and_ignore_registration_order() -> None:
    a = KernelSpec(OP, "triton", "pkg.k:a", origin=Origin("f.py", 1, "vendor-kernels", "1.0"))
    b = KernelSpec(OP, "torch", "pkg.k:b", reference=True)
    assert implementations_key([a, b]) == implementations_key([b, a])
    assert implementations_key([a, b]) == "torch=pkg.k:b;triton=pkg.k:a@vendor-kernels 1.0"
    newer = a.with_origin(Origin("f.py", 1, "vendor-kernels", "1.1"))
    assert implementations_key([newer, b]) != implementations_key([a, b])
    cuda = Platform("cuda", arch=(9, 0), torch_version="2.13.0", runtime_version="12.4")
    assert platform_key(cuda) == "cuda:9.0|torch=2.13.0|runtime=12.4"
    assert platform_key(Platform("cpu")) == "cpu|torch=-|runtime=-"


def _spec(backend: str, priority: int = 0) -> KernelSpec:
    return KernelSpec(OP, backend, f"pkg.k:{backend}", priority=priority)


@pytest.mark.parametrize(
    ("timings", "chosen"),
    [
        # (priority, median, spread) per backend
        ({"a": (0, 100.0, 1.0), "b": (0, 50.0, 1.0)}, "b"),  # clearly faster wins
        ({"a": (5, 100.0, 1.0), "b": (0, 98.0, 1.0)}, "a"),  # within 5 %: priority keeps its order
        ({"a": (5, 100.0, 1.0), "b": (0, 90.0, 1.0)}, "b"),  # 10 % faster: measurement wins
        ({"a": (5, 100.0, 1.0), "b": (0, 80.0, 25.0)}, "a"),  # within the fastest one's spread
        ({"a": (0, 100.0, 0.0), "b": (0, 100.0, 0.0)}, "a"),  # a tie: the label decides
        ({"a": (0, 101.0, 0.0), "b": (0, 100.0, 0.0)}, "b"),  # equal priority: faster median
    ],
)
def test_the_measured_choice(timings: dict[str, tuple[int, float, float]], chosen: str) -> None:
    specs = [_spec(name, priority) for name, (priority, _, _) in timings.items()]
    measured = {
        name: Measurement(median, spread, 10) for name, (_, median, spread) in timings.items()
    }
    assert choose_measured(specs, measured).backend == chosen
    assert choose_measured(specs[::-1], measured).backend == chosen


def _registry(strict: tuple[str, ...] = ()) -> KernelRegistry:
    registry = KernelRegistry(config=Config(policy=(OP,), strict=strict), platform=Platform("cpu"))
    registry.use_tuning_store(None)
    registry.register(KernelSpec(OP, "torch", "pkg.k:ref", reference=True))
    registry.register(_spec("fast", 10))
    registry.register(_spec("other", 5))
    registry.register(KernelSpec(OP, "gpu", "pkg.k:gpu", requires=["cuda"], priority=20))
    return registry


def test_without_measurements_priority_decides_and_the_candidates_are_named() -> None:
    registry = _registry()
    decision = registry.explain(OP, bucket="x=8")
    assert decision.rule == "priority"
    assert decision.chosen is not None
    assert decision.chosen.backend == "fast"
    assert [s.label for s in decision.tuning] == ["fast", "other", "torch"]
    assert any("not measured" in note for note in decision.notes)
    # A pending decision is not cached: once measured, the next explain decides by speed.
    registry.record_measurements(
        OP,
        registry.platform,
        None,
        "x=8",
        {
            "fast": Measurement(900, 5, 10),
            "other": Measurement(100, 5, 10),
            "torch": Measurement(400, 5, 10),
        },
    )
    measured = registry.explain(OP, bucket="x=8")
    assert measured.rule == "autotune"
    assert measured.chosen is not None
    assert measured.chosen.backend == "other"
    assert measured.candidate("fast").status == "eligible"
    assert "measured" in measured.candidate("fast").reasons[-1]
    # Other buckets are separate; the policy is off for other ops and when asked.
    assert registry.explain(OP, bucket="x=16").rule == "priority"
    assert registry.explain(OP, bucket="x=8", autotune=False).rule == "priority"


def test_the_first_recorded_result_wins() -> None:
    registry = _registry()
    first = {"fast": Measurement(100, 1, 10), "other": Measurement(200, 1, 10)}
    second = {"fast": Measurement(300, 1, 10), "other": Measurement(100, 1, 10)}
    registry.record_measurements(OP, registry.platform, None, "x=8", first)
    kept = registry.record_measurements(OP, registry.platform, None, "x=8", second)
    assert kept == first


def test_a_candidate_that_failed_when_measured_cannot_win() -> None:
    registry = _registry()
    registry.record_measurements(
        OP,
        registry.platform,
        None,
        "x=8",
        {"fast": Measurement(500, 1, 10), "torch": Measurement(400, 1, 10)},
    )
    decision = registry.explain(OP, bucket="x=8")
    assert decision.rule == "autotune"
    assert decision.chosen is not None
    assert decision.chosen.backend == "torch"
    assert decision.candidate("other").reasons[-1] == "failed when measured"
    assert decision.tuning == ()


def test_strict_mode_keeps_the_reference_out_of_the_race() -> None:
    registry = _registry(strict=(OP,))
    decision = registry.explain(OP, bucket="x=8")
    assert [s.label for s in decision.tuning] == ["fast", "other"]


def test_a_plan_records_and_replays_tuned_shape_buckets() -> None:
    from kernreg.plan import PlanEntry, SelectionPlan
    from kernreg.registry import build_plan

    registry = _registry()
    registry.record_measurements(
        OP,
        registry.platform,
        None,
        "x=8",
        {"fast": Measurement(900, 5, 10), "other": Measurement(100, 5, 10)},
    )
    plan = build_plan(registry, platforms=[registry.platform])
    by_bucket = {e.bucket: e for e in plan.entries()}
    assert set(by_bucket) == {None, "x=8"}
    assert (by_bucket["x=8"].label, by_bucket["x=8"].rule) == ("other", "autotune")
    assert (by_bucket[None].label, by_bucket[None].rule) == ("fast", "priority")
    assert "shapes x=8" in str(by_bucket["x=8"])
    # A worker following a plan that says otherwise for that bucket does what the plan says.
    follower = _registry()
    follower.use_plan(
        SelectionPlan(
            [PlanEntry(OP, "cpu", None, "torch", "", "autotune", "pkg.k:ref", bucket="x=8")]
        )
    )
    decision = follower.explain(OP, bucket="x=8")
    assert decision.rule == "plan"
    assert decision.chosen is not None
    assert decision.chosen.backend == "torch"
    # Buckets the plan does not list are decided (and measured) as usual.
    assert follower.explain(OP, bucket="x=16").rule == "priority"

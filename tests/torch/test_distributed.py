"""kernreg.torch.distributed: ranks of real gloo process groups (2 and 4 worker processes) prove
they run the same kernels, are told exactly where they do not, and follow one rank's plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

import kernreg  # noqa: E402
import kernreg.torch.distributed as kd  # noqa: E402
from kernreg.config import ENV_VARS  # noqa: E402
from kernreg.plan import PlanEntry, SelectionPlan  # noqa: E402
from kernreg.tuning import TuningStore  # noqa: E402

WORKER = Path(__file__).parent / "distributed_workers" / "worker.py"
#: A job whose ranks hang (a collective nobody joins) fails after this long instead of
#: stalling the suite; the ranks themselves give up on a collective after 30 s.
JOB_TIMEOUT = 90

Results = list[dict[str, Any]]


def _run_job(
    scenario: str, world: int, workdir: Path, env_of_rank: Callable[[int], dict[str, str]]
) -> Results:
    """Run ``world`` worker processes of ``scenario``; return each rank's phase results."""
    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    base.update(KERNREG_PLUGINS="none", KERNREG_PLATFORM="cpu")
    procs = []
    for rank in range(world):
        env = {**base, "KERNREG_CACHE_DIR": str(workdir / f"cache-rank{rank}"), **env_of_rank(rank)}
        command = [sys.executable, str(WORKER), scenario, str(rank), str(world)]
        command += [str(workdir / "init"), str(workdir)]
        with open(workdir / f"log-rank{rank}.txt", "w") as log:
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        for proc in procs:
            proc.wait(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
        pytest.fail(f"{scenario}: the {world} ranks did not finish within {JOB_TIMEOUT} s")
    for rank, proc in enumerate(procs):
        log = (workdir / f"log-rank{rank}.txt").read_text()
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{log}"
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(world)]


def _ok(results: Results, phase: str) -> list[Any]:
    """The value of ``phase`` on each rank, which must have succeeded without warnings."""
    for rank, result in enumerate(results):
        assert "ok" in result[phase], f"rank {rank}, {phase}: {result[phase]}"
        assert "warnings" not in result[phase], f"rank {rank}, {phase}: {result[phase]}"
    return [result[phase]["ok"] for result in results]


@pytest.fixture(scope="module")
def job(
    tmp_path_factory: pytest.TempPathFactory, once_per_session: Callable[..., Any]
) -> Callable[..., Results]:
    """``job(scenario, world, env_of_rank)``: :func:`_run_job`, once per test run."""

    def run(scenario: str, world: int, env_of_rank: Callable[[int], dict[str, str]]) -> Results:
        return once_per_session(  # type: ignore[no-any-return]
            f"distributed_{scenario}",
            lambda: _run_job(scenario, world, tmp_path_factory.mktemp(scenario), env_of_rank),
        )

    return run


@pytest.fixture(scope="module")
def agreeing(job: Callable[..., Results]) -> Results:
    """Two ranks with the same inventory and environment."""
    return job("agree", 2, lambda rank: {})


@pytest.fixture(scope="module")
def pinned_rank(job: Callable[..., Results]) -> Results:
    """Four ranks; rank 1 alone pins ``layernorm.rmsnorm`` to its torch reference."""
    return job(
        "mismatch", 4, lambda rank: {"KERNREG_PIN": "layernorm.rmsnorm=torch"} if rank == 1 else {}
    )


# --- without a process group ----------------------------------------------------------


def test_errors_are_kernreg_errors() -> None:
    assert issubclass(kd.RankMismatchError, kd.DistributedError)
    for base in (kernreg.KernregError, RuntimeError):
        assert issubclass(kd.RankMismatchError, base)
        assert issubclass(kd.DistributedError, base)


@pytest.mark.parametrize("collective", [kd.verify, kd.share_plan])
def test_collectives_need_an_initialised_process_group(collective: Callable[[], Any]) -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(kd.DistributedError, match=r"not initialised: call .*init_process_group"):
        collective()


@pytest.mark.parametrize("payload", [b"", b"a", "plan \u00e9\u4e2d".encode(), bytes(range(256))])
def test_bytes_survive_the_tensor_encoding(payload: bytes) -> None:
    cpu = torch.device("cpu")
    padded = kd._to_tensor(payload, len(payload) + 5, cpu)
    assert padded.dtype == torch.uint8
    assert kd._to_bytes(padded) == payload + bytes(5)
    assert kd._to_bytes(kd._to_tensor(payload, len(payload), cpu)) == payload


# --- real groups: ranks that agree ---------------------------------------------------


def test_agreeing_ranks_get_the_common_fingerprint(agreeing: Results) -> None:
    fingerprints = _ok(agreeing, "verify")
    assert len(set(fingerprints)) == 1
    assert len(fingerprints[0]) == 64
    assert fingerprints == _ok(agreeing, "local_fingerprint")


def test_verify_takes_a_registry_and_platforms(agreeing: Results) -> None:
    fingerprints = _ok(agreeing, "verify_explicit")
    assert len(set(fingerprints)) == 1
    assert fingerprints[0] != _ok(agreeing, "verify")[0]  # cuda:9.0 decisions are included


def test_a_failing_rank_fails_every_rank_instead_of_hanging(agreeing: Results) -> None:
    rank0, rank1 = (result["peer_failure"] for result in agreeing)
    assert rank1["error"] == "InvalidSpecError"  # its own error, raised where it happened
    assert rank0["error"] == "DistributedError"
    assert rank0["message"].startswith("rank 1 failed in a kernreg collective")
    assert len(set(_ok(agreeing, "verify_again"))) == 1  # the group is still usable


def test_share_plan_between_agreeing_ranks(agreeing: Results) -> None:
    assert _ok(agreeing, "share_plan") == _ok(agreeing, "verify")
    # Rank 0 had no tuning results to send, so rank 1 got no tuning store created for it.
    assert _ok(agreeing, "default_store_created")[1] is False


@pytest.fixture(scope="module")
def autotuned(job: Callable[..., Results]) -> Results:
    """Two ranks under ``KERNREG_POLICY=autotune``; only rank 0 measured a shape bucket."""
    return job("autotune", 2, lambda rank: {"KERNREG_POLICY": "autotune"})


def test_share_plan_brings_autotuned_decisions_into_agreement(autotuned: Results) -> None:
    errors = [result["verify"] for result in autotuned]
    assert all(error["mismatch"] for error in errors), errors
    assert (
        "  op layernorm.rmsnorm on cpu, bfloat16, shapes x=1024: rank 0 runs torch (autotune); "
        "rank 1 has no such decision"
    ) in errors[1]["message"].splitlines()
    shared = _ok(autotuned, "share_plan")
    assert _ok(autotuned, "verify_after") == shared
    # The measurements reached rank 1's own store (KERNREG_CACHE_DIR), not only the plan.
    assert _ok(autotuned, "tuned_buckets") == [[[["bfloat16"], "x=1024"]]] * 2


def test_ranks_that_demoted_differently_disagree_loudly(job: Callable[..., Results]) -> None:
    results = job("demoted", 2, lambda rank: {"KERNREG_DEMOTE": "layernorm.*"})
    errors = [result["verify"] for result in results]
    assert all(error.get("mismatch") for error in errors), errors
    assert (
        "  op layernorm.rmsnorm on cpu, bfloat16, shapes x=4096: rank 0 has no such decision; "
        "rank 1 runs torch (reference)"
    ) in errors[0]["message"].splitlines()


def test_verify_first_thing_sees_the_installed_plugins(tmp_path: Path) -> None:
    """``verify()`` right after ``init_process_group``, nothing selected yet: the op pack's
    kernels are in the fingerprint, so a rank that denies aten is caught, and the plan
    rank 0 shares is not empty."""
    results = _run_job(
        "installed",
        2,
        tmp_path,
        lambda rank: {"KERNREG_PLUGINS": "auto", **({"KERNREG_DENY": "aten"} if rank else {})},
    )
    errors = [result["verify"] for result in results]
    assert all(error.get("mismatch") for error in errors), errors
    assert "layernorm.rmsnorm" in errors[0]["message"]
    assert "rank 1 runs" in errors[0]["message"]
    sizes = _ok(results, "share_plan")
    assert sizes[0] == sizes[1] > 0
    # The shared plan says aten, rank 1's KERNREG_DENY says no: every rank is told.
    checked = [result["share_plan_checked"] for result in results]
    assert all(error.get("mismatch") for error in checked), checked
    assert "rank 1 runs torch" in checked[0]["message"]


# --- real groups: one rank configured differently ------------------------------------


def test_mismatch_is_raised_on_every_rank_naming_op_and_ranks(pinned_rank: Results) -> None:
    assert _ok(pinned_rank, "chosen_before") == ["aten", "torch", "aten", "aten"]
    errors = [result["verify"] for result in pinned_rank]
    assert all(error["mismatch"] for error in errors), errors
    message = errors[0]["message"]
    assert all(error["message"] == message for error in errors)
    lines = message.splitlines()
    assert lines[0].startswith("ranks run different kernels: 2 selection fingerprints among 4")
    assert (
        "  op layernorm.rmsnorm on cpu, bfloat16: ranks 0,2,3 run aten (priority); "
        "rank 1 runs torch (pin)"
    ) in lines
    assert "op layernorm.rmsnorm on cpu, float16: ranks 0,2,3 run aten" in message
    assert "any dtype" not in message  # the reference runs everywhere there: no difference
    assert "share_plan()" in lines[-1]


def test_verify_on_a_subgroup(pinned_rank: Results) -> None:
    pair = [result["verify_subgroup"] for result in pinned_rank[:2]]
    assert all(error["mismatch"] for error in pair), pair
    assert "rank 0 runs aten (priority); rank 1 runs torch (pin)" in pair[0]["message"]
    assert len(set(_ok(pinned_rank[2:], "verify_subgroup"))) == 1


def test_share_plan_source_must_be_in_the_group(pinned_rank: Results) -> None:
    for result in pinned_rank:
        assert result["share_bad_src"]["error"] == "ValueError"
        assert "src=7 is not a rank of the group (ranks 0-3)" in result["share_bad_src"]["message"]


def test_share_plan_makes_every_rank_follow_the_source(pinned_rank: Results) -> None:
    plans = _ok(pinned_rank, "share_plan")
    assert len(set(plans)) == 1
    shared = SelectionPlan.from_json(plans[0])
    assert shared.lookup("layernorm.rmsnorm", "cpu", ("bfloat16",)).backend == "aten"
    assert _ok(pinned_rank, "chosen_after") == ["aten"] * 4  # rank 1's pin no longer wins
    assert _ok(pinned_rank, "plan_source") == ["shared by rank 0"] * 4
    after = _ok(pinned_rank, "verify_after")
    assert len(set(after)) == 1
    assert after[0] == shared.fingerprint()


def test_share_plan_carries_tuning_results(pinned_rank: Results) -> None:
    if not hasattr(TuningStore, "import_json"):
        pytest.skip("kernreg.tuning.TuningStore has no export_json/import_json yet")
    exports = _ok(pinned_rank, "tuning_export")
    assert len(set(exports)) == 1  # ranks 1-3 hold exactly what rank 0 measured
    entries = json.loads(exports[0])["entries"]
    assert [entry["key"]["bucket"] for entry in entries] == ["m<=64", "m>64"]
    assert entries[0]["results"]["aten"]["median_ns"] == 1000.0


# --- the message, from plans built here ----------------------------------------------


def _plan(*choices: tuple[str, str, str]) -> SelectionPlan:
    """A plan of ``(op, backend, rule)`` decisions on cpu for bfloat16."""
    return SelectionPlan(
        PlanEntry(
            op, "cpu", ("bfloat16",), backend, "", rule, f"kops.{backend}:{op.replace('.', '_')}"
        )
        for op, backend, rule in choices
    )


def test_message_lists_a_bounded_number_of_decisions() -> None:
    ops = [f"bulk.op{i:03d}" for i in range(300)]
    fast = _plan(*((op, "aten", "priority") for op in ops))
    slow = _plan(*((op, "torch", "pin") for op in ops))
    fingerprints = {rank: fast.fingerprint() for rank in range(64)} | {5: slow.fingerprint()}
    error = kd._mismatch_error(fingerprints, {fast.fingerprint(): fast, slow.fingerprint(): slow})
    lines = str(error).splitlines()
    assert len(lines) == 1 + kd.MAX_LISTED + 2
    assert lines[1] == (
        "  op bulk.op000 on cpu, bfloat16: ranks 0-4,6-63 run aten (priority); rank 5 runs torch (pin)"
    )
    assert lines[-2] == f"  ... and {300 - kd.MAX_LISTED} more differing decisions"
    assert len(error.differences) == 300
    assert error.fingerprints[5] == slow.fingerprint()


@pytest.mark.parametrize(
    ("other", "expected"),
    [
        (_plan(), "rank 1 has no such decision"),
        (_plan(("norm.rms", "", "ambiguous")), "rank 1 runs nothing (ambiguous)"),
        (
            SelectionPlan(
                [PlanEntry("norm.rms", "cpu", ("bfloat16",), "aten", "", "priority", "b:c")]
            ),
            "rank 0 runs aten (priority) = kops.aten:norm_rms; rank 1 runs aten (priority) = b:c",
        ),
        (
            SelectionPlan(
                [
                    PlanEntry(
                        "norm.rms",
                        "cpu",
                        ("bfloat16",),
                        "aten",
                        "",
                        "priority",
                        "a:b",
                        "ops",
                        "2.0",
                    )
                ]
            ),
            "rank 1 runs aten (priority) [ops 2.0]",
        ),
    ],
    ids=["missing", "no-choice", "same-label-other-target", "distribution"],
)
def test_message_describes_each_side(other: SelectionPlan, expected: str) -> None:
    mine = _plan(("norm.rms", "aten", "priority"))
    error = kd._mismatch_error(
        {0: mine.fingerprint(), 1: other.fingerprint()},
        {mine.fingerprint(): mine, other.fingerprint(): other},
    )
    assert expected in str(error)


def test_message_names_the_shape_bucket_of_autotuned_decisions() -> None:
    fast, slow = (
        SelectionPlan(
            [PlanEntry("norm.rms", "cpu", ("bfloat16",), b, "", "autotune", "a:b", bucket="m<=64")]
        )
        for b in ("aten", "torch")
    )
    error = kd._mismatch_error(
        {0: fast.fingerprint(), 1: slow.fingerprint()},
        {fast.fingerprint(): fast, slow.fingerprint(): slow},
    )
    assert (
        "op norm.rms on cpu, bfloat16, shapes m<=64: rank 0 runs aten (autotune); "
        "rank 1 runs torch (autotune)"
    ) in str(error)


def test_message_names_different_platforms() -> None:
    hopper = SelectionPlan(
        [PlanEntry("norm.rms", "cuda:9.0", None, "triton", "", "priority", "a:b")]
    )
    ampere = SelectionPlan(
        [PlanEntry("norm.rms", "cuda:8.0", None, "torch", "", "priority", "a:c")]
    )
    error = kd._mismatch_error(
        {0: hopper.fingerprint(), 1: ampere.fingerprint(), 2: hopper.fingerprint()},
        {hopper.fingerprint(): hopper, ampere.fingerprint(): ampere},
    )
    assert (
        "the ranks decide for different platforms: ranks 0,2 decide for cuda:9.0; "
        "rank 1 decides for cuda:8.0"
    ) in str(error)


def test_message_counts_fingerprints_it_did_not_compare() -> None:
    plans = [_plan(("norm.rms", f"b{i}", "priority")) for i in range(kd.MAX_COMPARED + 3)]
    fingerprints = {rank: plan.fingerprint() for rank, plan in enumerate(plans)}
    compared = {plan.fingerprint(): plan for plan in plans[: kd.MAX_COMPARED]}
    first = str(kd._mismatch_error(fingerprints, compared)).splitlines()[0]
    assert first.endswith(f"3 more on ranks {kd.MAX_COMPARED}-{kd.MAX_COMPARED + 2}, not compared)")


def test_the_old_module_name_still_works_with_a_deprecation_warning() -> None:
    import importlib

    sys.modules.pop("kernreg.distributed", None)
    with pytest.warns(DeprecationWarning, match=r"kernreg\.torch\.distributed"):
        old = importlib.import_module("kernreg.distributed")
    assert old.verify is kd.verify
    assert old.RankMismatchError is kd.RankMismatchError


def test_a_model_kernelized_before_share_plan_follows_the_site_pins_of_the_plan(
    job: Callable[..., Results],
) -> None:
    # Rank 0 pins the norm site; the plan it shares carries that pin. Rank 1 kernelized
    # before it loaded the plan: its fingerprint then says it follows the pin, so it must.
    pin = {"KERNREG_PIN": "demo.scale@norm=torch"}
    results = job("kernelized", 2, lambda rank: pin if rank == 0 else {})
    assert _ok(results, "kernelize") == [2, 2]
    assert _ok(results, "ran_before") == [
        {"norm": "torch", "other": "fast"},
        {"norm": "fast", "other": "fast"},
    ]
    assert _ok(results, "share_plan") == [["demo.scale@norm=torch"]] * 2
    assert _ok(results, "ran_after") == [{"norm": "torch", "other": "fast"}] * 2


def test_ranks_whose_kernelized_models_run_otherwise_disagree_naming_the_site(
    job: Callable[..., Results],
) -> None:
    results = job("kernelize_pins", 2, lambda rank: {})
    # The same pins, models kernelized in another order (one since unkernelized): agree.
    alike = _ok(results, "alike")
    assert alike[0] == alike[1]
    assert alike[0] != _ok(results, "plan_fingerprint")[0]  # the models are in it
    model = "torch.nn.modules.container:Sequential"
    pinned = results[0]["other_pins"]
    assert [r["other_pins"]["message"] for r in results] == [pinned["message"]] * 2
    assert pinned["mismatch"]
    assert (
        f"kernelized site norm of {model} (op demo.scale): rank 0 runs fast and torch "
        "(kernelize pin torch); rank 1 runs fast and fast\n" in pinned["message"]
    )
    assert _ok(results, "outcome") == ["routed", "rejected"]
    rejected = results[1]["other_outcomes"]
    assert rejected["mismatch"]
    assert (
        f"kernelized site norm of {model} (op demo.scale): rank 0 runs fast and fast and "
        "torch (kernelize pin torch); rank 1 runs its own forward (fast rejected by "
        "verification) and fast and torch (kernelize pin torch)\n" in rejected["message"]
    )
    # The model that differed is unkernelized: it drops out, and the ranks agree again.
    assert _ok(results, "unkernelized") == alike


def test_ranks_agree_on_deep_copies_and_on_parts_kernelized_again_whatever_the_module_order(
    job: Callable[..., Results],
) -> None:
    results = job("kernelize_copies", 2, lambda rank: {})
    # Rank 0 keeps only a deep copy of its kernelized model: it runs what rank 1 runs.
    alike = _ok(results, "copy_only")
    assert alike[0] == alike[1] != _ok(results, "plan_fingerprint")[0]
    # Copies that run otherwise (their originals unkernelized) disagree, naming the site.
    differ = [r["copies_differ"] for r in results]
    assert all(d.get("mismatch") for d in differ), differ
    assert (
        "kernelized site norm of torch.nn.modules.container:Sequential (op demo.scale): "
        "rank 0 runs fast; rank 1 runs torch (kernelize pin torch)\n" in differ[0]["message"]
    )
    # A part kernelized again with a pin: each site is told by its path in the model.
    part = _ok(results, "part_pinned")
    assert part[0] == part[1]

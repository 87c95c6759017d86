"""Signal-mode jobs: never resized or moved, priced as all the work since their last start, and
the sentence of a decision that stops one says so."""

from __future__ import annotations

import pytest

from jobs.planner import Node, PlannerConfig, Reservation, plan
from jobs.planner.harvest import fits_in_grace
from jobs.planner.rhythm import reclaim_lead_time
from jobs.planner.victims import loss_gpu_s, victim_options
from tests.planner.factory import cluster, gpus_on, job, snapshot

NODES = cluster(switches=1, per_switch=4)
NOW = 100_000.0


def _signal(name: str, priority: str = "best_effort", **spec: object):
    return job(name, priority, integration="signal", **spec)


def _stopped(result) -> list[str]:
    return sorted(a.job for a in result.actions if a.kind in ("preempt", "shrink", "reclaim"))


def test_a_signal_job_is_priced_as_all_its_work_since_it_started() -> None:
    sig = _signal("sig", gpus=gpus_on("r0s0n0"), run_started_s=NOW - 340.0, grace_s=30.0)
    assert sig.signal
    assert loss_gpu_s(sig, PlannerConfig(), NOW) == (340.0 + 30.0) * 8
    # Checkpoint progress it might report does not make it cheaper: Omni cannot see its saves.
    saved = _signal("sig", gpus=gpus_on("r0s0n0"), run_started_s=NOW - 340.0, grace_s=30.0,
                    committed_steps=300, last_checkpoint_step=300)
    assert loss_gpu_s(saved, PlannerConfig(), NOW) == loss_gpu_s(sig, PlannerConfig(), NOW)


def test_victim_choice_prefers_an_omni_job_that_would_lose_more_steps() -> None:
    # The omni job has 150 unsaved steps (3760 GPU-s at risk); the signal job has saved nothing
    # Omni can see, which would make it look cheap (160 GPU-s), but it has run 340 s on 16 GPUs.
    omni = job("b-omni", "best_effort", dp=2, gpus=gpus_on("r0s0n0", "r0s0n1"), committed_steps=150,
               last_checkpoint_step=0)
    sig = _signal("a-signal", dp=2, gpus=gpus_on("r0s0n2", "r0s0n3"), run_started_s=NOW - 340.0)
    config = PlannerConfig()
    assert loss_gpu_s(omni, config, NOW) == 3760.0 < loss_gpu_s(sig, config, NOW) == 5920.0
    result = plan(snapshot(NODES, [omni, sig, job("crit", "critical", dp=2)]), NOW)
    assert _stopped(result) == ["b-omni"]


def test_at_equal_cost_the_omni_job_goes_first() -> None:
    omni = job("b-omni", "best_effort", dp=2, gpus=gpus_on("r0s0n0", "r0s0n1"), committed_steps=150,
               last_checkpoint_step=0)
    sig = _signal("a-signal", dp=2, gpus=gpus_on("r0s0n2", "r0s0n3"), run_started_s=NOW - 235.0, grace_s=0.0)
    config = PlannerConfig()
    assert loss_gpu_s(omni, config, NOW) == loss_gpu_s(sig, config, NOW)
    result = plan(snapshot(NODES, [sig, omni, job("crit", "critical", dp=2)]), NOW)
    assert _stopped(result) == ["b-omni"]


def test_a_signal_job_is_preempted_rather_than_shrunk() -> None:
    # Bounds that would allow a shrink (impossible at submission, where dp_min = dp = dp_max is
    # enforced) still never make the planner resize a signal job.
    sig = _signal("sig", dp=2, dp_min=1, dp_max=2, gpus=gpus_on("r0s0n0", "r0s0n1"))
    assert [len(o.kept) for o in victim_options(sig, PlannerConfig(), now_s=NOW)] == [0]
    holders = job("crit-running", "critical", dp=2, gpus=gpus_on("r0s0n2", "r0s0n3"))
    result = plan(snapshot(NODES, [sig, holders, job("crit", "critical", dp=1)]), NOW)
    assert [(a.kind, a.job) for a in result.actions if a.kind != "hold"] == [("preempt", "sig")]
    twin = job("omni", "best_effort", dp=2, dp_min=1, dp_max=2, gpus=gpus_on("r0s0n0", "r0s0n1"))
    result = plan(snapshot(NODES, [twin, holders, job("crit", "critical", dp=1)]), NOW)
    assert [(a.kind, a.job) for a in result.actions if a.kind != "hold"] == [("shrink", "omni")]


def test_a_signal_job_never_grows() -> None:
    spec = dict(dp=1, dp_min=1, dp_max=4, global_batch=64, gpus=gpus_on("r0s0n0"), run_started_s=0.0)
    assert plan(snapshot(NODES, [job("omni", "regular", **spec)]), NOW).by_kind("grow")
    assert not plan(snapshot(NODES, [_signal("sig", "regular", **spec)]), NOW).actions


def test_a_signal_job_is_not_migrated_off_a_slow_node() -> None:
    nodes = (Node("r0s0n0", "r0", "r0s0", 8, "healthy", 2.0), *NODES[1:])
    spec = dict(total_steps=100_000, gpus=gpus_on("r0s0n0"))
    assert plan(snapshot(nodes, [job("omni", "regular", **spec)]), NOW).by_kind("migrate")
    assert not plan(snapshot(nodes, [_signal("sig", "regular", **spec)]), NOW).actions


def test_a_drain_stops_a_signal_job_instead_of_moving_it() -> None:
    nodes = cluster(switches=1, per_switch=4, r0s0n0="draining")
    assert plan(snapshot(nodes, [job("omni", "regular", gpus=gpus_on("r0s0n0"))]), NOW).by_kind("migrate")
    result = plan(snapshot(nodes, [_signal("sig", "regular", gpus=gpus_on("r0s0n0"), grace_s=45.0,
                                           run_started_s=NOW - 600.0)]), NOW)
    (stop,) = result.actions
    assert (stop.kind, stop.forced, stop.deadline_s) == ("preempt", True, NOW + 45.0 + 30.0)
    assert "gets SIGTERM and 45 s to exit before SIGKILL" in stop.reason.text
    assert "never moved or resized" in stop.reason.text


def test_preempting_a_signal_job_says_why_and_gives_it_its_grace() -> None:
    sig = _signal("sig", dp=2, gpus=gpus_on("r0s0n0", "r0s0n1"), run_started_s=NOW - 340.0, grace_s=20.0)
    holders = job("crit-running", "critical", dp=2, gpus=gpus_on("r0s0n2", "r0s0n3"))
    result = plan(snapshot(NODES, [sig, holders, job("crit", "critical", dp=2)]), NOW)
    (preempt,) = result.by_kind("preempt")
    assert preempt.reason.text == (
        "crit (critical) needs GPUs; this best_effort signal-mode job: its checkpoints are not visible to "
        "Omni, so preempting it costs all 5 min of work since its last start; it gets SIGTERM and 20 s to "
        "exit before SIGKILL (5760 GPU-s at risk); no cheaper victim."
    )
    assert preempt.reason.inputs["signal"] is True
    assert preempt.reason.inputs["work_since_start_s"] == 340.0
    assert preempt.deadline_s == NOW + 20.0 + PlannerConfig().reclaim_margin_s


@pytest.mark.parametrize(("grace_s", "fits"), [(20.0, True), (90.0, False)])
def test_a_signal_borrower_is_given_its_grace_before_a_reclaim(grace_s: float, fits: bool) -> None:
    sig = _signal("sig", gpus=gpus_on("r0s0n0"), grace_s=grace_s)
    config = PlannerConfig()
    assert reclaim_lead_time(sig, config) == grace_s + config.reclaim_margin_s
    assert fits_in_grace(sig, config) is fits


def test_reclaiming_a_loan_from_a_signal_job_says_what_it_costs() -> None:
    pool = ("r0s0n2", "r0s0n3")
    borrower = _signal("sig", "regular", dp=2, gpus=gpus_on(*pool), borrowed_from="r", grace_s=20.0,
                       run_started_s=1000.0)
    snap = snapshot(NODES, [borrower, job("crit", "critical", dp=2)],
                    (Reservation("r", "crit", gpus=16, start_s=2000.0, nodes=pool),))
    (reclaim,) = plan(snap, 2000.0).by_kind("reclaim")
    assert reclaim.deadline_s == 2000.0 + 20.0 + 30.0
    assert reclaim.reason.text == (
        "Reservation 'r' needs its GPUs now; the loan ends now, so the job returns 16 GPUs within 50s (its "
        "grace + margin). It is a signal-mode job: its checkpoints are not visible to Omni, so preempting it "
        "costs all 16 min of work since its last start; it gets SIGTERM and 20 s to exit before SIGKILL."
    )


def test_recovering_a_signal_job_says_its_script_resumes_from_its_own_save() -> None:
    """The planner does not see a signal-mode script's saves: its recovery names none."""
    omni = job("o", "regular", dp=1, phase="recovering", last_checkpoint_step=40)
    sig = _signal("s", priority="regular", dp=1, phase="recovering")
    result = plan(snapshot(NODES, [omni, sig]), NOW)
    words = {a.job: a.reason.text for a in result.actions if a.kind == "recover"}
    assert "its script starts again from its own last save" in words["s"] and "step" not in words["s"]
    assert "restarts from step 40 on 1 replica (" in words["o"] and "replica(s)" not in words["o"]

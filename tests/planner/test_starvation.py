"""Rule 8: min_run_s protection and ageing of long waiters."""

from __future__ import annotations

from jobs.planner import PlannerConfig, plan
from jobs.planner.starvation import effective_rank, queue_key
from tests.planner.factory import cluster, gpus_on, job, snapshot

NODES = cluster(switches=1, per_switch=2)
ALL = gpus_on("r0s0n0", "r0s0n1")


def test_a_long_waiting_best_effort_job_ages_up_but_never_past_critical() -> None:
    config = PlannerConfig(ageing_s=3600.0)
    be = job("be", "best_effort", submit_s=0.0)
    assert effective_rank(be, 100.0, config) == 2
    assert effective_rank(be, 3700.0, config) == 1
    assert effective_rank(be, 100_000.0, config) == 1
    crit = job("crit", "critical", submit_s=99_000.0)
    reg = job("reg", submit_s=99_000.0)
    keys = sorted((queue_key(j, 100_000.0, config, 3), j.name) for j in (be, reg))
    assert [name for _, name in keys] == ["reg", "be"]  # same standing: the class by right first
    assert effective_rank(crit, 100_000.0, config) == 0


def test_a_long_waiting_regular_job_takes_gpus_from_one_that_had_its_min_run() -> None:
    runner = job("runner", dp=2, dp_min=1, global_batch=64, gpus=ALL, run_started_s=0.0, min_run_s=7200.0)
    waiter = job("waiter", dp=1, submit_s=600.0, queued_since_s=600.0)
    snap = snapshot(NODES, [runner, waiter])
    assert not plan(snap, 7000.0).by_kind("shrink")
    result = plan(snap, 7800.0)
    (shrink,) = result.by_kind("shrink")
    assert shrink.job == "runner" and shrink.reason.rule == "starvation"
    assert shrink.dp_after == 1


def test_an_aged_waiter_cannot_take_from_a_job_inside_its_min_run() -> None:
    runner = job("runner", dp=2, gpus=ALL, run_started_s=5000.0, min_run_s=7200.0)
    waiter = job("waiter", dp=1, submit_s=0.0, queued_since_s=0.0)
    result = plan(snapshot(NODES, [runner, waiter]), 9000.0)
    assert not [a for a in result.actions if a.kind in ("shrink", "preempt")]
    assert result.by_kind("hold")[0].job == "waiter"


def test_each_stop_earns_a_job_a_longer_turn_before_a_long_waiter_of_its_class_stops_it_again() -> None:
    # Stopped twice before, the runner may be stopped for a long waiter of its class only after
    # 3 x min_run_s of its new run: jobs that all wait long take turns ever less often.
    waiter = job("waiter", dp=1, submit_s=0.0, queued_since_s=0.0)
    stopped = job("runner", dp=2, dp_min=1, global_batch=64, gpus=ALL, run_started_s=0.0, min_run_s=7200.0,
                  preemptions=2)
    snap = snapshot(NODES, [stopped, waiter])
    assert not [a for a in plan(snap, 21_000.0).actions if a.kind in ("shrink", "preempt")]
    assert plan(snap, 21_000.0).by_kind("hold")[0].job == "waiter"
    (shrink,) = plan(snap, 21_700.0).by_kind("shrink")
    assert shrink.job == "runner" and shrink.reason.rule == "starvation"
    # Never stopped before: its min_run_s alone protects it.
    fresh = job("runner", dp=2, dp_min=1, global_batch=64, gpus=ALL, run_started_s=0.0, min_run_s=7200.0)
    assert plan(snapshot(NODES, [fresh, waiter]), 7800.0).by_kind("shrink")

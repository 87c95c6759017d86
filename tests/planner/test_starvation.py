"""Rule 8: min_run_s protection and ageing of long waiters."""

from __future__ import annotations

import math

from jobs.planner import PlannerConfig, plan
from jobs.planner.starvation import (
    class_rank,
    effective_rank,
    min_run_of,
    promoted,
    protected_by_min_run,
    protected_from_long_waiters,
    queue_key,
    queue_order_s,
    requeues_behind,
    run_protection_s,
    turn_s,
)
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


def test_each_stop_doubles_a_jobs_turn_before_a_long_waiter_of_its_class_stops_it_again() -> None:
    # Stopped twice before, the runner may be stopped for a long waiter of its class only after
    # 2^2 x min_run_s = 28,800 s of its new run (a linear 3 x min_run_s would let it go at
    # 21,600 s): jobs that all wait long take turns ever less often.
    waiter = job("waiter", dp=1, submit_s=0.0, queued_since_s=0.0)
    stopped = job("runner", dp=2, dp_min=1, global_batch=64, gpus=ALL, run_started_s=0.0, min_run_s=7200.0,
                  preemptions=2)
    snap = snapshot(NODES, [stopped, waiter])
    assert turn_s(stopped) == 28_800.0
    assert not [a for a in plan(snap, 28_000.0).actions if a.kind in ("shrink", "preempt")]
    assert plan(snap, 28_000.0).by_kind("hold")[0].job == "waiter"
    (shrink,) = plan(snap, 28_900.0).by_kind("shrink")
    assert shrink.job == "runner" and shrink.reason.rule == "starvation"
    # Never stopped before: its min_run_s alone protects it.
    fresh = job("runner", dp=2, dp_min=1, global_batch=64, gpus=ALL, run_started_s=0.0, min_run_s=7200.0)
    assert turn_s(fresh) == 7200.0
    assert plan(snapshot(NODES, [fresh, waiter]), 7800.0).by_kind("shrink")


def test_a_job_stopped_many_times_keeps_a_finite_turn() -> None:
    # A borrower of a recurring reservation's gaps is stopped at every gap's end: its turn stays
    # a number (no overflow), longer than any run.
    many = job("runner", dp=2, gpus=ALL, run_started_s=0.0, min_run_s=7200.0, preemptions=10_000)
    assert math.isfinite(turn_s(many)) and turn_s(many) > 1e15
    assert protected_from_long_waiters(many, 1e12)


# --- the regular queue's order: when a job began waiting plus a share of its length ----------------

ONE_NODE = cluster(switches=1, per_switch=1)


def _first_started(jobs: list, now_s: float, config: PlannerConfig, planner=plan) -> list[str]:
    result = planner(snapshot(ONE_NODE, jobs), now_s, config)
    return [a.job for a in result.actions if a.kind == "place"]


def test_a_short_regular_job_goes_ahead_of_a_long_one_that_began_waiting_a_little_earlier() -> None:
    # One node, room for one of them. The long job (100,000 s of steps) came 1,000 s earlier; at
    # the default weight 0.25 it stands at 0 + 25,000 and the short one (1,000 s) at 1,000 + 250.
    long = job("long", submit_s=0.0, total_steps=100_000, step_s=1.0)
    short = job("short", submit_s=1000.0, total_steps=1000, step_s=1.0)
    for explain in (True, False):  # walked job by job, and by group as a quiet pass walks it
        config = PlannerConfig(explain_holds=explain)
        assert queue_order_s(long, 0.0, config) == 25_000.0
        assert queue_order_s(short, 1000.0, config) == 1250.0
        assert _first_started([long, short], 1100.0, config) == ["short"]
    # First come, first served with the weight at 0.
    assert _first_started([long, short], 1100.0, PlannerConfig(queue_length_weight=0.0)) == ["long"]


def test_a_long_regular_job_that_has_waited_longer_than_its_share_of_the_difference_goes_first() -> None:
    # The short job came 30,000 s after the long one: more than 0.25 x the 99,000 s between their
    # runs, so the long job is not passed over (its standing does not move as newcomers arrive).
    long = job("long", submit_s=0.0, total_steps=100_000, step_s=1.0)
    short = job("short", submit_s=30_000.0, total_steps=1000, step_s=1.0)
    assert _first_started([long, short], 30_100.0, PlannerConfig()) == ["long"]
    # What has been done counts: a job stopped with 10% left stands by what remains.
    nearly = job("nearly", submit_s=5000.0, queued_since_s=5000.0, total_steps=100_000,
                 committed_steps=90_000, last_checkpoint_step=90_000, phase="preempted")
    assert queue_order_s(nearly, 5000.0, PlannerConfig()) == 5000.0 + 0.25 * 10_000
    assert _first_started([long, nearly], 6000.0, PlannerConfig()) == ["nearly"]


def test_best_effort_work_keeps_the_order_of_its_wait() -> None:
    long = job("long", "best_effort", submit_s=0.0, total_steps=100_000, step_s=1.0)
    short = job("short", "best_effort", submit_s=1000.0, total_steps=1000, step_s=1.0)
    # A best-effort job stands promote_after_s after its wait began, every one alike
    assert queue_order_s(short, 1000.0, PlannerConfig()) - queue_order_s(long, 0.0, PlannerConfig()) == 1000.0
    assert _first_started([long, short], 1100.0, PlannerConfig()) == ["long"]


def test_the_static_baseline_stays_first_come_first_served() -> None:
    from jobs.simulator.policies import plan_static

    long = job("long", submit_s=0.0, total_steps=100_000, step_s=1.0)
    short = job("short", submit_s=1000.0, total_steps=1000, step_s=1.0)
    assert _first_started([long, short], 1100.0, PlannerConfig(), planner=plan_static) == ["long"]


def test_a_long_waiter_does_not_stop_a_job_that_would_wait_ahead_of_it() -> None:
    # The waiter has 100,000 s of steps left: it stands at 600 + 25,000 s. A runner with 10,000 s
    # left, stopped at 7,800 s, would stand at 7,800 + 2,500 s, ahead of it, and take its GPUs
    # back at the next pass: the long waiter leaves it be. One with 100,000 s left would stand
    # at 7,800 + 25,000 s, behind it, and is stopped.
    waiter = job("waiter", dp=1, submit_s=600.0, queued_since_s=600.0, total_steps=100_000)
    config = PlannerConfig()
    for left, stopped in ((10_000, False), (100_000, True)):
        runner = job("runner", dp=2, dp_min=1, global_batch=64, gpus=ALL, run_started_s=0.0, min_run_s=7200.0,
                     total_steps=left)
        assert requeues_behind(runner, queue_order_s(waiter, 600.0, config), 7800.0, config) is stopped
        result = plan(snapshot(NODES, [runner, waiter]), 7800.0)
        taken = [a for a in result.actions if a.kind in ("shrink", "preempt")]
        assert [(a.job, a.reason.rule) for a in taken] == ([("runner", "starvation")] if stopped else [])
        if not stopped:
            assert result.by_kind("hold")[0].job == "waiter"


def test_a_best_effort_job_that_has_waited_promote_after_s_queues_as_a_regular_job_that_came_then() -> None:
    # Aged, it stands as a regular job but behind every regular job; promoted, it stands among
    # them as a regular job that came promote_after_s after it began waiting: behind one that
    # stands earlier (came at 45,000 s, 10 s of run: 45,002.5), ahead of one that stands later.
    config = PlannerConfig(ageing_s=3600.0, promote_after_s=50_000.0)
    be = job("be", "best_effort", submit_s=0.0, total_steps=10)
    later = job("later", submit_s=60_000.0, total_steps=10)
    earlier = job("earlier", submit_s=45_000.0, total_steps=10)

    def order(now: float) -> list[str]:
        return [j.name for j in sorted((be, later, earlier), key=lambda j: queue_key(j, now, config, 3))]

    assert queue_order_s(be, 0.0, config) == 50_000.0
    assert not promoted(be, 49_999.0, config) and class_rank(be, 49_999.0, config) == 2
    assert order(49_999.0) == ["earlier", "later", "be"]
    assert promoted(be, 50_000.0, config) and class_rank(be, 50_000.0, config) == 1
    assert order(50_000.0) == ["earlier", "be", "later"]
    # Off, or a regular job: nothing to promote, and best-effort work stands at its wait
    off = PlannerConfig(promote_after_s=0.0)
    assert not promoted(be, 10**9, off) and queue_order_s(be, 0.0, off) == 0.0
    assert not promoted(later, 10**9, config)


def test_a_promoted_best_effort_job_starts_before_a_regular_job_that_stands_after_it() -> None:
    config = PlannerConfig(promote_after_s=50_000.0)
    holder = job("holder", gpus=gpus_on("r0s0n0"), run_started_s=0.0, min_run_s=10**9)
    be = job("be", "best_effort", submit_s=0.0, queued_since_s=0.0)
    # 10,000 s of run: it stands at 48,000 + 2,500 s, after the promoted job's 50,000 s
    reg = job("reg", submit_s=48_000.0, queued_since_s=48_000.0)
    snap = snapshot(NODES, [holder, be, reg])
    (place,) = plan(snap, 49_000.0, config).by_kind("place")
    assert place.job == "reg"  # not yet promoted: the regular class first
    (place,) = plan(snap, 50_000.0, config).by_kind("place")
    assert place.job == "be"
    # Held, it says why it stands where it does
    full = snapshot(NODES, [job("holder", dp=2, gpus=ALL, run_started_s=0.0, min_run_s=10**9), be])
    (hold,) = plan(full, 60_000.0, config).by_kind("hold")
    assert hold.job == "be" and hold.reason.inputs["cause"] == "promoted"  # audited when it begins
    (before,) = plan(full, 49_000.0, config).by_kind("hold")
    assert before.reason.inputs["cause"] == "capacity"
    assert ("more than 13 h 53 min, so it now queues as regular work by right, standing as a regular job "
            "that came 13 h 53 min after it began waiting") in hold.reason.text


def test_a_promoted_best_effort_jobs_run_has_the_regular_min_run() -> None:
    # Started after a wait of promote_after_s, it is not stopped for the next regular arrival until
    # it has run min_run_s; a best-effort job started after a short wait is stopped at once.
    config = PlannerConfig(promote_after_s=50_000.0, min_run_s=7200.0)
    reg = job("reg", tp=8, dp=2, submit_s=60_000.0, queued_since_s=60_000.0)

    def runner(queued_since: float) -> object:
        return job("be", "best_effort", gpus=ALL, dp=2, submit_s=0.0, queued_since_s=queued_since,
                   run_started_s=55_000.0)

    promoted_run = runner(0.0)
    assert min_run_of(promoted_run, config) == 7200.0
    assert protected_by_min_run(promoted_run, 62_000.0, config)
    assert not [a for a in plan(snapshot(NODES, [promoted_run, reg]), 62_000.0, config).actions
                if a.kind in ("shrink", "preempt")]
    (stop,) = plan(snapshot(NODES, [promoted_run, reg]), 62_300.0, config).by_kind("preempt")
    assert stop.job == "be"
    plain_run = runner(50_000.0)  # waited 5,000 s before its run
    assert min_run_of(plain_run, config) == 0.0 and not protected_by_min_run(plain_run, 62_000.0, config)
    (stop,) = plan(snapshot(NODES, [plain_run, reg]), 62_000.0, config).by_kind("preempt")
    assert stop.job == "be"


def test_the_protection_of_a_run_read_from_plain_facts_matches_the_planners() -> None:
    # The simulator's quota invariant reads ``run_protection_s``: it must protect exactly the runs
    # ``min_run_of`` protects, so a promoted run the planner will not stop is no quota breach.
    config = PlannerConfig(promote_after_s=172_800.0, min_run_s=7200.0)
    assert run_protection_s("best_effort", 0.0, 172_800.0, config) == 7200.0
    assert run_protection_s("best_effort", 0.0, 172_799.0, config) == 0.0
    assert run_protection_s("regular", 3600.0, 10**6, config) == 3600.0
    assert run_protection_s("best_effort", 0.0, 10**6, PlannerConfig(promote_after_s=0.0)) == 0.0
    for queued_since in (0.0, 1.0, 100_000.0):
        running = job("be", "best_effort", gpus=ALL, dp=2, submit_s=0.0, queued_since_s=queued_since,
                      run_started_s=172_800.0)
        assert min_run_of(running, config) == run_protection_s("best_effort", 0.0, 172_800.0 - queued_since, config)

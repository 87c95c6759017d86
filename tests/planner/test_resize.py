"""Rule 5: resize only by whole replicas, at a constant global batch."""

from __future__ import annotations

import pytest

from jobs.planner import Gpu, Job, PlannerConfig, Reservation, plan
from jobs.planner.layout import accum_steps, layout_problems, valid_dps
from tests.planner.factory import cluster, gpus_on, job, snapshot

EIGHT_NODES = tuple(f"r0s{s}n{n}" for s in range(2) for n in range(4))


def test_only_batch_exact_dps_are_valid() -> None:
    j = job("a", dp=4, dp_min=1, dp_max=8, global_batch=96, micro_batch=4)
    assert valid_dps(j) == (1, 2, 3, 4, 6, 8)
    assert accum_steps(j, 3) == 8 and accum_steps(j, 5) is None


def test_shrink_keeps_global_batch() -> None:
    # The seed's example: 64 GPUs, global batch 1024, shrunk to 32 GPUs doubles accumulation.
    pool = EIGHT_NODES[4:]
    llm = job("llm-64", tp=8, dp=8, dp_min=4, dp_max=8, global_batch=1024, micro_batch=16,
              gpus=gpus_on(*EIGHT_NODES), run_started_s=0.0, min_run_s=7200.0)
    res = Reservation("res", "vlm", gpus=32, start_s=3600.0, nodes=pool)
    snap = snapshot(cluster(), [llm, job("vlm", "critical", dp=4)], (res,))
    (reclaim,) = plan(snap, 3600.0).by_kind("reclaim")
    assert (reclaim.dp_before, reclaim.dp_after) == (8, 4)
    assert (reclaim.accum_before, reclaim.accum_after) == (8, 16)
    assert reclaim.global_batch == 1024
    assert 16 * reclaim.dp_after * reclaim.accum_after == 1024
    assert len(reclaim.gpus_after) == 32
    assert not {g.node for g in reclaim.gpus_after} & set(pool)


def test_layout_problems_flag_a_split_tp_group_and_partial_replicas() -> None:
    j = job("a", tp=4, dp=2, dp_min=1, dp_max=2, global_batch=8)
    split = (Gpu("x", 0), Gpu("x", 1), Gpu("y", 0), Gpu("y", 1))
    assert any("TP group" in p for p in layout_problems(j, split))
    assert any("whole number" in p for p in layout_problems(j, split[:3]))
    assert layout_problems(j, (Gpu("x", 0), Gpu("x", 1), Gpu("x", 2), Gpu("x", 3))) == []


def test_an_elastic_job_grows_into_free_gpus_after_the_hysteresis() -> None:
    j = job("sft", tp=8, dp=2, dp_min=1, dp_max=4, global_batch=64, gpus=gpus_on(*EIGHT_NODES[:2]),
            run_started_s=0.0, total_steps=100_000, step_s=2.0)
    snap = snapshot(cluster(), [j])
    assert not plan(snap, 600.0).by_kind("grow")
    (grow,) = plan(snap, 4000.0).by_kind("grow")
    assert (grow.dp_before, grow.dp_after) == (2, 4)
    assert (grow.accum_before, grow.accum_after) == (32, 16)
    assert set(j.gpus) <= set(grow.gpus_after)


def test_a_job_in_a_periodic_save_grows_on_the_pass_after_it() -> None:
    def sft(phase: str, run_started_s: float = 0.0) -> Job:
        return job("sft", tp=8, dp=2, dp_min=1, dp_max=4, global_batch=64, gpus=gpus_on(*EIGHT_NODES[:2]),
                   run_started_s=run_started_s, total_steps=100_000, step_s=2.0, save_s=25.0, phase=phase)

    saving = plan(snapshot(cluster(), [sft("checkpointing")]), 4000.0)
    assert not saving.by_kind("grow")
    assert saving.wake_at_s == pytest.approx(4025.0)  # when the save is done
    assert plan(snapshot(cluster(), [sft("running")]), 4025.0).by_kind("grow")
    # Within the hysteresis, nothing to wake for.
    assert plan(snapshot(cluster(), [sft("checkpointing", run_started_s=3000.0)]), 4000.0).wake_at_s is None


def test_a_job_started_below_dp_max_starts_larger_when_gpus_are_free() -> None:
    # 8 nodes of 8 GPUs, 4 held: a new job preferring 2 replicas of 8 (up to 4) starts on 4 at
    # once (no restart to grow later), and says so.
    busy = job("busy", tp=8, dp=4, gpus=gpus_on(*EIGHT_NODES[:4]))
    sweep = job("sweep", "best_effort", tp=8, dp=2, dp_min=1, dp_max=4, global_batch=64)
    (start,) = plan(snapshot(cluster(), [busy, sweep]), 0.0).by_kind("place")
    assert (start.job, start.dp_after, start.accum_after) == ("sweep", 4, 16)
    assert "It starts at dp 4 rather than 2: 16 more GPUs are free" in start.reason.text
    # Not while a job of its class or higher waits for capacity after it.
    big = job("big", tp=8, dp=8, submit_s=1.0)
    result = plan(snapshot(cluster(), [busy, sweep, big]), 0.0)
    (start,) = [a for a in result.actions if a.job == "sweep"]
    assert start.dp_after == 2
    # Into a pool's GPUs only if the time saved before the pool needs them pays for the restart
    # its reclaim will cost: not 150 s ahead (it still borrows at its own size), but 25 h ahead.
    for start_s, dp in ((150.0, 2), (90_000.0, 4)):
        res = Reservation("pool", "crit", gpus=32, start_s=start_s, nodes=EIGHT_NODES[4:])
        (start,) = plan(snapshot(cluster(), [busy, sweep], (res,)), 0.0).actions
        assert (start.job, start.kind, start.dp_after) == ("sweep", "lend", dp)


def test_growth_while_an_equal_priority_job_waits_only_into_gpus_it_could_not_start_on() -> None:
    # 48 GPUs are free and the waiting job needs 64 at its smallest: it could not start on them,
    # so the running job of its class grows into them (shrunk back to its preferred size when
    # the waiter can then start, rule 4).
    j = job("sft", tp=8, dp=2, dp_min=1, dp_max=8, global_batch=64, gpus=gpus_on(*EIGHT_NODES[:2]),
            run_started_s=0.0, total_steps=100_000)
    big = job("big", tp=8, dp=8)
    (grow,) = plan(snapshot(cluster(), [j, big]), 4000.0).by_kind("grow")
    assert (grow.job, grow.dp_after) == ("sft", 8)
    assert "48 GPUs are free and no job of equal or higher priority that waits could start on them" in grow.reason.text
    # One that needs 32 waits while 16 are free: it could not start on them either, so sft grows.
    small = job("small", tp=8, dp=4, dp_min=4)
    busy = job("busy", tp=8, dp=2, gpus=gpus_on(*EIGHT_NODES[2:4]))
    other = job("other", tp=8, dp=2, gpus=gpus_on(*EIGHT_NODES[4:6]))
    result = plan(snapshot(cluster(), [j, busy, other, small]), 4000.0)
    assert result.by_kind("hold")[0].job == "small"
    assert [(a.job, a.dp_after) for a in result.by_kind("grow")] == [("sft", 4)]
    # A waiting job that could start on free GPUs it may use would have been started; one held
    # off them (a pool's short window, harvest.takes_window) keeps growth to such windows: below.


def test_a_job_kept_off_a_short_window_leaves_it_to_a_running_job_that_grows_into_it() -> None:
    # General capacity is full; the pool's 32 GPUs are needed at 7,200 s. The waiting job would
    # take 2 of them and not finish before then (harvest.takes_window): it is kept off them, and
    # the running elastic job grows into the window instead, its saving counted until the window
    # ends. Its reclaim then is a shrink, not a stop.
    pool = EIGHT_NODES[4:]
    res = Reservation("window", "crit", gpus=32, start_s=7200.0, nodes=pool)
    sft = job("sft", tp=8, dp=2, dp_min=2, dp_max=6, global_batch=96, gpus=gpus_on(*EIGHT_NODES[:2]),
              run_started_s=0.0, total_steps=100_000, step_s=4.0)
    busy = job("busy", tp=8, dp=2, gpus=gpus_on(*EIGHT_NODES[2:4]))
    small = job("small", tp=1, dp=2, total_steps=100_000)
    result = plan(snapshot(cluster(), [sft, busy, small], (res,)), 4000.0)
    (lend,) = result.by_kind("lend")
    assert (lend.job, lend.dp_after, lend.borrowed_from, lend.deadline_s) == ("sft", 6, ("window",), 7200.0)
    assert {g.node for g in lend.gpus_after} - set(EIGHT_NODES[:2]) <= set(pool)
    assert "no job of equal or higher priority that waits could start on them" not in lend.reason.text
    saved = lend.reason.inputs["saved_s"]
    assert 0 < saved < 3200.0  # the window, not the remaining 100,000 steps
    assert result.by_kind("hold")[0].job == "small"
    # Without the rule the small job borrows 2 GPUs of the window (to be stopped at its end), and
    # sft grows into the rest.
    result = plan(snapshot(cluster(), [sft, busy, small], (res,)), 4000.0, PlannerConfig(loan_share_min=0.0))
    assert [(a.job, a.kind, len(a.gpus_after)) for a in result.actions if a.kind in ("lend", "grow")] == [
        ("small", "lend", 2), ("sft", "lend", 32)]

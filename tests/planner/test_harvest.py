"""Rule 3: lend reserved-but-idle GPUs, reclaim them with a checkpoint ahead of need."""

from __future__ import annotations

import pytest

from jobs.planner import PlannerConfig, Reservation, plan
from jobs.planner.harvest import finish_window_s
from jobs.planner.rhythm import min_loan_window_s, reclaim_lead_time, stop_time_s
from tests.planner.factory import cluster, gpus_on, job, snapshot

POOL = ("r0s1n0", "r0s1n1", "r0s1n2", "r0s1n3")
RES = Reservation("vlm-window", "vlm", gpus=32, start_s=7200.0, nodes=POOL)
GENERAL = gpus_on("r0s0n0", "r0s0n1", "r0s0n2", "r0s0n3")


def test_idle_reserved_gpus_are_lent_before_the_window_opens() -> None:
    snap = snapshot(cluster(), [job("busy", gpus=GENERAL, dp=4), job("sft", dp=2)], (RES,))
    result = plan(snap, 0.0)
    (lend,) = result.by_kind("lend")
    assert lend.job == "sft"
    assert lend.borrowed_from == ("vlm-window",)
    assert {g.node for g in lend.gpus_after} <= set(POOL)
    assert lend.deadline_s == 7200.0
    assert lend.reason.rule == "harvest.lend"
    assert result.wake_at_s is not None and result.wake_at_s <= 7200.0


def test_no_loan_into_a_window_too_short_to_be_worth_it() -> None:
    snap = snapshot(cluster(), [job("busy", gpus=GENERAL, dp=4), job("sft", dp=2)], (RES,))
    result = plan(snap, 7200.0 - 60.0)
    assert not result.by_kind("lend")
    (hold,) = result.by_kind("hold")
    assert hold.job == "sft"
    assert "cannot be lent to it: they are needed again in 1 min, sooner than this job could start" in hold.reason.text


def test_a_job_with_fewer_steps_left_than_a_loan_asks_for_borrows_a_window_it_finishes_in() -> None:
    # A loan asks for a window fitting start-up, load, min_loan_steps (20) steps and the reclaim's
    # lead time; a job with 3 steps left needs only those 3: it finishes in the window, no stop.
    busy = job("busy", gpus=GENERAL, dp=4)
    short, long_ = job("short", dp=2, total_steps=3, step_s=30.0), job("long", dp=2, total_steps=1000, step_s=30.0)
    config = PlannerConfig()
    finish_s = finish_window_s(short, 2, config)
    assert finish_s < min_loan_window_s(long_, 2, config)
    now = 7200.0 - finish_s - 5.0

    (lend,) = plan(snapshot(cluster(), [busy, short], (RES,)), now).by_kind("lend")
    assert lend.job == "short" and lend.borrowed_from == ("vlm-window",)
    assert "(start-up, load, the 3 steps it has left, save)" in lend.reason.text
    assert not plan(snapshot(cluster(), [busy, long_], (RES,)), now).by_kind("lend")
    late = plan(snapshot(cluster(), [busy, short], (RES,)), 7200.0 - finish_s + 30.0)
    assert not late.by_kind("lend")
    assert "sooner than this job could start, load, run the 3 steps it has left and save" in \
        late.by_kind("hold")[0].reason.text


def test_reclaim_starts_one_lead_time_before_the_entitlement() -> None:
    borrower = job("sft", dp=2, gpus=gpus_on("r0s1n0", "r0s1n1"), borrowed_from="vlm-window", save_s=20.0)
    snap = snapshot(cluster(), [job("busy", gpus=GENERAL, dp=4), borrower], (RES,))
    lead = reclaim_lead_time(borrower, PlannerConfig())

    early = plan(snap, 7200.0 - lead - 100.0)
    assert not early.by_kind("reclaim")
    assert early.wake_at_s == pytest.approx(7200.0 - lead)

    due = plan(snap, 7200.0 - lead)
    (reclaim,) = due.by_kind("reclaim")
    assert reclaim.job == "sft" and reclaim.graceful
    assert reclaim.gpus_after == ()
    # A save taking safety_factor x as long may end inside the grace, never past it: the
    # command's deadline allows that much beyond the need.
    config = PlannerConfig()
    slack = stop_time_s(borrower, config) + config.reclaim_margin_s - lead
    assert 0 < slack <= config.reclaim_grace_s
    assert reclaim.deadline_s == pytest.approx(7200.0 + slack)
    assert reclaim.reason.inputs["lead_time_s"] == pytest.approx(lead, abs=1e-3)
    assert "still ends within the 60s grace" in reclaim.reason.text


def test_an_erratic_borrower_is_reclaimed_earlier_and_the_row_says_why() -> None:
    steady = job("sft", dp=2, gpus=gpus_on("r0s1n0", "r0s1n1"), borrowed_from="vlm-window", save_s=20.0,
                 step_times=(10.0,) * 50)
    erratic = job("sft", dp=2, gpus=gpus_on("r0s1n0", "r0s1n1"), borrowed_from="vlm-window", save_s=20.0,
                  step_times=(2.0, 18.0) * 25)
    config = PlannerConfig()
    assert reclaim_lead_time(erratic, config) > reclaim_lead_time(steady, config)
    for borrower, widened in ((steady, False), (erratic, True)):
        snap = snapshot(cluster(), [job("busy", gpus=GENERAL, dp=4), borrower], (RES,))
        (reclaim,) = plan(snap, 7200.0 - reclaim_lead_time(borrower, config)).by_kind("reclaim")
        assert ("so its margin is widened" in reclaim.reason.text) is widened
        assert reclaim.reason.inputs.get("margin_widened", False) is widened


def test_hot_spares_are_lent_while_the_owner_runs() -> None:
    pool = (*POOL, "r0s0n3")
    res = Reservation("r", "crit", gpus=32, spares=8, nodes=pool)
    owner = job("crit", "critical", dp=4, gpus=gpus_on(*POOL))
    snap = snapshot(cluster(), [owner, job("busy", gpus=gpus_on("r0s0n0", "r0s0n1", "r0s0n2"), dp=3),
                                job("probe", "best_effort")], (res,))
    (lend,) = plan(snap, 100.0).by_kind("lend")
    assert lend.job == "probe" and lend.gpus_after == gpus_on("r0s0n3")
    assert "hot spares" in lend.reason.text and "stopped without a checkpoint" not in lend.reason.text
    # A borrower that could not save within the grace is told what a fault would mean for it.
    slow = job("probe", "best_effort", save_s=120.0)
    snap = snapshot(cluster(), [owner, job("busy", gpus=gpus_on("r0s0n0", "r0s0n1", "r0s0n2"), dp=3), slow], (res,))
    (lend,) = plan(snap, 100.0).by_kind("lend")
    assert "(if one does, this job cannot save within the grace and is stopped without a checkpoint)" in lend.reason.text


def test_kill_mode_takes_gpus_back_at_the_moment_of_need_without_a_checkpoint() -> None:
    borrower = job("sft", dp=4, gpus=gpus_on(*POOL), borrowed_from="vlm-window")
    owner = job("vlm", "critical", dp=4, submit_s=7200.0)
    config = PlannerConfig(reclaim_mode="kill")
    snap_before = snapshot(cluster(), [job("busy", gpus=GENERAL, dp=4), borrower], (RES,))
    assert not plan(snap_before, 7100.0, config).by_kind("reclaim")
    snap = snapshot(cluster(), [job("busy", gpus=GENERAL, dp=4), borrower, owner], (RES,))
    result = plan(snap, 7200.0, config)
    (reclaim,) = result.by_kind("reclaim")
    assert not reclaim.graceful
    (place,) = result.by_kind("place")
    assert place.job == "vlm" and {g.node for g in place.gpus_after} == set(POOL)


def test_critical_job_never_borrows_another_reservations_gpus() -> None:
    snap = snapshot(cluster(), [job("busy", gpus=GENERAL, dp=4), job("other-crit", "critical", dp=2)], (RES,))
    result = plan(snap, 0.0)
    assert not result.by_kind("lend")
    assert result.by_kind("hold")[0].job == "other-crit"


def test_before_the_reserved_job_arrives_quick_savers_and_frequent_savers_borrow() -> None:
    active = Reservation("open", "vlm", gpus=32, start_s=0.0, nodes=POOL)
    quick = job("quick", "best_effort", dp=2, save_s=10.0)
    slow = job("slow", "best_effort", dp=2, save_s=120.0)  # saves every 100 steps of 1 s
    rare = job("rare", "best_effort", dp=2, save_s=120.0, step_s=40.0)  # every 4,000 s
    busy = job("busy", gpus=GENERAL, dp=4)
    (lent,) = plan(snapshot(cluster(), [busy, quick], (active,)), 100.0).by_kind("lend")
    assert lent.job == "quick" and "this job can save within the 1 min it would have" in lent.reason.text
    # The slow saver may be stopped without a checkpoint if the job comes: it loses at most 100 s.
    (lent,) = plan(snapshot(cluster(), [busy, slow], (active,)), 100.0).by_kind("lend")
    assert lent.job == "slow"
    assert "is stopped without a checkpoint, losing at most the steps since its last periodic save" in lent.reason.text
    # Not one that saves less often than loan_loss_max_s, and not with lend_past_grace off.
    result = plan(snapshot(cluster(), [busy, rare], (active,)), 100.0)
    assert not result.by_kind("lend")
    (hold,) = result.by_kind("hold")
    assert "nor stopped without one: it saves only every 1 h 6 min" in hold.reason.text
    off = PlannerConfig(lend_past_grace=False)
    assert not plan(snapshot(cluster(), [busy, slow], (active,)), 100.0, off).by_kind("lend")


def test_an_unannounced_owner_stops_a_slow_saving_borrower_without_a_checkpoint() -> None:
    active = Reservation("open", "vlm", gpus=32, start_s=0.0, nodes=POOL)
    busy = job("busy", gpus=GENERAL, dp=4)
    owner = job("vlm", "critical", dp=4, submit_s=500.0)
    for save_s, unsaved in ((10.0, False), (120.0, True)):
        borrower = job("b", "best_effort", dp=4, gpus=gpus_on(*POOL), borrowed_from="open", save_s=save_s,
                       committed_steps=250, last_checkpoint_step=200)
        (reclaim,) = plan(snapshot(cluster(), [busy, borrower, owner], (active,)), 500.0).by_kind("reclaim")
        assert reclaim.graceful is not unsaved
        assert reclaim.reason.inputs.get("unsaved", False) is unsaved
        if unsaved:
            assert reclaim.deadline_s == 500.0 and "predicted_stop_s" not in reclaim.reason.inputs
            assert reclaim.reason.inputs["steps_since_save"] == 50
            assert "stopped without a checkpoint" in reclaim.reason.text and "50 steps" in reclaim.reason.text
    # One that also holds general GPUs gives those back too: a job stopped unsaved restarts whole.
    busy3 = job("busy", gpus=gpus_on("r0s0n0", "r0s0n1", "r0s0n2"), dp=3)
    wide = job("b", "best_effort", dp=5, dp_min=1, gpus=gpus_on(*POOL, "r0s0n3"), borrowed_from="open", save_s=120.0)
    (reclaim,) = plan(snapshot(cluster(), [busy3, wide, owner], (active,)), 500.0).by_kind("reclaim")
    assert not reclaim.graceful and reclaim.gpus_after == ()
    assert "(and the other 8 it holds: it restarts from its last save)" in reclaim.reason.text
    # With room for the owner outside every pool, nobody is stopped unsaved: it starts there.
    small = job("vlm", "critical", dp=1, submit_s=500.0)
    slow = job("b", "best_effort", dp=4, gpus=gpus_on(*POOL), borrowed_from="open", save_s=120.0)
    result = plan(snapshot(cluster(), [busy3, slow, small], (active,)), 500.0)
    assert not result.by_kind("reclaim")
    (place,) = result.by_kind("place")
    assert place.job == "vlm" and {g.node for g in place.gpus_after} == {"r0s0n3"}
    # With lend_past_grace off the slow saver saves, and the owner waits past the grace.
    borrower = job("b", "best_effort", dp=4, gpus=gpus_on(*POOL), borrowed_from="open", save_s=120.0)
    off = PlannerConfig(lend_past_grace=False)
    (reclaim,) = plan(snapshot(cluster(), [busy, borrower, owner], (active,)), 500.0, off).by_kind("reclaim")
    assert reclaim.graceful


def test_a_recurring_pools_gaps_are_unannounced_until_its_job_arrives() -> None:
    hourly = Reservation("hourly", "vlm", gpus=32, start_s=0.0, period_s=3600.0, active_s=2400.0, nodes=POOL)
    busy = job("busy", gpus=GENERAL, dp=4)
    borrower = job("b", "best_effort", dp=4, gpus=gpus_on(*POOL), borrowed_from="hourly", save_s=20.0)
    # In a gap (t=3000) with the job not arrived, the next window is no known need: no reclaim
    # ahead of it, whatever the lead time.
    assert not plan(snapshot(cluster(), [busy, borrower], (hourly,)), 3600.0 - 40.0).by_kind("reclaim")
    off = PlannerConfig(lend_past_grace=False)
    assert plan(snapshot(cluster(), [busy, borrower], (hourly,)), 3600.0 - 40.0, off).by_kind("reclaim")
    # Once the job has arrived, the gaps are planned: the borrower is asked ahead of the window.
    owner = job("vlm", "critical", dp=4, submit_s=2500.0, phase="pending")
    (reclaim,) = plan(snapshot(cluster(), [busy, borrower, owner], (hourly,)), 3600.0 - 40.0).by_kind("reclaim")
    assert reclaim.graceful and reclaim.reason.inputs["need_at_s"] == 3600.0


def test_a_short_window_goes_only_to_a_borrower_large_enough_or_one_that_finishes_in_it() -> None:
    # The pool's 32 GPUs are needed at 7,200 s; at 1,000 s the window (6,200 s) is shorter than
    # min_run_s (7,200 s), so each borrower that would not finish in it must take at least
    # loan_share_min (1/8) of the pool, 4 GPUs: a window is cut into at most 8 stopped loans.
    busy = job("busy", gpus=GENERAL, dp=4)

    def borrower(gpus: int, steps: int) -> list:
        return [busy, job("b", tp=1, dp=gpus, total_steps=steps, step_s=1.0)]

    def lent(jobs: list, now_s: float = 1000.0, config: PlannerConfig | None = None) -> bool:
        return bool(plan(snapshot(cluster(), jobs, (RES,)), now_s, config).by_kind("lend"))

    assert not lent(borrower(2, 10_000))
    hold = plan(snapshot(cluster(), borrower(2, 10_000), (RES,)), 1000.0).by_kind("hold")[0]
    assert ("32 free GPUs of reservation 'vlm-window' cannot be lent to it: they are needed again in "
            "1 h 43 min, before this job could finish, and it would take 2 of the pool's 32 GPUs, less than the "
            "12.5% a loan stopped at the window's end must take") in hold.reason.text
    assert lent(borrower(4, 10_000))  # an eighth of the pool
    assert lent(borrower(2, 1_000))  # done well before the need
    assert lent(borrower(2, 10_000), now_s=0.0)  # a window of min_run_s: a whole turn
    assert lent(borrower(2, 10_000), config=PlannerConfig(loan_share_min=0.0))
    assert lent(borrower(2, 10_000), config=PlannerConfig(reclaim_mode="kill"))

"""Rule 9, teams (jobs/planner/quota.py): a unit test per rule. Order (work within a quota first,
whatever its class; fair share within a class), the guard on lower-class work within a quota, the
borrowing limit, reclaiming what other teams borrowed (checkpoint first, within each team's
excess, never a recent start), fair share among borrowers, team reservations, and the words."""

from __future__ import annotations

import pytest

from jobs.planner import PlannerConfig, Reservation, plan, quota
from jobs.planner.quota import TeamBook, accrue, decayed
from jobs.planner.snapshot import Snapshot, Team
from tests.planner.factory import cluster, gpus_on, job

NODES = cluster(switches=1, per_switch=4)  # 4 nodes x 8 GPUs
ALL = [f"r0s0n{i}" for i in range(4)]


def snap(jobs, teams, reservations=()) -> Snapshot:
    return Snapshot(NODES, tuple(jobs), tuple(reservations), (), False, tuple(teams))


def acts(result, kind=None):
    return {a.job: a for a in result.actions if kind is None or a.kind == kind}


def test_fair_share_usage_decays_with_its_half_life():
    assert decayed(100.0, 3600.0, 3600.0) == pytest.approx(50.0)
    # Holding 8 GPUs for one half-life from nothing: 8 x h / ln 2 x (1 - 1/2).
    assert accrue(0.0, 8, 3600.0, 3600.0) == pytest.approx(8 * 3600 / 0.6931471805599453 * 0.5)
    assert accrue(10.0, 0, 0.0, 3600.0) == 10.0


def test_a_team_within_its_quota_is_served_before_a_borrower_of_the_same_class():
    teams = [Team("vision", quota_gpus=16), Team("speech", quota_gpus=16)]
    running = job("v-run", tp=8, dp=2, gpus=gpus_on("r0s0n0", "r0s0n1"), team="vision")
    # vision already holds its 16; both want the last 8 GPUs (one node free after the borrower).
    borrower = job("v-more", tp=8, dp=1, team="vision", submit_s=0.0)
    owed = job("s-new", tp=8, dp=1, team="speech", submit_s=100.0)
    other = job("filler", tp=8, dp=1, gpus=gpus_on("r0s0n3"), team="speech")
    result = plan(snap([running, borrower, owed, other], teams), 1000.0)
    placed = acts(result, "place")
    assert "s-new" in placed and "v-more" not in placed  # the later arrival, owed its quota, goes first
    hold = acts(result, "hold")["v-more"]
    assert "team vision uses 16 of its 16 guaranteed GPUs and may borrow any idle GPU beyond them; none are idle" \
        in hold.reason.text


def test_a_teams_best_effort_job_within_its_quota_goes_ahead_of_another_teams_borrowing_regular_job():
    # vision holds its 16 and wants 8 more for a regular job: it could only borrow. speech holds
    # nothing of its 8 and has a best-effort job waiting. The one free node goes to speech's job:
    # a quota covers all of its team's work, whatever the class (as a Kueue ClusterQueue's does).
    teams = [Team("vision", quota_gpus=16), Team("speech", quota_gpus=8)]
    running = job("v-run", tp=8, dp=2, gpus=gpus_on("r0s0n0", "r0s0n1"), team="vision")
    filler = job("filler", tp=8, dp=1, gpus=gpus_on("r0s0n3"), run_started_s=9_000.0, min_run_s=7200.0)
    borrower = job("v-more", tp=8, dp=1, team="vision", submit_s=0.0)
    owed = job("s-be", "best_effort", tp=8, dp=1, team="speech", submit_s=500.0)
    result = plan(snap([running, filler, borrower, owed], teams), 10_000.0)
    assert set(acts(result, "place")) == {"s-be"}
    assert acts(result, "hold")["v-more"].reason.inputs["cause"] == "capacity"
    # Without its quota speech's job is a borrower like any: the regular job goes first.
    alone = plan(snap([running, filler, borrower, owed], [teams[0], Team("speech", quota_gpus=0)]), 10_000.0)
    assert set(acts(alone, "place")) == {"v-more"}


def test_a_higher_class_takes_from_another_teams_lower_class_only_what_it_borrowed():
    # speech runs two best-effort jobs, 8 GPUs within its quota of 8 and 8 beyond it; vision's
    # regular job (vision below its quota of 24: 16 held) needs 8. Rule 4 may take a lower class's
    # GPUs, but of another team only what it holds beyond its quota: one job of the two, not both.
    teams = [Team("vision", quota_gpus=24), Team("speech", quota_gpus=8)]
    v_run = job("v-run", tp=8, dp=2, gpus=gpus_on("r0s0n0", "r0s0n1"), team="vision")
    be = [job(f"s-be{i}", "best_effort", tp=8, dp=1, gpus=gpus_on(ALL[2 + i]), team="speech",
              run_started_s=0.0, min_run_s=0.0) for i in range(2)]
    wants = job("v-new", tp=8, dp=2, team="vision", submit_s=9_000.0)
    result = plan(snap([v_run, *be, wants], teams), 10_000.0)
    assert not acts(result, "preempt")  # 16 wanted, 8 may be taken: it waits, stopping no one
    one = job("v-one", tp=8, dp=1, team="vision", submit_s=9_000.0)
    result = plan(snap([v_run, *be, one], teams), 10_000.0)
    assert len(acts(result, "preempt")) + len(acts(result, "reclaim")) == 1
    # speech within its quota (one job): its job is not vision's to take, whatever the class.
    result = plan(snap([v_run, be[0], job("f", tp=8, gpus=gpus_on(ALL[3]), run_started_s=9_500.0,
                                          min_run_s=7200.0), one], teams), 10_000.0)
    assert "s-be0" not in acts(result, "preempt") and "s-be0" not in acts(result, "shrink")
    # Critical work stands above quotas: a critical job of vision may take it.
    crit = job("v-crit", "critical", tp=8, dp=1, team="vision", submit_s=9_000.0)
    result = plan(snap([v_run, be[0], job("f", tp=8, gpus=gpus_on(ALL[3]), run_started_s=9_500.0,
                                          min_run_s=7200.0), crit], teams), 10_000.0)
    assert "s-be0" in acts(result, "preempt")


def test_among_borrowers_the_team_with_least_past_usage_per_weight_gets_idle_gpus_first():
    teams = [Team("a", quota_gpus=0, usage_gpu_s=1000.0, weight=1.0),
             Team("b", quota_gpus=0, usage_gpu_s=1500.0, weight=2.0)]  # 750 per weight: owed more
    full = job("full", tp=8, dp=3, gpus=gpus_on(*ALL[:3]), team=None)
    result = plan(snap([full, job("a1", tp=8, team="a", submit_s=0.0), job("b1", tp=8, team="b", submit_s=50.0)],
                       teams), 1000.0)
    assert set(acts(result, "place")) == {"b1"}


def test_within_their_quotas_jobs_are_served_in_the_order_of_their_wait_not_by_fair_share():
    # Both teams start within their quotas: fair share has nothing to arbitrate, so the job
    # that has waited longer gets the one free node although its team has had more of late.
    teams = [Team("a", quota_gpus=16, usage_gpu_s=9000.0), Team("b", quota_gpus=16, usage_gpu_s=10.0)]
    full = job("full", tp=8, dp=3, gpus=gpus_on(*ALL[:3]), team=None)
    result = plan(snap([full, job("a1", tp=8, team="a", submit_s=0.0), job("b1", tp=8, team="b", submit_s=50.0)],
                       teams), 1000.0)
    assert set(acts(result, "place")) == {"a1"}


def test_a_job_starts_within_its_quota_while_another_teams_owed_work_waits():
    # Two nodes free. a1 (first: it has waited longer) could take both, but team a's quota is 8
    # and b1, of a team below its quota, waits behind it: what a1 took beyond would be b1's to
    # reclaim, a save and a restart later, and not in this pass. So a1 starts on 8, b1 on 8.
    teams = [Team("a", quota_gpus=8), Team("b", quota_gpus=8)]
    full = job("full", tp=8, dp=2, gpus=gpus_on(*ALL[:2]), team=None)
    a1 = job("a1", tp=8, dp=2, dp_min=1, dp_max=2, global_batch=128, team="a", submit_s=0.0)
    b1 = job("b1", tp=8, team="b", submit_s=50.0)
    result = plan(snap([full, a1, b1], teams), 1000.0)
    placed = acts(result, "place")
    assert set(placed) == {"a1", "b1"} and len(placed["a1"].gpus_after) == 8
    assert not acts(result, "shrink")
    # Alone, a1 borrows the idle node: nobody is owed it.
    alone = acts(plan(snap([full, a1], teams), 1000.0), "place")
    assert len(alone["a1"].gpus_after) == 16


def test_a_job_whose_team_reaches_its_quota_in_the_pass_waits_behind_work_within_its_quota():
    # a1, a2 and b1 all stand within their quotas when the pass sorts them (by wait). Once a1
    # starts, team a is at its quota of 8 and a2 is a borrower: it goes behind b1, which starts.
    teams = [Team("a", quota_gpus=8), Team("b", quota_gpus=8)]
    full = job("full", tp=8, dp=2, gpus=gpus_on(*ALL[:2]), team=None)
    waiting = [job("a1", tp=8, team="a", submit_s=0.0), job("a2", tp=8, team="a", submit_s=10.0),
               job("b1", tp=8, team="b", submit_s=20.0)]
    result = plan(snap([full, *waiting], teams), 1000.0)
    assert set(acts(result, "place")) == {"a1", "b1"}
    assert "team a uses 8 of its 8 guaranteed GPUs" in acts(result, "hold")["a2"].reason.text


def test_a_team_never_holds_more_than_its_quota_and_borrowing_limit():
    teams = [Team("vision", quota_gpus=8, borrow_limit_gpus=8)]
    running = job("v1", tp=8, dp=2, gpus=gpus_on("r0s0n0", "r0s0n1"), team="vision")
    wants = job("v2", tp=8, dp=1, team="vision")
    result = plan(snap([running, wants], teams), 1000.0)
    hold = acts(result, "hold")["v2"]
    assert hold.reason.inputs["cause"] == "team_limit"
    assert hold.reason.text.startswith("Team vision uses 16 of its 8 guaranteed GPUs and may borrow up to 8 more; "
                                       "it has reached that limit")
    # An elastic job grows only up to the limit too.
    grower = job("v-el", tp=8, dp=1, dp_min=1, dp_max=4, global_batch=64 * 4, gpus=gpus_on("r0s0n0"), team="vision",
                 total_steps=10**6)
    grown = acts(plan(snap([grower], teams), 10**5), "grow").get("v-el")
    assert grown is not None and len(grown.gpus_after) == 16


def test_a_parents_limit_binds_its_children():
    teams = [Team("org", quota_gpus=16, borrow_limit_gpus=0), Team("a", parent="org", quota_gpus=16),
             Team("b", parent="org", quota_gpus=16)]
    result = plan(snap([job("a1", tp=8, dp=2, gpus=gpus_on("r0s0n0", "r0s0n1"), team="a"),
                        job("b1", tp=8, team="b")], teams), 1000.0)
    assert acts(result, "hold")["b1"].reason.inputs["cause"] == "team_limit"
    assert acts(result, "hold")["b1"].reason.text.startswith(
        "Team org uses 16 of its 16 guaranteed GPUs and may not borrow beyond them; it has reached that limit")


def test_a_team_below_its_quota_reclaims_what_another_borrowed_checkpoint_first():
    teams = [Team("vision", quota_gpus=8), Team("speech", quota_gpus=24)]
    # vision borrows 24 beyond its 8 (elastic, 4 replicas of 8); speech wants 16 of its 24.
    borrower = job("v-big", tp=8, dp=4, dp_min=1, dp_max=4, global_batch=64 * 4, gpus=gpus_on(*ALL),
                   team="vision", run_started_s=0.0, min_run_s=0.0)
    owed = job("s-new", tp=8, dp=2, team="speech", submit_s=500.0)
    result = plan(snap([borrower, owed], teams), 10_000.0)
    shrink = acts(result, "shrink")["v-big"]
    assert len(shrink.gpus_after) == 16 and shrink.graceful and shrink.deadline_s is not None
    assert shrink.reason.rule == "quota.reclaim"
    assert shrink.reason.text.startswith("s-new needs GPUs: team speech is below its quota (0 of 24 guaranteed GPUs) "
                                         "and reclaims the GPUs other teams borrowed: team vision holds 32 GPUs, "
                                         "24 GPUs beyond its quota of 8")
    assert shrink.reason.inputs["lead_time_s"] == pytest.approx(shrink.deadline_s - 10_000.0)
    assert acts(result, "hold")["s-new"].reason.inputs["cause"] == "waiting_for_release"


def test_reclaim_takes_no_more_than_a_team_holds_beyond_its_quota():
    teams = [Team("vision", quota_gpus=24), Team("speech", quota_gpus=16)]
    # vision is 8 over; speech wants 16: only 8 can be reclaimed, so it waits, taking nothing.
    borrower = job("v-big", tp=8, dp=4, gpus=gpus_on(*ALL), team="vision", run_started_s=0.0, min_run_s=0.0)
    result = plan(snap([borrower, job("s-new", tp=8, dp=2, team="speech", submit_s=9_000.0)], teams), 10_000.0)
    assert not acts(result, "preempt") and not acts(result, "shrink")
    assert acts(result, "hold")["s-new"].reason.inputs["cause"] == "capacity"


def test_the_minimum_run_still_protects_a_recent_start_and_critical_work_is_never_reclaimed():
    teams = [Team("vision", quota_gpus=0), Team("speech", quota_gpus=16)]
    recent = job("v-recent", tp=8, dp=2, gpus=gpus_on("r0s0n0", "r0s0n1"), team="vision",
                 run_started_s=9_000.0, min_run_s=7200.0)
    crit = job("v-crit", "critical", tp=8, dp=2, gpus=gpus_on("r0s0n2", "r0s0n3"), team="vision")
    result = plan(snap([recent, crit, job("s-new", tp=8, dp=2, team="speech")], teams), 10_000.0)
    assert not acts(result, "preempt") and not acts(result, "shrink")


def test_the_borrower_with_most_past_usage_per_weight_gives_back_first():
    teams = [Team("a", quota_gpus=0, usage_gpu_s=9000.0), Team("b", quota_gpus=0, usage_gpu_s=1000.0),
             Team("owed", quota_gpus=16)]
    a = job("a1", tp=8, dp=2, gpus=gpus_on("r0s0n0", "r0s0n1"), team="a", run_started_s=0.0, min_run_s=0.0)
    b = job("b1", tp=8, dp=2, gpus=gpus_on("r0s0n2", "r0s0n3"), team="b", run_started_s=0.0, min_run_s=0.0)
    result = plan(snap([a, b, job("o1", tp=8, dp=2, team="owed")], teams), 10_000.0)
    assert set(acts(result, "preempt")) == {"a1"}
    assert acts(result, "preempt")["a1"].reason.text.endswith("and saves a checkpoint first.")


def test_a_job_of_no_team_only_borrows():
    teams = [Team("speech", quota_gpus=16)]
    loose = job("loose", tp=8, dp=2, gpus=gpus_on("r0s0n0", "r0s0n1"), run_started_s=0.0, min_run_s=0.0)
    rest = job("s-run", tp=8, dp=2, gpus=gpus_on("r0s0n2", "r0s0n3"), team="speech")
    result = plan(snap([loose, rest, job("s-new", tp=8, dp=2, team="speech", submit_s=9_000.0)], teams), 10_000.0)
    # speech already holds its 16: it is not below quota, so nothing is reclaimed for it.
    assert not acts(result, "preempt")
    result = plan(snap([loose, job("s-new", tp=8, dp=2, team="speech", submit_s=9_000.0),
                        job("fill", tp=8, dp=2, gpus=gpus_on("r0s0n2", "r0s0n3"))], teams), 10_000.0)
    assert set(acts(result, "preempt")) <= {"loose", "fill"} and acts(result, "preempt")
    assert "this job belongs to no team, so it has no quota and only borrows" in \
        next(iter(acts(result, "preempt").values())).reason.text


def test_a_team_reservation_guarantees_its_earliest_runnable_critical_job_and_outlives_it():
    teams = [Team("vision", quota_gpus=0)]
    res = Reservation("vision-window", job="", team="vision", gpus=16, nodes=("r0s0n0", "r0s0n1"))
    first = job("v-crit-1", "critical", tp=8, dp=2, team="vision", submit_s=10.0)
    second = job("v-crit-2", "critical", tp=8, dp=2, team="vision", submit_s=20.0)
    result = plan(snap([first, second], teams, [res]), 1000.0)
    placed = acts(result, "place")
    assert placed["v-crit-1"].reason.rule == "entitlement"
    # The first completed: the reservation now guarantees the second.
    done = job("v-crit-1", "critical", tp=8, dp=2, team="vision", submit_s=10.0, phase="completed")
    result = plan(snap([done, second], teams, [res]), 2000.0)
    assert acts(result, "place")["v-crit-2"].reason.rule == "entitlement"
    # With no critical job of the team, the pool is lent like any other.
    borrower = job("other", tp=8, dp=2)
    result = plan(snap([done, borrower], teams, [res]), 3000.0)
    assert "other" in {a.job for a in result.actions if a.kind in ("place", "lend")}


def test_the_ledger_follows_the_pass_and_the_words_read_right():
    book = TeamBook([Team("vision", quota_gpus=96, borrow_limit_gpus=32)], [])
    book.add("vision", 96)
    assert book.standing_words("vision") == "team vision uses 96 of its 96 guaranteed GPUs and may borrow up to 32 more"
    assert book.below_quota_by("vision") == 0 and book.may_use("vision") == 32
    book.add("vision", 40)
    assert book.may_use("vision") == 0 and book.above_quota_by("vision") == 40
    assert PlannerConfig().fair_share_half_life_s == 604800.0


def test_what_may_be_reclaimed_follows_every_change_of_the_ledger():
    """``reclaimable`` is remembered per pair of teams between changes; a change of any team's
    holding (the borrower's own, or its organisation's through a sibling) must be read."""
    teams = [Team("org", quota_gpus=16), Team("a", parent="org", quota_gpus=8), Team("b", parent="org", quota_gpus=8),
             Team("outside", quota_gpus=16)]
    book = TeamBook(teams, [])
    borrower = job("a-big", tp=8, team="a")
    book.add("a", 8)
    assert book.reclaimable(borrower, "outside") == 0  # a within its quota
    book.add("a", 16)
    assert book.reclaimable(borrower, "outside") == 8  # org 24 of 16, a 24 of 8: the least
    assert book.reclaimable(borrower, "b") == 16  # a sibling: only a's own excess
    book.add("b", -8)  # a sibling's change moves the organisation's excess
    assert book.reclaimable(borrower, "outside") == 0 and book.reclaimable(borrower, "b") == 16


def test_a_sibling_below_its_quota_reclaims_from_a_sibling_borrowing_inside_the_organisation():
    teams = [Team("org", quota_gpus=16), Team("a", parent="org", quota_gpus=8), Team("b", parent="org", quota_gpus=8),
             Team("outside", quota_gpus=16)]
    a = job("a-big", tp=8, dp=2, dp_min=1, gpus=gpus_on("r0s0n0", "r0s0n1"), team="a", run_started_s=0.0,
            min_run_s=0.0)
    full = job("out", tp=8, dp=2, gpus=gpus_on("r0s0n2", "r0s0n3"), team="outside")
    result = plan(snap([a, full, job("b1", tp=8, team="b", submit_s=9_000.0)], teams), 10_000.0)
    shrink = acts(result, "shrink")["a-big"]  # its 8 beyond its own quota, not the 8 it is owed
    assert shrink.reason.rule == "quota.reclaim" and len(shrink.gpus_after) == 8
    # ... but an outside team below its quota may not: the organisation is within its own quota.
    teams.append(Team("third", quota_gpus=8))
    third = job("t-run", tp=8, dp=1, gpus=gpus_on("r0s0n2"), team="third")
    result = plan(snap([a, third, job("o1", tp=8, dp=1, gpus=gpus_on("r0s0n3"), team="outside"),
                        job("o2", tp=8, dp=1, team="outside", submit_s=9_000.0)], teams), 10_000.0)
    assert not acts(result, "preempt") and not acts(result, "shrink")
    assert acts(result, "hold")["o2"].reason.inputs["cause"] == "capacity"


def test_a_borrower_protected_by_its_minimum_run_is_looked_at_again_when_it_ends():
    teams = [Team("vision", quota_gpus=0), Team("speech", quota_gpus=16)]
    recent = job("v-recent", tp=8, dp=4, gpus=gpus_on(*ALL), team="vision", run_started_s=9_000.0, min_run_s=7200.0)
    result = plan(snap([recent, job("s-new", tp=8, dp=2, team="speech", submit_s=9_500.0)], teams), 10_000.0)
    assert not acts(result, "preempt") and result.wake_at_s == 16_200.0


def test_a_borrower_about_to_finish_is_waited_for_instead_of_reclaimed_but_only_within_the_grace():
    teams = [Team("vision", quota_gpus=0), Team("speech", quota_gpus=16)]
    ending = job("v-ending", tp=8, dp=2, gpus=gpus_on("r0s0n0", "r0s0n1"), team="vision", run_started_s=0.0,
                 min_run_s=0.0, committed_steps=9_990, total_steps=10_000, step_times=(1.0,) * 10)
    going = job("v-going", tp=8, dp=2, gpus=gpus_on("r0s0n2", "r0s0n3"), team="vision", run_started_s=0.0,
                min_run_s=0.0)
    fresh = job("s-new", tp=8, dp=2, team="speech", submit_s=9_990.0, queued_since_s=9_990.0)
    result = plan(snap([ending, going, fresh], teams), 10_000.0)
    assert not acts(result, "preempt")  # 10 steps of 1 s left: it frees its GPUs sooner than a save would
    hold = acts(result, "hold")["s-new"]
    assert hold.reason.inputs["cause"] == "waiting_for_completion" and hold.reason.inputs["finishing"] == ["v-ending"]
    assert "16 GPUs come free within 1 min when v-ending finishes" in hold.reason.text
    # Waited past the grace (the prediction failed): reclaim as usual.
    late = job("s-new", tp=8, dp=2, team="speech", submit_s=9_900.0, queued_since_s=9_900.0)
    assert acts(plan(snap([ending, going, late], teams), 10_000.0), "preempt")


def test_a_long_waiter_does_not_take_from_a_team_within_its_quota():
    teams = [Team("vision", quota_gpus=0), Team("speech", quota_gpus=32)]
    # vision's job has waited past ageing_s; speech's regular jobs run within speech's quota.
    held = [job(f"s{i}", tp=8, dp=1, gpus=gpus_on(ALL[i]), team="speech", run_started_s=0.0, min_run_s=0.0)
            for i in range(4)]
    aged = job("v-aged", tp=8, dp=1, team="vision", submit_s=0.0, queued_since_s=0.0)
    result = plan(snap([*held, aged], teams), 20_000.0)
    assert not acts(result, "preempt") and not acts(result, "shrink")
    # Without teams the same long waiter takes GPUs from a regular job that had its minimum run.
    result = plan(Snapshot(NODES, tuple(held) + (aged,)), 20_000.0)
    assert acts(result, "preempt")


def test_a_team_below_its_quota_reclaims_for_a_smaller_size_when_the_excess_is_smaller():
    teams = [Team("vision", quota_gpus=24), Team("speech", quota_gpus=16)]
    # vision is 8 over; speech's elastic job prefers 16 but starts at 8: it reclaims those 8.
    borrower = job("v-big", tp=8, dp=4, dp_min=3, global_batch=64 * 12, gpus=gpus_on(*ALL), team="vision",
                   run_started_s=0.0, min_run_s=0.0)
    owed = job("s-new", tp=8, dp=2, dp_min=1, team="speech", submit_s=9_000.0)
    result = plan(snap([borrower, owed], teams), 10_000.0)
    shrink = acts(result, "shrink")["v-big"]
    assert shrink.reason.rule == "quota.reclaim" and len(shrink.gpus_after) == 24


def test_a_borrower_does_not_age_ahead_of_work_within_its_quota():
    teams = [Team("vision", quota_gpus=0), Team("speech", quota_gpus=8)]
    # vision borrows three nodes; its best-effort job has waited two ageing periods (it would
    # stand as a regular job), speech's best-effort job within its quota has just arrived.
    held = [job(f"v{i}", tp=8, dp=1, gpus=gpus_on(ALL[i]), team="vision", priority="best_effort",
                run_started_s=0.0, min_run_s=0.0) for i in range(3)]
    aged = job("v-aged", tp=8, dp=1, team="vision", priority="best_effort", submit_s=0.0, queued_since_s=0.0)
    owed = job("s-new", tp=8, dp=1, team="speech", priority="best_effort", submit_s=19_000.0)
    result = plan(snap([*held, aged, owed], teams), 20_000.0)
    assert set(acts(result, "place")) == {"s-new"}  # else the GPUs it is owed go back to vision
    # Without teams the same long waiter is ahead by its ageing.
    result = plan(Snapshot(NODES, (*held, aged, owed)), 20_000.0)
    assert set(acts(result, "place")) == {"v-aged"}


def test_a_long_waiting_borrower_does_not_stop_another_borrower():
    teams = [Team("vision", quota_gpus=0), Team("audio", quota_gpus=0), Team("speech", quota_gpus=32)]
    held = [job(f"a{i}", tp=8, dp=1, gpus=gpus_on(ALL[i]), team="audio", run_started_s=0.0, min_run_s=0.0)
            for i in range(4)]
    aged = job("v-aged", tp=8, dp=1, team="vision", submit_s=0.0, queued_since_s=0.0)
    result = plan(snap([*held, aged], teams), 20_000.0)
    assert not acts(result, "preempt") and not acts(result, "shrink")
    assert acts(result, "hold")["v-aged"].reason.inputs["effective_rank"] == 1  # its class, not aged


def test_a_reclaim_stops_borrowers_when_their_shrinks_fall_short():
    teams = [Team("vision", quota_gpus=0), Team("speech", quota_gpus=32)]
    # Each borrower can shrink to one replica (8 GPUs back each, 16 in all); speech needs 32.
    borrowers = [job(f"v{i}", tp=8, dp=2, dp_min=1, dp_max=2, global_batch=64 * 2,
                     gpus=gpus_on(ALL[2 * i], ALL[2 * i + 1]), team="vision", run_started_s=0.0, min_run_s=0.0)
                 for i in range(2)]
    owed = job("s-big", tp=8, dp=4, dp_min=4, dp_max=4, global_batch=64 * 4, team="speech", submit_s=9_000.0)
    result = plan(snap([*borrowers, owed], teams), 10_000.0)
    stopped = acts(result, "preempt")
    assert set(stopped) == {"v0", "v1"} and all(a.reason.rule == "quota.reclaim" for a in stopped.values())
    assert acts(result, "hold")["s-big"].reason.inputs["cause"] == "waiting_for_release"


def test_gpus_another_teams_reservation_lends_count_against_no_quota():
    teams = [Team("vision", quota_gpus=16), Team("speech", quota_gpus=8), Team("audio", quota_gpus=16)]
    # speech's reservation (n2, n3) opens in a day, with no critical job yet: it lends its 16 GPUs
    # to vision.
    res = Reservation("speech-window", job="", team="speech", gpus=16, start_s=100_000.0,
                      nodes=("r0s0n2", "r0s0n3"))
    jobs = [
        job("v-own", tp=8, dp=1, gpus=gpus_on("r0s0n0"), team="vision", min_run_s=0.0),
        job("v-lent", tp=8, dp=2, dp_min=1, gpus=gpus_on("r0s0n2", "r0s0n3"), borrowed_from="speech-window",
            team="vision", min_run_s=0.0),
        job("a-own", tp=8, dp=1, gpus=gpus_on("r0s0n1"), team="audio", min_run_s=0.0),
        job("a-new", tp=8, dp=1, team="audio", submit_s=9_000.0),
    ]
    result = plan(snap(jobs, teams, [res]), 10_000.0)
    # vision holds 24 GPUs but only its own 8 against its quota of 16: it is not borrowing, so
    # audio, below its quota, takes nothing from it (counted, the 16 lent GPUs would make 8 of
    # v-own's reclaimable: speech's GPUs go back to speech's pool, not to audio).
    assert not [a for a in result.actions if a.reason.rule == "quota.reclaim"]
    hold = acts(result, "hold")["a-new"]
    assert "team audio uses 8 of its 16 guaranteed GPUs" in hold.reason.text
    # The same GPUs held by speech's own critical job do count against speech's quota.
    own = [job("s-crit", "critical", tp=8, dp=2, gpus=gpus_on("r0s0n2", "r0s0n3"), team="speech")]
    book = TeamBook(teams, own, lambda j, gpus: quota.charged_gpus(j.team, gpus, {"r0s0n2": "speech-window",
                                                                                  "r0s0n3": "speech-window"},
                                                                   quota.pool_teams([res], own)))
    assert book.held["speech"] == 16
    book.add("vision", book.charge(jobs[1], jobs[1].gpus))
    assert book.held["vision"] == 0


def test_a_reclaim_counts_what_it_takes_from_a_team_as_its_quota_counts_it():
    teams = [Team("vision", quota_gpus=8), Team("speech", quota_gpus=8), Team("audio", quota_gpus=16)]
    res = Reservation("speech-window", job="", team="speech", gpus=8, start_s=100_000.0, nodes=("r0s0n2",))
    jobs = [
        # 16 GPUs, 8 of them lent by speech's pool: preempting it takes 8 of vision's quota, not 16.
        job("v-mix", tp=8, dp=2, gpus=gpus_on("r0s0n0", "r0s0n2"), borrowed_from="speech-window",
            team="vision", min_run_s=0.0),
        job("v-recent", tp=8, dp=1, gpus=gpus_on("r0s0n1"), team="vision", run_started_s=9_900.0,
            min_run_s=3600.0),
        job("a-own", tp=8, dp=1, gpus=gpus_on("r0s0n3"), team="audio", min_run_s=0.0),
        job("a-new", tp=8, dp=1, team="audio", submit_s=9_000.0),
    ]
    result = plan(snap(jobs, teams, [res]), 10_000.0)
    # vision is 8 beyond its quota (n0 and n1 count, n2 does not); v-recent is protected.
    preempt = acts(result, "preempt")["v-mix"]
    assert preempt.reason.rule == "quota.reclaim" and preempt.graceful
    assert "team vision holds 16 GPUs, 8 GPUs beyond its quota of 8" in preempt.reason.text

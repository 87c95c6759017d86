"""Rule 4: choose victims that lose the least."""

from __future__ import annotations

from jobs.planner import PlannerConfig, Reservation, plan
from jobs.planner.snapshot import Snapshot
from jobs.planner.victims import choose_victims, loss_gpu_s, victim_options, victim_sort_key
from tests.planner.factory import cluster, gpus_on, job, snapshot

NODES = cluster(switches=1, per_switch=4)


def _preempted(result) -> list[str]:
    return sorted(a.job for a in result.actions if a.kind in ("preempt", "shrink", "reclaim"))


def test_best_effort_is_chosen_before_regular() -> None:
    snap = snapshot(NODES, [
        job("reg", gpus=gpus_on("r0s0n0", "r0s0n1"), dp=2, run_started_s=0.0, min_run_s=0.0),
        job("be", "best_effort", gpus=gpus_on("r0s0n2", "r0s0n3"), dp=2),
        job("crit", "critical", dp=2),
    ])
    assert _preempted(plan(snap, 10_000.0)) == ["be"]


def test_fewest_gpu_seconds_lost_goes_first() -> None:
    cheap = job("be-cheap", "best_effort", gpus=gpus_on("r0s0n0", "r0s0n1"), dp=2,
                committed_steps=105, last_checkpoint_step=100)
    dear = job("be-dear", "best_effort", gpus=gpus_on("r0s0n2", "r0s0n3"), dp=2,
               committed_steps=190, last_checkpoint_step=100)
    config = PlannerConfig()
    assert loss_gpu_s(cheap, config) < loss_gpu_s(dear, config)
    snap = snapshot(NODES, [dear, cheap, job("crit", "critical", dp=2)])
    assert _preempted(plan(snap, 500.0)) == ["be-cheap"]


def test_min_run_s_protects_a_recently_started_regular_job() -> None:
    snap = snapshot(NODES, [
        job("reg", gpus=gpus_on(*[f"r0s0n{i}" for i in range(4)]), dp=4, run_started_s=1000.0, min_run_s=7200.0),
        job("crit", "critical", dp=2),
    ])
    result = plan(snap, 2000.0)
    assert _preempted(result) == []
    assert result.by_kind("hold")[0].job == "crit"


def test_a_reservation_may_take_gpus_inside_min_run_s() -> None:
    pool = ("r0s0n2", "r0s0n3")
    borrower = job("reg", gpus=gpus_on(*pool), dp=2, run_started_s=1000.0, min_run_s=7200.0,
                   borrowed_from="r")
    snap = snapshot(NODES, [borrower, job("crit", "critical", dp=2)],
                    (Reservation("r", "crit", gpus=16, start_s=2000.0, nodes=pool),))
    result = plan(snap, 2000.0)
    (reclaim,) = result.by_kind("reclaim")
    assert reclaim.job == "reg" and reclaim.forced


def test_an_elastic_job_is_shrunk_rather_than_stopped() -> None:
    elastic = job("be", "best_effort", gpus=gpus_on(*[f"r0s0n{i}" for i in range(4)]), dp=4, dp_min=1,
                  global_batch=64)
    options = victim_options(elastic, PlannerConfig())
    assert [len(o.kept) for o in options] == [16, 8, 0]  # dp 3 is not batch-exact for 64
    snap = snapshot(NODES, [elastic, job("reg", dp=1)])
    result = plan(snap, 100.0)
    (shrink,) = result.by_kind("shrink")
    assert shrink.job == "be" and shrink.dp_after == 2
    assert not result.by_kind("preempt")


def test_a_critical_job_is_never_a_victim_of_a_lower_class() -> None:
    snap = snapshot(NODES, [
        job("crit", "critical", gpus=gpus_on(*[f"r0s0n{i}" for i in range(4)]), dp=4),
        job("reg", dp=1),
    ])
    assert _preempted(plan(snap, 100_000.0)) == []


def test_choose_victims_returns_none_when_nothing_suffices() -> None:
    be = job("be", "best_effort", gpus=gpus_on("r0s0n0"), dp=1)
    config = PlannerConfig()
    assert choose_victims([be], lambda freed: len(freed) >= 16, config) is None
    picked = choose_victims([be], lambda freed: len(freed) >= 8, config)
    assert picked is not None and picked[0].job.name == "be"
    assert victim_sort_key(be, config)[0] == -2


def test_a_victim_the_rest_of_the_choice_frees_enough_without_is_not_stopped() -> None:
    # The cheapest victim alone is too small, so the search goes on to a larger one that
    # alone frees enough: stopping the first as well would be a save and a restart for nothing.
    small = job("be-small", "best_effort", gpus=gpus_on("r0s0n0"), dp=1)
    big = job("be-big", "best_effort", gpus=gpus_on("r0s0n1", "r0s0n2"), dp=2)
    config = PlannerConfig()
    assert victim_sort_key(small, config) < victim_sort_key(big, config)
    picked = choose_victims([small, big], lambda freed: len(freed) >= 16, config)
    assert picked is not None and [o.job.name for o in picked] == ["be-big"]
    snap = snapshot(NODES, [small, big, job("crit-held", "critical", gpus=gpus_on("r0s0n3"), dp=1),
                            job("crit", "critical", dp=2)])
    assert _preempted(plan(snap, 100.0)) == ["be-big"]


def test_victims_that_are_each_needed_are_all_kept() -> None:
    a = job("be-a", "best_effort", gpus=gpus_on("r0s0n0"), dp=1)
    b = job("be-b", "best_effort", gpus=gpus_on("r0s0n1"), dp=1)
    picked = choose_victims([a, b], lambda freed: len(freed) >= 16, PlannerConfig())
    assert picked is not None and [o.job.name for o in picked] == ["be-a", "be-b"]


def test_an_earlier_victim_is_dropped_when_the_later_ones_free_enough_together() -> None:
    # Neither the last victim alone nor the first two suffice; the last two together do.
    a = job("be-a", "best_effort", gpus=gpus_on("r0s0n0"), dp=1)
    b = job("be-b", "best_effort", gpus=gpus_on("r0s0n1"), dp=1)
    c = job("be-c", "best_effort", gpus=gpus_on("r0s0n2", "r0s0n3"), dp=2)
    picked = choose_victims([a, b, c], lambda freed: len(freed) >= 24, PlannerConfig())
    assert picked is not None and [o.job.name for o in picked] == ["be-b", "be-c"]


def _grown_and_waiter(waiter_dp: int) -> Snapshot:
    """A regular job grown from its preferred dp 2 to 4 on the whole cluster (one node per
    replica), past its min_run_s, and a regular newcomer of ``waiter_dp`` rigid replicas."""
    grown = job("grown", gpus=gpus_on(*[f"r0s0n{i}" for i in range(4)]), dp=2, dp_min=1, dp_max=4,
                global_batch=64, run_started_s=0.0, min_run_s=0.0)
    return snapshot(NODES, [grown, job("newcomer", dp=waiter_dp, global_batch=64 * waiter_dp)])


def test_a_grown_job_of_the_same_class_gives_back_its_growth() -> None:
    # Its two grown replicas are what the newcomer needs: it shrinks back to its preferred size.
    result = plan(_grown_and_waiter(2), 100.0, PlannerConfig(ageing_s=1e9))
    (shrink,) = result.by_kind("shrink")
    assert shrink.job == "grown" and shrink.dp_after == 2
    assert not result.by_kind("preempt")


def test_a_grown_job_whose_growth_falls_short_is_stopped() -> None:
    # Its growth (16 GPUs) is less than the newcomer's 24, and its shrinks stop at its preferred
    # size: its preemption, offered after them, is the option that completes the need (the
    # behaviour docs/planner.md's rule 4 and docs/simulator.md's "Where omni's rest goes" state).
    result = plan(_grown_and_waiter(3), 100.0, PlannerConfig(ageing_s=1e9))
    (preempt,) = result.by_kind("preempt")
    assert preempt.job == "grown"
    assert not result.by_kind("shrink")

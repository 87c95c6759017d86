"""Hold actions: every waiting job is told why it waits."""

from __future__ import annotations

from jobs.planner import Reservation, plan
from tests.planner.factory import cluster, gpus_on, job, snapshot


def test_a_pending_job_gets_a_hold_saying_why() -> None:
    nodes = cluster(switches=1, per_switch=1)
    snap = snapshot(nodes, [job("a", dp=1, gpus=gpus_on("r0s0n0")), job("b", "best_effort", dp=1)])
    (hold,) = plan(snap, 10.0).by_kind("hold")
    assert hold.job == "b"
    assert hold.reason.inputs["cause"] == "capacity"
    assert hold.reason.text == ("Needs 8 GPUs on one node; none of the GPUs it may use is free, the others are "
                                "held by 1 regular job; best-effort jobs never take GPUs from others.")
    assert hold.reason.inputs["gpus_needed"] == 8 and hold.reason.inputs["gpus_free"] == 0


def test_a_hold_says_in_plain_words_what_the_job_needs_and_who_holds_the_rest() -> None:
    nodes = cluster(switches=1, per_switch=3)
    crit = [job(f"crit-{i}", "critical", gpus=gpus_on(f"r0s0n{i}")) for i in range(2)]
    partial = job("half", "critical", tp=2, dp=1, gpus=gpus_on("r0s0n2", per_node=2))
    waiting = job("sft", tp=8, dp=2, dp_min=1, global_batch=64)
    (hold,) = plan(snapshot(nodes, [*crit, partial, waiting]), 10.0).by_kind("hold")
    text = hold.reason.text
    assert text == ("Needs 16 GPUs (2 replicas of 8, each on one node), or at least 8 to start; only 6 of the "
                    "GPUs it may use are free, the others are held by 3 critical jobs; no lower-priority job can "
                    "give enough back now (a job keeps its GPUs for its minimum run time after it starts).")
    assert hold.reason.inputs == {"cause": "capacity", "gpus_needed": 16, "gpus_min": 8, "gpus_free": 6,
                                  "waited_s": 10.0, "effective_rank": 1}


def test_free_gpus_spread_over_nodes_are_called_too_scattered() -> None:
    nodes = cluster(switches=1, per_switch=3)
    running = [job("crit", "critical", gpus=gpus_on("r0s0n0")),
               job("a", "critical", tp=4, gpus=gpus_on("r0s0n1", per_node=4)),
               job("b", "critical", tp=4, gpus=gpus_on("r0s0n2", per_node=4))]
    (hold,) = plan(snapshot(nodes, [*running, job("sft", tp=8)]), 10.0).by_kind("hold")
    assert ("8 GPUs it may use are free, but too scattered: each group of 8 must be on one node, the others "
            "are held by 3 critical jobs") in hold.reason.text


def test_no_hold_sentence_uses_the_planners_own_terms() -> None:
    nodes = cluster(switches=1, per_switch=2)
    jobs = [job("crit", "critical", gpus=gpus_on("r0s0n0")), job("reg", "regular", gpus=gpus_on("r0s0n1")),
            job("be", "best_effort", tp=2, dp=2), job("r2", tp=4, dp=4, dp_min=2), job("wide", tp=16)]
    holds = plan(snapshot(nodes, jobs), 10.0).by_kind("hold")
    assert len(holds) == 3
    for hold in holds:
        for term in ("TP group", "Pending:", "min_run_s", "dp ", "t="):
            assert term not in hold.reason.text, (term, hold.reason.text)


def test_a_job_the_cluster_shrank_under_is_held_as_unable_to_fit() -> None:
    nodes = cluster(switches=1, per_switch=2)  # 2 nodes of 8
    too_wide = job("wide", tp=16, dp=1)
    too_many = job("many", tp=8, dp=3, dp_min=3)
    fits = job("fits", tp=8, dp=1)
    result = plan(snapshot(nodes, [too_wide, too_many, fits]), 10.0)
    holds = {a.job: a.reason for a in result.by_kind("hold")}
    assert holds["wide"].inputs == {"cause": "cannot_fit", "field": "tp", "gpus_min": 16}
    assert holds["wide"].text == ("Cannot fit this cluster: 16 GPUs per tensor-parallel group but the largest node "
                                  "has 8. It waits until the cluster grows or its spec changes.")
    assert holds["many"].inputs["field"] == "dp_min"
    assert "at least 3 replicas of 8 GPUs (24 GPUs) but the whole cluster has room for 2 (16 GPUs on 2 nodes)" in (
        holds["many"].text)
    assert [a.job for a in result.by_kind("place")] == ["fits"]


def test_a_job_that_cannot_fit_does_not_stop_others_growing() -> None:
    nodes = cluster(switches=1, per_switch=2)
    grower = job("grower", tp=8, dp=1, dp_max=2, global_batch=64, gpus=gpus_on("r0s0n0"), run_started_s=0.0,
                 total_steps=1_000_000, step_s=10.0)
    result = plan(snapshot(nodes, [grower, job("wide", "critical", tp=16)]), 7200.0)
    assert result.by_kind("hold")[0].reason.inputs["cause"] == "cannot_fit"
    assert [a.job for a in result.by_kind("grow")] == ["grower"]


def test_a_recurring_owner_holds_between_its_windows() -> None:
    res = Reservation("hourly", "crit", gpus=8, period_s=3600.0, active_s=2400.0, nodes=("r0s0n0",))
    snap = snapshot(cluster(switches=1, per_switch=2), [job("crit", "critical", dp=1)], (res,))
    (hold,) = plan(snap, 3000.0).by_kind("hold")
    assert hold.reason.inputs["cause"] == "between_windows"
    assert hold.reason.text == "Runs only inside the windows of its reservation 'hourly'; the next one opens at t=3600s."
    assert hold.reason.inputs["next_start_s"] == 3600.0
    assert plan(snap, 3600.0).by_kind("place")[0].reason.rule == "entitlement"


def test_a_paused_planner_only_holds() -> None:
    snap = snapshot(cluster(), [job("a", dp=1)], paused=True)
    result = plan(snap, 0.0)
    assert result.paused
    assert [a.kind for a in result.actions] == ["hold"]
    assert result.actions[0].reason.inputs["cause"] == "planner_paused"

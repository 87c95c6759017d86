"""Rule 7: fault recovery, shrink-on-survivors, stragglers and drains."""

from __future__ import annotations

from dataclasses import replace

from jobs.planner import Reservation, plan
from tests.planner.factory import cluster, gpus_on, job, snapshot


def test_an_elastic_job_continues_on_its_survivors() -> None:
    nodes = cluster(switches=1, per_switch=4, r0s0n3="failed")
    j = job("sft", dp=4, dp_min=2, global_batch=64, gpus=gpus_on("r0s0n0", "r0s0n1", "r0s0n2", "r0s0n3"),
            phase="recovering")
    result = plan(snapshot(nodes, [j]), 100.0)
    (shrink,) = result.by_kind("shrink")
    assert shrink.reason.rule == "faults"
    assert shrink.dp_after == 2  # 3 survivors, but 64 % 3 != 0
    assert "r0s0n3" not in {g.node for g in shrink.gpus_after}


def test_critical_recovers_first_onto_its_spares() -> None:
    pool = ("r0s1n0", "r0s1n1", "r0s1n2", "r0s1n3", "r0s0n3")
    nodes = cluster(r0s1n1="failed")
    crit = job("crit", "critical", dp=4, phase="recovering")
    reg = job("reg", dp=1, phase="recovering")
    res = Reservation("r", "crit", gpus=32, spares=8, nodes=pool)
    busy = job("busy", dp=3, gpus=gpus_on("r0s0n0", "r0s0n1", "r0s0n2"))
    result = plan(snapshot(nodes, [reg, crit, busy], (res,)), 100.0)
    starts = [a for a in result.actions if a.kind in ("recover", "place")]
    assert starts[0].job == "crit"
    assert {g.node for g in starts[0].gpus_after} == {"r0s1n0", "r0s1n2", "r0s1n3", "r0s0n3"}


def test_recovery_reclaims_lent_spares() -> None:
    pool = ("r0s1n0", "r0s1n1", "r0s1n2", "r0s1n3", "r0s0n3")
    nodes = cluster(r0s1n1="failed")
    crit = job("crit", "critical", dp=4, phase="recovering")
    borrower = job("be", "best_effort", dp=1, gpus=gpus_on("r0s0n3"), borrowed_from="r")
    busy = job("busy", dp=3, gpus=gpus_on("r0s0n0", "r0s0n1", "r0s0n2"))
    res = Reservation("r", "crit", gpus=32, spares=8, nodes=pool)
    result = plan(snapshot(nodes, [crit, borrower, busy], (res,)), 100.0)
    (reclaim,) = result.by_kind("reclaim")
    assert reclaim.job == "be" and reclaim.graceful
    assert result.by_kind("hold")[0].job == "crit"


def test_a_replica_on_a_slow_node_migrates_when_it_pays() -> None:
    nodes = tuple(replace(n, speed_factor=1.8) if n.name == "r0s0n0" else n for n in cluster())
    j = job("long", dp=2, gpus=gpus_on("r0s0n0", "r0s0n1"), total_steps=100_000, step_s=3.0)
    (migrate,) = plan(snapshot(nodes, [j]), 100.0).by_kind("migrate")
    assert "r0s0n0" not in {g.node for g in migrate.gpus_after}
    assert migrate.dp_after == migrate.dp_before == 2
    assert migrate.reason.inputs["gain_gpu_s"] > migrate.reason.inputs["move_cost_gpu_s"]


def test_no_migration_when_the_run_is_nearly_over() -> None:
    nodes = tuple(replace(n, speed_factor=1.8) if n.name == "r0s0n0" else n for n in cluster())
    j = job("short", dp=2, gpus=gpus_on("r0s0n0", "r0s0n1"), total_steps=100, committed_steps=95)
    assert not plan(snapshot(nodes, [j]), 100.0).by_kind("migrate")


def test_a_drained_node_is_evacuated_gracefully() -> None:
    nodes = cluster(r0s0n0="draining")
    j = job("sft", dp=2, gpus=gpus_on("r0s0n0", "r0s0n1"))
    (migrate,) = plan(snapshot(nodes, [j]), 100.0).by_kind("migrate")
    assert migrate.reason.rule == "drain" and migrate.forced and migrate.graceful
    assert "r0s0n0" not in {g.node for g in migrate.gpus_after}
    # Nothing new lands on a draining node.
    result = plan(snapshot(nodes, [job("new", dp=8)]), 100.0)
    assert not result.by_kind("place")

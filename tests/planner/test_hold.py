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
    assert "needs 8 GPUs" in hold.reason.text and "best-effort jobs never preempt" in hold.reason.text


def test_a_recurring_owner_holds_between_its_windows() -> None:
    res = Reservation("hourly", "crit", gpus=8, period_s=3600.0, active_s=2400.0, nodes=("r0s0n0",))
    snap = snapshot(cluster(switches=1, per_switch=2), [job("crit", "critical", dp=1)], (res,))
    (hold,) = plan(snap, 3000.0).by_kind("hold")
    assert hold.reason.inputs["cause"] == "between_windows"
    assert hold.reason.inputs["next_start_s"] == 3600.0
    assert plan(snap, 3600.0).by_kind("place")[0].reason.rule == "entitlement"


def test_a_paused_planner_only_holds() -> None:
    snap = snapshot(cluster(), [job("a", dp=1)], paused=True)
    result = plan(snap, 0.0)
    assert result.paused
    assert [a.kind for a in result.actions] == ["hold"]
    assert result.actions[0].reason.inputs["cause"] == "planner_paused"

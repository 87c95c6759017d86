"""The planner is a pure function: same snapshot, same plan; and its types serialize."""

from __future__ import annotations

import json
import random

from jobs.planner import Action, Reservation, plan, snapshot_from_dict, to_dict
from tests.planner.factory import cluster, gpus_on, job, snapshot


def _busy_snapshot(order_seed: int):
    jobs = [
        job("run-a", dp=2, gpus=gpus_on("r0s0n0", "r0s0n1"), step_times=(1.0, 1.1)),
        job("run-b", "best_effort", dp=1, gpus=gpus_on("r0s0n2"), borrowed_from=None),
        job("wait-c", dp=2, submit_s=5.0),
        job("wait-d", "best_effort", dp=1, submit_s=1.0),
        job("crit", "critical", dp=2, submit_s=3.0),
    ]
    random.Random(order_seed).shuffle(jobs)
    res = (Reservation("r", "crit", gpus=16, start_s=5000.0, nodes=("r0s1n2", "r0s1n3")),)
    nodes = list(cluster())
    random.Random(order_seed).shuffle(nodes)
    return snapshot(tuple(nodes), jobs, res)


def test_the_same_snapshot_in_any_order_gives_the_same_plan() -> None:
    plans = {json.dumps(plan(_busy_snapshot(seed), 100.0).to_dict(), sort_keys=True) for seed in range(5)}
    assert len(plans) == 1


def test_snapshot_round_trips_through_plain_dicts() -> None:
    snap = _busy_snapshot(0)
    data = json.loads(json.dumps(to_dict(snap)))
    assert snapshot_from_dict(data) == snap


def test_actions_become_json_audit_rows_and_back() -> None:
    result = plan(_busy_snapshot(1), 100.0)
    assert result.actions
    for action in result.actions:
        row = json.loads(json.dumps(action.to_audit(), allow_nan=False))
        assert {"kind", "job", "dp_before", "dp_after", "accum_before", "accum_after", "global_batch",
                "reason"} <= set(row)
        assert row["reason"]["rule"] and row["reason"]["text"]
        assert Action.from_dict(json.loads(json.dumps(action.to_dict(), allow_nan=False))) == action

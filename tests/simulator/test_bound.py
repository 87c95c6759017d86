"""The fluid bound on utilisation (``results.utilization_bound``) and the figures beside it,
checked by hand on tiny scenarios."""

from __future__ import annotations

import pytest

from jobs.simulator import parse_scenario, simulate
from jobs.simulator.results import class_figures, p95, utilization_bound, waterfill


def _job(name: str, tp: int, dp: int, steps: int, **extra: object) -> dict:
    job = {"name": name, "priority": "regular", "tp": tp, "dp": dp, "global_batch": 8 * dp,
           "micro_batch": 8, "total_steps": steps, "step_s": 1.0, "step_cv": 0.0, "comm_fraction": 0.0,
           "min_run_s": 0, "checkpoint": {"every_steps": 100000, "save_s": 0, "load_s": 0}}
    job.update(extra)
    return job


TWO_NODES = {"nodes": [{"name": "n0", "rack": "r0", "switch": "s0", "gpus": 4},
                       {"name": "n1", "rack": "r0", "switch": "s0", "gpus": 4}]}


def test_waterfill_shares_capacity_max_min_fairly() -> None:
    import numpy as np

    assert list(waterfill(np.array([4.0, 8.0]), 8)) == [4.0, 4.0]
    assert list(waterfill(np.array([2.0, 8.0, 8.0]), 10)) == [2.0, 4.0, 4.0]
    assert list(waterfill(np.array([2.0, 3.0]), 10)) == [2.0, 3.0]


def test_bound_by_hand_with_a_node_down() -> None:
    # x: 4 GPUs at most, 100 steps of 4 GPU-s = 400 GPU-s; y: 2 replicas of 4, 200 steps worth
    # 8 GPU-s each at dp_max = 1,600 GPU-s. Both arrive at 0 on 8 GPUs; n1 is down 50..150.
    #   0..50:  8 GPUs, 4 + 4     -> x 200 left, y 1,400 left (400 served)
    #  50..150: 4 GPUs, 2 + 2     -> x done at 150, y 1,200 left (400 served)
    # 150..300: 8 GPUs, y alone 8 -> y done at 300 (1,200 served)
    # 2,000 GPU-s served over 8 x 1000 - 4 x 100 = 7,600 healthy GPU-s.
    data = {"name": "bound", "horizon_s": 1000, "cluster": TWO_NODES,
            "jobs": [_job("x", 4, 1, 100), _job("y", 4, 2, 200)],
            "events": [{"kind": "node_down", "at_s": 50, "node": "n1"}, {"kind": "node_up", "at_s": 150, "node": "n1"}]}
    scenario = parse_scenario(data)
    bound = utilization_bound(scenario)
    assert bound["bound_useful_gpu_s"] == pytest.approx(2000)
    assert bound["utilization_bound"] == pytest.approx(2000 / 7600, abs=1e-6)
    result = simulate(scenario, "omni")
    assert result["healthy_gpu_s"] == pytest.approx(7600)
    assert result["utilization"] <= result["utilization_bound"]
    assert result["bound_share"] == pytest.approx(result["utilization"] / result["utilization_bound"], abs=1e-5)


def test_bound_counts_a_job_at_its_largest_size_and_stops_at_a_cancel() -> None:
    # One 8-GPU node; z may use 2 replicas of 4 and its steps are worth 4 x (0.5 x 2 + 0.5 x 1) = 6
    # GPU-s each at dp_max; it is cancelled at 100 s, by when the fluid has served 8 x 100 GPU-s.
    data = {"name": "bound2", "horizon_s": 1000,
            "cluster": {"racks": 1, "switches_per_rack": 1, "nodes_per_switch": 1, "gpus_per_node": 8},
            "jobs": [_job("z", 4, 1, 1000, dp_max=2, comm_fraction=0.5, global_batch=16)],
            "events": [{"kind": "cancel", "at_s": 100, "job": "z"}]}
    assert utilization_bound(parse_scenario(data))["bound_useful_gpu_s"] == pytest.approx(800)
    data["events"] = []
    assert utilization_bound(parse_scenario(data))["bound_useful_gpu_s"] == pytest.approx(6000)


def test_goodput_is_useful_over_allocated_gpu_seconds() -> None:
    # One 4-GPU job of 100 one-second steps with a 20 s save at step 50 (and none at the end):
    # it holds 4 GPUs for 120 s and computes for 100 s.
    data = {"name": "goodput", "horizon_s": 1000,
            "cluster": {"racks": 1, "switches_per_rack": 1, "nodes_per_switch": 1, "gpus_per_node": 8},
            "jobs": [_job("a", 4, 1, 100, checkpoint={"every_steps": 50, "save_s": 20, "load_s": 0})]}
    result = simulate(parse_scenario(data), "static")
    assert result["useful_gpu_s"] == pytest.approx(400)
    assert result["allocated_gpu_s"] == pytest.approx(4 * 120)
    assert result["goodput"] == pytest.approx(400 / 480, abs=1e-5)


def test_class_figures_count_unstarted_jobs_waiting_to_the_horizon() -> None:
    jobs = [
        {"priority": "regular", "submit_s": 0, "start_s": 10, "jct_s": 100, "preemptions": 1},
        {"priority": "regular", "submit_s": 0, "start_s": 30, "jct_s": 300, "preemptions": 0},
        {"priority": "regular", "submit_s": 100, "start_s": None, "jct_s": None, "preemptions": 0},
    ]
    fig = class_figures(jobs, 1000)["regular"]
    assert fig["completed"] == 2 and fig["jct_median_s"] == 200 and fig["jct_p95_s"] == 300
    # The unfinished job counts 900 s (to the horizon) in the completion time over every job.
    assert fig["jct_horizon_median_s"] == 300 and fig["jct_horizon_p95_s"] == 900
    assert fig["queue_median_s"] == 30 and fig["queue_p95_s"] == 900
    assert p95(list(range(1, 101))) == 95

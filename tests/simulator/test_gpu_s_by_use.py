"""Where a replay's GPU-seconds go (``gpu_s_by_use``): every healthy GPU-second counted once, by
what the job holding it did or, idle, whether it sat on the nodes of a reservation in force, or
elsewhere while some job waited for GPUs, or while none did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.simulator import load_scenario, simulate
from jobs.simulator.cli import format_table
from jobs.simulator.policies import POLICIES
from jobs.simulator.report import where_table_html
from jobs.simulator.results import where_gpu_s_went
from jobs.simulator.scenario import parse_scenario

SCENARIO_DIR = Path(__file__).resolve().parents[2] / "jobs" / "scenarios"
SMALL = sorted(p for p in SCENARIO_DIR.glob("*.json") if len(json.loads(p.read_text())["jobs"]) <= 200)
HELD = ("computing", "saving", "saving_to_stop", "loading", "idle_phase", "incoming")


@pytest.mark.parametrize("path", SMALL, ids=lambda p: p.stem)
def test_the_uses_add_up_to_the_healthy_and_the_held_ones_to_the_allocated_gpu_seconds(path: Path) -> None:
    scenario = load_scenario(path)
    for policy in POLICIES:
        result = simulate(scenario, policy)
        uses = result["gpu_s_by_use"]
        assert set(uses) <= {*HELD, "idle_reserved", "idle_queued", "idle_other"}, (policy, uses)
        assert min(uses.values()) >= 0, (policy, uses)
        assert sum(uses.values()) == pytest.approx(result["healthy_gpu_s"], rel=1e-9, abs=0.01), (policy, uses)
        held = sum(v for k, v in uses.items() if k in HELD)
        assert held == pytest.approx(result["allocated_gpu_s"], rel=1e-9, abs=0.01), (policy, uses)
        # Kept and lost steps were computed: no policy counts more of them than it computed
        # beyond the scenarios' step-time noise (2% by default).
        assert result["useful_gpu_s"] + result["lost_gpu_s"] <= uses.get("computing", 0) * 1.05 + 0.01, (policy, uses)


def test_idle_gpus_count_as_reserved_while_the_reservation_is_in_force_and_as_queued_while_jobs_wait() -> None:
    # Two 8-GPU nodes; the reservation's pool is the last node, in force from t=1500. "train"
    # runs on the first node for 100 steps of 10 s with a 20 s save after steps 40 and 80
    # (0-1040); "wide" (16 GPUs, 10 steps) comes at 500; "crit" comes at 2000 and runs 50 steps.
    omni, static = _hand_scenario_results()
    assert omni["invariant_violations"] == [] and static["invariant_violations"] == []
    held = {"computing": (1000 + 500) * 8.0 + 100 * 16.0, "saving": 2 * 20 * 8.0}
    # static keeps the pool node idle, before the reservation too: "wide" waits from 500 until
    # crit is done (2500). Reserved: the pool idle from the reservation's start to crit's
    # (1500-2000). Queued: the first node idle while "wide" waits (1040-2500) and the pool node
    # before the reservation (500-1500). The rest: the pool node until "wide" came, both after it.
    assert static["gpu_s_by_use"] == {
        **held,
        "idle_reserved": 500 * 8.0,
        "idle_queued": (2500 - 1040) * 8.0 + (1500 - 500) * 8.0,
        "idle_other": 500 * 8.0 + 2 * (3000 - 2600) * 8.0,
    }
    # omni lends the pool node before the reservation starts: "wide" runs 1040-1140 on both
    # nodes, and waits only while "train" holds the first one (the pool node idle 500-1040).
    assert omni["gpu_s_by_use"] == {
        **held,
        "idle_reserved": 500 * 8.0,
        "idle_queued": (1040 - 500) * 8.0,
        # The pool node until "wide" came; both nodes after it but for crit's run and the
        # reserved idle span (the pool node, 2000-2500 and 1500-2000).
        "idle_other": 500 * 8.0 + (3000 - 1140) * 16.0 - (2500 - 2000) * 8.0 - (2000 - 1500) * 8.0,
    }


def _hand_scenario_results() -> list[dict]:
    scenario = parse_scenario({
        "name": "uses", "horizon_s": 3000, "seed": 1,
        "cluster": {"racks": 1, "switches_per_rack": 1, "nodes_per_switch": 2, "gpus_per_node": 8},
        "jobs": [
            {"name": "train", "owner": "a", "priority": "regular", "submit_s": 0, "tp": 8, "dp": 1,
             "global_batch": 8, "micro_batch": 1, "total_steps": 100, "step_s": 10.0, "step_cv": 0,
             "checkpoint": {"every_steps": 40, "save_s": 20, "load_s": 30}},
            {"name": "wide", "owner": "a", "priority": "regular", "submit_s": 500, "tp": 8, "dp": 2,
             "global_batch": 16, "micro_batch": 1, "total_steps": 10, "step_s": 10.0, "step_cv": 0,
             "checkpoint": {"every_steps": 1000, "save_s": 20, "load_s": 30}},
            {"name": "crit", "owner": "b", "priority": "critical", "submit_s": 2000, "tp": 8, "dp": 1,
             "global_batch": 8, "micro_batch": 1, "total_steps": 50, "step_s": 10.0, "step_cv": 0,
             "checkpoint": {"every_steps": 1000, "save_s": 20, "load_s": 30}},
        ],
        "reservations": [{"name": "crit-res", "job": "crit", "gpus": 8, "start_s": 1500}],
    })
    return [simulate(scenario, policy) for policy in ("omni", "static")]


def test_the_table_and_the_report_say_where_the_gpu_seconds_went() -> None:
    results = _hand_scenario_results()
    static = where_gpu_s_went(results[1])
    assert static is not None
    assert static["useful"] == pytest.approx(results[1]["utilization"], abs=1e-6)
    assert static["idle_reserved"] == pytest.approx(500 * 8 / (3000 * 16))
    assert static["idle_queued"] == pytest.approx((1460 + 1000) * 8 / (3000 * 16))
    assert sum(static.values()) == pytest.approx(1.0)

    text = format_table(results)
    block = text[text.index("where the healthy GPU-seconds went"):].splitlines()
    header, rows = block[1].split(), {line.split()[0]: line.split()[1:] for line in block[2:4]}
    assert header[:2] == ["policy", "kept"] and "reserved" in header
    reserved = header.index("reserved") - 2  # "idle reserved" is two words in the header
    assert float(rows["static"][reserved]) == pytest.approx(8.33, abs=0.005)
    queued = header.index("queued") - 3  # after "idle reserved" and "idle queued"
    assert float(rows["static"][queued]) == pytest.approx(41.0, abs=0.005)
    assert float(rows["static"][0]) == pytest.approx(results[1]["utilization"] * 100, abs=0.005)

    page = where_table_html(results)
    assert page.startswith('<table id="where">')
    assert "<td>idle on reserved nodes, the reservation in force</td><td>" in page and "8.33%" in page
    assert "<td>idle elsewhere while jobs wait (too few for them, or held back)</td><td>" in page and "41.00%" in page
    assert where_table_html([{k: v for k, v in results[0].items() if k != "gpu_s_by_use"}]) == ""

"""The Plotly HTML report: one offline page with the three charts and the metrics table."""

from __future__ import annotations

import re
from pathlib import Path

from jobs.simulator.report import write_html

POLICIES = ("omni", "static", "kill_preempt")


def fake_result(policy: str) -> dict:
    """A small result in the simulator's --json --events shape, with a sampled timeline."""
    jobs = [
        {"name": "pretrain", "priority": "critical", "submit_s": 0, "start_s": 0, "end_s": 7200,
         "steps_done": 100, "preemptions": 0, "jct_s": 7200},
        {"name": "sft", "priority": "regular", "submit_s": 0, "start_s": 0, "end_s": None,
         "steps_done": 40, "preemptions": 1, "jct_s": None},
        {"name": "ablation", "priority": "best_effort", "submit_s": 600, "start_s": 600, "end_s": 3000,
         "steps_done": 10, "preemptions": 0, "jct_s": 2400},
    ]
    events = [
        {"t": 0, "kind": "place", "job": "pretrain", "gpus_before": 0, "gpus_after": 16, "reason": "reservation"},
        {"t": 0, "kind": "place", "job": "sft", "gpus_before": 0, "gpus_after": 8, "reason": "fifo"},
        {"t": 600, "kind": "place", "job": "ablation", "gpus_before": 0, "gpus_after": 8, "reason": "loan"},
        {"t": 1800, "kind": "preempt", "job": "sft", "gpus_before": 8, "gpus_after": 0, "reason": "reclaim"},
        {"t": 2400, "kind": "place", "job": "sft", "gpus_before": 0, "gpus_after": 4, "reason": "fifo"},
        {"t": 3000, "kind": "finish", "job": "ablation", "gpus_before": 8, "gpus_after": 0, "reason": "done"},
        {"t": 7200, "kind": "finish", "job": "pretrain", "gpus_before": 16, "gpus_after": 0, "reason": "done"},
    ]
    timeline = [
        {"t": t, "allocated": {"critical": 16, "regular": 8, "best_effort": 8 if 600 <= t < 3000 else 0},
         "useful": {"critical": 12, "regular": 6, "best_effort": 6 if 600 <= t < 3000 else 0},
         "entitled": {"pretrain": 16}, "delivered": {"pretrain": 16 if t else 0}}
        for t in range(0, 7201, 300)
    ]
    return {
        "scenario": "tiny", "policy": policy, "utilization": 0.61, "reservation_shortfall": 0.001,
        "preemptions": 1, "graceful_preemptions": 1 if policy == "omni" else 0, "lost_gpu_s": 12.5,
        "invariant_violations": [] if policy != "kill_preempt" else ["t=5: example breach"],
        "jobs": jobs, "events": events, "timeline": timeline, "horizon_s": 7200,
    }


def test_report_has_every_chart_and_the_metrics(tmp_path: Path) -> None:
    path = tmp_path / "report.html"
    write_html([fake_result(policy) for policy in POLICIES], path)
    page = path.read_text()
    assert page.count('class="plotly-graph-div"') == 5
    for name in ("useful critical", "allocated regular", "allocated best_effort", "entitled",
                 "kill_preempt delivered", "critical running", "preemption"):
        assert f'"name":"{name}"' in page, name
    assert page.count('"name":"allocated critical"') == 3  # one panel per policy
    assert '<table id="metrics">' in page
    assert "61.00%" in page and "example breach" in page


def test_report_opens_offline(tmp_path: Path) -> None:
    path = tmp_path / "report.html"
    write_html([fake_result("omni")], path)
    page = path.read_text()
    assert not re.search(r"<script[^>]*\bsrc=", page), "every script must be inline"
    assert not re.search(r"<link[^>]*\bhref=\"?https?:", page)
    assert "Plotly.newPlot" in page and len(page) > 1_000_000  # plotly.js itself is inside


def test_report_rebuilds_allocation_from_events_without_a_timeline(tmp_path: Path) -> None:
    results = []
    for policy in POLICIES:
        result = fake_result(policy)
        del result["timeline"]
        results.append(result)
    path = tmp_path / "report.html"
    write_html(results, path)
    page = path.read_text()
    assert '"name":"allocated critical"' in page
    assert '"name":"critical running"' in page
    assert "No data for this chart" in page  # no entitlement samples without a timeline


HARVEST = {
    "name": "report-harvest", "horizon_s": 14400, "seed": 1,
    "cluster": {"racks": 1, "switches_per_rack": 1, "nodes_per_switch": 4, "gpus_per_node": 8},
    "jobs": [
        {"name": "pretrain", "priority": "critical", "submit_s": 3600, "tp": 8, "dp": 2, "global_batch": 256,
         "micro_batch": 4, "total_steps": 1500, "step_s": 5.0,
         "checkpoint": {"every_steps": 100, "save_s": 20, "load_s": 40}},
        {"name": "ablation", "priority": "best_effort", "tp": 8, "dp": 2, "dp_min": 1, "dp_max": 4,
         "global_batch": 128, "micro_batch": 4, "total_steps": 4000, "step_s": 3.0,
         "checkpoint": {"every_steps": 50, "save_s": 10, "load_s": 20}},
    ],
    "reservations": [{"name": "pretrain-res", "job": "pretrain", "gpus": 16, "start_s": 3600}],
}


def test_report_of_a_real_simulation(tmp_path: Path) -> None:
    from jobs.simulator import parse_scenario, simulate

    scenario = parse_scenario(HARVEST)
    results = [simulate(scenario, policy) for policy in POLICIES]
    path = tmp_path / "report.html"
    write_html(results, path)
    page = path.read_text()
    assert page.count('class="plotly-graph-div"') == 5
    assert '"name":"omni delivered"' in page and '"name":"healthy GPUs"' in page
    assert '"y":["pretrain"' in page or '"pretrain"' in page
    assert not re.search(r"<script[^>]*\bsrc=", page)

"""omni against the peers, figure by figure (``jobs.simulator.verdict``): the simulate command's
last lines and the report's table."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.simulator.cli import main
from jobs.simulator.verdict import format_verdict, verdict

SCENARIO = str(Path(__file__).resolve().parents[2] / "jobs" / "scenarios" / "teams.json")


def result(policy: str, *, utilization: float, churn: float | None, regular: dict, lost: float = 0.0,
           shortfall: float = 0.0) -> dict:
    classes = {"regular": {"jobs": 4, "completed": 4, "jct_median_s": 100.0, "jct_p95_s": 200.0,
                           "queue_median_s": 10.0, "queue_p95_s": 20.0, **regular},
               "critical": {"jobs": 0}}
    return {"policy": policy, "utilization": utilization, "goodput": 0.9, "classes": classes,
            "preemptions_per_completed_job": churn, "lost_gpu_s": lost, "reservation_shortfall": shortfall}


def test_each_figure_names_the_best_peer_and_whether_omni_leads_it() -> None:
    found = verdict([
        result("omni", utilization=0.95, churn=0.5, regular={"jct_median_s": 90.0}, lost=50.0),
        result("kill_preempt", utilization=0.90, churn=0.6, regular={}, lost=1000.0),
        result("slurm", utilization=0.91, churn=0.3, regular={"queue_p95_s": 15.0, "completed": 3}),
        result("elastic", utilization=0.94, churn=0.2, regular={"jct_median_s": 95.0}),
    ])
    assert found is not None and found["peers"] == ["slurm", "elastic"]  # kueue absent, kill_preempt no peer
    rows = {row["figure"]: row for row in found["figures"]}
    # The empty critical class gives no figures; goodput is level (0.9 each): level counts as ahead.
    assert set(rows) == {"utilization", "goodput", "regular.jct_median_s", "regular.jct_p95_s",
                         "regular.queue_median_s", "regular.queue_p95_s", "preemptions_per_completed_job"}
    assert rows["utilization"]["ahead"] and rows["utilization"]["best_peer"] == "elastic"
    assert rows["goodput"]["ahead"]
    assert rows["regular.jct_median_s"]["ahead"] and rows["regular.jct_median_s"]["best_peer_value"] == 95.0
    assert not rows["regular.queue_p95_s"]["ahead"] and rows["regular.queue_p95_s"]["best_peer"] == "slurm"
    assert not rows["preemptions_per_completed_job"]["ahead"]
    assert rows["preemptions_per_completed_job"]["best_peer"] == "elastic"
    assert (found["ahead"], found["of"]) == (5, 7)
    assert [b["met"] for b in found["bounds"]] == [True, True]  # no shortfall; 50 <= 10% of 1000

    text = format_verdict(found)
    assert text.splitlines()[0] == "omni against the peers (slurm, elastic): ahead or level on 5 of 7 figures; behind on:"
    assert "  regular queueing delay p95: 20 s (slurm 15 s)" in text
    assert "  preemptions per completed job: 0.50 (elastic 0.20)" in text
    assert "GPU-s thrown away by stops (at most 10% of kill_preempt's): 50 against a limit of 100: met" in text


def test_a_peer_that_completes_fewer_jobs_is_said_to_and_a_bound_missed_is_loud() -> None:
    found = verdict([
        result("omni", utilization=0.9, churn=None, regular={"jct_p95_s": 300.0}, lost=500.0, shortfall=0.01),
        result("kill_preempt", utilization=0.8, churn=0.1, regular={}, lost=1000.0),
        result("kueue", utilization=0.8, churn=0.1, regular={"completed": 2}),
    ])
    rows = {row["figure"]: row for row in found["figures"]}
    assert not rows["preemptions_per_completed_job"]["ahead"]  # omni completed nothing to count over
    text = format_verdict(found)
    assert "regular completion time p95: 300 s (kueue 200 s, over 2 completed jobs against omni's 4)" in text
    assert "preemptions per completed job: none completed (kueue 0.10)" in text
    assert "critical reservation shortfall, node failures aside: 1.000%: NOT MET" in text
    assert "500 against a limit of 100: NOT MET" in text


def test_the_bounds_leave_node_failures_aside() -> None:
    # spares-node-failure: a node fails under every policy; its unsaved steps and the owner's
    # recovery are no policy's doing (kill_preempt throws away 1,320 GPU-s more by its kills).
    from jobs.simulator import simulate
    from jobs.simulator.scenario import load_scenario

    scenario = load_scenario(SCENARIO.replace("teams.json", "spares-node-failure.json"))
    results = [simulate(scenario, policy) for policy in ("omni", "kill_preempt", "slurm")]
    assert results[0]["reservation_shortfall"] > 0 and results[0]["lost_gpu_s"] > 15_000
    bounds = {b["figure"]: b for b in verdict(results)["bounds"]}
    assert bounds["reservation_shortfall"]["omni"] == 0.0 and bounds["reservation_shortfall"]["met"]
    assert bounds["lost_gpu_s"]["omni"] == 0.0 and bounds["lost_gpu_s"]["limit"] == pytest.approx(132, abs=1)


def test_without_omni_or_without_a_peer_there_is_no_verdict() -> None:
    base = {"utilization": 0.9, "churn": 0.1, "regular": {}}
    assert verdict([result("omni", **base), result("static", **base), result("kill_preempt", **base)]) is None
    assert verdict([result("slurm", **base), result("kueue", **base)]) is None
    assert format_verdict(None) == ""


def test_simulate_ends_its_table_with_the_verdict_and_the_report_draws_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    page = tmp_path / "teams.html"
    assert main([SCENARIO, "--html", str(page)]) == 0
    lines = capsys.readouterr().out.splitlines()
    [head] = [i for i, line in enumerate(lines) if line.startswith("omni against the peers (slurm, kueue, elastic)")]
    # teams.json: omni leads utilisation; elastic finishes without a preemption (0.00 per job).
    assert "  preemptions per completed job: 0.33 (elastic 0.00)" in lines[head + 1:]
    assert lines[-2] == "  critical reservation shortfall, node failures aside: 0.000%: met"
    assert lines[-1] == "  GPU-s thrown away by stops (at most 10% of kill_preempt's): 0 against a limit of 1,233: met"
    html = page.read_text()
    assert '<table id="verdict">' in html and "<td>utilisation</td><td>95.27%</td><td>elastic: 94.27%</td>" in html
    assert main([SCENARIO, "--policy", "omni"]) == 0
    assert "against the peers" not in capsys.readouterr().out

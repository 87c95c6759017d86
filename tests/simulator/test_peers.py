"""The peers' policies (``slurm``, ``kueue``, ``elastic``): each one's characteristic behaviour on
a tiny scenario checked by hand, every shipped scenario under each with no invariant broken, and
``simulate --policy all`` with its table and HTML report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.simulator import parse_scenario, simulate
from jobs.simulator.cli import main
from jobs.simulator.policies import POLICIES

SCENARIOS = Path(__file__).resolve().parents[2] / "jobs" / "scenarios"
#: The two trace-driven files take minutes per policy: the engine's own tests cover them.
BIG = {"philly-week.json", "acme-llm.json"}
PEERS = ("slurm", "kueue", "elastic")


def _job(name: str, submit_s: float, tp: int, steps: int, **extra: object) -> dict:
    job = {"name": name, "priority": "regular", "submit_s": submit_s, "tp": tp, "dp": 1, "global_batch": 8,
           "micro_batch": 8, "total_steps": steps, "step_s": 1.0, "step_cv": 0.0, "min_run_s": 0,
           "checkpoint": {"every_steps": 100000, "save_s": 0, "load_s": 0}}
    job.update(extra)
    return job


def _scenario(jobs: list[dict], nodes: int = 1, horizon_s: float = 10000, **extra: object) -> dict:
    return {"name": "tiny", "horizon_s": horizon_s,
            "cluster": {"racks": 1, "switches_per_rack": 1, "nodes_per_switch": nodes, "gpus_per_node": 8},
            "jobs": jobs, **extra}


def _jobs(result: dict) -> dict[str, dict]:
    return {j["name"]: j for j in result["jobs"]}


# --- slurm ---------------------------------------------------------------------------------------


def test_slurm_backfills_a_short_job_around_a_blocked_big_one_but_not_a_long_one() -> None:
    # One 8-GPU node. "running" holds 4 GPUs until t=1000; "big" (8 GPUs) must wait for it and gets
    # the backfill reservation at t=1000. "long" (4 GPUs, 5000 s) would delay it: it waits.
    # "short" (4 GPUs, 300 s) ends by t=320: it is backfilled at once.
    data = _scenario([
        _job("running", 0, 4, 1000),
        _job("big", 10, 8, 500),
        _job("long", 15, 4, 5000),
        _job("short", 20, 4, 300),
    ])
    scenario = parse_scenario(data)
    jobs = _jobs(simulate(scenario, "slurm"))
    assert jobs["short"]["start_s"] == pytest.approx(20)
    assert jobs["big"]["start_s"] == pytest.approx(1000)
    assert jobs["long"]["start_s"] >= jobs["big"]["start_s"]
    # The FCFS baseline backfills without a reservation, so the long job delays the big one.
    static = _jobs(simulate(scenario, "static"))
    assert static["long"]["start_s"] == pytest.approx(15)
    assert static["big"]["start_s"] > 1000


def test_slurm_requeues_a_preempted_lower_tier_job_from_its_checkpoint_within_grace_time() -> None:
    # "low" (best effort) holds the node; "high" (regular, a higher PriorityTier) arrives at 500.
    # low gets SIGTERM, saves (20 s) within GraceTime, is requeued, and restarts from that save
    # once high is done: nothing is lost.
    ckpt = {"every_steps": 1000, "save_s": 20, "load_s": 30}
    data = _scenario([
        _job("low", 0, 8, 3000, priority="best_effort", checkpoint=ckpt),
        _job("high", 500, 8, 400, checkpoint=ckpt),
    ])
    result = simulate(parse_scenario(data), "slurm", record_events=True)
    jobs = _jobs(result)
    assert result["invariant_violations"] == []
    assert result["preemptions"] == 1 and result["graceful_preemptions"] == 1
    assert result["lost_gpu_s"] == 0
    # high waits for low's save (20 s + the step in flight), which GraceTime (>= save + 2 steps) covers.
    assert 500 + 20 <= jobs["high"]["start_s"] <= 500 + 30
    preempt = next(e for e in result["events"] if e["kind"] == "preempt" and e["job"] == "low")
    assert preempt["graceful"] and preempt["deadline_s"] - preempt["t"] >= 22
    # low restarts (loading its checkpoint) after high completes and finishes all its steps.
    restart = [e for e in result["events"] if e["kind"] == "place" and e["job"] == "low"]
    assert len(restart) == 2 and restart[1]["t"] >= jobs["high"]["end_s"] - 1e-6
    assert jobs["low"]["end_s"] is not None and jobs["low"]["steps_done"] == 3000
    # 501 steps kept at the preemption, then 2499 more: low's end accounts for every step once.
    expected_end = jobs["high"]["end_s"] + 30 + 2499 + 20 * 2  # load, steps, saves at 1000 and 2000
    assert jobs["low"]["end_s"] == pytest.approx(expected_end, abs=25)


# --- kueue ---------------------------------------------------------------------------------------


def test_kueue_lends_idle_quota_and_reclaims_it_by_killing_and_requeueing_the_borrower() -> None:
    # Two teams with 8 GPUs of nominal quota each on 16 GPUs. Vision runs two 8-GPU jobs from t=0:
    # the second borrows speech's idle quota. Speech's job at t=1000 reclaims it at once: the
    # borrower is killed, loses the 100 steps since its checkpoint at step 900, and is requeued.
    ckpt = {"every_steps": 300, "save_s": 0, "load_s": 0}
    data = _scenario([
        _job("v1", 0, 8, 5000, team="vision", checkpoint=ckpt),
        _job("v2", 0, 8, 5000, team="vision", checkpoint=ckpt),
        _job("s1", 1000, 8, 500, team="speech", checkpoint=ckpt),
    ], nodes=2, teams=[{"name": "vision", "quota_gpus": 8}, {"name": "speech", "quota_gpus": 8}])
    result = simulate(parse_scenario(data), "kueue")
    jobs = _jobs(result)
    assert result["invariant_violations"] == []
    assert jobs["v1"]["start_s"] == 0 and jobs["v2"]["start_s"] == 0  # v2 borrows
    assert jobs["s1"]["start_s"] == pytest.approx(1000)  # reclaimed at the moment of need
    victim = "v2" if jobs["v2"]["preemptions"] else "v1"
    assert jobs[victim]["preemptions"] == 1 and result["graceful_preemptions"] == 0
    assert result["lost_gpu_s"] == pytest.approx(100 * 8, abs=8)
    assert result["lost_gpu_s_by_cause"]["kill"] == result["lost_gpu_s"]
    # The victim is readmitted when speech's job ends and goes on from step 900.
    assert jobs[victim]["segments"][1]["start_s"] == pytest.approx(jobs["s1"]["end_s"])
    assert result["quota_shortfall"] == 0.0


# --- elastic -------------------------------------------------------------------------------------


def test_elastic_grows_into_free_gpus_and_shrinks_checkpoint_first_without_lead_time() -> None:
    # Two 8-GPU nodes. "grower" (1..2 replicas of 8) starts on the 8 GPUs "other" leaves free,
    # grows to 16 when other completes at t=500, and shrinks back to 8, saving first (40 s), when
    # the critical job's reservation begins at t=2000: the owner waits for that save.
    ckpt = {"every_steps": 100000, "save_s": 40, "load_s": 20}
    data = _scenario([
        _job("other", 0, 8, 500),
        _job("grower", 10, 8, 20000, dp_min=1, dp_max=2, global_batch=16, checkpoint=ckpt),
        _job("owner", 2000, 8, 1000, priority="critical"),
    ], nodes=2, reservations=[{"name": "r", "job": "owner", "gpus": 8, "start_s": 2000}])
    result = simulate(parse_scenario(data), "elastic")
    jobs = _jobs(result)
    assert result["invariant_violations"] == []
    segs = jobs["grower"]["segments"]
    assert [s["gpus"] for s in segs[:3]] == [8, 16, 8]
    assert segs[0]["end"] == "resized" and segs[0]["end_s"] == pytest.approx(500 + 40, abs=2)
    assert segs[1]["end"] == "resized"
    # No lead time: the shrink is decided at t=2000, and the owner starts after the save.
    assert 2000 + 40 <= jobs["owner"]["start_s"] <= 2000 + 40 + 2
    assert result["lost_gpu_s"] == 0 and result["preemptions"] == 0
    # The wait is inside the 60 s grace: no shortfall, but the reservation's wait shows it.
    assert result["reservation_shortfall"] == 0.0
    owner = jobs["owner"]
    entitled_s = (owner["end_s"] if owner["end_s"] is not None else data["horizon_s"]) - 2000
    assert result["reservation_wait"] == pytest.approx((owner["start_s"] - 2000) / entitled_s, abs=1e-6)
    # omni reclaims ahead of the need: its owner starts at once.
    omni_result = simulate(parse_scenario(data), "omni")
    assert _jobs(omni_result)["owner"]["start_s"] == pytest.approx(2000)
    assert omni_result["reservation_wait"] == 0.0


# --- every shipped scenario ---------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(p.name for p in SCENARIOS.glob("*.json") if p.name not in BIG))
def test_peers_break_no_invariant_on_shipped_scenarios(path: str) -> None:
    from jobs.simulator import load_scenario

    scenario = load_scenario(SCENARIOS / path)
    for policy in PEERS:
        result = simulate(scenario, policy, full_check=True)
        assert result["invariant_violations"] == [], (policy, result["invariant_violations"][:3])
        assert result["utilization"] <= result["utilization_bound"] + 1e-9, policy
        assert 0 < result["goodput"] <= 1.0 + 1e-9, policy


# --- command line and report ---------------------------------------------------------------------


def test_policy_all_prints_every_policy_and_draws_them_side_by_side(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    data = _scenario([_job("a", 0, 8, 300), _job("b", 10, 8, 200, priority="best_effort")], horizon_s=2000)
    scenario = tmp_path / "tiny.json"
    scenario.write_text(json.dumps(data))
    html = tmp_path / "report.html"
    assert main([str(scenario), "--policy", "all", "--html", str(html)]) == 0
    out = capsys.readouterr().out.splitlines()
    for policy in POLICIES:
        assert any(line.startswith(policy + " ") for line in out), policy
        assert any(line.startswith(f"  [{policy}] regular (1/1) jct ") for line in out), policy
    assert "fluid bound" in out[0]
    page = html.read_text()
    for policy in POLICIES:
        assert f'"name":"{policy} completion"' in page
        assert f'"name":"{policy} useful (mean ' in page
    assert "regular: median completion time" in page and "share of the bound" in page
    assert "regular: p95 completion time, unfinished jobs counted to the horizon" in page
    assert main([str(scenario), "--policy", "all", "--json"]) == 0
    many = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in many] == list(POLICIES)
    assert all(r["classes"]["regular"]["jct_median_s"] is not None for r in many)
    # The regular job finishes under every policy, so counting to the horizon changes nothing.
    assert all(r["classes"]["regular"]["jct_horizon_median_s"] == r["classes"]["regular"]["jct_median_s"]
               for r in many)

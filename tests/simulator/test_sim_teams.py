"""Teams in the simulator: validation, the per-team metrics on a hand-computable scenario, the
quota invariant (it holds under omni, and it is reported when it breaks), a team's reservation,
the Philly importer's --teams, and random scenarios with teams under omni."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jobs.planner.quota import accrue, decayed
from jobs.planner.snapshot import Gpu
from jobs.simulator import ScenarioError, Simulation, load_scenario, parse_scenario, simulate
from jobs.simulator.cli import main
from jobs.simulator.traces import TraceError, default_options, import_trace, options_with, team_quotas

SCENARIOS = Path(__file__).resolve().parents[2] / "jobs" / "scenarios"


def _job(name: str, team: str | None, submit_s: float = 0, **extra: object) -> dict:
    job = {"name": name, "priority": "regular", "submit_s": submit_s, "tp": 8, "dp": 1, "global_batch": 8,
           "micro_batch": 1, "total_steps": 100, "step_s": 1.0, "step_cv": 0.0, "min_run_s": 0,
           "checkpoint": {"every_steps": 1000, "save_s": 0, "load_s": 0}}
    if team is not None:
        job["team"] = team
    job.update(extra)
    return job


GOOD = {
    "name": "teams-ok",
    "horizon_s": 300,
    "cluster": {"racks": 1, "switches_per_rack": 1, "nodes_per_switch": 1, "gpus_per_node": 8},
    "teams": [{"name": "org", "quota_gpus": 8}, {"name": "a", "parent": "org", "quota_gpus": 8},
              {"name": "b", "quota_gpus": 0, "borrow_limit_gpus": 8, "weight": 2}],
    "jobs": [_job("ja", "a"), _job("jb", "b"), _job("crit", "a", priority="critical")],
    "reservations": [{"name": "r", "team": "a", "gpus": 8}],
}


def _with(change: dict, where: str | None = None) -> dict:
    data = copy.deepcopy(GOOD)
    for path, value in change.items():
        target: object = data
        keys = path.split(".")
        for key in keys[:-1]:
            target = target[int(key)] if isinstance(target, list) else target[key]  # type: ignore[index]
        if value is _DROP:
            del target[keys[-1]]  # type: ignore[union-attr]
        elif isinstance(target, list):
            target[int(keys[-1])] = value
        else:
            target[keys[-1]] = value  # type: ignore[index]
    return data


_DROP = object()


def test_a_scenario_with_teams_is_accepted() -> None:
    scenario = parse_scenario(GOOD)
    assert [t.name for t in scenario.teams] == ["org", "a", "b"]
    assert scenario.teams[1].parent == "org"
    assert scenario.teams[0].borrow_limit_gpus is None and scenario.teams[2].borrow_limit_gpus == 8
    assert scenario.teams[2].weight == 2.0 and scenario.teams[0].weight == 1.0
    assert scenario.jobs[0].team == "a"
    assert scenario.reservations[0].team == "a" and scenario.reservations[0].job == ""


def test_every_shipped_scenario_still_loads() -> None:
    for path in sorted(SCENARIOS.glob("*.json")):
        load_scenario(path)


def test_fair_share_half_life_reaches_the_planner_config() -> None:
    scenario = parse_scenario(_with({"policy": {"fair_share_half_life_s": 3600}}))
    assert scenario.planner_config().fair_share_half_life_s == 3600.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"teams.1.parent": "orgx"}, "teams[1].parent: 'orgx' is not a team"),
        ({"teams.2.name": "a"}, "teams[2].name: duplicate team 'a'"),
        ({"teams.0.parent": "a"}, "teams[0].parent: cycle: org -> a -> org"),
        ({"teams.0.parent": "org"}, "teams[0].parent: cycle: org -> org"),
        ({"teams.0.quota_gpus": -1}, "teams[0].quota_gpus: must be at least 0, got -1"),
        ({"teams.0.quota_gpus": 1.5}, "teams[0].quota_gpus: must be an integer, got 1.5"),
        ({"teams.2.borrow_limit_gpus": -8}, "teams[2].borrow_limit_gpus: must be at least 0, got -8"),
        ({"teams.2.weight": 0}, "teams[2].weight: must be positive, got 0"),
        ({"teams.0.colour": "red"}, "teams[0].colour: unknown key"),
        ({"teams.0.name": _DROP}, "teams[0].name: is required"),
        ({"teams": {"name": "a"}}, "teams: must be a list, got dict"),
        ({"jobs.1.team": "c"}, "jobs[1].team: 'c' is not a team"),
        ({"jobs.1.team": ""}, 'jobs[1].team: must be a non-empty string, got ""'),
        ({"reservations.0.job": "crit"}, "reservations[0]: needs exactly one of job or team, not both"),
        ({"reservations.0.team": _DROP}, "reservations[0]: needs exactly one of job or team"),
        ({"reservations.0.team": "nobody"}, "reservations[0].team: 'nobody' is not a team"),
        ({"reservations.0.gpus": 4}, "reservations[0].gpus: 4 is not a multiple of 'crit''s replica size 8"),
        ({"policy": {"fair_share_half_life_s": 0}}, "policy.fair_share_half_life_s: must be positive, got 0"),
        ({"policy": {"fair_share_half_life_s": -5}}, "policy.fair_share_half_life_s: must be positive, got -5"),
    ],
)
def test_bad_teams_give_one_line_naming_the_field(change: dict, message: str) -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario(_with(change))
    assert str(err.value) == message


def test_a_bad_team_file_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_with({"teams.1.parent": "orgx"})))
    assert main([str(path), "--policy", "omni", "--json"]) == 2
    err = capsys.readouterr().err
    assert err == "teams[1].parent: 'orgx' is not a team\n"


# --- metrics ---------------------------------------------------------------------------------------

TINY = {
    "name": "tiny-teams",
    "horizon_s": 300,
    "cluster": {"racks": 1, "switches_per_rack": 1, "nodes_per_switch": 1, "gpus_per_node": 8},
    "teams": [{"name": "a", "quota_gpus": 8}, {"name": "b", "quota_gpus": 0}],
    "policy": {"fair_share_half_life_s": 100},
    "jobs": [_job("ja", "a"), _job("jb", "b", submit_s=0)],
}


def test_team_metrics_on_a_hand_computable_scenario() -> None:
    # One node: a's job (within its quota) runs 0-100 s, b's (quota 0) waits and runs 100-200 s.
    result = simulate(parse_scenario(TINY), "omni")
    assert result["invariant_violations"] == []
    teams = {t["name"]: t for t in result["teams"]}
    assert teams["a"]["received_gpu_s"] == pytest.approx(800.0)
    assert teams["b"]["received_gpu_s"] == pytest.approx(800.0)
    assert teams["a"]["demand_gpu_s"] == pytest.approx(800.0)
    assert teams["b"]["demand_gpu_s"] == pytest.approx(1600.0)  # asked for 8 GPUs from 0 to 200 s
    assert teams["a"]["median_queue_s"] == 0.0 and teams["b"]["median_queue_s"] == pytest.approx(100.0)
    # Jain over received/demand = (1, 0.5): (1.5)^2 / (2 x 1.25) = 0.9.
    assert result["jain_index"] == pytest.approx(0.9)
    assert result["quota_shortfall"] == 0.0  # b has no quota, so nobody is owed anything it lacks
    assert teams["a"]["quota_gpus"] == 8 and teams["b"]["quota_shortfall"] == 0.0


def test_team_usage_is_decayed_with_the_half_life() -> None:
    sim = Simulation(parse_scenario(TINY), "omni")
    sim.run()
    # a held 8 GPUs for 0-100 s, then nothing until 300 s; the half-life is 100 s.
    expected = decayed(accrue(0.0, 8, 100.0, 100.0), 200.0, 100.0)
    assert sim.ledger is not None
    assert sim.ledger.usage_gpu_s["a"] == pytest.approx(expected)
    snapshot_team = next(t for t in sim.ledger.snapshot_teams() if t.name == "a")
    assert snapshot_team.usage_gpu_s == pytest.approx(expected)


def test_a_parent_accrues_its_childrens_usage() -> None:
    data = copy.deepcopy(TINY)
    data["teams"] = [{"name": "org", "quota_gpus": 8}, {"name": "a", "parent": "org", "quota_gpus": 8},
                     {"name": "b", "quota_gpus": 0}]
    result = simulate(parse_scenario(data), "omni")
    teams = {t["name"]: t for t in result["teams"]}
    assert teams["org"]["received_gpu_s"] == pytest.approx(teams["a"]["received_gpu_s"])
    # Jain's index is over leaf teams only (org is a's parent): the same 0.9.
    assert result["jain_index"] == pytest.approx(0.9)


def test_scenarios_without_teams_report_no_team_metrics() -> None:
    data = copy.deepcopy(TINY)
    del data["teams"]
    for job in data["jobs"]:
        del job["team"]
    result = simulate(parse_scenario(data), "omni")
    assert "teams" not in result and "jain_index" not in result and "quota_shortfall" not in result


# --- the quota invariant ---------------------------------------------------------------------------

BORROW = {
    "name": "borrow",
    "horizon_s": 3600,
    "cluster": {"racks": 1, "switches_per_rack": 1, "nodes_per_switch": 2, "gpus_per_node": 8},
    "teams": [{"name": "a", "quota_gpus": 8}, {"name": "b", "quota_gpus": 8}],
    "jobs": [_job("a1", "a", total_steps=3000, checkpoint={"every_steps": 100, "save_s": 10, "load_s": 10}),
             _job("a2", "a", total_steps=3000, checkpoint={"every_steps": 100, "save_s": 10, "load_s": 10}),
             _job("b1", "b", submit_s=600)],
}


def test_omni_reclaims_borrowed_gpus_for_a_team_below_its_quota() -> None:
    result = simulate(parse_scenario(BORROW), "omni", record_events=True, full_check=True)
    assert result["invariant_violations"] == []
    assert result["quota_shortfall"] == 0.0
    reclaims = [e for e in result["events"] if (e.get("reason") or {}).get("rule") == "quota.reclaim"]
    assert reclaims and reclaims[0]["t"] == 600.0
    b1 = next(j for j in result["jobs"] if j["name"] == "b1")
    assert b1["start_s"] is not None and b1["start_s"] - 600 <= 10 + 2 * 1.0 + 60


def test_in_a_batched_replay_gpus_reclaimed_for_a_team_are_planned_for_at_once() -> None:
    # Big replays batch non-urgent passes into 60 s slots; a quota reclaim's release is not
    # batched (the live planner plans on the agent's ``done``), so b1 starts as soon as a1's
    # save ends, not at the next slot.
    sim = Simulation(parse_scenario(BORROW), "omni", record_events=True, coalesce_s=60.0)
    sim.big = True
    result = sim.run()
    assert result["invariant_violations"] == []
    reclaim = next(e for e in result["events"] if (e.get("reason") or {}).get("rule") == "quota.reclaim")
    b1 = next(j for j in result["jobs"] if j["name"] == "b1")
    victim = next(j for j in result["jobs"] if j["name"] == reclaim["job"])
    released = next(s["end_s"] for s in victim["segments"] if s["end"] == "preempted")
    assert b1["start_s"] == pytest.approx(released)
    assert b1["start_s"] % 60.0 != pytest.approx(0.0)


def test_the_quota_invariant_is_reported_when_borrowed_gpus_are_not_reclaimed() -> None:
    # The FCFS baseline never reclaims: held to the invariant, it must be reported.
    sim = Simulation(parse_scenario(BORROW), "static")
    sim.quota_invariant = True
    result = sim.run()
    assert any("team b is below its quota (0 of 8 guaranteed GPUs) and b1 waits" in v
               for v in result["invariant_violations"])
    # Kept from 8 GPUs from 600 s + (save 10 + 2 steps + grace 60) until a1/a2 end at 3000 s... or the horizon.
    teams = {t["name"]: t for t in result["teams"]}
    assert teams["b"]["quota_shortfall"] > 0.9
    assert result["quota_shortfall"] == pytest.approx(teams["b"]["quota_shortfall"])
    # Not held to it, static still measures its shortfall, without a violation.
    plain = simulate(parse_scenario(BORROW), "static")
    assert plain["invariant_violations"] == [] and plain["quota_shortfall"] == result["quota_shortfall"]


def test_a_waiting_job_larger_than_its_teams_headroom_is_not_kept() -> None:
    # b's job needs 16 GPUs but b is owed only 8: it could not be given them within its quota.
    data = copy.deepcopy(BORROW)
    data["cluster"]["nodes_per_switch"] = 3
    data["jobs"][2] = _job("b1", "b", submit_s=600, dp=2, global_batch=16)
    data["jobs"].append(_job("a3", "a", total_steps=3000))
    sim = Simulation(parse_scenario(data), "static")
    sim.quota_invariant = True
    result = sim.run()
    assert result["invariant_violations"] == []
    assert result["quota_shortfall"] == 0.0


def test_a_borrower_that_can_only_give_back_more_than_its_excess_keeps_nobody() -> None:
    # a holds 4 GPUs beyond its quota of 12, but a1 cannot shrink: it gives back 16 GPUs or none,
    # and the planner never takes more than a team's excess.
    data = {
        "name": "fragments", "horizon_s": 2000,
        "cluster": {"racks": 1, "switches_per_rack": 1, "nodes_per_switch": 2, "gpus_per_node": 8},
        "teams": [{"name": "a", "quota_gpus": 12}, {"name": "b", "quota_gpus": 4}],
        "jobs": [_job("a1", "a", tp=2, dp=8, global_batch=8, total_steps=3000)]
                + [_job("b1", "b", submit_s=100, tp=4, dp=1, global_batch=4)],
    }
    sim = Simulation(parse_scenario(data), "static")
    sim.quota_invariant = True
    result = sim.run()
    a1 = next(j for j in result["jobs"] if j["name"] == "a1")
    assert a1["start_s"] == 0.0
    assert result["invariant_violations"] == []


def test_the_shipped_teams_scenario_borrows_and_reclaims_under_omni() -> None:
    scenario = load_scenario(SCENARIOS / "teams.json")
    results = {p: simulate(scenario, p, record_events=p == "omni", full_check=True)
               for p in ("omni", "static", "kill_preempt")}
    for result in results.values():
        assert result["invariant_violations"] == []
    omni = results["omni"]
    assert omni["quota_shortfall"] == 0.0 and omni["reservation_shortfall"] == 0.0
    assert any(e["reason"] and e["reason"].get("rule") == "quota.reclaim" for e in omni["events"])
    assert omni["jain_index"] > results["static"]["jain_index"]
    assert omni["utilization"] > results["static"]["utilization"]


def test_a_teams_reservation_entitles_its_earliest_runnable_critical_job() -> None:
    scenario = load_scenario(SCENARIOS / "teams.json")
    sim = Simulation(scenario, "omni")
    res = sim.reservations[0]
    assert res.job == "" and res.team == "speech"
    assert sim.entitled_job(res) is None  # nothing submitted yet
    result = sim.run()
    assert result["reservation_shortfall"] == 0.0
    entitled = {name for sample in result["timeline"] for name, gpus in sample["entitled"].items() if gpus}
    assert entitled == {"s-eval-1", "s-eval-2"}  # the first, then the second once the first is done


# --- the Philly importer ---------------------------------------------------------------------------

PHILLY_CSV = """timestamp,duration,num_gpus,gpu_time,cluster
2017-10-01 00:00:00,7200,1,7200,aaa
2017-10-01 00:10:00,7200,2,14400,bbb
2017-10-01 00:20:00,3600,1,3600,aaa
2017-10-01 00:30:00,14400,4,57600,ccc
"""


def test_philly_teams_come_from_virtual_clusters_with_quotas_by_gpu_hours(tmp_path: Path) -> None:
    path = tmp_path / "philly.csv"
    path.write_text(PHILLY_CSV)
    options = options_with("philly", {"teams": True, "start_day": 0.0, "days": 1.0, "gpus": 64, "gpu_scale": 1})
    scenario = import_trace("philly", path, options)
    assert scenario["name"] == "philly-day0-1d-teams"
    quotas = {t["name"]: t["quota_gpus"] for t in scenario["teams"]}
    # GPU-seconds submitted: aaa 7200 + 3600, bbb 14400, ccc 57600 (of 82800) on 64 GPUs.
    assert quotas == {"vc-aaa": 8, "vc-bbb": 11, "vc-ccc": 45}
    assert sum(quotas.values()) == 64
    assert [j["team"] for j in scenario["jobs"]] == ["vc-aaa", "vc-bbb", "vc-aaa", "vc-ccc"]
    assert "Teams: one per Philly virtual cluster" in scenario["comment"]
    parse_scenario(scenario)


def test_team_quotas_sum_to_the_cluster_by_largest_remainder() -> None:
    assert team_quotas({"a": 1.0, "b": 1.0, "c": 1.0}, 10) == {"a": 4, "b": 3, "c": 3}
    assert sum(team_quotas({"x": 0.3, "y": 2.9, "z": 7.7}, 1024).values()) == 1024


def test_teams_need_virtual_clusters(tmp_path: Path) -> None:
    path = tmp_path / "philly.csv"
    path.write_text("timestamp,duration,num_gpus\n2017-10-01 00:00:00,7200,1\n")
    with pytest.raises(TraceError, match=r"^--teams: philly.csv row 1: no cluster"):
        import_trace("philly", path, options_with("philly", {"teams": True, "start_day": 0.0, "days": 1.0}))
    with pytest.raises(TraceError, match=r"^--teams: the acme trace has no virtual clusters"):
        import_trace("acme", path, options_with("acme", {"teams": True}))


def test_without_teams_the_import_is_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "philly.csv"
    path.write_text(PHILLY_CSV)
    options = options_with("philly", {"start_day": 0.0, "days": 1.0, "gpus": 64, "gpu_scale": 1})
    scenario = import_trace("philly", path, options)
    assert "teams" not in scenario and all("team" not in j for j in scenario["jobs"])
    assert default_options("philly").teams is False


# --- random scenarios with teams -------------------------------------------------------------------


@st.composite
def team_scenarios(draw: st.DrawFn) -> dict:
    """2-4 nodes of 8 GPUs, 2-3 teams (maybe one inside another), up to 6 jobs, maybe a team reservation."""
    nodes = draw(st.integers(2, 4))
    total = nodes * 8
    n_teams = draw(st.integers(2, 3))
    teams = []
    for i in range(n_teams):
        team: dict = {"name": f"t{i}", "quota_gpus": draw(st.sampled_from([0, 4, 8, 16]))}
        if draw(st.booleans()):
            team["borrow_limit_gpus"] = draw(st.sampled_from([0, 8, 16]))
        if i == 2 and draw(st.booleans()):
            team["parent"] = "t0"
        if draw(st.booleans()):
            team["weight"] = draw(st.sampled_from([0.5, 2.0]))
        teams.append(team)
    jobs = []
    for i in range(draw(st.integers(2, 6))):
        tp = draw(st.sampled_from([1, 4, 8]))
        dp = draw(st.integers(1, 2))
        dp_max = draw(st.integers(dp, dp + 2))
        jobs.append({
            "name": f"j{i}", "team": draw(st.sampled_from([t["name"] for t in teams])),
            "priority": draw(st.sampled_from(["critical", "regular", "regular", "best_effort"])),
            "submit_s": draw(st.integers(0, 2400)), "tp": tp, "dp": dp, "dp_min": 1, "dp_max": dp_max,
            "global_batch": math.lcm(*range(1, dp_max + 1)) * 2, "micro_batch": 1,
            "total_steps": draw(st.integers(100, 800)), "step_s": draw(st.floats(1.0, 5.0)),
            "checkpoint": {"every_steps": draw(st.integers(30, 150)), "save_s": draw(st.integers(2, 30)),
                           "load_s": draw(st.integers(2, 30))},
            "min_run_s": draw(st.sampled_from([0, 600])),
        })
    reservations = []
    crit = [j for j in jobs if j["priority"] == "critical" and j["tp"] == 8]
    if crit and draw(st.booleans()):
        reservations.append({"name": "res", "team": crit[0]["team"], "gpus": 8,
                             "start_s": draw(st.integers(0, 2400))})
    return {"name": "random-teams", "horizon_s": draw(st.integers(3600, 7200)), "seed": draw(st.integers(0, 100)),
            "cluster": {"racks": 1, "switches_per_rack": 1, "nodes_per_switch": nodes, "gpus_per_node": 8},
            "teams": teams, "jobs": [j for j in jobs if j["tp"] * j["dp_min"] <= total],
            "reservations": reservations,
            "policy": {"fair_share_half_life_s": draw(st.sampled_from([3600, 604800]))}}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(team_scenarios())
def test_random_scenarios_with_teams_keep_every_invariant_under_omni(data: dict) -> None:
    try:
        scenario = parse_scenario(data)
    except ScenarioError:
        assume(False)
        return
    result = simulate(scenario, "omni", full_check=True)
    assert result["invariant_violations"] == []
    assert 0.0 <= result["quota_shortfall"] <= 1.0
    assert result["jain_index"] is None or 0.0 < result["jain_index"] <= 1.0 + 1e-9


def test_victims_give_back_in_whole_chunks_within_their_teams_excess() -> None:
    # a and b each hold 3 GPUs beyond their quota of 5, in 2-GPU jobs that cannot shrink: the
    # planner may take 2 from each (a third job's 2 would pass the excess), 4 in all, and c's
    # job needs 6. Counting min(excess, what its jobs hold) per team (3 + 3) reported c as kept.
    data = {
        "name": "chunks", "horizon_s": 2000,
        "cluster": {"racks": 1, "switches_per_rack": 1, "nodes_per_switch": 2, "gpus_per_node": 8},
        "teams": [{"name": "a", "quota_gpus": 5}, {"name": "b", "quota_gpus": 5}, {"name": "c", "quota_gpus": 6}],
        "jobs": [_job(f"{t}{i}", t, tp=2, global_batch=1, total_steps=3000) for t in "ab" for i in range(4)]
                + [_job("c1", "c", submit_s=100, tp=2, dp=3, global_batch=3)],
    }
    sim = Simulation(parse_scenario(data), "static")
    sim.quota_invariant = True
    result = sim.run()
    assert all(j["start_s"] == 0.0 for j in result["jobs"] if j["name"] != "c1")
    assert result["invariant_violations"] == []
    assert result["quota_shortfall"] == 0.0
    # One GPU more of excess each (quota 4): 3 jobs' worth from a and b together covers c1's 6.
    for team in data["teams"][:2]:
        team["quota_gpus"] = 4
    sim = Simulation(parse_scenario(data), "static")
    sim.quota_invariant = True
    assert any("team c is below its quota" in v for v in sim.run()["invariant_violations"])


def test_gpus_another_teams_reservation_lends_are_not_charged_to_the_borrowers_quota() -> None:
    # What the planner counts (quota.charged_gpus), kept by the engine as GPUs change hands and
    # as the reservation's job comes (its pool is then its team's) and goes (no pool at all).
    data = {
        "name": "lent", "horizon_s": 3600,
        "cluster": {"racks": 1, "switches_per_rack": 1, "nodes_per_switch": 2, "gpus_per_node": 8},
        "teams": [{"name": "a", "quota_gpus": 8}, {"name": "b", "quota_gpus": 8}],
        "jobs": [_job("a1", "a"), _job("b-crit", "b", submit_s=500, priority="critical"), _job("b2", "b")],
        "reservations": [{"name": "r", "job": "b-crit", "gpus": 8, "start_s": 1000}],
    }
    sim = Simulation(parse_scenario(data), "omni")
    assert sim.ledger is not None
    pool = [Gpu(sim.reservations[0].nodes[0], i) for i in range(8)]
    a1, crit, b2 = sim.jobs["a1"], sim.jobs["b-crit"], sim.jobs["b2"]
    sim._assign(a1, pool[:4], new_placement=True)
    sim._assign(b2, pool[4:], new_placement=True)
    # Before b-crit is submitted the pool is nobody's: no one is charged for it (the planner
    # sees the pool but not its job).
    assert (sim.ledger.held["a"], sim.ledger.charged["a"], sim.ledger.charged["b"]) == (4, 0, 0)
    sim._on_submit(crit)
    assert (sim.ledger.charged["a"], sim.ledger.charged["b"]) == (0, 4)  # now b's own pool
    crit.terminal = "completed"
    sim._own_pools(crit, active=False)
    assert (sim.ledger.charged["a"], sim.ledger.charged["b"]) == (4, 4)  # general capacity now
    sim._unassign(a1, pool[:4])
    sim._unassign(b2, pool[4:])
    assert sim.ledger.held == sim.ledger.charged == {"a": 0, "b": 0}


def test_gpus_a_team_holds_only_on_a_reservations_pool_are_not_counted_as_reclaimable() -> None:
    # b waits for 8 GPUs. a holds 4 beyond its quota in two jobs that can each shrink by 4: the
    # planner may take 4 of them, no more. d's only unprotected job runs on the pool of c's
    # reservation (c arrives after the horizon, so the pool is lent): reclaimed, those GPUs would
    # go back to that pool, not to b. So nothing can make room for b, and the invariant must not
    # say that 8 GPUs were kept from it (it did: d's borrower was counted as reclaimable).
    ck = {"every_steps": 100, "save_s": 5, "load_s": 5}
    data = {
        "name": "pool-borrower", "horizon_s": 3000,
        "cluster": {"racks": 1, "switches_per_rack": 1, "nodes_per_switch": 4, "gpus_per_node": 8},
        "teams": [{"name": "a", "quota_gpus": 12}, {"name": "b", "quota_gpus": 8},
                  {"name": "d", "quota_gpus": 0}],
        "jobs": [
            _job("a-gen1", "a", tp=1, dp=8, dp_min=4, global_batch=8, total_steps=100_000, checkpoint=ck),
            _job("a-gen2", "a", tp=1, dp=8, dp_min=4, global_batch=8, total_steps=100_000, checkpoint=ck),
            _job("d0-prot", "d", tp=1, dp=8, global_batch=8, total_steps=100_000, min_run_s=100_000,
                 checkpoint=ck),
            _job("d1-pool", "d", tp=1, dp=8, global_batch=8, total_steps=200_000, checkpoint=ck),
            _job("b-wait", "b", submit_s=600, tp=1, dp=8, global_batch=8, total_steps=100_000, checkpoint=ck),
            _job("c", None, submit_s=10_000, priority="critical", tp=1, dp=8, global_batch=8, checkpoint=ck),
        ],
        "reservations": [{"name": "r", "job": "c", "gpus": 8}],
    }
    result = simulate(parse_scenario(data), "omni", record_events=True, full_check=True)
    starts = {e["job"]: e for e in result["events"] if e["kind"] in ("place", "lend") and e["t"] == 0.0}
    assert starts["d1-pool"]["borrowed_from"] == ["r"]  # the pool's borrower is d's unprotected job
    b = next(j for j in result["jobs"] if j["name"] == "b-wait")
    assert b["start_s"] is None  # nothing could make room for it
    assert result["invariant_violations"] == []


def _idle_lender_scenario() -> dict:
    # Node 0: l-crit (team l) runs 100 steps, then idles for 1,200 s; its GPUs are lent to b's
    # best-effort jobs (b has no quota: it only borrows). Node 1: d's job, protected by its
    # minimum run. c (below its quota of 4) submits a best-effort job once b's borrowers run.
    ck = {"every_steps": 50, "save_s": 5, "load_s": 5}
    be = {"priority": "best_effort", "tp": 1, "dp": 4, "dp_min": 2, "global_batch": 8, "total_steps": 100_000,
          "checkpoint": ck}
    return {
        "name": "idle-lender", "horizon_s": 2400,
        "cluster": {"racks": 1, "switches_per_rack": 1, "nodes_per_switch": 2, "gpus_per_node": 8},
        "teams": [{"name": "l", "quota_gpus": 8}, {"name": "b", "quota_gpus": 0},
                  {"name": "c", "quota_gpus": 4}, {"name": "d", "quota_gpus": 4}],
        "jobs": [
            _job("l-crit", "l", priority="critical", tp=1, dp=8, total_steps=300, checkpoint=ck,
                 idle_phases=[{"every_steps": 100, "duration_s": 1200}]),
            _job("d-prot", "d", tp=1, dp=8, total_steps=100_000, min_run_s=100_000, checkpoint=ck),
            _job("b-1", "b", submit_s=50, **be), _job("b-2", "b", submit_s=50, **be),
            _job("c-wait", "c", submit_s=400, **be),
        ],
    }


def test_gpus_lent_for_an_idle_phase_are_not_charged_to_the_borrowers_quota() -> None:
    # The planner's snapshot shows a lent idle phase as the pool idle:<job> of the lender's team
    # (quota.charged_gpus): b's borrowers there hold nothing against b's quota, so b borrows
    # nothing c could reclaim (reclaimed, the GPUs go back to l-crit). The invariant said c was
    # kept from 4 GPUs for as long as the phase lasted: it counted b's borrowers as over-quota.
    sim = Simulation(parse_scenario(_idle_lender_scenario()), "omni", record_events=True, full_check=True)
    result = sim.run()
    lends = [(e["t"], e["job"]) for e in result["events"] if e["kind"] == "lend" and e["borrowed_from"] == ["idle:l-crit"]]
    assert lends[:2] == [(110.0, "b-1"), (110.0, "b-2")]  # the first phase was lent to b, before c came
    assert result["invariant_violations"] == []
    assert result["quota_shortfall"] == 0.0


def test_a_lent_idle_phase_is_a_pool_while_it_lasts() -> None:
    # Kept by the engine as the phase is lent (the borrowers' GPUs stop counting), and as it ends:
    # the lender placed again, or gone with its GPUs still lent (no pool any more: they count).
    sim = Simulation(parse_scenario(_idle_lender_scenario()), "omni")
    assert sim.ledger is not None
    lender, b1 = sim.jobs["l-crit"], sim.jobs["b-1"]
    gpus = [Gpu(sim.node_order[0], i) for i in range(8)]
    sim._assign(b1, gpus[:4], new_placement=True)
    assert sim.ledger.charged["b"] == 4  # general capacity: b borrows beyond its quota
    lender.parked = list(gpus)
    sim._idle_pool(lender, lent=True)
    assert (sim.ledger.held["b"], sim.ledger.charged["b"]) == (4, 0)
    sim._assign(b1, gpus[4:6], new_placement=True)
    assert (sim.ledger.held["b"], sim.ledger.charged["b"]) == (6, 0)
    sim._idle_pool(lender, lent=False)
    assert (sim.ledger.held["b"], sim.ledger.charged["b"]) == (6, 6)
    sim._unassign(b1, gpus[:6])
    assert sim.ledger.held["b"] == sim.ledger.charged["b"] == 0

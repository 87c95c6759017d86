"""Property tests: random small scenarios never break an invariant under the planner."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jobs.simulator import ScenarioError, parse_scenario, simulate

GPUS_PER_NODE = st.sampled_from([4, 8])


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    """A small random scenario: 1-12 nodes, up to 6 jobs, maybe a reservation and faults."""
    racks = draw(st.integers(1, 2))
    switches = draw(st.integers(1, 2))
    per_switch = draw(st.integers(1, 3))
    gpn = draw(GPUS_PER_NODE)
    total = racks * switches * per_switch * gpn
    node_names = [f"r{r}s{s}n{n}" for r in range(racks) for s in range(switches) for n in range(per_switch)]
    jobs = []
    for i in range(draw(st.integers(1, 6))):
        tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if t <= gpn]))
        pp = draw(st.integers(1, 2))
        dp = draw(st.integers(1, 3))
        dp_min = draw(st.integers(1, dp))
        dp_max = draw(st.integers(dp, dp + 2))
        micro = draw(st.integers(1, 2))
        gb = micro * math.lcm(*range(1, dp_max + 1)) * draw(st.integers(1, 2))
        if tp * pp * dp_min > total:
            continue
        job = {
            "name": f"j{i}", "priority": draw(st.sampled_from(["critical", "regular", "best_effort"])),
            "submit_s": draw(st.integers(0, 3000)), "tp": tp, "pp": pp, "dp": dp, "dp_min": dp_min,
            "dp_max": dp_max, "global_batch": gb, "micro_batch": micro,
            "total_steps": draw(st.integers(50, 600)), "step_s": draw(st.floats(0.5, 6.0)),
            "step_cv": draw(st.sampled_from([0.0, 0.02, 0.1])),
            "checkpoint": {"every_steps": draw(st.integers(20, 150)), "save_s": draw(st.integers(2, 40)),
                           "load_s": draw(st.integers(2, 60))},
            "min_run_s": draw(st.sampled_from([0, 600, 1800])),
        }
        if draw(st.booleans()):
            job["idle_phases"] = [{"every_steps": draw(st.integers(30, 200)), "duration_s": draw(st.integers(60, 900))}]
        jobs.append(job)
    assume(jobs)
    reservations = []
    critical = [j for j in jobs if j["priority"] == "critical"]
    if critical and draw(st.booleans()):
        owner = critical[0]
        rep = owner["tp"] * owner["pp"]
        res = {"name": "res", "job": owner["name"], "gpus": rep * owner["dp"],
               "spares": draw(st.sampled_from([0, gpn])), "start_s": draw(st.integers(0, 3600))}
        if draw(st.booleans()):
            res["period_s"] = 3600
            res["active_s"] = draw(st.sampled_from([1200, 2400]))
        reservations.append(res)
    events = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["node_down", "node_up", "slow_node", "drain", "cancel"]))
        ev: dict = {"at_s": draw(st.integers(0, 7000)), "kind": kind}
        if kind == "cancel":
            ev["job"] = draw(st.sampled_from([j["name"] for j in jobs]))
        else:
            ev["node"] = draw(st.sampled_from(node_names))
        if kind == "slow_node":
            ev["factor"] = draw(st.sampled_from([1.3, 2.0]))
        events.append(ev)
    return {
        "name": "random", "horizon_s": draw(st.integers(3600, 10800)), "seed": draw(st.integers(0, 1000)),
        "cluster": {"racks": racks, "switches_per_rack": switches, "nodes_per_switch": per_switch,
                    "gpus_per_node": gpn},
        "jobs": jobs, "reservations": reservations, "events": events,
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(scenarios())
def test_random_scenarios_keep_every_invariant_under_omni(data: dict) -> None:
    try:
        scenario = parse_scenario(data)
    except ScenarioError:
        assume(False)
        return
    result = simulate(scenario, "omni", full_check=True)
    assert result["invariant_violations"] == []
    assert 0.0 <= result["utilization"] <= 1.0 + 1e-9
    for job in result["jobs"]:
        assert job["steps_done"] <= next(j.total_steps for j in scenario.jobs if j.name == job["name"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(scenarios())
def test_random_scenarios_keep_every_invariant_under_the_baselines(data: dict) -> None:
    try:
        scenario = parse_scenario(data)
    except ScenarioError:
        assume(False)
        return
    for policy in ("static", "kill_preempt"):
        assert simulate(scenario, policy, full_check=True)["invariant_violations"] == []

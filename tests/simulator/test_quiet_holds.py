"""A replay that records no events asks the planner not to word its holds
(``PlannerConfig.explain_holds``), and the fast paths that skips (a long queue's tail held without
a search) must decide exactly what the worded pass decides: same figures, same jobs, every policy."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, assume, given, settings

from jobs.simulator import POLICIES, ScenarioError, parse_scenario, simulate
from tests.simulator.test_sim_properties import scenarios


def _figures(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "events" and "wall" not in k}


def queued_scenario(seed: int, jobs_n: int = 90, switches: int = 2) -> dict:
    """32 GPUs (16 per switch) and a queue of 90 jobs of every class and shape: most passes hold
    a long tail."""
    rng = random.Random(seed)
    jobs = []
    for i in range(jobs_n):
        tp = rng.choice((1, 1, 2, 4, 8))
        dp = rng.choice((1, 1, 2, 4)) if tp < 8 else rng.choice((1, 2))
        jobs.append({
            "name": f"j{i:03d}", "priority": rng.choice(("regular", "best_effort", "best_effort")),
            "submit_s": rng.randrange(0, 40_000), "tp": tp, "dp": dp, "dp_min": max(1, dp // 2),
            "dp_max": dp * 2, "global_batch": 16 * dp * 2, "micro_batch": 2,
            "total_steps": rng.randrange(200, 3000), "step_s": rng.uniform(1.0, 4.0),
            "checkpoint": {"every_steps": 100, "save_s": rng.randrange(5, 40), "load_s": rng.randrange(5, 60)},
            "min_run_s": rng.choice((0, 1800)),
        })
    jobs.append({"name": "crit", "priority": "critical", "tp": 8, "dp": 1, "global_batch": 64, "micro_batch": 8,
                 "total_steps": 1_000_000, "step_s": 2.0, "checkpoint": {"every_steps": 200, "save_s": 20, "load_s": 30}})
    return {
        "name": f"queued-{seed}", "horizon_s": 86_400, "seed": seed,
        "cluster": {"racks": 1, "switches_per_rack": switches, "nodes_per_switch": 2, "gpus_per_node": 8},
        "jobs": jobs,
        "reservations": [{"name": "crit-hourly", "job": "crit", "gpus": 8, "period_s": 3600, "active_s": 1800}],
        "events": [{"at_s": 30_000, "kind": "node_down", "node": "r0s1n1"}, {"at_s": 34_000, "kind": "node_up", "node": "r0s1n1"}],
    }


def with_teams(data: dict, quota_gpus: tuple[int, int, int], borrow_limit_gpus: int) -> dict:
    """``data`` with three teams (the second with a borrowing limit) owning three jobs in four."""
    data["teams"] = [{"name": "vision", "quota_gpus": quota_gpus[0]},
                     {"name": "speech", "quota_gpus": quota_gpus[1], "borrow_limit_gpus": borrow_limit_gpus},
                     {"name": "infra", "quota_gpus": quota_gpus[2]}]
    for i, job in enumerate(data["jobs"]):
        if job["priority"] != "critical" and i % 4:
            job["team"] = ("vision", "speech", "infra")[i % 3]
    return data


@pytest.mark.parametrize("policy", POLICIES)
def test_a_long_queue_is_decided_the_same_with_holds_worded_or_not(policy: str) -> None:
    scenario = parse_scenario(queued_scenario(7))
    quiet = simulate(scenario, policy)
    worded = simulate(scenario, policy, record_events=True)
    assert any(e["kind"] == "hold" for e in worded["events"])  # the queue did wait
    assert _figures(quiet) == _figures(worded)


@pytest.mark.parametrize("policy", ("omni", "kill_preempt", "kueue"))
def test_a_long_queue_of_teams_is_decided_the_same_with_holds_worded_or_not(policy: str) -> None:
    # Quotas and a borrowing limit: reclaims for a team below its quota, and jobs held at their
    # team's limit whatever is free, are decided in the quiet pass too.
    scenario = parse_scenario(with_teams(queued_scenario(11), quota_gpus=(12, 12, 4), borrow_limit_gpus=4))
    quiet = simulate(scenario, policy)
    worded = simulate(scenario, policy, record_events=True)
    assert any(e["kind"] == "hold" and "team" in e["reason"]["text"] for e in worded["events"])
    assert _figures(quiet) == _figures(worded)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(scenarios())
def test_random_scenarios_are_decided_the_same_with_holds_worded_or_not(data: dict) -> None:
    try:
        scenario = parse_scenario(data)
    except ScenarioError:
        assume(False)
        return
    for policy in ("omni", "static", "kill_preempt"):
        assert _figures(simulate(scenario, policy)) == _figures(simulate(scenario, policy, record_events=True)), policy


def _twice(make_pass, grouped_off, counts: dict):
    # A plan function that decides each pass both ways, by groups and job by job, and insists
    # on the same actions, wake-up and class held for capacity (which decides who may grow).
    def decide(snapshot, now_s, config):
        by_group = make_pass(snapshot, now_s, config)
        plan = by_group.run()
        with grouped_off():
            one_by_one = make_pass(snapshot, now_s, config)
            assert one_by_one.run() == plan, now_s
        assert by_group.capacity_blocked_rank == one_by_one.capacity_blocked_rank, now_s
        counts["passes"] += 1
        counts["held"] += by_group.capacity_blocked_rank < 99
        return plan
    return decide


@pytest.mark.parametrize("seed", (3, 5, 8))
@pytest.mark.parametrize("policy", ("omni", "kill_preempt", "static"))
def test_the_quiet_walk_by_groups_decides_every_pass_as_the_walk_job_by_job(
        policy: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # ``admission._walk_quietly`` skips whole groups of plain waiters while the pass's state
    # stands; each pass of a long queue (ageing every 30 min, so standings and long waiters mix)
    # is decided again job by job (``_quiet_groups`` finds no grouping).
    import contextlib

    from jobs.planner import admission
    from jobs.planner.core import PlanningPass
    from jobs.simulator import engine, policies

    @contextlib.contextmanager
    def grouped_off():
        with monkeypatch.context() as m:
            m.setattr(admission, "_quiet_groups", lambda state: None)
            yield

    counts = {"passes": 0, "held": 0}
    data = queued_scenario(seed, jobs_n=240, switches=4)
    data["policy"] = {"ageing_s": 1800}
    for job in data["jobs"][::9]:  # jobs back from an idle phase take their lent GPUs back
        job["idle_phases"] = [{"every_steps": 100, "duration_s": 1200}]
    if policy == "static":
        monkeypatch.setattr(policies, "plan_static", _twice(
            lambda s, t, c: policies.StaticPass(s, t, c.with_overrides({"ageing_s": 0.0})), grouped_off, counts))
    else:
        monkeypatch.setattr(engine, "omni_plan", _twice(PlanningPass, grouped_off, counts))
    simulate(parse_scenario(data), policy)
    assert counts["passes"] > 100 and counts["held"] > counts["passes"] // 4, counts


@pytest.mark.parametrize("teams", (False, True))
@pytest.mark.parametrize("policy", ("slurm", "kueue", "elastic"))
def test_the_peers_walk_by_shape_decides_as_their_walk_job_by_job(
        policy: str, teams: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # ``PeerPass.walk_queue`` skips whole shapes while they are hopeless; the walk it stands for
    # keys and sorts every waiting job and skips each job of a hopeless shape as it reaches it.
    from jobs.simulator.peers.common import PeerPass

    data = queued_scenario(5, jobs_n=240, switches=4)
    scenario = parse_scenario(with_teams(data, quota_gpus=(24, 24, 16), borrow_limit_gpus=8) if teams else data)
    by_shape = simulate(scenario, policy)
    skips = {"n": 0}

    def walk_job_by_job(self, key, decide, grouped=True, prepare=None):
        queue = self.waiting()
        if prepare is not None:
            prepare(queue)
        for job in sorted(queue, key=key):
            if self.hopeless(job, *self.size_range(job)):
                skips["n"] += 1
                self.skip(job)
            else:
                decide(job)

    monkeypatch.setattr(PeerPass, "walk_queue", walk_job_by_job)
    assert _figures(simulate(scenario, policy)) == _figures(by_shape)
    assert skips["n"] > 1000, skips  # the queue was long and hopeless shapes were skipped


@pytest.mark.parametrize("seed", (5, 11))
def test_static_asks_its_kept_queue_what_asking_every_job_answers(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # ``StaticPass._may_start`` reads the waiting jobs kept by size between passes; asking each
    # job of the pass (``_could_start``) must answer the same on every pass, node loss included.
    from jobs.planner import admission
    from jobs.simulator.policies import StaticPass

    kept_answer = StaticPass._may_start
    answers = {True: 0, False: 0}

    def both(self):
        got = kept_answer(self)
        lost = admission.lost_nodes(self)
        assert got == any(self._could_start(job, lost) for job in self.jobs.values())
        answers[got] += 1
        return got

    monkeypatch.setattr(StaticPass, "_may_start", both)
    data = queued_scenario(seed, jobs_n=240, switches=4)
    for job in data["jobs"][::7]:  # some arrive while others recover from the node's loss
        job["submit_s"] = 30_500
    simulate(parse_scenario(data), "static")
    assert answers[True] > 50 and answers[False] > 50, answers


def test_static_sends_a_job_that_waits_holding_gpus_through_the_queue() -> None:
    # A job back from a fault with its survivors (recovering, holding GPUs, no node lost now)
    # goes through the queue even on a full cluster; with a stop in flight for it, it does not.
    from jobs.planner.config import PlannerConfig
    from jobs.planner.snapshot import Command
    from jobs.simulator.policies import StaticPass
    from tests.planner.factory import cluster, gpus_on, job, snapshot

    nodes = cluster(switches=1, per_switch=2)
    survivor = job("survivor", tp=4, gpus=gpus_on(nodes[0].name, per_node=4), phase="recovering")
    full = job("full", tp=8, dp=1, gpus=gpus_on(nodes[1].name))
    waiting = job("waiting", tp=8)
    config = PlannerConfig().with_overrides({"explain_holds": False})
    assert StaticPass(snapshot(nodes, [full, survivor, waiting]), 0.0, config)._may_start()
    busy = (Command("c1", "survivor", "grow", None, ()),)  # in flight, giving nothing back
    assert not StaticPass(snapshot(nodes, [full, survivor, waiting], commands=busy), 0.0, config)._may_start()

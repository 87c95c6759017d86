"""What a pass keeps of a job snapshot between passes (by identity: a snapshot never changes) must
be what it would work out afresh: ``Job.gpus`` per holdings tuple, ``live_jobs_by_name``."""

from __future__ import annotations

import random

import pytest

from jobs.planner import snapshot as snapshot_module
from jobs.planner.snapshot import Gpu, Holding, Job, live_jobs_by_name


def _job(name: str, holdings: tuple[Holding, ...], phase: str = "running") -> Job:
    return Job(name=name, priority="regular", tp=1, pp=1, dp=len(holdings) or 1, dp_min=1, dp_max=8,
               global_batch=64, micro_batch=1, total_steps=100, step_s=1.0, phase=phase, holdings=holdings)


def test_a_jobs_gpus_are_its_holdings_gpus_however_many_layouts_come_and_go(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot_module, "_GPUS_OF_MAX", 16)  # cleared over and over below
    rng = random.Random(3)
    layouts = []
    for _ in range(200):
        gpus = [Gpu(f"n{rng.randrange(4)}", rng.randrange(8)) for _ in range(rng.randrange(1, 9))]
        layouts.append(tuple(Holding(g, "pool" if rng.random() < 0.2 else None) for g in gpus))
    for k in range(2000):
        held = layouts[rng.randrange(len(layouts))]
        job = _job(f"j{k}", held if rng.random() < 0.5 else tuple(held))  # shared or a copy
        assert job.gpus == tuple(h.gpu for h in held)
    assert len(snapshot_module._GPUS_OF) <= 16
    assert _job("idle", ()).gpus == ()


def test_the_live_jobs_by_name_are_in_name_order_and_leave_the_finished_out() -> None:
    rng = random.Random(5)
    phases = ["pending", "running", "preempted", "completed", "failed", "cancelled", "checkpointing"]
    jobs = [_job(f"j{rng.randrange(10_000):05d}", (), rng.choice(phases)) for _ in range(500)]
    want = {j.name: j for j in sorted(jobs, key=lambda j: j.name)
            if j.phase not in ("completed", "failed", "cancelled")}
    got = live_jobs_by_name(jobs)
    assert list(got) == list(want) and all(got[n] is want[n] for n in want)
    running = [j for j in jobs if j.phase == "running"]
    assert list(live_jobs_by_name(running)) == sorted({j.name for j in running})


def test_kept_facts_stand_for_their_own_object_only_and_are_forgotten_when_they_outgrow_the_jobs() -> None:
    from jobs.planner.kept import KeptById

    kept = KeptById()
    a, b = _job("a", ()), _job("b", ())
    assert kept.keep(a, 1, "x") == (a, 1, "x")
    assert kept.get(id(a))[0] is a and kept.get(id(b)) is None
    assert not kept.trim(in_sight=0)  # 1 entry: within 4 x 0 + 1,024
    for k in range(1025):
        kept.keep(_job(f"j{k}", ()), k)
    assert len(kept) > 1024 and kept.trim(in_sight=0) and len(kept) == 0


def test_a_noted_jobs_by_name_is_taken_for_its_own_tuple_only() -> None:
    jobs = tuple(_job(f"j{k}", ()) for k in range(5))
    noted = {"j0": jobs[0]}  # deliberately not what the tuple holds: it is taken as noted
    snapshot_module.note_live_jobs_by_name(jobs, noted)
    got = live_jobs_by_name(jobs)
    assert got == noted and got is not noted  # a copy: a pass's index is its own
    assert list(live_jobs_by_name(tuple(list(jobs)))) == [f"j{k}" for k in range(5)]  # an equal tuple is worked out


@pytest.mark.parametrize("policy", ("omni", "kill_preempt"))
def test_victim_entries_kept_between_passes_are_what_a_fresh_build_gives(
        policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # ``victim_pool`` reuses a job's entry while the job snapshot, the zone map and the config
    # stand and its minimum-run flags still hold; each pass's pool is built again from nothing
    # (no entry kept) and must be equal, entry for entry.
    from jobs.planner import victims
    from jobs.simulator import parse_scenario, simulate
    from tests.simulator.test_quiet_holds import queued_scenario

    kept_build = victims.victim_pool
    seen = {"builds": 0, "protected": 0}

    def both(state):
        if state._victims_sorted is not None:
            return kept_build(state)
        kept = list(kept_build(state))
        saved = dict(victims._VICTIM_ENTRIES)
        victims._VICTIM_ENTRIES.clear()
        state._victims_sorted = None
        fresh = kept_build(state)
        assert kept == fresh
        victims._VICTIM_ENTRIES.clear()
        victims._VICTIM_ENTRIES.update(saved)
        seen["builds"] += 1
        seen["protected"] += sum(e.protected or e.turn_protected for e in fresh)
        return fresh

    monkeypatch.setattr(victims, "victim_pool", both)
    data = queued_scenario(5, jobs_n=240, switches=4)
    for job in data["jobs"][::9]:  # lenders of idle phases: their pools come and go, and the zones with them
        job["idle_phases"] = [{"every_steps": 100, "duration_s": 1200}]
    simulate(parse_scenario(data), policy)
    assert seen["builds"] > 100 and seen["protected"] > 100, seen


def test_a_kept_victim_entry_follows_the_zones_and_the_minimum_run() -> None:
    # The same job snapshot across passes: its entry's zones follow the reservations' nodes, and
    # its minimum-run protection ends when the run has lasted min_run_s.
    from jobs.planner.config import PlannerConfig
    from jobs.planner.core import PlanningPass
    from jobs.planner.snapshot import Reservation
    from jobs.planner.victims import victim_pool
    from tests.planner.factory import cluster, gpus_on, job, snapshot

    nodes = cluster(switches=1, per_switch=2)
    victim = job("victim", priority="best_effort", gpus=gpus_on(nodes[0].name), min_run_s=600.0, run_started_s=0.0)
    pool = Reservation("pool", "owner", 8, nodes=(nodes[0].name,))
    owner = job("owner", priority="critical")
    config = PlannerConfig()

    def entry(now: float, reservations: tuple) -> object:
        [got] = victim_pool(PlanningPass(snapshot(nodes, [owner, victim], reservations), now, config))
        return got

    assert entry(100.0, (pool,)).zones == {"pool"} and entry(100.0, (pool,)).protected
    assert entry(200.0, ()).zones == {None}
    assert entry(300.0, (pool,)).zones == {"pool"}
    assert not entry(700.0, (pool,)).protected


@pytest.mark.parametrize("policy", ("omni", "kill_preempt"))
@pytest.mark.parametrize(("seed", "promote_after_s"), ((3, None), (5, None), (3, 20_000.0), (5, 20_000.0)))
def test_the_queue_kept_between_passes_decides_as_visiting_every_job(
        policy: str, seed: int, promote_after_s: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # A quiet pass reads its plain waiters from the queue kept between passes
    # (``admission._kept_quiet_queue``); replayed with every pass visiting every job instead, every
    # figure of the result must be the same. The reserved job arrives unannounced, idle phases
    # lend and a node fails and comes back (the kept queue is built again for the new nodes);
    # with promote_after_s within the day, best-effort waiters are promoted as it goes (their
    # final groups move at a known time).
    from jobs.planner import admission
    from jobs.planner.core import PlanningPass
    from jobs.simulator import parse_scenario, simulate
    from tests.simulator.test_quiet_holds import queued_scenario

    data = queued_scenario(seed, jobs_n=240, switches=4)
    data["jobs"][-1]["submit_s"] = 20_000
    for job in data["jobs"][::9]:
        job["idle_phases"] = [{"every_steps": 100, "duration_s": 1200}]
    if promote_after_s is not None:
        data["policy"] = {"promote_after_s": promote_after_s}
    calls = {"kept": 0, "grouped": 0, "ageing": 0, "promoted": 0}
    kept_queue = admission._kept_quiet_queue

    def checked(state, groups):
        # Each pass's groups and walked jobs against a grouping of every job from scratch.
        others = kept_queue(state, groups)
        fresh: dict[tuple, list] = {}
        walked = set()
        left_out = state.busy | state.acted
        for job in state.jobs.values():
            if job.phase not in admission.QUEUE_PHASES:
                continue
            entry = admission._plain_waiter(job, state.config)
            if entry is None or job.name in state.res_of_job:
                walked.add(job.name)
            elif state._fit_problems(job) or job.name in left_out:
                continue
            elif entry[0] is None:
                walked.add(job.name)
            else:
                sig = admission._group_at(entry, state.now, state.config.ageing_s, state.config.promote_after_s)
                fresh.setdefault(sig, []).append(entry[4])
                calls["ageing"] += sig[1] > 1
                calls["promoted"] += sig[7] < sig[2]
        assert {g: sorted(m) for g, m in groups.items()} == {g: sorted(m) for g, m in fresh.items()}
        assert {j.name for j in others} - left_out == walked - left_out
        calls["kept"] += 1
        calls["grouped"] += sum(map(len, groups.values()))
        return others

    monkeypatch.setattr(admission, "_kept_quiet_queue", checked)
    kept = simulate(parse_scenario(data), policy)
    monkeypatch.setattr(PlanningPass, "kept_queue", False)
    walked = simulate(parse_scenario(data), policy)
    for result in (kept, walked):
        result.pop("wall_s")
    assert calls["kept"] > 100 and calls["grouped"] > 1000 and calls["ageing"] > 100, calls
    assert (calls["promoted"] > 100) == (promote_after_s is not None), calls
    assert kept == walked


def test_the_kept_queue_leaves_out_what_a_pass_decided_already_and_ages_its_waiters() -> None:
    from jobs.planner import PlannerConfig, admission
    from jobs.planner.core import PlanningPass
    from tests.planner.factory import cluster, job, snapshot

    config = PlannerConfig(explain_holds=False, ageing_s=3600.0)
    waiters = [job(f"w{i}", "best_effort", submit_s=float(i)) for i in range(4)]
    snap = snapshot(cluster(), waiters)

    def grouped(now_s: float, acted: set[str]) -> dict[str, tuple]:
        state = PlanningPass(snap, now_s, config)
        state.acted.update(acted)
        groups: dict = {}
        assert admission._kept_quiet_queue(state, groups) == []
        return {m[1]: sig for sig, members in groups.items() for m in members}

    first = grouped(100.0, {"w1"})
    assert sorted(first) == ["w0", "w2", "w3"]  # decided already in this pass: left out
    again = grouped(100.0, set())  # the same snapshot, kept: w1 is back
    assert sorted(again) == ["w0", "w1", "w2", "w3"] and again["w0"] == first["w0"]
    # Best effort ages into regular standing after ageing_s, and stays there (its group final).
    assert grouped(3700.0, set())["w0"][1] == 1 < again["w0"][1]

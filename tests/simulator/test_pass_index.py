"""The peers' plain waiters by shape and jobs holding GPUs, kept between passes (``PassIndex``): after any sequence of
passes, what it holds is what grouping that pass's jobs from scratch gives."""

from __future__ import annotations

import random

import pytest

from jobs.planner.snapshot import WAITING_PHASES, Gpu, live_jobs_by_name
from jobs.simulator.peers.common import PassIndex
from tests.planner.factory import job

PHASES = ("pending", "preempted", "recovering", "running", "checkpointing", "completed")


def shape_of(j):
    return ("hopeless", j.priority, j.team, j.tp, j.pp, j.dp, j.dp_min, j.dp)


def from_scratch(jobs):
    """Every live job that wants GPUs: those that hold none by shape (members sorted), the others'
    names."""
    groups, holding = {}, set()
    for j in jobs.values():
        if (j.phase in WAITING_PHASES or j.phase == "recovering") and not j.parked:
            if j.holdings:
                holding.add(j.name)
            else:
                groups.setdefault(shape_of(j), []).append((j.submit_s, j.name, j))
    return {s: sorted(m) for s, m in groups.items()}, holding


def a_job(rng: random.Random, name: str):
    phase = rng.choice(PHASES)
    gpus = (Gpu("n0", rng.randrange(8)),) if phase != "pending" and rng.random() < 0.5 else ()
    return job(name, priority=rng.choice(("regular", "best_effort")), tp=1, dp=rng.choice((1, 2)),
               dp_min=1, dp_max=2, global_batch=64, phase=phase, gpus=gpus,
               parked=(Gpu("n1", 0),) if rng.random() < 0.05 else (),
               submit_s=float(rng.randrange(100)), team=rng.choice((None, "a", "b")))


@pytest.mark.parametrize("seed", range(20))
def test_kept_between_passes_it_is_what_a_fresh_grouping_gives(seed: int) -> None:
    rng = random.Random(seed)
    index = PassIndex(shape_of)
    current = {f"j{i:03d}": a_job(rng, f"j{i:03d}") for i in range(60)}
    regrouped = 0
    for _pass in range(40):
        # Between passes some jobs change (a new snapshot), arrive or are gone; most stand.
        for name in rng.sample(sorted(current), 8):
            if rng.random() < 0.3:
                del current[name]
            else:
                current[name] = a_job(rng, name)
        for _ in range(rng.randrange(5)):
            name = f"j{rng.randrange(1000):03d}"
            current[name] = a_job(rng, name)
        jobs = live_jobs_by_name(current.values())
        index.update(jobs)
        groups, holding = from_scratch(jobs)
        assert index.groups == groups
        assert index.holding == holding
        assert index.holders == {j.name for j in jobs.values() if j.holdings}
        assert {n: s for n, (s, _) in index.member.items()} == {
            m[1]: s for s, members in groups.items() for m in members}
        regrouped += len(groups)
    assert regrouped > 100  # the passes had waiters to group


def test_a_job_that_ends_leaves_its_group_and_an_empty_group_goes() -> None:
    index = PassIndex(shape_of)
    a, b = job("a", tp=1, submit_s=1.0), job("b", tp=1, submit_s=2.0)
    index.update({"a": a, "b": b})
    assert [m[1] for m in index.groups[shape_of(a)]] == ["a", "b"]
    index.update({"b": b})
    assert [m[1] for m in index.groups[shape_of(a)]] == ["b"]
    index.update({"b": job("b", tp=1, submit_s=2.0, phase="running", gpus=(Gpu("n0", 0),))})
    assert index.groups == {} and index.member == {} and index.holding == set() and index.holders == {"b"}

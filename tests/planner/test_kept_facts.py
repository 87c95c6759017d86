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

"""``admission._walk_quietly``, the queue walk of a quiet pass, against its specification: in
queue order, every job of ``others`` is admitted, and a plain waiter is admitted unless, at that
moment, no victim search is left to try for it and either more GPUs are needed than are free or
``admit``'s quick hold holds it (its own loan terms open too little), when it waits and counts its
class as held for capacity. Each admission may change what is free, what the pools open to which
loan terms and which victim searches failed, in any direction; the walk must follow."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from jobs.planner import admission
from jobs.planner.admission import TIER_OTHER
from jobs.planner.snapshot import PRIORITY_RANK


class ScriptedPass:
    """The part of a planning pass the walk reads and writes; each admission moves the free count,
    what the pools open and the failed victim searches as a seeded script says (the same in both
    walks). Like ``admit``, an admission first holds a plain waiter its own quick hold holds
    (``_held``): that changes nothing but the class held for capacity."""

    takes_victims = True

    def __init__(self, seed: int, sigs: list[tuple], members: dict[str, tuple]) -> None:
        self.seed = seed
        self.sigs = sigs
        self.members = members  # a plain waiter's (group, shortest loan, fits the grace)
        rng = random.Random(seed)
        self.free: float = rng.randrange(0, 12)
        self.room = self._room(rng)
        self.victim_failed_at: dict[tuple, int] = {}
        self.capacity_blocked_rank = 99
        self.admitted: list[str] = []

    @staticmethod
    def _room(rng: random.Random) -> tuple[float, bool, int]:
        # What the pools open: loans at least this short, whether to one that fits the grace, and
        # how many GPUs then (the rest is free for anyone, none of it for such a job).
        return rng.choice((0.0, 300.0, 600.0, 1200.0)), rng.random() < 0.5, rng.randrange(0, 12)

    def _free_for_anyone(self) -> float:
        return self.free

    def _group_blocked(self, sig: tuple, window_s: float, fits_grace: bool, finish_s: float = math.inf) -> bool:
        longest, to_grace, gpus = self.room
        # A member that would finish in the pools' windows may borrow them too (``window_taken``).
        return sig[0] > (gpus if window_s <= longest or (fits_grace and to_grace) or finish_s <= longest else 0)

    def _held(self, job: str) -> bool:
        hit = self.members.get(job)
        return hit is not None and _hopeless(self, hit[0]) and self._group_blocked(*hit)

    def _admit(self, job: str) -> None:
        if self._held(job):
            self.capacity_blocked_rank = min(self.capacity_blocked_rank, self.members[job][0][7])
            return
        self.admitted.append(job)
        rng = random.Random(f"{self.seed}:{job}")
        move = rng.random()
        if move < 0.15:
            self.free = math.inf  # a victim's GPUs are on their way back
        elif move < 0.45:
            self.free = rng.randrange(0, 12)  # up or down
            self.room = self._room(rng)
        elif move < 0.75 and self.sigs:
            need, standing, rank, aged = rng.choice(self.sigs)[:4]
            key = (rank, standing, False, aged)
            self.victim_failed_at[key] = min(self.victim_failed_at.get(key, 1 << 30), rng.choice((1, 2, 4, 8)))


def _hopeless(state: ScriptedPass, sig: tuple) -> bool:
    need, standing, rank, aged = sig[:4]
    return (standing >= PRIORITY_RANK["best_effort"]
            or state.victim_failed_at.get((rank, standing, False, aged), 1 << 30) <= need)


def _shut(state: ScriptedPass, sig: tuple) -> bool:
    """Whether ``_waits_quietly`` holds a job of group ``sig`` (the quick hold is ``_held``'s)."""
    return sig[0] > state._free_for_anyone() and _hopeless(state, sig)


def _queue(seed: int) -> tuple[list[tuple[tuple, str]], dict[tuple, list[tuple]]]:
    rng = random.Random(seed)
    others = sorted(((rng.choice((0, 2, TIER_OTHER)), rng.choice((1, 2)), rng.choice((1, 2)), float(rng.randrange(50)),
                      f"o{i}"), f"o{i}") for i in range(rng.randrange(0, 6)))
    groups: dict[tuple, list[tuple]] = {}
    for i in range(rng.randrange(0, 60)):
        rank = rng.choice((1, 2))
        short = rng.choice((None, 3, 6))  # finish_bucket: a band's terms move along the walk
        standing = rng.choice((1, rank))
        # A best-effort job that has aged may be promoted: the queue puts it in the regular class
        queue_class = 1 if standing == 1 else rank
        if rank == 2 and standing == 1:
            queue_class = rng.choice((1, 2))
        sig = (rng.choice((1, 2, 4, 8, 16)), standing, rank, rank == 1 and rng.random() < 0.3, 1, 1, short, queue_class)
        groups.setdefault(sig, []).append((float(rng.randrange(50)), f"p{i}", rng.choice((200.0, 500.0, 900.0)),
                                           rng.random() < 0.3, rng.choice((300.0, 3000.0)) if short is not None else math.inf,
                                           f"p{i}"))
    return others, groups


def _scripted(seed: int, groups: dict) -> ScriptedPass:
    return ScriptedPass(seed, list(groups), {m[-1]: (sig, m[2], m[3], m[4]) for sig, ms in groups.items() for m in ms})


def _reference(state: ScriptedPass, others: list, groups: dict) -> None:
    walk = sorted([(key, job, None) for key, job in others]
                  + [((TIER_OTHER, sig[1], sig[7], since, name), job, sig)
                     for sig, members in groups.items() for since, name, _, _, _, job in members])
    for _, job, sig in walk:
        if sig is not None and (_shut(state, sig) or state._held(job)):
            state.capacity_blocked_rank = min(state.capacity_blocked_rank, sig[7])
            continue
        state._admit(job)


@pytest.mark.parametrize("seed", range(300))
def test_the_walk_by_groups_admits_and_holds_as_the_walk_job_by_job(seed: int) -> None:
    others, groups = _queue(seed)
    expected = _scripted(seed, groups)
    _reference(expected, others, {sig: list(m) for sig, m in groups.items()})
    walked = _scripted(seed, groups)
    admission._walk_quietly(walked, others, {sig: list(m) for sig, m in groups.items()})
    assert walked.admitted == expected.admitted
    assert walked.capacity_blocked_rank == expected.capacity_blocked_rank
    assert walked.victim_failed_at == expected.victim_failed_at


def test_the_script_reopens_shut_groups_behind_the_walk() -> None:
    # The cases the walk's catching up is for: a group shut while the walk passed some of its
    # jobs, then open again (GPUs on their way back) with jobs still ahead.
    reopened = 0
    for seed in range(300):
        others, groups = _queue(seed)
        state = _scripted(seed, groups)
        shut_seen: set[tuple] = set()
        walk = sorted([(key, job, None) for key, job in others]
                      + [((TIER_OTHER, s[1], s[7], since, name), job, s)
                         for s, m in groups.items() for since, name, _, _, _, job in m])
        for _, job, sig in walk:
            if sig is not None and _shut(state, sig):
                shut_seen.add(sig)
                continue
            if sig in shut_seen:
                reopened += 1
                shut_seen.discard(sig)
            state._admit(job)
    assert reopened >= 30, reopened


def test_the_script_shuts_whole_groups_by_their_loosest_loan_terms() -> None:
    # The cases ``group_blocked`` is for: GPUs free for anyone, none that the group's members may
    # borrow; and groups where some members may borrow and others not (open: each admission
    # holds its own).
    shut, mixed = 0, 0
    for seed in range(300):
        _, groups = _queue(seed)
        state = _scripted(seed, groups)
        for sig, members in groups.items():
            if not _hopeless(state, sig) or _shut(state, sig):
                continue
            held = [state._held(m[-1]) for m in members]
            loosest = (min(m[2] for m in members), any(m[3] for m in members), min(m[4] for m in members))
            assert state._group_blocked(sig, *loosest) == all(held), (seed, sig)
            shut += all(held)
            mixed += any(held) and not all(held)
    assert shut >= 50 and mixed >= 10, (shut, mixed)


def test_a_plain_waiter_is_grouped_by_its_smallest_size_its_standing_its_class_and_a_long_wait() -> None:
    # Everything ``_waits_quietly`` reads of a job without teams, and nothing else: two jobs in
    # one group are told apart by nothing but their place in the queue.
    from jobs.planner.config import PlannerConfig
    from jobs.planner.core import PlanningPass
    from tests.planner.factory import cluster, job, snapshot

    config = PlannerConfig(ageing_s=1000.0, explain_holds=False)
    jobs = [
        job("fresh", tp=2, dp=4, dp_min=2, dp_max=4, submit_s=4_500.0),
        job("long", tp=2, dp=4, dp_min=2, dp_max=4, submit_s=3_000.0),  # waited 2,000 s >= ageing_s
        job("be-old", priority="best_effort", tp=1, dp=2, dp_min=1, dp_max=2, submit_s=0.0),  # aged up a class
        job("be-new", priority="best_effort", tp=1, dp=2, dp_min=1, dp_max=2, submit_s=4_900.0),
    ]
    state = PlanningPass(snapshot(cluster(), jobs), 5_000.0, config)
    groups = {j.name: admission._quiet_group(state, state.jobs[j.name]) for j in jobs}
    assert groups == {"fresh": (4, 1, 1, False, 2, 1, None, 1), "long": (4, 1, 1, True, 2, 1, None, 1),
                      "be-old": (1, 1, 2, False, 1, 1, None, 2), "be-new": (1, 2, 2, False, 1, 1, None, 2)}
    # Waited promote_after_s, a best-effort job queues in the regular class (its own group)
    promoted = PlanningPass(snapshot(cluster(), jobs), 5_000.0, replace(config, promote_after_s=4_000.0))
    assert admission._quiet_group(promoted, promoted.jobs["be-old"]) == (1, 1, 2, False, 1, 1, None, 1)
    assert admission._quiet_group(promoted, promoted.jobs["be-new"]) == (1, 2, 2, False, 1, 1, None, 2)
    # A job that could finish inside a window shorter than min_run_s is in a group by its band
    short = job("short", tp=2, dp=4, dp_min=2, dp_max=4, submit_s=4_500.0, total_steps=100)
    assert admission._quiet_group(PlanningPass(snapshot(cluster(), [short]), 5_000.0, config),
                                  short) == (4, 1, 1, False, 2, 1, 3, 1)  # finishes in 376.5 s: (240, 480]
    assert admission._quiet_groups(state) == {}
    assert admission._quiet_groups(PlanningPass(snapshot(cluster(), jobs), 5_000.0, PlannerConfig())) is None


def test_a_plain_waiters_group_at_any_instant_is_its_standing_long_wait_and_class_as_starvation_says() -> None:
    # ``_group_at`` works out a group from what ``_plain_waiter`` kept of the job: at every instant
    # (either side of each ageing step and of its promotion, before it was queued, with ageing or
    # promotion off) it must give ``starvation.effective_rank``, ``is_aged`` and ``class_rank``;
    # and once ``_group_final_until`` says until when a group stays, it stays that group until
    # then, and a best-effort job is promoted then (not a moment before or after).
    from jobs.planner.config import PlannerConfig
    from jobs.planner.starvation import class_rank, effective_rank, is_aged
    from tests.planner.factory import job

    rng = random.Random(7)
    checked = promotions = 0
    for ageing_s, promote_s, submit_s in ((0.0, 0.0, 1000.0), (600.0, 3000.0, 1000.0), (7200.0, 0.0, 1000.0),
                                          (1234.5, 20_000.0, 1000.0), (600.0, 172_800.0, 0.1 + 0.2)):
        config = PlannerConfig(ageing_s=ageing_s, promote_after_s=promote_s)
        for priority in ("regular", "best_effort"):
            j = job("w", priority=priority, tp=2, dp=4, dp_min=2, dp_max=4, submit_s=submit_s)
            entry = admission._plain_waiter(j, config)
            assert entry is not None and entry[0] == 4
            edges = [submit_s + k * ageing_s + d for k in range(4) for d in (-1e-7, 0.0, 1e-7)]
            edges += [submit_s + promote_s + d for d in (-1e-7, 0.0, 1e-7)]
            final: tuple | None = None  # (group, until)
            for now in sorted(edges + [rng.uniform(0.0, 200_000.0) for _ in range(200)]):
                want = (4, effective_rank(j, now, config), PRIORITY_RANK[priority],
                        priority == "regular" and is_aged(j, now, config), 2, 1, None, class_rank(j, now, config))
                got = admission._group_at(entry, now, ageing_s, promote_s)
                assert got == want, (ageing_s, priority, now)
                if final is not None and now < final[1]:
                    assert got == final[0], (ageing_s, promote_s, priority, now)
                elif final is not None:
                    assert got[7] == 1 and final[0][7] == 2, (ageing_s, promote_s, now)  # promoted then
                until = admission._group_final_until(got, entry, ageing_s, promote_s)
                if until is not None and (final is None or now >= final[1]):
                    promotions += final is not None
                    final = (got, until)
                    if until < math.inf:
                        assert class_rank(j, until, config) == 1 and class_rank(j, math.nextafter(until, 0.0), config) == 2
                checked += 1
            assert final is not None, (ageing_s, promote_s, priority)
    assert checked == 10 * 215 and promotions == 3
    held = job("h", priority="critical", tp=2, dp=4, dp_min=2, dp_max=4)
    assert admission._plain_waiter(held, PlannerConfig()) is None

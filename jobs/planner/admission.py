"""Rules 4-8 at the queue: admit each waiting job, in queue order, or hold it saying why.

Queue order is *entitled owners, fault recovery, other critical, then everyone else by aged
class, class, wait* (``queue_tier`` and ``starvation.queue_key``). Each job is placed on free
GPUs at its preferred size (an entitled job in its own pool first; others may use lendable
reserved GPUs), else continues on the survivors of a fault, else waits for GPUs already on
their way back, else (critical and recovering work at its preferred size; others first at a
smaller batch-exact size on what is free) takes GPUs from cheaper victims, else gets a
``hold`` with the reason. Cheap upper bounds hold the tail of a long queue without a search.
A job that can never fit the cluster (it shrank under it) is held first, saying so.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from jobs.planner import quota
from jobs.planner.config import PlannerConfig
from jobs.planner.decisions import Action, Reason
from jobs.planner.entitlements import is_active, next_start_s
from jobs.planner.faults import continue_on_survivors, surviving_replicas
from jobs.planner.harvest import (
    finish_window_s,
    loan_notes,
    may_borrow_unannounced,
    open_pools,
    refused_loan_notes,
    window_taken,
)
from jobs.planner.kept import KeptById, KeptByName
from jobs.planner.layout import accum_steps, valid_dps
from jobs.planner.queue_walk import walk_by_groups
from jobs.planner.rhythm import min_loan_window_s, reclaim_lead_time
from jobs.planner.snapshot import PRIORITY_RANK, WAITING_PHASES, Gpu, Job
from jobs.planner.starvation import (
    class_rank,
    effective_rank,
    is_aged,
    promoted,
    queue_key,
    queue_order_s,
    waited_s,
    waiting_since_s,
)
from jobs.planner.topology import spread_of
from jobs.planner.wording import (
    agree,
    duration_words,
    gpu_shape,
    gpus_are,
    join_words,
    low_disk_words,
    plural,
    replica_count,
    returning_sentence,
    upper_first,
)

if TYPE_CHECKING:
    from jobs.planner.core import PlanningPass

INFINITY = math.inf
LOST_HEALTH = frozenset({"failed"})
# The phases of the jobs the queue decides (``in_queue``), while no node is lost.
QUEUE_PHASES = WAITING_PHASES | {"recovering"}

# Queue tiers: lower goes first.
TIER_ENTITLED = 0
TIER_RECOVERING = 1
TIER_CRITICAL = 2
TIER_OTHER = 3
REGULAR, BEST_EFFORT = PRIORITY_RANK["regular"], PRIORITY_RANK["best_effort"]
# A quiet pass's groups of plain waiters (``_walk_quietly``): (GPUs at the smallest size, queue
# standing, class, long waiter, tp, pp, the band of the window it would finish in if shorter than
# ``min_run_s``, else None: ``finish_bucket``; ``harvest.window_taken`` asks that of no one
# else; the class the queue puts it in, ``starvation.class_rank``), and each member as (waiting since, name, its shortest
# worthwhile loan at its smallest size (``min_loan_window_s``), whether it can stop within the
# grace or be stopped unsaved, so may borrow a pool whose need may come at any moment
# (``harvest.may_borrow_unannounced``), the window it would finish in at its smallest size
# (``harvest.finish_window_s``), job).
Group = tuple[int, int, int, bool, int, int, int | None, int]
Waiter = tuple[float, str, float, bool, float, Job]
# What ``_quiet_group`` reads of a plain waiter itself: (GPUs at its smallest size or None, class
# rank, regular, waiting since, its member of a group, tp, pp, ``finish_bucket``).
PlainWaiter = tuple[int | None, int, bool, float, Waiter, int, int, int | None]
#: (job, config, ``_plain_waiter(job, config)``, ``_WaiterMemo``) per job snapshot, for every pass
#: that walks by groups.
_PLAIN_WAITERS = KeptById()


class _WaiterMemo:
    """What quiet passes learn of a plain waiter's snapshot as they go: its group once it can
    change no more until a known time (its standing and long wait can change no more, and its
    promotion comes then if at all: each only moves one way as time goes on, ``_group_at``,
    ``_group_final_until``), from when and until when, and whether it can never fit the nodes it
    was last fitted to (``_fit_problems``, kept while the snapshot's nodes tuple stands)."""

    __slots__ = ("final_group", "final_from", "final_until", "fitted_to", "unfit")

    def __init__(self) -> None:
        self.final_group: Group | None = None
        self.final_from = INFINITY
        self.final_until = INFINITY
        self.fitted_to: tuple | None = None
        self.unfit = False


# The hold cause of a job that can never run on this cluster as it is (pages show it no ETA).
CANNOT_FIT = "cannot_fit"


def queue_tier(state: PlanningPass, job: Job) -> int:
    """Which tier of the queue ``job`` waits in (``TIER_*``, lower goes first)."""
    if state._entitled_now(job):
        return TIER_ENTITLED
    if job.phase == "recovering":
        return TIER_RECOVERING
    if job.priority == "critical":
        return TIER_CRITICAL
    return TIER_OTHER


def lost_nodes(state: PlanningPass) -> set[str]:
    """Nodes whose GPUs are lost to the jobs on them (failed)."""
    return {n for n, node in state.nodes.items() if node.health in LOST_HEALTH}


def in_queue(state: PlanningPass, job: Job, lost: set[str]) -> bool:
    """Whether ``job`` is the queue's to decide in this pass: nothing in flight or decided for it
    yet, and waiting, recovering, or holding GPUs on a node in ``lost`` (or one that is gone)."""
    if job.name in state.busy or job.name in state.acted:
        return False
    if job.phase in WAITING_PHASES or job.phase == "recovering":
        return True
    return bool(job.holdings) and bool(lost) and any(
        h.gpu.node in lost or h.gpu.node not in state.nodes for h in job.holdings)


class _QuietQueue(KeptByName):
    """A quiet pass's queue kept from one pass to the next (``_kept_quiet_queue``).

    Its plain waiters (``_plain_waiter``, with a smallest size, fitting the nodes) by group once
    their group is final (their standing and long wait can change no more), the others still
    ageing, and the names of the other jobs of the queue's phases. What a job is here reads only
    its snapshot, the config and the nodes: it changes where a job's snapshot does
    (``KeptByName``), and the whole queue is built again for another config or nodes tuple.
    """

    def __init__(self, state: PlanningPass) -> None:
        super().__init__()
        self.state = state
        self.config = state.config
        self.nodes = state.snapshot.nodes
        self.final: dict[Group, dict[str, Waiter]] = {}  # group -> its members by name
        self.final_sig: dict[str, Group] = {}
        self.ageing: dict[str, PlainWaiter] = {}  # plain waiters whose group may still change
        # Final groups that change once more at a known time (a best-effort job's promotion):
        # (then, count, name, its entry) by time, and the entry each such name is due with.
        self.pending: list[tuple[float, int, str, PlainWaiter]] = []
        self.pending_entry: dict[str, PlainWaiter] = {}
        self.others: set[str] = set()  # the queue's other jobs: walked one by one

    def add(self, job: Job) -> None:
        if job.phase not in QUEUE_PHASES:
            return
        entry = _plain_waiter(job, self.config)
        name = job.name
        if entry is None or entry[0] is None:
            self.others.add(name)
        elif not self.state._fit_problems(job):  # one that can never fit is left out
            self.ageing[name] = entry

    def drop(self, name: str) -> None:
        self.others.discard(name)
        self.ageing.pop(name, None)
        self.pending_entry.pop(name, None)
        sig = self.final_sig.pop(name, None)
        if sig is not None:
            members = self.final[sig]
            del members[name]
            if not members:
                del self.final[sig]


_QUIET_QUEUE = threading.local()


def _kept_quiet_queue(state: PlanningPass, groups: dict[Group, list[Waiter]]) -> list[Job]:
    """Fill ``groups`` with this pass's plain waiters from the queue kept between passes, and
    return the queue's other jobs (in name order) for the walk job by job.

    It decides what ``admit_waiting``'s loop over every job decides (``test_kept_facts.py``
    compares the two, pass by pass and over whole replays): a plain waiter with a stop in
    flight, already decided in this pass, or that can never fit is left out; one with a
    reservation is walked job by job.
    """
    q = getattr(_QUIET_QUEUE, "queue", None)
    if q is None or q.config is not state.config or q.nodes is not state.snapshot.nodes:
        q = _QUIET_QUEUE.queue = _QuietQueue(state)
    q.state = state
    q.update(state.jobs)
    now, ageing_s, promote_s = state.now, state.config.ageing_s, state.config.promote_after_s
    final, final_sig = q.final, q.final_sig
    pending, due = q.pending, q.pending_entry
    # Final groups whose one change (a promotion) has come: each moves to its new group.
    while pending and pending[0][0] <= now:
        _, _, name, entry = heapq.heappop(pending)
        if due.get(name) is not entry:
            continue  # dropped (or queued again with another entry) since
        del due[name]
        old = final_sig[name]
        members = final[old]
        del members[name]
        if not members:
            del final[old]
        q.ageing[name] = entry  # placed again below
    for name, entry in list(q.ageing.items()):
        sig = _group_at(entry, now, ageing_s, promote_s)
        until = _group_final_until(sig, entry, ageing_s, promote_s)
        if until is not None:
            del q.ageing[name]  # its standing and long wait can change no more, its class not before ``until``
            final_sig[name] = sig
            if (members := final.get(sig)) is None:
                final[sig] = {name: entry[4]}
            else:
                members[name] = entry[4]
            if until < INFINITY:
                due[name] = entry
                heapq.heappush(pending, (until, len(pending), name, entry))
    for sig, members in final.items():
        groups[sig] = list(members.values())
    left_out = state.busy | state.acted
    walked = [n for n in state.res_of_job if n in final_sig or n in q.ageing]
    for name in left_out.union(walked) if walked else left_out:
        sig = final_sig.get(name)
        if sig is not None:
            groups[sig].remove(final[sig][name])
            if not groups[sig]:
                del groups[sig]
    for name, entry in q.ageing.items():
        if name in left_out or name in state.res_of_job:
            continue
        sig = _group_at(entry, now, ageing_s, promote_s)
        if (members := groups.get(sig)) is None:
            groups[sig] = [entry[4]]
        else:
            members.append(entry[4])
    jobs = state.jobs
    return [jobs[n] for n in sorted(q.others.union(walked) if walked else q.others)]


def admit_waiting(state: PlanningPass) -> None:
    """Hold jobs in an idle phase or between windows; admit the others in queue order."""
    waiting: list[tuple[tuple, int, tuple, Job]] = []  # (key, arrival, queue_key, job)
    lost = lost_nodes(state)
    groups = _quiet_groups(state)
    if groups is not None:
        _PLAIN_WAITERS.trim(len(state.jobs))
    now, config, reserving = state.now, state.config, state.res_of_job
    ageing_s, promote_s = config.ageing_s, config.promote_after_s
    busy, acted, nodes = state.busy, state.acted, state.snapshot.nodes
    settled = not lost  # then only waiting and recovering jobs can be the queue's (``in_queue``)
    jobs: Iterable[Job] = state.jobs.values()
    if groups is not None and settled and state.kept_queue:
        # The plain waiters come grouped from the queue kept between passes; only the other
        # jobs of the queue's phases are walked one by one below.
        jobs = _kept_quiet_queue(state, groups)
    for job in jobs:
        if settled and job.phase not in QUEUE_PHASES:
            continue
        # A plain waiter takes the short way to its group: what ``in_queue`` and the holds below
        # would ask of it comes down to these two tests (this loop visits every waiting job of
        # every pass; through ``in_queue``, ``queue_key`` and the holds, kill_preempt's week
        # replays 13% slower).
        if groups is not None:
            hit = _PLAIN_WAITERS.get(id(job))
            if hit is None or hit[0] is not job or hit[1] is not config:
                hit = _PLAIN_WAITERS.keep(job, config, _plain_waiter(job, config), _WaiterMemo())
            entry = hit[2]
            if entry is not None and job.name not in reserving:
                memo = hit[3]
                if memo.fitted_to is not nodes:
                    memo.fitted_to, memo.unfit = nodes, bool(state._fit_problems(job))
                if memo.unfit or job.name in busy or job.name in acted:
                    continue  # not the queue's to decide, or can never fit (a hold says nothing here)
                if entry[0] is not None:
                    if memo.final_from <= now < memo.final_until:
                        sig = memo.final_group
                    else:
                        sig = _group_at(entry, now, ageing_s, promote_s)
                        until = _group_final_until(sig, entry, ageing_s, promote_s)
                        if until is not None:  # it can change no more before ``until``
                            memo.final_group, memo.final_from, memo.final_until = sig, now, until
                    if (members := groups.get(sig)) is None:
                        groups[sig] = [entry[4]]
                    else:
                        members.append(entry[4])
                    continue
        if not in_queue(state, job, lost):
            continue
        if job.parked and job.idle_until_s is not None and job.idle_until_s > state.now:
            state._hold(job, "idle_phase",
                        f"Its idle phase (evaluation or data loading) lasts until {state._when(job.idle_until_s)}; "
                        f"its {gpus_are(len(job.parked), 'lent')} to other jobs meanwhile and come back by then.",
                        idle_until_s=job.idle_until_s, gpus_lent=len(job.parked))
            continue
        if not job.holdings and not job.parked and hold_if_cannot_fit(state, job):
            continue
        dormant = state._dormant_between_windows(job)
        if dormant is not None and not job.holdings:
            t = next_start_s(dormant, state.now)
            state._hold(job, "between_windows",
                        f"Runs only inside the windows of its reservation '{dormant.name}'; the next "
                        f"one opens at {state._when(t)}.",
                        reservation=dormant.name, next_start_s=None if t == INFINITY else t)
            continue
        base = queue_key(job, state.now, state.config, state._tier(job))
        waiting.append((_team_key(state, job, base) if state.teams else base, len(waiting), base, job))
    if state.teams:  # who would reclaim what a job of another team starts with beyond its quota
        state.quota_waiters = sorted(
            (PRIORITY_RANK[job.priority], job.team, job.dp_min * job.tp * job.pp, job.name)
            for _, _, _, job in waiting if job.team is not None and not job.holdings)
    # With teams a team's standing changes as its jobs start: one that reaches its quota in the
    # pass makes its next jobs borrowers, which go behind the work still within its quota (rule
    # 9), not ahead of it where the first ordering put them (a job placed in a pass is no victim
    # in it). Without teams the keys never change and this is a plain sorted walk.
    if state.teams:
        heapq.heapify(waiting)
        pops = _pop_current(state, waiting)
    else:
        waiting.sort()
        if groups is not None:
            _walk_quietly(state, [(key, job) for key, _, _, job in waiting], groups)
            return
        pops = ((key, job) for key, _, _, job in waiting)
    free = None  # ``free_for_anyone``, until an admission changes it
    for key, job in pops:
        if not state.explain:
            if free is None:
                free = state._free_for_anyone()
            if _waits_quietly(state, key, job, free):
                continue
        state._admit(job)
        free = None


def _quiet_groups(state: PlanningPass) -> dict[Group, list[Waiter]] | None:
    """Where a pass walks its plain waiters by group (``_walk_quietly``), the empty groups to
    fill: in a quiet pass without teams, with the queue's own tiers. Else None."""
    return {} if not state.explain and not state.teams and type(state)._tier is queue_tier else None


def _plain_waiter(job: Job, config: PlannerConfig) -> PlainWaiter | None:
    """What a quiet pass reads of a plain waiter (``_quiet_group``), or None for a job that is
    not one by itself: one that holds or lends GPUs, is not waiting, or is critical."""
    if job.holdings or job.parked or job.phase not in WAITING_PHASES or job.priority == "critical":
        return None
    sizes = valid_dps(job)
    since = waiting_since_s(job)
    window_s = min_loan_window_s(job, sizes[0], config) if sizes else INFINITY
    finish_s = finish_window_s(job, sizes[0], config) if sizes else INFINITY
    return (sizes[0] * job.tp * job.pp if sizes else None, PRIORITY_RANK[job.priority],
            job.priority == "regular", since,
            (queue_order_s(job, since, config), job.name, window_s, may_borrow_unannounced(job, config), finish_s,
             job),
            job.tp, job.pp, finish_bucket(finish_s, config))


def finish_bucket(finish_s: float, config: PlannerConfig) -> int | None:
    """Which of a group's bands a plain waiter's ``harvest.finish_window_s`` falls in: None at
    ``min_run_s`` or more (it finishes in no window the share rule applies to), else k with
    ``finish_s`` in (60 x 2^(k-1), 60 x 2^k] s. Jobs of one band finish within a factor of two of
    each other, so a group is seldom open for one finisher while its other members are held."""
    if finish_s >= config.min_run_s:
        return None
    return max(0, math.ceil(math.log2(max(finish_s, 1.0) / 60.0)))


def _group_at(entry: PlainWaiter, now_s: float, ageing_s: float, promote_after_s: float) -> Group:
    """A plain waiter's group at ``now_s``: its standing is ``starvation.effective_rank`` (its
    class is never critical), it is a long waiter as ``starvation.is_aged`` says, and the queue
    puts it in the class ``starvation.class_rank`` says."""
    need, rank, regular, since, _, tp, pp, band = entry
    waited = now_s - since
    if waited < 0.0:
        waited = 0.0
    standing = max(1, rank - int(waited // ageing_s)) if ageing_s > 0 else rank
    queue_class = rank
    if rank == BEST_EFFORT and promote_after_s > 0 and waited >= promote_after_s:
        queue_class = REGULAR
    return (need, standing, rank, regular and waited >= ageing_s, tp, pp, band, queue_class)


def _group_final_until(sig: Group, entry: PlainWaiter, ageing_s: float, promote_after_s: float) -> float | None:
    """Until when a plain waiter's group ``sig`` stays as it is: None while its standing may
    still rise (it is not regular and ageing is on) or a regular job is not yet a long waiter;
    else infinity, or for a best-effort job not yet promoted the instant it is (``promoted``:
    the first ``now`` with ``now - since >= promote_after_s``). Each only moves one way."""
    if not ((sig[1] == REGULAR or ageing_s <= 0) and (sig[3] or not entry[2])):
        return None
    if entry[1] != BEST_EFFORT or promote_after_s <= 0 or sig[7] == REGULAR:
        return INFINITY
    since = entry[3]
    at = since + promote_after_s
    while at - since < promote_after_s:  # the sum may round below the instant
        at = math.nextafter(at, INFINITY)
    return at


def _quiet_group(state: PlanningPass, job: Job) -> Group | None:
    """A plain waiter's group for ``_walk_quietly``: (GPUs at its smallest size, queue standing,
    class, long waiter, tp, pp, ``finish_bucket``), everything
    ``_waits_quietly`` reads of it without teams and the shape ``admit``'s quick hold reads (its
    loan terms go with each member; a job that could not finish in such a window is refused the
    windows ``harvest.window_taken`` keeps from small borrowers whatever its run, so its group
    is shut by them as a whole); None for a job
    that is not a plain waiter (waiting for its first GPUs, or again after a stop, not critical,
    reserving and lending nothing; its queue tier is ``TIER_OTHER``) or has no valid size
    (``admit`` decides it)."""
    entry = _plain_waiter(job, state.config)
    if entry is None or entry[0] is None or job.name in state.res_of_job:
        return None
    return _group_at(entry, state.now, state.config.ageing_s, state.config.promote_after_s)


def _walk_quietly(state: PlanningPass, others: list[tuple[tuple, Job]], groups: dict[Group, list[Waiter]]) -> None:
    """The queue walk of a quiet pass without teams, by groups (``queue_walk``), deciding as the
    walk job by job with ``_waits_quietly`` would.

    Plain waiters (``_plain``) come in ``groups`` of jobs ``_waits_quietly`` tells apart by
    nothing (``_quiet_group``). A group is shut while more GPUs than are free for anyone would be
    needed at its smallest size and no victim search is left to try for its standing (best effort,
    or one failed for as many GPUs in this pass). It is shut too, with no victim search left to
    try, while ``admit``'s quick hold would hold even the member that may borrow the most
    (``group_blocked``): free GPUs in pools that none of its jobs may borrow, or too scattered
    for its ``tp``, count for anyone but not for them. Jobs of a shut group that the walk passes
    wait; like ``admit``'s holds for capacity, each counts its class as held for capacity.
    """
    best_effort = PRIORITY_RANK["best_effort"]
    # Per group, its members' loosest loan terms from each member on (the walk's sorted order):
    # a group is shut by the terms of the jobs still ahead of the walk.
    terms: dict[Group, list[tuple[float, bool, float]]] = {}

    def terms_from(sig: Group, at: int) -> tuple[float, bool, float]:
        suffix = terms.get(sig)
        if suffix is None:
            suffix, loosest = [], (INFINITY, False, INFINITY)
            for m in reversed(groups[sig]):
                loosest = (min(loosest[0], m[2]), loosest[1] or m[3], min(loosest[2], m[4]))
                suffix.append(loosest)
            suffix.reverse()
            terms[sig] = suffix
        return suffix[at] if at < len(suffix) else (INFINITY, False, INFINITY)

    def shut_now() -> Callable[[Group, Callable[[], int]], bool]:
        free = state._free_for_anyone()
        failed = state.victim_failed_at
        victims = state.takes_victims
        blocked: dict[tuple[Group, int], bool] = {}

        def shut(sig: Group, at: Callable[[], int]) -> bool:
            need, standing, rank, aged = sig[:4]
            hopeless = standing >= best_effort or failed.get((rank, standing, False, aged), 1 << 30) <= need
            if need > free and (hopeless or not victims):
                return True
            if not hopeless:
                return False
            # Only a group that may hold a job finishing in a short window (``window_taken``) has
            # terms that change along the walk; any other's are its first member's on.
            i = at() if sig[6] is not None else 0
            hit = blocked.get((sig, i))
            if hit is None:
                hit = blocked[(sig, i)] = state._group_blocked(sig, *terms_from(sig, i))
            return hit
        return shut

    def passed(sig: Group) -> None:
        state.capacity_blocked_rank = sig[7]

    # A member's queue key is ``starvation.queue_key``'s, put together from its group and its
    # (waiting since, name).
    walk_by_groups(others, groups, lambda sig, m: (TIER_OTHER, sig[1], sig[7], m[0], m[1]), shut_now,
                   state._admit, passed, heeds=lambda sig: sig[7] < state.capacity_blocked_rank, head_aware=True)


def _pop_current(state: PlanningPass, heap: list[tuple[tuple, int, tuple, Job]]) -> Iterator[tuple[tuple, Job]]:
    """(key, job) from ``heap`` in order of each job's standing now: one whose key has grown since
    it was pushed goes back in with the new key."""
    while heap:
        key, i, base, job = heapq.heappop(heap)
        if (now_key := _team_key(state, job, base)) > key:
            heapq.heappush(heap, (now_key, i, base, job))
            continue
        yield now_key, job


def _waits_quietly(state: PlanningPass, key: tuple, job: Job, free: float) -> bool:
    """With no hold to word: whether ``admit`` would hold ``job`` (queue key ``key``) at once, and
    then it just waits. That is a job holding, lent and reserving nothing, neither recovering nor
    critical, with no quota to reclaim for, and either at its team's borrowing limit or needing
    more than ``free`` (``free_for_anyone``) at its smallest size with no victims to take from
    (best effort, or a search for as many already failed in this pass). Like ``admit``'s hold
    for capacity, it counts its class as held for capacity."""
    if (key[0] != TIER_OTHER or job.holdings or job.parked or job.phase not in WAITING_PHASES
            or job.name in state.res_of_job):
        return False
    sizes = valid_dps(job)  # ascending: ``admit`` tries the smallest last
    if not sizes:
        return False
    need = sizes[0] * job.tp * job.pp
    if state.teams:
        if quota.may_reclaim(state, job, need):
            return False
        if job.team is not None and need > quota.size_cap(state, job):
            return True  # held at its team's borrowing limit, whatever is free
    if need <= free:
        return False
    rank = queue_standing(state, key)
    if rank < PRIORITY_RANK["best_effort"] and state.takes_victims:
        aged = job.priority == "regular" and quota.ages(state, job) and is_aged(job, state.now, state.config)
        if state.victim_failed_at.get(quota.failure_key(state, job, rank, False, aged), 1 << 30) > need:
            return False
    state.capacity_blocked_rank = min(state.capacity_blocked_rank, class_rank(job, state.now, state.config))
    return True


def free_for_anyone(state: PlanningPass) -> float:
    """At most how many GPUs a job with no reservation of its own could use now: every zone's free
    GPUs, or infinity while some are on their way back where it may use them (general capacity,
    or a pool with free GPUs left: ``harvest.zones_open_to`` offers no other)."""
    totals = state.view.zone_total
    if any(n and (z is None or totals.get(z, 0) > 0) for z, n in state.soon_free.items()):
        return INFINITY
    return sum(totals.values())


def group_blocked(state: PlanningPass, sig: Group, window_s: float, unannounced_ok: bool,
                  finish_s: float = INFINITY) -> bool:
    """Whether ``admit``'s quick hold (its first test, or the one on the zones a job may use)
    would hold every plain waiter of group ``sig`` now: it does for the member that may borrow
    the most, whose shortest worthwhile loan is ``window_s``, which may borrow a pool whose
    need may come at any moment if ``unannounced_ok``, and which would finish in a window of
    ``finish_s`` (``harvest.open_pools``, ``harvest.window_taken``: a shorter loan, being allowed
    such pools, or a shorter run, never opens fewer GPUs), so it does for each."""
    need, tp, pp, config = sig[0], sig[4], sig[5], state.config
    zones = open_pools(state, {None: None}, lambda: window_s, lambda: unannounced_ok,
                       lambda pool, window: window_taken(need, finish_s, pool, window, config))
    return blocked_in(state, zones, tp, pp, need // (tp * pp))[0]


def blocked_in(state: PlanningPass, zones: dict[str | None, int | None], tp: int, pp: int, dp: int) -> tuple[bool, int]:
    """Whether ``dp`` replicas of ``tp`` x ``pp`` GPUs cannot start in ``zones`` (a capped zone
    counting at most its cap) nor wait there for GPUs on their way back: too few free ``tp``-GPU
    groups with nothing coming back, or too few GPUs even counting those; and the free groups.
    ``admit``'s quick hold on the zones a job may use."""
    groups = sum(state.view.free_groups(z, tp) if limit is None else min(state.view.free_groups(z, tp), limit // tp)
                 for z, limit in zones.items())
    soon = sum(state.soon_free.get(z, 0) for z in zones)
    return (dp * pp > groups and soon == 0) or state._free_total(zones) + soon < dp * tp * pp, groups


def _team_key(state: PlanningPass, job: Job, key: tuple) -> tuple:
    """``key`` with rule 9's standing: after the tier and critical work, a job its team's quota
    covers ahead of any borrower whatever their classes; within a class the least past usage
    first; a borrower does not age (``quota.ages``). The standing ``admit`` reads stays third
    (``queue_standing``)."""
    standing = quota.queue_rank(state, job)
    if standing[0]:
        key = (key[0], key[2]) + key[2:]
    first = 0 if job.priority == "critical" else 1 + standing[0]
    return (key[0], first) + key[1:3] + standing + key[3:]


def queue_standing(state: PlanningPass, key: tuple) -> int:
    """The standing in a queue key (``queue_key``, ``_team_key``): ``admit``'s rank, effective
    with ageing, else the class."""
    return key[2] if state.teams else key[1]


def admit(state: PlanningPass, job: Job) -> None:
    """Start ``job`` now if it can, else make room or wait for GPUs coming back, else hold it."""
    rep = job.tp * job.pp
    dps = [d for d in reversed(valid_dps(job)) if d <= job.dp]
    if not dps:
        dps = list(reversed(valid_dps(job)))
    if state.teams and job.team is not None and job.phase != "recovering":
        # Rule 9: no bigger than its team (and the team's parents) may still hold.
        cap = quota.size_cap(state, job)
        allowed = [d for d in dps if d * rep <= cap]
        if not allowed:
            state._hold(job, "team_limit",
                        f"{upper_first(state.teams.limit_words(job.team))}: it needs {gpu_shape(job.tp, job.pp, dps[-1])} "
                        "at least, so it waits until the team's own jobs give GPUs back.",
                        team=job.team, gpus_min=dps[-1] * rep, gpus_allowed=int(min(cap, 1 << 30)))
            return
        dps = allowed
        # Within its quota, no bigger than the quota while another team's owed work waits.
        room = quota.room_before_reclaim(state, job)
        dps = [d for d in dps if d * rep <= room] or dps
    preferred = dps[0]
    ages = quota.ages(state, job)
    rank = effective_rank(job, state.now, state.config) if ages else PRIORITY_RANK[job.priority]
    reclaims = quota.may_reclaim(state, job, dps[-1] * rep)
    if not job.holdings and job.phase != "recovering" and not job.parked:
        # Cheapest test first, for long queues: fewer GPUs free anywhere than the job's
        # smallest size, nothing coming back, and no way to take GPUs from others.
        groups = groups_upper_bound(state, job)
        blocked = cheap = dps[-1] * job.pp > groups and not any(state.soon_free.values())
        if not blocked and not state._entitled_now(job):
            # Count only the zones this job may really use, and what is coming back there.
            blocked, groups = blocked_in(state, state._zones_for(job, dps[-1]), job.tp, job.pp, dps[-1])
        if blocked and not state._entitled_now(job):
            aged = ages and job.priority == "regular" and is_aged(job, state.now, state.config)
            key = quota.failure_key(state, job, rank, False, aged)
            if not reclaims and (rank >= PRIORITY_RANK["best_effort"]
                                 or state.victim_failed_at.get(key, 1 << 30) <= dps[-1] * rep):
                hold_queue_full(state, job, preferred, rep, groups * job.tp, rank, zoned=not cheap)
                return
    recovering = job.phase == "recovering" or (bool(job.holdings) and any(
        state.nodes.get(h.gpu.node) is None or state.nodes[h.gpu.node].health in LOST_HEALTH for h in job.holdings
    ))
    survivors = surviving_replicas(job, state.nodes, LOST_HEALTH) if job.holdings else []
    held_dp = len(survivors)
    survivor_gpus = [g for r in survivors for g in r]
    anchor = sorted({g.node for g in survivor_gpus}) or sorted({h.gpu.node for h in job.holdings})
    entitled = state._entitled_now(job)
    kind = "recover" if recovering else "place"
    forced = entitled or recovering

    # Fast path for a long queue: nothing free for even the smallest size, nothing on its
    # way back, and no way to take GPUs (best-effort, or a victim search that already
    # failed for a request this size in this pass): hold at once.
    if not forced:
        smallest_need = dps[-1] * rep
        zones_min = state._zones_for(job, dps[-1])
        if (state._free_total(zones_min) < smallest_need
                and not any(state.soon_free.get(z, 0) for z in zones_min)):
            aged = ages and job.priority == "regular" and is_aged(job, state.now, state.config)
            key = quota.failure_key(state, job, rank, False, aged)
            if not reclaims and (rank >= PRIORITY_RANK["best_effort"]
                                 or state.victim_failed_at.get(key, 1 << 30) <= smallest_need):
                hold_for_capacity(state, job, preferred, rep,
                                  state._free_total(state._zones_for(job, preferred)), rank)
                return

    # (a) Fault with enough survivors: continue on them (rule 7) unless spares are at hand.
    if recovering and held_dp:
        if state._try_place(job, preferred, held_dp, survivor_gpus, anchor, kind, entitled):
            return
        if continue_on_survivors(state, job, survivors):
            return

    # (b) Free GPUs at the preferred size: an entitled job's own pool first, then general
    # capacity (and, for others, lendable reserved GPUs).
    if entitled and state._try_place(job, preferred, 0, [], anchor, kind, entitled, own_pool_only=True):
        return
    # Unlent GPUs before a loan: a job that fits on general capacity is not put where it will
    # be reclaimed from (each reclaim costs the borrower a save, a restart and a wait).
    if state._try_place(job, preferred, 0, [], anchor, kind, entitled, unlent_only=True):
        return
    if state._try_place(job, preferred, 0, [], anchor, kind, entitled):
        return
    # (c) GPUs already on their way back to the queue: wait for them rather than take more.
    wait_dp = preferred if (job.priority == "critical" or recovering) else dps[-1]
    need = wait_dp * rep
    zones = state._zones_for(job, wait_dp)
    free_total = state._free_total(zones)
    soon = sum(state.soon_free.get(z, 0) for z in zones)
    if free_total + soon >= need and soon > 0:
        state._claim_soon_free(zones, need - free_total)
        state._claim_free(job, zones, free_total)
        names = sorted({n for z in zones for n in state.soon_free_by.get(z, [])})
        state._hold(job, "waiting_for_release", returning_sentence(need - free_total, names, job.tp, job.pp, wait_dp),
                    gpus_needed=need, gpus_free=free_total, gpus_returning=soon)
        return
    # (c') A team below its quota takes back what other teams borrowed (rule 9), at the largest
    # size its quota covers, with the loan mechanics (lead time, checkpoint first).
    if reclaims and not recovering:
        headroom = state.teams.below_quota_by(job.team)
        within = [d for d in dps if d * rep <= headroom]
        # Smaller on what is free before taking from anyone: it grows later, and the GPUs it
        # would reclaim for its preferred size cost their borrower a save and a restart.
        for d in within:
            if d < preferred and state._try_place(job, d, 0, [], anchor, kind, entitled):
                return
        if within:
            q_zones = state._zones_for(job, within[0])
            q_free = state._free_total(q_zones)
            q_need = within[0] * rep
            # Jobs about to finish on their own give GPUs back as soon as a reclaim would: wait
            # for them rather than stop a borrower (each reclaim costs it a save and a restart).
            # (Only while it has waited less than the grace: a prediction that fails does not keep it.)
            done_soon = (quota.finishing_soon(state, q_zones, q_need - q_free)
                         if q_free < q_need and waited_s(job, state.now) < state.config.reclaim_grace_s else [])
            if done_soon:
                state._claim_free(job, q_zones, q_free)
                names = [j.name for j in done_soon]
                state._hold(job, "waiting_for_completion",
                            f"{plural(q_need - q_free, 'GPU')} come free within {duration_words(state.config.reclaim_grace_s)} "
                            f"when {join_words(names[:5])} {'finishes' if len(names) == 1 else 'finish'}; "
                            f"then it starts with {gpu_shape(job.tp, job.pp, within[0])}, within its team's quota.",
                            gpus_needed=q_need, gpus_free=q_free, finishing=names)
                return
            # The largest size its quota covers that the borrowers' excess can make room for.
            for d in within:
                if state._try_victims(job, d, q_zones if d == within[0] else state._zones_for(job, d), rank, False,
                                      kind, entitled, quota=True):
                    return
    # (d) Critical work takes GPUs from cheaper victims at its preferred size (rule 4);
    # (e) others first start smaller on what is free (they grow later), and only then take
    # GPUs from victims, for their smallest batch-exact size.
    if job.priority == "critical" or recovering:
        if state._try_victims(job, preferred, zones, rank, forced, kind, entitled):
            return
    for d in dps[1:]:
        if state._try_place(job, d, 0, [], anchor, kind, entitled):
            return
    if job.priority != "critical" and not recovering:
        smallest = dps[-1]
        if state._try_victims(job, smallest, state._zones_for(job, smallest), rank, forced, kind, entitled):
            return
    # (f) Hold, saying why.
    hold_for_capacity(state, job, preferred, rep, free_total, rank)


def groups_upper_bound(state: PlanningPass, job: Job) -> int:
    """At most how many free ``tp``-GPU groups any zone could give ``job`` now (cheap, cached)."""
    own = tuple(r.name for r in state.res_of_job.get(job.name, ()))  # already sorted
    key = (job.tp, job.priority == "critical", own, state.view.generation)
    hit = state._bound_cache.get(key)
    if hit is not None:
        return hit
    # The pools' part depends only on (tp, critical, free set), not on the job: count it
    # once for every pool as if none were the job's own, then correct for its own pools
    # (usually none or one) instead of walking every pool for every waiting job.
    critical = job.priority == "critical"
    pools_key = (job.tp, critical, state.view.generation)
    per_pool = state._pools_bound_cache.get(pools_key)
    if per_pool is None:
        shortest_s = state.config.startup_s + state.config.reclaim_margin_s
        parts: dict[str, tuple[int, int]] = {}
        other_total = 0
        for name, pool in state.pools.items():
            if not state.view.zone_total.get(name, 0):
                continue
            groups = state.view.free_groups(name, job.tp)
            if state.kill:
                other = groups
            elif not critical:
                window_s = pool.next_need_s - state.now
                other = groups if window_s > shortest_s else min(groups, pool.spare_lendable // job.tp)
            else:
                other = 0
            parts[name] = (groups, other)
            other_total += other
        per_pool = (other_total, parts)
        state._pools_bound_cache[pools_key] = per_pool
    other_total, parts = per_pool
    bound = state.view.free_groups(None, job.tp) + other_total
    for name in set(own):
        part = parts.get(name)
        if part is not None:
            bound += part[0] - part[1]
    state._bound_cache[key] = bound
    return bound


def hold_if_cannot_fit(state: PlanningPass, job: Job) -> bool:
    """Hold a job that can never run on this cluster as it is now (``layout.fit_problems``)."""
    problems = state._fit_problems(job)
    if not problems:
        return False
    field, problem = next(iter(problems.items()))
    state._hold(job, CANNOT_FIT,
                f"Cannot fit this cluster: {problem}. It waits until the cluster grows or its spec changes.",
                field=field, gpus_min=job.dp_min * job.tp * job.pp)
    return True


def capacity_sentence(state: PlanningPass, job: Job, preferred: int, free: int, rank: int,
                      notes: Sequence[str] = ()) -> str:
    """Why a job cannot start now, for its owner: its size, what is free, who holds the rest,
    what it may not borrow (``notes``), and why it takes nothing from others."""
    min_need = job.dp_min * job.tp * job.pp
    text = f"Needs {gpu_shape(job.tp, job.pp, preferred)}"
    if job.dp_min < preferred:
        text += f", or at least {min_need} to start"
    if free < min_need:
        text += f"; only {free} of the GPUs it may use are free" if free else "; none of the GPUs it may use is free"
    elif job.tp > 1:
        text += f"; {plural(free, 'GPU')} it may use {agree(free, 'is', 'are')} free, but too scattered: each group of {job.tp} must be on one node"
    else:
        text += f"; {plural(free, 'GPU')} it may use {agree(free, 'is', 'are')} free, but not where it can use them"
    holders = [plural(state.holders[p], f"{label} job") for p, label in CLASS_WORDS if state.holders.get(p, 0) > 0]
    if holders:
        text += f", the others are held by {join_words(holders)}"
    parts = [text, *notes, *low_disk_notes(state, job)[0]]
    if state.teams and job.team in state.teams.teams:
        parts.append(state.teams.standing_words(job.team) + ("; none are idle" if free < min_need else ""))
    if rank >= PRIORITY_RANK["best_effort"]:
        parts.append("best-effort jobs never take GPUs from others")
    else:
        parts.append("no lower-priority job can give enough back now (a job keeps its GPUs for its minimum "
                     "run time after it starts)")
    waited = waited_s(job, state.now)
    if promoted(job, state.now, state.config):
        after = duration_words(state.config.promote_after_s)
        parts.append(f"it has waited {duration_words(waited)}, more than {after}, so it now queues as regular work "
                     f"by right, standing as a regular job that came {after} after it began waiting")
    elif waited > 0 and rank < PRIORITY_RANK[job.priority]:
        parts.append(f"it has waited {duration_words(waited)}, so it now queues as a regular job")
    return "; ".join(parts) + "."


def low_disk_notes(state: PlanningPass, job: Job) -> tuple[list[str], list[str]]:
    """(a phrase, the nodes) on free GPUs ``job`` could use but for their nodes' full runs dirs
    (``Node.low_disk``): ``8 GPUs are free on r0s0n1, but no new work goes there: r0s0n1 has
    1.2 GiB free in its runs dir, under the 2 GiB minimum``. Nothing when no node is low on disk."""
    if not state.low_disk_nodes:
        return [], []
    zones = state._zones_for(job, job.dp_min)
    hit: list[tuple[str, int, int | None]] = []
    for node in state.low_disk_nodes:
        free = node.gpus - len(state.view.held_by_node.get(node.name, ()))
        if free >= job.tp and state.view.zone_of_node.get(node.name) in zones:
            hit.append((node.name, free, node.disk_free_bytes))
    if not hit:
        return [], []
    gpus = sum(free for _, free, _ in hit)
    where = hit[0][0] if len(hit) == 1 else f"{len(hit)} nodes"
    words = low_disk_words([(name, disk) for name, _, disk in hit], state.config.min_free_disk_bytes)
    phrase = f"{gpus_are(gpus)} on {where}, but no new work goes there: {words}"
    return [phrase], [name for name, _, _ in hit]


# How each class is named in a hold's sentence, best first.
CLASS_WORDS = (("critical", "critical"), ("regular", "regular"), ("best_effort", "best-effort"))


def hold_queue_full(state: PlanningPass, job: Job, preferred: int, rep: int, free_anywhere: int, rank: int,
                    zoned: bool = False) -> None:
    """The cheap hold for the tail of a long queue: nothing anywhere could start it (``zoned``:
    nothing in the zones it may use, so the sentence says which pools may not lend to it)."""
    state.capacity_blocked_rank = min(state.capacity_blocked_rank, class_rank(job, state.now, state.config))
    if not state.explain:
        return
    need = preferred * rep
    text = capacity_sentence(state, job, preferred, free_anywhere, rank, refused_loan_notes(state, job) if zoned else ())
    state.actions.append(Action(
        kind="hold", job=job.name,
        reason=Reason("hold", text, {"cause": capacity_cause(state, job), "gpus_needed": need, "gpus_min": job.dp_min * rep,
                                     "gpus_free": free_anywhere, "effective_rank": rank}),
        global_batch=job.global_batch,
    ))


def capacity_cause(state: PlanningPass, job: Job) -> str:
    """A capacity hold's cause: ``promoted`` for a promoted best-effort job (``starvation.promoted``),
    so the live planner audits the hold the moment it is promoted (a hold is audited when its
    cause changes), else ``capacity``."""
    return "promoted" if promoted(job, state.now, state.config) else "capacity"


def hold_for_capacity(state: PlanningPass, job: Job, preferred: int, rep: int, free_total: int, rank: int) -> None:
    """Hold a job that cannot start now, with the reasons in plain words."""
    state.capacity_blocked_rank = min(state.capacity_blocked_rank, class_rank(job, state.now, state.config))
    if not state.explain:
        return
    need = preferred * rep
    min_need = job.dp_min * rep
    text = capacity_sentence(state, job, preferred, free_total, rank, refused_loan_notes(state, job))
    low_disk = low_disk_notes(state, job)[1]
    state._hold(job, capacity_cause(state, job), text, gpus_needed=need, gpus_min=min_need,
                gpus_free=free_total, waited_s=round(waited_s(job, state.now), 1),
                effective_rank=rank, **({"low_disk_nodes": low_disk} if low_disk else {}))


def try_place(
    state: PlanningPass,
    job: Job,
    dp: int,
    held_dp: int,
    held_gpus: list[Gpu],
    anchor: Sequence[str],
    kind: str,
    entitled: bool,
    own_pool_only: bool = False,
    unlent_only: bool = False,
) -> bool:
    """Start ``job`` at ``dp`` (keeping ``held_gpus``) on free GPUs of the zones it may use, if they
    fit: only its own pools' with ``own_pool_only``, no other pool's with ``unlent_only``."""
    extra = dp - held_dp
    if extra < 0:
        return False
    zones = state._zones_for(job, dp)
    if own_pool_only or unlent_only:
        own = {r.name for r in state.res_of_job.get(job.name, ())}
        zones = {z: n for z, n in zones.items() if z in own or (unlent_only and z is None)}
        if not zones or (unlent_only and len(zones) == len(state._zones_for(job, dp))):
            return False  # nothing to keep out: the plain call that follows tries the same zones
    if state._free_total(zones) < extra * job.tp * job.pp:
        return False
    if extra == 0:
        new: tuple[Gpu, ...] = ()
    else:
        # A request that did not fit still does not fit (nor does a bigger one) until the
        # free set changes: remember failures per zone set and shape.
        memo_key = (tuple(sorted(zones.items(), key=lambda kv: (kv[0] is not None, kv[0] or ""))),
                    job.tp, job.pp, state.view.generation)
        if state._place_failed.get(memo_key, 1 << 30) <= extra:
            return False
        groups = sum(
            state.view.free_groups(z, job.tp) if limit is None
            else min(state.view.free_groups(z, job.tp), limit // job.tp)
            for z, limit in zones.items()
        )
        if groups < extra * job.pp:
            state._place_failed[memo_key] = min(extra, state._place_failed.get(memo_key, 1 << 30))
            return False
        found = state.view.place(zones, job.tp, job.pp, extra, anchor)
        if found is None:
            state._place_failed[memo_key] = min(extra, state._place_failed.get(memo_key, 1 << 30))
            return False
        new = found
    after = list(held_gpus) + list(new)
    emit_start(state, job, kind, after, dp, entitled)
    return True


def emit_start(state: PlanningPass, job: Job, kind: str, after: list[Gpu], dp: int, entitled: bool,
               note: str = "") -> None:
    """Issue the ``place``, ``lend`` (on borrowed GPUs) or ``recover`` that starts ``job`` on
    ``after``, with ``note`` ending its sentence."""
    spread = spread_of(after, state.nodes)
    own = {r.name for r in state.res_of_job.get(job.name, ())}
    lent = sorted({z for g in after if (z := state.view.zone(g)) is not None and z not in own})
    inputs: dict[str, object] = {"dp": dp, "gpus": len(after), **spread.as_inputs(),
                                 "waited_s": round(waited_s(job, state.now), 1)}
    deadline = None
    if lent:
        loan_end = min(state.pools[z].next_need_s for z in lent)
        deadline = None if loan_end == INFINITY else loan_end
        kind_out = "lend"
        rule = "harvest.lend"
        window_notes = loan_notes(state, job, dp, lent)
        text = (f"Started on {replica_count(dp)} ({plural(len(after), 'GPU')}, {spread.describe()}) using lent "
                f"GPUs nobody is using now: {'; '.join(window_notes)}.")
        if loan_end < INFINITY:
            text += f" The loan ends at {state._when(loan_end)}; the job will be asked to save ahead of it."
        inputs["loan_ends_s"] = None if loan_end == INFINITY else loan_end
        inputs["lead_time_s"] = round(reclaim_lead_time(job, state.config), 3)
    elif kind == "recover":
        kind_out = "recover"
        rule = "faults"
        # A signal-mode script resumes from its own save, which the planner does not see.
        where = "its script starts again from its own last save" if job.signal else \
            f"restarts from step {job.last_checkpoint_step}"
        text = (f"Recovering from a fault: {where} on {replica_count(dp)} ({spread.describe()}), "
                "nearest to where it ran.")
    else:
        kind_out = "place"
        rule = "entitlement" if entitled else "placement"
        own_active = [r.name for r in state.res_of_job.get(job.name, ()) if is_active(r, state.now)]
        if own_active and own_active[0].startswith("idle:"):
            who = "its idle phase is over and its lent GPUs are back"
        elif entitled:
            who = "its reservation is active"
        else:
            who = f"{plural(len(after), 'GPU')} {agree(len(after), 'was', 'were')} free"
        text = f"Started on {replica_count(dp)} ({plural(len(after), 'GPU')}, {spread.describe()}): {who}."
    if dp != job.dp:
        text += (f" Runs at dp {dp} instead of {job.dp} with accumulation {accum_steps(job, dp)}, "
                 f"keeping the global batch {job.global_batch}.")
    state._emit(kind_out, job, after, Reason(rule, text + note, inputs), deadline_s=deadline)

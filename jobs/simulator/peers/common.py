"""What the peers' policies share: one pass's view of the cluster (free GPUs, GPUs on their way
back from a stop already sent, GPUs claimed by a job waiting for them), placement of whole
replicas (``jobs.planner.topology.choose_gpus``), a minimal victim set (greedy, then pruned, as
Slurm and Kueue both do), drains and fault recovery, and the ``Plan``/``Action`` they return.

A peer is a baseline, not the planner: it reads the same ``Snapshot`` and returns the same
``Plan``, so it runs under the simulator's invariant checks unchanged, but it uses none of the
planner's rules (no lead times, no loans of idle phases, no straggler migration).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from jobs.planner.config import PlannerConfig
from jobs.planner.core import team_reservation_owner
from jobs.planner.decisions import Action, Plan, Reason
from jobs.planner.entitlements import is_active
from jobs.planner.kept import KeptByName
from jobs.planner.layout import accum_steps, batch_divides
from jobs.planner.queue_walk import walk_by_groups
from jobs.planner.rhythm import step_time_at
from jobs.planner.snapshot import (
    PRIORITY_RANK,
    WAITING_PHASES,
    Gpu,
    Job,
    Reservation,
    Snapshot,
    live_jobs_by_name,
)
from jobs.planner.topology import choose_gpus, held_indexes

INFINITY = math.inf
T = TypeVar("T")


class PassIndex(KeptByName):
    """A peer's plain waiters by shape, and its jobs that hold GPUs, kept from one pass to the next.

    A plain waiter wants GPUs (pending, preempted or recovering, not parked) and holds none. Its
    shape (class, team, TP, PP, sizes: ``PeerPass.plain_shape``) reads only the job, so the
    groups change only where a job's snapshot does (``KeptByName``): a long quiet queue is not
    visited job by job on every pass. What a pass itself rules out (a stop in flight, a job
    decided already, a reservation's job) it leaves out when it walks (``PeerPass.walk_queue``).
    The jobs that hold GPUs (``holders``) are the few a pass's view of the cluster is built from.
    """

    def __init__(self, shape_of: Callable[[Job], tuple]) -> None:
        super().__init__()
        self.shape_of = shape_of
        self.groups: dict[tuple, list[tuple]] = {}  # shape -> members (submit_s, name, job), sorted
        self.member: dict[str, tuple[tuple, tuple]] = {}  # name -> (shape, member)
        self.holding: set[str] = set()  # jobs that want GPUs and hold some (survivors of a fault)
        self.holders: set[str] = set()  # jobs that hold GPUs

    def add(self, job: Job) -> None:
        name = job.name
        if job.holdings:
            self.holders.add(name)
        if (job.phase not in WAITING_PHASES and job.phase != "recovering") or job.parked:
            return
        if job.holdings:
            self.holding.add(name)
            return
        shape = self.shape_of(job)
        entry = (job.submit_s, name, job)
        members = self.groups.get(shape)
        if members is None:
            self.groups[shape] = [entry]
        else:
            bisect.insort(members, entry)
        self.member[name] = (shape, entry)

    def drop(self, name: str) -> None:
        self.holding.discard(name)
        self.holders.discard(name)
        hit = self.member.pop(name, None)
        if hit is None:
            return
        shape, entry = hit
        members = self.groups[shape]
        i = bisect.bisect_left(members, entry)
        assert members[i] is entry
        del members[i]
        if not members:
            del self.groups[shape]


#: Per thread, per peer class: its ``PassIndex`` (a replay's passes run one after another).
_INDEXES = threading.local()


def _index_of(peer: type[PeerPass]) -> PassIndex:
    by_class = getattr(_INDEXES, "by_class", None)
    if by_class is None:
        by_class = _INDEXES.by_class = {}
    index = by_class.get(peer)
    if index is None:
        index = by_class[peer] = PassIndex(peer.plain_shape)
    return index


@dataclass(slots=True)
class Option:
    """One way to free GPUs from a running job: stop it (``after`` empty) or shrink it to ``after``."""

    job: Job
    after: tuple[Gpu, ...]

    @property
    def freed(self) -> tuple[Gpu, ...]:
        keep = set(self.after)
        return tuple(g for g in self.job.gpus if g not in keep)


def est_remaining_s(job: Job, dp: int | None = None) -> float:
    """Run time still to go at ``dp`` replicas (default: as it holds now, else its preferred size),
    saves and idle phases included: what a perfect time limit would say."""
    d = dp or job.current_dp or job.dp
    steps = job.remaining_steps
    t = steps * step_time_at(job, d)
    t += (steps // max(1, job.checkpoint.every_steps)) * job.checkpoint.save_s
    for phase in job.idle_phases:
        t += (steps // max(1, phase.every_steps)) * phase.duration_s
    if job.phase in WAITING_PHASES and job.committed_steps > 0:
        t += job.checkpoint.load_s
    return t


def valid_sizes(job: Job, low: int, high: int) -> list[int]:
    """Batch-exact replica counts in ``[low, high]`` (within the job's bounds), largest first."""
    low, high = max(low, job.dp_min), min(high, job.dp_max)
    return [d for d in range(high, low - 1, -1) if batch_divides(job, d)]


class PeerPass:
    """One pass of a peer's policy; subclasses give ``schedule()``. Build it, call ``run()`` once."""

    #: Prefix of the reason rules this peer writes (``slurm.backfill``, ``kueue.reclaim``, ...).
    name = "peer"

    def __init__(self, snapshot: Snapshot, now_s: float, config: PlannerConfig) -> None:
        self.snapshot = snapshot
        self.now = float(now_s)
        self.config = config
        self.nodes = {n.name: n for n in snapshot.nodes}
        self.jobs: dict[str, Job] = live_jobs_by_name(snapshot.jobs)
        self.index = _index_of(type(self))
        self.index.update(self.jobs)
        #: The jobs that hold GPUs, in name order (most of a long queue holds nothing).
        self.holding_jobs: list[Job] = [self.jobs[name] for name in sorted(self.index.holders)]
        self.busy = {c.job for c in snapshot.commands}
        self.reservations: list[Reservation] = [
            team_reservation_owner(r, self.jobs) for r in sorted(snapshot.reservations, key=lambda r: r.name)
            if not r.name.startswith("idle:")
        ]
        self.res_of_job: dict[str, list[Reservation]] = {}
        for res in self.reservations:
            self.res_of_job.setdefault(res.job, []).append(res)
        # The nodes set aside for a job's reservations: where its partition (Slurm) or resource
        # flavour (Kueue) lives, so it is placed there first.
        self.pool_nodes: dict[str, set[str]] = {}
        for res in self.reservations:
            if res.nodes and res.job:
                self.pool_nodes.setdefault(res.job, set()).update(res.nodes)
        self.owner: dict[Gpu, str] = {}
        held: dict[str, set[int]] = {}
        for j in self.holding_jobs:
            self.owner.update(dict.fromkeys(j.gpus, j.name))
            for node, idx in held_indexes(j):
                held.setdefault(node, set()).update(idx)
        #: Nodes that take new work.
        self.placeable = frozenset(n.name for n in snapshot.nodes if n.takes_new_work)
        self.free: dict[str, set[int]] = {}
        for n in snapshot.nodes:
            if n.takes_new_work:
                idx = set(range(n.gpus)) - held.get(n.name, set())
                if idx:
                    self.free[n.name] = idx
        # GPUs that stops already sent (or sent in this pass) will give back, and by whom.
        self.releasing: dict[Gpu, str] = {}
        for cmd in sorted(snapshot.commands, key=lambda c: c.id):
            job = self.jobs.get(cmd.job)
            if job is None:
                continue
            for g in cmd.releases or (job.gpus if cmd.kind in ("preempt", "reclaim") else ()):
                if g.node in self.placeable:
                    self.releasing[g] = job.name
        self.actions: list[Action] = []
        self.acted: set[str] = set()
        self.wake = INFINITY
        #: The best class (rank) some job of which waits for GPUs in this pass.
        self.blocked_rank = 99
        self._no_fit: set[tuple[int, int, int, int]] = set()
        self._running: tuple[int, list[Job]] | None = None
        self._memo: dict[tuple, Any] = {}
        self.generation = 0

    # --- what a peer reads ----------------------------------------------------------------------

    def entitled_gpus(self, job: Job) -> int:
        """GPUs the job's active reservations guarantee now (0 outside every window)."""
        resv = self.res_of_job.get(job.name)
        if not resv:
            return 0
        return sum(r.gpus for r in resv if is_active(r, self.now))

    def dormant(self, job: Job) -> bool:
        """A critical job between the windows of its recurring reservation: it needs no GPUs."""
        resv = self.res_of_job.get(job.name)
        if not resv:
            return False
        return any(r.period_s for r in resv) and not any(is_active(r, self.now) for r in resv)

    def protected(self, job: Job) -> bool:
        """Whether a running job is within its ``min_run_s`` (then only a reservation, a fault or a
        drain may stop or shrink it)."""
        if job.run_started_s is None or job.min_run_s <= 0:
            return False
        return self.now - job.run_started_s < job.min_run_s - 1e-9

    def waiting(self) -> list[Job]:
        """Jobs that want GPUs now: waiting (or recovering from a fault), not between windows."""
        return [j for j in self.jobs.values() if self.wants(j)]

    def wants(self, j: Job) -> bool:
        """Whether ``j`` wants GPUs now (``waiting``)."""
        return ((j.phase in WAITING_PHASES or j.phase == "recovering") and j.name not in self.busy
                and j.name not in self.acted and not j.parked
                and (j.name not in self.res_of_job or not self.dormant(j)))

    def running(self) -> list[Job]:
        """Jobs holding GPUs with no stop in flight and nothing decided in this pass (kept until
        something is decided: a long queue asks for it once per waiting job)."""
        if self._running is None or self._running[0] != len(self.acted):
            self._running = (len(self.acted), [
                j for j in self.holding_jobs
                if j.phase not in WAITING_PHASES and j.phase != "recovering"
                and j.name not in self.busy and j.name not in self.acted])
        return self._running[1]

    def cached(self, key: tuple, build: Callable[[], T]) -> T:
        """``build()`` for ``key``, kept until the next action is decided in this pass."""
        full = (*key, len(self.acted))
        hit = self._memo.get(full)
        if hit is None:
            hit = self._memo[full] = build()
        return hit

    def size_range(self, job: Job) -> tuple[int, int]:
        """Replicas to ask for: ``[dp_min, dp]``, or an entitled job's reservation in full."""
        high = job.dp
        ent = self.entitled_gpus(job)
        if ent:
            high = max(high, min(job.dp_max, ent // job.replica_gpus))
        return job.dp_min, high

    def free_count(self) -> int:
        return sum(len(v) for v in self.free.values())

    # --- placement ------------------------------------------------------------------------------

    def fit(self, job: Job, dp: int, extra: Iterable[Gpu] = (), only: set[str] | None = None) -> tuple[Gpu, ...] | None:
        """GPUs for ``dp`` replicas of ``job`` from the free ones plus ``extra`` (its own survivors,
        GPUs a stop will free), on the nodes ``only`` if given, or None."""
        placeable = self.placeable
        extra = [g for g in extra if g.node in placeable and (only is None or g.node in only)]
        key = (job.tp, job.pp, dp, self.generation)
        if only is None and not extra and key in self._no_fit:
            return None
        cand: dict[str, list[int]] = {n: sorted(idx) for n, idx in self.free.items() if only is None or n in only}
        for g in extra:
            cand.setdefault(g.node, [])
            if g.index not in cand[g.node]:
                cand[g.node].append(g.index)
        if sum(len(v) for v in cand.values()) < dp * job.replica_gpus:
            if not extra and only is None:
                self._no_fit.add(key)
            return None
        anchor = sorted({g.node for g in job.gpus})
        got = choose_gpus(cand, self.nodes, job.tp, job.pp, dp, anchor)
        if got is None and not extra and only is None:
            self._no_fit.add(key)
        return got

    def fit_largest(self, job: Job, low: int, high: int, extra: Sequence[Gpu] = ()) -> tuple[Gpu, ...] | None:
        """The largest batch-exact layout in ``[low, high]`` replicas that fits now, or None."""
        if self.free_count() + len(extra) < low * job.replica_gpus:
            return None
        for d in valid_sizes(job, low, high):
            got = self.fit_pool_first(job, d, extra)
            if got is not None:
                return got
        return None

    def fit_pool_first(self, job: Job, dp: int, extra: Sequence[Gpu] = ()) -> tuple[Gpu, ...] | None:
        """``fit``, on the job's reservation pool first when it has one."""
        pool = self.pool_nodes.get(job.name)
        return (self.fit(job, dp, extra, only=pool) if pool else None) or self.fit(job, dp, extra)

    def make_room(self, job: Job, dp: int, options: Sequence[Option],
                  extra: Sequence[Gpu] = ()) -> tuple[list[Option], tuple[Gpu, ...]] | None:
        """The victims (in ``options`` order, each job once, a later option for the same job
        replacing an earlier one) whose freed GPUs let ``dp`` replicas of ``job`` fit, pruned to a
        minimal set; with the layout. None if all of them are not enough."""
        need = dp * job.replica_gpus
        chosen: dict[str, Option] = {}
        base = list(extra)
        layout = None
        total = self.free_count() + len(base)
        for opt in options:
            prev = chosen.get(opt.job.name)
            total += len(opt.freed) - (len(prev.freed) if prev else 0)
            chosen[opt.job.name] = opt
            if total < need:
                continue
            layout = self.fit(job, dp, base + [g for o in chosen.values() for g in o.freed])
            if layout is not None:
                break
        if layout is None:
            return None
        picked = list(chosen.values())
        for opt in reversed(list(picked)):
            rest = [o for o in picked if o is not opt]
            trial = self.fit(job, dp, base + [g for o in rest for g in o.freed])
            if trial is not None:
                picked, layout = rest, trial
        return picked, layout

    # --- actions --------------------------------------------------------------------------------

    def emit(self, kind: str, job: Job, after: Sequence[Gpu], rule: str, text: str, *,
             graceful: bool = True, forced: bool = False, deadline_s: float | None = None,
             **inputs: object) -> None:
        """Record an action and apply it to this pass's view (a graceful stop's GPUs come back
        later, as ``releasing``; a kill's, or a waiting job's survivors, are free at once)."""
        rep = job.replica_gpus
        before, dp_after = job.current_dp, len(after) // rep
        self.actions.append(Action(
            kind=kind, job=job.name, reason=Reason(rule, text, dict(inputs)), gpus_before=job.gpus,
            gpus_after=tuple(after), dp_before=before, dp_after=dp_after,
            accum_before=accum_steps(job, before), accum_after=accum_steps(job, dp_after),
            global_batch=job.global_batch, deadline_s=deadline_s, graceful=graceful, forced=forced,
        ))
        if kind == "hold":
            return
        self.acted.add(job.name)
        self.generation += 1
        keep = set(after)
        for g in after:
            if self.owner.get(g) != job.name:
                self.owner[g] = job.name
                idx = self.free.get(g.node)
                if idx is not None:
                    idx.discard(g.index)
                    if not idx:
                        del self.free[g.node]
                self.releasing.pop(g, None)
        stopping_now = not graceful or job.phase in WAITING_PHASES or job.phase == "recovering"
        for g in job.gpus:
            if g in keep:
                continue
            self.owner.pop(g, None)
            if g.node not in self.placeable:
                continue
            if stopping_now:
                self.free.setdefault(g.node, set()).add(g.index)
            else:
                self.releasing[g] = job.name

    def hold(self, job: Job, cause: str, text: str, **inputs: object) -> None:
        """The job keeps waiting, saying why; its class counts as blocked for this pass."""
        self.blocked_rank = min(self.blocked_rank, PRIORITY_RANK[job.priority])
        if not self.config.explain_holds:
            return
        dp = job.current_dp
        accum = accum_steps(job, dp) if dp else None
        self.actions.append(Action(
            kind="hold", job=job.name, reason=Reason(f"{self.name}.queue", text, {"cause": cause, **inputs}),
            gpus_before=job.gpus, gpus_after=job.gpus, dp_before=dp, dp_after=dp, accum_before=accum,
            accum_after=accum, global_batch=job.global_batch))

    # A waiting job that found nothing (no fit, no GPUs coming back, no victims) makes every later
    # job of the same shape, class and team hopeless too until something is decided: a long
    # queue then costs one hold per job, not one search.

    @staticmethod
    def _shape(job: Job, low: int, high: int) -> tuple:
        return ("hopeless", job.priority, job.team, job.tp, job.pp, job.dp, low, high)

    @staticmethod
    def plain_range(job: Job) -> tuple[int, int]:
        """``size_range`` of a job no reservation names (it reads nothing of the pass)."""
        return job.dp_min, job.dp

    @classmethod
    def plain_shape(cls, job: Job) -> tuple:
        """The shape of a plain waiter (``PassIndex``): the peer's, whatever the pass."""
        return cls._shape(job, *cls.plain_range(job))

    def walk_queue(self, key: Callable[[Job], tuple], decide: Callable[[Job], Any], grouped: bool = True,
                   prepare: Callable[[list[Job]], None] | None = None) -> None:
        """``decide`` the jobs of ``waiting()`` in the order of ``key``, but those of a ``hopeless``
        shape.

        With ``grouped``, plain waiters (``PassIndex``, kept between passes) are walked by shape
        (``queue_walk``): ``key`` must order the jobs of one shape by submit time, and read nothing
        the pass changes (it keys a job when the walk reaches it). A hopeless shape is shut, and
        the jobs of it that the walk passes wait with nothing to record: the one that found
        nothing was held, its class counted as blocked. The walk job by job, which keys and
        sorts every job and skips each of a hopeless shape, decides the same
        (``tests/simulator/test_quiet_holds.py``).

        ``prepare``, if given, is called before the walk with the jobs keyed one by one and one job
        of each shape (the jobs of a shape share their class, team and sizes).
        """
        if not grouped:
            ungrouped, groups = self.waiting(), {}
        else:
            index = self.index
            reserving = self.res_of_job
            # The few a pass rules out of the groups: a stop in flight, decided already, or named
            # by a reservation (walked one by one, with what it is entitled to).
            out = (self.busy | self.acted | reserving.keys()) & index.member.keys()
            groups = index.groups
            if out:
                groups = dict(groups)
                for shape in {index.member[name][0] for name in out}:
                    kept = [m for m in groups[shape] if m[1] not in out]
                    if kept:
                        groups[shape] = kept
                    else:
                        del groups[shape]
            jobs = self.jobs
            names = sorted((index.holding | reserving.keys()) & jobs.keys())
            ungrouped = [j for j in map(jobs.__getitem__, names) if self.wants(j)]
        if prepare is not None:
            prepare(ungrouped + [members[0][2] for members in groups.values()])
        others = sorted((key(job), job) for job in ungrouped)

        def shut_now() -> Callable[[tuple], bool]:
            stamp = (self.generation, len(self.acted))
            return lambda shape: self._memo.get(shape) == stamp

        walk_by_groups(others, groups, lambda shape, m: key(m[2]), shut_now, decide)

    def hopeless(self, job: Job, low: int, high: int) -> bool:
        """Whether a job of this shape already found nothing in this pass, with nothing decided since."""
        if job.holdings or job.name in self.res_of_job:
            return False
        return self._memo.get(self._shape(job, low, high)) == (self.generation, len(self.acted))

    def skip(self, job: Job) -> None:
        """A hopeless job keeps waiting with no action: its hold reason stands from an earlier
        pass (the engine records a hold only when its cause changes anyway)."""
        self.blocked_rank = min(self.blocked_rank, PRIORITY_RANK[job.priority])

    def mark_hopeless(self, job: Job, low: int, high: int) -> None:
        """Note that a job of this shape found nothing (see ``hopeless``)."""
        self._memo[self._shape(job, low, high)] = (self.generation, len(self.acted))

    def claim(self, gpus: Iterable[Gpu], job: Job) -> None:
        """Keep ``gpus`` (free now or on their way back) for ``job`` for the rest of this pass."""
        self.generation += 1
        for g in gpus:
            self.releasing.pop(g, None)
            idx = self.free.get(g.node)
            if idx is not None:
                idx.discard(g.index)
                if not idx:
                    del self.free[g.node]
            self.owner[g] = f"<claimed by {job.name}>"

    def start(self, job: Job, layout: Sequence[Gpu], rule: str, text: str, **inputs: object) -> None:
        """Place a waiting job (``recover`` when a fault left it waiting)."""
        kind = "recover" if job.phase == "recovering" else "place"
        self.emit(kind, job, layout, rule, text, **inputs)

    def wait_for_release(self, job: Job, low: int, high: int) -> bool:
        """If GPUs already on their way back let the job fit, keep them for it and hold it."""
        if not self.releasing:
            return False
        for d in valid_sizes(job, low, high):
            got = self.fit(job, d, list(self.releasing) + list(job.gpus))
            if got is not None:
                self.claim([g for g in got if g not in set(job.gpus)], job)
                self.hold(job, "waiting_for_release", f"Waits for {len(got)} GPUs that jobs it preempted "
                          "are giving back after their checkpoint.", gpus_needed=len(got))
                return True
        return False

    def stop_victims(self, victims: Sequence[Option], for_job: Job, rule: str, *, graceful: bool,
                     forced: bool, deadline_s: float | None, why: str) -> None:
        """Send each victim its stop or shrink."""
        for opt in victims:
            v = opt.job
            if opt.after:
                text = (f"Shrinks from {len(v.gpus)} to {len(opt.after)} GPUs, saving its checkpoint first, "
                        f"so that {for_job.name} can start: {why}.")
                self.emit("shrink", v, opt.after, rule, text, graceful=True, forced=forced,
                          deadline_s=deadline_s, for_job=for_job.name)
            else:
                how = "saves its checkpoint and is requeued" if graceful else \
                    "is killed and requeued; it restarts from its last checkpoint"
                self.emit("preempt", v, (), rule, f"Preempted for {for_job.name}: {why}; it {how}.",
                          graceful=graceful, forced=forced, deadline_s=deadline_s, for_job=for_job.name)

    def release_survivors(self, job: Job) -> None:
        """A job hit by a fault that cannot restart now gives back the GPUs that survived."""
        if job.holdings and job.name not in self.acted:
            self.emit("preempt", job, (), "faults", "Its node failed and it cannot restart at its size now: "
                      "the surviving GPUs go back to the queue and the job is requeued.", forced=True)

    def drains(self, shrink: bool = False) -> None:
        """Work on a draining node leaves gracefully (checkpoint, then requeue; an elastic job may
        instead drop the replicas there and continue)."""
        draining = {n.name for n in self.snapshot.nodes if n.health == "draining"}
        if not draining:
            return
        for job in self.running():
            if not any(g.node in draining for g in job.gpus):
                continue
            deadline = self.now + job.checkpoint.save_s + self.config.reclaim_grace_s
            if shrink:
                rep = job.replica_gpus
                reps = [job.gpus[i:i + rep] for i in range(0, len(job.gpus), rep)]
                kept = [r for r in reps if not any(g.node in draining for g in r)]
                sizes = valid_sizes(job, job.dp_min, len(kept))
                if sizes:
                    after = tuple(g for r in kept[:sizes[0]] for g in r)
                    self.emit("shrink", job, after, "drain", "An operator drains a node under the job: it "
                              "saves and continues without the replicas there.", forced=True, deadline_s=deadline)
                    continue
            self.emit("preempt", job, (), "drain", "An operator drains a node under the job: it saves its "
                      "checkpoint and is requeued.", forced=True, deadline_s=deadline)

    # --- run ------------------------------------------------------------------------------------

    def schedule(self) -> None:  # pragma: no cover - each peer gives its own
        raise NotImplementedError

    def run(self) -> Plan:
        """Decide, and return the plan."""
        if self.snapshot.paused:
            return Plan((), None, paused=True)
        self.schedule()
        return Plan(tuple(self.actions), None if self.wake == INFINITY else self.wake)

    def wake_at(self, t: float) -> None:
        """Ask for a pass at ``t`` at the latest."""
        if self.now + 1e-6 < t < self.wake:
            self.wake = t

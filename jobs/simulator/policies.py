"""The baseline policies the simulator compares the planner against.

``static``: whole-job allocation. Reserved GPUs are fenced off for their owner (held idle
when it does not use them); every other job runs first-come-first-served at its preferred
size with backfill on the rest; nothing is ever preempted or resized (a drained node is
still evacuated with a checkpoint, because an operator asked, and a job hit by a fault
continues on its survivors or waits for its full size).

``kill_preempt`` is not here: it is the production planner with
``PlannerConfig(reclaim_mode="kill")``: it lends reserved GPUs the same way but takes them
back at the moment of need by killing the borrower without a checkpoint.

The peers (``slurm``, ``kueue``, ``elastic``) live in ``jobs.simulator.peers``; this module
registers every policy (``POLICIES``, ``planner_for``) and says which are held to the quota
invariant (``QUOTA_POLICIES``).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from jobs.planner import admission
from jobs.planner import plan as omni_plan
from jobs.planner.config import PlannerConfig
from jobs.planner.core import PlanningPass
from jobs.planner.decisions import Plan
from jobs.planner.kept import KeptByName
from jobs.planner.rhythm import step_time_at
from jobs.planner.snapshot import Job, Snapshot

if TYPE_CHECKING:
    from jobs.simulator.scenario import JobSpec, Scenario

#: Every policy ``simulate --policy`` accepts (``all`` runs them in this order).
POLICIES = ("omni", "static", "kill_preempt", "slurm", "kueue", "elastic")
#: Policies that honour team quotas, so the quota invariant holds them to them: ``static`` is
#: FCFS, ``slurm`` orders by fair share but guarantees no quota (``GrpTRES`` would only cap), and
#: ``elastic`` knows no teams.
QUOTA_POLICIES = frozenset({"omni", "kill_preempt", "kueue"})
#: Policies that Omni's own planner decides (``omni_plan``), with every rule as configured, rule 8's
#: promotion included: the quota invariant gives their promoted best-effort runs the regular
#: ``min_run_s``.
OMNI_PLANNER_POLICIES = frozenset({"omni", "kill_preempt"})

PlanFunction = Callable[[Snapshot, float, PlannerConfig], Plan]


class StaticPass(PlanningPass):
    """A planning pass restricted to the ``static`` baseline's behaviour."""

    takes_victims = False

    def _zones_for(self, job: Job, dp: int) -> dict[str | None, int | None]:
        zones: dict[str | None, int | None] = {None: None}
        for res in self.res_of_job.get(job.name, ()):
            if res.name in self.pools:
                zones[res.name] = None
        return zones

    def _admit(self, job: Job) -> None:
        # FCFS at the preferred size only; a job that does not fit waits and later jobs
        # that do fit go ahead of it (backfill). Faults may continue on survivors.
        rep = job.tp * job.pp
        if job.holdings:
            super()._admit(job)
            return
        # Fewer GPUs free in every zone it may use than its size: it waits (the cheap test a
        # long queue's tail needs; ``_try_place`` would find the same).
        if self._free_total(self._zones_for(job, job.dp)) >= job.dp * rep:
            entitled = job.priority == "critical" and self._entitled_now(job)
            kind = "recover" if job.phase == "recovering" else "place"
            if entitled and self._try_place(job, job.dp, 0, [], [], kind, entitled, own_pool_only=True):
                return
            if self._try_place(job, job.dp, 0, [], [], kind, entitled):
                return
        if self.explain:
            self._hold(job, "capacity", f"Static policy: waits for {job.dp * rep} GPUs at its preferred size; "
                       f"{self._free_total(self._zones_for(job, job.dp))} are free.", gpus_needed=job.dp * rep)

    def _try_victims(self, *args: object, **kwargs: object) -> bool:
        return False

    def _group_blocked(self, *args: object) -> bool:
        # Its ``_admit`` has no quick hold (``admission.group_blocked``): the quiet walk shuts a
        # group for static only by ``_free_for_anyone``.
        return False

    def _free_for_anyone(self) -> float:
        # Reserved pools are fenced for their owners: others start only on general capacity.
        if self.soon_free.get(None):
            return math.inf
        return self.view.zone_total.get(None, 0)

    def _queue(self) -> None:
        # With no hold to word, a pass where no waiting job could start is skipped: static takes
        # nothing from others, so a job holding no GPUs starts only at its preferred size on
        # GPUs free (or coming back) in general capacity and its own pools (the long queue of a
        # full week: most passes have too few of those for any of it). An owner between its
        # windows only waits; jobs a fault left holding GPUs still go through the queue.
        if self.explain or self._may_start():
            super()._queue()

    def _may_start(self) -> bool:
        """Whether some job of the queue could start (or holds GPUs) in this pass."""
        lost = admission.lost_nodes(self)
        if lost:  # jobs holding GPUs on a lost node are the queue's too: ask each job
            return any(self._could_start(job, lost) for job in self.jobs.values())
        # Else the queue is its waiting and recovering jobs, kept by size between passes
        # (``_QueueSizes``): those holding GPUs go through it; a plain one needs its size free
        # in general capacity; a reservation's job is asked on its own.
        sizes = _queue_sizes()
        sizes.update(self.jobs)
        out = self.busy | self.acted
        if sizes.holding - out:
            return True
        if any(self._could_start(self.jobs[name], lost) for name in self.res_of_job if name in self.jobs):
            return True
        general = self.view.zone_total.get(None, 0) + self.soon_free.get(None, 0)
        out |= self.res_of_job.keys()
        return any(len(names) > len(names & out) for size, names in sizes.by_size.items() if size <= general)

    def _could_start(self, job: Job, lost: set[str]) -> bool:
        if not admission.in_queue(self, job, lost):
            return False
        totals, soon = self.view.zone_total, self.soon_free
        avail = totals.get(None, 0) + soon.get(None, 0) + sum(
            totals.get(r.name, 0) + soon.get(r.name, 0) for r in self.res_of_job.get(job.name, ()))
        return bool(job.holdings) or (job.dp * job.tp * job.pp <= avail and self._dormant_between_windows(job) is None)

    def _reservations(self) -> None:
        # Summarise pools (for zones) but never reclaim: nothing is ever lent.
        saved = list(self.actions)
        super()._reservations()
        self.actions = saved

    def _stragglers(self) -> None:
        return

    def _grow(self) -> None:
        return

    def run(self) -> Plan:
        """Static queue: sort by tier then submit order (no ageing)."""
        return super().run()


class _QueueSizes(KeptByName):
    """The static baseline's waiting and recovering jobs, kept from one pass to the next
    (``KeptByName``): those that hold GPUs, and the others by size (``dp * tp * pp``)."""

    def __init__(self) -> None:
        super().__init__()
        self.holding: set[str] = set()
        self.size_of: dict[str, int] = {}
        self.by_size: dict[int, set[str]] = {}

    def add(self, job: Job) -> None:
        if job.phase not in admission.QUEUE_PHASES:
            return
        if job.holdings:
            self.holding.add(job.name)
        else:
            size = self.size_of[job.name] = job.dp * job.tp * job.pp
            self.by_size.setdefault(size, set()).add(job.name)

    def drop(self, name: str) -> None:
        self.holding.discard(name)
        size = self.size_of.pop(name, None)
        if size is not None:
            names = self.by_size[size]
            names.discard(name)
            if not names:
                del self.by_size[size]


#: Per thread: its ``_QueueSizes`` (a replay's passes run one after another).
_QUEUE_SIZES = threading.local()


def _queue_sizes() -> _QueueSizes:
    """This thread's ``_QueueSizes``."""
    sizes = getattr(_QUEUE_SIZES, "sizes", None)
    if sizes is None:
        sizes = _QUEUE_SIZES.sizes = _QueueSizes()
    return sizes


@functools.lru_cache(maxsize=16)
def _without_ageing(config: PlannerConfig) -> PlannerConfig:
    """``config`` with ageing and promotion off and the queue first come, first served, one object per config:
    what a pass works out of a job once per config (``admission._plain_waiter``) is kept while the
    config is the same object."""
    return config.with_overrides({"ageing_s": 0.0, "promote_after_s": 0.0, "queue_length_weight": 0.0})


def plan_static(snapshot: Snapshot, now_s: float, config: PlannerConfig) -> Plan:
    """One pass of the ``static`` baseline."""
    return StaticPass(snapshot, now_s, _without_ageing(config)).run()


def _plan_static_without_teams(snapshot: Snapshot, now_s: float, config: PlannerConfig) -> Plan:
    # The FCFS baseline ignores quotas (it still knows each job's team, to resolve a team's
    # reservation to its owner).
    return plan_static(replace(snapshot, teams=()), now_s, config)


def planner_for(policy: str, scenario: Scenario) -> PlanFunction:
    """The plan function that decides for ``policy`` on ``scenario``."""
    from jobs.simulator import peers

    if policy in OMNI_PLANNER_POLICIES:
        return omni_plan
    if policy == "static":
        return _plan_static_without_teams
    if policy == "slurm":
        # GraceTime covers the slowest save plus two steps (at dp_min, the slowest size).
        grace = peers.grace_time_for([(j.checkpoint.save_s, step_time_at(_spec_job(j), j.dp_min))
                                      for j in scenario.jobs])
        return peers.slurm_planner(peers.SlurmConfig(grace_time_s=grace))
    if policy == "kueue":
        return peers.plan_kueue
    if policy == "elastic":
        return peers.plan_elastic
    raise ValueError(f"unknown policy {policy!r}")


def _spec_job(spec: JobSpec) -> Job:
    """A planner ``Job`` with just a spec's shape (for ``step_time_at``)."""
    return Job(name=spec.name, priority=spec.priority, tp=spec.tp, pp=spec.pp, dp=spec.dp, dp_min=spec.dp_min,
               dp_max=spec.dp_max, global_batch=spec.global_batch, micro_batch=spec.micro_batch,
               total_steps=spec.total_steps, step_s=spec.step_s, comm_fraction=spec.comm_fraction)

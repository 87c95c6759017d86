"""One planning pass: ``plan(snapshot, now_s, config) -> Plan``.

``PlanningPass`` builds the pass's working state from the snapshot, applies the rules in a
fixed order and collects their actions. Each rule's body lives in its rule module (see
docs/planner.md); this module only orchestrates:

1. reservations (rules 2, 3; ``harvest.review_pools``): summarise each pool; reclaim loans
   whose lead time has come;
2. drains (rule 7; ``drains``): move work off draining nodes gracefully;
3. idle phases (rule 3; ``harvest.lend_idle_phases``): lend the GPUs of jobs in a known idle
   phase to waiting work;
4. the waiting queue (rules 4-8; ``admission``): entitled owners, then fault recovery, then
   the rest by class and age; each is placed on free GPUs (harvesting lendable reserved
   ones), else given GPUs taken from cheaper victims (``victims``), else held with the reason;
5. stragglers (rule 7; ``faults.migrate_stragglers``): migrate replicas off slow nodes when
   it pays;
6. growth (rule 5; ``growth``): elastic jobs grow into GPUs nobody waits for, with hysteresis.

Teams (rule 9; ``quota``) run through the queue and growth: the order within a class, the
borrowing limit on every start and growth, and reclaiming what others borrowed for a team below
its quota (through ``victims``, with the loan mechanics).

The rule modules call back into the pass for what every rule shares: issuing an action
(``_emit``, ``_hold``), the wake-up time, free-GPU bookkeeping, and the zones a job may use.
Each rule is bound to the pass as a method too. The simulator's ``static`` baseline
(jobs/simulator/policies.py) subclasses the pass and overrides some of these methods, so rule
modules always call them, and one another's steps, through the pass.

Everything iterates in sorted order, so the same snapshot always yields the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace

from jobs.planner import admission, drains, faults, growth, harvest, quota, victims
from jobs.planner.admission import TIER_OTHER
from jobs.planner.config import PlannerConfig
from jobs.planner.decisions import Action, Plan, Reason
from jobs.planner.entitlements import is_active, next_start_s
from jobs.planner.harvest import PoolState
from jobs.planner.layout import accum_steps, fit_problems, valid_dps
from jobs.planner.quota import TeamBook
from jobs.planner.snapshot import (
    PLACEABLE_HEALTH,
    WAITING_PHASES,
    Gpu,
    Job,
    Reservation,
    Snapshot,
    holding_gpus,
    live_jobs_by_name,
)
from jobs.planner.starvation import class_rank
from jobs.planner.topology import ClusterView
from jobs.planner.victims import VictimEntry
from jobs.planner.wording import fmt_t

__all__ = ["TIER_OTHER", "PlanningPass", "plan"]

INFINITY = math.inf
RELEASING_COMMANDS = frozenset({"preempt", "reclaim"})


def team_reservation_owner(res: Reservation, jobs: dict[str, Job]) -> Reservation:
    """A team's reservation with its job resolved: the team's earliest-submitted critical job
    still to run (none: ``job`` stays empty, and the pool is lent with no owner to give it to)."""
    if not res.team:
        return res
    owners = [j for j in jobs.values() if j.team == res.team and j.priority == "critical"]
    if not owners:
        return replace(res, job="")
    return replace(res, job=min(owners, key=lambda j: (j.submit_s, j.name)).name)


def plan(snapshot: Snapshot, now_s: float, config: PlannerConfig | None = None) -> Plan:
    """Decide what every job should do now. Pure and deterministic; see the module docstring."""
    return PlanningPass(snapshot, now_s, config or PlannerConfig()).run()


class PlanningPass:
    """The mutable working state of one pass; build it, call ``run()`` once."""

    #: Whether a waiting job may take GPUs from running ones (``_try_victims``).
    takes_victims = True

    def __init__(self, snapshot: Snapshot, now_s: float, config: PlannerConfig) -> None:
        self.snapshot = snapshot
        self.now = float(now_s)
        self.config = config
        self.kill = config.reclaim_mode == "kill"
        self.explain = config.explain_holds
        self.jobs: dict[str, Job] = live_jobs_by_name(snapshot.jobs)
        self.busy: set[str] = {c.job for c in snapshot.commands}
        self.view = ClusterView(snapshot)
        self.nodes = self.view.nodes
        # Up nodes that take no new work for lack of disk: hold sentences name them.
        self.low_disk_nodes = sorted((n for n in snapshot.nodes if n.low_disk and n.health in PLACEABLE_HEALTH),
                                     key=lambda n: n.name)
        self.reservations: list[Reservation] = [
            team_reservation_owner(r, self.jobs) for r in sorted(snapshot.reservations, key=lambda r: r.name)
        ]
        self.res_of_job: dict[str, list[Reservation]] = {}
        for res in self.reservations:
            self.res_of_job.setdefault(res.job, []).append(res)
        self.pools: dict[str, PoolState] = {}
        self.actions: list[Action] = []
        self.acted: set[str] = set()
        self.wake = INFINITY
        # GPUs that outstanding or just-issued graceful releases will free, per zone.
        self.soon_free: dict[str | None, int] = {}
        self.soon_free_by: dict[str | None, list[str]] = {}
        for cmd in sorted(snapshot.commands, key=lambda c: c.id):
            job = self.jobs.get(cmd.job)
            if job is None:
                continue
            releases = cmd.releases or (job.gpus if cmd.kind in RELEASING_COMMANDS else ())
            for g in releases:
                node = self.nodes.get(g.node)
                if node is None or not node.takes_new_work:
                    continue
                zone = self.view.zone(g)
                self.soon_free[zone] = self.soon_free.get(zone, 0) + 1
                self.soon_free_by.setdefault(zone, []).append(job.name)
        # The best class held for capacity so far: a job of that class or lower grows only into
        # GPUs no waiting job could start on, or into windows kept from small borrowers (growth).
        self.capacity_blocked_rank = 99
        # The fewest GPUs a job still waiting after the queue could start with, per class rank
        # (``waiter_could_start``), worked out when first asked.
        self._waiting_min_gpus: dict[int, int] | None = None
        # How many jobs of each class hold GPUs, kept up to date by ``_emit`` (hold reasons).
        self.holders: dict[str, int] = {}
        for job in holding_gpus(self.jobs.values()):
            self.holders[job.priority] = self.holders.get(job.priority, 0) + 1
        # Teams: quotas, borrowing limits, fair share (rule 9), kept current by ``_emit``.
        pool_team = quota.pool_teams(snapshot.reservations, snapshot.jobs) if snapshot.teams else {}
        # The charge reads the zone map, not the pass: a closure over ``self`` would put every
        # pass in a reference cycle, freed only by the cyclic collector (a replay's passes piled
        # up between its runs, with all they hold).
        zone_of_node = self.view.zone_of_node
        self.teams = TeamBook(snapshot.teams, self.jobs.values(),
                              lambda job, gpus: quota.charged_gpus(job.team, gpus, zone_of_node, pool_team))
        self._node_gpus: tuple[int, ...] | None = None
        self._fit_cache: dict[tuple[int, int, int], dict[str, str]] = {}
        # Per-pass caches kept by the rule modules (victims, admission, harvest, _zones_for).
        self._victims_sorted: list[VictimEntry] | None = None
        self._victims_acted_seen = 0
        self._victims_head = 0
        self._place_failed: dict[tuple, int] = {}
        self._lendable_pools: list[tuple[str, PoolState]] | None = None
        self._bound_cache: dict[tuple, int] = {}
        self._pools_bound_cache: dict[tuple, tuple[int, dict[str, tuple[int, int]]]] = {}
        self._zones_cache: dict[tuple[str, int], dict[str | None, int | None]] = {}
        self.victim_failed_at: dict[tuple, int] = {}  # ``quota.failure_key`` -> smallest size that failed
        #: Waiting jobs of teams, (class rank, team, smallest GPUs, name) in class order (rule 9).
        self.quota_waiters: list[tuple[int, str, int, str]] = []

    # --- what every rule shares ---------------------------------------------------------------

    def _emit(
        self,
        kind: str,
        job: Job,
        gpus_after: Sequence[Gpu],
        reason: Reason,
        deadline_s: float | None = None,
        graceful: bool = True,
        forced: bool = False,
    ) -> Action:
        """Record an action and apply it to the pass's view: GPUs taken now, GPUs freed now or
        (a graceful release) counted as coming back."""
        rep = job.tp * job.pp
        dp_before = job.current_dp
        dp_after = len(gpus_after) // rep
        own = {r.name for r in self.res_of_job.get(job.name, ())}
        borrowed = sorted(
            {z for g in gpus_after if (z := self.view.zone(g)) is not None and z not in own}
        )
        action = Action(
            kind=kind,
            job=job.name,
            reason=reason,
            gpus_before=job.gpus,
            gpus_after=tuple(gpus_after),
            dp_before=dp_before,
            dp_after=dp_after,
            accum_before=accum_steps(job, dp_before),
            accum_after=accum_steps(job, dp_after),
            global_batch=job.global_batch,
            borrowed_from=tuple(borrowed),
            deadline_s=deadline_s,
            graceful=graceful,
            forced=forced,
        )
        self.actions.append(action)
        if kind != "hold":
            self.acted.add(job.name)
            if self.teams and job.team is not None:
                self.teams.add(job.team, self.teams.charge(job, gpus_after) - self.teams.charge(job, job.gpus))
            if bool(job.holdings) != bool(gpus_after) and (gpus_after or not graceful):
                self.holders[job.priority] = self.holders.get(job.priority, 0) + (1 if gpus_after else -1)
            new = [g for g in gpus_after if self.view.owner.get(g) != job.name]
            self.view.take(job.name, new)
            after_set = set(gpus_after)
            freed = [g for g in job.gpus if g not in after_set]
            if freed:
                if graceful and kind not in ("recover",):
                    for g in freed:
                        zone = self.view.zone(g)
                        self.soon_free[zone] = self.soon_free.get(zone, 0) + 1
                        self.soon_free_by.setdefault(zone, []).append(job.name)
                else:
                    self.view.release(freed)
        return action

    def _hold(self, job: Job, cause: str, text: str, **inputs: object) -> None:
        """Record that ``job`` keeps waiting, with the ``cause`` and a sentence saying why
        (nothing, with ``explain_holds`` off: a hold changes nothing in the pass)."""
        if not self.explain:
            return
        reason = Reason("hold", text, {"cause": cause, **inputs})
        if job.holdings:
            self._emit("hold", job, job.gpus, reason)
        else:  # what ``_emit`` would record for a job holding nothing, without its bookkeeping
            self.actions.append(Action(kind="hold", job=job.name, reason=reason, global_batch=job.global_batch))

    def _when(self, t: float) -> str:
        """A time for a reason's sentence, as the planner's clock reads (``wording.fmt_t``)."""
        return fmt_t(t, self.now, self.config.wall_clock_zone)

    def _fit_problems(self, job: Job) -> dict[str, str]:
        """Why ``job`` can never run on this cluster, by spec field (``layout.fit_problems``)."""
        key = (job.tp, job.pp, job.dp_min)
        hit = self._fit_cache.get(key)
        if hit is None:
            if self._node_gpus is None:
                self._node_gpus = tuple(n.gpus for n in self.snapshot.nodes)
            hit = self._fit_cache[key] = fit_problems(job.tp, job.pp, job.dp_min, self._node_gpus)
        return hit

    def _wake_at(self, t: float) -> None:
        """Ask for a pass at ``t`` at the latest (a foreseen decision falls due then)."""
        if self.now < t < self.wake:
            self.wake = t

    def _entitled_now(self, job: Job) -> bool:
        """Whether one of the job's reservations is active now."""
        resv = self.res_of_job.get(job.name)
        return bool(resv) and any(is_active(r, self.now) for r in resv)

    def _dormant_between_windows(self, job: Job) -> Reservation | None:
        """The recurring reservation a critical job waits for, if it is between windows."""
        resv = self.res_of_job.get(job.name)
        if not resv:
            return None
        recurring = [r for r in resv if r.period_s]
        if not recurring or any(is_active(r, self.now) for r in resv):
            return None
        return min(recurring, key=lambda r: (next_start_s(r, self.now), r.name))

    def _free_total(self, zones: dict[str | None, int | None]) -> int:
        """Free GPUs in ``zones``, a capped zone counting at most its cap."""
        totals = self.view.zone_total
        total = 0
        for zone, limit in zones.items():
            n = totals.get(zone, 0)
            if n:
                total += n if limit is None else min(n, limit)
        return total

    def _claim_free(self, job: Job, zones: dict[str | None, int | None], n: int) -> None:
        """Keep up to ``n`` free GPUs for ``job`` for the rest of this pass (it waits for more)."""
        claimed: list[Gpu] = []
        for node, idx in sorted(self.view.candidates(zones).items()):
            for i in idx:
                if len(claimed) >= n:
                    break
                claimed.append(Gpu(node, i))
        self.view.take(f"<claimed by {job.name}>", claimed)

    def _claim_soon_free(self, zones: Iterable[str | None], n: int) -> None:
        """Count ``n`` of the GPUs coming back in ``zones`` as promised to a waiting job."""
        for z in zones:
            take = min(n, self.soon_free.get(z, 0))
            self.soon_free[z] = self.soon_free.get(z, 0) - take
            n -= take
            if n <= 0:
                return

    def waiter_could_start(self, rank: int, gpus: int) -> bool:
        """Whether a job of class ``rank`` or better that still waits after the queue (not started
        in this pass, not between its reservation's windows) could start on ``gpus`` GPUs at its
        smallest size. Asked by growth, after the queue."""
        mins = self._waiting_min_gpus
        if mins is None:
            mins = self._waiting_min_gpus = {}
            for job in self.jobs.values():
                if (job.holdings or job.parked or job.phase not in WAITING_PHASES or job.name in self.acted
                        or self._dormant_between_windows(job) is not None):
                    continue
                sizes = valid_dps(job)
                if not sizes:
                    continue
                r, n = class_rank(job, self.now, self.config), sizes[0] * job.tp * job.pp
                if n < mins.get(r, 1 << 30):
                    mins[r] = n
        return any(n <= gpus for r, n in mins.items() if r <= rank)

    def _zones_for(self, job: Job, dp: int) -> dict[str | None, int | None]:
        """Zones ``job`` may draw GPUs from at ``dp`` (``harvest.zones_open_to``), cached per pass."""
        key = (job.name, dp)
        hit = self._zones_cache.get(key)
        if hit is not None:
            return dict(hit)
        zones = harvest.zones_open_to(self, job, dp)
        self._zones_cache[key] = zones
        return dict(zones)

    # --- the rules ----------------------------------------------------------------------------
    # Each is its rule module's function, bound as a method (``state`` is the pass), so a
    # policy such as the simulator's static baseline can replace one by overriding it.

    _reservations = harvest.review_pools
    _drains = drains.evacuate_draining_nodes
    _lend_idle_phases = harvest.lend_idle_phases
    _queue = admission.admit_waiting
    _tier = admission.queue_tier
    _free_for_anyone = admission.free_for_anyone
    _group_blocked = admission.group_blocked
    _admit = admission.admit
    _try_place = admission.try_place
    _try_victims = victims.take_from_victims
    _stragglers = faults.migrate_stragglers
    _grow = growth.grow_elastic_jobs
    #: Whether a quiet pass reads its plain waiters from the queue kept between passes
    #: (``admission._kept_quiet_queue``) rather than visiting every job; the same decisions.
    kept_queue = True

    # --- run ----------------------------------------------------------------------------------

    def run(self) -> Plan:
        """Apply the rules in order and return the plan."""
        if self.snapshot.paused:
            for job in self.jobs.values():
                if job.phase in WAITING_PHASES:
                    self._hold(job, "planner_paused", "The planner is paused by an operator; nothing is "
                               "placed, resized or preempted until it resumes.")
            return Plan(tuple(self.actions), None, paused=True)
        self._reservations()
        self._drains()
        self._lend_idle_phases()
        self._queue()
        self._stragglers()
        self._grow()
        return Plan(tuple(self.actions), None if self.wake == INFINITY else self.wake)


"""One planning pass: ``plan(snapshot, now_s, config) -> Plan``.

The pass applies the rules in a fixed order, each in its own module (see docs/planner.md):

1. reservations (rules 2, 3): summarise each pool; reclaim loans whose lead time has come;
2. drains (rule 7): move work off draining nodes gracefully;
3. the waiting queue (rules 4, 5, 6, 7, 8): entitled owners, then fault recovery, then the
   rest by class and age; each is placed on free GPUs (harvesting lendable reserved ones),
   else given GPUs taken from cheaper victims, else held with the reason why;
4. stragglers (rule 7): migrate replicas off slow nodes when it pays;
5. growth (rule 5): elastic jobs grow into GPUs nobody waits for, with hysteresis.

Everything iterates in sorted order, so the same snapshot always yields the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice

from jobs.planner.config import PlannerConfig
from jobs.planner.decisions import Action, Plan, Reason
from jobs.planner.entitlements import is_active, next_boundary_s, next_start_s
from jobs.planner.faults import continue_on_survivors_dp, straggler_gain, surviving_replicas
from jobs.planner.harvest import PoolState, fits_in_grace, lendable_gpus, pool_state, reclaim_due_s
from jobs.planner.layout import accum_steps, batch_divides, replicas_of, valid_dps
from jobs.planner.rhythm import min_loan_window_s, predict, reclaim_lead_time, step_time_at
from jobs.planner.snapshot import (
    PLACEABLE_HEALTH,
    PRIORITY_RANK,
    TERMINAL_PHASES,
    WAITING_PHASES,
    Gpu,
    Job,
    Reservation,
    Snapshot,
)
from jobs.planner.starvation import effective_rank, is_aged, protected_by_min_run, queue_key, waited_s
from jobs.planner.topology import ClusterView, choose_gpus, spread_of
from jobs.planner.victims import (
    VictimOption,
    choose_victims,
    victim_options_off_pool,
    victim_sort_key,
)

INFINITY = math.inf
LOST_HEALTH = frozenset({"failed"})
RELEASING_COMMANDS = frozenset({"preempt", "reclaim"})

# Queue tiers: lower goes first.
TIER_ENTITLED = 0
TIER_RECOVERING = 1
TIER_CRITICAL = 2
TIER_OTHER = 3


def plan(snapshot: Snapshot, now_s: float, config: PlannerConfig | None = None) -> Plan:
    """Decide what every job should do now. Pure and deterministic; see the module docstring."""
    return PlanningPass(snapshot, now_s, config or PlannerConfig()).run()


@dataclass(frozen=True, slots=True)
class _VictimEntry:
    """A possible victim with the facts every victim search filters on."""

    job: Job
    zones: frozenset[str | None]
    rank: int
    protected: bool
    excess: bool
    aged: bool


def _pool_label(name: str) -> str:
    """How a pool is named to a researcher: a reservation, or a job's lent-out idle phase."""
    if name.startswith("idle:"):
        return f"the idle phase of {name[5:]}"
    return f"reservation '{name}'"


def _upper_first(text: str) -> str:
    return text[:1].upper() + text[1:]


def _replicas(n: int) -> str:
    return f"{n} replica" if n == 1 else f"{n} replicas"


def _fmt_t(t: float) -> str:
    return "never" if t == INFINITY else f"t={t:.0f}s"


class PlanningPass:
    """The mutable working state of one pass; build it, call ``run()`` once."""

    def __init__(self, snapshot: Snapshot, now_s: float, config: PlannerConfig) -> None:
        self.snapshot = snapshot
        self.now = float(now_s)
        self.config = config
        self.kill = config.reclaim_mode == "kill"
        self.jobs: dict[str, Job] = {
            j.name: j for j in sorted(snapshot.jobs, key=lambda j: j.name) if j.phase not in TERMINAL_PHASES
        }
        self.busy: set[str] = {c.job for c in snapshot.commands}
        self.view = ClusterView(snapshot)
        self.nodes = self.view.nodes
        self.reservations: list[Reservation] = sorted(snapshot.reservations, key=lambda r: r.name)
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
                if node is None or node.health not in PLACEABLE_HEALTH:
                    continue
                zone = self.view.zone(g)
                self.soon_free[zone] = self.soon_free.get(zone, 0) + 1
                self.soon_free_by.setdefault(zone, []).append(job.name)
        self.capacity_blocked_rank = 99
        self._victims_sorted: list[_VictimEntry] | None = None
        self._victims_acted_seen = 0
        self._victims_head = 0
        self._place_failed: dict[tuple, int] = {}
        self._lendable_pools: list[tuple[str, PoolState]] | None = None
        self._bound_cache: dict[tuple, int] = {}
        self._pools_bound_cache: dict[tuple, tuple[int, dict[str, tuple[int, int]]]] = {}
        self._zones_cache: dict[tuple[str, int], dict[str | None, int | None]] = {}
        self.victim_failed_at: dict[tuple[int, int, bool, bool], int] = {}

    # --- helpers ----------------------------------------------------------------------------

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
        inputs = {"cause": cause, **inputs}
        self._emit("hold", job, job.gpus, Reason("hold", text, inputs))

    def _wake_at(self, t: float) -> None:
        if self.now < t < self.wake:
            self.wake = t

    def _own_pools(self, job: Job) -> list[PoolState]:
        return [self.pools[r.name] for r in self.res_of_job.get(job.name, ()) if r.name in self.pools]

    def _entitled_now(self, job: Job) -> bool:
        resv = self.res_of_job.get(job.name)
        return bool(resv) and any(is_active(r, self.now) for r in resv)

    def _dormant_between_windows(self, job: Job) -> Reservation | None:
        """The recurring reservation a critical job waits for, if it is between windows."""
        resv = self.res_of_job.get(job.name, ())
        recurring = [r for r in resv if r.period_s]
        if not recurring or any(is_active(r, self.now) for r in resv):
            return None
        return min(recurring, key=lambda r: (next_start_s(r, self.now), r.name))

    # --- 1. reservations ----------------------------------------------------------------------

    def _pool_gpus(self, res: Reservation) -> tuple[int, list[Gpu]]:
        healthy = 0
        held: list[Gpu] = []
        for name in res.nodes:
            node = self.nodes.get(name)
            if node is None or node.health not in PLACEABLE_HEALTH:
                continue
            if self.view.zone_of_node.get(name) != res.name:
                continue
            healthy += node.gpus
            for i in sorted(self.view.held_by_node.get(name, ())):
                g = Gpu(name, i)
                if g in self.view.owner:
                    held.append(g)
        return healthy, held

    def _reservations(self) -> None:
        for res in self.reservations:
            self._wake_at(next_boundary_s(res, self.now))
            if not res.nodes:
                continue
            owner = self.jobs.get(res.job)
            healthy, held = self._pool_gpus(res)
            free = self.view.free_count(res.name)
            pool = pool_state(res, owner, self.now, healthy, free, owner_busy=res.job in self.busy)
            self.pools[res.name] = pool
            if pool.next_need_s < INFINITY:
                self._wake_at(pool.next_need_s)
            # GPUs already on their way back count as returned.
            returning = 0
            borrowers: dict[str, list[Gpu]] = {}
            for g in held:
                holder = self.view.owner[g]
                if holder == res.job:
                    continue
                if holder in self.busy:
                    returning += 1
                    continue
                borrowers.setdefault(holder, []).append(g)
            deficit = pool.must_be_free - pool.free_gpus - returning
            if deficit <= 0 or pool.next_need_s == INFINITY or not borrowers:
                continue
            candidates = sorted(
                (self.jobs[b] for b in borrowers if b in self.jobs and b not in self.acted),
                key=lambda j: victim_sort_key(j, self.config),
            )
            if not candidates:
                continue
            # Nothing can be due before the longest lead time: just ask to be woken then.
            earliest_due = min(reclaim_due_s(j, pool, self.config) for j in candidates)
            if earliest_due > self.now + 1e-9:
                self._wake_at(earliest_due)
                continue
            pool_nodes = set(res.nodes)
            options = choose_victims(
                candidates,
                lambda freed, nodes=pool_nodes, short=deficit: sum(1 for g in freed if g.node in nodes) >= short,
                self.config,
                drop_first=lambda replica, nodes=pool_nodes: any(g.node in nodes for g in replica),
            )
            if options is None:
                # Not enough on loan to cover it (e.g. a failed pool node): reclaim them all.
                options = []
                for job in candidates:
                    options.append(victim_options_off_pool(job, self.config, pool_nodes))
            for opt in options:
                due = reclaim_due_s(opt.job, pool, self.config)
                if due <= self.now + 1e-9:
                    self._reclaim(opt, res, pool)
                else:
                    self._wake_at(due)

    def _reclaim(self, opt: VictimOption, res: Reservation, pool: PoolState) -> None:
        job = opt.job
        lead_s = reclaim_lead_time(job, self.config)
        need_s = pool.next_need_s
        inputs = {
            "reservation": res.name,
            "need_at_s": need_s,
            "lead_time_s": round(lead_s, 3),
            "predicted_save_s": predict(job, self.config).save_s,
            "safety_factor": self.config.safety_factor,
            "gpus_returned": len(opt.freed),
        }
        if self.kill:
            text = (
                f"{_upper_first(_pool_label(res.name))} needs its GPUs now; the job was stopped without a "
                f"checkpoint to return {len(opt.freed)} GPUs at once."
            )
            deadline = self.now
        else:
            deadline = max(need_s, self.now + lead_s)
            if need_s <= self.now + 1e-9:
                text = (
                    f"{_upper_first(_pool_label(res.name))} needs these GPUs now (its job became entitled or lost "
                    f"GPUs to a fault); the job saves its checkpoint and returns {len(opt.freed)} GPUs "
                    f"within {lead_s:.0f}s (predicted save x safety {self.config.safety_factor} + step + margin)."
                )
            else:
                text = (
                    f"{_upper_first(_pool_label(res.name))} needs its GPUs at {_fmt_t(need_s)}; the loan ends now, "
                    f"{lead_s:.0f}s ahead (predicted save {inputs['predicted_save_s']:.0f}s x safety "
                    f"{self.config.safety_factor} + step + margin), so the job saves before then."
                )
        self._emit(
            "reclaim",
            job,
            opt.kept,
            Reason("harvest.reclaim", text, inputs),
            deadline_s=deadline,
            graceful=not self.kill,
            forced=True,
        )

    # --- 2. drains ----------------------------------------------------------------------------

    def _drains(self) -> None:
        draining = {n for n, node in self.nodes.items() if node.health in ("draining",)}
        if not draining:
            return
        for job in self.jobs.values():
            if job.name in self.busy or job.name in self.acted or not job.holdings:
                continue
            if job.phase not in ("running", "checkpointing"):
                continue
            if not any(g.node in draining for g in job.gpus):
                continue
            replicas = replicas_of(job, job.gpus)
            keep = [r for r in replicas if not any(g.node in draining for g in r)]
            lost = len(replicas) - len(keep)
            kept_gpus = [g for r in keep for g in r]
            zones = self._zones_for(job, job.current_dp)
            cand = self.view.candidates(zones)
            anchor = sorted({g.node for g in kept_gpus})
            new = choose_gpus(cand, self.nodes, job.tp, job.pp, lost, anchor)
            p = predict(job, self.config)
            deadline = self.now + p.save_s + self.config.reclaim_grace_s
            inputs = {"draining_nodes": sorted({g.node for g in job.gpus if g.node in draining}),
                      "replicas_affected": lost, "predicted_save_s": p.save_s}
            if new is not None:
                after = kept_gpus + list(new)
                self._emit("migrate", job, after,
                           Reason("drain", f"Node drained by an operator: {lost} replica(s) move to "
                                  f"{spread_of(new, self.nodes).describe()} after a checkpoint.",
                                  {**inputs, **spread_of(after, self.nodes).as_inputs()}),
                           deadline_s=deadline, forced=True)
                continue
            d = continue_on_survivors_dp(job, len(keep))
            if d is not None:
                after = [g for r in keep[:d] for g in r]
                self._emit("shrink", job, after,
                           Reason("drain", f"Node drained by an operator and no free GPUs to move to: "
                                  f"the job saves and continues on {d} replicas; accumulation "
                                  f"goes from {accum_steps(job, job.current_dp)} to {accum_steps(job, d)} "
                                  f"so the global batch stays {job.global_batch}.", inputs),
                           deadline_s=deadline, forced=True)
                continue
            self._emit("preempt", job, (),
                       Reason("drain", "Node drained by an operator and no free GPUs to move to: the "
                              "job saves its checkpoint and waits to be placed elsewhere.", inputs),
                       deadline_s=deadline, graceful=not self.kill, forced=True)

    # --- 2b. idle phases (rule 3) ------------------------------------------------------------

    def _lend_idle_phases(self) -> None:
        """Lend the GPUs of jobs in a known idle phase to waiting work, for the phase's length."""
        idle = [j for j in self.jobs.values()
                if j.idle_until_s is not None and j.holdings and j.phase == "running"
                and j.name not in self.busy and j.name not in self.acted
                and j.idle_until_s - self.now >= self.config.idle_lend_min_s]
        if not idle:
            return
        waiting = [j for j in self.jobs.values()
                   if j.phase in WAITING_PHASES and not j.parked and j.priority != "critical"
                   and j.name not in self.busy and self._dormant_between_windows(j) is None]
        if not waiting:
            return
        for job in idle:
            nodes = {g.node for g in job.gpus}
            whole = all(
                self.view.zone_of_node.get(n) is None
                and self.nodes[n].health in PLACEABLE_HEALTH
                and len(self.view.held_by_node.get(n, ())) == self.nodes[n].gpus
                and all(self.view.owner.get(Gpu(n, i)) == job.name for i in range(self.nodes[n].gpus))
                for n in nodes
            )
            if not whole:
                continue
            remaining_s = job.idle_until_s - self.now  # type: ignore[operator]
            p = predict(job, self.config)
            takers = [
                w.name for w in waiting
                if w.dp_min * w.tp * w.pp <= len(job.holdings)
                and min_loan_window_s(w, w.dp_min, self.config) + p.load_s <= remaining_s
            ]
            if not takers:
                continue
            self._emit("lend", job, (),
                       Reason("harvest.idle",
                              f"The job is in a known idle phase for another {remaining_s:.0f}s; its "
                              f"{len(job.holdings)} GPUs are lent to waiting work ({', '.join(sorted(takers)[:3])}) "
                              f"and reclaimed with a checkpoint before {_fmt_t(job.idle_until_s)}, when it "
                              f"reloads ({p.load_s:.0f}s) and continues.",
                              {"idle_until_s": job.idle_until_s, "idle_remaining_s": round(remaining_s, 1),
                               "gpus_lent": len(job.holdings), "predicted_load_s": p.load_s,
                               "candidates": sorted(takers)[:5]}),
                       deadline_s=job.idle_until_s)

    # --- 3. the waiting queue -----------------------------------------------------------------

    def _zones_for(self, job: Job, dp: int) -> dict[str | None, int | None]:
        """Zones ``job`` may draw GPUs from at ``dp``: general, its own pools, lendable pools."""
        key = (job.name, dp)
        hit = self._zones_cache.get(key)
        if hit is not None:
            return dict(hit)
        zones = self._compute_zones(job, dp)
        self._zones_cache[key] = zones
        return dict(zones)

    def _compute_zones(self, job: Job, dp: int) -> dict[str | None, int | None]:
        zones: dict[str | None, int | None] = {None: None}
        for res in self.res_of_job.get(job.name, ()):
            if res.name in self.pools:
                zones[res.name] = None
        if job.priority == "critical":
            # A critical job outside its own reservation never borrows: it would be reclaimed
            # from, which it must not be.
            return zones
        if self._lendable_pools is None:
            self._lendable_pools = [(name, pool) for name, pool in sorted(self.pools.items()) if pool.free_gpus > 0]
        needed_s: float | None = None
        totals = self.view.zone_total
        if any(totals.get(name, 0) <= 0 for name, _ in self._lendable_pools) and not self.kill:
            # Exhausted pools stay exhausted for the rest of a graceful pass (GPUs given back
            # come free only after the borrower has saved): stop looking at them.
            self._lendable_pools = [(n, p) for n, p in self._lendable_pools if totals.get(n, 0) > 0]
        for name, pool in self._lendable_pools:
            if name in zones or totals.get(name, 0) <= 0:
                continue
            if not pool.need_predictable and not self.kill and not fits_in_grace(job, self.config):
                continue
            window_s = pool.next_need_s - self.now
            if window_s > 0 and needed_s is None:
                needed_s = 0.0 if self.kill else min_loan_window_s(job, dp, self.config)
            n = pool.free_gpus if window_s > 0 and needed_s is not None and window_s >= needed_s else pool.spare_lendable
            if n > 0:
                zones[name] = n
        return zones

    def _tier(self, job: Job) -> int:
        if self._entitled_now(job):
            return TIER_ENTITLED
        if job.phase == "recovering":
            return TIER_RECOVERING
        if job.priority == "critical":
            return TIER_CRITICAL
        return TIER_OTHER

    def _queue(self) -> None:
        waiting: list[tuple[tuple, Job]] = []
        lost_nodes = {n for n, node in self.nodes.items() if node.health in LOST_HEALTH}
        for job in self.jobs.values():
            if job.name in self.busy or job.name in self.acted:
                continue
            has_lost = bool(lost_nodes) and bool(job.holdings) and any(
                h.gpu.node in lost_nodes or h.gpu.node not in self.nodes for h in job.holdings
            )
            if job.phase in WAITING_PHASES or job.phase == "recovering" or has_lost:
                if job.parked and job.idle_until_s is not None and job.idle_until_s > self.now:
                    self._hold(job, "idle_phase",
                               f"In an idle phase (evaluation or data stall) until {_fmt_t(job.idle_until_s)}; "
                               f"its {len(job.parked)} GPUs are lent meanwhile and come back by then.",
                               idle_until_s=job.idle_until_s, gpus_lent=len(job.parked))
                    continue
                dormant = self._dormant_between_windows(job)
                if dormant is not None and not job.holdings:
                    t = next_start_s(dormant, self.now)
                    self._hold(job, "between_windows",
                               f"Waiting for its reservation window '{dormant.name}' to open at "
                               f"{_fmt_t(t)}; the job needs no GPUs between windows.",
                               reservation=dormant.name, next_start_s=None if t == INFINITY else t)
                    continue
                waiting.append((queue_key(job, self.now, self.config, self._tier(job)), job))
        waiting.sort(key=lambda kv: kv[0])
        for _, job in waiting:
            self._admit(job)

    def _free_total(self, zones: dict[str | None, int | None]) -> int:
        totals = self.view.zone_total
        total = 0
        for zone, limit in zones.items():
            n = totals.get(zone, 0)
            if n:
                total += n if limit is None else min(n, limit)
        return total

    def _admit(self, job: Job) -> None:
        rep = job.tp * job.pp
        dps = [d for d in reversed(valid_dps(job)) if d <= job.dp]
        if not dps:
            dps = list(reversed(valid_dps(job)))
        preferred = dps[0]
        rank = effective_rank(job, self.now, self.config)
        if not job.holdings and job.phase != "recovering" and not job.parked:
            # Cheapest test first, for long queues: fewer GPUs free anywhere than the job's
            # smallest size, nothing coming back, and no way to take GPUs from others.
            groups = self._groups_upper_bound(job)
            blocked = dps[-1] * job.pp > groups and not any(self.soon_free.values())
            if not blocked and not self._entitled_now(job):
                # Count only the zones this job may really use, and what is coming back there.
                zones_min = self._zones_for(job, dps[-1])
                groups = sum(
                    self.view.free_groups(z, job.tp) if limit is None
                    else min(self.view.free_groups(z, job.tp), limit // job.tp)
                    for z, limit in zones_min.items()
                )
                soon = sum(self.soon_free.get(z, 0) for z in zones_min)
                blocked = (dps[-1] * job.pp > groups and soon == 0) or (
                    self._free_total(zones_min) + soon < dps[-1] * rep)
            if blocked and not self._entitled_now(job):
                aged = job.priority == "regular" and is_aged(job, self.now, self.config)
                key = (PRIORITY_RANK[job.priority], rank, False, aged)
                if rank >= PRIORITY_RANK["best_effort"] or self.victim_failed_at.get(key, 1 << 30) <= dps[-1] * rep:
                    self._hold_queue_full(job, preferred, rep, groups * job.tp, rank)
                    return
        recovering = job.phase == "recovering" or (bool(job.holdings) and any(
            self.nodes.get(h.gpu.node) is None or self.nodes[h.gpu.node].health in LOST_HEALTH for h in job.holdings
        ))
        survivors = surviving_replicas(job, self.nodes, LOST_HEALTH) if job.holdings else []
        held_dp = len(survivors)
        survivor_gpus = [g for r in survivors for g in r]
        anchor = sorted({g.node for g in survivor_gpus}) or sorted({h.gpu.node for h in job.holdings})
        entitled = self._entitled_now(job)
        kind = "recover" if recovering else "place"
        forced = entitled or recovering

        # Fast path for a long queue: nothing free for even the smallest size, nothing on its
        # way back, and no way to take GPUs (best-effort, or a victim search that already
        # failed for a request this size in this pass): hold at once.
        if not forced:
            smallest_need = dps[-1] * rep
            zones_min = self._zones_for(job, dps[-1])
            if (self._free_total(zones_min) < smallest_need
                    and not any(self.soon_free.get(z, 0) for z in zones_min)):
                aged = job.priority == "regular" and is_aged(job, self.now, self.config)
                key = (PRIORITY_RANK[job.priority], rank, False, aged)
                if rank >= PRIORITY_RANK["best_effort"] or self.victim_failed_at.get(key, 1 << 30) <= smallest_need:
                    self._hold_for_capacity(job, preferred, rep, self._free_total(self._zones_for(job, preferred)), rank)
                    return

        # (a) Fault with enough survivors: continue on them (rule 7) unless spares are at hand.
        if recovering and held_dp:
            d_surv = continue_on_survivors_dp(job, held_dp)
            full = self._try_place(job, preferred, held_dp, survivor_gpus, anchor, kind, entitled)
            if full:
                return
            if d_surv is not None:
                after = [g for r in survivors[:d_surv] for g in r]
                self._emit("shrink", job, after,
                           Reason("faults", f"A node failed; {held_dp} whole replicas survived, which "
                                  f"satisfies dp_min {job.dp_min}, so the job continues on {d_surv} "
                                  f"replicas from its last checkpoint instead of waiting. Accumulation "
                                  f"becomes {accum_steps(job, d_surv)} to keep the global batch "
                                  f"{job.global_batch}.",
                                  {"survivors": held_dp, "dp_min": job.dp_min, "dp_after": d_surv}),
                           forced=True)
                return

        # (b) Free GPUs at the preferred size: an entitled job's own pool first, then general
        # capacity (and, for others, lendable reserved GPUs).
        if entitled and self._try_place(job, preferred, 0, [], anchor, kind, entitled, own_pool_only=True):
            return
        if self._try_place(job, preferred, 0, [], anchor, kind, entitled):
            return
        # (c) GPUs already on their way back to the queue: wait for them rather than take more.
        wait_dp = preferred if (job.priority == "critical" or recovering) else dps[-1]
        need = wait_dp * rep
        zones = self._zones_for(job, wait_dp)
        free_total = self._free_total(zones)
        soon = sum(self.soon_free.get(z, 0) for z in zones)
        if free_total + soon >= need and soon > 0:
            self._claim_soon_free(zones, need - free_total)
            self._claim_free(job, zones, free_total)
            names = sorted({n for z in zones for n in self.soon_free_by.get(z, [])})
            self._hold(job, "waiting_for_release",
                       f"Waiting for {need - free_total} GPUs that {', '.join(names[:5]) or 'other jobs'} "
                       f"are saving and releasing; then it starts on {_replicas(wait_dp)}.",
                       gpus_needed=need, gpus_free=free_total, gpus_returning=soon)
            return
        need = preferred * rep
        # (d) Critical work takes GPUs from cheaper victims at its preferred size (rule 4);
        # (e) others first start smaller on what is free (they grow later), and only then take
        # GPUs from victims, for their smallest batch-exact size.
        if job.priority == "critical" or recovering:
            if self._try_victims(job, preferred, zones, rank, forced, kind, entitled):
                return
        for d in dps[1:]:
            if self._try_place(job, d, 0, [], anchor, kind, entitled):
                return
        if job.priority != "critical" and not recovering:
            smallest = dps[-1]
            if self._try_victims(job, smallest, self._zones_for(job, smallest), rank, forced, kind, entitled):
                return
        # (f) Hold, saying why.
        self._hold_for_capacity(job, preferred, rep, free_total, rank)

    def _groups_upper_bound(self, job: Job) -> int:
        """At most how many free ``tp``-GPU groups any zone could give ``job`` now (cheap, cached)."""
        own = tuple(r.name for r in self.res_of_job.get(job.name, ()))  # already sorted
        key = (job.tp, job.priority == "critical", own, self.view.generation)
        hit = self._bound_cache.get(key)
        if hit is not None:
            return hit
        # The pools' part depends only on (tp, critical, free set), not on the job: count it
        # once for every pool as if none were the job's own, then correct for its own pools
        # (usually none or one) instead of walking every pool for every waiting job.
        critical = job.priority == "critical"
        pools_key = (job.tp, critical, self.view.generation)
        per_pool = self._pools_bound_cache.get(pools_key)
        if per_pool is None:
            shortest_s = self.config.startup_s + self.config.reclaim_margin_s
            parts: dict[str, tuple[int, int]] = {}
            other_total = 0
            for name, pool in self.pools.items():
                if not self.view.zone_total.get(name, 0):
                    continue
                groups = self.view.free_groups(name, job.tp)
                if self.kill:
                    other = groups
                elif not critical:
                    window_s = pool.next_need_s - self.now
                    other = groups if window_s > shortest_s else min(groups, pool.spare_lendable // job.tp)
                else:
                    other = 0
                parts[name] = (groups, other)
                other_total += other
            per_pool = (other_total, parts)
            self._pools_bound_cache[pools_key] = per_pool
        other_total, parts = per_pool
        bound = self.view.free_groups(None, job.tp) + other_total
        for name in set(own):
            part = parts.get(name)
            if part is not None:
                bound += part[0] - part[1]
        self._bound_cache[key] = bound
        return bound

    def _hold_queue_full(self, job: Job, preferred: int, rep: int, free_anywhere: int, rank: int) -> None:
        """The cheap hold for the tail of a long queue: nothing anywhere could start it."""
        self.capacity_blocked_rank = min(self.capacity_blocked_rank, PRIORITY_RANK[job.priority])
        need = preferred * rep
        why = ("best-effort jobs never preempt others" if rank >= PRIORITY_RANK["best_effort"]
               else "no lower-priority job can give GPUs back now")
        text = (f"Pending: needs {need} GPUs ({_replicas(preferred)} of {rep}; at least {job.dp_min * rep}) "
                f"and at most {free_anywhere} GPUs it may use are free in whole {job.tp}-GPU TP groups; {why}.")
        self.actions.append(Action(
            kind="hold", job=job.name,
            reason=Reason("hold", text, {"cause": "capacity", "gpus_needed": need, "gpus_min": job.dp_min * rep,
                                         "gpus_free": free_anywhere, "effective_rank": rank}),
            global_batch=job.global_batch,
        ))

    def _hold_for_capacity(self, job: Job, preferred: int, rep: int, free_total: int, rank: int) -> None:
        """Hold a job that cannot start now, with the reasons in plain words."""
        self.capacity_blocked_rank = min(self.capacity_blocked_rank, PRIORITY_RANK[job.priority])
        need = preferred * rep
        min_need = job.dp_min * rep
        lend_notes = []
        zones_min = self._zones_for(job, job.dp_min)
        for name, pool in self._lendable_pools or ():
            if len(lend_notes) >= 3:
                break
            if name in {r.name for r in self.res_of_job.get(job.name, ())} or job.priority == "critical":
                continue
            free_now = self.view.free_count(name)
            if free_now <= 0 or (zones_min.get(name) or 0) >= free_now:
                continue
            n, window_s, needed_s = lendable_gpus(pool, job, job.dp_min, self.now, self.config)
            lend_notes.append(
                f"{free_now - min(n, free_now)} GPUs of {_pool_label(name)} are free but the window before "
                f"they are needed ({window_s:.0f}s) is shorter than this job needs "
                f"({needed_s:.0f}s: start-up, load, {self.config.min_loan_steps} steps, save)"
            )
        text = (
            f"Pending: needs {need} GPUs ({_replicas(preferred)} of {rep}; at least {min_need}) and "
            f"{free_total} usable GPUs are free"
        )
        if lend_notes:
            text += "; " + "; ".join(lend_notes)
        if rank >= PRIORITY_RANK["best_effort"]:
            text += "; best-effort jobs never preempt others"
        else:
            text += "; no lower-priority job can give GPUs back now (min_run_s protects recent starts)"
        if waited_s(job, self.now) > 0 and rank < PRIORITY_RANK[job.priority]:
            text += f"; it has waited {waited_s(job, self.now):.0f}s and has aged up a class"
        self._hold(job, "capacity", text + ".", gpus_needed=need, gpus_min=min_need,
                   gpus_free=free_total, waited_s=round(waited_s(job, self.now), 1),
                   effective_rank=rank)

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
        for z in zones:
            take = min(n, self.soon_free.get(z, 0))
            self.soon_free[z] = self.soon_free.get(z, 0) - take
            n -= take
            if n <= 0:
                return

    def _try_place(
        self,
        job: Job,
        dp: int,
        held_dp: int,
        held_gpus: list[Gpu],
        anchor: Sequence[str],
        kind: str,
        entitled: bool,
        own_pool_only: bool = False,
    ) -> bool:
        extra = dp - held_dp
        if extra < 0:
            return False
        zones = self._zones_for(job, dp)
        if own_pool_only:
            own = {r.name for r in self.res_of_job.get(job.name, ())}
            zones = {z: n for z, n in zones.items() if z in own}
            if not zones:
                return False
        if self._free_total(zones) < extra * job.tp * job.pp:
            return False
        if extra == 0:
            new: tuple[Gpu, ...] = ()
        else:
            # A request that did not fit still does not fit (nor does a bigger one) until the
            # free set changes: remember failures per zone set and shape.
            memo_key = (tuple(sorted(zones.items(), key=lambda kv: (kv[0] is not None, kv[0] or ""))),
                        job.tp, job.pp, self.view.generation)
            if self._place_failed.get(memo_key, 1 << 30) <= extra:
                return False
            groups = sum(
                self.view.free_groups(z, job.tp) if limit is None
                else min(self.view.free_groups(z, job.tp), limit // job.tp)
                for z, limit in zones.items()
            )
            if groups < extra * job.pp:
                self._place_failed[memo_key] = min(extra, self._place_failed.get(memo_key, 1 << 30))
                return False
            found = self.view.place(zones, job.tp, job.pp, extra, anchor)
            if found is None:
                self._place_failed[memo_key] = min(extra, self._place_failed.get(memo_key, 1 << 30))
                return False
            new = found
        after = list(held_gpus) + list(new)
        self._emit_start(job, kind, after, dp, entitled)
        return True

    def _emit_start(self, job: Job, kind: str, after: list[Gpu], dp: int, entitled: bool) -> None:
        spread = spread_of(after, self.nodes)
        own = {r.name for r in self.res_of_job.get(job.name, ())}
        lent = sorted({z for g in after if (z := self.view.zone(g)) is not None and z not in own})
        inputs: dict[str, object] = {"dp": dp, "gpus": len(after), **spread.as_inputs(),
                                     "waited_s": round(waited_s(job, self.now), 1)}
        deadline = None
        if lent:
            loan_end = min(self.pools[z].next_need_s for z in lent)
            deadline = None if loan_end == INFINITY else loan_end
            kind_out = "lend"
            rule = "harvest.lend"
            window_notes = []
            for z in lent:
                pool = self.pools[z]
                n, window_s, needed_s = lendable_gpus(pool, job, dp, self.now, self.config)
                if pool.need_now > 0 and (window_s == INFINITY or n < pool.free_gpus or window_s <= 0):
                    window_notes.append(f"they are hot spares of '{z}', lent until a fault needs them")
                elif window_s == INFINITY:
                    window_notes.append(f"'{z}' does not need them again")
                elif n < pool.free_gpus or window_s <= 0:
                    window_notes.append(f"they are spares of '{z}' beyond what its next window needs")
                else:
                    window_notes.append(f"{_pool_label(z)} needs them in {window_s:.0f}s and this job needs a window "
                                        f"of {needed_s:.0f}s (start-up, load, {self.config.min_loan_steps} "
                                        f"steps, save)")
            text = (f"Started on {_replicas(dp)} ({len(after)} GPUs, {spread.describe()}) using lent "
                    f"GPUs nobody is using now: {'; '.join(window_notes)}.")
            if loan_end < INFINITY:
                text += f" The loan ends {_fmt_t(loan_end)}; the job will be asked to save ahead of it."
            inputs["loan_ends_s"] = None if loan_end == INFINITY else loan_end
            inputs["lead_time_s"] = round(reclaim_lead_time(job, self.config), 3)
        elif kind == "recover":
            kind_out = "recover"
            rule = "faults"
            text = (f"Recovering from a fault: restarts from step {job.last_checkpoint_step} on {dp} "
                    f"replica(s) ({spread.describe()}), nearest to where it ran.")
        else:
            kind_out = "place"
            rule = "entitlement" if entitled else "placement"
            own_active = [r.name for r in self.res_of_job.get(job.name, ()) if is_active(r, self.now)]
            if own_active and own_active[0].startswith("idle:"):
                who = "its idle phase is over and its lent GPUs are back"
            elif entitled:
                who = "its reservation is active"
            else:
                who = f"{len(after)} GPUs were free"
            text = f"Started on {_replicas(dp)} ({len(after)} GPUs, {spread.describe()}): {who}."
        if dp != job.dp:
            text += (f" Runs at dp {dp} instead of {job.dp} with accumulation {accum_steps(job, dp)}, "
                     f"keeping the global batch {job.global_batch}.")
        self._emit(kind_out, job, after, Reason(rule, text, inputs), deadline_s=deadline)

    def _try_victims(
        self,
        job: Job,
        dp: int,
        zones: dict[str | None, int | None],
        rank: int,
        forced: bool,
        kind: str,
        entitled: bool,
    ) -> bool:
        aged = job.priority == "regular" and is_aged(job, self.now, self.config)
        if rank >= PRIORITY_RANK["best_effort"] and not forced:
            return False
        key = (PRIORITY_RANK[job.priority], rank, forced, aged)
        need = dp * job.tp * job.pp
        if self.victim_failed_at.get(key, 1 << 30) <= need:
            return False
        my_rank = PRIORITY_RANK[job.priority]
        zone_set = set(zones)
        floors: dict[str, int] = {}

        def candidates() -> Iterator[Job]:
            # _victim_pool() is in victim order (lower class, elastic, cheapest first), so the
            # search stops at the first set that fits.
            pool = self._victim_pool()
            for entry in islice(pool, self._victims_head, None):
                other = entry.job
                if other.name == job.name or other.name in self.acted or zone_set.isdisjoint(entry.zones):
                    continue
                if entry.rank > my_rank:
                    if not forced and entry.protected:
                        continue
                elif entry.rank == my_rank:
                    # Same class: only replicas grown beyond the preferred size (cheap to give
                    # back), or, for a long waiter, a job that has had its min_run_s (rule 8).
                    if entry.excess and (forced or not entry.protected):
                        floors[other.name] = other.dp
                    elif not (aged and not entry.protected and not entry.aged):
                        continue
                else:
                    continue
                yield other

        # choose_gpus() finds a placement whenever the free whole TP groups number at least
        # dp * pp (it only fails when they are fewer), so the fit test counts groups: free
        # GPUs per node once per search (whole zones from the view's incrementally kept
        # counts), the victims already chosen incrementally (that list only grows), and per
        # test only the option's own freed GPUs, instead of re-merging every free node and
        # every chosen GPU per call.
        free_now = self._free_total(zones)
        tp = job.tp
        groups_needed = dp * job.pp
        view = self.view
        base: dict[str, int] = {}
        state: dict[str, object] = {}

        def have_free(node: str) -> int:
            z = view.zone_of_node.get(node)
            return len(view.free.get(z, {}).get(node, ())) if zones[z] is None else base.get(node, 0)

        def count(gpus: Sequence[Gpu], into: dict[str, int]) -> None:
            for g in gpus:
                if view.zone(g) in zone_set and self.nodes[g.node].health in PLACEABLE_HEALTH:
                    into[g.node] = into.get(g.node, 0) + 1

        def fits_split(chosen: list[Gpu], extra: Sequence[Gpu]) -> bool:
            if free_now + len(chosen) + len(extra) < need:
                return False
            if groups_needed <= 0:
                return True
            if "groups" not in state:
                total = 0
                for z, limit in zones.items():
                    if limit is None:
                        total += view.free_groups(z, tp)
                    else:
                        # Same counts as view.candidates() for a capped zone.
                        for n, idx in view.candidates({z: limit}).items():
                            base[n] = len(idx)
                            total += len(idx) // tp
                state["groups"] = total
            if state.get("list") is not chosen:
                state["list"], state["seen"], state["added"], state["gain"] = chosen, 0, {}, 0
            added: dict[str, int] = state["added"]  # type: ignore[assignment]
            seen: int = state["seen"]  # type: ignore[assignment]
            if seen < len(chosen):
                more: dict[str, int] = {}
                count(chosen[seen:], more)
                gain: int = state["gain"]  # type: ignore[assignment]
                for node, k in more.items():
                    now = have_free(node) + added.get(node, 0)
                    gain += (now + k) // tp - now // tp
                    added[node] = added.get(node, 0) + k
                state["seen"], state["gain"] = len(chosen), gain
            extra_added: dict[str, int] = {}
            count(extra, extra_added)
            groups: int = state["groups"] + state["gain"]  # type: ignore[operator]
            for node, k in extra_added.items():
                now = have_free(node) + added.get(node, 0)
                groups += (now + k) // tp - now // tp
            return groups >= groups_needed

        def fits(freed: list[Gpu]) -> bool:
            return fits_split([], freed)

        options = choose_victims(candidates(), fits, self.config, floor_dp=lambda j: floors.get(j.name),
                                 fits_split=fits_split)
        if options is None:
            self.victim_failed_at[key] = min(need, self.victim_failed_at.get(key, 1 << 30))
            return False
        names = []
        for opt in options:
            names.append(opt.job.name)
            self._emit_victim(opt, job, forced, aged)
        if self.kill:
            return self._try_place(job, dp, 0, [], [], kind, entitled)
        soon_gpus = sum(len(o.freed) for o in options)
        self._claim_soon_free(zones, soon_gpus)
        self._claim_free(job, zones, need)
        self._hold(job, "waiting_for_release",
                   f"Waiting for {soon_gpus} GPUs that {', '.join(names)} are saving and releasing; "
                   f"then it starts on {_replicas(dp)}.",
                   gpus_needed=need, victims=names)
        return True

    def _victim_pool(self) -> list[_VictimEntry]:
        """Running non-critical jobs that could give GPUs back, in victim order.

        Built once per pass with what the filters need precomputed; entries already acted on
        are dropped from time to time so later searches stay short.
        """
        if self._victims_sorted is None:
            pool = [
                j for j in self.jobs.values()
                if j.holdings and j.phase in ("running", "checkpointing") and j.name not in self.busy
                and PRIORITY_RANK[j.priority] > 0
            ]
            pool.sort(key=lambda j: victim_sort_key(j, self.config))
            self._victims_sorted = [
                _VictimEntry(
                    job=j,
                    zones=frozenset(self.view.zone_of_node.get(h.gpu.node) for h in j.holdings),
                    rank=PRIORITY_RANK[j.priority],
                    protected=protected_by_min_run(j, self.now),
                    excess=j.current_dp > j.dp,
                    aged=is_aged(j, self.now, self.config),
                )
                for j in pool
            ]
            self._victims_acted_seen = len(self.acted)
            self._victims_head = 0
        elif len(self.acted) - self._victims_acted_seen >= max(16, len(self._victims_sorted) // 8):
            self._victims_sorted = [e for e in self._victims_sorted if e.job.name not in self.acted]
            self._victims_acted_seen = len(self.acted)
            self._victims_head = 0
        # The cheapest victims are taken first, so acted-on entries gather at the head: skip
        # that prefix once instead of re-testing it on every search (the searches skip acted
        # entries anyway).
        entries = self._victims_sorted
        head = self._victims_head
        while head < len(entries) and entries[head].job.name in self.acted:
            head += 1
        self._victims_head = head
        return entries

    def _emit_victim(self, opt: VictimOption, requester: Job, forced: bool, aged: bool) -> None:
        job = opt.job
        p = predict(job, self.config)
        unsaved = max(0, job.committed_steps - job.last_checkpoint_step)
        inputs = {
            "for_job": requester.name,
            "for_priority": requester.priority,
            "victim_priority": job.priority,
            "steps_since_save": unsaved,
            "predicted_step_s": round(p.step_s, 3),
            "predicted_save_s": p.save_s,
            "loss_gpu_s": round(opt.cost_gpu_s, 1),
            "gpus_freed": len(opt.freed),
            "run_s": round(self.now - job.run_started_s, 1) if job.run_started_s is not None else 0.0,
            "min_run_s": job.min_run_s,
        }
        why = (f"{requester.name} ({requester.priority}"
               f"{', waiting ' + format(waited_s(requester, self.now), '.0f') + 's' if aged else ''}) needs GPUs")
        deadline = self.now + p.step_s + p.save_s * self.config.safety_factor + self.config.reclaim_margin_s
        rule = "victims" if not aged or PRIORITY_RANK[job.priority] > 1 else "starvation"
        if opt.is_shrink:
            d_after = len(opt.kept) // (job.tp * job.pp)
            text = (f"{why}; this {job.priority} job gives back {len(opt.freed)} GPUs by shrinking from dp "
                    f"{job.current_dp} to {d_after} (accumulation {accum_steps(job, job.current_dp)} -> "
                    f"{accum_steps(job, d_after)}, global batch {job.global_batch} unchanged) rather "
                    f"than stopping; it was the cheapest choice ({opt.cost_gpu_s:.0f} GPU-s at risk).")
            self._emit("shrink", job, opt.kept, Reason(rule, text, inputs),
                       deadline_s=deadline, graceful=not self.kill, forced=forced)
        else:
            text = (f"{why}; this {job.priority} job was the cheapest to stop ({unsaved} steps since its "
                    f"last save, {opt.cost_gpu_s:.0f} GPU-s at risk)"
                    f"{'' if self.kill else ' and saves a checkpoint first'}.")
            self._emit("preempt", job, (), Reason(rule, text, inputs),
                       deadline_s=deadline, graceful=not self.kill, forced=forced)

    # --- 4. stragglers ------------------------------------------------------------------------

    def _stragglers(self) -> None:
        slow = {n: node.speed_factor for n, node in self.nodes.items()
                if node.speed_factor >= self.config.straggler_factor}
        if not slow:
            return
        for job in self.jobs.values():
            if job.name in self.busy or job.name in self.acted or job.phase != "running":
                continue
            on_slow = sorted({g.node for g in job.gpus if g.node in slow})
            if not on_slow:
                continue
            factor = max(slow[n] for n in on_slow)
            gain, cost = straggler_gain(job, factor, self.config)
            inputs = {"slow_nodes": on_slow, "speed_factor": factor, "gain_gpu_s": round(gain, 1),
                      "move_cost_gpu_s": round(cost, 1)}
            if gain < self.config.migrate_gain_factor * cost:
                continue
            replicas = replicas_of(job, job.gpus)
            keep = [r for r in replicas if not any(g.node in slow for g in r)]
            kept_gpus = [g for r in keep for g in r]
            cand = {n: v for n, v in self.view.candidates(self._zones_for(job, job.current_dp)).items()
                    if n not in slow}
            new = choose_gpus(cand, self.nodes, job.tp, job.pp, len(replicas) - len(keep),
                              sorted({g.node for g in kept_gpus}))
            if new is None:
                continue
            after = kept_gpus + list(new)
            self._emit("migrate", job, after,
                       Reason("faults.straggler",
                              f"Node(s) {', '.join(on_slow)} run {factor:.2f}x slower; moving "
                              f"{len(replicas) - len(keep)} replica(s) saves about {gain:.0f} GPU-s over the "
                              f"remaining {job.remaining_steps} steps against a move cost of {cost:.0f} GPU-s.",
                              {**inputs, **spread_of(after, self.nodes).as_inputs()}))

    # --- 5. growth ----------------------------------------------------------------------------

    def _grow(self) -> None:
        growers = sorted(
            (j for j in self.jobs.values()
             if j.phase == "running" and j.name not in self.busy and j.name not in self.acted
             and j.holdings and j.current_dp < j.dp_max),
            key=lambda j: (PRIORITY_RANK[j.priority], j.name),
        )
        for job in growers:
            if PRIORITY_RANK[job.priority] >= self.capacity_blocked_rank:
                continue
            since = job.last_resize_s if job.last_resize_s is not None else job.run_started_s
            if since is not None and self.now - since < self.config.resize_hysteresis_s:
                # No wake-up for this: growth is opportunistic and the next pass will do.
                continue
            d = job.current_dp
            zones = self._zones_for(job, job.dp_max)
            free = self._free_total(zones)
            if free < job.tp * job.pp:
                continue
            cand = self.view.candidates(zones)
            anchor = sorted({g.node for g in job.gpus})
            p = predict(job, self.config)
            for target in range(job.dp_max, d, -1):
                if not batch_divides(job, target):
                    continue
                if (target - d) * job.tp * job.pp > free:
                    continue
                now_step = step_time_at(job, d, p.mean_step_s, d)
                new_step = step_time_at(job, target, p.mean_step_s, d)
                saved_s = job.remaining_steps * (now_step - new_step)
                cost_s = p.step_s + p.save_s + p.load_s
                if saved_s < self.config.grow_gain_factor * cost_s:
                    continue
                new = choose_gpus(cand, self.nodes, job.tp, job.pp, target - d, anchor)
                if new is None:
                    continue
                after = list(job.gpus) + list(new)
                lent = sorted({z for g in new if (z := self.view.zone(g)) is not None})
                loan_end = min((self.pools[z].next_need_s for z in lent), default=INFINITY)
                self._emit("lend" if lent else "grow", job, after,
                           Reason("resize",
                                  f"{len(new)} GPUs are free and nobody of equal or higher priority is "
                                  f"waiting: the job grows from dp {d} to {target}; accumulation goes "
                                  f"{accum_steps(job, d)} -> {accum_steps(job, target)} so the global batch "
                                  f"stays {job.global_batch}. Predicted saving {saved_s:.0f}s over the "
                                  f"remaining run against {cost_s:.0f}s to resize.",
                                  {"dp_before": d, "dp_after": target, "saved_s": round(saved_s, 1),
                                   "resize_cost_s": round(cost_s, 1), "free_gpus": free,
                                   **spread_of(after, self.nodes).as_inputs()}),
                           deadline_s=loan_end if loan_end < INFINITY else None)
                break

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


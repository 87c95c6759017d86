"""The discrete-event engine: plays the cluster, the clock and the trainer agents.

``simulate(scenario, policy) -> dict`` replays a ``Scenario`` under ``omni`` (the production
planner, ``jobs.planner.plan``), a baseline or a peer (``jobs.simulator.policies`` registers
them all) and returns the result dict.

How time advances: a heap of events (arrivals, segment ends, saves, loads, idle phases,
window boundaries, faults, planner wake-ups and a periodic tick). A running job computes in
*segments* up to its next milestone (checkpoint, idle phase, completion); a segment of k steps
draws one seeded noise value for its mean step time, so a week of 5,000 jobs costs events per
checkpoint, not per step. After each batch of same-time events that changed something the
planner runs, its actions are applied, and the invariants are checked.

What a trainer agent does with each action (graceful): finish the step in flight, save a
checkpoint if any step is unsaved, then release GPUs (preempt) or load at the new layout
(shrink / grow / migrate); GPUs a job grows or migrates onto are held from the moment of the
decision. Not graceful (``kill_preempt``): stop now, lose every step since the last completed
save. A failed node kills every job touching it the same way; whole replicas that survive
stay held if they form a valid layout, so the planner can continue on them.

The result dict, and what it measures: ``jobs.simulator.results``; the planner's view of the
cluster each pass: ``jobs.simulator.views``; the planner's actions
taken by the simulated agents: ``jobs.simulator.apply``.

An audit record is ``{"t": float, **Action.to_audit()}`` (kind, job, gpus/nodes before and
after, dp, accum, global_batch, borrowed_from, deadline_s, graceful, forced, reason{rule,
text, inputs}); the engine adds records of kind ``node_down``, ``node_up``, ``slow_node``,
``drain``, ``cancel``, ``complete`` and ``window_end`` for context. ``hold`` records appear
only when a job's hold cause changes.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from jobs.planner import plan as omni_plan
from jobs.planner.config import PlannerConfig
from jobs.planner.decisions import Plan
from jobs.planner.entitlements import is_active
from jobs.planner.layout import accum_steps, batch_divides, layout_problems, replicas_of
from jobs.planner.quota import charged_gpus
from jobs.planner.rhythm import step_time_at
from jobs.planner.snapshot import (
    Gpu,
    Job,
    Node,
    Reservation,
    Snapshot,
)
from jobs.simulator import results
from jobs.simulator.apply import apply_action
from jobs.simulator.policies import OMNI_PLANNER_POLICIES, POLICIES, QUOTA_POLICIES, planner_for
from jobs.simulator.scenario import JobSpec, Scenario
from jobs.simulator.state import EPS, Op, SimJob
from jobs.simulator.teams import TeamLedger
from jobs.simulator.views import PlannerView

__all__ = ["POLICIES", "Simulation", "simulate", "stderr_progress"]
# Event kinds, with the order they are handled in at the same instant.
EV_SCENARIO = 0
EV_SUBMIT = 1
EV_JOB = 2
EV_WINDOW = 3
EV_WAKE = 4
EV_CHECK = 5


class Simulation:
    """One replay of one scenario under one policy. Build it, call ``run()`` once."""

    def __init__(
        self,
        scenario: Scenario,
        policy: str = "omni",
        record_events: bool = False,
        progress: Callable[[str], None] | None = None,
        full_check: bool | None = None,
        tick_s: float = 600.0,
        coalesce_s: float | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}")
        self.scenario = scenario
        self.policy = policy
        self.record_events = record_events
        self.progress = progress
        self.tick_s = tick_s
        # Big replays batch non-urgent planner passes into 60 s slots; small ones plan at once.
        self.big = len(scenario.jobs) > 500
        self.coalesce_s = coalesce_s if coalesce_s is not None else (60.0 if self.big else 0.0)
        self.config: PlannerConfig = scenario.planner_config("kill" if policy == "kill_preempt" else "graceful")
        if not record_events:  # holds are read only for the event log (``PlannerConfig.explain_holds``)
            self.config = replace(self.config, explain_holds=False)
        self.horizon = scenario.horizon_s
        self.nodes: dict[str, Node] = {n.name: n for n in scenario.nodes}
        self.node_order = [n.name for n in scenario.nodes]
        self.down: set[str] = set()
        self.drained_at: dict[str, float] = {}
        self.speed: dict[str, float] = {n: 1.0 for n in self.nodes}
        self.health: dict[str, str] = {n: "healthy" for n in self.nodes}
        self.jobs: dict[str, SimJob] = {}
        for spec in scenario.jobs:
            self.jobs[spec.name] = SimJob(spec=spec, rng=random.Random(f"{scenario.seed}:{spec.name}"))
        self.reservations = [
            Reservation(r.name, r.job, r.gpus, r.spares, r.start_s, r.end_s, r.period_s, r.active_s, r.nodes, r.team)
            for r in scenario.reservations
        ]
        # A team's reservation guarantees its earliest-submitted runnable critical job.
        self.team_critical: dict[str, list[str]] = {}
        for spec in sorted(scenario.jobs, key=lambda j: (j.submit_s, j.name)):
            if spec.team is not None and spec.priority == "critical":
                self.team_critical.setdefault(spec.team, []).append(spec.name)
        self.ledger = TeamLedger(scenario.teams, self.config.fair_share_half_life_s) if scenario.teams else None
        # The quota invariant holds a policy to quotas it honours (``policies.QUOTA_POLICIES``);
        # the others' quota_shortfall is still measured, as baselines.
        self.quota_invariant = policy in QUOTA_POLICIES
        self.decide = planner_for(policy, scenario)
        self.state_version = 0
        self.pool_of_node = {n: r.name for r in self.reservations for n in r.nodes}
        # The pools as the planner's snapshot shows them, for ``quota.charged_gpus``: a team's
        # reservation is its team's; a job's is nobody's until the job is submitted, then its
        # team's, and gone once the job is done (``_own_pools``).
        self.pool_team: dict[str, str | None] = {r.name: r.team or None for r in self.reservations}
        # Nodes a job lent for its idle phase: the snapshot shows them as the pool ``idle:<job>``
        # of the lender's team (``views``), so they are charged as a pool too (``_idle_pool``).
        self.idle_pool_of_node: dict[str, str] = {}
        self.uncharged: set[Gpu] = set()  # held GPUs that do not count against their job's team's quota
        self.owner: dict[Gpu, str] = {}
        self.active_names: set[str] = set()
        self.view = PlannerView()  # what the last snapshot showed
        self.heap: list[tuple[float, int, int, str, str, int]] = []
        self.seq = 0
        self.now = 0.0
        self.last_t = 0.0
        self.violations: list[str] = []
        self.violation_keys: set[str] = set()
        self.records: list[dict[str, Any]] = []
        self.useful_gpu_s = 0.0
        self.healthy_gpu_s = 0.0
        self.allocated_gpu_s = 0.0  # GPUs held by any job, integrated (goodput's denominator)
        self.lost_by_cause = {"kill": 0.0, "fault": 0.0}
        # Where the GPU-seconds go (``results.account``): the GPUs held now by what their job
        # does (``held_by_activity``, "incoming" for GPUs a job is given but not yet using),
        # recounted at each advance for the jobs changed since (``changed``), integrated into
        # ``gpu_s_by_activity``; and the idle GPUs on reserved nodes while their reservation is
        # in force (``idle_reserved_gpu_s``), a pool's held ones counted as GPUs are assigned and
        # released (``pool_of_node``: the loader gives each node to one pool at most).
        self.held_by_activity: dict[str, int] = {}
        self.gpu_s_by_activity: dict[str, float] = {}
        self.counted: dict[str, tuple[str, int, int]] = {}
        self.changed: set[str] = set()
        self.pool_gpus: dict[str, int] = dict.fromkeys((r.name for r in self.reservations), 0)
        for n, r_name in self.pool_of_node.items():
            self.pool_gpus[r_name] += self.nodes[n].gpus
        self.held_in_pool: dict[str, int] = dict.fromkeys(self.pool_gpus, 0)
        self.idle_reserved_gpu_s = 0.0
        # The jobs waiting for GPUs now (submitted, not done, not dormant between their windows),
        # kept by ``results.recount``; idle GPUs off the reservations in force while any waits
        # count in ``idle_queued_gpu_s`` (a hole too small for them, or held back).
        self.queued: set[str] = set()
        self.idle_queued_gpu_s = 0.0
        self.preemptions = 0
        self.graceful_preemptions = 0
        self.planner_calls = 0
        self.wakes: set[float] = set()
        self.plan_due: set[float] = set()
        self.dirty = False
        total = sum(n.gpus for n in scenario.nodes)
        self.total_gpus = total
        # A full O(GPUs) sweep after every pass for small scenarios; big replays rely on the
        # incremental checks made at every assignment, layout change and commit.
        self.full_check = (total <= 1024 and len(scenario.jobs) <= 300) if full_check is None else full_check
        # Shortfall accounting per reservation.
        self.res_entitled_since: dict[str, float | None] = {r.name: None for r in self.reservations}
        self.res_fault_since: dict[str, float | None] = {r.name: None for r in self.reservations}
        self.entitled_gpu_s = 0.0
        self.short_gpu_s = 0.0
        self.short_fault_gpu_s = 0.0
        self.wait_gpu_s = 0.0  # undelivered from the entitlement's start, the grace included
        # Timeline.
        self.sample_s = max(60.0, self.horizon / 288.0)
        self.next_sample = 0.0
        self.timeline: list[dict[str, Any]] = []
        self.segments: dict[str, list[dict[str, Any]]] = {}
        self.next_progress_day = 1

    # --- event plumbing -------------------------------------------------------------------------

    def _push(self, t: float, order: int, kind: str, key: str = "", epoch: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, order, self.seq, kind, key, epoch))

    def _job_event(self, job: SimJob, t: float, kind: str) -> None:
        self._push(t, EV_JOB, kind, job.spec.name, job.epoch)

    def _request_plan(self, t: float, urgent: bool = True) -> None:
        if urgent or self.coalesce_s <= 0:
            self.dirty = True
            return
        slot = math.ceil(t / self.coalesce_s) * self.coalesce_s
        if slot <= t + EPS:
            self.dirty = True
            return
        if slot not in self.plan_due:
            self.plan_due.add(slot)
            self._push(slot, EV_WAKE, "plan")

    def _violation(self, text: str, key: str | None = None) -> None:
        k = key or text
        if k in self.violation_keys:
            return
        self.violation_keys.add(k)
        self.violations.append(f"t={self.now:.1f}s: {text}")

    def _record(self, kind: str, job: str | None, **fields: Any) -> None:
        if self.record_events:
            self.records.append({"t": round(self.now, 3), "kind": kind, "job": job, **fields})

    # --- state changes with invariant checks ----------------------------------------------------

    def _touch(self, job: SimJob) -> None:
        self.changed.add(job.spec.name)
        job.version += 1
        self.state_version += 1
        self.view.touched.add(job.spec.name)

    def _set_activity(self, job: SimJob, activity: str) -> None:
        job.activity = activity
        self.changed.add(job.spec.name)

    def _activate(self, name: str, active: bool) -> None:
        """A job joins the active set (submitted) or leaves it (done, cancelled)."""
        if active:
            self.active_names.add(name)
            self.view.join(name)
        else:
            self.active_names.discard(name)
            self.view.leave(name)
            if self.jobs[name].parked:
                self._idle_pool(self.jobs[name], lent=False)  # the snapshot shows no pool of a job gone

    def entitled_job(self, res: Reservation) -> SimJob | None:
        """The job a reservation guarantees now: its own, or for a team's reservation the team's
        earliest-submitted critical job still to run (submitted, not done); None when there is none."""
        if not res.team:
            return self.jobs[res.job]
        for name in self.team_critical.get(res.team, ()):
            job = self.jobs[name]
            if job.submitted and job.terminal is None:
                return job
        return None

    def own_reservations(self, name: str) -> set[str]:
        """Names of the reservations that guarantee job ``name`` now."""
        return {r.name for r in self.reservations
                if (r.job == name if not r.team else (j := self.entitled_job(r)) is not None and j.spec.name == name)}

    def _assign(self, job: SimJob, gpus: list[Gpu], new_placement: bool) -> None:
        for g in gpus:
            holder = self.owner.get(g)
            if holder is not None and holder != job.spec.name:
                self._violation(f"GPU {g.label()} held by both {holder} and {job.spec.name}")
                self.changed.add(holder)
                if self.ledger is not None:
                    self.ledger.hold(self.jobs[holder].spec.team, -1, g not in self.uncharged)
                    self.uncharged.discard(g)
            if self.ledger is not None and holder != job.spec.name:
                charged = self._charged(job.spec.team, g)
                self.ledger.hold(job.spec.team, 1, charged)
                if not charged:
                    self.uncharged.add(g)
            if g.node in self.down:
                self._violation(f"{job.spec.name} placed on down node {g.node}")
            if new_placement and self.health[g.node] in ("draining", "cordoned"):
                self._violation(f"{job.spec.name} placed on {self.health[g.node]} node {g.node}")
            if holder is None and g.node in self.pool_of_node:
                self.held_in_pool[self.pool_of_node[g.node]] += 1
            self.owner[g] = job.spec.name
        self.changed.add(job.spec.name)

    def pool_zone(self, node: str) -> str | None:
        """The pool ``node`` is in as the planner's snapshot shows it: a reservation's, or a lent
        idle phase's (``idle:<job>``); None for general capacity."""
        return self.pool_of_node.get(node) or self.idle_pool_of_node.get(node)

    def _charged(self, team: str | None, g: Gpu) -> bool:
        """Whether ``g``, held by a job of ``team``, counts against the team's quota, as the
        planner counts it (``quota.charged_gpus`` over the pools its snapshot shows)."""
        return charged_gpus(team, (g,), {g.node: self.pool_zone(g.node)}, self.pool_team) == 1

    def _own_pools(self, job: SimJob, active: bool) -> None:
        """``job`` was submitted (``active``) or is done: the pools of its reservations belong to
        its team from its submission to its end, as the planner sees them (its snapshot holds
        neither a job not yet submitted nor the reservations of one that is done); the GPUs held
        there are charged again by that light."""
        for r in self.reservations:
            if r.team or r.job != job.spec.name:
                continue
            if active:
                self.pool_team[r.name] = job.spec.team
            else:
                self.pool_team.pop(r.name, None)
            self._recharge(set(r.nodes))

    def _idle_pool(self, job: SimJob, lent: bool) -> None:
        """``job`` lent its GPUs for an idle phase (``lent``), or has them back or is gone: their
        nodes are the pool ``idle:<job>`` of its team while it lends them, as the planner's
        snapshot shows them, so what another team borrows there is not held against its quota
        (``quota.charged_gpus``: reclaimed, the GPUs go back to the lender); the GPUs held there
        are charged again by that light."""
        zone = f"idle:{job.spec.name}"
        nodes = {g.node for g in job.parked}
        if lent:
            self.pool_team[zone] = job.spec.team
            self.idle_pool_of_node.update(dict.fromkeys(nodes, zone))
        else:
            self.pool_team.pop(zone, None)
            for n in nodes:
                if self.idle_pool_of_node.get(n) == zone:
                    del self.idle_pool_of_node[n]
        self._recharge(nodes)

    def _recharge(self, nodes: set[str]) -> None:
        """The GPUs held on ``nodes`` counted against their teams' quotas anew (a pool there
        changed hands, came or went)."""
        if self.ledger is None:
            return
        for g, holder in self.owner.items():
            team = self.jobs[holder].spec.team
            if g.node not in nodes or team is None:
                continue
            charged = self._charged(team, g)
            if charged == (g not in self.uncharged):
                continue
            self.ledger.charge(team, 1 if charged else -1)
            (self.uncharged.discard if charged else self.uncharged.add)(g)

    def _unassign(self, job: SimJob, gpus: list[Gpu]) -> None:
        self.changed.add(job.spec.name)
        for g in gpus:
            if self.owner.get(g) == job.spec.name:
                del self.owner[g]
                if g.node in self.pool_of_node:
                    self.held_in_pool[self.pool_of_node[g.node]] -= 1
                if self.ledger is not None:
                    self.ledger.hold(job.spec.team, -1, g not in self.uncharged)
                    self.uncharged.discard(g)
            job.borrowed.pop(g, None)

    def _check_layout(self, job: SimJob) -> None:
        spec = job.spec
        if not job.gpus:
            return
        probe = _probe_job(spec)
        if len(set(job.gpus)) != len(job.gpus):
            self._violation(f"{spec.name}: holds the same GPU twice in one layout", key=f"dup:{spec.name}")
        for problem in layout_problems(probe, job.gpus):
            self._violation(f"{spec.name}: {problem}", key=f"layout:{spec.name}:{problem}")
        d = len(job.gpus) // job.rep
        if job.accum is None or spec.micro_batch * d * job.accum != spec.global_batch:
            self._violation(
                f"{spec.name}: micro_batch {spec.micro_batch} x dp {d} x accum {job.accum} != global_batch {spec.global_batch}"
            )

    def _set_layout(self, job: SimJob, gpus: list[Gpu]) -> None:
        job.gpus = list(gpus)
        job.dp = len(gpus) // job.rep if gpus else 0
        job.accum = accum_steps(_probe_job(job.spec), job.dp) if job.dp else None
        self._check_layout(job)
        self._touch(job)

    def _set_committed(self, job: SimJob, value: int, rollback: bool = False) -> None:
        if value < job.committed:
            if not rollback:
                self._violation(f"{job.spec.name}: committed steps went back from {job.committed} to {value}")
            elif value != job.last_ckpt_step:
                self._violation(
                    f"{job.spec.name}: rolled back to step {value}, not its last checkpoint {job.last_ckpt_step}"
                )
        job.committed = value
        self._touch(job)

    # --- intervals (the result's segments) ------------------------------------------------------

    def _open_interval(self, job: SimJob) -> None:
        if job.interval_start is None:
            job.interval_start = self.now

    def _close_interval(self, job: SimJob, end: str, gpus: int | None = None) -> None:
        if job.interval_start is None:
            return
        self.segments.setdefault(job.spec.name, []).append({
            "start_s": round(job.interval_start, 3),
            "end_s": round(self.now, 3),
            "gpus": len(job.gpus) if gpus is None else gpus,
            "end": end,
        })
        job.interval_start = None

    # --- job mechanics ------------------------------------------------------------------------

    def _nominal_step_s(self, job: SimJob) -> float:
        return step_time_at(_probe_job(job.spec), job.dp)

    def _start_computing(self, job: SimJob) -> None:
        spec = job.spec
        if job.committed >= spec.total_steps:
            self._complete(job)
            return
        milestone = spec.total_steps
        every = spec.checkpoint.every_steps
        milestone = min(milestone, (job.committed // every + 1) * every)
        for phase in spec.idle_phases:
            milestone = min(milestone, (job.committed // phase.every_steps + 1) * phase.every_steps)
        k = max(1, milestone - job.committed)
        nominal = self._nominal_step_s(job)
        slow = max((self.speed[g.node] for g in job.gpus), default=1.0)
        base = nominal * slow
        cv = spec.step_cv
        noise = 1.0
        if cv > 0:
            noise = min(2.0, max(0.5, 1.0 + cv * job.rng.gauss(0.0, 1.0) / math.sqrt(k)))
            for _ in range(min(k, 3)):
                job.ring.append(base * min(2.0, max(0.5, 1.0 + cv * job.rng.gauss(0.0, 1.0))))
        else:
            job.ring.append(base)
        self._set_activity(job, "computing")
        job.seg_t0 = self.now
        job.seg_k = k
        job.seg_step_s = base * noise
        job.seg_nominal_s = nominal
        job.epoch += 1
        self._touch(job)
        self._job_event(job, self.now + k * job.seg_step_s, "segment_end")

    def _commit_segment(self, job: SimJob, steps: int) -> None:
        if steps <= 0:
            return
        self._set_committed(job, job.committed + steps)
        job.unsaved_useful += steps * job.seg_nominal_s * len(job.gpus)

    def _segment_end(self, job: SimJob) -> None:
        self._commit_segment(job, job.seg_k)
        job.seg_k = 0
        spec = job.spec
        if job.committed >= spec.total_steps:
            self._complete(job)
            return
        job.repace = False
        if job.op is not None:
            self._stop_save_or_execute(job)
            return
        if job.committed % spec.checkpoint.every_steps == 0:
            self._begin_save(job, "saving")
            return
        self._after_save_point(job)

    def _after_save_point(self, job: SimJob) -> None:
        idle = sum(p.duration_s for p in job.spec.idle_phases if job.committed % p.every_steps == 0)
        if idle > 0 and job.committed > 0:
            self._set_activity(job, "idle")
            job.idle_until = self.now + idle
            job.epoch += 1
            self._touch(job)
            self._job_event(job, self.now + idle, "idle_end")
            self._request_plan(self.now, urgent=False)
            return
        self._start_computing(job)

    def _begin_save(self, job: SimJob, activity: str) -> None:
        self._set_activity(job, activity)
        job.epoch += 1
        save_s = job.spec.checkpoint.save_s
        self._touch(job)
        self._job_event(job, self.now + save_s, "save_end")

    def _save_end(self, job: SimJob) -> None:
        job.last_ckpt_step = job.committed
        job.last_ckpt_t = self.now
        job.save_hist.append(job.spec.checkpoint.save_s)
        self.useful_gpu_s += job.unsaved_useful
        job.unsaved_useful = 0.0
        self._touch(job)
        if job.op is not None:
            self._execute_op(job)
            return
        self._after_save_point(job)

    def _stop_save_or_execute(self, job: SimJob) -> None:
        if job.committed > job.last_ckpt_step:
            self._begin_save(job, "stop_saving")
        else:
            self._execute_op(job)

    def _truncate_segment(self, job: SimJob) -> None:
        """End the current compute segment at the next step boundary."""
        elapsed = self.now - job.seg_t0
        n = int(elapsed / job.seg_step_s + EPS) if job.seg_step_s > 0 else 0
        at_boundary = abs(elapsed - n * job.seg_step_s) <= EPS
        target = min(job.seg_k, n if at_boundary else n + 1)
        job.seg_k = target
        job.epoch += 1
        self._job_event(job, job.seg_t0 + target * job.seg_step_s, "segment_end")

    def _repace(self, job: SimJob) -> None:
        """A node under the job changed speed: new pace from the next step boundary."""
        job.repace = True
        self._truncate_segment(job)

    def _request_stop(self, job: SimJob, op: Op) -> None:
        job.op = op
        self._touch(job)
        act = job.activity
        if act == "computing":
            self._truncate_segment(job)
        elif act in ("saving", "stop_saving"):
            return
        elif act == "idle":
            self._stop_save_or_execute(job)
        else:  # loading or waiting
            job.epoch += 1
            self._execute_op(job)

    def _execute_op(self, job: SimJob) -> None:
        op = job.op
        job.op = None
        self._touch(job)
        # GPUs given back: plan at once, except in big replays where releases of non-critical
        # work are batched with the other non-urgent changes (never those someone waits for now:
        # a team below its quota, a reservation whose need has begun; the live planner plans on
        # the agent's ``done`` at once).
        self._request_plan(self.now, urgent=not self.big or job.spec.priority == "critical"
                           or (op is not None and op.awaited))
        if op is None:
            return
        if op.kind == "park":
            self._close_interval(job, "lent")
            job.parked = list(job.gpus)
            self._idle_pool(job, lent=True)
            job.parked_until = job.idle_until if job.idle_until is not None else self.now
            self._unassign(job, job.gpus + job.incoming)
            job.incoming = []
            self._set_layout(job, [])
            job.run_started = None
            job.queued_since = self.now
            job.epoch += 1
            if job.idle_until is not None and job.idle_until > self.now + EPS:
                self._set_activity(job, "parked")
                self._job_event(job, job.idle_until, "idle_end")
            else:
                job.idle_until = None
                self._set_activity(job, "waiting")
            return
        if op.kind in ("release", "dormant"):
            end = "window" if op.kind == "dormant" else ("preempted" if op.graceful else "killed")
            self._close_interval(job, end)
            self._unassign(job, job.gpus + job.incoming)
            job.incoming = []
            self._set_layout(job, [])
            self._set_activity(job, "waiting")
            job.epoch += 1
            job.run_started = None
            job.queued_since = self.now
            job.dormant = op.kind == "dormant"
            if op.preemption:
                job.preemptions += 1
                self.preemptions += 1
                if op.graceful:
                    self.graceful_preemptions += 1
            return
        # reconfigure: keep `after`, drop the rest, load at the new layout.
        after = list(op.after)
        keep = set(after)
        self._close_interval(job, "resized")
        self._unassign(job, [g for g in job.gpus + job.incoming if g not in keep])
        job.incoming = []
        old_dp = job.dp
        self._set_layout(job, after)
        if job.dp != old_dp:
            job.ring.clear()
            job.last_resize = self.now
        if op.action_kind == "migrate":
            job.last_resize = self.now
        if op.preemption:
            job.preemptions += 1
        self._begin_load(job)

    def _begin_load(self, job: SimJob) -> None:
        if not job.gpus:
            self._set_activity(job, "waiting")
            return
        self._open_interval(job)
        self._set_activity(job, "loading")
        job.epoch += 1
        load_s = job.spec.checkpoint.load_s
        job.load_hist.append(load_s)
        self._touch(job)
        self._job_event(job, self.now + load_s, "load_end")

    def _kill(self, job: SimJob, cause: str) -> None:
        """Stop now without a checkpoint: every step since the last completed save is lost."""
        lost = job.unsaved_useful
        if job.activity == "computing" and job.seg_step_s > 0:
            elapsed = self.now - job.seg_t0
            n = min(job.seg_k, int(elapsed / job.seg_step_s + EPS))
            self._commit_segment(job, n)
            lost = job.unsaved_useful + max(0.0, elapsed - n * job.seg_step_s) * len(job.gpus) * (
                job.seg_nominal_s / job.seg_step_s)
        job.lost_gpu_s += lost
        self.lost_by_cause[cause] += lost
        job.unsaved_useful = 0.0
        if job.committed != job.last_ckpt_step:
            self._set_committed(job, job.last_ckpt_step, rollback=True)
        job.seg_k = 0
        job.epoch += 1
        self._set_activity(job, "waiting")
        self._touch(job)

    def _complete(self, job: SimJob) -> None:
        self.useful_gpu_s += job.unsaved_useful
        job.unsaved_useful = 0.0
        self._close_interval(job, "completed")
        self._unassign(job, job.gpus + job.incoming)
        job.incoming = []
        job.gpus = []
        job.dp = 0
        job.terminal = "completed"
        self._set_activity(job, "done")
        job.end_s = self.now
        self._own_pools(job, active=False)
        job.op = None
        job.epoch += 1
        self._activate(job.spec.name, False)
        if self.ledger is not None:
            self.ledger.runnable(job, added=False)
        self._record("complete", job.spec.name, steps_done=job.committed)
        self._request_plan(self.now, urgent=job.spec.priority == "critical")

    # --- handlers -----------------------------------------------------------------------------

    def _on_job_event(self, kind: str, job: SimJob) -> None:
        if kind == "segment_end":
            self._segment_end(job)
        elif kind == "save_end":
            self._save_end(job)
        elif kind == "idle_end":
            job.idle_until = None
            self._touch(job)
            if job.activity == "parked":
                # The phase is over: the job waits, entitled to the GPUs it lent out.
                self._set_activity(job, "waiting")
                self._request_plan(self.now)
            elif job.op is not None:
                self._stop_save_or_execute(job)
            else:
                self._start_computing(job)
        elif kind == "load_end":
            self._start_computing(job)

    def _on_submit(self, job: SimJob) -> None:
        job.submitted = True
        self._own_pools(job, active=True)
        self._set_activity(job, "waiting")
        job.queued_since = self.now
        self._activate(job.spec.name, True)
        if self.ledger is not None:
            self.ledger.runnable(job, added=True)
        self._touch(job)
        self._request_plan(self.now, urgent=job.spec.priority == "critical")

    def _on_scenario_event(self, index: int) -> None:
        ev = self.scenario.events[index]
        self.view.nodes = None  # health or speed may change
        self.state_version += 1
        if ev.kind == "node_down":
            self._node_down(ev.node or "")
        elif ev.kind == "node_up":
            node = ev.node or ""
            self.down.discard(node)
            self.health[node] = "healthy"
            self.drained_at.pop(node, None)
            self._record("node_up", None, nodes_after=[node])
        elif ev.kind == "slow_node":
            node = ev.node or ""
            self.speed[node] = ev.factor or 1.0
            self._record("slow_node", None, nodes_after=[node], factor=ev.factor)
            for name in sorted(self.active_names):
                job = self.jobs[name]
                if job.activity == "computing" and any(g.node == node for g in job.gpus) and job.op is None:
                    self._repace(job)
        elif ev.kind == "drain":
            node = ev.node or ""
            if node not in self.down:
                self.health[node] = "draining"
                self.drained_at[node] = self.now
                self._record("drain", None, nodes_after=[node])
                for name in sorted(self.active_names):
                    job = self.jobs[name]
                    if any(g.node == node for g in job.gpus + job.incoming):
                        deadline = self.now + job.spec.checkpoint.save_s + self.config.reclaim_grace_s
                        # One step in flight is allowed on top of save + grace.
                        deadline += self._nominal_step_s(job) * 2.0 * max(self.speed.values())
                        self._push(deadline, EV_CHECK, "drain_check", f"{name}|{node}")
        elif ev.kind == "cancel":
            job = self.jobs[ev.job or ""]
            if job.terminal is None and job.submitted:
                if job.gpus:
                    self._kill(job, "kill")
                self._close_interval(job, "cancelled")
                self._unassign(job, job.gpus + job.incoming)
                job.gpus, job.incoming, job.dp, job.op = [], [], 0, None
                job.terminal = "cancelled"
                self._set_activity(job, "done")
                job.end_s = self.now
                self._own_pools(job, active=False)
                job.epoch += 1
                self._activate(job.spec.name, False)
                if self.ledger is not None:
                    self.ledger.runnable(job, added=False)
                self._record("cancel", job.spec.name)
            elif not job.submitted:
                job.terminal = "cancelled"
                self._own_pools(job, active=False)
        self._request_plan(self.now)

    def _node_down(self, node: str) -> None:
        self.down.add(node)
        self.health[node] = "failed"
        self._record("node_down", None, nodes_before=[node])
        for name in sorted(self.active_names):
            job = self.jobs[name]
            if not any(g.node == node for g in job.gpus + job.incoming):
                continue
            before = list(job.gpus)
            self._kill(job, "fault")
            job.op = None
            self._unassign(job, job.incoming)
            job.incoming = []
            probe = _probe_job(job.spec)
            survivors = [r for r in replicas_of(probe, job.gpus) if not any(g.node in self.down for g in r)]
            keep: list[Gpu] = []
            if survivors:
                d = len(survivors)
                while d >= job.spec.dp_min and not batch_divides(probe, d):
                    d -= 1
                if d >= job.spec.dp_min:
                    keep = [g for r in survivors[:d] for g in r]
            self._close_interval(job, "fault", gpus=len(before))
            self._unassign(job, [g for g in job.gpus if g not in set(keep)])
            self._set_layout(job, keep)
            job.recovering = True
            job.dormant = False
            job.run_started = None if not keep else job.run_started
            job.queued_since = self.now
            self._record("fault", name, nodes_before=sorted({g.node for g in before}),
                         gpus_before=len(before), gpus_after=len(keep),
                         reason={"rule": "faults", "text": f"Node {node} failed: the job loses the steps "
                                 f"since its last checkpoint (step {job.last_ckpt_step}) and recovers.",
                                 "inputs": {"node": node, "survivor_gpus": len(keep)}})
            for res in self.reservations:
                if (owner := self.entitled_job(res)) is not None and owner.spec.name == name:
                    self.res_fault_since[res.name] = self.now

    def _on_window(self, res_index: int) -> None:
        res = self.reservations[res_index]
        job = self.entitled_job(res)
        if job is not None and res.period_s and not is_active(res, self.now) and job.terminal is None and job.submitted:
            if job.gpus and job.op is None:
                self._record("window_end", job.spec.name, reason={"rule": "entitlement", "text": (
                    f"Reservation window of '{res.name}' closed: the job saves and sleeps until the next one."),
                    "inputs": {}})
                self._request_stop(job, Op("dormant", [], True, "window_end", f"{job.spec.name}-w{self.seq}", None, False))
        self._request_plan(self.now)

    # --- snapshot and plan ------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The planner's view of the simulated cluster now (``jobs.simulator.views``)."""
        return self.view.snapshot(self)

    def _plan(self) -> None:
        snap = self.snapshot()
        self.planner_calls += 1
        # The production planner is looked up at call time (tests substitute it).
        decide = omni_plan if self.policy in OMNI_PLANNER_POLICIES else self.decide
        result: Plan = decide(snap, self.now, self.config)
        for action in result.actions:
            apply_action(self, action)
        if result.wake_at_s is not None and result.wake_at_s > self.now + EPS and result.wake_at_s not in self.wakes:
            self.wakes.add(result.wake_at_s)
            self._push(result.wake_at_s, EV_WAKE, "wake")

    # --- main loop ------------------------------------------------------------------------------

    def _check_all(self) -> None:
        results.recount(self)
        # A plan that breaks an invariant (a GPU held twice) is reported as such; the uses then
        # follow each job's own list of GPUs.
        if not self.violations and sum(self.held_by_activity.values()) != len(self.owner):
            raise RuntimeError(f"t={self.now}: GPUs counted by activity {self.held_by_activity} are not the "
                               f"{len(self.owner)} held")
        waiting = {name for name in self.active_names if results.waits(self.jobs[name])}
        if waiting != self.queued:
            raise RuntimeError(f"t={self.now}: the jobs kept as waiting {sorted(self.queued)} are not the "
                               f"{sorted(waiting)} that wait")
        seen: dict[Gpu, str] = {}
        for name in self.active_names:
            job = self.jobs[name]
            for g in job.gpus + job.incoming:
                if g in seen and seen[g] != name:
                    self._violation(f"GPU {g.label()} held by both {seen[g]} and {name}")
                seen[g] = name
                if g.node in self.down:
                    self._violation(f"{name} holds GPU {g.label()} on down node {g.node}")
            if job.gpus:
                self._check_layout(job)

    def _on_check(self, key: str) -> None:
        name, node = key.split("|")
        job = self.jobs[name]
        if self.health.get(node) == "draining" and any(g.node == node for g in job.gpus + job.incoming):
            self._violation(f"{name} still on drained node {node} past its save time + reclaim_grace_s")

    def run(self) -> dict[str, Any]:
        """Play the scenario to its horizon and return the result dict (see module docstring)."""
        wall0 = time.perf_counter()
        for spec in self.scenario.jobs:
            self._push(spec.submit_s, EV_SUBMIT, "submit", spec.name)
        for i, ev in enumerate(self.scenario.events):
            self._push(ev.at_s, EV_SCENARIO, "scenario", str(i))
        for i, res in enumerate(self.reservations):
            for t in _window_boundaries(res, self.horizon):
                self._push(t, EV_WINDOW, "window", str(i))
        t = 0.0
        while t <= self.horizon:
            self._push(t, EV_WAKE, "tick")
            t += self.tick_s
        self._push(self.horizon, EV_CHECK, "horizon")
        plans_at_t = 0
        while self.heap:
            t = self.heap[0][0]
            if t > self.horizon + EPS:
                break
            if t > self.now + EPS:
                results.advance(self, t)
                self.now = t
                plans_at_t = 0
                if self.progress is not None and t >= self.next_progress_day * 86400:
                    self.progress(f"{self.scenario.name} [{self.policy}]: day {int(t // 86400)} "
                                  f"({len(self.active_names)} jobs active, {self.planner_calls} planner passes)")
                    self.next_progress_day = int(t // 86400) + 1
            while True:
                self._drain_now()
                results.update_entitlement_marks(self)
                if self.dirty and plans_at_t < 4:
                    self.dirty = False
                    plans_at_t += 1
                    self._plan()
                    results.update_entitlement_marks(self)
                    if self.full_check:
                        self._check_all()
                    continue
                break
        results.advance(self, self.horizon)
        self.now = self.horizon
        wall_s = time.perf_counter() - wall0
        self._stop_at_horizon()
        return results.result(self, wall_s)

    def _drain_now(self) -> None:
        """Handle every queued event at the current instant (handlers may add more)."""
        while self.heap and self.heap[0][0] <= self.now + EPS:
            _, order, _, kind, key, epoch = heapq.heappop(self.heap)
            if kind == "horizon":
                continue
            if order == EV_JOB:
                job = self.jobs[key]
                if epoch == job.epoch and job.terminal is None:
                    self._on_job_event(kind, job)
            elif kind == "submit":
                job = self.jobs[key]
                if job.terminal is None:
                    self._on_submit(job)
            elif kind == "scenario":
                self._on_scenario_event(int(key))
            elif kind == "window":
                self._on_window(int(key))
            elif kind in ("wake", "tick", "plan"):
                self.plan_due.discard(self.now)
                self.dirty = True
            elif kind == "drain_check":
                self._on_check(key)

    def _stop_at_horizon(self) -> None:
        """The replay ends: whole steps done so far count, unsaved work counts as useful (nothing
        kills it), and every job's open holding ends at the horizon."""
        for spec in self.scenario.jobs:
            job = self.jobs[spec.name]
            if job.terminal is None and job.activity == "computing":
                n = job.live_committed(self.horizon) - job.committed
                if n > 0:
                    self._commit_segment(job, n)
            if job.terminal is None:
                self.useful_gpu_s += job.unsaved_useful
                job.unsaved_useful = 0.0
                self._close_interval(job, "horizon")


_PROBES: dict[int, tuple[JobSpec, Job]] = {}


def _probe_job(spec: JobSpec) -> Job:
    """A planner ``Job`` carrying just the spec (for the layout and step-time helpers)."""
    hit = _PROBES.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    probe = Job(name=spec.name, priority=spec.priority, tp=spec.tp, pp=spec.pp, dp=spec.dp, dp_min=spec.dp_min,
                dp_max=spec.dp_max, global_batch=spec.global_batch, micro_batch=spec.micro_batch,
                total_steps=spec.total_steps, step_s=spec.step_s, comm_fraction=spec.comm_fraction)
    _PROBES[id(spec)] = (spec, probe)
    return probe


def _window_boundaries(res: Reservation, horizon: float) -> list[float]:
    """Every time in [0, horizon] at which ``res`` becomes active or inactive."""
    out = [res.start_s]
    if res.end_s is not None:
        out.append(res.end_s)
    if res.period_s:
        t = res.start_s
        end = min(horizon, res.end_s if res.end_s is not None else horizon)
        while t <= end:
            out.append(t)
            out.append(t + (res.active_s or res.period_s))
            t += res.period_s
    return sorted({t for t in out if 0 <= t <= horizon})


#: The cyclic collector's generation-0 threshold during a replay (Python's default is 700).
REPLAY_GC_THRESHOLD = 10_000


@contextmanager
def fewer_collections() -> Iterator[None]:
    """Run the cyclic garbage collector less often: a replay allocates millions of short-lived
    containers and makes no reference cycles (``tests/simulator/test_sim_engine.py`` holds it to
    that), so at the default threshold the collector ran every 700 of them to find nothing, 2,159
    times over a week under ``static`` (2.0 s of its 18 s of CPU; 80 times and 0.3 s at 10,000).
    Python's thresholds come back after, whatever happens."""
    thresholds = gc.get_threshold()
    gc.set_threshold(REPLAY_GC_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def simulate(
    scenario: Scenario,
    policy: str = "omni",
    record_events: bool = False,
    progress: Callable[[str], None] | None = None,
    full_check: bool | None = None,
) -> dict[str, Any]:
    """Replay ``scenario`` under ``policy`` and return the result dict."""
    with fewer_collections():
        return Simulation(scenario, policy, record_events, progress, full_check).run()


def stderr_progress(message: str) -> None:
    """Progress printer for long runs (one line per simulated day)."""
    print(message, file=sys.stderr, flush=True)

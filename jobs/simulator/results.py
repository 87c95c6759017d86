"""What a replay measures and returns: utilisation, reservation shortfall and the timeline,
integrated as the simulated clock advances, and the result dict ``simulate`` returns (drawn as
an HTML page by ``jobs.simulator.report``).

Result shape (FORMAT.md fields plus extras), JSON-able::

    {scenario, policy, horizon_s, utilization, reservation_shortfall,
     reservation_shortfall_faults_aside, reservation_wait, preemptions, graceful_preemptions,
     lost_gpu_s, lost_gpu_s_by_cause: {kill, fault}, useful_gpu_s, healthy_gpu_s,
     invariant_violations: [str], planner_calls, wall_s,
     goodput, allocated_gpu_s, utilization_bound, bound_useful_gpu_s, bound_share,
     preemptions_per_completed_job, resizes,
     gpu_s_by_use: {computing, saving, saving_to_stop, loading, idle_phase, incoming,
                    idle_reserved, idle_queued, idle_other},   # sums to healthy_gpu_s; a use never seen is left out
     classes: {critical|regular|best_effort|all: {jobs, completed, jct_median_s, jct_p95_s,
               jct_horizon_median_s, jct_horizon_p95_s, queue_median_s, queue_p95_s,
               preemptions}},
     jobs: [{name, priority, submit_s, start_s, end_s, steps_done, preemptions, jct_s,
             lost_gpu_s,
             segments: [{start_s, end_s, gpus, end}]}],
             # one bar per continuous holding; end is completed|preempted|killed|fault|
             # resized|window|cancelled|horizon ("preempted"/"killed" mark preemptions)
     events: [audit record],           # only with record_events=True (--events)
     timeline: [                       # one sample every horizon/288 s (at least 60 s)
        {t, healthy_gpus,
         allocated: {critical, regular, best_effort},   # GPUs held, by class
         useful: {critical, regular, best_effort},      # GPUs computing steps at t
         entitled: {critical job: GPUs its reservations guarantee at t},
         delivered: {critical job: GPUs it holds at t, capped at the entitlement}}],
     # with teams (jobs.simulator.teams):
     teams: [{name, parent, quota_gpus, received_gpu_s, demand_gpu_s, quota_shortfall,
              median_queue_s, jobs}],   # a team's figures include its sub-teams' jobs
     jain_index,                        # over leaf teams with demand: received / demand GPU-s
     quota_shortfall}
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jobs.planner.entitlements import is_active
from jobs.planner.snapshot import PRIORITIES, Reservation
from jobs.simulator.state import EPS

if TYPE_CHECKING:
    from jobs.simulator.engine import Simulation
    from jobs.simulator.scenario import Scenario
    from jobs.simulator.state import SimJob


def share(part: float, whole: float) -> float:
    """``part / whole`` to six places, 0 when there is no whole (a replay with no reservation,
    no healthy GPU): the form of every fraction in the result."""
    return round(part / whole, 6) if whole else 0.0


def entitlement(sim: Simulation, res: Reservation, t: float) -> tuple[int, int]:
    """GPUs ``res`` entitles its job to at ``t`` (0 while the job cannot run), and how many of
    them it holds. A team's reservation entitles the team's earliest-submitted runnable
    critical job."""
    job = sim.entitled_job(res)
    if job is None:
        return 0, 0
    runnable = job.submitted and job.terminal is None
    if not runnable or not is_active(res, t):
        return 0, 0
    cap = min(res.gpus, job.spec.dp_max * job.rep)
    return cap, min(cap, len(job.gpus))


def waits(job: SimJob) -> bool:
    """Whether ``job`` waits for GPUs now: submitted, not done, not running and not asleep
    between its reservation's windows (``Simulation.queued`` keeps the jobs that do)."""
    return job.activity == "waiting" and job.submitted and job.terminal is None and not job.dormant


def recount(sim: Simulation) -> None:
    """Bring ``held_by_activity`` and ``queued`` up to date for the jobs changed since they were
    last counted: each job's GPUs under what it does now, the GPUs it is given but not yet using
    under "incoming", and whether it waits for GPUs (``waits``)."""
    held, counted, queued = sim.held_by_activity, sim.counted, sim.queued
    for name in sim.changed:
        job = sim.jobs[name]
        if waits(job):
            queued.add(name)
        else:
            queued.discard(name)
        now = (job.activity, len(job.gpus), len(job.incoming))
        before = counted.get(name)
        if before == now:
            continue
        if before is not None:
            held[before[0]] -= before[1]
            held["incoming"] -= before[2]
        held[now[0]] = held.get(now[0], 0) + now[1]
        held["incoming"] = held.get("incoming", 0) + now[2]
        counted[name] = now
    sim.changed.clear()


def account(sim: Simulation, a: float, b: float, healthy: int) -> None:
    """Where the GPU-seconds of [a, b) go: held GPUs by what their job does; idle GPUs on the
    nodes of a reservation the planner sees at ``a`` while it is in force (from its start, its
    gaps too, until its end or its job's); the other idle GPUs, while some job waits for GPUs
    (``sim.queued``: ``idle_queued_gpu_s``) or not (the rest, ``gpu_s_by_use``'s ``idle_other``)."""
    dt = b - a
    by_activity = sim.gpu_s_by_activity
    for activity, n in sim.held_by_activity.items():
        if n:
            by_activity[activity] = by_activity.get(activity, 0.0) + n * dt
    reserved = 0.0
    for res in sim.reservations:
        pool = sim.pool_gpus.get(res.name, 0)
        if not pool or not (res.team or sim.jobs[res.job].terminal is None):
            continue
        span = min(b, res.end_s if res.end_s is not None else b) - max(a, res.start_s)
        if span <= 0:
            continue
        if sim.down:
            pool -= sum(sim.nodes[n].gpus for n in sim.down if sim.pool_of_node.get(n) == res.name)
        reserved += max(0, pool - sim.held_in_pool[res.name]) * span
    sim.idle_reserved_gpu_s += reserved
    if sim.queued:
        sim.idle_queued_gpu_s += (healthy - len(sim.owner)) * dt - reserved


def advance(sim: Simulation, t: float) -> None:
    """Integrate metrics over [last_t, t) with the state as it is, and take samples."""
    if sim.changed:
        recount(sim)
    a, b = sim.last_t, min(t, sim.horizon)
    if b > a:
        healthy = sim.total_gpus - sum(sim.nodes[name].gpus for name in sim.down)
        sim.healthy_gpu_s += healthy * (b - a)
        sim.allocated_gpu_s += len(sim.owner) * (b - a)
        account(sim, a, b, healthy)
        if sim.ledger is not None:
            sim.ledger.advance(sim, a, b)
        for res in sim.reservations:
            ent, got = entitlement(sim, res, a)
            if ent <= 0:
                continue
            sim.entitled_gpu_s += ent * (b - a)
            short = ent - got
            if short <= 0:
                continue
            sim.wait_gpu_s += short * (b - a)
            since = sim.res_entitled_since[res.name]
            start = max(a, (since if since is not None else a) + sim.config.reclaim_grace_s)
            if b > start:
                sim.short_gpu_s += short * (b - start)
                if sim.res_fault_since[res.name] is not None:
                    sim.short_fault_gpu_s += short * (b - start)
        while sim.next_sample < b - EPS:
            sim.timeline.append(timeline_sample(sim, sim.next_sample, healthy))
            sim.next_sample += sim.sample_s
    sim.last_t = max(sim.last_t, b)


def timeline_sample(sim: Simulation, t: float, healthy: int) -> dict[str, Any]:
    """One point of the timeline: GPUs held and computing by class, entitled and delivered by job."""
    alloc = dict.fromkeys(PRIORITIES, 0)
    useful = dict.fromkeys(PRIORITIES, 0)
    for name in sim.active_names:
        job = sim.jobs[name]
        n = len(job.gpus) + len(job.incoming)
        alloc[job.spec.priority] += n
        if job.activity == "computing":
            useful[job.spec.priority] += len(job.gpus)
    entitled: dict[str, int] = {}
    delivered: dict[str, int] = {}
    for res in sim.reservations:
        ent, got = entitlement(sim, res, t)
        owner = sim.entitled_job(res)
        if owner is None:
            continue
        name = owner.spec.name
        entitled[name] = entitled.get(name, 0) + ent
        delivered[name] = delivered.get(name, 0) + got
    return {"t": round(t, 3), "healthy_gpus": healthy, "allocated": alloc, "useful": useful,
            "entitled": entitled, "delivered": delivered}


def update_entitlement_marks(sim: Simulation) -> None:
    """Note when each reservation became entitled, and end its fault mark once it is whole again."""
    for res in sim.reservations:
        ent, got = entitlement(sim, res, sim.now)
        if ent <= 0:
            sim.res_entitled_since[res.name] = None
            sim.res_fault_since[res.name] = None
            continue
        if sim.res_entitled_since[res.name] is None:
            sim.res_entitled_since[res.name] = sim.now
        if got >= ent:
            sim.res_fault_since[res.name] = None


def result(sim: Simulation, wall_s: float) -> dict[str, Any]:
    """The result dict of a replay played to its horizon (the shape above)."""
    jobs_out = []
    for spec in sim.scenario.jobs:
        job = sim.jobs[spec.name]
        jobs_out.append({
            "name": spec.name,
            "priority": spec.priority,
            "submit_s": spec.submit_s,
            "start_s": job.start_s,
            "end_s": job.end_s if job.terminal == "completed" else None,
            "steps_done": job.committed,
            "preemptions": job.preemptions,
            "jct_s": (job.end_s - spec.submit_s) if job.terminal == "completed" and job.end_s is not None else None,
            "lost_gpu_s": round(job.lost_gpu_s, 3),
            "segments": sim.segments.get(spec.name, []),
        })
    lost = sim.lost_by_cause["kill"] + sim.lost_by_cause["fault"]
    out: dict[str, Any] = {
        "scenario": sim.scenario.name,
        "policy": sim.policy,
        "horizon_s": sim.horizon,
        "utilization": share(sim.useful_gpu_s, sim.healthy_gpu_s),
        "reservation_shortfall": share(sim.short_gpu_s, sim.entitled_gpu_s),
        "reservation_shortfall_faults_aside": share(sim.short_gpu_s - sim.short_fault_gpu_s, sim.entitled_gpu_s),
        # What the reserved jobs waited for their GPUs at all, inside the grace too: the price of
        # a reclaim made at the moment of need (the owner waits for the borrower's save).
        "reservation_wait": share(sim.wait_gpu_s, sim.entitled_gpu_s),
        "preemptions": sim.preemptions,
        "graceful_preemptions": sim.graceful_preemptions,
        "lost_gpu_s": round(lost, 3),
        "lost_gpu_s_by_cause": {k: round(v, 3) for k, v in sim.lost_by_cause.items()},
        "useful_gpu_s": round(sim.useful_gpu_s, 3),
        "healthy_gpu_s": round(sim.healthy_gpu_s, 3),
        "invariant_violations": list(sim.violations),
        "planner_calls": sim.planner_calls,
        "wall_s": round(wall_s, 3),
        "jobs": jobs_out,
        "timeline": sim.timeline,
    }
    completed = sum(1 for j in jobs_out if j["end_s"] is not None)
    bound = utilization_bound(sim.scenario)
    out.update({
        "goodput": share(sim.useful_gpu_s, sim.allocated_gpu_s),
        "allocated_gpu_s": round(sim.allocated_gpu_s, 3),
        "utilization_bound": bound["utilization_bound"],
        "bound_useful_gpu_s": bound["bound_useful_gpu_s"],
        "bound_share": share(out["utilization"], bound["utilization_bound"]),
        "preemptions_per_completed_job": round(sim.preemptions / completed, 6) if completed else None,
        "resizes": sum(1 for j in jobs_out for seg in j["segments"] if seg["end"] == "resized"),
        "classes": class_figures(jobs_out, sim.horizon),
        "gpu_s_by_use": gpu_s_by_use(sim),
    })
    if sim.ledger is not None:
        out.update(sim.ledger.result(sim))
    if sim.record_events:
        out["events"] = sim.records
    return out


#: ``gpu_s_by_use``'s names for what a job holding GPUs does (``SimJob.activity``).
USE_OF_ACTIVITY = {"computing": "computing", "saving": "saving", "stop_saving": "saving_to_stop",
                   "loading": "loading", "idle": "idle_phase", "incoming": "incoming"}


def gpu_s_by_use(sim: Simulation) -> dict[str, float]:
    """Where the healthy GPU-seconds went, summing to ``healthy_gpu_s``: held GPUs by what their
    job did (computing, saving at a periodic checkpoint, saving to stop or resize, loading, in
    a known idle phase, given to a job but not yet in use), then idle ones (``account``): on the
    nodes of a reservation in force, from its start until its end or its job's
    (``idle_reserved``), elsewhere while some job waits for GPUs (``idle_queued``: holes too
    small for the jobs that wait, or GPUs the planner holds back), and elsewhere while none does
    (``idle_other``)."""
    out = {USE_OF_ACTIVITY.get(a, a): round(v, 3) for a, v in sorted(sim.gpu_s_by_activity.items()) if v}
    idle = sim.healthy_gpu_s - sim.allocated_gpu_s
    out["idle_reserved"] = round(sim.idle_reserved_gpu_s, 3)
    out["idle_queued"] = round(sim.idle_queued_gpu_s, 3)
    out["idle_other"] = round(idle - sim.idle_reserved_gpu_s - sim.idle_queued_gpu_s, 3) + 0.0  # + 0.0: no "-0.0"
    return out


#: ``where_gpu_s_went``'s rows: (key, a column's short name, words).
WHERE_ROWS = (
    ("useful", "kept", "kept steps (utilization)"),
    ("lost", "lost", "steps thrown away"),
    ("computing_other", "slow", "computing beyond the steps' nominal time (slow nodes, step-time noise)"),
    ("saving", "saves", "periodic checkpoint saves"),
    ("saving_to_stop", "stop saves", "saves to stop or resize"),
    ("loading", "loads", "loads after a (re)start or resize"),
    ("idle_phase", "idle phases", "held through known idle phases"),
    ("incoming", "incoming", "given to a job, not yet in use"),
    ("idle_reserved", "idle reserved", "idle on reserved nodes, the reservation in force"),
    ("idle_queued", "idle queued", "idle elsewhere while jobs wait (too few for them, or held back)"),
    ("idle_other", "idle other", "idle elsewhere, no job waiting"),
)


def where_rows(shares: Sequence[Mapping[str, float]]) -> list[tuple[str, str, str]]:
    """The ``WHERE_ROWS`` some of ``shares`` (``where_gpu_s_went``'s) show at two decimals of a
    percent: the rows a side-by-side table of them needs."""
    return [row for row in WHERE_ROWS if any(abs(share.get(row[0], 0.0)) >= 5e-5 for share in shares)]


def where_gpu_s_went(result: Mapping[str, Any]) -> dict[str, float] | None:
    """``gpu_s_by_use`` as shares of the healthy GPU-seconds, computing split into the kept steps
    (``useful_gpu_s``), the steps thrown away (``lost_gpu_s``) and the rest of the computing time
    (a step counts at its nominal time: slower steps on a slow node, or step-time noise, which can
    make this a little negative); None for a result without it (written before it existed)."""
    uses, healthy = result.get("gpu_s_by_use"), result.get("healthy_gpu_s")
    if uses is None or not healthy:
        return None
    useful, lost = result["useful_gpu_s"], result["lost_gpu_s"]
    out = {"useful": useful, "lost": lost, "computing_other": uses.get("computing", 0.0) - useful - lost}
    out.update((k, v) for k, v in uses.items() if k != "computing")
    return {k: v / healthy for k, v in out.items()}


# --- completion time and queueing delay per class ----------------------------------------------


def median(values: Sequence[float]) -> float | None:
    """The median (the mean of the middle two for an even count), None for no values."""
    return round(float(statistics.median(values)), 3) if values else None


def p95(values: Sequence[float]) -> float | None:
    """The 95th percentile by nearest rank (the smallest value at or above 95% of them)."""
    if not values:
        return None
    ordered = sorted(values)
    return round(float(ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]), 3)


def class_figures(jobs_out: Sequence[dict[str, Any]], horizon_s: float) -> dict[str, dict[str, Any]]:
    """Per priority class (and ``all``): completion time (``jct_s``) over completed jobs, queueing
    delay (first start - submission) over submitted jobs, a job never started counting its wait
    to the horizon (so a policy that starves a job is not flattered by leaving it out).

    ``jct_horizon_*`` is completion time by the same rule: over every submitted job, one not
    finished counting its time to the horizon. Over completed jobs alone, a policy that finishes
    fewer of a class's jobs (the long ones) reads shorter; this one does not flatter it. Where
    the report's completion-time CDF (drawn over all the class's jobs) reaches 50% or 95% before
    the horizon, it reads the same there."""
    out: dict[str, dict[str, Any]] = {}
    for cls in (*PRIORITIES, "all"):
        jobs = [j for j in jobs_out if (cls == "all" or j["priority"] == cls) and j["submit_s"] < horizon_s]
        jct = [j["jct_s"] for j in jobs if j["jct_s"] is not None]
        to_horizon = [j["jct_s"] if j["jct_s"] is not None else horizon_s - j["submit_s"] for j in jobs]
        queue = [(j["start_s"] if j["start_s"] is not None else horizon_s) - j["submit_s"] for j in jobs]
        out[cls] = {
            "jobs": len(jobs),
            "completed": len(jct),
            "jct_median_s": median(jct),
            "jct_p95_s": p95(jct),
            "jct_horizon_median_s": median(to_horizon),
            "jct_horizon_p95_s": p95(to_horizon),
            "queue_median_s": median(queue),
            "queue_p95_s": p95(queue),
            "preemptions": sum(j["preemptions"] for j in jobs),
        }
    return out


# --- the fluid bound -----------------------------------------------------------------------------

_BOUNDS: dict[int, tuple[Scenario, dict[str, float]]] = {}


def waterfill(caps: np.ndarray, capacity: float) -> np.ndarray:
    """Rates that share ``capacity`` max-min fairly among jobs each capped at ``caps``."""
    if caps.sum() <= capacity:
        return caps.astype(float)
    ordered = np.sort(caps)
    n = len(ordered)
    before = np.concatenate(([0.0], np.cumsum(ordered)[:-1]))
    level = (capacity - before) / (n - np.arange(n))
    k = int(np.argmax(level <= ordered))
    return np.minimum(caps, level[k]).astype(float)


def utilization_bound(scenario: Scenario) -> dict[str, float]:
    """The useful GPU-seconds a fluid relaxation could serve, over healthy GPU-seconds.

    Work is infinitely divisible and needs no saves, loads or whole replicas; each job, from its
    arrival (to its cancellation, if any), may use at most ``dp_max * tp * pp`` GPUs, and its
    work is what its steps count as useful at ``dp_max`` (the most any size counts: at ``d``
    replicas a step is worth ``tp*pp * step_s * (comm_fraction * d + (1 - comm_fraction) * dp)``
    GPU-seconds); capacity is the healthy GPUs at each instant (node_down / node_up). Between
    events the capacity is shared by water-filling (max-min fair, each job capped). Reservations,
    windows, fragmentation and checkpoint costs are all ignored, so no policy can exceed it.
    Policy-independent: computed once per scenario.
    """
    hit = _BOUNDS.get(id(scenario))
    if hit is not None and hit[0] is scenario:
        return hit[1]
    horizon = scenario.horizon_s
    node_gpus = {n.name: n.gpus for n in scenario.nodes}
    total = float(sum(node_gpus.values()))
    cancel_at = {ev.job: ev.at_s for ev in scenario.events if ev.kind == "cancel" and ev.job}
    # (time, order, kind, payload): capacity changes first, then arrivals, then cancels.
    timeline: list[tuple[float, int, str, Any]] = []
    for ev in scenario.events:
        if ev.kind in ("node_down", "node_up") and ev.at_s < horizon:
            timeline.append((ev.at_s, 0, ev.kind, ev.node))
    for i, spec in enumerate(scenario.jobs):
        if spec.submit_s >= horizon or cancel_at.get(spec.name, math.inf) <= spec.submit_s:
            continue
        rep = spec.tp * spec.pp
        c = spec.comm_fraction
        volume = spec.total_steps * rep * spec.step_s * (c * spec.dp_max + (1 - c) * spec.dp)
        timeline.append((spec.submit_s, 1, "arrive", (i, volume, float(spec.dp_max * rep))))
        if spec.name in cancel_at and cancel_at[spec.name] < horizon:
            timeline.append((cancel_at[spec.name], 2, "cancel", i))
    timeline.sort(key=lambda e: (e[0], e[1]))
    timeline.append((horizon, 3, "end", None))
    down: set[str] = set()
    ids: list[int] = []
    vols = np.zeros(0)
    caps = np.zeros(0)
    served = 0.0
    healthy_s = 0.0
    t = 0.0
    for at, _, kind, payload in timeline:
        capacity = total - sum(node_gpus.get(n, 0) for n in down)
        healthy_s += capacity * max(0.0, at - t)
        while t < at - 1e-9 and len(ids):
            rates = waterfill(caps, capacity)
            with np.errstate(divide="ignore"):
                finish = np.where(rates > 0, vols / np.where(rates > 0, rates, 1.0), np.inf)
            dt = min(at - t, float(finish.min()))
            served += float(rates.sum()) * dt
            vols = vols - rates * dt
            t += dt
            keep = vols > 1e-6 * np.maximum(1.0, caps)
            if not keep.all():
                ids = [x for x, k in zip(ids, keep, strict=True) if k]
                vols, caps = vols[keep], caps[keep]
        t = at
        if kind == "node_down":
            down.add(payload)
        elif kind == "node_up":
            down.discard(payload)
        elif kind == "arrive":
            i, volume, cap = payload
            ids.append(i)
            vols = np.append(vols, volume)
            caps = np.append(caps, cap)
        elif kind == "cancel" and payload in ids:
            keep = np.array([x != payload for x in ids])
            ids = [x for x in ids if x != payload]
            vols, caps = vols[keep], caps[keep]
    out = {
        "bound_useful_gpu_s": round(served, 3),
        "utilization_bound": share(served, healthy_s),
    }
    _BOUNDS[id(scenario)] = (scenario, out)
    return out

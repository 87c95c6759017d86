"""What a replay measures and returns: utilisation, reservation shortfall and the timeline,
integrated as the simulated clock advances, and the result dict ``simulate`` returns (drawn as
an HTML page by ``jobs.simulator.report``).

Result shape (FORMAT.md fields plus extras), JSON-able::

    {scenario, policy, horizon_s, utilization, reservation_shortfall,
     reservation_shortfall_faults_aside, preemptions, graceful_preemptions, lost_gpu_s,
     lost_gpu_s_by_cause: {kill, fault}, useful_gpu_s, healthy_gpu_s,
     invariant_violations: [str], planner_calls, wall_s,
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

from typing import TYPE_CHECKING, Any

from jobs.planner.entitlements import is_active
from jobs.planner.snapshot import PRIORITIES, Reservation
from jobs.simulator.state import EPS

if TYPE_CHECKING:
    from jobs.simulator.engine import Simulation


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


def advance(sim: Simulation, t: float) -> None:
    """Integrate metrics over [last_t, t) with the state as it is, and take samples."""
    a, b = sim.last_t, min(t, sim.horizon)
    if b > a:
        healthy = sim.total_gpus - sum(sim.nodes[name].gpus for name in sim.down)
        sim.healthy_gpu_s += healthy * (b - a)
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
        "utilization": round(sim.useful_gpu_s / sim.healthy_gpu_s, 6) if sim.healthy_gpu_s else 0.0,
        "reservation_shortfall": round(sim.short_gpu_s / sim.entitled_gpu_s, 6) if sim.entitled_gpu_s else 0.0,
        "reservation_shortfall_faults_aside": round(
            (sim.short_gpu_s - sim.short_fault_gpu_s) / sim.entitled_gpu_s, 6) if sim.entitled_gpu_s else 0.0,
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
    if sim.ledger is not None:
        out.update(sim.ledger.result(sim))
    if sim.record_events:
        out["events"] = sim.records
    return out

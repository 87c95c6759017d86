"""How the simulated agents take the planner's actions: a start onto the GPUs it names, or a
stop (``Op``) to carry out once the step in flight is done and saved; a kill when the policy is
not graceful. The ``Simulation`` (``jobs.simulator.engine``) calls ``apply_action`` for every
action of a pass and plays the stop out itself.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from jobs.planner.decisions import Action
from jobs.simulator.state import EPS, Op

if TYPE_CHECKING:
    from jobs.simulator.engine import Simulation

#: Reasons for which a regular job may be stopped before its min_run_s (invariant 4).
FORCED_RULES = frozenset({"harvest.reclaim", "entitlement", "faults", "drain", "victims", "starvation"})


def apply_action(sim: Simulation, action: Action) -> None:
    """Carry out one planner action on the simulated cluster, recording it and any invariant it breaks."""
    job = sim.jobs.get(action.job)
    if job is None or job.terminal is not None:
        return
    if action.kind == "hold":
        cause = action.reason.inputs.get("cause")
        if cause != job.hold_cause:
            job.hold_cause = cause
            sim._record("hold", job.spec.name, **_audit(action))
        return
    job.hold_cause = None
    sim._record(action.kind, job.spec.name, **_audit(action))
    after = list(action.gpus_after)
    spec = job.spec
    if action.kind in ("preempt", "reclaim", "shrink") and spec.priority == "regular":
        ran = sim.now - job.run_started if job.run_started is not None else math.inf
        if job.run_started is not None and ran < spec.min_run_s - EPS and not (
            action.forced and action.reason.rule in FORCED_RULES
        ) and action.reason.rule not in ("harvest.reclaim", "drain", "faults"):
            sim._violation(f"{spec.name} ({action.kind}) stopped after {ran:.0f}s < min_run_s {spec.min_run_s:.0f}s "
                           f"for {action.reason.rule}")
    if job.activity in ("waiting",):
        # Start (place / lend / recover) or a fault shrink onto survivors.
        new = [g for g in after if g not in set(job.gpus)]
        sim._assign(job, new, new_placement=True)
        sim._unassign(job, [g for g in job.gpus if g not in set(after)])
        own = sim.own_reservations(spec.name)
        for g in after:
            zone = sim.pool_zone(g.node)
            if zone is not None and zone not in own:
                job.borrowed[g] = zone
        sim._set_layout(job, after)
        if not after:
            return
        job.recovering = False
        job.dormant = False
        if job.parked:
            sim._idle_pool(job, lent=False)
        job.parked = []
        job.parked_until = None
        job.run_started = sim.now
        if job.start_s is None:
            job.start_s = sim.now
        sim._open_interval(job)
        if not job.ever_started:
            job.ever_started = True
            sim._start_computing(job)
        else:
            sim._begin_load(job)
        return
    if job.op is not None:
        return  # already stopping: the planner should not have asked
    if action.kind == "lend" and not after:
        sim._request_stop(job, Op("park", [], True, "lend", f"{spec.name}-{job.cmd_seq}", action.deadline_s, False))
        job.cmd_seq += 1
        return
    graceful = action.graceful
    preemption = action.kind in ("preempt", "reclaim") and not after
    cmd_id = f"{spec.name}-{job.cmd_seq}"
    job.cmd_seq += 1
    awaited = action.reason.rule == "quota.reclaim" or (
        action.reason.rule == "harvest.reclaim" and action.reason.inputs.get("need_at_s", math.inf) <= sim.now + EPS)
    if not after:
        op = Op("release", [], graceful, action.kind, cmd_id, action.deadline_s, preemption, awaited)
    else:
        new = [g for g in after if g not in set(job.gpus)]
        if new:
            sim._assign(job, new, new_placement=True)
            job.incoming = new
            for g in new:
                zone = sim.pool_of_node.get(g.node)
                if zone is not None and zone not in sim.own_reservations(spec.name):
                    job.borrowed[g] = zone
        op = Op("reconfigure", after, graceful, action.kind, cmd_id, action.deadline_s, False, awaited)
    if graceful:
        sim._request_stop(job, op)
    else:
        sim._kill(job, "kill")
        job.op = op
        sim._execute_op(job)


def _audit(action: Action) -> dict[str, Any]:
    out = action.to_audit()
    out.pop("kind")
    out.pop("job")
    return out

"""Rule 7, drains: move work off the nodes an operator is draining.

A job with a replica on a draining node saves and moves those replicas to free GPUs nearest
its other ones (``migrate``); with nowhere to go it continues on its other whole replicas when
they still satisfy ``dp_min`` batch-exactly (``shrink``), else it stops (``preempt``). The
operator asked, so ``min_run_s`` does not protect it (``forced``); the deadline is
``now + predicted save + reclaim_grace_s``. A signal-mode job is neither moved nor shrunk: it
is stopped (SIGTERM, its ``grace_s``, SIGKILL) by ``now + grace_s + reclaim_margin_s`` and
waits to be placed elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobs.planner.decisions import Reason
from jobs.planner.faults import continue_on_survivors_dp
from jobs.planner.layout import accum_steps, replicas_of
from jobs.planner.rhythm import predict, stop_time_s
from jobs.planner.snapshot import Job
from jobs.planner.topology import choose_gpus, spread_of
from jobs.planner.victims import work_since_start_s
from jobs.planner.wording import agree, replica_count, signal_stop_words

if TYPE_CHECKING:
    from jobs.planner.core import PlanningPass


def evacuate_draining_nodes(state: PlanningPass) -> None:
    """Migrate, shrink or preempt every running job with GPUs on a draining node."""
    draining = {n for n, node in state.nodes.items() if node.health in ("draining",)}
    if not draining:
        return
    for job in state.jobs.values():
        if job.name in state.busy or job.name in state.acted or not job.holdings:
            continue
        if job.phase not in ("running", "checkpointing"):
            continue
        if not any(g.node in draining for g in job.gpus):
            continue
        if job.signal:
            stop_signal_job(state, job, draining)
            continue
        replicas = replicas_of(job, job.gpus)
        keep = [r for r in replicas if not any(g.node in draining for g in r)]
        lost = len(replicas) - len(keep)
        kept_gpus = [g for r in keep for g in r]
        zones = state._zones_for(job, job.current_dp)
        cand = state.view.candidates(zones)
        anchor = sorted({g.node for g in kept_gpus})
        new = choose_gpus(cand, state.nodes, job.tp, job.pp, lost, anchor)
        p = predict(job, state.config)
        deadline = state.now + p.save_s + state.config.reclaim_grace_s
        inputs = {"draining_nodes": sorted({g.node for g in job.gpus if g.node in draining}),
                  "replicas_affected": lost, "predicted_save_s": p.save_s}
        if new is not None:
            after = kept_gpus + list(new)
            state._emit("migrate", job, after,
                        Reason("drain", f"Node drained by an operator: {replica_count(lost)} {agree(lost, 'moves', 'move')} to "
                               f"{spread_of(new, state.nodes).describe()} after a checkpoint.",
                               {**inputs, **spread_of(after, state.nodes).as_inputs()}),
                        deadline_s=deadline, forced=True)
            continue
        d = continue_on_survivors_dp(job, len(keep))
        if d is not None:
            after = [g for r in keep[:d] for g in r]
            state._emit("shrink", job, after,
                        Reason("drain", f"Node drained by an operator and no free GPUs to move to: "
                               f"the job saves and continues on {d} replicas; accumulation "
                               f"goes from {accum_steps(job, job.current_dp)} to {accum_steps(job, d)} "
                               f"so the global batch stays {job.global_batch}.", inputs),
                        deadline_s=deadline, forced=True)
            continue
        state._emit("preempt", job, (),
                    Reason("drain", "Node drained by an operator and no free GPUs to move to: the "
                           "job saves its checkpoint and waits to be placed elsewhere.", inputs),
                    deadline_s=deadline, graceful=not state.kill, forced=True)


def stop_signal_job(state: PlanningPass, job: Job, draining: set[str]) -> None:
    """Stop a signal-mode job with a replica on a draining node: it cannot move or shrink."""
    ran_s = work_since_start_s(job, state.now)
    inputs = {"draining_nodes": sorted({g.node for g in job.gpus if g.node in draining}), "signal": True,
              "work_since_start_s": round(ran_s, 1), "grace_s": job.grace_s}
    state._emit("preempt", job, (),
                Reason("drain", f"Node drained by an operator; this {signal_stop_words(ran_s, job.grace_s)}, "
                       f"and it waits to be placed elsewhere (a signal-mode job is never moved or resized).",
                       inputs),
                deadline_s=state.now + stop_time_s(job, state.config) + state.config.reclaim_margin_s,
                graceful=not state.kill, forced=True)

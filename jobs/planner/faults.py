"""Rule 7, faults and stragglers: what survives a failed node, and when a move pays.

When a node fails, every replica with a GPU on it is lost; the job restarts from its last
checkpoint. Recovery order is critical first, onto the reservation's spares, then reclaimed
loans, then GPUs taken from lower classes, nearest in topology to the survivors. An elastic
job whose surviving whole replicas still satisfy ``dp_min`` (batch-exactly) continues on them
instead of waiting. A replica on a slow node is migrated when the time it would save over the
rest of the run beats the cost of the move (finish step + save + load) by a margin. A
signal-mode job is neither shrunk onto survivors nor migrated (it is not elastic, and Omni
cannot see it save).

The pass's part: ``continue_on_survivors`` (the shrink onto what survived, for the queue) and
``migrate_stragglers`` (after the queue). Recovery onto spares and reclaimed loans is the
queue's ordinary placement (``jobs.planner.admission``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from jobs.planner.config import PlannerConfig
from jobs.planner.decisions import Reason
from jobs.planner.layout import accum_steps, largest_valid_dp, replicas_of
from jobs.planner.rhythm import predict
from jobs.planner.snapshot import Gpu, Job, Node
from jobs.planner.topology import choose_gpus, spread_of
from jobs.planner.wording import agree, replica_count

if TYPE_CHECKING:
    from jobs.planner.core import PlanningPass


def surviving_replicas(job: Job, nodes: Mapping[str, Node], lost_health: frozenset[str]) -> list[tuple[Gpu, ...]]:
    """The job's whole replicas with no GPU on a node whose health is in ``lost_health``."""
    return [
        r
        for r in replicas_of(job, job.gpus)
        if all(g.node in nodes and nodes[g.node].health not in lost_health for g in r)
    ]


def continue_on_survivors_dp(job: Job, survivors: int) -> int | None:
    """The DP an elastic job can continue at on ``survivors`` replicas, or None (always for a
    signal-mode job: it is not elastic)."""
    if job.signal:
        return None
    return largest_valid_dp(job, survivors)


def straggler_gain(job: Job, factor: float, config: PlannerConfig) -> tuple[float, float]:
    """(GPU-seconds saved over the remaining run, GPU-seconds a move costs) for a slow node.

    A job's step runs at its slowest rank's pace, so measured step time already includes
    ``factor``; moving off the slow node saves ``step x (1 - 1/factor)`` per remaining step.
    """
    p = predict(job, config)
    gpus = len(job.holdings)
    slow_step_s = p.mean_step_s if p.samples else p.mean_step_s * factor
    saved_s = job.remaining_steps * slow_step_s * (1.0 - 1.0 / factor)
    cost_s = p.step_s + p.save_s + p.load_s
    return saved_s * gpus, cost_s * gpus


def continue_on_survivors(state: PlanningPass, job: Job, survivors: list[tuple[Gpu, ...]]) -> bool:
    """Shrink a job hit by a fault onto its surviving whole replicas, if they satisfy ``dp_min``."""
    held_dp = len(survivors)
    d_surv = continue_on_survivors_dp(job, held_dp)
    if d_surv is None:
        return False
    after = [g for r in survivors[:d_surv] for g in r]
    state._emit("shrink", job, after,
                Reason("faults", f"A node failed; {held_dp} whole replicas survived, which "
                       f"satisfies dp_min {job.dp_min}, so the job continues on {d_surv} "
                       f"replicas from its last checkpoint instead of waiting. Accumulation "
                       f"becomes {accum_steps(job, d_surv)} to keep the global batch "
                       f"{job.global_batch}.",
                       {"survivors": held_dp, "dp_min": job.dp_min, "dp_after": d_surv}),
                forced=True)
    return True


def migrate_stragglers(state: PlanningPass) -> None:
    """Move replicas off nodes at least ``straggler_factor`` slow when the saving pays for the move."""
    slow = {n: node.speed_factor for n, node in state.nodes.items()
            if node.speed_factor >= state.config.straggler_factor}
    if not slow:
        return
    for job in state.jobs.values():
        if job.name in state.busy or job.name in state.acted or job.phase != "running" or job.signal:
            # A signal-mode job is not moved: a stop and start it cannot verify.
            continue
        on_slow = sorted({g.node for g in job.gpus if g.node in slow})
        if not on_slow:
            continue
        factor = max(slow[n] for n in on_slow)
        gain, cost = straggler_gain(job, factor, state.config)
        inputs = {"slow_nodes": on_slow, "speed_factor": factor, "gain_gpu_s": round(gain, 1),
                  "move_cost_gpu_s": round(cost, 1)}
        if gain < state.config.migrate_gain_factor * cost:
            continue
        replicas = replicas_of(job, job.gpus)
        keep = [r for r in replicas if not any(g.node in slow for g in r)]
        kept_gpus = [g for r in keep for g in r]
        cand = {n: v for n, v in state.view.candidates(state._zones_for(job, job.current_dp)).items()
                if n not in slow}
        new = choose_gpus(cand, state.nodes, job.tp, job.pp, len(replicas) - len(keep),
                          sorted({g.node for g in kept_gpus}))
        if new is None:
            continue
        after = kept_gpus + list(new)
        state._emit("migrate", job, after,
                    Reason("faults.straggler",
                           f"{agree(len(on_slow), 'Node', 'Nodes')} {', '.join(on_slow)} "
                           f"{agree(len(on_slow), 'runs', 'run')} {factor:.2f}x slower; moving "
                           f"{replica_count(len(replicas) - len(keep))} saves about {gain:.0f} GPU-s over the "
                           f"remaining {job.remaining_steps} steps against a move cost of {cost:.0f} GPU-s.",
                           {**inputs, **spread_of(after, state.nodes).as_inputs()}))

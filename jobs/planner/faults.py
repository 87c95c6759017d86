"""Rule 7, faults and stragglers: what survives a failed node, and when a move pays.

When a node fails, every replica with a GPU on it is lost; the job restarts from its last
checkpoint. Recovery order is critical first, onto the reservation's spares, then reclaimed
loans, then GPUs taken from lower classes, nearest in topology to the survivors. An elastic
job whose surviving whole replicas still satisfy ``dp_min`` (batch-exactly) continues on them
instead of waiting. A replica on a slow node is migrated when the time it would save over the
rest of the run beats the cost of the move (finish step + save + load) by a margin.
"""

from __future__ import annotations

from collections.abc import Mapping

from jobs.planner.config import PlannerConfig
from jobs.planner.layout import largest_valid_dp, replicas_of
from jobs.planner.rhythm import predict
from jobs.planner.snapshot import Gpu, Job, Node


def surviving_replicas(job: Job, nodes: Mapping[str, Node], lost_health: frozenset[str]) -> list[tuple[Gpu, ...]]:
    """The job's whole replicas with no GPU on a node whose health is in ``lost_health``."""
    return [
        r
        for r in replicas_of(job, job.gpus)
        if all(g.node in nodes and nodes[g.node].health not in lost_health for g in r)
    ]


def continue_on_survivors_dp(job: Job, survivors: int) -> int | None:
    """The DP an elastic job can continue at on ``survivors`` replicas, or None."""
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

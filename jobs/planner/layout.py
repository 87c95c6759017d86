"""Rule 5, resize granularity: whole data-parallel replicas at a constant global batch.

TP and PP fix the model's partitioning, so a job only ever holds whole replicas of
``tp * pp`` GPUs, each TP group inside one node, and only at a DP ``d`` for which
``global_batch % (micro_batch * d) == 0``. Gradient accumulation is recomputed as
``global_batch / (micro_batch * d)``; the global batch itself never changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from jobs.planner.snapshot import Gpu, Job
from jobs.planner.wording import plural


def batch_divides(job: Job, dp: int) -> bool:
    """Whether ``dp`` replicas keep ``micro_batch * dp * accum == global_batch`` exact."""
    return dp > 0 and job.global_batch % (job.micro_batch * dp) == 0


def valid_dps(job: Job) -> tuple[int, ...]:
    """Every DP the job may run at, ascending: within its bounds and batch-exact."""
    return _valid_dps(job.dp_min, job.dp_max, job.global_batch, job.micro_batch)


@lru_cache(maxsize=4096)
def _valid_dps(dp_min: int, dp_max: int, global_batch: int, micro_batch: int) -> tuple[int, ...]:
    return tuple(d for d in range(dp_min, dp_max + 1) if global_batch % (micro_batch * d) == 0)


def accum_steps(job: Job, dp: int) -> int | None:
    """Gradient accumulation steps at ``dp`` (None when ``dp`` is 0 or not batch-exact)."""
    if not batch_divides(job, dp):
        return None
    return job.global_batch // (job.micro_batch * dp)


def largest_valid_dp(job: Job, at_most: int, at_least: int | None = None) -> int | None:
    """The largest valid DP not above ``at_most`` (and not below ``at_least``), or None."""
    floor = job.dp_min if at_least is None else max(job.dp_min, at_least)
    for d in range(min(at_most, job.dp_max), floor - 1, -1):
        if batch_divides(job, d):
            return d
    return None


def fit_problems(tp: int, pp: int, dp_min: int, node_gpus: Sequence[int]) -> dict[str, str]:
    """Why a job of this shape can never run on nodes of these sizes, by spec field; {} if it can.

    Each TP group needs ``tp`` GPUs on one node and the job at least ``dp_min`` replicas of
    ``pp`` groups, counted on every node whatever its health (a failed node may be repaired).
    Submission refuses such a job (``jobs.actions.jobs.submit_job``) and the planner holds one
    that the cluster has shrunk under. A cluster with no nodes yet is being set up: nothing is
    refused.
    """
    if not node_gpus:
        return {}
    largest = max(node_gpus)
    if tp > largest:
        return {"tp": f"{tp} GPUs per tensor-parallel group but the largest node has {largest}"}
    room = sum(n // tp for n in node_gpus) // pp
    if dp_min > room:
        rep = tp * pp
        return {"dp_min": (
            f"at least {dp_min} replicas of {plural(rep, 'GPU')} ({plural(dp_min * rep, 'GPU')}) but the whole cluster has room "
            f"for {room or 'none'} ({sum(node_gpus)} GPUs on {plural(len(node_gpus), 'node')})"
        )}
    return {}


def replicas_of(job: Job, gpus: Sequence[Gpu]) -> list[tuple[Gpu, ...]]:
    """Split a job's GPU list (replica order) into replicas of ``tp * pp``."""
    size = job.tp * job.pp
    return [tuple(gpus[i : i + size]) for i in range(0, len(gpus) - size + 1, size)]


def layout_problems(job: Job, gpus: Sequence[Gpu]) -> list[str]:
    """What is wrong with ``gpus`` as a layout for ``job`` (empty list: nothing)."""
    problems: list[str] = []
    size = job.tp * job.pp
    if len(gpus) % size:
        problems.append(f"{len(gpus)} GPUs is not a whole number of {size}-GPU replicas")
        return problems
    d = len(gpus) // size
    if not job.dp_min <= d <= job.dp_max:
        problems.append(f"dp {d} outside [{job.dp_min}, {job.dp_max}]")
    if not batch_divides(job, d):
        problems.append(f"global_batch {job.global_batch} not divisible by micro_batch*dp {job.micro_batch * d}")
    for start in range(0, len(gpus), job.tp):
        group = gpus[start : start + job.tp]
        if len({g.node for g in group}) != 1:
            problems.append(f"TP group {start // job.tp} spans nodes {sorted({g.node for g in group})}")
    return problems

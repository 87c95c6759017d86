"""Rule 4, victim choice: free GPUs so that the least work is lost.

Lower class first (best-effort, then regular; critical is never a victim of a lower class),
then the fewest GPU-seconds at risk: steps since the last save x predicted step time x GPUs,
plus the save itself. ``min_run_s`` protects a job except when the need is a reservation, a
fault or a drain (``forced``). An elastic job is shrunk by whole replicas in preference to
being stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from jobs.planner.config import PlannerConfig
from jobs.planner.layout import batch_divides, replicas_of
from jobs.planner.rhythm import predict
from jobs.planner.snapshot import PRIORITY_RANK, Gpu, Job
from jobs.planner.starvation import protected_by_min_run


@dataclass(frozen=True, slots=True)
class VictimOption:
    """Freeing GPUs from one job: a shrink to ``kept`` or (``kept`` empty) a preemption."""

    job: Job
    kept: tuple[Gpu, ...]
    freed: tuple[Gpu, ...]
    cost_gpu_s: float

    @property
    def is_shrink(self) -> bool:
        """True when the job keeps running on ``kept``."""
        return bool(self.kept)


def loss_gpu_s(job: Job, config: PlannerConfig) -> float:
    """GPU-seconds at risk when stopping ``job`` now.

    (steps since last save x predicted step x GPUs) + (predicted save x GPUs).
    """
    p = predict(job, config)
    gpus = len(job.holdings)
    unsaved = max(0, job.committed_steps - job.last_checkpoint_step)
    return unsaved * p.step_s * gpus + p.save_s * gpus


def victim_options(
    job: Job,
    config: PlannerConfig,
    floor_dp: int | None = None,
    drop_first: Callable[[tuple[Gpu, ...]], bool] | None = None,
) -> list[VictimOption]:
    """Ways to free GPUs from ``job``, fewest freed first: shrinks, then a preemption.

    Shrinks go down by whole replicas to a batch-exact DP no lower than ``floor_dp`` (default
    ``dp_min``); replicas for which ``drop_first`` is true are dropped first, then the last.
    """
    gpus = job.gpus
    replicas = replicas_of(job, gpus)
    if drop_first is not None:
        order = sorted(range(len(replicas)), key=lambda i: (not drop_first(replicas[i]), -i))
    else:
        order = list(range(len(replicas) - 1, -1, -1))
    cost = loss_gpu_s(job, config)
    floor = job.dp_min if floor_dp is None else max(job.dp_min, floor_dp)
    options: list[VictimOption] = []
    d = len(replicas)
    for keep in range(d - 1, floor - 1, -1):
        if keep <= 0 or not batch_divides(job, keep):
            continue
        dropped = set(order[: d - keep])
        kept = tuple(g for i, r in enumerate(replicas) if i not in dropped for g in r)
        freed = tuple(g for i, r in enumerate(replicas) if i in dropped for g in r)
        options.append(VictimOption(job, kept, freed, cost))
    options.append(VictimOption(job, (), gpus, cost))
    return options


def victim_sort_key(job: Job, config: PlannerConfig) -> tuple:
    """Lower class first, elastic (shrinkable) first, then fewest GPU-seconds lost, then name."""
    elastic = job.current_dp > job.dp_min
    return (-PRIORITY_RANK[job.priority], not elastic, loss_gpu_s(job, config), job.name)


def eligible_victim(job: Job, now_s: float, forced: bool) -> bool:
    """Whether ``job`` may be made to give GPUs back now (``min_run_s`` unless forced)."""
    if not job.holdings:
        return False
    return forced or not protected_by_min_run(job, now_s)


def choose_victims(
    candidates: Iterable[Job],
    fits: Callable[[list[Gpu]], bool],
    config: PlannerConfig,
    floor_dp: Callable[[Job], int | None] = lambda job: None,
    drop_first: Callable[[tuple[Gpu, ...]], bool] | None = None,
    fits_split: Callable[[list[Gpu], tuple[Gpu, ...]], bool] | None = None,
) -> list[VictimOption] | None:
    """The cheapest set of victim options after which ``fits(freed)`` holds, or None.

    ``fits_split(chosen, extra)``, when given, is asked instead of ``fits(chosen + extra)``
    and must answer the same; ``chosen`` is one list that only grows during the search, so
    the callee can count it incrementally instead of re-reading it on every test.

    ``candidates`` must already be filtered for class and ``min_run_s`` and sorted with
    ``victim_sort_key``; it may be a lazy iterator (it is consumed only as far as needed). For each candidate in turn the smallest option that completes the
    need is taken; otherwise its largest shrink (or its preemption if it cannot shrink).
    """
    chosen: list[VictimOption] = []
    freed: list[Gpu] = []
    for job in candidates:
        options = victim_options(job, config, floor_dp(job), drop_first)
        for opt in options:
            if fits_split(freed, opt.freed) if fits_split is not None else fits(freed + list(opt.freed)):
                chosen.append(opt)
                return chosen
        shrinks = [o for o in options if o.is_shrink]
        pick = shrinks[-1] if shrinks else options[-1]
        chosen.append(pick)
        freed.extend(pick.freed)
    return None


def victim_options_off_pool(job: Job, config: PlannerConfig, pool_nodes: set[str]) -> VictimOption:
    """Give back every GPU ``job`` holds on ``pool_nodes``: its largest shrink off them, else stop."""
    options = victim_options(job, config, drop_first=lambda r: any(g.node in pool_nodes for g in r))
    for opt in options:
        if not any(g.node in pool_nodes for g in opt.kept):
            return opt
    return options[-1]

"""Modality-aware assignment of a global batch's samples to data-parallel ranks and micro-batches.

The set of samples in step ``s`` is fixed by the data position alone; this module only decides
who computes which sample. ``contiguous_plan`` is the naive split (rank r takes the r-th slice);
``balanced_plan`` groups samples of similar size into micro-batches (little padding) and then
hands micro-batches to ranks so every rank's estimated cost is about equal (vision attention
grows with the square of the visual tokens, text about linearly). See docs/trainer.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainer_agent.workload import ModelConfig, SampleSpec, micro_batch_cost


@dataclass(frozen=True)
class StepPlan:
    """Who computes what in one step: ``ranks[r][m]`` lists the sample indices of rank r's m-th micro-batch."""

    ranks: list[list[list[int]]]
    estimated_rank_cost: list[float]

    @property
    def estimated_imbalance(self) -> float:
        """Most expensive rank's estimated cost over the mean rank's."""
        mean = sum(self.estimated_rank_cost) / len(self.estimated_rank_cost)
        return max(self.estimated_rank_cost) / mean if mean > 0 else 1.0


def _cost_of(micro_batches: list[list[SampleSpec]], config: ModelConfig) -> float:
    return sum(micro_batch_cost(mb, config) for mb in micro_batches)


def contiguous_plan(specs: list[SampleSpec], dp: int, micro_batch: int, config: ModelConfig) -> StepPlan:
    """Rank r takes samples [r*n, (r+1)*n) of the global batch, in order, ``micro_batch`` at a time."""
    per_rank = len(specs) // dp
    ranks: list[list[list[SampleSpec]]] = []
    for r in range(dp):
        mine = specs[r * per_rank : (r + 1) * per_rank]
        ranks.append([mine[i : i + micro_batch] for i in range(0, per_rank, micro_batch)])
    return _plan(ranks, config)


def balanced_plan(specs: list[SampleSpec], dp: int, micro_batch: int, config: ModelConfig) -> StepPlan:
    """Group similar samples into micro-batches, then spread micro-batches so rank costs are equal.

    Greedy longest-processing-time first with a capacity of ``accum`` micro-batches per rank, so
    every rank still computes exactly ``global_batch / dp`` samples. Ties break on sample index,
    which keeps the plan a pure function of the global batch (every rank computes the same plan).
    """
    accum = len(specs) // (dp * micro_batch)
    by_size = sorted(specs, key=lambda s: (s.visual_tokens, s.text_tokens, s.index))
    groups = [by_size[i : i + micro_batch] for i in range(0, len(by_size), micro_batch)]
    groups.sort(key=lambda g: (-micro_batch_cost(g, config), g[0].index))
    ranks: list[list[list[SampleSpec]]] = [[] for _ in range(dp)]
    loads = [0.0] * dp
    for group in groups:
        open_ranks = [r for r in range(dp) if len(ranks[r]) < accum]
        target = min(open_ranks, key=lambda r: (loads[r], r))
        ranks[target].append(group)
        loads[target] += micro_batch_cost(group, config)
    for rank in ranks:
        rank.sort(key=lambda g: g[0].index)
    return _plan(ranks, config)


def _plan(ranks: list[list[list[SampleSpec]]], config: ModelConfig) -> StepPlan:
    return StepPlan(
        ranks=[[[s.index for s in mb] for mb in rank] for rank in ranks],
        estimated_rank_cost=[_cost_of(rank, config) for rank in ranks],
    )


PlanFunction = Callable[[list[SampleSpec], int, int, ModelConfig], StepPlan]


def plan_step(specs: list[SampleSpec], dp: int, micro_batch: int, config: ModelConfig, balance: bool) -> StepPlan:
    """The plan the trainer uses: balanced when ``balance`` is on, contiguous otherwise."""
    return (balanced_plan if balance else contiguous_plan)(specs, dp, micro_batch, config)


def imbalance(rank_seconds: list[float]) -> float:
    """Measured imbalance: slowest rank's compute time over the mean rank's (1.0 is perfect)."""
    mean = sum(rank_seconds) / len(rank_seconds) if rank_seconds else 0.0
    return max(rank_seconds) / mean if mean > 0 else 1.0

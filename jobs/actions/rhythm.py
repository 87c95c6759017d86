"""Measured rhythm (docs/rhythm.md): a job's step records folded into its ``JobRhythm`` as they
arrive, its measured saves and loads, and the node speed factors its stragglers imply.

A rank that runs slower than the median of its job's other ranks by the planner's ``straggler_factor`` in most
of its last ``STRAGGLER_WINDOW`` steps is attributed to the node it runs on (the agent reports
which node each rank is on); that node's ``speed_factor`` becomes the rank's median slowdown,
through an audited ``node_speed`` row, and the planner is asked to look (it moves replicas off a
slow node when the move pays). With hysteresis: the factor is rewritten only when it moves by a
tenth, and cleared to 1.0 only once every rank of the job on that node ran within half the
straggler margin over a whole window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import transaction

from jobs.actions._common import kept_layout, trigger_plan
from jobs.audit import record_event
from jobs.models import Job, JobRhythm, Node
from jobs.rhythm import STRAGGLER_WINDOW, RhythmState
from jobs.snapshot import straggler_factor
from jobs.vocab import EventKind

SPEED_CHANGE = 0.1  # relative change of a node's speed factor worth writing


@transaction.atomic
def observe_step_records(job_id: int, records: list[dict[str, Any]]) -> RhythmState | None:
    """Fold a frame of step records into the job's rhythm; adjust node speed factors. Returns the
    new state, or ``None`` when nothing was new."""
    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        return None
    JobRhythm.objects.get_or_create(job=job)
    row = JobRhythm.objects.select_for_update(no_key=True).get(job=job)
    state = row.load()
    checks = state.checks
    if not state.observe(records, dp=job.dp, checkpoint_every=job.checkpoint_every_steps):
        return None
    row.store(state)
    row.save()
    _judge_nodes(job, state)
    for finding in state.findings[len(state.findings) - min(state.checks - checks, len(state.findings)):]:
        _record_health(job, finding)
    return state


def _record_health(job: Job, finding: dict[str, Any]) -> None:
    """The post-change health check of a resize or a resume, in the audit trail."""
    record_event(EventKind.HEALTH_CHECK, job=job, actor="omni:rhythm", **kept_layout(job),
                 global_batch=job.global_batch,
                 reason={"rule": "post_change_health" if finding["healthy"] else "post_change_unhealthy",
                         "text": finding["text"],
                         "inputs": {"step": finding["step"], "change": finding["kind"], "healthy": finding["healthy"]}})


def observe_checkpoint(job: Job, *, save_s: float | None = None, load_s: float | None = None) -> None:
    """A measured save or load of ``job`` (from a command's outcome) joins its rhythm."""
    _update(job, lambda state: state.observe_checkpoint(save_s=save_s, load_s=load_s))


def observe_reclaim(job: Job, *, predicted_s: float, lead_s: float, took_s: float) -> None:
    """A reclaim of ``job`` ended: what its stop was predicted to take, the lead it had, what it took."""
    _update(job, lambda state: state.observe_reclaim(predicted_s, lead_s, took_s))


def _update(job: Job, change: Callable[[RhythmState], None]) -> None:
    JobRhythm.objects.get_or_create(job=job)
    row = JobRhythm.objects.select_for_update(no_key=True).get(job=job)
    state = row.load()
    change(state)
    row.store(state)
    row.save()


def _judge_nodes(job: Job, state: RhythmState) -> None:
    factor = straggler_factor()
    if not state.rank_nodes:
        return
    slow = state.stragglers(factor)
    by_node: dict[str, list[tuple[int, float]]] = {}
    for rank, ratio in slow.items():
        if rank < len(state.rank_nodes):
            by_node.setdefault(state.rank_nodes[rank], []).append((rank, ratio))
    for name, ranks in by_node.items():
        node = Node.objects.select_for_update(no_key=True).filter(name=name).first()
        if node is None:
            continue
        worst = max(ratio for _, ratio in ranks)
        if abs(worst - node.speed_factor) < SPEED_CHANGE * node.speed_factor:
            continue
        ranks_words = ", ".join(f"rank {r} ({ratio:.2f}x)" for r, ratio in sorted(ranks))
        _set_speed(node, worst, job, f"{name} runs slow: {ranks_words} of {job.name} took that many times the "
                   f"other ranks' median compute time in most of their last {STRAGGLER_WINDOW} steps; speed factor "
                   f"{node.speed_factor:.2f} -> {worst:.2f}.",
                   {"ranks": {str(r): round(x, 3) for r, x in ranks}, "straggler_factor": factor})
    # Recovery: a slow node whose every rank of this job is back near the median.
    on_node: dict[str, list[int]] = {}
    for rank, name in enumerate(state.rank_nodes):
        on_node.setdefault(name, []).append(rank)
    for name, ranks in on_node.items():
        if name in by_node:
            continue
        node = Node.objects.select_for_update(no_key=True).filter(name=name, speed_factor__gt=1.0).first()
        if node is None or not all(state.recovered(r, factor) for r in ranks):
            continue
        _set_speed(node, 1.0, job, f"{name} runs at speed again: every rank of {job.name} on it was within "
                   f"{(factor - 1) / 2:.0%} of the other ranks' median over its last {STRAGGLER_WINDOW} steps; speed "
                   f"factor {node.speed_factor:.2f} -> 1.00.", {"ranks": ranks, "straggler_factor": factor})


def _set_speed(node: Node, factor: float, job: Job, text: str, inputs: dict[str, Any]) -> None:
    before = node.speed_factor
    node.speed_factor = round(max(factor, 1.0), 3)
    node.save(update_fields=["speed_factor"])
    record_event(EventKind.NODE_SPEED, job=job, actor="omni:rhythm", nodes_after=[node.name],
                 reason={"rule": "straggler" if node.speed_factor > 1.0 else "straggler_recovered", "text": text,
                         "inputs": {"node": node.name, "speed_before": before, "speed_after": node.speed_factor,
                                    **inputs}})
    trigger_plan("node_speed")

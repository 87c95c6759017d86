"""What node agents report (docs/control-loop.md): hello, heartbeats, step records and workers
that exit on their own; and fencing the workers a node should no longer run."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from jobs.actions._common import (
    WORKING_JOB_STATES,
    agent_actor,
    control_logger,
    note_checkpoint,
    release_allocations,
    trigger_plan,
)
from jobs.actions.commands import (
    OPEN_COMMAND_STATES,
    dispatch_on_commit,
    record_job_fault,
    write_stop_commands,
)
from jobs.audit import record_event
from jobs.models import Allocation, Command, Job, JobState, Node, NodeState
from jobs.vocab import CommandKind, EventKind


@transaction.atomic
def record_agent_hello(node: Node, workers: list[dict[str, Any]]) -> list[Command]:
    """An agent (re)connected: note it alive and fence its stray workers."""
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now())
    return fence_stray_workers(node, workers)


@transaction.atomic
def fence_stray_workers(node: Node, workers: list[dict[str, Any]]) -> list[Command]:
    """Stop any worker the agent runs for a job no longer placed on its node (a node back from a
    failure, or cut off for a while, must not keep training a job that moved on)."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    placed = set(Allocation.objects.filter(node=node).values_list("job__name", flat=True))
    fenced: list[Command] = []
    open_stops = set(
        Command.objects.filter(node=node, kind=CommandKind.STOP, state__in=OPEN_COMMAND_STATES)
        .values_list("job__name", flat=True)
    )
    for worker in workers:
        name = worker.get("job")
        if not isinstance(name, str) or name in placed or name in open_stops:
            continue
        job = Job.objects.filter(name=name).first()
        if job is None:
            continue
        fenced += write_stop_commands(job, [node])
        control_logger.warning("fencing %s on %s: the job is not placed there", name, node.name)
    if fenced:
        dispatch_on_commit({node.id})
    return fenced


def record_heartbeat(node: Node, workers: list[dict[str, Any]]) -> None:
    """A heartbeat: the node is alive (a suspect node is healthy again; a failed one stays
    failed until repaired), and each worker's newest complete checkpoint is noted.

    Not one transaction, on purpose: each write commits on its own, so a heartbeat never holds
    its node's row lock (taken by fencing) while it waits for a job row that a planner pass has
    locked; the pass, which locks the job first and references the node after, cannot deadlock
    with it.
    """
    now = timezone.now()
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now)
    # The caller's Node may be stale (a consumer holds it for the whole connection): ask the row.
    if Node.objects.filter(pk=node.pk, state=NodeState.SUSPECT).exists():
        _heartbeat_heals(node)
    placed = set(Allocation.objects.filter(node=node).values_list("job_id", flat=True))
    placed_names = set(Job.objects.filter(id__in=placed).values_list("name", flat=True))
    strays = [w for w in workers if w.get("state") not in ("member", "exited") and w.get("job") not in placed_names]
    if strays:
        fence_stray_workers(node, strays)
    for worker in workers:
        step = worker.get("checkpoint_step")
        name = worker.get("job")
        if not isinstance(step, int) or not isinstance(name, str) or step < 0:
            continue
        Job.objects.filter(
            name=name, id__in=placed, last_checkpoint_step__lt=step, total_steps__gte=step,
            state__in=WORKING_JOB_STATES,
        ).update(last_checkpoint_step=step, last_checkpoint_at=now)


@transaction.atomic
def _heartbeat_heals(node: Node) -> None:
    fresh = Node.objects.select_for_update().get(pk=node.pk)
    if fresh.state == NodeState.SUSPECT:
        fresh.save(update_fields=fresh.transition_to(NodeState.HEALTHY))
        record_event(EventKind.NODE_REPAIRED, actor=agent_actor(node), nodes_after=[node.name],
                     reason={"rule": "heartbeat", "text": f"{node.name} answered heartbeats again; healthy.",
                             "inputs": {"node": node.name, "from": "suspect"}})


def record_step_records(node: Node, job_name: str, records: list[dict[str, Any]]) -> tuple[int, int | None]:
    """Progress from a worker's step records: the job's committed step moves forward (never back
    past a fault's rollback, which resets it). Returns (newest step, job id), (-1, None) when
    the job is not running on this node. One conditional update, no transaction needed."""
    steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    if not steps:
        return -1, None
    newest = max(steps)
    job = Job.objects.filter(name=job_name, allocations__node=node).distinct().first()
    if job is None or job.state not in WORKING_JOB_STATES:
        return -1, None
    newest = min(newest, job.total_steps)
    Job.objects.filter(pk=job.pk, committed_steps__lt=newest).update(committed_steps=newest)
    return newest, job.pk


@transaction.atomic
def record_worker_exit(node: Node, job_name: str, outcome: dict[str, Any]) -> Job | None:
    """A job's workers exited on their own: completed (GPUs freed) or crashed (the job recovers)."""
    job = Job.objects.select_for_update().filter(name=job_name).first()
    if job is None or job.state not in (JobState.RUNNING,) or not job.allocations.filter(node=node).exists():
        return None
    result = outcome.get("outcome")
    actor = agent_actor(node)
    if result == "completed":
        step = outcome.get("step")
        fields = note_checkpoint(job, {"checkpoint_step": step}) if isinstance(step, int) else []
        gpus_before = job.allocations.count()
        job.committed_steps = job.total_steps if not isinstance(step, int) else min(step, job.total_steps)
        fields += job.transition_to(JobState.COMPLETED)
        job.save(update_fields=sorted({*fields, "committed_steps"}))
        nodes = release_allocations(job)
        record_event(EventKind.COMPLETE, job=job, actor=actor, nodes_before=nodes, gpus_before=gpus_before,
                     gpus_after=0, dp_before=job.dp, global_batch=job.global_batch,
                     outcome={"step": job.committed_steps},
                     reason={"rule": "complete", "text": f"{job.name} finished at step {job.committed_steps}.",
                             "inputs": {}})
    elif result in ("failed", "crashed"):
        record_job_fault(job, actor, f"{job.name}'s workers on {node.name} exited: {outcome.get('error') or result}")
    else:
        return None
    trigger_plan("worker_exit")
    return job

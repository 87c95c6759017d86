"""Checkpoint storage hygiene (docs/storage.md): the run dirs of cancelled and failed jobs are
removed once ``OMNI_RUN_DIR_RETENTION_S`` has passed, by a ``clean`` command to one agent, and
each removal is audited.

``sweep_run_dirs`` writes the commands (the periodic task ``jobs.sweep_run_dirs`` sends them
after commit; ``sweep_commands`` resends any left pending); ``run_dir_clean_done`` is the effect
of a ``clean``'s outcome (``jobs.actions.commands._OUTCOME_EFFECTS``). A ``clean`` carries
``{"job": name, "clean": true}`` and no layout: nothing treats it as a launch, the planner's
snapshot leaves it out, and its expiry changes nothing. This module imports nothing from
``jobs.actions.commands``, which imports it for the effect.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from jobs.actions._common import agent_actor, control_logger
from jobs.audit import record_event
from jobs.models import AllocationSpan, Command, Job, JobState, Node, NodeState
from jobs.models.commands import TERMINAL_COMMAND_STATES
from jobs.planner.wording import bytes_words, duration_words
from jobs.vocab import CommandKind, EventKind

if TYPE_CHECKING:
    from jobs.actions.commands import _Outcome

# The finished states whose run dirs are removed (a completed job's are its owner's result).
CLEANED_JOB_STATES = (JobState.CANCELLED, JobState.FAILED)
# After a clean that failed or expired, the next try waits this long.
CLEAN_RETRY_S = 3600.0
# At most this many clean commands per sweep: a backlog drains over a few sweeps.
SWEEP_BATCH = 100


def run_dir_retention() -> timedelta:
    return timedelta(seconds=settings.OMNI_RUN_DIR_RETENTION_S)


def connected_nodes(now: datetime) -> dict[int, Node]:
    """Healthy nodes whose agent was heard from within the heartbeat timeout, by id."""
    heard_after = now - timedelta(seconds=settings.OMNI_HEARTBEAT_INTERVAL_S * settings.OMNI_HEARTBEAT_MISSES)
    nodes = Node.objects.filter(state=NodeState.HEALTHY, last_heartbeat_at__gte=heard_after).order_by("name")
    return {node.pk: node for node in nodes}


@transaction.atomic
def sweep_run_dirs(now: datetime | None = None) -> list[Command]:
    """One ``clean`` command for each cancelled or failed job whose run dir outlived retention.

    A job qualifies once it finished ``OMNI_RUN_DIR_RETENTION_S`` ago, ran at some point (a job
    cancelled while pending has no run dir), has no ``run_dir_removed_at`` yet, no open clean
    command and none that failed within ``CLEAN_RETRY_S``. The command goes to one connected
    healthy node, the one the job ran on last if it is up (run dirs live under the shared
    ``--runs-dir``, so any node can remove them), else the first by name. Returns the commands
    written; the caller sends them after this commits. Two concurrent sweeps skip each other's
    locked rows, and a second outcome for the same job changes nothing.
    """
    now = now or timezone.now()
    nodes = connected_nodes(now)
    if not nodes:
        return []
    recent_clean = Command.objects.filter(job=OuterRef("pk"), kind=CommandKind.CLEAN).filter(
        ~Q(state__in=TERMINAL_COMMAND_STATES) | Q(created_at__gt=now - timedelta(seconds=CLEAN_RETRY_S))
    )
    due = list(
        Job.objects.select_for_update(skip_locked=True, no_key=True)
        .filter(state__in=CLEANED_JOB_STATES, finished_at__lte=now - run_dir_retention(),
                run_dir_removed_at__isnull=True, first_started_at__isnull=False)
        .exclude(Exists(recent_clean))
        .order_by("finished_at", "id")[:SWEEP_BATCH]
    )
    if not due:
        return []
    last_nodes: dict[int, list[int]] = {}
    spans = AllocationSpan.objects.filter(job__in=due).order_by("job_id", "-started_at", "-id")
    for job_id, node_id in spans.values_list("job_id", "node_id"):
        last_nodes.setdefault(job_id, []).append(node_id)
    fallback = next(iter(nodes.values()))
    written = []
    for job in due:
        node = next((nodes[n] for n in last_nodes.get(job.pk, []) if n in nodes), fallback)
        written.append(Command.objects.create(node=node, job=job, kind=CommandKind.CLEAN,
                                              payload={"job": job.name, "clean": True}))
    return written


def run_dir_clean_done(o: _Outcome) -> None:
    """A ``clean``'s outcome: note the run dir gone and audit it (``outcome`` carries
    ``removed`` and ``bytes_freed``). A failed clean is only logged: the next sweep after
    ``CLEAN_RETRY_S`` tries again."""
    record_run_dir_removed(o.job, o.node, o.command, ok=o.ok, reported=o.reported)


def record_run_dir_removed(job: Job, node: Node, command: Command, *, ok: bool, reported: dict[str, Any]) -> None:
    """Set ``Job.run_dir_removed_at`` and write the ``run_dir_removed`` audit row, once (the
    caller holds the job's row lock: ``record_command_outcome``)."""
    if job.run_dir_removed_at is not None:
        return
    if not ok:
        control_logger.warning("%s could not remove the run dir of %s: %s", node.name, job.name,
                               command.error or "no reason given")
        return
    removed = reported.get("removed") is True
    freed = reported.get("bytes_freed")
    freed = freed if isinstance(freed, int) and not isinstance(freed, bool) and freed >= 0 else 0
    now = timezone.now()
    job.run_dir_removed_at = now
    job.save(update_fields=["run_dir_removed_at"])
    finished = job.finished_at or now
    ago = f"the job {'was cancelled' if job.state == JobState.CANCELLED else 'failed'} " \
          f"{duration_words((now - finished).total_seconds())} ago"
    if removed:
        text = f"{node.name} removed the run dir of {job.name} ({bytes_words(freed)} freed); {ago}."
    else:
        text = f"{node.name} found no run dir of {job.name} to remove; {ago}."
    record_event(
        EventKind.RUN_DIR_REMOVED, job=job, actor=agent_actor(node), command=command.id, nodes_after=[node.name],
        outcome={"removed": removed, "bytes_freed": freed},
        reason={"rule": "storage.retention", "text": text,
                "inputs": {"retention_s": settings.OMNI_RUN_DIR_RETENTION_S, "state": job.state,
                           "finished_at": finished.isoformat()}},
    )

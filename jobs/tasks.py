"""Celery tasks of the control loop: thin shells around jobs.actions (docs/control-loop.md).

Each takes ids or plain values, ignores its result, and leaves every write to an action. The
periodic ones are declared in ``omniweb.scheduled``; in embedded mode ``omniweb.loop`` calls
the same functions in-process. Actions trigger ``jobs.plan_tick`` after commit by its name
(``delay_on_commit``, run eagerly in embedded mode) and never import this module.
"""

from __future__ import annotations

import logging

from celery import shared_task
from django.utils import timezone

from jobs import actions

logger = logging.getLogger(__name__)


@shared_task(name="jobs.plan_tick", ignore_result=True)
def plan_tick(trigger: str = "beat") -> None:
    """One planner pass (skipped when another holds the lock; the next tick catches up)."""
    result = actions.run_planner_pass(trigger)
    if result.run is None:
        logger.debug("planner pass (%s) skipped: another pass holds the lock", trigger)
    elif result.applied or result.deferred:
        logger.info("planner pass %s (%s): %d applied, %d deferred, %d commands", result.run.id, trigger,
                    result.applied, len(result.deferred), result.commands)


@shared_task(name="jobs.monitor_heartbeats", ignore_result=True)
def monitor_heartbeats() -> None:
    """Mark silent nodes suspect, then failed (their jobs go to recovering), by the silence the
    monitor has watched (``monitor_watching_since``)."""
    now = timezone.now()
    suspect, failed = actions.heartbeat_verdicts(now, actions.monitor_watching_since(now))
    for node, silence_s in suspect:
        try:
            actions.mark_node_suspect(node, silence_s)
        except actions.IllegalTransition:
            pass  # someone else moved it meanwhile
    for node, silence_s in failed:
        try:
            actions.mark_node_failed(node, silence_s)
        except actions.IllegalTransition:
            pass


@shared_task(name="jobs.sweep_commands", ignore_result=True)
def sweep_commands() -> None:
    """Retry unacknowledged commands, expire the hopeless, and (re)send any still pending: a
    dispatch lost with a broker or channel-layer outage is sent again from the outbox."""
    actions.expire_overdue_commands()
    actions.resend_pending_commands()


@shared_task(name="jobs.sweep_run_dirs", ignore_result=True)
def sweep_run_dirs() -> None:
    """Ask an agent to remove each run dir of a cancelled or failed job past its retention
    (docs/storage.md), and send the commands once they are committed."""
    commands = actions.sweep_run_dirs(timezone.now())
    for node_id in sorted({c.node_id for c in commands}):
        actions.send_node_commands(node_id)
    if commands:
        logger.info("asked to remove %d run dirs past their retention", len(commands))


@shared_task(name="jobs.prune_logs", ignore_result=True)
def prune_logs() -> None:
    """Delete the ranks' log lines older than ``OMNI_LOG_RETENTION_S`` (docs/logs.md)."""
    deleted = actions.prune_logs(timezone.now())
    if deleted:
        logger.info("pruned %d log lines past their retention", deleted)


@shared_task(name="jobs.publish_audit_head", ignore_result=True)
def publish_audit_head() -> None:
    """Append the audit chain's head to ``OMNI_AUDIT_HEADS`` unless it has not moved (docs/audit-log.md)."""
    from jobs.audit import audit_key, publish_head

    head = publish_head(key=audit_key())
    if head:
        logger.info("published audit head: row %d of %d rows", head["id"], head["rows"])

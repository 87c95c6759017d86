"""Celery tasks of the control loop: thin shells around jobs.actions (docs/control-loop.md).

Each takes ids or plain values, ignores its result, and leaves every write to an action. The
periodic ones are declared in ``omniweb.scheduled``; in embedded mode ``jobs.loop`` calls the
same functions in-process and ``delay_on_commit`` runs them eagerly after commit.
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from celery import shared_task
from channels.layers import get_channel_layer
from django.utils import timezone

from jobs import actions
from jobs.models import Node

logger = logging.getLogger(__name__)


def agent_group(node_id: int) -> str:
    """The channel-layer group an agent's socket joins: ``agent-{node id}``."""
    return f"agent-{node_id}"


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
    """Mark silent nodes suspect, then failed (their jobs go to recovering)."""
    suspect, failed = actions.heartbeat_verdicts(timezone.now())
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
    pending = (
        Node.objects.filter(commands__state=actions.CommandState.PENDING).values_list("id", flat=True).distinct()
    )
    for node_id in pending:
        dispatch_node_commands(node_id)


@shared_task(name="jobs.dispatch_node_commands", ignore_result=True)
def dispatch_node_commands(node_id: int) -> None:
    """Send a node's pending commands to its agent's socket (if connected) and mark them sent.

    The row is marked first and the frame sent after commit: a frame lost on the way is
    retried by ``sweep_commands`` after the ack timeout, and the agent drops duplicates.
    """
    commands = actions.claim_commands_for_dispatch(node_id)
    if not commands:
        return
    layer = get_channel_layer()
    if layer is None:
        return
    frames = [actions.command_frame(c) for c in commands]
    try:
        async_to_sync(layer.group_send)(agent_group(node_id), {"type": "agent.commands", "frames": frames})
    except Exception:  # the outbox keeps them; the sweep resends after the ack timeout
        logger.warning("could not hand %d command(s) for node %s to the channel layer", len(frames), node_id,
                       exc_info=True)

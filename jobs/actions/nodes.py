"""Node health: operators cordon, uncordon, drain and repair nodes; silent nodes become suspect,
then failed, and the jobs on a failed node recover elsewhere (docs/control-loop.md)."""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.db import transaction

from jobs.actions._common import WORKING_JOB_STATES, actor_name, trigger_plan
from jobs.actions.commands import expire_node_commands, record_job_fault
from jobs.audit import record_event
from jobs.models import Allocation, Job, Node, NodeState
from jobs.roles import require_operator
from jobs.vocab import EventKind


def _node_action(node: Node, actor, *, allowed: str, target: str, kind: EventKind, text: str) -> Node:
    """An operator moves the node to ``target``; audited as ``kind`` with ``text``."""
    require_operator(actor, allowed)
    node = Node.objects.select_for_update().get(pk=node.pk)
    before = node.state
    node.save(update_fields=node.transition_to(target))
    record_event(
        kind,
        actor=actor_name(actor),
        actor_user=actor,
        nodes_before=[node.name],
        nodes_after=[node.name],
        reason={"rule": kind, "text": text, "inputs": {"node": node.name, "from": before, "to": target}},
    )
    return node


@transaction.atomic
def cordon_node(node: Node, actor) -> Node:
    """No new work lands on the node; what runs there stays."""
    text = f"{actor_name(actor)} cordoned {node.name}: no new work will be placed there."
    return _node_action(node, actor, allowed="cordon nodes", target=NodeState.CORDONED, kind=EventKind.CORDON,
                        text=text)


@transaction.atomic
def uncordon_node(node: Node, actor) -> Node:
    """Return a cordoned or draining node to service."""
    text = f"{actor_name(actor)} returned {node.name} to service."
    return _node_action(node, actor, allowed="uncordon nodes", target=NodeState.HEALTHY, kind=EventKind.UNCORDON,
                        text=text)


@transaction.atomic
def drain_node(node: Node, actor) -> Node:
    """No new work; the planner moves what runs there off gracefully (checkpoint first)."""
    # A set, not .distinct(): Allocation's default ordering would make each GPU a distinct row.
    held = set(Allocation.objects.filter(node=node).values_list("job__name", flat=True))
    text = f"{actor_name(actor)} drained {node.name}; running there: {', '.join(sorted(held)) or 'nothing'}."
    return _node_action(node, actor, allowed="drain nodes", target=NodeState.DRAINING, kind=EventKind.DRAIN,
                        text=text)


@transaction.atomic
def mark_node_repaired(node: Node, actor) -> Node:
    """An operator (or a health check) re-admits a failed or suspect node."""
    text = f"{actor_name(actor)} marked {node.name} repaired and healthy."
    return _node_action(node, actor, allowed="mark nodes repaired", target=NodeState.HEALTHY,
                        kind=EventKind.NODE_REPAIRED, text=text)


# -- heartbeat verdicts ----------------------------------------------------------------------


@transaction.atomic
def mark_node_suspect(node: Node, silence_s: float) -> Node:
    """A node missed a heartbeat: suspect (nothing moves yet)."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    node.save(update_fields=node.transition_to(NodeState.SUSPECT))
    record_event(EventKind.NODE_SUSPECT, actor="system", nodes_before=[node.name], nodes_after=[node.name],
                 reason={"rule": "heartbeat", "text": f"{node.name} silent for {silence_s:.1f}s; suspect.",
                         "inputs": {"node": node.name, "silence_s": round(silence_s, 2)}})
    return node


@transaction.atomic
def mark_node_failed(node: Node, silence_s: float) -> Node:
    """A node missed too many heartbeats: failed. Its jobs lose their unsaved steps and go to
    ``recovering``; its open commands expire; the planner recovers the jobs elsewhere."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    before = node.state
    node.save(update_fields=node.transition_to(NodeState.FAILED))
    misses = silence_s / settings.OMNI_HEARTBEAT_INTERVAL_S
    record_event(EventKind.NODE_FAILED, actor="system", nodes_before=[node.name], nodes_after=[node.name],
                 reason={"rule": "heartbeat", "text": f"{node.name} silent for {silence_s:.1f}s "
                         f"({misses:.1f} heartbeat intervals); failed.",
                         "inputs": {"node": node.name, "from": before, "silence_s": round(silence_s, 2)}})
    expire_node_commands(node, "node failed")
    job_ids = set(Allocation.objects.filter(node=node).values_list("job_id", flat=True))
    for job in Job.objects.select_for_update().filter(pk__in=job_ids).order_by("pk"):
        if job.state in WORKING_JOB_STATES:
            record_job_fault(job, "system", f"{node.name} failed under {job.name}", kind=EventKind.NODE_FAILED)
    trigger_plan("node_failed")
    return node


def heartbeat_verdicts(now: datetime) -> tuple[list[tuple[Node, float]], list[tuple[Node, float]]]:
    """Which nodes to mark suspect and which failed, by the silence since their last heartbeat.

    Suspect after 1.5 intervals (one heartbeat missed); failed once ``OMNI_HEARTBEAT_MISSES``
    intervals have passed, less the monitor's own tick, so detection lands within that many
    intervals of the last sign of life. Nodes that never sent a heartbeat are not judged.
    """
    interval = settings.OMNI_HEARTBEAT_INTERVAL_S
    fail_after = max(interval, interval * settings.OMNI_HEARTBEAT_MISSES - monitor_tick_s())
    suspect: list[tuple[Node, float]] = []
    failed: list[tuple[Node, float]] = []
    watched = Node.objects.filter(
        last_heartbeat_at__isnull=False,
        state__in=[NodeState.HEALTHY, NodeState.SUSPECT, NodeState.DRAINING, NodeState.CORDONED],
    )
    for node in watched:
        silence_s = (now - node.last_heartbeat_at).total_seconds()
        if silence_s >= fail_after:
            failed.append((node, silence_s))
        elif silence_s >= 1.5 * interval and node.state == NodeState.HEALTHY:
            suspect.append((node, silence_s))
    return suspect, failed


def monitor_tick_s() -> float:
    """How often monitor_heartbeats runs: a quarter heartbeat interval, at most a second."""
    return min(1.0, settings.OMNI_HEARTBEAT_INTERVAL_S / 4.0)

"""Nodes: operators register, edit and remove them, and cordon, uncordon, drain and repair them;
silent nodes become suspect, then failed, and the jobs on a failed node recover elsewhere
(docs/control-loop.md)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.cache import caches
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q, QuerySet, TextField
from django.db.models.functions import Cast

from jobs.actions._common import (
    WORKING_JOB_STATES,
    actor_name,
    control_logger,
    describe_changes,
    trigger_plan,
)
from jobs.actions.commands import expire_node_commands, record_job_fault
from jobs.actions.edits import (
    changed_facts,
    refuse_fields,
    refuse_invalid,
    wait_for_planner,
    with_changes,
)
from jobs.audit import record_event
from jobs.models import Allocation, ElasticEvent, Job, Node, NodeState
from jobs.roles import require_operator
from jobs.vocab import EventKind


def _node_action(node: Node, actor, *, allowed: str, target: str, kind: EventKind, text: str) -> Node:
    """An operator moves the node to ``target``; audited as ``kind`` with ``text``."""
    require_operator(actor, allowed)
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
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


# -- the node record: register, edit, remove ---------------------------------------------------

# What an operator may change on a node: where it sits and what GPUs it has. Its name is how
# agents, commands and the audit log know it; state, heartbeat and speed factor are measured.
NODE_EDITABLE = ("rack", "switch", "gpu_model", "gpu_count")
# A node's own bookkeeping rows describe the record, not work done on the node: they do not stop
# a mistaken registration from being removed.
NODE_RECORD_EVENTS = (EventKind.NODE_REGISTERED, EventKind.NODE_EDITED, EventKind.NODE_REMOVED)


def node_with_changes(node: Node, changes: dict[str, Any]) -> Node:
    """The node as the edit would leave it (for an unsaved node: as registered), or a
    ValidationError naming each refused field. The admin's form asks it; the actions ask again
    under their locks."""
    errors = refuse_fields(changes, NODE_EDITABLE if node.pk is not None else ("name", *NODE_EDITABLE))
    gpu_count = changes.get("gpu_count")
    if gpu_count is not None and gpu_count < 1:
        errors["gpu_count"] = ["a node has at least one GPU"]
    elif gpu_count is not None and node.pk is not None:
        # GPU indexes run from 0: fewer GPUs than the highest held index + 1 would strand a job.
        held = (Allocation.objects.filter(node=node, gpu_index__gte=gpu_count).select_related("job")
                .order_by("-gpu_index").first())
        if held is not None:
            errors["gpu_count"] = [
                f"{node.name} cannot have {gpu_count} GPUs: GPU {held.gpu_index} is held by {held.job.name}; "
                f"keep at least {held.gpu_index + 1}, or drain the node first"
            ]
    edited = with_changes(node, changes)
    refuse_invalid(edited, errors)
    return edited


@transaction.atomic
def register_node(actor, *, name: str, rack: str, switch: str, gpu_count: int, gpu_model: str = "H100-80GB") -> Node:
    """Add a machine to the cluster, healthy; its agent needs a token (``issue_agent_token``).
    ``actor`` None is the server's own command line (``manage.py add_node``), audited as ``system``."""
    if actor is not None:
        require_operator(actor, "register nodes")
    facts = {"name": name, "rack": rack, "switch": switch, "gpu_count": gpu_count, "gpu_model": gpu_model}
    node = node_with_changes(Node(), facts)
    node.save(force_insert=True)
    record_event(
        EventKind.NODE_REGISTERED,
        actor=actor_name(actor),
        actor_user=actor,
        nodes_after=[name],
        reason={
            "rule": "node_registered",
            "text": f"{actor_name(actor)} registered node {name}: {gpu_count}x {gpu_model} in rack {rack}, "
            f"switch {switch}.",
            "inputs": facts,
        },
    )
    return node


@transaction.atomic
def edit_node(node: Node, actor, **changes: Any) -> Node:
    """Change where a node sits or what GPUs it has; a GPU count that would strand GPUs that jobs
    hold is refused. The audit row keeps the before and after."""
    require_operator(actor, "edit nodes")
    wait_for_planner()
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    edited = node_with_changes(node, changes)
    before, after = changed_facts(node, edited, list(changes))
    if not before:
        return node
    edited.save(update_fields=list(before))
    record_event(
        EventKind.NODE_EDITED,
        actor=actor_name(actor),
        actor_user=actor,
        nodes_before=[node.name],
        nodes_after=[node.name],
        reason={
            "rule": "node_edited",
            "text": f"{actor_name(actor)} changed node {node.name}: {describe_changes(before, after)}.",
            "inputs": {"node": node.name, "before": before, "after": after},
        },
    )
    return edited


def _audit_rows_naming(name: str) -> QuerySet[ElasticEvent]:
    # Node names sit in JSON (the node lists, the reason's inputs). Matching the quoted name in
    # their text works on PostgreSQL and SQLite alike; a node is removed rarely enough to scan.
    quoted = json.dumps(name)
    return ElasticEvent.objects.alias(
        before_text=Cast("nodes_before", TextField()),
        after_text=Cast("nodes_after", TextField()),
        why_text=Cast("reason", TextField()),
    ).filter(Q(before_text__contains=quoted) | Q(after_text__contains=quoted) | Q(why_text__contains=quoted))


def node_history(node: Node) -> dict[str, int]:
    """What the cluster remembers of the node beyond its own record, by kind: every row that
    points at it (GPUs held now and before, commands, telemetry streams, and whatever relation is
    added later) and the audit rows that name it."""
    history = {
        str(rel.related_model._meta.verbose_name_plural): rel.related_model._base_manager.filter(
            **{rel.field.name: node}).count()
        for rel in Node._meta.related_objects
    }
    history["audit rows"] = _audit_rows_naming(node.name).exclude(kind__in=NODE_RECORD_EVENTS).count()
    return history


def node_removal_refusal(node: Node) -> str:
    """Why the node may not be removed, as a sentence; empty when it may."""
    history = ", ".join(f"{what}: {count}" for what, count in node_history(node).items() if count)
    if not history:
        return ""
    return f"{node.name} has history ({history}) and cannot be deleted; cordon it to keep it out of service."


@transaction.atomic
def remove_node(node: Node, actor) -> None:
    """Delete a node that never did any work (a mistaken registration); one with history stays."""
    require_operator(actor, "remove nodes")
    wait_for_planner()
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    refusal = node_removal_refusal(node)
    if refusal:
        raise ValidationError(refusal)
    facts = {field: getattr(node, field) for field in ("name", *NODE_EDITABLE)}
    node.delete()
    record_event(
        EventKind.NODE_REMOVED,
        actor=actor_name(actor),
        actor_user=actor,
        nodes_before=[facts["name"]],
        reason={
            "rule": "node_removed",
            "text": f"{actor_name(actor)} removed node {facts['name']} ({facts['gpu_count']}x "
            f"{facts['gpu_model']}); it had held no GPUs for a job and received no commands.",
            "inputs": facts,
        },
    )


# -- heartbeat verdicts ----------------------------------------------------------------------


@transaction.atomic
def mark_node_suspect(node: Node, silence_s: float) -> Node:
    """A node missed a heartbeat: suspect (nothing moves yet)."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    node.save(update_fields=node.transition_to(NodeState.SUSPECT))
    record_event(EventKind.NODE_SUSPECT, actor="system", nodes_before=[node.name], nodes_after=[node.name],
                 reason={"rule": "heartbeat", "text": f"{node.name} silent for {silence_s:.1f}s; suspect.",
                         "inputs": {"node": node.name, "silence_s": round(silence_s, 2)}})
    return node


@transaction.atomic
def mark_node_failed(node: Node, silence_s: float) -> Node:
    """A node missed too many heartbeats: failed. Its jobs lose their unsaved steps and go to
    ``recovering``; its open commands expire; the planner recovers the jobs elsewhere."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    before = node.state
    node.save(update_fields=node.transition_to(NodeState.FAILED))
    # Every row lock before the first audit row: recording takes the audit chain's lock until
    # commit, and a transaction that holds it while waiting for a row another one holds (an
    # agent's outcome on one of these commands, a cancel of one of these jobs, each of which
    # records its own event after its row lock) deadlocks with it.
    expire_node_commands(node, "node failed")
    job_ids = set(Allocation.objects.filter(node=node).values_list("job_id", flat=True))
    jobs = list(Job.objects.select_for_update(no_key=True).filter(pk__in=job_ids).order_by("pk"))
    misses = silence_s / settings.OMNI_HEARTBEAT_INTERVAL_S
    record_event(EventKind.NODE_FAILED, actor="system", nodes_before=[node.name], nodes_after=[node.name],
                 reason={"rule": "heartbeat", "text": f"{node.name} silent for {silence_s:.1f}s "
                         f"({misses:.1f} heartbeat intervals); failed.",
                         "inputs": {"node": node.name, "from": before, "silence_s": round(silence_s, 2)}})
    for job in jobs:
        if job.state in WORKING_JOB_STATES:
            record_job_fault(job, "system", f"{node.name} failed under {job.name}", kind=EventKind.NODE_FAILED)
    trigger_plan("node_failed")
    return node


# A node is suspect once its heartbeat is a whole interval late. It was 1.5 intervals (half an
# interval late): on the demo's 2 cores, agents beside two torch workers and a browser, heartbeats
# came 2.5-3.4 s late (silences of 7.5-8.4 s at a 5 s interval) about every two minutes, each a
# node_suspect row and a node_repaired row a second later, and an amber node on the Cluster page.
# Failure detection is unchanged (OMNI_HEARTBEAT_MISSES intervals); a control-plane outage is
# still told by nodes that have missed half an interval (OUTAGE_SILENCE_INTERVALS).
SUSPECT_AFTER_INTERVALS = 2.0
OUTAGE_SILENCE_INTERVALS = 1.5


def heartbeat_verdicts(now: datetime, watched_since: datetime | None = None
                       ) -> tuple[list[tuple[Node, float]], list[tuple[Node, float]]]:
    """Which nodes to mark suspect and which failed, by the silence since their last heartbeat.

    ``watched_since`` (``monitor_watching_since``): silence before it is not the nodes' to
    answer for, since nobody was listening: a node last heard before it counts as heard then.

    Suspect after ``SUSPECT_AFTER_INTERVALS`` (a heartbeat a whole interval late); failed after
    ``failure_delay_s``. Nodes that never sent a heartbeat are not judged.
    """
    interval = settings.OMNI_HEARTBEAT_INTERVAL_S
    fail_after = failure_delay_s()
    suspect: list[tuple[Node, float]] = []
    failed: list[tuple[Node, float]] = []
    watched = Node.objects.filter(
        last_heartbeat_at__isnull=False,
        state__in=[NodeState.HEALTHY, NodeState.SUSPECT, NodeState.DRAINING, NodeState.CORDONED],
    )
    watched = list(watched)
    if watched_since is not None:
        for node in watched:  # in memory only: mark_node_* read the row again
            node.last_heartbeat_at = max(node.last_heartbeat_at, watched_since)
    for node in watched:
        silence_s = (now - node.last_heartbeat_at).total_seconds()
        if silence_s >= fail_after:
            failed.append((node, silence_s))
        elif silence_s >= SUSPECT_AFTER_INTERVALS * interval and node.state == NodeState.HEALTHY:
            suspect.append((node, silence_s))
    share = settings.OMNI_HEARTBEAT_MASS_SILENCE
    if share >= 1.0 or len(watched) < 2:
        return suspect, failed
    # Silent at once: every node that has missed a heartbeat, not only those already past the
    # failure delay. Their last heartbeats are spread over an interval, so in an outage they
    # cross the delay one monitor tick after another, and counting only those past it failed
    # the first ones alone (bench.faults: daphne back after 5-6 s against a 6 s delay).
    silent = [node for node in watched
              if (now - node.last_heartbeat_at).total_seconds() >= OUTAGE_SILENCE_INTERVALS * interval]
    together = len(silent) >= max(2, share * len(watched))
    if together:
        # An outage: every node that has missed half an interval is suspect, not only those a
        # whole interval late (one late node is jitter; most of them at once is not).
        named = {n.pk for n, _ in suspect} | {n.pk for n, _ in failed}
        suspect += [(n, (now - n.last_heartbeat_at).total_seconds()) for n in silent
                    if n.state == NodeState.HEALTHY and n.pk not in named]
    if not failed and not together:
        return suspect, failed  # nothing to judge and no outage to remember: the cache is not read
    patience_s = fail_after * settings.OMNI_HEARTBEAT_OUTAGE_PATIENCE
    span = outage_span(silent if together else [], now, patience_s + fail_after)
    if span is None or not failed:
        return suspect, failed
    began, seen = span
    # Most nodes silent at once is the control plane's outage (its ASGI server, the network in
    # front of it), not theirs: Kubernetes' node controller stops evicting in a full disruption
    # for the same reason. Failing them would send every job back to its checkpoint and every
    # node to an operator's repair. They stay suspect until they are heard again, or until the
    # silence lasts OMNI_HEARTBEAT_OUTAGE_PATIENCE x longer. So do the last ones of an outage
    # that is ending: nodes are heard again one by one, and those still silent fell below the
    # share and failed alone; a node last heard between the outage's start and its end is one of
    # them (one heard after it ended and silent since has failed on its own).
    held = [(n, s) for n, s in failed
            if s < patience_s and began - timedelta(seconds=interval) <= n.last_heartbeat_at <= seen]
    if held:
        control_logger.warning(
            "%d of %d nodes silent since a control-plane outage began at %s: %d kept suspect, not failed",
            len(failed), len(watched), began.isoformat(), len(held))
        kept = {n.pk for n, _ in held}
        failed = [(n, s) for n, s in failed if n.pk not in kept]
        suspect += [(n, s) for n, s in held if n.state == NodeState.HEALTHY]
    return suspect, failed


OUTAGE_KEY = "heartbeat:outage"
WATCH_KEY = "heartbeat:watching"


def monitor_watching_since(now: datetime) -> datetime | None:
    """Since when the heartbeat monitor has watched without a gap of more than a failure delay:
    ``now`` when it starts, or resumes after one (the control plane stopped: a restart, a deploy,
    the demo run again on its database), else when it last did. A node's silence counts from
    then at the earliest (``heartbeat_verdicts``): a control plane back after ten minutes found
    every node silent for ten minutes and failed them all, though their agents were reconnecting
    that second (found 2026-12-07 running ``make demo`` again: six failed nodes, seven jobs
    recovering for ever). A node that did die meanwhile fails a failure delay after the monitor
    is back. Remembered in the shared cache with the outage (every worker's monitor reads it);
    None when the cache cannot be read (judged as before)."""
    gap_s = failure_delay_s()
    store = caches["throttle"]
    try:
        remembered = store.get(WATCH_KEY)
    except Exception:
        control_logger.warning("heartbeat monitor's watch memory unreadable; judging by the last heartbeats")
        return None
    since_ts = now.timestamp()
    if remembered is not None and 0 <= now.timestamp() - remembered[1] <= gap_s:
        since_ts = min(remembered[0], since_ts)
    elif remembered is not None:
        control_logger.warning("heartbeat monitor resumed after %.0f s: silence counts from now",
                               now.timestamp() - remembered[1])
    try:
        store.set(WATCH_KEY, [since_ts, now.timestamp()], timeout=None)
    except Exception:
        control_logger.warning("heartbeat monitor's watch memory not written")
    return datetime.fromtimestamp(since_ts, tz=UTC)


def outage_span(together: list[Node], now: datetime, remember_s: float) -> tuple[datetime, datetime] | None:
    """The control-plane outage now going on, or just over: (when it began, the earliest last
    heartbeat of the nodes silent together; when it was last seen). ``together``: the nodes
    silent together now, if they are enough to be an outage (else empty). Remembered in the
    shared cache (Redis in production: every worker's monitor reads it) for ``remember_s`` after
    it was last seen; None when there is none."""
    store = caches["throttle"]
    try:
        remembered = store.get(OUTAGE_KEY)
    except Exception:  # Redis away (restarting): judge by what is silent now, as before
        control_logger.warning("outage memory unreadable; judging by the nodes silent now")
        remembered = None
    span = None
    if remembered is not None:
        began_ts, seen_ts = remembered
        span = (datetime.fromtimestamp(began_ts, tz=UTC), datetime.fromtimestamp(seen_ts, tz=UTC))
    if together:
        first = min(node.last_heartbeat_at for node in together)
        span = (first if span is None else min(span[0], first), now)
        try:
            store.set(OUTAGE_KEY, [t.timestamp() for t in span], timeout=remember_s)
        except Exception:
            control_logger.warning("outage memory not written; judging by the nodes silent now")
    return span


def forget_outage() -> None:
    """Forget a remembered outage and watch (tests: one test's silence is not the next's)."""
    caches["throttle"].delete_many([OUTAGE_KEY, WATCH_KEY])


def failure_delay_s() -> float:
    """The silence after which a node fails: ``OMNI_HEARTBEAT_MISSES`` intervals less the
    monitor's own tick, so detection lands within that many intervals of the last sign of life."""
    interval = settings.OMNI_HEARTBEAT_INTERVAL_S
    return max(interval, interval * settings.OMNI_HEARTBEAT_MISSES - monitor_tick_s())


def monitor_tick_s() -> float:
    """How often monitor_heartbeats runs: a quarter heartbeat interval, at most a second."""
    return min(1.0, settings.OMNI_HEARTBEAT_INTERVAL_S / 4.0)

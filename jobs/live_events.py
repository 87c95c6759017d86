"""What the live pages are told when the audit log grows: complete payloads, sent after commit.

Every change in Omni goes through an action that appends an :class:`ElasticEvent` in the same
transaction, so one ``post_save`` receiver on that model is enough to keep every page live,
whoever made the change (a view, the API, the planner in a Celery worker, an agent). Once the
transaction commits it sends:

* ``audit``            -> event ``audit``: the row as the auditor's table shows it;
* ``job-{id}``         -> event ``job_event``: the row plus the job's current summary;
* ``cluster``          -> event ``job`` (a job's summary) and/or ``node`` (a node with its GPUs);
* ``node-{id}``        -> event ``node``.

The payload shapes are documented in docs/live-ui.md; the sentences come from
:func:`describe_event`, the same function the pages use, so a live row reads exactly like a
reloaded one.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

from django.db import transaction
from django.db.models.signals import post_save
from django.utils import timezone

from jobs.live import AUDIT_GROUP, CLUSTER_GROUP, broadcast_now, job_group, node_group
from jobs.models import Allocation, ElasticEvent, Job, Node

logger = logging.getLogger(__name__)

NODE_EVENT_KINDS = frozenset(
    {"drain", "cordon", "uncordon", "node_suspect", "node_failed", "node_repaired"}
)
_NODE_NAME = re.compile(r"^(?P<prefix>.*?)(?P<number>\d+)$")


def compact_nodes(names: Iterable[str]) -> str:
    """``["r1s0n2", "r1s0n3", "r1s1n0"]`` -> ``"r1s0n2-n3, r1s1n0"``: runs on one switch read as one."""
    groups: list[tuple[str, list[int]]] = []
    others: list[str] = []
    for name in sorted(set(names), key=_natural_key):
        match = _NODE_NAME.match(name)
        if not match:
            others.append(name)
            continue
        prefix, number = match["prefix"], int(match["number"])
        if groups and groups[-1][0] == prefix and groups[-1][1][-1] == number - 1:
            groups[-1][1].append(number)
        else:
            groups.append((prefix, [number]))
    parts = []
    for prefix, numbers in groups:
        if len(numbers) == 1:
            parts.append(f"{prefix}{numbers[0]}")
        else:
            tail = re.sub(r"^.*?([A-Za-z]*)$", r"\1", prefix)
            parts.append(f"{prefix}{numbers[0]}-{tail}{numbers[-1]}")
    return ", ".join(parts + others)


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _seconds(value: Any) -> str:
    try:
        return f"{float(value):.0f} s" if float(value) >= 10 else f"{float(value):.1f} s"
    except (TypeError, ValueError):
        return str(value)


def describe_event(event: ElasticEvent, *, with_time: bool = True) -> str:
    """One plain sentence for a row: the decision's own words, then what actually happened.

    ``with_time`` starts it with the hour ("14:02 Preempted ..."), for places that show no
    time column of their own (the dashboard's "last event")."""
    at = timezone.localtime(event.at).strftime("%H:%M")
    text = event.reason_text.strip() if isinstance(event.reason, dict) else ""
    if not text:
        subject = event.job_name or compact_nodes(event.nodes_after or event.nodes_before) or "the cluster"
        text = f"{event.get_kind_display()} {subject}."
    sentence = f"{at} {text}" if with_time else text
    extras = []
    outcome = event.outcome if isinstance(event.outcome, dict) else {}
    step = outcome.get("checkpoint_step", outcome.get("step"))
    save_s = outcome.get("save_s", outcome.get("checkpoint_s"))
    if step is not None and save_s is not None:
        extras.append(f"checkpoint at step {step} saved in {_seconds(save_s)}")
    elif step is not None:
        extras.append(f"checkpoint at step {step}")
    elif save_s is not None:
        extras.append(f"checkpoint saved in {_seconds(save_s)}")
    if outcome.get("steps_lost") not in (None, 0):
        extras.append(f"{outcome['steps_lost']} steps lost")
    if outcome.get("error"):
        extras.append(f"error: {outcome['error']}")
    if event.nodes_after and event.kind not in NODE_EVENT_KINDS and event.kind in (
        "place", "lend", "grow", "shrink", "recover", "migrate", "reconfigure"
    ):
        extras.append(f"on {compact_nodes(event.nodes_after)}")
    if extras:
        sentence = sentence.rstrip(".") + "; " + "; ".join(extras) + "."
    return sentence


def event_payload(event: ElasticEvent) -> dict[str, Any]:
    """The row as every page draws it (table cell, log line, chart marker)."""
    return {
        "id": event.pk,
        "at": event.at.isoformat(),
        "kind": event.kind,
        "kind_label": event.get_kind_display(),
        "job_id": event.job_id,
        "job": event.job_name,
        "actor": event.actor,
        "planner_run": str(event.planner_run) if event.planner_run else None,
        "refers_to": event.refers_to_id,
        "nodes_before": event.nodes_before,
        "nodes_after": event.nodes_after,
        "gpus_before": event.gpus_before,
        "gpus_after": event.gpus_after,
        "dp_before": event.dp_before,
        "dp_after": event.dp_after,
        "accum_before": event.accum_before,
        "accum_after": event.accum_after,
        "global_batch": event.global_batch,
        "rule": event.reason.get("rule", "") if isinstance(event.reason, dict) else "",
        "text": describe_event(event),
        "sentence": describe_event(event, with_time=False),
        "reason": event.reason,
        "outcome": event.outcome,
        "hash": event.hash,
    }


def job_summary(job: Job, gpus: int, borrowed: int) -> dict[str, Any]:
    """A job's row on the dashboard; ETA is the spec's step time until telemetry says otherwise."""
    remaining = max(job.total_steps - job.committed_steps, 0)
    return {
        "id": job.pk,
        "name": job.name,
        "owner": job.owner.get_username() if job.owner_id else "",
        "priority": job.priority,
        "priority_label": job.get_priority_display(),
        "state": job.state,
        "state_label": job.get_state_display(),
        "gpus": gpus,
        "borrowed_gpus": borrowed,
        "tp": job.tp,
        "pp": job.pp,
        "dp": job.dp,
        "accum_steps": job.accum_steps,
        "global_batch": job.global_batch,
        "committed_steps": job.committed_steps,
        "total_steps": job.total_steps,
        "progress": round(job.progress, 4),
        "remaining_steps": remaining,
        "pending_reason": job.pending_reason,
        "last_checkpoint_step": job.last_checkpoint_step,
        "preemptions": job.preemptions,
    }


def node_summary(node: Node) -> dict[str, Any]:
    """A node on the cluster map: health, and who holds each GPU (owned or borrowed)."""
    held = {
        a.gpu_index: a
        for a in Allocation.objects.filter(node=node).select_related("job")
    }
    return {
        "id": node.pk,
        "name": node.name,
        "rack": node.rack,
        "switch": node.switch,
        "state": node.state,
        "state_label": node.get_state_display(),
        "gpus": [
            {
                "index": i,
                "job": held[i].job.name if i in held else None,
                "job_id": held[i].job_id if i in held else None,
                "priority": held[i].job.priority if i in held else None,
                "borrowed": held[i].borrowed_from_id is not None if i in held else False,
            }
            for i in range(node.gpu_count)
        ],
    }


def broadcast_event(event_id: int) -> None:
    """Send the committed row and the state it changed to every group that shows it."""
    event = ElasticEvent.objects.select_related("job__owner").filter(pk=event_id).first()
    if event is None:
        return
    payload = event_payload(event)
    broadcast_now(AUDIT_GROUP, "audit", payload)
    if event.job_id is not None:
        job = event.job
        allocations = list(Allocation.objects.filter(job=job).values_list("borrowed_from_id", flat=True))
        summary = job_summary(job, len(allocations), sum(1 for b in allocations if b is not None))
        broadcast_now(job_group(job.pk), "job_event", {"event": payload, "job": summary})
        broadcast_now(CLUSTER_GROUP, "job", summary)
    names = set(event.nodes_before) | set(event.nodes_after)
    if names and (event.kind in NODE_EVENT_KINDS or event.job_id is not None):
        for node in Node.objects.filter(name__in=names):
            summary = node_summary(node)
            broadcast_now(CLUSTER_GROUP, "node", summary)
            broadcast_now(node_group(node.pk), "node", summary)


def _on_event_saved(sender, instance: ElasticEvent, created: bool, raw: bool = False, **kwargs) -> None:
    if not created or raw:
        return
    event_id = instance.pk

    def send() -> None:
        try:
            broadcast_event(event_id)
        except Exception:  # the write has committed; a lost live message is re-read on reload
            logger.exception("live broadcast of audit row %s failed", event_id)

    transaction.on_commit(send)


def connect() -> None:
    """Hook the receiver (called once from JobsConfig.ready)."""
    post_save.connect(_on_event_saved, sender=ElasticEvent, dispatch_uid="omni-live-audit-broadcast")

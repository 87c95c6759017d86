"""What the live pages are told when Omni changes: complete payloads, built after commit.

Every change in Omni goes through an action that appends an :class:`ElasticEvent` in the same
transaction, so one ``post_save`` receiver on that model is enough to keep every page live,
whoever made the change (a view, the API, the planner in a Celery worker, an agent); a planner
pass that changes nothing still writes its ``PlannerRun``. Through :func:`jobs.live.send_built`
the rows of one transaction are turned into messages together, after it commits:

* ``audit``            -> event ``audit``: the row as the auditor's table shows it, and one
                          ``chain``: the new rows checked against their hashes and links;
* ``job-{id}``         -> event ``job_event``: the row plus the job's current summary;
* ``cluster``          -> event ``job`` (a job's summary) and/or ``node`` (a node with its GPUs),
                          and one ``cluster_summary`` (the Cluster page's header, queue, planner
                          line and a utilisation point; also after every planner run);
* ``node-{id}``        -> event ``node``.

The payload shapes are documented in docs/live-ui.md; the sentences come from
:func:`describe_event`, the same function the pages use, so a live row reads exactly like a
reloaded one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.db.models import Q, Subquery
from django.db.models.signals import post_save
from django.utils import timezone

from jobs import live
from jobs.audit import GENESIS_HASH, link_problem
from jobs.live import AUDIT_GROUP, CLUSTER_GROUP, job_group, node_group
from jobs.models import Allocation, ElasticEvent, Job, Node, PlannerRun
from jobs.planner.wording import bytes_words
from jobs.snapshot import low_on_disk
from jobs.vocab import EventKind
from jobs.waiting import waiting_note

NODE_EVENT_KINDS = frozenset({
    EventKind.DRAIN, EventKind.CORDON, EventKind.UNCORDON, EventKind.NODE_SUSPECT, EventKind.NODE_FAILED,
    EventKind.NODE_REPAIRED, EventKind.NODE_REGISTERED, EventKind.NODE_EDITED, EventKind.NODE_REMOVED,
})
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
        "waiting": _waiting(job),
        "last_checkpoint_step": job.last_checkpoint_step,
        "last_checkpoint_at": job.last_checkpoint_at.isoformat() if job.last_checkpoint_at else None,
        "preemptions": job.preemptions,
    }


def _waiting(job: Job) -> dict[str, Any] | None:
    """The dashboard's waiting text, live: the words a reloaded row shows (``jobs.waiting``),
    with the planner's latest note as the reason (no query)."""
    note = waiting_note(job, None)
    if note is None:
        return None
    return {"lead": note["lead"], "since": note["since"].isoformat(), "style": note["style"], "tail": note["tail"],
            "reason": note["reason"], "cannot_fit": note["cannot_fit"]}


def disk_note(node: Node) -> dict[str, Any] | None:
    """A node's runs-dir space as the console shows it, or None when its agent never reported
    it: ``text`` ("41 GiB free of 2 TiB"), and ``low`` with its ``warning`` when it is under
    ``OMNI_MIN_FREE_DISK_BYTES`` (``jobs.snapshot.low_on_disk``, the planner's own test)."""
    if node.disk_free_bytes is None:
        return None
    total = node.disk_total_bytes
    text = f"{bytes_words(node.disk_free_bytes)} free" + (f" of {bytes_words(total)}" if total else "")
    low = low_on_disk(node)
    warning = (f"low disk: no new placements ({bytes_words(node.disk_free_bytes)} free in its runs dir, under "
               f"the {bytes_words(settings.OMNI_MIN_FREE_DISK_BYTES)} minimum)") if low else ""
    return {"free_bytes": node.disk_free_bytes, "total_bytes": total, "text": text, "low": low, "warning": warning}


def node_summary(node: Node, held: dict[int, Allocation]) -> dict[str, Any]:
    """A node on the cluster map: health, runs-dir space (``disk_note``), and who holds each GPU
    (``held``: GPU index -> its allocation, with the job loaded), owned or borrowed."""
    return {
        "id": node.pk,
        "name": node.name,
        "rack": node.rack,
        "switch": node.switch,
        "state": node.state,
        "state_label": node.get_state_display(),
        "disk": disk_note(node),
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


def audit_messages(event_ids: list[int]) -> list[live.Message]:
    """The messages for the audit rows one transaction committed, built together in three
    queries however many rows: the rows (with their jobs, owners and the row before them), the
    affected nodes, and the allocations of the affected jobs and nodes.

    Per row, in id order: ``audit`` to ``audit``; ``job_event`` to ``job-{id}``; the job's summary
    (``job``) to ``cluster``; each node it moved or changed (``node``) to ``cluster`` and
    ``node-{id}``; then one ``chain`` message to ``audit``: the new rows checked against their
    hashes and the row before them. Summaries are the state after the transaction, so coalescing
    keeps one per job and node.
    """
    first = min(event_ids)
    before = ElasticEvent.objects.filter(id__lt=first).order_by("-id").values("id")[:1]
    rows = list(
        ElasticEvent.objects.select_related("job__owner")
        .filter(Q(pk__in=event_ids) | Q(pk=Subquery(before))).order_by("id")
    )
    previous = rows.pop(0) if rows and rows[0].pk < first else None
    if not rows:
        return []
    job_ids = {event.job_id for event in rows if event.job_id is not None}
    names = set()
    for event in rows:
        if event.kind in NODE_EVENT_KINDS or event.job_id is not None:
            names.update(event.nodes_before, event.nodes_after)
    nodes = list(Node.objects.filter(name__in=names)) if names else []
    node_ids = [node.pk for node in nodes]
    held: dict[int, dict[int, Allocation]] = {}
    gpus: dict[int, list[bool]] = {}  # job id -> borrowed? per GPU it holds
    if job_ids or node_ids:
        for allocation in Allocation.objects.filter(Q(job_id__in=job_ids) | Q(node_id__in=node_ids)).select_related("job"):
            held.setdefault(allocation.node_id, {})[allocation.gpu_index] = allocation
            gpus.setdefault(allocation.job_id, []).append(allocation.borrowed_from_id is not None)
    # Every state below was read after the last of these rows committed (appends are serialised,
    # so ids follow commits): its id versions them, and a socket drops a state older than one it
    # has already taken (jobs.live_consumers), as batches from two senders may cross.
    seq = rows[-1].pk
    summaries = {
        event.job_id: {**job_summary(event.job, len(gpus.get(event.job_id, [])), sum(gpus.get(event.job_id, []))),
                       "seq": seq}
        for event in rows if event.job_id is not None
    }
    node_payloads = {node.name: {**node_summary(node, held.get(node.pk, {})), "seq": seq} for node in nodes}
    messages: list[live.Message] = []
    for event in rows:
        payload = event_payload(event)
        messages.append(live.message(AUDIT_GROUP, "audit", payload))
        if event.job_id is not None:
            summary = summaries[event.job_id]
            messages.append(live.message(job_group(event.job_id), "job_event", {"event": payload, "job": summary}))
            messages.append(live.message(CLUSTER_GROUP, "job", summary))
        if event.kind in NODE_EVENT_KINDS or event.job_id is not None:
            for name in sorted(set(event.nodes_before) | set(event.nodes_after)):
                if name in node_payloads:
                    node = node_payloads[name]
                    messages.append(live.message(CLUSTER_GROUP, "node", node))
                    messages.append(live.message(node_group(node["id"]), "node", node))
    messages.append(live.message(AUDIT_GROUP, "chain", chain_check(previous, rows), key=AUDIT_GROUP))
    return messages


def chain_check(previous: ElasticEvent | None, rows: list[ElasticEvent]) -> dict[str, Any]:
    """The audit page's chain banner, for rows just appended: do they match their hashes and
    link to the row before them (``after_id``)? The first that does not is ``bad``."""
    expected = previous.hash if previous is not None else GENESIS_HASH
    bad = None
    last_good = previous.pk if previous is not None else None
    for event in rows:
        problem = link_problem(event, expected)
        if problem:
            bad = {"id": event.pk, "problem": problem}
            break
        expected, last_good = event.hash, event.pk
    return {"after_id": previous.pk if previous is not None else 0, "first_id": rows[0].pk,
            "last_id": rows[-1].pk, "rows": len(rows), "last_good_id": last_good, "bad": bad}


_summaries = live.SharedTrailingThrottle("cluster-summary")


def cluster_messages(_: list[Any]) -> list[live.Message]:
    """The Cluster page's summary (header counts, health and planner pills, planner line, queue,
    a utilisation point), after a transaction that wrote an audit row or a planner run: at most
    one per ``OMNI_LIVE_SUMMARY_INTERVAL_S`` among all the processes on one Redis (servers and
    workers; per process in the embedded mode), the state after the last of them always (a
    summary is the whole state, so one built later says everything the skipped ones would
    have). Under load that was half of every frame the browsers got (docs/load.md)."""
    if not _summaries.go(CLUSTER_GROUP, settings.OMNI_LIVE_SUMMARY_INTERVAL_S,
                         lambda: live.send_messages(summary_messages())):
        return []
    return summary_messages()


def reset_summaries() -> None:
    """Forget the summary throttle's state (tests)."""
    _summaries.reset()


def summary_messages() -> list[live.Message]:
    """The cluster summary now, as a message."""
    from jobs.live_data import cluster_summary, used_point  # live_data reads this module's sentences

    summary = cluster_summary()
    summary["used"] = used_point(timezone.now(), summary["gpus_total"])
    return [live.message(CLUSTER_GROUP, "cluster_summary", summary, key=CLUSTER_GROUP)]


def _on_event_saved(sender, instance: ElasticEvent, created: bool, raw: bool = False, **kwargs) -> None:
    if created and not raw:
        live.send_built(audit_messages, instance.pk)
        live.send_built(cluster_messages, None)


def _on_planner_run_saved(sender, instance: PlannerRun, raw: bool = False, **kwargs) -> None:
    if not raw:
        live.send_built(cluster_messages, None)


def connect() -> None:
    """Hook the receivers (called once from JobsConfig.ready). Every change in Omni appends an
    audit row; a planner pass that changes nothing still writes its run (the planner line)."""
    post_save.connect(_on_event_saved, sender=ElasticEvent, dispatch_uid="omni-live-audit-broadcast")
    post_save.connect(_on_planner_run_saved, sender=PlannerRun, dispatch_uid="omni-live-planner-run")

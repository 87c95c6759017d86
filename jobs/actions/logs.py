"""What the ranks printed: log lines shipped by the node agents, stored once, sent live, pruned
(docs/logs.md).

An agent's ``logs`` frame (``trainer_agent.logship``) carries chunks of consecutive lines of one
rank's stdout or stderr, each line with its size in the file, so every line has a byte offset.
A line is stored once by (job, run, rank, stream, offset): a chunk sent again after a
reconnect changes nothing. The new lines go to the job page's group after commit, to the viewers
who may see the job in full (only they may join ``job-{id}``: jobs.live_consumers).
"""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from jobs import live
from jobs.models import AllocationSpan, Job, JobLogLine, Node
from trainer_agent import protocol
from trainer_agent.protocol import ProtocolError

logger = logging.getLogger("jobs.agent")

LOG_EVENT = "job_logs"
# Lines per live message: a burst beyond this sends its newest lines and says how many it left
# out ("skipped"); the page and the API read them all from the database.
MAX_LIVE_LINES = 500
# How far a chunk's read time may be from the server's clock before it is taken as the clock's.
MAX_CLOCK_SKEW_S = 300.0
PRUNE_BATCH = 10_000


class LogsRefused(Exception):
    """A well-formed ``logs`` frame for a job or run this node may not ship lines of."""


def check_logs_frame(frame: dict[str, Any]) -> dict[str, Any]:
    """The shape of a ``logs`` frame (docs/control-loop.md); returns it or raises ProtocolError."""

    def need(obj: dict[str, Any], key: str, kind: type, where: str) -> Any:
        if key not in obj:
            raise ProtocolError("missing_field", f"{where} needs {key!r}")
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ProtocolError("bad_field", f"{where}: {key!r} must be {kind.__name__}")
        return value

    need(frame, "ship", int, "logs frame")
    need(frame, "job", str, "logs frame")
    run_id = need(frame, "run_id", str, "logs frame")
    if not run_id or len(run_id) > JobLogLine._meta.get_field("run_id").max_length:
        raise ProtocolError("bad_field", "logs frame: 'run_id' must be 1 to 64 characters")
    chunks = need(frame, "chunks", list, "logs frame")
    lines = size = 0
    for chunk in chunks:
        if not isinstance(chunk, dict):
            raise ProtocolError("bad_record", "every chunk must be an object")
        rank, offset = need(chunk, "rank", int, "chunk"), need(chunk, "offset", int, "chunk")
        if rank < 0 or offset < 0:
            raise ProtocolError("bad_record", "a chunk's rank and offset must not be negative")
        if chunk.get("stream") not in protocol.LOG_STREAMS:
            raise ProtocolError("bad_record", f"a chunk's stream must be one of {', '.join(protocol.LOG_STREAMS)}")
        texts, sizes = need(chunk, "lines", list, "chunk"), need(chunk, "sizes", list, "chunk")
        if len(texts) != len(sizes):
            raise ProtocolError("bad_record", "a chunk needs one size per line")
        if not all(isinstance(t, str) for t in texts):
            raise ProtocolError("bad_record", "every line must be a string")
        if not all(isinstance(s, int) and not isinstance(s, bool) and 0 < s <= protocol.MAX_LOG_LINE_BYTES
                   for s in sizes):
            raise ProtocolError("bad_record", f"every line's size must be 1 to {protocol.MAX_LOG_LINE_BYTES} bytes")
        if "at" in chunk and (isinstance(chunk["at"], bool) or not isinstance(chunk["at"], (int, float))
                              or not math.isfinite(chunk["at"])):
            raise ProtocolError("bad_field", "chunk: 'at' must be Unix seconds")
        lines += len(texts)
        size += sum(sizes)
    if lines > protocol.MAX_LOG_LINES_PER_FRAME:
        raise ProtocolError("too_many_records", f"{lines} lines exceed {protocol.MAX_LOG_LINES_PER_FRAME} per frame")
    if size > protocol.MAX_LOG_FRAME_BYTES:
        raise ProtocolError("frame_too_large", f"{size} bytes of lines exceed {protocol.MAX_LOG_FRAME_BYTES} per frame")
    return frame


def log_source_job(node: Node, job_name: str, run_id: str) -> Job:
    """The job whose lines ``node`` may ship for ``run_id``, or LogsRefused.

    The last lines of a run arrive after it stopped, so this is more than "placed here now":
    the job's current run, on a node that held its GPUs during that run (still holds them, or let
    go of them after the run began: the job may be terminal, recovering or preempted by now); or
    an earlier run of the job that this node was already shipping lines of (a relaunch gave the
    job a new run id while the old run's tail was still on its way).
    """
    job = Job.objects.filter(name=job_name).only("id", "name", "owner_id", "run_id", "started_at").first()
    if job is None:
        raise LogsRefused(f"no job {job_name!r}")
    if run_id == job.run_id and job.started_at is not None:
        held = AllocationSpan.objects.filter(job=job, node=node).filter(
            Q(ended_at__isnull=True) | Q(ended_at__gte=job.started_at))
        if held.exists():
            return job
    if JobLogLine.objects.filter(job=job, run_id=run_id, node=node.name).exists():
        return job
    raise LogsRefused(f"{node.name} did not run {job_name!r} in run {run_id!r}")


def _read_at(chunk: dict[str, Any], now: datetime) -> datetime:
    """When the agent read the chunk (just before sending it), kept within a node's plausible
    clock skew of the server's clock: retention counts from it."""
    at = chunk.get("at")
    if at is None:
        return now
    return datetime.fromtimestamp(min(max(float(at), now.timestamp() - MAX_CLOCK_SKEW_S), now.timestamp()), tz=UTC)


@transaction.atomic
def record_log_lines(node: Node, frame: dict[str, Any]) -> int:
    """Store the lines of one ``logs`` frame from ``node``; return how many were new.

    Raises ProtocolError for a malformed frame and LogsRefused for lines this node may not
    ship (:func:`log_source_job`); neither changes anything.
    """
    check_logs_frame(frame)
    job = log_source_job(node, frame["job"], frame["run_id"])
    run_id = frame["run_id"]
    now = datetime.now(UTC)
    rows: dict[tuple[int, str, int], JobLogLine] = {}
    for chunk in frame["chunks"]:
        at = _read_at(chunk, now)
        offset = chunk["offset"]
        for text, size in zip(chunk["lines"], chunk["sizes"], strict=True):
            key = (chunk["rank"], chunk["stream"], offset)
            rows.setdefault(key, JobLogLine(job=job, run_id=run_id, node=node.name, rank=key[0], stream=key[1],
                                            offset=offset, at=at, text=text.replace("\x00", "\ufffd")))
            offset += size
    if not rows:
        return 0
    by_file: dict[tuple[int, str], list[int]] = {}
    for rank, stream, offset in rows:
        by_file.setdefault((rank, stream), []).append(offset)
    where = Q()
    for (rank, stream), offsets in by_file.items():
        where |= Q(rank=rank, stream=stream, offset__in=offsets)
    lines = JobLogLine.objects.filter(job=job, run_id=run_id)
    stored = set(lines.filter(where).values_list("rank", "stream", "offset"))
    new = [row for key, row in rows.items() if key not in stored]
    if not new:
        return 0
    # ignore_conflicts: a copy of this frame stored meanwhile (an old socket still draining) wins.
    JobLogLine.objects.bulk_create(new, ignore_conflicts=True, batch_size=2000)
    where = Q()
    for (rank, stream), offsets in by_file.items():
        mine = [o for o in offsets if (rank, stream, o) not in stored]
        if mine:
            where |= Q(rank=rank, stream=stream, offset__in=mine)
    fresh = list(lines.filter(where).order_by("id").values("id", "rank", "stream", "at", "text"))
    _send_live(job, run_id, node.name, fresh)
    return len(new)


def _send_live(job: Job, run_id: str, node_name: str, lines: list[dict[str, Any]]) -> None:
    skipped = max(0, len(lines) - MAX_LIVE_LINES)
    payload = {
        "job": job.pk, "run_id": run_id, "node": node_name, "skipped": skipped,
        "lines": [{"id": line["id"], "rank": line["rank"], "stream": line["stream"], "at": line["at"].isoformat(),
                   "text": line["text"]} for line in lines[skipped:]],
    }
    live.send(live.job_group(job.pk), LOG_EVENT, payload)


def prune_logs(now: datetime) -> int:
    """Delete log lines read more than ``OMNI_LOG_RETENTION_S`` before ``now``, in batches (each
    its own short transaction, so pruning a large backlog never holds a long lock); return how
    many."""
    cutoff = now - timedelta(seconds=settings.OMNI_LOG_RETENTION_S)
    deleted = 0
    while True:
        ids = list(JobLogLine.objects.filter(at__lt=cutoff).order_by("at").values_list("id", flat=True)[:PRUNE_BATCH])
        if not ids:
            return deleted
        deleted += JobLogLine.objects.filter(id__in=ids).delete()[0]
        if len(ids) < PRUNE_BATCH:
            return deleted

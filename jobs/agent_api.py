"""The server side of the agent protocol, shared by the WebSocket consumer and the HTTP fallback.

Agents are authenticated by ``jobs.agent_auth`` (the same function for the socket, this
fallback and telemetry ingestion). ``handle_frame`` applies one validated agent frame through the
actions in ``jobs.actions`` and returns the frames to send back. ``heartbeat_view`` is the HTTP
fallback for heartbeats, step records and worker exits when a socket cannot be held open.
Protocol: ``trainer_agent.protocol`` and docs/control-loop.md.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from jobs import actions
from jobs.agent_auth import AgentAuthFailure, agent_from_headers, request_headers
from jobs.models import Node
from trainer_agent import protocol

logger = logging.getLogger("jobs.agent")


def error_frame(code: str, message: str, ref: Any = None) -> dict[str, Any]:
    """An ``error`` frame: a machine-readable code, one human line, and what it refers to."""
    return {"type": protocol.ERROR, "code": code, "message": message, "ref": ref}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return float(value)


def _ingest_gpu_samples(node: Node, frame: dict[str, Any]) -> None:
    """Heartbeat GPU samples -> a telemetry batch (``telemetry.ingest``, docs/telemetry.md)."""
    from telemetry.ingest import ingest_gpu_batch

    samples = []
    for sample in frame.get("gpus", []):
        if not isinstance(sample, dict) or not isinstance(sample.get("index"), int):
            continue
        util = _number(sample.get("util"))
        row = {"gpu": sample["index"], "at": _number(sample.get("t")) or _number(frame.get("sent_at"))}
        if util is not None:
            row["util_pct"] = max(0.0, min(100.0, util * 100.0))
        if isinstance(sample.get("mem_used_bytes"), int):
            row["mem_used_bytes"] = sample["mem_used_bytes"]
        samples.append(row)
    if samples and isinstance(frame.get("seq"), int):
        _store_telemetry(ingest_gpu_batch, node, {"source": _source(node, frame, "gpu"), "seq": frame["seq"],
                                                  "samples": samples})


def _ingest_step_records(node: Node, job_id: int, frame: dict[str, Any]) -> None:
    """Step records -> a telemetry batch of step samples for the job (rank 0's view)."""
    from telemetry.ingest import ingest_step_batch

    samples = []
    for record in frame["records"]:
        row: dict[str, Any] = {"job": job_id, "rank": 0, "step": record["step"],
                               "at": _number(record.get("at")) or _number(frame.get("sent_at"))}
        for name in ("step_s", "data_wait_s", "compute_s", "comm_s", "loss"):
            value = _number(record.get(name))
            if value is not None:
                row[name] = value
        tokens = record.get("tokens")
        if isinstance(tokens, dict):
            row["tokens"] = {k: int(v) for k, v in tokens.items() if k in ("text", "image", "video", "audio")
                             and isinstance(v, int) and not isinstance(v, bool)}
        samples.append(row)
    if samples and isinstance(frame.get("seq"), int):
        # The frame is acknowledged once stored, and an acknowledged frame is never sent again: its
        # commit waits for the WAL flush (inside a caller's transaction the store leaves
        # synchronous_commit alone, docs/telemetry.md), or a database crash could lose it.
        with transaction.atomic():
            _store_telemetry(ingest_step_batch, node, {"source": _source(node, frame, "steps"),
                                                       "seq": frame["seq"], "samples": samples}, retried=True)


def _observe_rhythm(node: Node, job_id: int, frame: dict[str, Any]) -> None:
    """Step records -> the job's measured rhythm and its nodes' speed (jobs/actions/rhythm.py)."""
    try:
        actions.observe_step_records(job_id, frame["records"])
    except Exception:  # like telemetry, the rhythm must never break the control loop
        logger.exception("rhythm of job %s from %s failed", job_id, node.name)


def _source(node: Node, frame: dict[str, Any], kind: str) -> str:
    boot = str(frame.get("boot") or "0")[:32]
    return f"agent-{node.name}-{boot}-{kind}"[:128]


def _store_telemetry(ingest, node: Node, batch: dict[str, Any], *, retried: bool = False) -> None:
    # Telemetry must never break the control loop: a refused batch is logged and dropped. A batch
    # the sender sends again until acknowledged (``retried``: a ``steps`` frame) lets a failure to
    # store it through, so the frame goes unacknowledged rather than lost.
    try:
        ingest(node, batch)
    except ValidationError as exc:
        logger.info("telemetry batch from %s refused: %s", node.name, exc)
    except Exception:
        if retried:
            raise
        logger.exception("telemetry batch from %s failed", node.name)


def handle_frame(node: Node, frame: dict[str, Any]) -> list[dict[str, Any]]:
    """Apply one validated agent frame; return the frames to answer with (maybe none)."""
    kind = frame["type"]
    if kind == protocol.HEARTBEAT:
        workers = [w for w in frame.get("workers", []) if isinstance(w, dict)]
        actions.record_heartbeat(node, workers, disk=frame.get("disk"))
        _ingest_gpu_samples(node, frame)
        return []
    if kind == protocol.ACK:
        try:
            actions.record_command_ack(node, frame["command"])
        except actions.UnknownCommand as exc:
            return [error_frame("unknown_command", str(exc), frame["command"])]
        return []
    if kind == protocol.DONE:
        try:
            actions.record_command_outcome(node, frame["command"], ok=frame["ok"], outcome=frame.get("outcome", {}))
        except actions.UnknownCommand as exc:
            return [error_frame("unknown_command", str(exc), frame["command"])]
        except protocol.ProtocolError as exc:  # an outcome field out of bounds: nothing written
            return [error_frame(exc.code, str(exc), frame["command"])]
        return []
    if kind == protocol.STEPS:
        job_id, progress = actions.record_step_records(node, frame["job"], frame["records"])
        if job_id is None:
            return [error_frame("stale_records", f"job {frame['job']!r} has not run on {node.name} lately",
                                frame["job"])]
        _ingest_step_records(node, job_id, frame)
        if progress:  # late records are history: the rhythm belongs to the job's current run
            _observe_rhythm(node, job_id, frame)
        return []
    if kind == protocol.EXIT:
        actions.record_worker_exit(node, frame["job"], frame["outcome"])
        return []
    return [error_frame("unexpected_type", f"{kind!r} is not accepted here", kind)]


@csrf_exempt
@require_POST
def heartbeat_view(request: HttpRequest) -> JsonResponse:
    """HTTP fallback: POST one heartbeat, steps or exit frame with the node's bearer token."""
    try:
        node = agent_from_headers(request_headers(request), request.META.get("REMOTE_ADDR", "?"))
    except AgentAuthFailure as exc:
        return JsonResponse(error_frame("unauthorized", str(exc)), status=exc.http_status)
    try:
        frame = protocol.validate_agent_frame(protocol.parse_frame(request.body))
    except protocol.ProtocolError as exc:
        return JsonResponse(error_frame(exc.code, str(exc)), status=400)
    if frame["type"] not in (protocol.HEARTBEAT, protocol.STEPS, protocol.EXIT):
        return JsonResponse(error_frame("unexpected_type", "use the WebSocket for commands"), status=400)
    replies = handle_frame(node, frame)
    pending = node.commands.filter(state__in=actions.OPEN_COMMAND_STATES).count()
    return JsonResponse({"ok": not replies, "replies": replies, "open_commands": pending})


__all__ = ["error_frame", "handle_frame", "heartbeat_view"]

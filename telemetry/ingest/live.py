"""Ingestion, stage 4: after commit, new points go to the live pages, throttled.

The store stage calls ``send_live(kind, node, rows)`` once a batch has committed; nothing else
in ingestion knows about browsers. Rows are buffered per node and kind and released at most
once per ``OMNI_TELEMETRY_LIVE_INTERVAL_S`` (``LiveThrottle``); frames go out from one
event-loop thread per process (``LiveSender``) so ingestion never waits on the channel layer.
Messages have ``jobs.live``'s shape; payloads are in docs/telemetry.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from channels.layers import get_channel_layer
from django.conf import settings

from jobs.live import job_group, node_group
from jobs.models import Allocation, Node
from telemetry import metrics
from telemetry.ingest.validate import TOKEN_MODALITIES, SampleRows
from telemetry.models import BatchKind

logger = logging.getLogger(__name__)

MAX_LIVE_POINTS = 4096


class LiveThrottle:
    """Per-stream buffer of new rows, released at most once per ``interval_s`` (AWX's
    ``MAX_WEBSOCKET_EVENT_RATE``). Rows held back ride along with the next message; points are
    built only when a message goes out. A page that (re)connects loads history from
    telemetry.queries."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, list[SampleRows]] = {}
        self._sent_at: dict[str, float] = {}

    def offer(self, key: str, rows: SampleRows, interval_s: float) -> list[SampleRows] | None:
        """Add ``rows``; return everything pending for ``key`` when it may send now."""
        with self._lock:
            pending = self._pending.setdefault(key, [])
            pending.append(rows)
            while len(pending) > 1 and sum(len(chunk) for chunk in pending[1:]) >= MAX_LIVE_POINTS:
                pending.pop(0)
            now = time.monotonic()
            if now - self._sent_at.get(key, -math.inf) < interval_s:
                return None
            self._sent_at[key] = now
            return self._pending.pop(key)


throttle = LiveThrottle()


class LiveSender:
    """Sends telemetry frames to the channel layer from one event-loop thread per process, so
    ingestion never waits on ``async_to_sync`` or the layer. Frames go out after commit and may
    be lost (a full backlog drops them, counted in /metrics): the database stays the truth and a
    page that reconnects reloads it. Messages have jobs.live's shape."""

    MAX_BACKLOG = 256

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._backlog: set[concurrent.futures.Future] = set()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="telemetry-live", daemon=True).start()
            return self._loop

    def send(self, frames: list[tuple[str, str, dict[str, Any]]]) -> None:
        """Queue ``(group, event, payload)`` frames; returns at once."""
        layer = get_channel_layer()
        if layer is None or not frames:
            return
        with self._lock:
            if len(self._backlog) >= self.MAX_BACKLOG:
                metrics.count("omni_telemetry_live_frames_dropped_total", "backlog", len(frames))
                return
        future = asyncio.run_coroutine_threadsafe(self._send_all(layer, frames), self._running_loop())
        with self._lock:
            self._backlog.add(future)
        future.add_done_callback(self._done)

    async def _send_all(self, layer, frames: list[tuple[str, str, dict[str, Any]]]) -> None:
        for group, event, payload in frames:
            await layer.group_send(group, {"type": "live.message", "event": event, "payload": payload})

    def _done(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._backlog.discard(future)
        if not future.cancelled() and future.exception() is not None:
            logger.error("telemetry live frame failed", exc_info=future.exception())

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until every queued frame is sent (tests, shutdown)."""
        with self._lock:
            pending = list(self._backlog)
        concurrent.futures.wait(pending, timeout=timeout_s)


live_sender = LiveSender()


ALLOCATIONS_CACHE_S = 2.0
_allocations: tuple[float, dict[int, dict[int, int]]] = (-math.inf, {})


def _gpu_jobs(node_id: int) -> dict[int, int]:
    """gpu_index -> id of the job holding it, on this node. One query for the whole cluster at
    most every ALLOCATIONS_CACHE_S, so live routing costs no query per batch; a GPU that just
    changed hands may route its points to the old job's page for that long."""
    global _allocations
    fetched_at, by_node = _allocations
    if time.monotonic() - fetched_at > ALLOCATIONS_CACHE_S:
        by_node = {}
        for node, gpu, job in Allocation.objects.values_list("node_id", "gpu_index", "job_id"):
            by_node.setdefault(node, {})[gpu] = job
        _allocations = (time.monotonic(), by_node)
    return by_node.get(node_id, {})


def forget_allocations() -> None:
    """Drop the allocation cache (tests; a process that just moved GPUs)."""
    global _allocations
    _allocations = (-math.inf, {})


def send_live(kind: str, node: Node, rows: SampleRows) -> None:
    """Offer a committed batch's rows to the live pages of its node and of the jobs concerned.

    Called by the store stage after commit, and only then. Returns at once; a frame that cannot
    be sent is dropped (counted), since a page that reconnects reloads from the database.
    """
    due = throttle.offer(f"{kind}:{node.pk}", rows, settings.OMNI_TELEMETRY_LIVE_INTERVAL_S)
    if not due:
        return
    frames: list[tuple[str, str, dict[str, Any]]] = []
    if kind == BatchKind.GPU:
        points = _gpu_points(due)
        frames.append(
            (node_group(node.pk), "gpu_samples", {"node": node.pk, "node_name": node.name, "points": points})
        )
        gpu_jobs = _gpu_jobs(node.pk)
        by_job: dict[int, list[dict[str, Any]]] = {}
        for point in points:
            job_id = gpu_jobs.get(point["gpu"])
            if job_id is not None:
                by_job.setdefault(job_id, []).append(point)
        for job_id, job_points in by_job.items():
            frames.append((job_group(job_id), "gpu_samples",
                           {"job": job_id, "node": node.pk, "node_name": node.name, "points": job_points}))
    else:
        by_job = {}
        for point in _step_points(due):
            by_job.setdefault(point["job"], []).append(point)
        for job_id, job_points in by_job.items():
            frames.append((job_group(job_id), "step_records", {"job": job_id, "node": node.pk, "points": job_points}))
    live_sender.send(frames)


def _columns(chunks: list[SampleRows], names: Sequence[str]) -> tuple[dict[str, list], dict[str, list], list[float]]:
    """The newest MAX_LIVE_POINTS rows of ``chunks`` as Python lists per column."""
    def joined(arrays: list[np.ndarray]) -> list:
        return np.concatenate(arrays)[-MAX_LIVE_POINTS:].tolist()

    values = {name: joined([c.values[name] for c in chunks]) for name in names}
    nulls = {name: joined([c.nulls[name] for c in chunks]) for name in names if name in chunks[0].nulls}
    return values, nulls, joined([c.epoch_s for c in chunks])


def _gpu_points(chunks: list[SampleRows]) -> list[dict[str, Any]]:
    values, nulls, at = _columns(chunks, ("gpu_index", "util_pct", "mem_used_bytes", "power_w", "temp_c", "xid_errors"))
    return [
        {"gpu": g, "at": t, "util_pct": u, "mem_used_bytes": m, "power_w": None if pn else p,
         "temp_c": None if tn else c, "xid_errors": x}
        for g, t, u, m, p, pn, c, tn, x in zip(
            values["gpu_index"], at, values["util_pct"], values["mem_used_bytes"], values["power_w"],
            nulls["power_w"], values["temp_c"], nulls["temp_c"], values["xid_errors"], strict=True,
        )
    ]


STEP_POINT_FIELDS = ("step_s", "data_wait_s", "compute_s", "comm_s", "loss")


def _step_points(chunks: list[SampleRows]) -> list[dict[str, Any]]:
    tokens = tuple(f"tokens_{m}" for m in TOKEN_MODALITIES)
    values, nulls, at = _columns(chunks, ("job_id", "rank", "step", *STEP_POINT_FIELDS, *tokens))
    out = []
    for i, at_s in enumerate(at):
        point: dict[str, Any] = {"job": values["job_id"][i], "rank": values["rank"][i], "step": values["step"][i],
                                 "at": at_s}
        for name in STEP_POINT_FIELDS:
            point[name] = None if nulls[name][i] else values[name][i]
        point["tokens"] = {m: values[f"tokens_{m}"][i] for m in TOKEN_MODALITIES if not nulls[f"tokens_{m}"][i]}
        out.append(point)
    return out

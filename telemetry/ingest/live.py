"""Ingestion, stage 4: after commit, new points go to the live pages, throttled.

The store stage calls ``send_live(kind, node, rows)`` once a batch has committed; nothing else
in ingestion knows about browsers. Rows are buffered per node and kind and released at most
once per ``OMNI_TELEMETRY_LIVE_INTERVAL_S`` (``LiveThrottle``); frames go out through
``jobs.live``, which hands them to an event loop and returns at once, so ingestion never waits
on the channel layer. Payloads are in docs/telemetry.md.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from django.conf import settings

from jobs import live
from jobs.live import job_group, node_group
from jobs.models import Allocation, Node
from telemetry.ingest.validate import TOKEN_MODALITIES, SampleRows
from telemetry.models import BatchKind

MAX_LIVE_POINTS = 4096


class LiveThrottle:
    """Per-stream buffer of new rows, released at most once per ``interval_s`` (AWX's
    ``MAX_WEBSOCKET_EVENT_RATE``). Rows held back ride along with the next message, or, when no
    next batch comes in time (a node that went quiet, or two servers sharing its samples), go
    out by themselves at the end of the interval (``jobs.live.TrailingThrottle``): no row waits
    longer than the interval. Points are built only when a message goes out. A page that
    (re)connects loads history from telemetry.queries."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, list[SampleRows]] = {}
        self._edge = live.TrailingThrottle()

    def offer(self, key: str, rows: SampleRows, interval_s: float, later: Callable[[], None]) -> list[SampleRows] | None:
        """Add ``rows``; return everything pending for ``key`` when it may send now, else None
        (``later`` then runs at the interval's end, once, and should ``take`` the rows)."""
        with self._lock:
            pending = self._pending.setdefault(key, [])
            pending.append(rows)
            while len(pending) > 1 and sum(len(chunk) for chunk in pending[1:]) >= MAX_LIVE_POINTS:
                pending.pop(0)
        if not self._edge.go(key, interval_s, later):
            return None
        return self.take(key)

    def take(self, key: str) -> list[SampleRows] | None:
        with self._lock:
            return self._pending.pop(key, None)

    def idle(self) -> bool:
        """Nothing held waits for its interval's end (tests)."""
        return self._edge.idle()

    def reset(self) -> None:
        """Drop what is held and the timers that would send it (tests)."""
        self._edge.reset()
        with self._lock:
            self._pending.clear()


throttle = LiveThrottle()


ALLOCATIONS_CACHE_S = 2.0
_allocations: tuple[float, dict[int, dict[int, tuple[int, float]]]] = (-math.inf, {})


def _gpu_jobs(node_id: int) -> dict[int, tuple[int, float]]:
    """gpu_index -> (id of the job holding it, since when in epoch seconds), on this node. One
    query for the whole cluster at most every ALLOCATIONS_CACHE_S, so live routing costs no query
    per batch. Points older than the holder's ``since`` never reach its page (they are the
    previous holder's); a GPU that changed hands within the cache's age may still send the old
    holder a last few seconds."""
    global _allocations
    fetched_at, by_node = _allocations
    if time.monotonic() - fetched_at > ALLOCATIONS_CACHE_S:
        by_node = {}
        for node, gpu, job, since in Allocation.objects.values_list("node_id", "gpu_index", "job_id", "since"):
            by_node.setdefault(node, {})[gpu] = (job, since.timestamp())
        _allocations = (time.monotonic(), by_node)
    return by_node.get(node_id, {})


def forget_allocations() -> None:
    """Drop the allocation cache (tests; a process that just moved GPUs)."""
    global _allocations
    _allocations = (-math.inf, {})


def send_live(kind: str, node: Node, rows: SampleRows) -> None:
    """Offer a committed batch's rows to the live pages of its node and of the jobs concerned.

    Called by the store stage after commit, and only then. Returns at once (jobs.live); a frame
    that cannot be sent is dropped (counted), since a page that reconnects reloads from the
    database.
    """
    key = f"{kind}:{node.pk}"
    due = throttle.offer(key, rows, settings.OMNI_TELEMETRY_LIVE_INTERVAL_S, lambda: _release(key, kind, node))
    if due:
        _send(kind, node, due)


def _release(key: str, kind: str, node: Node) -> None:
    """The interval's end for rows held back (a timer thread): they go out by themselves."""
    due = throttle.take(key)
    if due:
        _send(kind, node, due)


def _send(kind: str, node: Node, due: list[SampleRows]) -> None:
    frames: list[live.Message] = []
    if kind == BatchKind.GPU:
        points = _gpu_points(due)
        frames.append(
            live.message(node_group(node.pk), "gpu_samples", {"node": node.pk, "node_name": node.name, "points": points})
        )
        gpu_jobs = _gpu_jobs(node.pk)
        by_job: dict[int, list[dict[str, Any]]] = {}
        for point in points:
            holder = gpu_jobs.get(point["gpu"])
            if holder is not None and point["at"] >= holder[1]:
                by_job.setdefault(holder[0], []).append(point)
        for job_id, job_points in by_job.items():
            frames.append(live.message(job_group(job_id), "gpu_samples",
                                       {"job": job_id, "node": node.pk, "node_name": node.name, "points": job_points}))
    else:
        by_job = {}
        for point in _step_points(due):
            by_job.setdefault(point["job"], []).append(point)
        for job_id, job_points in by_job.items():
            frames.append(live.message(job_group(job_id), "step_records",
                                       {"job": job_id, "node": node.pk, "points": job_points}))
    live.send_messages(frames)


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

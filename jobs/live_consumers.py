"""The browsers' WebSocket: one socket per page, subscribing to the streams it shows.

``/ws/live/`` accepts only signed-in users with an Omni role. The page then sends
``{"action": "subscribe", "stream": "job", "id": 7}`` (streams: ``cluster``, ``audit``,
``job``, ``node``) and each subscribe is checked against the user's roles, like AWX's
consumers: a job's stream only by those who may see it in full (``roles.job_visibility``), the
audit log only by operators and auditors. Messages from :mod:`jobs.live` arrive as one batch
per group through ``live_batch`` and go out one by one as ``{"type": "live", "event": ...,
"payload": ...}``; a group's message is the same for every socket, so each is first cut to what
this viewer may see (:func:`payload_for_viewer`): someone else's job on the cluster stream as
its summary, or not at all. Telemetry frames are throttled: at most one frame per ``FRAME_INTERVAL_S`` per socket,
later samples batched into the next frame (``{"type": "live", "event": ..., "batch":
[payload, ...]}``), so a busy job cannot flood a browser (AWX ``MAX_WEBSOCKET_EVENT_RATE``).
Snapshots (``job``, ``node``, ``cluster_summary``: each the whole state of one object) are
coalesced per socket, latest wins: at most one write of them per ``SNAPSHOT_INTERVAL_S``, the
first after a quiet spell at once. See docs/live-ui.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from jobs import roles
from jobs.live import AUDIT_GROUP, BATCH_TYPE, CLUSTER_GROUP, job_group, node_group
from jobs.models import Job, Node
from telemetry.metrics import websocket_closed, websocket_opened
from trainer_agent.protocol import ProtocolError, loads_strict

logger = logging.getLogger(__name__)

# Events that carry telemetry samples, and a job's log lines (``job_logs``, jobs.actions.logs,
# as bursty): batched and rate-limited. Everything else (decisions, state changes) goes out at
# once, after any telemetry already buffered so order is kept.
TELEMETRY_EVENTS = frozenset({"gpu_samples", "step_records", "telemetry", "gpu", "steps", "job_logs"})
# Events whose payload is the whole state of one object (a job's summary, a node, the cluster
# summary): of several queued for one socket only the newest needs to go out.
SNAPSHOT_EVENTS = frozenset({"job", "node", "cluster_summary"})
MAX_SUBSCRIPTIONS = 256
MAX_BUFFERED_PAYLOADS = 5000
# Job owners remembered per socket (owners never change); beyond this the memory starts over.
MAX_KNOWN_OWNERS = 10_000
# The newest ``seq`` taken per job and node, per socket; beyond this the memory starts over.
MAX_KNOWN_SEQS = 10_000

CLOSE_NOT_SIGNED_IN = 4401
CLOSE_NO_ROLE = 4403
# A browser's messages are small subscribe requests.
MAX_MESSAGE_CHARS = 4096


def _subscription_check(user, stream: str, object_id: Any) -> tuple[str | None, int, str]:
    """(group, status, message): the group to join, or why not (403/404/400)."""
    if stream == "cluster":
        return CLUSTER_GROUP, 200, "ok"
    if stream == "audit":
        if roles.can_read_audit(user):
            return AUDIT_GROUP, 200, "ok"
        return None, 403, "only operators and auditors may follow the audit log"
    try:
        pk = int(object_id)
    except (TypeError, ValueError, OverflowError):
        return None, 400, f"stream {stream!r} needs a numeric id"
    if not 0 < pk < 2**63:
        return None, 400, f"stream {stream!r} needs an id of 1 or more that fits in 64 bits"
    if stream == "job":
        job = roles.visible_jobs(user, Job.objects.filter(pk=pk)).only("id", "owner_id").first()
        if job is None:
            return None, 404, f"no job {pk}"
        if roles.job_visibility(user, job) is roles.Visibility.FULL:
            return job_group(pk), 200, "ok"
        return None, 403, "a job's stream is for its owner, operators and auditors; its summary is on the cluster stream"
    if stream == "node":
        if not Node.objects.filter(pk=pk).exists():
            return None, 404, f"no node {pk}"
        return node_group(pk), 200, "ok"
    return None, 400, f"unknown stream {stream!r}; expected cluster, audit, job or node"


def _job_ids(event: str, payload: dict[str, Any]) -> set[int]:
    """The jobs a group message names: a summary's id, the holders of a node's GPUs, the waiting
    jobs of the cluster summary, a sample's job."""
    if event == "job":
        return {payload["id"]} if isinstance(payload.get("id"), int) else set()
    if event == "node":
        return {g["job_id"] for g in payload.get("gpus", ()) if isinstance(g.get("job_id"), int)}
    if event == "cluster_summary":
        return {item["id"] for key in ("queue", "losing") for item in payload.get(key, ())
                if isinstance(item.get("id"), int)}
    if event in TELEMETRY_EVENTS:
        return {payload["job"]} if isinstance(payload.get("job"), int) else set()
    return set()


def payload_for_viewer(event: str, payload: Any, visibility: Callable[[int], roles.Visibility]) -> Any:
    """``payload`` as a viewer may see it, given ``visibility(job_id)``; None: not at all.

    Only group messages any role may receive need cutting: ``job``, ``node`` and
    ``cluster_summary`` on the cluster stream (the Cluster page renders the summary through this
    too), ``node`` and GPU samples on a node's. A job's own stream (``job_event``, step records)
    and the audit stream are joined only by those who see everything in them.
    """
    if not isinstance(payload, dict):
        return payload
    if event == "job":
        seen = visibility(payload["id"]) if isinstance(payload.get("id"), int) else roles.Visibility.FULL
        if seen is roles.Visibility.FULL:
            return payload
        return roles.summarise(payload) if seen is roles.Visibility.SUMMARY else None
    if event == "cluster_summary":
        queue = []
        for item in payload.get("queue", ()):
            seen = visibility(item["id"])
            if seen is roles.Visibility.SUMMARY:  # in the queue, unlinked, without why it waits
                item = {**{key: value for key, value in item.items() if key != "why"}, "visibility": "summary"}
            if seen > roles.Visibility.NONE:
                queue.append(item)
        # The jobs losing most GPU time: another user's job (seen in summary) unlinked; the rest not at all.
        losing = [item if visibility(item["id"]) is roles.Visibility.FULL else {**item, "visibility": "summary"}
                  for item in payload.get("losing", ()) if visibility(item["id"]) > roles.Visibility.NONE]
        return {**payload, "queue": queue, "losing": losing}
    if event == "node":
        gpus = []
        for gpu in payload.get("gpus", ()):
            if isinstance(gpu.get("job_id"), int) and visibility(gpu["job_id"]) is roles.Visibility.NONE:
                gpu = {**gpu, "job": None, "job_id": None, "held": True}  # the class stays: occupancy
            gpus.append(gpu)
        return {**payload, "gpus": gpus}
    if event in TELEMETRY_EVENTS and isinstance(payload.get("job"), int):
        if visibility(payload["job"]) is roles.Visibility.NONE:
            return {key: value for key, value in payload.items() if key != "job"}
    return payload


def snapshot_key(event: str, payload: Any) -> tuple[str, Any] | None:
    """What a snapshot is the state of (``("job", 7)``, ``("node", 3)``, ``("cluster_summary",
    None)``), so a newer one replaces it; None for everything else, which is never coalesced."""
    if event == "cluster_summary":
        return (event, None)
    if event in SNAPSHOT_EVENTS and isinstance(payload, dict) and isinstance(payload.get("id"), int):
        return (event, payload["id"])
    return None


def _job_owners(job_ids: set[int]) -> dict[int, int]:
    return dict(Job.objects.filter(pk__in=job_ids).values_list("id", "owner_id")) if job_ids else {}


def payload_for_user(user, event: str, payload: Any) -> Any:
    """:func:`payload_for_viewer` for ``user`` from synchronous code (a page rendering what the
    socket sends): owners looked up in one query, none for viewers who see every job in full."""
    if roles.owner_visibility(user, None) is roles.Visibility.FULL or not isinstance(payload, dict):
        return payload
    owners = _job_owners(_job_ids(event, payload))
    return payload_for_viewer(event, payload, lambda job_id: roles.owner_visibility(user, owners.get(job_id)))


class SharedViews:
    """What a batch looks like to one kind of viewer, made once per process.

    channels_redis hands the same batch object to every socket of the process in the group, so
    the first socket of a kind of viewer (one who sees every job in full: ``None``; else the
    user's id, since what a researcher sees depends on whose jobs they are) starts cutting and
    encoding it, as a task, and every socket of that kind awaits the same task (the sockets take
    the batch concurrently, and the cut may wait on the database for owners). Batches are told
    apart by identity; each entry keeps its batch alive, so an id is not reused while it is
    remembered. The in-memory layer copies a message per socket: there every socket makes its
    own, as before."""

    SIZE = 256

    def __init__(self) -> None:
        self._views: OrderedDict[tuple[int, int | None], tuple[dict[str, Any], asyncio.Task]] = OrderedDict()

    async def views(self, batch: dict[str, Any], viewer: int | None,
                    make: Callable[[], Any]) -> list[tuple[str, Any, str, int | None]]:
        key = (id(batch), viewer)
        entry = self._views.get(key)
        if entry is None or entry[0] is not batch or entry[1].get_loop() is not asyncio.get_running_loop():
            entry = (batch, asyncio.ensure_future(make()))
            self._views[key] = entry
            while len(self._views) > self.SIZE:
                self._views.popitem(last=False)
        # Shielded: a socket that closes while waiting must not cancel the others' views.
        return await asyncio.shield(entry[1])


_shared_views = SharedViews()


def _run_held(flush: Callable[[], Any]) -> None:
    """Send what a socket held back, from its timer. The socket may have closed since: the server
    then refuses the send before the consumer hears of the close, and the frames are dropped
    (a page that reconnects reloads its state): logged, not raised into the loop."""

    def done(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.warning("held live frames not sent: %r", task.exception())

    asyncio.ensure_future(flush()).add_done_callback(done)


class LiveConsumer(AsyncJsonWebsocketConsumer):
    """One browser page's socket: permission-checked subscriptions, throttled telemetry and
    coalesced snapshots."""

    FRAME_INTERVAL_S = 0.25
    # Under load the cluster stream brings a job's summary per audit row and a node per move:
    # a socket writes its snapshots at most this often, each object once, in its latest state.
    SNAPSHOT_INTERVAL_S = 0.25

    async def connect(self) -> None:
        user = self.scope.get("user")
        self.joined: set[str] = set()
        self.buffer: dict[str, list[Any]] = {}
        self.buffered = 0
        self.dropped = 0
        self.last_frame_at = 0.0
        self.flush_handle: asyncio.TimerHandle | None = None
        # (event, object) -> the frame's text, in the order of each one's latest arrival.
        self.snapshots: dict[tuple[str, Any], str] = {}
        # (event, object) -> the ``seq`` of its newest state taken (jobs.live_events.audit_messages).
        self.seqs: dict[tuple[str, Any], int] = {}
        self.last_snapshots_at = 0.0
        self.snapshots_handle: asyncio.TimerHandle | None = None
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_NOT_SIGNED_IN)
            return
        if not await database_sync_to_async(roles.has_any_role)(user):
            await self.close(code=CLOSE_NO_ROLE)
            return
        # What this viewer sees of jobs that are not theirs: when that is everything, no message
        # needs cutting and no owner is ever looked up.
        self.others_visibility = roles.owner_visibility(user, None)
        self.job_owners: dict[int, int] = {}
        await self.accept()
        self.counted = True
        websocket_opened("live")
        await self.send_json({"type": "hello", "user": user.get_username(),
                              "roles": sorted(roles.role_names(user))})

    async def disconnect(self, code: int) -> None:
        if getattr(self, "counted", False):
            websocket_closed("live")
        for handle in (self.flush_handle, self.snapshots_handle):
            if handle is not None:
                handle.cancel()
        for group in list(getattr(self, "joined", ())):
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs) -> None:
        """Decode a message strictly (``protocol.loads_strict``): anything that is not a small
        JSON text gets an error message, never a closed socket."""
        if text_data is None:
            await self.send_json({"type": "error", "status": 400, "message": "send JSON text, not binary"})
            return
        if len(text_data) > MAX_MESSAGE_CHARS:
            await self.send_json({"type": "error", "status": 400,
                                  "message": f"a message is at most {MAX_MESSAGE_CHARS} characters"})
            return
        try:
            content = loads_strict(text_data)
        except ProtocolError as exc:
            await self.send_json({"type": "error", "status": 400, "message": str(exc)})
            return
        await self.receive_json(content)

    async def receive_json(self, content: Any, **kwargs) -> None:
        if not isinstance(content, dict):
            await self.send_json({"type": "error", "status": 400, "message": "send a JSON object"})
            return
        action = content.get("action")
        stream = content.get("stream")
        if action not in ("subscribe", "unsubscribe"):
            await self.send_json({"type": "error", "status": 400,
                                  "message": "action must be subscribe or unsubscribe"})
            return
        group, status, message = await database_sync_to_async(_subscription_check)(
            self.scope["user"], str(stream), content.get("id")
        )
        reply = {"stream": stream, "id": content.get("id")}
        if group is None:
            await self.send_json({"type": "error", "status": status, "message": message, **reply})
            return
        if action == "unsubscribe":
            if group in self.joined:
                self.joined.discard(group)
                await self.channel_layer.group_discard(group, self.channel_name)
            await self.send_json({"type": "unsubscribed", "group": group, **reply})
            return
        if group not in self.joined:
            if len(self.joined) >= MAX_SUBSCRIPTIONS:
                await self.send_json({"type": "error", "status": 429,
                                      "message": f"at most {MAX_SUBSCRIPTIONS} streams per socket", **reply})
                return
            self.joined.add(group)
            await self.channel_layer.group_add(group, self.channel_name)
        await self.send_json({"type": "subscribed", "group": group, **reply})

    # -- messages from jobs.live ---------------------------------------------------------------

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Channels runs ``close_old_connections`` on the sync thread before every handler; a
        live batch touches the database only through ``database_sync_to_async`` (which does the
        same around its call), so it skips that hop: at 200 sockets it was a thread round trip
        per socket per batch, the server's largest cost after the sends (docs/load.md)."""
        if message.get("type") == BATCH_TYPE:
            await self.live_batch(message)
        else:
            await super().dispatch(message)

    async def live_batch(self, message: dict[str, Any]) -> None:
        """A group's batch from jobs.live: each message cut for this viewer and encoded, then
        sent (decisions), kept as the latest state of its object (snapshots) or buffered into
        the next telemetry frame. Every socket of the process in the group gets the same batch
        object from the channel layer, so the cut and the JSON text are made once per batch and
        kind of viewer (``_shared_views``), not once per socket. The batch's snapshots go out
        together once it is read: at once, unless this socket wrote snapshots less than
        ``SNAPSHOT_INTERVAL_S`` ago (then with whatever else comes until the interval ends)."""
        viewer = None if self.others_visibility is roles.Visibility.FULL else self.scope["user"].pk
        for event, key, text, seq in await _shared_views.views(message, viewer, lambda: self._views(message)):
            if seq is not None and key is not None:
                # Built after an earlier audit row than a state of the object already taken: two
                # senders' batches can cross on the way (a planner worker's and the server's), and
                # the older state must not land last (docs/live-ui.md, "Out of order").
                if seq < self.seqs.get(key, -1):
                    continue
                if len(self.seqs) > MAX_KNOWN_SEQS:
                    self.seqs.clear()
                self.seqs[key] = seq
            await self._send_live(event, key, text)
        if self.snapshots and self.snapshots_handle is None:
            wait_s = self.last_snapshots_at + self.SNAPSHOT_INTERVAL_S - time.monotonic()
            if wait_s <= 0:
                await self._flush_snapshots()
            else:
                self.snapshots_handle = asyncio.get_running_loop().call_later(
                    wait_s, _run_held, self._flush_snapshots)

    async def _views(self, message: dict[str, Any]) -> list[tuple[str, Any, str, int | None]]:
        """(event, snapshot key, JSON text, seq) per message of the batch this viewer may see: a
        whole frame for a decision or a snapshot, the payload alone for telemetry (it joins a
        frame's ``batch``); ``seq`` is a snapshot's audit row (None: not versioned)."""
        items = [item for item in message.get("messages", ()) if isinstance(item, dict)]
        if self.others_visibility is not roles.Visibility.FULL:
            await self._learn_owners(items)
        user = self.scope["user"]
        views = []
        for item in items:
            event = item.get("event", "")
            payload = item.get("payload")
            seq = payload.get("seq") if isinstance(payload, dict) else None  # before a cut drops it
            if self.others_visibility is not roles.Visibility.FULL:
                payload = payload_for_viewer(
                    event, payload, lambda job_id: roles.owner_visibility(user, self.job_owners.get(job_id))
                )
            if payload is None:
                continue
            if event in TELEMETRY_EVENTS:
                views.append((event, None, json.dumps(payload), None))
            else:
                views.append((event, snapshot_key(event, payload),
                              json.dumps({"type": "live", "event": event, "payload": payload}),
                              seq if isinstance(seq, int) else None))
        return views

    async def _learn_owners(self, items: list[dict[str, Any]]) -> None:
        """The owners of the jobs a batch names that this socket does not know yet, in one query."""
        unknown: set[int] = set()
        for item in items:
            if isinstance(item.get("payload"), dict):
                unknown |= _job_ids(item.get("event", ""), item["payload"])
        unknown -= self.job_owners.keys()
        if unknown:
            if len(self.job_owners) > MAX_KNOWN_OWNERS:
                self.job_owners.clear()
            self.job_owners.update(await database_sync_to_async(_job_owners)(unknown))

    async def _send_live(self, event: str, key: Any, text: str) -> None:
        if key is not None:
            # The newest state of the object, at its place: after whatever came before it.
            self.snapshots.pop(key, None)
            self.snapshots[key] = text
            return
        if event in TELEMETRY_EVENTS:
            self._buffer(event, text)
            now = time.monotonic()
            wait_s = self.last_frame_at + self.FRAME_INTERVAL_S - now
            if wait_s <= 0 and self.flush_handle is None:
                await self._flush()
            elif self.flush_handle is None:
                loop = asyncio.get_running_loop()
                self.flush_handle = loop.call_later(wait_s, _run_held, self._flush)
            return
        # A decision goes out at once, after the snapshots held before it (which flush telemetry
        # first), so a page never sees it before what preceded it.
        await self._flush_snapshots()
        await self._flush(force=True)
        await self.send(text_data=text)

    async def _flush_snapshots(self) -> None:
        """Write the held snapshots, buffered telemetry first (as before any state change)."""
        if self.snapshots_handle is not None:
            self.snapshots_handle.cancel()
            self.snapshots_handle = None
        if not self.snapshots:
            return
        await self._flush(force=True)
        texts, self.snapshots = list(self.snapshots.values()), {}
        self.last_snapshots_at = time.monotonic()
        for text in texts:
            await self.send(text_data=text)

    def _buffer(self, event: str, text: str) -> None:
        if self.buffered >= MAX_BUFFERED_PAYLOADS:
            # A browser that cannot keep up loses the oldest samples, never the socket; the
            # page shows how many were dropped and a reload reads them from the database.
            oldest = next(iter(self.buffer))
            self.buffer[oldest].pop(0)
            if not self.buffer[oldest]:
                del self.buffer[oldest]
            self.buffered -= 1
            self.dropped += 1
        self.buffer.setdefault(event, []).append(text)
        self.buffered += 1

    async def _flush(self, force: bool = False) -> None:
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        if not self.buffer:
            return
        frames, self.buffer, self.buffered = self.buffer, {}, 0
        self.last_frame_at = time.monotonic()
        for event, texts in frames.items():
            # {"type": "live", "event": ..., "batch": [payload, ...], "dropped": n}, from the
            # payloads' texts as they were encoded once for every socket.
            dropped = ""
            if self.dropped:
                dropped, self.dropped = f', "dropped": {self.dropped}', 0
            await self.send(text_data=f'{{"type": "live", "event": {json.dumps(event)}, '
                                      f'"batch": [{", ".join(texts)}]{dropped}}}')

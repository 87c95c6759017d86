"""Live updates to browsers and agents: group names and the one way to send them (docs/live-ui.md).

Every live message goes through :func:`send` / :func:`send_messages` (complete payloads) or
:func:`send_built` (payloads built after commit from the rows a transaction wrote, all of them
together, so a transaction of many rows costs a constant number of queries). Inside a
transaction nothing leaves before it commits: messages are kept per transaction and flushed once
after commit, coalesced (of the messages with the same group, event and id only the latest is
sent; the rest keep their order) and sent as one ``live.batch`` per group. A rollback sends
nothing. Outside a transaction they go at once.

Sending never waits on the channel layer: batches are handed to an event loop — the server's
when the caller runs on it or in one of its worker threads (views, ``database_sync_to_async``)
or in a thread that asked for it (``send_through``: the embedded mode's in-process loop), else
one sender thread per process (Celery workers, management commands) — and a failing layer
is logged, never raised. Flushes that queue up while a send is in progress go out together, one
channel-layer message per group. The database stays the truth: a page that reconnects reloads
its state.

Groups: ``job-{id}``, ``node-{id}``, ``cluster``, ``audit`` (browsers, jobs.live_consumers) and
``agent-{node id}`` (a node's agent, jobs.consumers). On the channel layer a batch is
``{"type": "live.batch", "messages": [{"event": ..., "payload": ...}, ...]}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, NamedTuple

import redis
from asgiref.sync import SyncToAsync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction

from telemetry import metrics

logger = logging.getLogger(__name__)

CLUSTER_GROUP = "cluster"
AUDIT_GROUP = "audit"
BATCH_TYPE = "live.batch"  # consumers implement ``live_batch``
DROPPED_METRIC = "omni_telemetry_live_frames_dropped_total"


def job_group(job_id: int) -> str:
    return f"job-{job_id}"


def node_group(node_id: int) -> str:
    return f"node-{node_id}"


class Message(NamedTuple):
    """``payload`` sent as ``event`` to ``group``. Messages of one flush with the same group,
    event and ``key`` describe one object: only the latest goes out. ``None``: never coalesced."""

    group: str
    event: str
    payload: Any
    key: Hashable | None = None


def message(group: str, event: str, payload: Any, key: Hashable | None = None) -> Message:
    """A :class:`Message` whose key is, unless given, the payload's ``id`` (if it has one)."""
    if key is None and isinstance(payload, dict):
        key = payload.get("id")
    return Message(group, event, payload, key)


# What builds payloads after commit: called once per flush with the items given to
# ``send_built`` in that transaction (each once, in order), it returns the messages.
Builder = Callable[[list[Any]], Iterable[Message]]


class _Build(NamedTuple):
    build: Builder
    item: Hashable


def send(group: str, event: str, payload: Any, *, key: Hashable | None = None) -> None:
    """Send one complete payload: after the current transaction commits, or at once."""
    send_messages([message(group, event, payload, key)])


def send_messages(messages: Iterable[Message]) -> None:
    """Send complete payloads together: after the current transaction commits, or at once."""
    _submit_or_keep(list(messages))


def send_built(build: Builder, item: Hashable) -> None:
    """Have ``build(items)`` make the messages after commit, once for the whole transaction, with
    every ``item`` it was given in it; outside a transaction ``build([item])`` at once.

    Builders read the committed rows (a row written in a savepoint that rolled back is simply
    not there), so their payloads are the state after the transaction. Synchronous code only.
    """
    _submit_or_keep([_Build(build, item)])


def send_through(loop: asyncio.AbstractEventLoop | None) -> None:
    """Send this thread's batches through ``loop`` from now on (None: as any other thread). The
    embedded mode's in-process loop sends through the server's: the in-memory channel layer wakes
    the server's consumers only from there, and batches of one loop keep their order, so a node
    the heartbeat monitor marks suspect cannot reach a page after the heartbeat that healed it."""
    _loop_override.loop = loop


def wait_sent(timeout_s: float = 5.0) -> bool:
    """Wait until every batch handed over so far has been sent (tests, shutdown); False on
    timeout. Call it from synchronous code, not from the loop it waits for."""
    deadline = time.monotonic() + timeout_s
    while not _sender.idle():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class TrailingThrottle:
    """At most one go per key per ``interval_s``; a go that comes too soon is not lost but runs
    once, from a timer thread, when the interval is over (the trailing edge), however many came
    meanwhile: so the last state always goes out, at most ``interval_s`` late.

    ``later`` runs in the timer's thread, which may read the database (its connection is closed
    after) and must not raise (it is logged). Used by the cluster summary (jobs.live_events) and
    the telemetry streams (telemetry.ingest.live)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[Hashable, float] = {}
        self._timers: dict[Hashable, threading.Timer] = {}
        self._firing = 0  # timers that have fired and whose go has not finished yet

    def go(self, key: Hashable, interval_s: float, later: Callable[[], None]) -> bool:
        """True: go now. False: too soon; ``later`` is (or already was) scheduled."""
        with self._lock:
            now = time.monotonic()
            if key in self._timers:
                return False
            wait_s = self._last.get(key, -float("inf")) + interval_s - now
            if wait_s <= 0:
                self._last[key] = now
                return True
            self._schedule(key, wait_s, self._fire, (key, later))
        return False

    def _schedule(self, key: Hashable, wait_s: float, fire: Callable[..., None], args: tuple,
                  loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Run ``fire(*args, loop)`` in ``wait_s`` (the caller holds the lock). The trailing go
        sends through the loop this caller would have used (the embedded mode's in-memory layer
        wakes its consumers only from the server's)."""
        timer = threading.Timer(wait_s, fire, (*args, loop or _sender.loop()))
        timer.daemon = True
        self._timers[key] = timer
        timer.start()

    def _fire(self, key: Hashable, later: Callable[[], None], loop: asyncio.AbstractEventLoop) -> None:
        with self._fired(key, stamp=True):
            self._run(key, later, loop)

    @contextlib.contextmanager
    def _fired(self, key: Hashable, stamp: bool) -> Iterator[None]:
        """A timer's go: its timer forgotten (and, with ``stamp``, the go counted as the key's
        last, under the same lock), and the throttle not ``idle`` until the go is done."""
        with self._lock:
            self._timers.pop(key, None)
            if stamp:
                self._last[key] = time.monotonic()
            self._firing += 1
        try:
            yield
        finally:
            with self._lock:
                self._firing -= 1

    @staticmethod
    def _run(key: Hashable, later: Callable[[], None], loop: asyncio.AbstractEventLoop) -> None:
        _loop_override.loop = loop
        try:
            later()
        except Exception:
            logger.exception("a held live update for %s failed", key)
        finally:
            _loop_override.loop = None
            from django.db import connection

            connection.close()

    def reset(self) -> None:
        """Forget every go and cancel the trailing ones (tests: one test's must not reach the next)."""
        with self._lock:
            for timer in self._timers.values():
                timer.cancel()
            self._timers.clear()
            self._last.clear()

    def idle(self) -> bool:
        """No trailing go is scheduled or still running (tests)."""
        with self._lock:
            return not self._timers and not self._firing


class SharedTrailingThrottle(TrailingThrottle):
    """A :class:`TrailingThrottle` over every process on the Redis of ``REDIS_URL``: at most one
    go per key per ``interval_s`` among all of them, whoever claims the key first
    (``SET NX PX``, Redis's clock). A go that is refused runs ``later`` once the claim that
    refused it has expired, unless another claim was made meanwhile: that one was made after
    this go was refused, so after its change committed, and the state it sends carries it.
    So the last state still always goes out, at most about ``interval_s`` late.

    Without ``REDIS_URL`` (the embedded mode: one process) it is the per-process throttle; if
    Redis fails it lets the go through (logged): a lost update is worse than an extra one."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self._tokens = itertools.count()
        self._claims: dict[Hashable, str] = {}  # key -> this process's latest claim

    def go(self, key: Hashable, interval_s: float, later: Callable[[], None]) -> bool:
        if interval_s <= 0:
            return True
        with self._lock:
            if key in self._timers:
                return False
            wait_s = self._last.get(key, -float("inf")) + interval_s - time.monotonic()
            if wait_s > 0:  # this process's own claim still holds: no need to ask Redis
                self._schedule(key, wait_s, self._fire, (key, later, interval_s, self._claims.get(key)))
                return False
        claimed, holder, wait_s = self._claim(key, interval_s)
        with self._lock:
            if claimed:
                self._last[key], self._claims[key] = time.monotonic(), holder
                return True
            if key not in self._timers:
                self._schedule(key, wait_s, self._fire, (key, later, interval_s, holder))
        return False

    def _fire(self, key: Hashable, later: Callable[[], None], interval_s: float, refused_by: str | None,
              loop: asyncio.AbstractEventLoop) -> None:
        with self._fired(key, stamp=False):
            claimed, holder, wait_s = self._claim(key, interval_s)
            with self._lock:
                if claimed:
                    self._last[key], self._claims[key] = time.monotonic(), holder
                elif holder == refused_by and key not in self._timers:  # the timer ran a little early
                    self._schedule(key, wait_s, self._fire, (key, later, interval_s, refused_by), loop)
            if claimed:
                self._run(key, later, loop)

    def _claim(self, key: Hashable, interval_s: float) -> tuple[bool, str | None, float]:
        """(claimed, the claim's holder, seconds it still holds)."""
        token = f"{socket.gethostname()}:{os.getpid()}:{next(self._tokens)}"
        url = settings.REDIS_URL
        if not url:
            return True, token, 0.0
        name = f"omni:live:throttle:{self._name}:{key}"
        try:
            client = _redis_client(url)
            for _ in range(3):  # the claim may expire between the SET and the GET
                if client.set(name, token, nx=True, px=max(1, round(interval_s * 1000))):
                    return True, token, 0.0
                holder, ttl_ms = client.pipeline().get(name).pttl(name).execute()
                if holder is not None:
                    return False, holder.decode(), max(ttl_ms, 1) / 1000
        except redis.RedisError as exc:
            logger.warning("the shared live throttle %s could not reach Redis (%r): going without it", self._name, exc)
        return True, token, 0.0

    def reset(self) -> None:
        super().reset()
        with self._lock:
            self._claims.clear()


_redis_clients: dict[str, redis.Redis] = {}


def _redis_client(url: str) -> redis.Redis:
    """One client per URL and process (redis-py's pool reconnects after a fork); short timeouts:
    the caller is a request or a worker that must not hang on a throttle."""
    client = _redis_clients.get(url)
    if client is None:
        client = _redis_clients[url] = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    return client


# -- after commit, once per transaction ------------------------------------------------------------


class _Segment:
    """What one savepoint level of a transaction sent, registered with ``transaction.on_commit``.

    Django drops the hooks of a savepoint that rolls back (all of them with the transaction), so
    a segment that is gone took its messages with it. A transaction holds its segments weakly;
    the first one Django runs after commit sends itself and every later one still alive, in
    one flush. Most transactions have one segment; a planner pass, one per applied action.
    """

    def __init__(self, pending: _Pending, savepoints: tuple[str | None, ...]) -> None:
        self.pending = pending
        self.savepoints = savepoints
        self.entries: list[tuple[int, Message | _Build]] = []
        self.sent = False

    def __call__(self) -> None:
        self.pending.flush(self)


class _Pending:
    """The unsent segments of this thread's transaction, in the order they were registered."""

    def __init__(self) -> None:
        self.segments: list[weakref.ref[_Segment]] = []
        self.sequence = 0

    def unsent(self) -> list[_Segment]:
        alive = [segment for ref in self.segments if (segment := ref()) is not None and not segment.sent]
        self.segments = [weakref.ref(segment) for segment in alive]
        return alive

    def keep(self, entries: list[Message | _Build], savepoints: tuple[str | None, ...]) -> None:
        unsent = self.unsent()
        segment = unsent[-1] if unsent and unsent[-1].savepoints == savepoints else None
        if segment is None:
            segment = _Segment(self, savepoints)
            self.segments.append(weakref.ref(segment))
            transaction.on_commit(segment)
        for entry in entries:
            self.sequence += 1
            segment.entries.append((self.sequence, entry))

    def flush(self, first: _Segment) -> None:
        if first.sent:
            return
        unsent = self.unsent()
        # Segments registered before ``first`` and still unsent are not part of this commit
        # (pytest-django's captured hooks run only those registered in the block).
        segments = unsent[unsent.index(first):] if first in unsent else [first]
        for segment in segments:
            segment.sent = True
        entries = sorted((e for segment in segments for e in segment.entries), key=lambda e: e[0])
        _deliver([entry for _, entry in entries])


_local = threading.local()


def _submit_or_keep(entries: list[Message | _Build]) -> None:
    if not entries:
        return
    connection = transaction.get_connection()
    if not connection.in_atomic_block:
        _deliver(entries)
        return
    pending: _Pending | None = getattr(_local, "pending", None)
    if pending is None or not pending.unsent():
        pending = _local.pending = _Pending()
    pending.keep(entries, tuple(connection.savepoint_ids))


def _deliver(entries: list[Message | _Build]) -> None:
    """Build, coalesce and hand over one flush. Never raises: the write has committed."""
    try:
        batches = coalesce(_expand(entries))
        layer = get_channel_layer()
        if layer is not None and batches:
            _sender.submit(layer, batches)
    except Exception:
        logger.exception("live messages could not be sent")


def _expand(entries: list[Message | _Build]) -> list[Message]:
    """The messages of a flush, each builder's in the place of its last item."""
    items: dict[Builder, dict[Hashable, None]] = {}
    last: dict[Builder, int] = {}
    for index, entry in enumerate(entries):
        if isinstance(entry, _Build):
            items.setdefault(entry.build, {})[entry.item] = None
            last[entry.build] = index
    messages: list[Message] = []
    for index, entry in enumerate(entries):
        if isinstance(entry, Message):
            messages.append(entry)
        elif last[entry.build] == index:
            try:
                messages.extend(entry.build(list(items[entry.build])))
            except Exception:
                logger.exception("building live messages with %s failed", entry.build.__qualname__)
    return messages


def coalesce(messages: list[Message]) -> dict[str, list[dict[str, Any]]]:
    """One batch per group, in order; of the messages with one (group, event, key) only the latest."""
    seen: set[tuple[str, str, Hashable]] = set()
    kept: list[Message] = []
    for item in reversed(messages):
        if item.key is not None:
            identity = (item.group, item.event, item.key)
            if identity in seen:
                continue
            seen.add(identity)
        kept.append(item)
    batches: dict[str, list[dict[str, Any]]] = {}
    for item in reversed(kept):
        batches.setdefault(item.group, []).append({"event": item.event, "payload": item.payload})
    return batches


# -- handing batches to the channel layer ------------------------------------------------------------


class _LoopQueue:
    """The batches of one event loop: handed over (``waiting``), queued, sent by one task at a time."""

    def __init__(self) -> None:
        self.waiting = 0
        self.batches: deque[tuple[Any, dict[str, list[dict[str, Any]]]]] = deque()
        self.draining = False


class _Sender:
    """Sends batches from an event loop, never making the caller wait: the caller's own loop,
    else the ASGI server's loop that runs the calling worker thread (the in-memory layer of the
    embedded mode can wake its consumers only from there), else a loop thread of this process.
    Each loop sends its batches in order; beyond ``MAX_BACKLOG`` waiting ones, new ones are
    dropped and counted (``omni_telemetry_live_frames_dropped_total``)."""

    MAX_BACKLOG = 1000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopQueue] = weakref.WeakKeyDictionary()
        self._tasks: set[asyncio.Task] = set()  # asyncio keeps only weak references to tasks
        self._own: tuple[int, asyncio.AbstractEventLoop] | None = None

    def submit(self, layer: Any, batches: dict[str, list[dict[str, Any]]]) -> None:
        loop = self.loop()
        with self._lock:
            queue = self._queues.get(loop)
            if queue is None:
                queue = self._queues[loop] = _LoopQueue()
            queue.waiting += 1
        try:
            loop.call_soon_threadsafe(self._enqueue, queue, layer, batches)
        except RuntimeError:  # the loop closed meanwhile
            with self._lock:
                queue.waiting -= 1
            logger.warning("live messages dropped: their event loop is closed")

    def idle(self) -> bool:
        """Nothing handed over is still to be sent (on loops that still run)."""
        with self._lock:
            return not any(queue.waiting or queue.batches
                           for loop, queue in self._queues.items() if not loop.is_closed())

    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop this thread's batches go through."""
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            pass
        override = getattr(_loop_override, "loop", None)
        if override is not None and not override.is_closed():
            return override
        # asgiref notes the server's loop in the threads that run sync code for it.
        server = getattr(SyncToAsync.threadlocal, "main_event_loop", None)
        if (server is not None and getattr(SyncToAsync.threadlocal, "main_event_loop_pid", None) == os.getpid()
                and server.is_running()):
            return server
        with self._lock:
            if self._own is None or self._own[0] != os.getpid():  # none yet, or a forked worker
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="omni-live-sender", daemon=True).start()
                self._own = (os.getpid(), loop)
            return self._own[1]

    def _enqueue(self, queue: _LoopQueue, layer: Any, batches: dict[str, list[dict[str, Any]]]) -> None:
        with self._lock:
            queue.waiting -= 1
            if len(queue.batches) >= self.MAX_BACKLOG:
                metrics.count(DROPPED_METRIC, "backlog", sum(len(messages) for messages in batches.values()))
                return
            queue.batches.append((layer, batches))
            if queue.draining:
                return
            queue.draining = True
        task = asyncio.get_running_loop().create_task(self._drain(queue))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, queue: _LoopQueue) -> None:
        """Send the queued batches in order; those that queued up while a send was in progress
        go together, one channel-layer message per group (each group's messages in order): under
        load a server's loop handed over flushes faster than it sent them one group message each,
        and every socket in a group pays per message."""
        try:
            while True:
                with self._lock:
                    if not queue.batches:
                        return
                    layer = queue.batches[0][0]
                    taken = 0
                    merged: dict[str, list[dict[str, Any]]] = {}
                    for entry_layer, batches in queue.batches:
                        if entry_layer is not layer:
                            break
                        taken += 1
                        for group, messages in batches.items():
                            merged.setdefault(group, []).extend(messages)
                for group, messages in merged.items():
                    try:
                        await layer.group_send(group, {"type": BATCH_TYPE, "messages": messages})
                    except Exception:
                        logger.exception("live batch to %s failed", group)
                with self._lock:
                    for _ in range(taken):
                        queue.batches.popleft()
        finally:  # on this loop's thread, as _enqueue: no batch can slip in between
            with self._lock:
                queue.draining = False


_sender = _Sender()
_loop_override = threading.local()  # TrailingThrottle's timer threads: the loop of who scheduled them

"""The agent endpoint: one WebSocket per node agent at ``/ws/agent/`` (docs/control-loop.md).

The agent authenticates with its node's bearer token (``jobs.agent_auth``, the same check as the
HTTP fallback and telemetry ingestion); a missing or wrong token gets the socket closed with
4401 / 4403 and a log line (never the token). After ``hello`` the server fences stray workers,
sends to recovery the runs a restarted agent lost (``jobs.actions.agents.reconcile_lost_runs``),
replays every unacknowledged command for the node, then streams new ones as ``send_node_commands``
sends them to the ``agent-{node id}`` group (through jobs.live: one ``command`` message each,
a node's commands in one batch). Malformed frames and unknown command ids are answered with an
``error`` frame and change nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.db import close_old_connections

from jobs import actions
from jobs.actions import agent_group
from jobs.actions.commands import COMMAND_EVENT
from jobs.agent_api import error_frame, handle_frame
from jobs.agent_auth import AgentAuthFailure, agent_from_headers, asgi_headers
from jobs.models import Node
from telemetry.metrics import websocket_closed, websocket_opened
from trainer_agent import protocol

logger = logging.getLogger("jobs.agent")

# A peer that sends this many bad frames in a row is not a confused agent: close it.
MAX_BAD_FRAMES = 20


def _in_pool(function, *args):
    close_old_connections()
    try:
        return function(*args)
    finally:
        close_old_connections()


# Agent frames are handled in a thread pool rather than Channels' single database thread, so
# one node's burst of step records never queues another node's ack behind it.
run_in_pool = sync_to_async(_in_pool, thread_sensitive=False)


# Step-record frames waiting for the database, per socket; beyond this the oldest are dropped.
MAX_QUEUED_STEP_FRAMES = 200
# The command ids a hello's ``applied`` may list that are read (the agent sends its last 50).
MAX_APPLIED_IDS = 4096
# Logs frames waiting, per socket: far more than an agent's window allows (docs/logs.md).
MAX_QUEUED_LOG_FRAMES = 64


def _logs_reply(node: Node, frame: dict[str, Any]) -> dict[str, Any]:
    """Store one ``logs`` frame; answer ``logs_ack`` (stored, or refused: the agent drops the
    run's lines) or, for a malformed frame, ``error``."""
    try:
        stored = actions.record_log_lines(node, frame)
    except protocol.ProtocolError as exc:
        logger.info("bad logs frame from %s: %s", node.name, exc)
        return error_frame(exc.code, str(exc), frame.get("ship"))
    except actions.LogsRefused as exc:
        logger.info("logs from %s refused: %s", node.name, exc)
        return {"type": protocol.LOGS_ACK, "ship": frame["ship"], "job": frame["job"], "run_id": frame["run_id"],
                "stored": 0, "refused": str(exc)}
    return {"type": protocol.LOGS_ACK, "ship": frame["ship"], "job": frame["job"], "run_id": frame["run_id"],
            "stored": stored, "refused": None}


class AgentConsumer(AsyncWebsocketConsumer):
    """One node agent's socket: auth, hello + replay, heartbeats, acks, outcomes, step records.

    Step records go through a per-socket queue drained by a background task, so a burst of
    telemetry never delays the heartbeats, acks and outcomes behind it (a node must not look
    dead because its trainer is fast). Each frame is answered ``steps_ack`` once it is stored,
    never before: a frame lost in the queue (a killed server, a failed database) goes again from
    the agent (``trainer_agent.node.UnackedSteps``).
    """

    node: Node | None = None
    group: str | None = None
    bad_frames = 0
    steps_queue: asyncio.Queue | None = None
    steps_task: asyncio.Task | None = None
    dropped_step_frames = 0
    logs_queue: asyncio.Queue | None = None
    logs_task: asyncio.Task | None = None

    async def connect(self) -> None:
        headers = asgi_headers(self.scope.get("headers", []))
        client = self.scope.get("client") or ("?", 0)
        peer = f"{client[0]}:{client[1]}"
        await self.accept()
        try:
            self.node = await database_sync_to_async(agent_from_headers)(headers, peer)
        except AgentAuthFailure as exc:
            await self.send_frame(error_frame("unauthorized", str(exc)))
            await self.close(code=exc.close_code)
            return
        self.group = agent_group(self.node.id)
        websocket_opened("agent")
        # One agent per node: an older socket for the same node is told to close (4409), so a
        # command is never delivered to two live agents.
        await self.channel_layer.group_send(self.group, {"type": "agent.replaced", "by": self.channel_name})
        await self.channel_layer.group_add(self.group, self.channel_name)
        from django.conf import settings

        await self.send_frame(
            {
                "type": protocol.WELCOME,
                "protocol": protocol.PROTOCOL_VERSION,
                "node": self.node.name,
                "heartbeat_interval_s": settings.OMNI_HEARTBEAT_INTERVAL_S,
            }
        )
        logger.info("agent of %s connected from %s", self.node.name, peer)

    async def _drain_steps(self) -> None:
        assert self.steps_queue is not None
        while True:
            frame = await self.steps_queue.get()
            try:
                replies = await run_in_pool(handle_frame, self.node, frame)
            except Exception:  # not acknowledged: the agent sends the frame again
                logger.exception("step records from %s failed", self.node.name if self.node else "?")
                continue
            for reply in replies:
                await self.send_frame(reply)
            if isinstance(frame.get("seq"), int):
                await self.send_frame({"type": protocol.STEPS_ACK, "seq": frame["seq"]})

    async def __call__(self, scope, receive, send) -> None:
        """A server that shuts down (daphne on SIGTERM or Ctrl-C) cancels each consumer without a
        ``disconnect``: the drains end with it, rather than being destroyed pending with the loop."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stop_drains()

    async def _stop_drains(self) -> None:
        for task in (self.steps_task, self.logs_task):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def disconnect(self, code: int) -> None:
        await self._stop_drains()
        if self.group is not None:
            websocket_closed("agent")
            await self.channel_layer.group_discard(self.group, self.channel_name)
            logger.info("agent of %s disconnected (%s)", self.node.name if self.node else "?", code)

    async def send_frame(self, frame: dict[str, Any]) -> None:
        await self.send(text_data=protocol.dumps(frame))

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.node is None:
            return
        try:
            frame = protocol.parse_frame(text_data)
            # A logs frame's shape is checked where it is stored (jobs.actions.logs).
            if frame["type"] != protocol.LOGS:
                frame = protocol.validate_agent_frame(frame)
        except protocol.ProtocolError as exc:
            self.bad_frames += 1
            logger.info("bad frame from %s: %s", self.node.name, exc)
            await self.send_frame(error_frame(exc.code, str(exc)))
            if self.bad_frames >= MAX_BAD_FRAMES:
                await self.close(code=protocol.CLOSE_PROTOCOL_ERROR)
            return
        self.bad_frames = 0
        if frame["type"] == protocol.HEARTBEAT:
            # Re-join the node's group on every heartbeat: a Redis restart forgets group
            # membership, and commands must find this socket again without a reconnect.
            try:
                await self.channel_layer.group_add(self.group, self.channel_name)
            except Exception:
                logger.warning("could not re-join %s on the channel layer", self.group)
        if frame["type"] == protocol.HELLO:
            await self.on_hello(frame)
            return
        if frame["type"] == protocol.STEPS:
            if self.steps_queue is None:
                self.steps_queue = asyncio.Queue()
                self.steps_task = asyncio.create_task(self._drain_steps())
            if self.steps_queue.qsize() >= MAX_QUEUED_STEP_FRAMES:
                self.steps_queue.get_nowait()
                self.dropped_step_frames += 1
                logger.warning("dropped a step-record frame from %s unacknowledged (database behind; %d so far; "
                               "the agent sends it again)",
                               self.node.name, self.dropped_step_frames)
            self.steps_queue.put_nowait(frame)
            return
        if frame["type"] == protocol.LOGS:
            await self.on_logs(frame)
            return
        replies = await run_in_pool(handle_frame, self.node, frame)
        for reply in replies:
            await self.send_frame(reply)

    async def on_logs(self, frame: dict[str, Any]) -> None:
        """Log lines go through a queue of their own, like step records, so a chatty job never
        delays the heartbeats behind it. The agent's window bounds what it sends unacknowledged
        (docs/logs.md), so the queue stays short; a peer that ignores the window is refused."""
        if self.logs_queue is None:
            self.logs_queue = asyncio.Queue()
            self.logs_task = asyncio.create_task(self._drain_logs())
        if self.logs_queue.qsize() >= MAX_QUEUED_LOG_FRAMES:
            await self.send_frame(error_frame("logs_backlog", f"more than {MAX_QUEUED_LOG_FRAMES} logs frames "
                                              "waiting: wait for their acks", frame.get("ship")))
            return
        self.logs_queue.put_nowait(frame)

    async def _drain_logs(self) -> None:
        assert self.logs_queue is not None
        while True:
            frame = await self.logs_queue.get()
            try:
                reply = await run_in_pool(_logs_reply, self.node, frame)
            except Exception:
                logger.exception("log lines from %s failed", self.node.name if self.node else "?")
                reply = error_frame("logs_failed", "the server could not store these lines; send them again",
                                    frame.get("ship"))
            await self.send_frame(reply)
            if reply["type"] == protocol.ERROR:
                self.bad_frames += 1
                if self.bad_frames >= MAX_BAD_FRAMES:
                    await self.close(code=protocol.CLOSE_PROTOCOL_ERROR)

    async def on_hello(self, frame: dict[str, Any]) -> None:
        """Fence workers for jobs no longer placed here, recover the runs a restarted agent lost,
        then replay every unacked command, and the acked ones it applied (their ``done`` again)."""
        workers = [w for w in frame.get("workers", []) if isinstance(w, dict)]
        inventory = frame.get("inventory") if isinstance(frame.get("inventory"), dict) else {}
        applied = frame.get("applied") if isinstance(frame.get("applied"), list) else []
        applied = [a for a in applied[:MAX_APPLIED_IDS] if isinstance(a, str)]
        frames = await database_sync_to_async(self._hello_frames)(
            workers, str(inventory.get("address") or ""), applied)
        for item in frames:
            await self.send_frame(item)

    def _hello_frames(self, workers: list[dict[str, Any]], address: str = "",
                      applied: list[str] | None = None) -> list[dict[str, Any]]:
        assert self.node is not None
        actions.record_agent_hello(self.node, workers, address, applied or [])
        commands = actions.claim_commands_for_dispatch(self.node.id, include_sent=True, applied=applied or [])
        return [actions.command_frame(c) for c in commands]

    async def agent_replaced(self, event: dict[str, Any]) -> None:
        """A newer connection for this node arrived: this one steps aside."""
        if event.get("by") != self.channel_name:
            logger.warning("agent of %s replaced by a newer connection", self.node.name if self.node else "?")
            await self.send_frame(error_frame("replaced", "a newer agent connection for this node took over"))
            await self.close(code=protocol.CLOSE_REPLACED)

    async def live_batch(self, batch: dict[str, Any]) -> None:
        """Commands sent to this node's group through jobs.live (``jobs.actions.commands.send_node_commands``)."""
        for message in batch["messages"]:
            if message["event"] == COMMAND_EVENT:
                await self.send_frame(message["payload"])

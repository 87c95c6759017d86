"""The node agent: ``python -m trainer_agent.node --server URL --token TOKEN [--simulate-gpus N]``.

Runs on each GPU node (no Django here). It holds one WebSocket to the control plane
(``/ws/agent/``), reports its inventory, sends a heartbeat with GPU samples every few seconds,
and carries out commands: ``start``/``resume`` launch this node's share of the job's code with
torchrun (``trainer_agent.launch``: one torchrun per node, c10d rendezvous on the leader),
``preempt`` and ``resize`` send SIGTERM to every rank (an ``omni`` job checkpoints and exits; a
``signal`` job gets its grace, then SIGKILL), ``stop`` ends the ranks, ``clean`` removes a
finished job's run dir. Exits are reported with the failing rank, its code and its log's tail;
the ranks' logs are shipped as they grow (``trainer_agent.logship``). Every command is acknowledged on receipt and answered with a
``done`` frame carrying its outcome (checkpoint step, save seconds, error). Command ids already
applied are ignored (the server delivers at least once). Step records from ``metrics.jsonl``
are forwarded as they appear, each frame kept until the server acknowledges it stored
(``UnackedSteps``); while the server is away the workers keep running and records wait in a
bounded buffer (oldest dropped, counted). ``--virtual-nodes`` runs many simulated
nodes in one process, speaking the same protocol, with no torch at all. The workers themselves
(a torchrun's ranks, or simulated ones) are ``trainer_agent.workers``.

Protocol: ``trainer_agent.protocol``; design and semantics: docs/control-loop.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import random
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from trainer_agent import launch, protocol
from trainer_agent.workers import (
    SimulatedJob,
    TorchrunJob,
    WorkerHandle,
    newest_checkpoint_on_disk,
    resumes_simulated,
)

logger = logging.getLogger("trainer_agent.node")

RECORD_BUFFER = 2000
RECORD_FLUSH_S = 1.0
# A ``steps`` frame the server has not acknowledged (``steps_ack``) goes again after every hello
# and when unanswered this long on a live socket (a database that failed under the frame).
STEPS_RESEND_S = 30.0
APPLIED_MEMORY = 4096
EXIT_MEMORY = 64  # jobs whose last exit report is re-sent after every hello
_clock_offset = [0.0, 0.0]  # agent_clock's [offset_s, when it was read]


def agent_clock() -> float:
    """Wall-clock seconds for the timestamps this agent reports (heartbeats, GPU samples, step
    records). Fault-injection hook (``python -m bench.faults``, docs/faults.md): when
    ``OMNI_AGENT_TEST_CLOCK_FILE`` names a file, the number of seconds in it is added, re-read
    at most twice a second, so a bench can jump a running agent's clock; unset, the system
    clock as it is."""
    path = os.environ.get("OMNI_AGENT_TEST_CLOCK_FILE")
    now = time.time()
    if not path:
        return now
    if now - _clock_offset[1] >= 0.5:
        try:
            _clock_offset[:] = [float(Path(path).read_text().strip() or 0), now]
        except (OSError, ValueError):
            _clock_offset[:] = [0.0, now]
    return now + _clock_offset[0]


# -- GPUs ------------------------------------------------------------------------------------


class GpuInventory:
    """The node's GPUs: real NVML readings when nvidia-ml-py and a driver are present, else
    ``count`` simulated GPUs whose utilisation follows what the workers on them are doing."""

    def __init__(self, simulate: int | None) -> None:
        self.nvml = None
        self.handles: list[Any] = []
        if simulate is None:
            try:
                import pynvml  # nvidia-ml-py

                pynvml.nvmlInit()
                self.nvml = pynvml
                self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            except Exception:
                self.nvml = None
        self.count = len(self.handles) if self.nvml else (simulate or 1)
        self.mem_total_bytes = 80 * (1 << 30)

    def describe(self) -> list[dict[str, Any]]:
        """Inventory entries for ``hello``."""
        if self.nvml:
            out = []
            for i, handle in enumerate(self.handles):
                name = self.nvml.nvmlDeviceGetName(handle)
                mem = self.nvml.nvmlDeviceGetMemoryInfo(handle)
                out.append({"index": i, "model": name if isinstance(name, str) else name.decode(),
                            "mem_bytes": int(mem.total)})
            return out
        return [{"index": i, "model": "simulated", "mem_bytes": self.mem_total_bytes} for i in range(self.count)]

    def samples(self, busy: dict[int, tuple[str, float]]) -> list[dict[str, Any]]:
        """One sample per GPU; ``busy`` maps GPU index -> (job, simulated utilisation 0..1)."""
        now = agent_clock()
        out = []
        for i in range(self.count):
            job, util = busy.get(i, (None, 0.0))
            if self.nvml:
                handle = self.handles[i]
                rates = self.nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = self.nvml.nvmlDeviceGetMemoryInfo(handle)
                out.append({"index": i, "t": now, "util": rates.gpu / 100.0, "mem_used_bytes": int(mem.used),
                            "mem_total_bytes": int(mem.total), "job": job, "source": "nvml"})
            else:
                used = int(self.mem_total_bytes * (0.6 if job else 0.0))
                out.append({"index": i, "t": now, "util": round(util, 3), "mem_used_bytes": used,
                            "mem_total_bytes": self.mem_total_bytes, "job": job, "source": "simulated"})
        return out


# -- the agent -----------------------------------------------------------------------------------


class UnackedSteps:
    """The ``steps`` frames sent and not yet acknowledged, by ``seq``, oldest first.

    A frame the socket took is not a frame the server stored: a server killed with frames in its
    queue, or a database that failed under one, loses them, and with them the steps they carried
    (``tests/control_loop/test_outages.py`` saw steps 2-6 go missing). So each frame is kept
    until its ``steps_ack`` arrives, sent again after every hello (``due_again``) and when
    unanswered for ``STEPS_RESEND_S``. The server stores a frame sent twice once (telemetry by
    ``(boot, seq)``, progress and rhythm by step). Held records are bounded like the buffer in
    front of them: past ``limit`` the oldest frames go, counted as dropped records."""

    def __init__(self, limit: int = RECORD_BUFFER) -> None:
        self.limit = limit
        self.frames: collections.OrderedDict[int, tuple[dict[str, Any], float]] = collections.OrderedDict()
        self.records = 0

    def keep(self, frame: dict[str, Any], sent_at: float) -> int:
        """Hold ``frame`` (sent at ``sent_at``); return how many records older frames dropped."""
        self.frames[frame["seq"]] = (frame, sent_at)
        self.records += len(frame["records"])
        dropped = 0
        while self.records > self.limit and len(self.frames) > 1:
            _, (old, _) = self.frames.popitem(last=False)
            self.records -= len(old["records"])
            dropped += len(old["records"])
        return dropped

    def on_ack(self, frame: dict[str, Any]) -> None:
        held = self.frames.pop(frame.get("seq"), None) if isinstance(frame.get("seq"), int) else None
        if held is not None:
            self.records -= len(held[0]["records"])

    def due_again(self) -> None:
        """A new session: every held frame is due at once."""
        for seq, (frame, _) in list(self.frames.items()):
            self.frames[seq] = (frame, float("-inf"))

    def due(self, now: float) -> list[dict[str, Any]]:
        """The held frames unanswered for ``STEPS_RESEND_S`` (marked sent again at ``now``)."""
        out = []
        for seq, (frame, sent_at) in list(self.frames.items()):
            if now - sent_at >= STEPS_RESEND_S:
                self.frames[seq] = (frame, now)
                out.append(frame)
        return out


class NodeAgent:
    """One node's agent: connection, heartbeats, command handling and the worker table."""

    def __init__(self, server: str, token: str, *, node: str = "", gpus: GpuInventory, runs_dir: Path,
                 simulated_workers: bool = False, time_scale: float = 1.0, heartbeat_s: float | None = None,
                 python: str = sys.executable, device: str = "auto", address: str = "",
                 log_cap_bytes: int | None = None) -> None:
        self.server = server.rstrip("/")
        self.token = token
        self.node = node
        self.gpus = gpus
        self.runs_dir = runs_dir
        self.simulated_workers = simulated_workers
        self.time_scale = time_scale
        self.heartbeat_s = heartbeat_s or 5.0
        self.python = python
        self.device = ("cuda" if gpus.nvml else "cpu") if device == "auto" else device
        self.address = address
        self.log_cap_bytes = log_cap_bytes
        self.shipper = _log_shipper()
        self.jobs: dict[str, TorchrunJob | SimulatedJob] = {}
        self.members: dict[str, list[int]] = {}
        self.applied: collections.OrderedDict[str, dict[str, Any] | None] = collections.OrderedDict()
        # The last ``exit`` frame of each job whose workers ended here, re-sent after every hello
        # (``report_exit``): nothing answers an exit, and one the socket took may never have been
        # applied.
        self.exits: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self.control_out: collections.deque[dict[str, Any]] = collections.deque()
        self.records_out: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECORD_BUFFER)
        self.dropped_records = 0
        self.steps_unacked = UnackedSteps()
        self.ws: Any = None
        self.seq = 0
        self.steps_seq = 0
        self._records_sent_at = 0.0
        # Identifies this agent process in telemetry batches: (boot, seq) de-duplicates replays.
        self.boot = f"{int(time.time()):x}{random.randrange(1 << 16):04x}"
        self.connected = asyncio.Event()
        self.stopping = False
        self.fatal: str | None = None

    # -- outgoing ------------------------------------------------------------------------------

    def queue_control(self, frame: dict[str, Any]) -> None:
        self.control_out.append(frame)

    def queue_records(self, job: str, records: list[dict[str, Any]]) -> None:
        for record in records:
            if len(self.records_out) == self.records_out.maxlen:
                self.dropped_records += 1  # the deque drops the oldest
            record = _finite(record)
            record.setdefault("at", agent_clock())
            self.records_out.append({"job": job, "record": record})

    async def _flush(self) -> None:
        """Send queued acks/outcomes at once; step records at most every RECORD_FLUSH_S, one
        frame per job (a fast trainer must not flood the socket ahead of heartbeats)."""
        ws = self.ws
        if ws is None:
            return
        while self.control_out:
            frame = self.control_out[0]
            await ws.send(protocol.dumps(frame))
            self.control_out.popleft()
        if self.shipper is not None:
            for frame in self.shipper.frames():
                await ws.send(protocol.dumps(frame))
        now = time.monotonic()
        for frame in self.steps_unacked.due(now):
            await ws.send(protocol.dumps(frame))
        if not self.records_out or (now - self._records_sent_at < RECORD_FLUSH_S
                                    and len(self.records_out) < protocol.MAX_RECORDS_PER_FRAME):
            return
        self._records_sent_at = now
        by_job: dict[str, list[dict[str, Any]]] = {}
        while self.records_out:
            item = self.records_out.popleft()
            by_job.setdefault(item["job"], []).append(item["record"])
        pending = list(by_job.items())
        while pending:
            job, records = pending[0]
            batch, rest = records[:200], records[200:]
            if rest:
                pending[0] = (job, rest)
            else:
                pending.pop(0)
            self.steps_seq += 1
            frame = {"type": protocol.STEPS, "job": job, "records": batch, "boot": self.boot, "seq": self.steps_seq,
                     "sent_at": agent_clock()}
            # Held before it is sent: a send that fails leaves it due after the next hello.
            self.dropped_records += self.steps_unacked.keep(frame, now)
            try:
                await ws.send(protocol.dumps(frame))
            except Exception:
                for other_job, other in reversed(pending):
                    for record in reversed(other):
                        self.records_out.appendleft({"job": other_job, "record": record})
                raise

    def _workers_report(self) -> list[dict[str, Any]]:
        out = []
        for name, job in self.jobs.items():
            h = job.handle
            checkpoint = job.newest_checkpoint() if h.leader and h.integration == "omni" else None
            out.append({"job": name, "state": h.state, "step": h.step, "checkpoint_step": checkpoint, "gpus": h.gpus,
                        "run_id": h.run_id, "leader": h.leader})
        for name, gpus in self.members.items():
            out.append({"job": name, "state": "member", "gpus": gpus})
        return out

    def _busy(self) -> dict[int, tuple[str, float]]:
        busy: dict[int, tuple[str, float]] = {}
        for name, job in self.jobs.items():
            for g in job.handle.gpus:
                busy[g] = (name, job.handle.utilisation())
        for name, gpus in self.members.items():
            for g in gpus:
                busy[g] = (name, 0.8)
        return busy

    def heartbeat_frame(self) -> dict[str, Any]:
        self.seq += 1
        frame = {"type": protocol.HEARTBEAT, "seq": self.seq, "boot": self.boot, "sent_at": agent_clock(),
                 "gpus": self.gpus.samples(self._busy()), "workers": self._workers_report(),
                 "dropped_records": self.dropped_records}
        disk = _runs_dir_usage(self.runs_dir)
        if disk:
            frame["disk"] = disk
        if self.shipper is not None:
            frame["log_backlog_bytes"] = self.shipper.pending_bytes()
        return frame

    # -- connection ------------------------------------------------------------------------------

    async def run(self) -> int:
        """Connect, serve, reconnect with backoff; return an exit code when told the token is bad."""
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed, InvalidHandshake

        tasks = [asyncio.create_task(self._supervise()), asyncio.create_task(self._heartbeats())]
        url = self.server.replace("http://", "ws://").replace("https://", "wss://") + protocol.AGENT_PATH
        headers = {"Authorization": f"Bearer {self.token}"}
        if self.node:
            headers["X-Omni-Node"] = self.node
        backoff = 0.2
        try:
            while not self.stopping:
                try:
                    async with connect(url, additional_headers=headers, open_timeout=5, ping_interval=10,
                                       ping_timeout=10, max_size=protocol.MAX_FRAME_BYTES) as ws:
                        await self._session(ws)
                        backoff = 0.2
                except ConnectionClosed as exc:
                    code = exc.rcvd.code if exc.rcvd is not None else None
                    if code in (protocol.CLOSE_MISSING_TOKEN, protocol.CLOSE_BAD_TOKEN):
                        self.fatal = f"server refused the token (close code {code}: {exc.rcvd.reason})"
                        logger.error("%s", self.fatal)
                        return 3
                    if code == protocol.CLOSE_REPLACED:
                        self.fatal = "another agent connected for this node; this one stops"
                        logger.error("%s", self.fatal)
                        return 4
                    logger.info("connection closed (%s); reconnecting", code)
                # InvalidHandshake: a refused upgrade (InvalidStatus), and also a server, or a proxy
                # in front of it, that closes the connection before answering (InvalidMessage,
                # what a daphne killed mid-handshake looks like): retry, never exit and take the
                # ranks down with the agent (found by bench.faults, kill9_asgi).
                except (TimeoutError, OSError, InvalidHandshake) as exc:
                    logger.info("cannot reach %s (%s); retrying in %.1fs", url, exc, backoff)
                finally:
                    self.ws = None
                    self.connected.clear()
                await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(5.0, backoff * 2)
        finally:
            for task in tasks:
                task.cancel()
        return 0

    async def _session(self, ws: Any) -> None:
        welcome = json.loads(await asyncio.wait_for(ws.recv(), timeout=10))
        if welcome.get("type") == protocol.ERROR:
            # The server closes right after; the close code tells run() why.
            await ws.recv()
        self.node = welcome.get("node", self.node)
        if self.simulated_workers and self.node:
            _note_simulated_node(self.runs_dir, self.node)
        if welcome.get("heartbeat_interval_s"):
            self.heartbeat_s = float(welcome["heartbeat_interval_s"])
        self.ws = ws
        if self.shipper is not None:
            self.shipper.on_disconnect()  # whatever the last session did not get acknowledged goes again
        self.steps_unacked.due_again()
        await ws.send(protocol.dumps({
            "type": protocol.HELLO, "protocol": protocol.PROTOCOL_VERSION, "node": self.node,
            "inventory": {"gpus": self.gpus.describe(), "hostname": socket.gethostname(),
                          "address": self.address or _local_address(ws)},
            "workers": self._workers_report(), "applied": list(self.applied)[-50:],
        }))
        await ws.send(protocol.dumps(self.heartbeat_frame()))
        self._resend_exits()
        self.connected.set()
        logger.info("connected to %s as %s", self.server, self.node)
        await self._flush()
        async for text in ws:
            try:
                frame = json.loads(text)
            except ValueError:
                continue
            if frame.get("type") == protocol.COMMAND:
                await self.on_command(frame)
            elif frame.get("type") == protocol.STEPS_ACK:
                self.steps_unacked.on_ack(frame)
            elif frame.get("type") == protocol.LOGS_ACK and self.shipper is not None:
                self.shipper.on_ack(frame)
            elif frame.get("type") == protocol.ERROR:
                logger.warning("server error: %s %s", frame.get("code"), frame.get("message"))
            await self._flush()

    async def _heartbeats(self) -> None:
        last = time.monotonic()
        while True:
            # Short naps: the interval may change when the server's welcome arrives.
            await asyncio.sleep(min(0.1, self.heartbeat_s / 4))
            if time.monotonic() - last < self.heartbeat_s:
                continue
            last = time.monotonic()
            frame = self.heartbeat_frame()
            if self.ws is not None:
                try:
                    await self.ws.send(protocol.dumps(frame))
                    await self._flush()
                except Exception:
                    logger.info("heartbeat over the socket failed; the session will reconnect")
            else:
                await asyncio.get_running_loop().run_in_executor(None, self._http_heartbeat, frame)

    def _http_heartbeat(self, frame: dict[str, Any]) -> None:
        """HTTP fallback while the socket is down: the node stays alive to the control plane."""
        request = urllib.request.Request(
            self.server + protocol.HTTP_HEARTBEAT_PATH, data=protocol.dumps(frame).encode(), method="POST",
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                response.read()
        except Exception:
            pass

    def report_exit(self, job: str, outcome: dict[str, Any]) -> None:
        """Queue the ``exit`` frame of workers that ended unasked, and keep it to send again.

        A frame the socket accepted is not a frame the server applied: if the consumer dies on
        it or on a frame before it (PostgreSQL restarting under it, daphne killed, the
        connection cut mid-frame), the exit is gone, and with it the only word that the job
        completed or failed. The agent reconnects and lists the launch as applied, so the
        server waits for an exit that never comes and the job stays ``running`` with no step
        (bench.faults found it, docs/faults.md). So each job's last exit goes again after every
        hello; the server applies one once (an older run's, or a job no longer running here,
        changes nothing)."""
        frame = {"type": protocol.EXIT, "job": job, "outcome": outcome}
        self.exits[job] = frame
        self.exits.move_to_end(job)
        while len(self.exits) > EXIT_MEMORY:
            self.exits.popitem(last=False)
        self.queue_control(frame)

    def _resend_exits(self) -> None:
        """After a hello: every kept exit frame not still waiting to be sent goes again."""
        for frame in self.exits.values():
            if all(queued is not frame for queued in self.control_out):
                self.queue_control(frame)

    # -- commands -------------------------------------------------------------------------------

    def _remember(self, command_id: str, done: dict[str, Any] | None) -> None:
        self.applied[command_id] = done
        self.applied.move_to_end(command_id)
        while len(self.applied) > APPLIED_MEMORY:
            self.applied.popitem(last=False)

    def _done(self, command_id: str, ok: bool, **outcome: Any) -> None:
        frame = {"type": protocol.DONE, "command": command_id, "ok": ok, "outcome": outcome}
        self._remember(command_id, frame)
        self.queue_control(frame)

    async def on_command(self, frame: dict[str, Any]) -> None:
        command_id = str(frame.get("id"))
        self.queue_control({"type": protocol.ACK, "command": command_id})
        if command_id in self.applied:
            done = self.applied[command_id]
            logger.info("duplicate command %s ignored (re-acked%s)", command_id, ", outcome re-sent" if done else "")
            if done is not None:
                self.queue_control(done)  # the server missed our answer: send it again
            return
        self._remember(command_id, None)
        kind = frame.get("kind")
        payload = frame.get("payload") or {}
        job = frame.get("job") or payload.get("job")
        logger.info("applying command %s on %s: %s %s (attempt %s)", command_id, self.node, kind, job,
                    frame.get("attempt"))
        try:
            if kind == "clean":
                self._clean(command_id, job)
            elif self._simulates(payload) and not payload.get("leader", True):
                await self._member(command_id, kind, job, payload)
            elif kind in ("start", "resume"):
                await self._start(command_id, job, payload)
            elif kind in ("preempt", "resize", "stop"):
                await self._stop(command_id, kind, job, payload, frame.get("deadline"))
            else:
                self._done(command_id, False, error=f"unknown command kind {kind!r}")
        except Exception as exc:  # an agent bug must not leave the command unanswered
            logger.exception("command %s failed", command_id)
            self._done(command_id, False, error=f"{type(exc).__name__}: {exc}")

    async def _member(self, command_id: str, kind: str, job: str, payload: dict[str, Any]) -> None:
        """Simulated workers: another node leads the job and plays all of it; only track which of
        our GPUs it uses."""
        if kind in ("start", "resume", "resize") and payload.get("gpus"):
            self.members[job] = list(payload["gpus"])
        else:
            self.members.pop(job, None)
        current = self.jobs.get(job)
        if current is not None and (kind in ("preempt", "resize", "stop")
                                    or current.payload.get("run_id") != payload.get("run_id")):
            # Workers this node played when it led the job: the leader elsewhere plays all of it
            # now, so they must not play on beside it (and keep the job's slot here "running").
            current.signal(signal.SIGKILL)
        self._done(command_id, True)

    def _clean(self, command_id: str, job: str) -> None:
        """Remove a finished job's run dir (the control plane asks after the retention period)."""
        worker = self.jobs.get(job)
        if worker is not None and worker.alive():
            self._done(command_id, False, error=f"{job} still has live ranks on {self.node}; not removed")
            return
        from trainer_agent.housekeeping import remove_run_dir

        self._done(command_id, True, **remove_run_dir(self.runs_dir, job))

    async def _start(self, command_id: str, job: str, payload: dict[str, Any]) -> None:
        current = self.jobs.get(job)
        if isinstance(current, SimulatedJob) and current.killed:
            # Killed a moment ago by a fencing stop that came just before this launch (both in
            # one replay): its task ends at the loop's next turn. Let it end and answer for it
            # first, or this launch would be answered "already running" with nothing running.
            deadline = time.monotonic() + 5.0
            while current.alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if self.jobs.get(job) is current and not current.alive():
                await self._on_exit(job, current)
            current = self.jobs.get(job)
        if current is not None and current.alive():
            old_run, new_run = current.payload.get("run_id"), payload.get("run_id")
            # A simulated run launched without a run id (an older server) is taken for this one.
            same_run = old_run == new_run or (isinstance(current, SimulatedJob) and not (old_run and new_run))
            if same_run:
                self._done(command_id, True, step=current.handle.step, outcome="already running")
                return
            # A new run while ranks of an old one live on here: they must not meet the new world.
            logger.warning("%s: ranks of run %s still alive; killing them before run %s", job,
                           current.payload.get("run_id"), payload.get("run_id"))
            await self._kill_and_wait(current)
        busy = _rendezvous_port_taken(payload, self.node)
        if busy:
            # Taken outside Omni (the control plane never gives two live jobs one port): the
            # launch fails, the job recovers, and the next launch draws another port.
            self._done(command_id, False, error=busy, run_id=payload.get("run_id"))
            return
        started = time.perf_counter()
        handle = await self._launch(job, payload)
        # A signal job's checkpoints are its own: Omni reports none.
        resumed = handle.resume_step if handle.integration == "omni" else None
        self._done(command_id, True, checkpoint_step=resumed, step=resumed,
                   load_s=round(time.perf_counter() - started, 4), outcome="launched",
                   run_id=payload.get("run_id"))

    async def _kill_and_wait(self, worker: TorchrunJob | SimulatedJob, timeout_s: float = 10.0) -> None:
        worker.signal(signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while worker.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if isinstance(worker, TorchrunJob):
            self.shipper_finish(worker)
        self.jobs.pop(worker.handle.job, None)

    async def _stop(self, command_id: str, kind: str, job: str, payload: dict[str, Any], deadline: float | None) -> None:
        worker = self.jobs.get(job)
        self.members.pop(job, None)
        if worker is None or not worker.alive():
            step = worker.newest_checkpoint() if worker is not None else None
            if step is None:
                step = newest_checkpoint_on_disk(self.runs_dir / launch.safe_name(job))
            if kind == "resize" and payload.get("relaunch") and isinstance(worker, SimulatedJob):
                await self._relaunch(command_id, job, payload, step)
            else:
                self.jobs.pop(job, None)
                self._done(command_id, True, checkpoint_step=step, save_s=0.0, outcome="not running")
            return
        h = worker.handle
        h.state = "stopping"
        h.stop_command = command_id
        h.stop_kind = kind
        h.stop_payload = payload
        h.term_at = time.time()
        if kind == "stop" and payload.get("kill"):
            worker.signal(signal.SIGKILL)
            h.killed = True
            return
        # SIGTERM to every rank: an ``omni`` rank finishes its step and checkpoints (the ranks
        # agree on the step); a ``signal`` rank does whatever its script does, within grace_s.
        worker.ask_stop()
        worker.signal(signal.SIGTERM)
        if h.integration == "signal" or kind == "stop":
            h.stop_deadline = h.term_at + h.grace_s
        else:
            h.stop_deadline = (deadline + 1.0) if deadline else None

    async def _relaunch(self, command_id: str, job: str, payload: dict[str, Any], step: int) -> None:
        dp = int(payload.get("dp_after") or payload.get("dp"))
        await self._launch(job, {**payload, "dp": dp})
        self._done(command_id, True, checkpoint_step=step, outcome="relaunched", dp=dp)

    async def _launch(self, job: str, payload: dict[str, Any]) -> WorkerHandle:
        workload = payload.get("workload") or {}
        handle = WorkerHandle(job=job, gpus=list(payload.get("gpus", [])), leader=bool(payload.get("leader", True)),
                              run_id=str(payload.get("run_id") or ""),
                              integration=str(workload.get("integration") or "omni"),
                              grace_s=float(workload.get("grace_s") or 30.0))
        run_dir = self.runs_dir / launch.safe_name(job)
        self.exits.pop(job, None)  # a new run: the last one's exit is history
        worker: TorchrunJob | SimulatedJob
        if self._simulates(payload) or (_runs_reference(payload) and (
                resumes_simulated(run_dir) or _spans_simulated_node(self.runs_dir, payload))):
            # A reference job whose newest checkpoint was saved by simulated workers has no state
            # a real trainer could load: it stays simulated here too rather than silently going
            # back to an older real checkpoint or step 0. And one that spans a node playing its
            # workers would wait for ever for that node's ranks at the rendezvous: the leader
            # here plays all of it instead (test beds only: production never simulates). A
            # researcher's own script is never played, so it runs for real on every node it
            # holds, simulated ones included, and its ranks meet at the rendezvous.
            worker = SimulatedJob(handle, run_dir, payload, self.time_scale)
        else:
            worker = TorchrunJob(handle, self.runs_dir, payload, self.python, self.node, self.device,
                                 log_cap_bytes=self.log_cap_bytes)
        self.jobs[job] = worker
        await worker.launch(int(payload["dp"]))
        if isinstance(worker, TorchrunJob) and self.shipper is not None:
            self.shipper.watch(job, handle.run_id, worker.paths.log_dir)
        return handle

    def _simulates(self, payload: dict[str, Any]) -> bool:
        """Whether this agent plays the job without torch: with ``--simulated-workers``, the
        reference workload is simulated; a researcher's own script cannot be, and runs for real."""
        if "placement" not in payload:
            return True
        return self.simulated_workers and _runs_reference(payload)

    def shipper_finish(self, worker: TorchrunJob) -> None:
        if self.shipper is not None:
            self.shipper.finish(worker.handle.job, worker.handle.run_id)

    # -- supervising the workers ------------------------------------------------------------------

    async def _supervise(self) -> None:
        """Forward new step records, notice exits, enforce stop deadlines and grace periods."""
        while True:
            await asyncio.sleep(0.2)
            for name, worker in list(self.jobs.items()):
                records = worker.read_new_records()
                h = worker.handle
                if records:
                    h.step = max(r["step"] for r in records)
                    h.last_record = records[-1]
                    self.queue_records(name, records)
                if h.state == "starting" and (records or (isinstance(worker, TorchrunJob) and worker.running_ranks())):
                    h.state = "running"
                if h.state == "stopping" and worker.alive():
                    if h.stop_deadline is not None and time.time() > h.stop_deadline:
                        logger.warning("%s: ranks still alive %.1fs after SIGTERM; SIGKILL", name, time.time() - h.term_at)
                        worker.signal(signal.SIGKILL)
                        h.killed = True
                        h.stop_deadline = None
                    elif not h.killed:
                        worker.signal(signal.SIGTERM)  # ranks that registered after the first SIGTERM
                if isinstance(worker, TorchrunJob) and worker.proc is not None and worker.proc.returncode is not None:
                    if worker.live_pids():
                        # torchrun is gone but a rank is not (it ignored torchrun's stop): no rank
                        # outlives its node's torchrun.
                        worker.signal(signal.SIGKILL)
                        continue
                    await self._on_exit(name, worker)
                elif isinstance(worker, SimulatedJob) and worker.task is not None and worker.task.done():
                    await self._on_exit(name, worker)
            if self.ws is not None:
                try:
                    await self._flush()
                except Exception:
                    pass

    async def _on_exit(self, name: str, worker: TorchrunJob | SimulatedJob) -> None:
        """The workers have exited: answer the stop they were asked for, or report the exit."""
        if self.jobs.get(name) is not worker:
            return  # answered already (``_start`` reaps a killed worker before a new launch)
        records = worker.read_new_records()
        if records:
            self.queue_records(name, records)
        h = worker.handle
        del self.jobs[name]
        if isinstance(worker, TorchrunJob):
            self.shipper_finish(worker)
        if h.stop_command is None:
            outcome = worker.exit_report()
            if outcome is not None:
                self.report_exit(name, outcome)
        elif isinstance(worker, SimulatedJob) and worker.relaunches():
            await self._relaunch(h.stop_command, name, h.stop_payload or {}, worker.newest_checkpoint())
        else:
            ok, outcome = worker.stop_report()
            self._done(h.stop_command, ok, **outcome)

    def shutdown(self) -> None:
        """A stopping agent asks its ranks to checkpoint and exit (SIGTERM); ``drain`` waits."""
        self.stopping = True
        for worker in self.jobs.values():
            worker.handle.term_at = worker.handle.term_at or time.time()
            worker.signal(signal.SIGTERM)

    async def drain(self, timeout_s: float) -> None:
        """After ``shutdown``: wait up to ``timeout_s`` for the ranks, then kill what is left, so
        no rank outlives its agent."""
        deadline = time.monotonic() + timeout_s
        while any(w.alive() for w in self.jobs.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for worker in self.jobs.values():
            if worker.alive():
                worker.signal(signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while any(w.alive() for w in self.jobs.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


SIMULATED_NODES_DIR = ".simulated-nodes"  # under the shared runs dir: one empty file per node


def _note_simulated_node(runs_dir: Path, node: str) -> None:
    """Say, on the shared runs dir, that this node plays its workers (``--simulated-workers``)."""
    try:
        (runs_dir / SIMULATED_NODES_DIR).mkdir(parents=True, exist_ok=True)
        (runs_dir / SIMULATED_NODES_DIR / launch.safe_name(node)).touch()
    except OSError:
        pass


def _runs_reference(payload: dict[str, Any]) -> bool:
    """Whether the job runs the reference trainer (the workload simulated agents can play)."""
    entrypoint = list((payload.get("workload") or {}).get("entrypoint") or launch.REFERENCE_ENTRYPOINT)
    return entrypoint[:2] == list(launch.REFERENCE_ENTRYPOINT)


def _spans_simulated_node(runs_dir: Path, payload: dict[str, Any]) -> bool:
    """Whether a node of the job's placement plays its workers (``_note_simulated_node``)."""
    return any((runs_dir / SIMULATED_NODES_DIR / launch.safe_name(str(entry.get("node")))).exists()
               for entry in payload.get("placement") or [] if entry.get("gpus"))


def _rendezvous_port_taken(payload: dict[str, Any], node: str) -> str:
    """On the leader, whether the run's rendezvous port can be bound: a reason when not."""
    rdzv = payload.get("rdzv")
    placement = payload.get("placement") or []
    if not rdzv or not placement or placement[0].get("node") != node:
        return ""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("", int(rdzv["port"])))
    except OSError as exc:
        return f"rendezvous port {rdzv['port']} is in use on {node} ({exc.strerror}); the job recovers on another port"
    finally:
        probe.close()
    return ""


def _log_shipper() -> Any:
    try:
        from trainer_agent.logship import LogShipper
    except ImportError:  # pragma: no cover - the module ships with the agent
        return None
    return LogShipper()


def _runs_dir_usage(runs_dir: Path) -> dict[str, int] | None:
    try:
        from trainer_agent.housekeeping import runs_dir_usage

        return runs_dir_usage(runs_dir)
    except (ImportError, OSError):
        return None


def _local_address(ws: Any) -> str:
    """The address this node reaches the control plane from: where other nodes reach it too."""
    try:
        return str(ws.local_address[0])
    except Exception:
        return socket.gethostbyname(socket.gethostname())


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in record.items():
        out[key] = None if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))) else value
    return out


# -- command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer_agent.node", description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True, help="control plane base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--token", help="this node's agent token (manage.py issue_agent_token NODE)")
    p.add_argument("--token-file", help="read the token from this file instead")
    p.add_argument("--node", default="", help="node name (checked against the token)")
    p.add_argument("--simulate-gpus", type=int, default=None, help="report N simulated GPUs instead of NVML")
    p.add_argument("--runs-dir", default=os.environ.get("OMNI_RUNS_DIR", "var/runs"),
                   help="shared storage for run dirs (checkpoints, metrics); every node must see the same one")
    p.add_argument("--simulated-workers", action="store_true", help="play the training workers without torch")
    p.add_argument("--time-scale", type=float, default=1.0, help="simulated step time multiplier")
    p.add_argument("--trainer-device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="device for real trainers; auto: cuda when NVML reports GPUs")
    p.add_argument("--python", default=sys.executable,
                   help="the Python that runs jobs' .py and -m entrypoints (default: this agent's)")
    p.add_argument("--address", default=os.environ.get("OMNI_NODE_ADDRESS", ""),
                   help="address other nodes reach this one at, for rendezvous (default: the one facing the server)")
    p.add_argument("--log-cap-bytes", type=int, default=64 << 20, help="size cap of each rank's stdout/stderr file")
    p.add_argument("--virtual-nodes", help="JSON file [{node, token, gpus}]: run all as simulated nodes here")
    p.add_argument("--log-level", default="INFO")
    return p


async def _main_async(args: argparse.Namespace) -> int:
    runs_dir = Path(args.runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    if args.virtual_nodes:
        spec = json.loads(Path(args.virtual_nodes).read_text())
        agents = [
            NodeAgent(args.server, entry["token"], node=entry["node"], gpus=GpuInventory(int(entry.get("gpus", 8))),
                      runs_dir=runs_dir, simulated_workers=True, time_scale=args.time_scale)
            for entry in spec
        ]
        results = await asyncio.gather(*(a.run() for a in agents))
        return max(results or [0])
    token = args.token
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
    if not token:
        print("node: error: --token or --token-file is required", file=sys.stderr)
        return 2
    agent = NodeAgent(args.server, token, node=args.node, gpus=GpuInventory(args.simulate_gpus), runs_dir=runs_dir,
                      simulated_workers=args.simulated_workers, time_scale=args.time_scale,
                      device=args.trainer_device, python=args.python, address=args.address,
                      log_cap_bytes=args.log_cap_bytes)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    runner = asyncio.create_task(agent.run())
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({runner, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if runner in done:
        return runner.result()
    agent.shutdown()
    # Ranks get their grace to checkpoint and exit (the agent keeps reporting meanwhile); none
    # outlives the agent.
    await agent.drain(max([w.handle.grace_s for w in agent.jobs.values()] + [10.0]))
    runner.cancel()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s node %(message)s")
    return asyncio.run(_main_async(args))


if __name__ == "__main__":
    sys.exit(main())

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
are forwarded as they appear; while the server is away the workers keep running and records
wait in a bounded buffer (oldest dropped, counted). ``--virtual-nodes`` runs many simulated
nodes in one process, speaking the same protocol, with no torch at all.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer_agent import launch, protocol
from trainer_agent.checkpoint import CheckpointStore

logger = logging.getLogger("trainer_agent.node")

RECORD_BUFFER = 2000
RECORD_FLUSH_S = 1.0
APPLIED_MEMORY = 4096
SIM_CHECKPOINT = "sim-checkpoint.json"


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
        now = time.time()
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


# -- workers -----------------------------------------------------------------------------------


@dataclass
class WorkerHandle:
    """What one job's workers on this node are doing, for heartbeats and GPU samples."""

    job: str
    gpus: list[int]
    leader: bool
    state: str = "starting"  # starting | running | stopping | exited
    step: int = 0
    resume_step: int = 0
    last_record: dict[str, Any] = field(default_factory=dict)
    run_id: str = ""
    integration: str = "omni"  # omni | signal (docs/workloads.md)
    grace_s: float = 30.0
    stop_command: str | None = None
    stop_kind: str | None = None
    stop_payload: dict[str, Any] | None = None
    stop_deadline: float | None = None
    term_at: float | None = None  # when SIGTERM was first sent
    killed: bool = False
    exit_outcome: dict[str, Any] | None = None

    def utilisation(self) -> float:
        """Simulated GPU utilisation from the last step: compute share, low while saving/starting."""
        if self.state == "running" and not self.last_record and self.integration == "signal":
            return max(0.0, min(1.0, 0.85 + random.uniform(-0.03, 0.03)))  # no step records: nominal
        if self.state != "running" or not self.last_record:
            return 0.05 if self.state in ("starting", "stopping") else 0.0
        step_s = float(self.last_record.get("step_s") or 0.0)
        compute_s = float(self.last_record.get("compute_s") or 0.0)
        if step_s <= 0:
            return 0.5
        return max(0.0, min(1.0, 0.97 * compute_s / step_s + random.uniform(-0.02, 0.02)))


class TorchrunJob:
    """This node's share of one run of a job: its torchrun, the ranks it started (found through
    the rank wrapper's registry, trainer_agent/rank.py), their logs and their exit records."""

    def __init__(self, handle: WorkerHandle, runs_dir: Path, payload: dict[str, Any], python: str, node: str,
                 device: str = "cpu", log_cap_bytes: int | None = None) -> None:
        self.handle = handle
        self.payload = payload
        self.python = python
        self.node = node
        self.device = device
        self.log_cap_bytes = log_cap_bytes
        self.paths = launch.RunPaths.of(runs_dir, payload["job"], payload["run_id"], node)
        self.run_dir = self.paths.run_dir
        self.proc: asyncio.subprocess.Process | None = None
        self.signalled: dict[int, int] = {}  # rank wrapper pid -> last signal sent
        self.exited_at: float | None = None
        self._offset = 0
        self._inode: int | None = None

    @property
    def integration(self) -> str:
        return str(self.payload["workload"].get("integration", "omni"))

    def newest_checkpoint(self) -> int:
        """The newest complete checkpoint step of an ``omni`` job's run dir (0 when none)."""
        steps = CheckpointStore(self.paths.checkpoint_dir).complete_steps()
        return steps[-1] if steps else 0

    async def launch(self, dp: int) -> None:
        paths = self.paths
        for directory in (paths.run_dir, paths.checkpoint_dir, paths.log_dir, paths.state_dir):
            directory.mkdir(parents=True, exist_ok=True)
        if self.handle.leader:
            (paths.run_dir / "exit.json").unlink(missing_ok=True)
        env = launch.rank_env(self.payload, self.node, paths, dict(os.environ), device=self.device,
                              log_cap_bytes=self.log_cap_bytes)
        argv = launch.torchrun_argv(self.payload, self.node, self.python)
        workdir = self.payload["workload"].get("workdir") or str(paths.run_dir)
        self.handle.resume_step = self.newest_checkpoint() if self.integration == "omni" else 0
        self.handle.step = self.handle.resume_step
        self.handle.state = "starting"
        log = open(paths.log_dir / "torchrun.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            # Own process group, and death with the agent: a dead agent stands for a dead node,
            # whose ranks must not write on (each rank wrapper dies with torchrun in turn).
            self.proc = await asyncio.create_subprocess_exec(
                *argv, cwd=workdir, stdout=log, stderr=log, env=env, stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_agent,
            )
        finally:
            log.close()
        self._offset, self._inode = 0, None

    # -- the ranks ---------------------------------------------------------------------------

    def ranks(self) -> list[dict[str, Any]]:
        """The ranks of this run on this node that have registered (rank, pid, child...)."""
        out = []
        for path in sorted(self.paths.state_dir.glob("rank-*.json")):
            if path.name.endswith(".exit.json"):
                continue
            try:
                entry = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(entry, dict) and isinstance(entry.get("pid"), int):
                out.append(entry)
        return out

    def live_pids(self) -> list[int]:
        """Rank wrappers and their children still alive (each wrapper leads its process group)."""
        pids = []
        for entry in self.ranks():
            for pid in (entry.get("pid"), entry.get("child")):
                if isinstance(pid, int) and _pid_alive(pid):
                    pids.append(pid)
        return pids

    def signal(self, signum: int) -> None:
        """SIGTERM/SIGUSR1: to every rank (its wrapper passes it on); SIGKILL: every rank's whole
        process group and torchrun's."""
        if signum == signal.SIGKILL:
            for entry in self.ranks():
                _killpg(entry.get("pid"), signal.SIGKILL)
                _kill(entry.get("child"), signal.SIGKILL)
            if self.proc is not None and self.proc.returncode is None:
                _killpg(self.proc.pid, signal.SIGKILL)
            return
        for entry in self.ranks():
            pid = entry.get("pid")
            if isinstance(pid, int) and self.signalled.get(pid) != signum:
                self.signalled[pid] = signum
                _kill(pid, signum)

    def alive(self) -> bool:
        if self.proc is not None and self.proc.returncode is None:
            return True
        return bool(self.live_pids())

    def running_ranks(self) -> int:
        return sum(1 for entry in self.ranks() if _pid_alive(entry.get("child")))

    # -- what the run reports ----------------------------------------------------------------

    def read_new_records(self) -> list[dict[str, Any]]:
        """Step records appended to metrics.jsonl since the last call (the leader forwards them;
        the file may be rewritten when a run resumes)."""
        if not self.handle.leader:
            return []
        path = self.run_dir / "metrics.jsonl"
        try:
            stat = path.stat()
        except FileNotFoundError:
            return []
        if self._inode != stat.st_ino or stat.st_size < self._offset:
            self._inode, self._offset = stat.st_ino, 0
        if stat.st_size == self._offset:
            return []
        with path.open("rb") as fh:
            fh.seek(self._offset)
            chunk = fh.read()
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        self._offset += end + 1
        out = []
        for line in chunk[: end + 1].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > self.handle.step:
                out.append(record)
        return out

    def exit_info(self) -> dict[str, Any]:
        """An ``omni`` run's outcome (exit.json, written by rank 0 on shared storage)."""
        try:
            return json.loads((self.run_dir / "exit.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def returncode(self) -> int:
        return self.proc.returncode if self.proc is not None and self.proc.returncode is not None else 0

    def failure(self) -> dict[str, Any]:
        """The first rank on this node that exited non-zero: rank, code, signal, the last lines
        of its log. Falls back to torchrun's own log when no rank got that far."""
        exits = []
        for path in self.paths.state_dir.glob("rank-*.exit.json"):
            try:
                entry = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(entry, dict) and entry.get("code"):
                exits.append(entry)
        if exits:
            first = min(exits, key=lambda e: float(e.get("at") or 0.0))
            rank = int(first.get("rank", -1))
            tail = _tail(self.paths.log_dir / f"rank-{rank}.err") or _tail(self.paths.log_dir / f"rank-{rank}.out")
            return {"rank": rank, "code": first.get("code"), "signal": first.get("signal"), "at": first.get("at"),
                    "tail": tail}
        return {"rank": None, "code": self.returncode(), "signal": None, "at": time.time(),
                "tail": _tail(self.paths.log_dir / "torchrun.log")}


class SimulatedJob:
    """A job's workers played without torch: steps on a timer, checkpoints in a small JSON file
    in the shared run dir, so a job recovered on another (virtual) node resumes from it."""

    def __init__(self, handle: WorkerHandle, run_dir: Path, payload: dict[str, Any], time_scale: float) -> None:
        self.handle = handle
        self.run_dir = run_dir
        self.payload = payload
        self.time_scale = time_scale
        self.task: asyncio.Task | None = None
        self.records: list[dict[str, Any]] = []
        self.stop_requested = False
        self.killed = False

    def newest_checkpoint(self) -> int:
        # A real trainer's checkpoints count too: a job may move between real and simulated nodes.
        return _newest_checkpoint_on_disk(self.run_dir)

    def _save(self, step: int) -> float:
        started = time.perf_counter()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.run_dir / f".{SIM_CHECKPOINT}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"step": step, "dp": self.payload.get("dp")}))
        os.replace(tmp, self.run_dir / SIM_CHECKPOINT)
        return time.perf_counter() - started

    async def launch(self, dp: int) -> None:
        self.handle.resume_step = self.newest_checkpoint()
        self.handle.step = self.handle.resume_step
        self.handle.state = "starting"
        self.stop_requested = False
        self.task = asyncio.create_task(self._run(dp))

    async def _run(self, dp: int) -> None:
        p = self.payload
        step_s = max(0.05, float(p.get("step_s", 1.0)) * self.time_scale)
        every = max(1, int(p.get("checkpoint_every", 50)))
        total = int(p["total_steps"])
        await asyncio.sleep(min(1.0, step_s))  # start-up and checkpoint load
        self.handle.state = "running"
        step = self.handle.step
        save_s = 0.0
        while step < total:
            started = time.perf_counter()
            await asyncio.sleep(step_s * random.uniform(0.97, 1.03))
            step += 1
            took = time.perf_counter() - started
            record = {"format": "omni-step/1", "step": step, "step_s": took, "compute_s": took * 0.85,
                      "data_wait_s": took * 0.05, "comm_s": took * 0.1, "dp": dp,
                      "accum": p.get("accum"), "global_batch": p.get("global_batch"),
                      "tokens": {"image": 300 * dp, "video": 40 * dp, "text": 150 * dp}, "simulated": True,
                      "loss": 4.0 / (1.0 + 0.01 * step)}
            self.handle.step = step
            self.handle.last_record = record
            self.records.append(record)
            if self.stop_requested or step % every == 0:
                save_s = self._save(step)
            if self.stop_requested:
                self.handle.exit_outcome = {"outcome": "preempted", "step": step, "save_s": save_s}
                return
        save_s = self._save(step)
        self.handle.exit_outcome = {"outcome": "completed", "step": step, "save_s": save_s}

    def signal(self, signum: int) -> None:
        if signum == signal.SIGKILL:
            self.killed = True
            if self.task is not None:
                self.task.cancel()
        else:
            self.stop_requested = True

    def alive(self) -> bool:
        return self.task is not None and not self.task.done()

    def read_new_records(self) -> list[dict[str, Any]]:
        out, self.records = self.records, []
        return out

    def exit_info(self) -> dict[str, Any]:
        return self.handle.exit_outcome or {}


# -- the agent -----------------------------------------------------------------------------------


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
        self.control_out: collections.deque[dict[str, Any]] = collections.deque()
        self.records_out: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECORD_BUFFER)
        self.dropped_records = 0
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
            record.setdefault("at", time.time())
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
            self.steps_seq += 1
            frame = {"type": protocol.STEPS, "job": job, "records": batch, "boot": self.boot, "seq": self.steps_seq,
                     "sent_at": time.time()}
            try:
                await ws.send(protocol.dumps(frame))
            except Exception:
                for other_job, other in reversed(pending):
                    for record in reversed(other):
                        self.records_out.appendleft({"job": other_job, "record": record})
                raise
            if rest:
                pending[0] = (job, rest)
            else:
                pending.pop(0)

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
        frame = {"type": protocol.HEARTBEAT, "seq": self.seq, "boot": self.boot, "sent_at": time.time(),
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
        from websockets.exceptions import ConnectionClosed, InvalidStatus

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
                except (TimeoutError, OSError, InvalidStatus) as exc:
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
        if welcome.get("heartbeat_interval_s"):
            self.heartbeat_s = float(welcome["heartbeat_interval_s"])
        self.ws = ws
        if self.shipper is not None:
            self.shipper.on_disconnect()  # whatever the last session did not get acknowledged goes again
        await ws.send(protocol.dumps({
            "type": protocol.HELLO, "protocol": protocol.PROTOCOL_VERSION, "node": self.node,
            "inventory": {"gpus": self.gpus.describe(), "hostname": socket.gethostname(),
                          "address": self.address or _local_address(ws)},
            "workers": self._workers_report(), "applied": list(self.applied)[-50:],
        }))
        await ws.send(protocol.dumps(self.heartbeat_frame()))
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
            elif frame.get("type") == getattr(protocol, "LOGS_ACK", "logs_ack") and self.shipper is not None:
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
        if kind == "stop" and job in self.jobs:
            self.jobs[job].signal(signal.SIGKILL)
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
        if current is not None and current.alive():
            same_run = isinstance(current, SimulatedJob) or current.payload.get("run_id") == payload.get("run_id")
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
                step = _newest_checkpoint_on_disk(self.runs_dir / _safe(job))
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
        run_dir = self.runs_dir / _safe(job)
        worker: TorchrunJob | SimulatedJob
        if self._simulates(payload) or _has_only_simulated_history(run_dir):
            # A job that so far ran on simulated nodes has no state a real trainer could load:
            # it stays simulated here too rather than silently restarting from step 0.
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
        entrypoint = list((payload.get("workload") or {}).get("entrypoint") or launch.REFERENCE_ENTRYPOINT)
        return self.simulated_workers and entrypoint[:2] == list(launch.REFERENCE_ENTRYPOINT)

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
        records = worker.read_new_records()
        if records:
            self.queue_records(name, records)
        h = worker.handle
        del self.jobs[name]
        if isinstance(worker, SimulatedJob):
            await self._simulated_exit(name, worker)
            return
        self.shipper_finish(worker)
        returncode = worker.returncode()
        omni = h.integration == "omni"
        info = worker.exit_info() if omni and h.leader else {}
        checkpoint_step = worker.newest_checkpoint() if omni else None
        facts: dict[str, Any] = {"run_id": h.run_id, "code": returncode, "leader": h.leader}
        if h.stop_command is not None:
            exit_s = round(time.time() - h.term_at, 3) if h.term_at else None
            facts.update(checkpoint_step=checkpoint_step, save_s=info.get("save_s"), step=info.get("step"),
                         exit_s=exit_s, grace_s=h.grace_s, killed=h.killed)
            if h.killed:
                facts["outcome"] = "killed"
                facts["error"] = (f"ranks did not exit within grace_s {h.grace_s:g} s of SIGTERM; killed"
                                  if not omni else f"ranks did not checkpoint by the deadline; killed after {exit_s} s")
            elif omni:
                facts["outcome"] = info.get("outcome") or f"exit {returncode}"
            else:
                facts["outcome"] = "exited" if returncode == 0 else f"exit {returncode}"
            if h.stop_kind == "stop":
                ok = True
            elif omni and h.leader:
                ok = returncode == 0 and info.get("outcome") in ("preempted", "completed", "resize")
            elif omni:
                ok = returncode == 0 and not h.killed
            else:
                # Signal mode: whatever the script does with SIGTERM (save and exit 0, or die of
                # it), leaving within grace is a graceful stop; only the SIGKILL is not.
                ok = not h.killed
            if not ok and "error" not in facts:
                failure = worker.failure()
                facts["error"] = f"ranks exited with code {returncode} before a checkpoint: {failure.get('tail', '')[-300:]}"
            self._done(h.stop_command, ok, **facts)
            return
        if returncode == 0:
            outcome = "completed"
            if omni and h.leader and info.get("outcome") == "preempted":
                outcome = "stopped"  # a signal from outside Omni stopped it at a checkpoint
            self.queue_control({"type": protocol.EXIT, "job": name,
                                "outcome": {**facts, "outcome": outcome, "step": info.get("step"),
                                            "checkpoint_step": checkpoint_step}})
            return
        failure = worker.failure()
        self.queue_control({"type": protocol.EXIT, "job": name, "outcome": {
            **facts, "outcome": "failed", "code": failure.get("code") or returncode, "rank": failure.get("rank"),
            "signal": failure.get("signal"), "at": failure.get("at"), "error": failure.get("tail") or f"exit code {returncode}",
            "checkpoint_step": checkpoint_step,
        }})

    async def _simulated_exit(self, name: str, worker: SimulatedJob) -> None:
        h = worker.handle
        info = worker.exit_info() if not worker.killed else {}
        checkpoint_step = worker.newest_checkpoint()
        if h.stop_command is not None:
            outcome = {"checkpoint_step": checkpoint_step, "save_s": info.get("save_s"), "step": info.get("step"),
                       "outcome": info.get("outcome") or "killed"}
            if h.stop_kind == "resize" and (h.stop_payload or {}).get("relaunch") and info:
                await self._relaunch(h.stop_command, name, h.stop_payload or {}, checkpoint_step)
                return
            saved = info.get("outcome") in ("preempted", "completed")
            if h.stop_kind == "stop" or saved:
                self._done(h.stop_command, True, **outcome)
            else:
                self._done(h.stop_command, False, error="workers exited without a checkpoint", **outcome)
            return
        if info.get("outcome") == "completed":
            self.queue_control({"type": protocol.EXIT, "job": name,
                                "outcome": {"outcome": "completed", "step": info.get("step"), "leader": True,
                                            "checkpoint_step": checkpoint_step}})

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


def _die_with_agent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in record.items():
        out[key] = None if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))) else value
    return out


_safe = launch.safe_name


def _newest_checkpoint_on_disk(run_dir: Path) -> int:
    best = 0
    try:
        best = int(json.loads((run_dir / SIM_CHECKPOINT).read_text())["step"])
    except (OSError, ValueError, KeyError):
        pass
    steps = CheckpointStore(run_dir / "checkpoints").complete_steps()
    return max(best, steps[-1] if steps else 0)


def _has_only_simulated_history(run_dir: Path) -> bool:
    directory = run_dir / "checkpoints"
    real = directory.is_dir() and any((e / "manifest.json").exists() for e in directory.iterdir())
    return (run_dir / SIM_CHECKPOINT).exists() and not real


def _tail(path: Path, limit: int = 4000, lines: int = 40) -> str:
    """The last lines of a log file (at most ``lines`` lines and ``limit`` bytes)."""
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, path.stat().st_size - limit))
            data = fh.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").strip().splitlines()[-lines:])


def _pid_alive(pid: Any) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _kill(pid: Any, signum: int) -> None:
    if isinstance(pid, int) and pid > 0:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _killpg(pid: Any, signum: int) -> None:
    if isinstance(pid, int) and pid > 0:
        try:
            os.killpg(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


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

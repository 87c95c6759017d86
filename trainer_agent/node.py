"""The node agent: ``python -m trainer_agent.node --server URL --token TOKEN [--simulate-gpus N]``.

Runs on each GPU node (no Django here). It holds one WebSocket to the control plane
(``/ws/agent/``), reports its inventory, sends a heartbeat with GPU samples every few seconds,
and carries out commands: ``start``/``resume`` launch the reference trainer
(``python -m trainer_agent.train``) for the job, ``preempt`` sends SIGTERM so the workers finish
their step and checkpoint before the deadline, ``resize`` checkpoints and relaunches at the new
DP, ``stop`` ends the workers. Every command is acknowledged on receipt and answered with a
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

from trainer_agent import protocol
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
    stop_command: str | None = None
    stop_deadline: float | None = None
    exit_outcome: dict[str, Any] | None = None

    def utilisation(self) -> float:
        """Simulated GPU utilisation from the last step: compute share, low while saving/starting."""
        if self.state != "running" or not self.last_record:
            return 0.05 if self.state in ("starting", "stopping") else 0.0
        step_s = float(self.last_record.get("step_s") or 0.0)
        compute_s = float(self.last_record.get("compute_s") or 0.0)
        if step_s <= 0:
            return 0.5
        return max(0.0, min(1.0, 0.97 * compute_s / step_s + random.uniform(-0.02, 0.02)))


class TorchJob:
    """A job's real trainer on this node: the launcher process, its run dir and its records."""

    def __init__(self, handle: WorkerHandle, run_dir: Path, payload: dict[str, Any], python: str,
                 device: str = "cpu") -> None:
        self.handle = handle
        self.run_dir = run_dir
        self.payload = payload
        self.python = python
        self.device = device
        self.proc: asyncio.subprocess.Process | None = None
        self._offset = 0
        self._inode: int | None = None

    def newest_checkpoint(self) -> int:
        """The newest complete checkpoint step in the run dir (0 when none)."""
        steps = CheckpointStore(self.run_dir / "checkpoints").complete_steps()
        return steps[-1] if steps else 0

    async def launch(self, dp: int) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "exit.json").unlink(missing_ok=True)
        p = self.payload
        argv = [self.python, "-m", "trainer_agent.train", "--run-dir", str(self.run_dir),
                "--steps", str(p["total_steps"]), "--dp", str(dp),
                "--global-batch", str(p["global_batch"]), "--micro-batch", str(p["micro_batch"]),
                "--checkpoint-every", str(max(1, int(p.get("checkpoint_every", 10)))), "--device", self.device]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        if self.device == "cuda" and p.get("gpus"):
            # The workers see only the GPUs the control plane gave this job on this node.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in p["gpus"])
        self.handle.resume_step = self.newest_checkpoint()
        self.handle.step = self.handle.resume_step
        self.handle.state = "starting"
        log = open(self.run_dir / "launcher.log", "ab")  # noqa: SIM115 - handed to the child
        # Own process group (signals reach launcher and workers together), and death with the
        # agent: a dead agent stands for a dead node, whose workers must not write on.
        self.proc = await asyncio.create_subprocess_exec(*argv, stdout=log, stderr=log, env=env,
                                                         start_new_session=True, preexec_fn=_die_with_agent)
        log.close()
        self._offset, self._inode = 0, None

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def read_new_records(self) -> list[dict[str, Any]]:
        """Records appended to metrics.jsonl since the last call (the file may be rewritten)."""
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
        try:
            return json.loads((self.run_dir / "exit.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}


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
                 python: str = sys.executable, device: str = "auto") -> None:
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
        self.jobs: dict[str, TorchJob | SimulatedJob] = {}
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
            out.append({"job": name, "state": h.state, "step": h.step,
                        "checkpoint_step": job.newest_checkpoint() if h.leader else None, "gpus": h.gpus})
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
        return {"type": protocol.HEARTBEAT, "seq": self.seq, "boot": self.boot, "sent_at": time.time(),
                "gpus": self.gpus.samples(self._busy()), "workers": self._workers_report(),
                "dropped_records": self.dropped_records}

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
        await ws.send(protocol.dumps({
            "type": protocol.HELLO, "protocol": protocol.PROTOCOL_VERSION, "node": self.node,
            "inventory": {"gpus": self.gpus.describe(), "hostname": socket.gethostname()},
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
            if not payload.get("leader", True):
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
        """Another node leads the job: only track which of our GPUs it uses."""
        if kind in ("start", "resume", "resize") and payload.get("gpus"):
            self.members[job] = list(payload["gpus"])
        else:
            self.members.pop(job, None)
        if kind == "stop" and job in self.jobs:
            self.jobs[job].signal(signal.SIGKILL)
        self._done(command_id, True)

    async def _start(self, command_id: str, job: str, payload: dict[str, Any]) -> None:
        current = self.jobs.get(job)
        if current is not None and current.alive():
            self._done(command_id, True, step=current.handle.step, outcome="already running")
            return
        started = time.perf_counter()
        handle = await self._launch(job, payload)
        self._done(command_id, True, checkpoint_step=handle.resume_step, step=handle.resume_step,
                   load_s=round(time.perf_counter() - started, 4), outcome="launched")

    async def _stop(self, command_id: str, kind: str, job: str, payload: dict[str, Any], deadline: float | None) -> None:
        worker = self.jobs.get(job)
        self.members.pop(job, None)
        if worker is None or not worker.alive():
            step = worker.newest_checkpoint() if worker is not None else None
            if step is None:
                step = _newest_checkpoint_on_disk(self.runs_dir / _safe(job))
            if kind == "resize" and payload.get("relaunch"):
                await self._relaunch(command_id, job, payload, step)
            else:
                self.jobs.pop(job, None)
                self._done(command_id, True, checkpoint_step=step, save_s=0.0, outcome="not running")
            return
        h = worker.handle
        h.state = "stopping"
        h.stop_command = command_id
        h.stop_deadline = deadline
        if kind == "stop" and payload.get("kill"):
            worker.signal(signal.SIGKILL)
        else:
            worker.signal(signal.SIGTERM)
        h.exit_outcome = {"kind": kind, "payload": payload, "asked_at": time.perf_counter()}

    async def _relaunch(self, command_id: str, job: str, payload: dict[str, Any], step: int) -> None:
        dp = int(payload.get("dp_after") or payload.get("dp"))
        await self._launch(job, {**payload, "dp": dp})
        self._done(command_id, True, checkpoint_step=step, outcome="relaunched", dp=dp)

    async def _launch(self, job: str, payload: dict[str, Any]) -> WorkerHandle:
        handle = WorkerHandle(job=job, gpus=list(payload.get("gpus", [])), leader=True)
        run_dir = self.runs_dir / _safe(job)
        worker: TorchJob | SimulatedJob
        if self.simulated_workers or _has_only_simulated_history(run_dir):
            # A job that so far ran on simulated nodes has no state a real trainer could load:
            # it stays simulated here too rather than silently restarting from step 0.
            worker = SimulatedJob(handle, run_dir, payload, self.time_scale)
        else:
            worker = TorchJob(handle, run_dir, payload, self.python, self.device)
        self.jobs[job] = worker
        await worker.launch(int(payload["dp"]))
        return handle

    # -- supervising the workers ------------------------------------------------------------------

    async def _supervise(self) -> None:
        """Forward new step records, notice exits, enforce preempt deadlines."""
        while True:
            await asyncio.sleep(0.2)
            for name, worker in list(self.jobs.items()):
                records = worker.read_new_records()
                if records:
                    worker.handle.step = max(r["step"] for r in records)
                    worker.handle.last_record = records[-1]
                    if worker.handle.state == "starting":
                        worker.handle.state = "running"
                    self.queue_records(name, records)
                h = worker.handle
                if h.stop_deadline is not None and worker.alive() and time.time() > h.stop_deadline + 1.0:
                    worker.signal(signal.SIGKILL)
                    h.stop_deadline = None
                if not worker.alive() and worker.__class__ is TorchJob and worker.proc is not None:
                    await self._on_exit(name, worker)
                elif isinstance(worker, SimulatedJob) and worker.task is not None and worker.task.done():
                    await self._on_exit(name, worker)
            if self.ws is not None:
                try:
                    await self._flush()
                except Exception:
                    pass

    async def _on_exit(self, name: str, worker: TorchJob | SimulatedJob) -> None:
        records = worker.read_new_records()
        if records:
            self.queue_records(name, records)
        h = worker.handle
        info = worker.exit_info() if not getattr(worker, "killed", False) else {}
        returncode = worker.proc.returncode if isinstance(worker, TorchJob) and worker.proc else 0
        checkpoint_step = worker.newest_checkpoint()
        del self.jobs[name]
        if h.stop_command is not None:
            asked = h.exit_outcome if isinstance(h.exit_outcome, dict) and "kind" in h.exit_outcome else {}
            kind = asked.get("kind", "preempt")
            payload = asked.get("payload", {})
            saved = returncode == 0 and info.get("outcome") in ("preempted", "completed", "resize")
            outcome = {"checkpoint_step": checkpoint_step, "save_s": info.get("save_s"), "step": info.get("step"),
                       "outcome": info.get("outcome") or f"exit {returncode}"}
            if kind == "resize" and payload.get("relaunch") and saved:
                await self._relaunch(h.stop_command, name, payload, checkpoint_step)
                return
            if kind == "stop":
                self._done(h.stop_command, True, **outcome)
            elif saved:
                self._done(h.stop_command, True, **outcome)
            else:
                self._done(h.stop_command, False, error=f"workers exited without a checkpoint (code {returncode})",
                           **outcome)
            return
        if returncode == 0 and info.get("outcome") == "completed":
            self.queue_control({"type": protocol.EXIT, "job": name,
                                "outcome": {"outcome": "completed", "step": info.get("step"),
                                            "checkpoint_step": checkpoint_step}})
        elif returncode == 0 and info.get("outcome") == "preempted":
            pass  # stopped by a signal that was not a command of ours (an operator): nothing to report
        else:
            tail = _tail(worker.run_dir / "launcher.log") if isinstance(worker, TorchJob) else ""
            self.queue_control({"type": protocol.EXIT, "job": name,
                                "outcome": {"outcome": "failed", "step": info.get("step"), "code": returncode,
                                            "error": tail or f"exit code {returncode}",
                                            "checkpoint_step": checkpoint_step}})

    def shutdown(self) -> None:
        """A stopping agent asks its workers to checkpoint and exit (SIGTERM)."""
        self.stopping = True
        for worker in self.jobs.values():
            worker.signal(signal.SIGTERM)


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


def _safe(job: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in job)


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


def _tail(path: Path, limit: int = 600) -> str:
    try:
        return path.read_bytes()[-limit:].decode("utf-8", "replace").strip()
    except OSError:
        return ""


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
                      device=args.trainer_device)
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
    runner.cancel()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s node %(message)s")
    return asyncio.run(_main_async(args))


if __name__ == "__main__":
    sys.exit(main())

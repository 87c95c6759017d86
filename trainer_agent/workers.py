"""The node agent's workers: one job's share of this node, as a torchrun of real ranks
(``TorchrunJob``) or played without torch (``SimulatedJob``), and what each reports when it
ends (the ``done`` of a stop, or the ``exit`` of a run that ended unasked).

The agent (``trainer_agent.node``) launches, signals and supervises them; protocol and
semantics: docs/control-loop.md and docs/workloads.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer_agent import launch
from trainer_agent.checkpoint import newest_step
from trainer_agent.rank import STOP_ASKED

SIM_CHECKPOINT = "sim-checkpoint.json"
#: The ``exit.json`` outcomes of an ``omni`` run that ended as asked or finished: nothing lost.
ENDED_WELL = ("preempted", "resize", "completed")


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
        if self.state == "running" and self.integration == "signal" and "compute_s" not in self.last_record:
            # A plain script's step lines (if it writes any) do not split the step: nominal.
            return max(0.0, min(1.0, 0.85 + random.uniform(-0.03, 0.03)))
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
        self._sent_rank_nodes: list[str] = []

    @property
    def integration(self) -> str:
        return str(self.payload["workload"].get("integration", "omni"))

    def newest_checkpoint(self) -> int:
        """The newest checkpoint step of an ``omni`` job (0 when none): the library's committed
        checkpoints, or the step a framework integration noted (trainer_agent/checkpoint.py)."""
        return newest_step(self.paths.checkpoint_dir)

    async def launch(self, dp: int) -> None:
        paths = self.paths
        for directory in (paths.run_dir, paths.checkpoint_dir, paths.log_dir, paths.state_dir):
            directory.mkdir(parents=True, exist_ok=True)
        if self.handle.leader:
            (paths.run_dir / "exit.json").unlink(missing_ok=True)
            if self.integration == "signal":
                # A signal-mode script's step lines are its own, run by run: the last run's would
                # read as this one's progress (an omni run trims the file to its checkpoint itself).
                (paths.run_dir / launch.METRICS_FILE).unlink(missing_ok=True)
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
        for entry in _registered(self.paths.state_dir, "rank-*.json"):
            if isinstance(entry.get("pid"), int):
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

    def ask_stop(self) -> None:
        """Note, for the rank wrappers, that the SIGTERM about to come is a stop the agent asks for
        (``trainer_agent.rank.STOP_ASKED``): a rank that dies of it stopped as asked."""
        self.paths.state_dir.mkdir(parents=True, exist_ok=True)
        (self.paths.state_dir / STOP_ASKED).touch()

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
        path = self.run_dir / launch.METRICS_FILE
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
                record.setdefault("run", self.payload["run_id"])  # a new run is a resume or a resize
                out.append(record)
        nodes = self.rank_nodes()
        if out and nodes != self._sent_rank_nodes:
            out[0]["rank_nodes"] = nodes  # which node each rank runs on: the server attributes stragglers
            self._sent_rank_nodes = nodes
        return out

    def rank_nodes(self) -> list[str]:
        """The node of every rank of this run, in rank order, from the rank wrappers' registries
        on every node (shared storage); empty until all have registered."""
        found: dict[int, str] = {}
        for entry in _registered(self.paths.state_dir.parent, "*/rank-*.json"):
            if isinstance(entry.get("rank"), int) and isinstance(entry.get("node"), str):
                found[entry["rank"]] = entry["node"]
        world = sum(len(entry.get("gpus") or ()) for entry in self.payload.get("placement") or ())
        if not found or sorted(found) != list(range(world)):
            return []
        return [found[r] for r in range(len(found))]

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
            if isinstance(entry, dict) and entry.get("code") and not entry.get("asked"):
                exits.append(entry)
        if exits:
            first = min(exits, key=lambda e: float(e.get("at") or 0.0))
            rank = int(first.get("rank", -1))
            tail = _tail(self.paths.log_dir / f"rank-{rank}.err") or _tail(self.paths.log_dir / f"rank-{rank}.out")
            return {"rank": rank, "code": first.get("code"), "signal": first.get("signal"), "at": first.get("at"),
                    "tail": tail}
        return {"rank": None, "code": self.returncode(), "signal": None, "at": time.time(),
                "tail": _tail(self.paths.log_dir / "torchrun.log")}

    def failed_after_finish(self, info: dict[str, Any], returncode: int,
                            outcomes: tuple[str, ...] = ENDED_WELL) -> str | None:
        """What the audit says of an ``omni`` run that exited non-zero, unkilled, only because a
        rank on this node failed after the run had ended well: rank 0 had written ``exit.json``
        (one of ``outcomes``; a follower reads the leader's on the shared storage) before that
        rank exited, and a stop's checkpoint is the step it names and is on disk. Under load a
        rank can abort in the interpreter's teardown after ``finish`` (SIGABRT, "terminate called
        without an active exception"), torchrun then exits non-zero, and the run lost nothing.
        None for a clean exit, a kill, or a rank that failed before the run's end was written."""
        if self.integration != "omni" or returncode == 0 or self.handle.killed:
            return None
        if not self.handle.leader:
            info = self.exit_info()
        outcome = info.get("outcome")
        if outcome not in outcomes:
            return None
        step = info.get("step")
        if outcome != "completed" and not (isinstance(step, int) and info.get("checkpoint_step") == step
                                           and self.newest_checkpoint() >= step):
            return None
        failure = self.failure()
        written = info.get("at")
        if failure.get("rank") is None or not isinstance(written, (int, float)):
            return None  # torchrun failed on its own, or an exit.json that does not say when
        if float(written) > float(failure.get("at") or 0.0):
            return None
        how = f"signal {failure['signal']}" if failure.get("signal") else f"code {failure.get('code')}"
        return f"rank {failure['rank']} exited with {how} after the run had ended at step {step}"


    # -- how the run ended -------------------------------------------------------------------

    def _ending(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """exit.json (an ``omni`` leader's only) and the facts every report of the ending carries."""
        h = self.handle
        omni = h.integration == "omni"
        info = self.exit_info() if omni and h.leader else {}
        facts = {"run_id": h.run_id, "code": self.returncode(), "leader": h.leader,
                 "checkpoint_step": self.newest_checkpoint() if omni else None}
        return info, facts

    def stop_report(self) -> tuple[bool, dict[str, Any]]:
        """Whether the stop the ranks exited for succeeded, and the outcome its ``done`` carries."""
        h = self.handle
        info, facts = self._ending()
        returncode = facts["code"]
        omni = h.integration == "omni"
        exit_s = round(time.time() - h.term_at, 3) if h.term_at else None
        facts.update(save_s=info.get("save_s"), step=info.get("step"), exit_s=exit_s, grace_s=h.grace_s,
                     killed=h.killed)
        if h.killed:
            facts["outcome"] = "killed"
            facts["error"] = (f"ranks did not exit within grace_s {h.grace_s:g} s of SIGTERM; killed"
                              if not omni else f"ranks did not checkpoint by the deadline; killed after {exit_s} s")
        elif omni:
            facts["outcome"] = info.get("outcome") or f"exit {returncode}"
        else:
            facts["outcome"] = "exited" if returncode == 0 else f"exit {returncode}"
        late = self.failed_after_finish(info, returncode)
        if late:
            facts["teardown"] = late
        if h.stop_kind == "stop":
            ok = True
        elif omni and h.leader:
            ok = (returncode == 0 or bool(late)) and info.get("outcome") in ENDED_WELL
        elif omni:
            ok = (returncode == 0 or bool(late)) and not h.killed
        else:
            # Signal mode: whatever the script does with SIGTERM (save and exit 0, or die of
            # it), leaving within grace is a graceful stop; only the SIGKILL is not.
            ok = not h.killed
        if not ok and "error" not in facts:
            tail = self.failure().get("tail", "")[-300:]
            facts["error"] = f"ranks exited with code {returncode} before a checkpoint: {tail}"
        return ok, facts

    def exit_report(self) -> dict[str, Any]:
        """The outcome an ``exit`` frame carries when the run ended unasked: completed, or failed
        with the first rank that did."""
        info, facts = self._ending()
        returncode = facts["code"]
        late = self.failed_after_finish(info, returncode, ("preempted", "completed"))
        if late:
            facts["teardown"] = late
        if returncode == 0 or late:
            # "stopped": a signal from outside Omni stopped it at a checkpoint (a follower's
            # report says "completed", which the server leaves to the leader's)
            outcome = "stopped" if info.get("outcome") == "preempted" else "completed"
            return {**facts, "outcome": outcome, "step": info.get("step")}
        failure = self.failure()
        return {**facts, "outcome": "failed", "code": failure.get("code") or returncode, "rank": failure.get("rank"),
                "signal": failure.get("signal"), "at": failure.get("at"),
                "error": failure.get("tail") or f"exit code {returncode}"}

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
        return newest_checkpoint_on_disk(self.run_dir)

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
            if self.payload.get("run_id"):
                record["run"] = self.payload["run_id"]
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

    def ask_stop(self) -> None:
        """Nothing to note: no rank here can die of the SIGTERM."""

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

    def relaunches(self) -> bool:
        """Whether a resize that asked for a relaunch found the workers stopped at a checkpoint."""
        h = self.handle
        return (h.stop_kind == "resize" and bool((h.stop_payload or {}).get("relaunch"))
                and not self.killed and bool(self.exit_info()))

    def stop_report(self) -> tuple[bool, dict[str, Any]]:
        """Whether the stop the workers ended for succeeded, and the outcome its ``done`` carries."""
        info = self.exit_info() if not self.killed else {}
        outcome = {"checkpoint_step": self.newest_checkpoint(), "save_s": info.get("save_s"), "step": info.get("step"),
                   "outcome": info.get("outcome") or "killed"}
        if self.handle.stop_kind == "stop" or info.get("outcome") in ("preempted", "completed"):
            return True, outcome
        return False, {"error": "workers exited without a checkpoint", **outcome}

    def exit_report(self) -> dict[str, Any] | None:
        """The outcome an ``exit`` frame carries when the workers ended unasked: only a completed
        run reports (a killed one was stopped by this agent)."""
        info = self.exit_info() if not self.killed else {}
        if info.get("outcome") != "completed":
            return None
        return {"outcome": "completed", "step": info.get("step"), "leader": True,
                "checkpoint_step": self.newest_checkpoint()}


def _die_with_agent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _registered(directory: Path, pattern: str) -> list[dict[str, Any]]:
    """The rank wrappers' registry entries under ``directory`` (trainer_agent/rank.py), in path
    order; exit records and files torn or gone meanwhile are skipped."""
    out = []
    for path in sorted(directory.glob(pattern)):
        if path.name.endswith(".exit.json"):
            continue
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def newest_checkpoint_on_disk(run_dir: Path) -> int:
    best = 0
    try:
        best = int(json.loads((run_dir / SIM_CHECKPOINT).read_text())["step"])
    except (OSError, ValueError, KeyError):
        pass
    return max(best, newest_step(run_dir / "checkpoints"))


def resumes_simulated(run_dir: Path) -> bool:
    """Whether the job's newest checkpoint is a simulated one: a real trainer cannot load it and
    would go back to its own older checkpoint (or step 0), so the job stays simulated, on a real
    node too. Only a test bed mixes the two (bench.faults: a job that ran real, then simulated,
    then came back to a real node resumed 900 steps back)."""
    try:
        simulated = int(json.loads((run_dir / SIM_CHECKPOINT).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return simulated > newest_step(run_dir / "checkpoints")


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

"""Seeded fault injection on one running stack: ``python -m bench.faults --json`` (docs/faults.md).

Starts its own services so that restarting them hurts nobody: a private PostgreSQL cluster
(initdb into a temp dir) and a private redis-server, then one stack for the whole run: daphne, a
Celery worker with beat, four node agents (two running real torch ranks on CPU, two playing
simulated workers) reaching daphne through a small TCP proxy that can cut a connection in the
middle of a frame, and a few jobs (elastic ones, a critical one with a reserved window) that keep
the planner busy. Then, for each of ``--faults`` faults drawn from ``--seed``: a little churn
(submits, cancels), the fault (``kill -9`` of the Celery worker mid-pass, of daphne, of an
agent, of a rank; a Redis or PostgreSQL restart; a socket cut mid-frame; a clock jump on an
agent), a supervisor's restart of what was killed, and the checks, polled until they all pass or
``--settle-s`` runs out: no command lost or applied twice, no allocation half-written, every job
running where the database says (its ranks are there, its steps advance) or waiting with a
reason, the audit chain verifies. Progress goes to stderr; ``--json`` prints one object.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.procs import answers, free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

KINDS = ("kill9_celery", "kill9_asgi", "kill9_agent", "kill9_rank", "restart_redis", "restart_postgres",
         "cut_socket", "clock_jump")
REAL_NODES = ("r0", "r1")          # agents whose jobs run real torch ranks (1 GPU each)
SIMULATED_NODES = ("s0", "s1")     # agents with --simulated-workers (2 GPUs each)
HEARTBEAT_S = 1.0
HEARTBEAT_MISSES = 6               # a supervisor's restart (a few seconds) is not a node failure
ACK_TIMEOUT_S = 3.0
MAX_ATTEMPTS = 3
DONE_TIMEOUT_S = 60.0
SUPERVISOR_DELAY_S = 0.5           # systemd's RestartSec
# A fault is survived once every check holds for this long without a break: a kill's effects
# (a rank's exit report, a missed heartbeat) take a few seconds to show.
QUIET_S = 4.0
# How long a kill9_rank waits for a rank under a real agent before it changes places with a later
# fault (and, as the last faults, falls back to kill9_agent): every kind is injected at least once.
RANK_WAIT_S = 20.0
STALL_S = 25.0                     # a running job whose steps stop for this long is not running
ACTIVE_STATES = ("running", "checkpointing", "resizing")
APPLIED = re.compile(r"applying command (\S+) on")


def log(message: str) -> None:
    print(f"faults {time.strftime('%H:%M:%S')}: {message}", file=sys.stderr, flush=True)








# -- private services ----------------------------------------------------------------------------


class PrivatePostgres:
    """A throw-away PostgreSQL cluster on its own port, trust auth. fsync is off (an immediate
    stop keeps the OS's buffers) but synchronous_commit is not: with it off, a restart forgets
    commits an agent has already acted on, which production never does. PostgreSQL refuses to
    run as root, so as root the cluster belongs to the ``postgres`` user."""

    def __init__(self) -> None:
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not bins:
            raise SystemExit("faults: no PostgreSQL server binaries under /usr/lib/postgresql/*/bin")
        self.bin = Path(bins[-1]).parent
        self.root = Path(tempfile.mkdtemp(prefix="omni-faults-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self._pg(["initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync"])

    def _pg(self, argv: list[str]) -> None:
        subprocess.run(self.as_user + [str(self.bin / argv[0])] + argv[1:], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, cwd=self.root)

    def start(self) -> None:
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c max_connections=200")
        self._pg(["pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-o", options, "-w", "start"])

    def crash(self) -> None:
        """What a power cut does to the server: no shutdown checkpoint, every backend gone."""
        self._pg(["pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop"])

    def url(self, name: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{name}"

    def destroy(self) -> None:
        try:
            self.crash()
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)


# -- the socket cutter ---------------------------------------------------------------------------


@dataclass
class _Link:
    client: socket.socket
    upstream: socket.socket
    opened: float = field(default_factory=time.monotonic)
    cut: threading.Event = field(default_factory=threading.Event)
    closed: threading.Event = field(default_factory=threading.Event)
    cut_bytes: int = 0

    def close(self) -> None:
        for s in (self.client, self.upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.closed.set()


class CuttingProxy:
    """TCP between the agents and daphne. ``cut()`` drops one long-lived connection (an agent's
    WebSocket) after forwarding only half of the next chunk that crosses it: a frame cut in two."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.links: list[_Link] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=2)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            link = _Link(client, upstream)
            with self.lock:
                self.links = [x for x in self.links if not x.closed.is_set()] + [link]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(link, src, dst), daemon=True).start()

    @staticmethod
    def _pump(link: _Link, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if link.cut.is_set():
                    half = max(1, len(data) // 2)
                    dst.sendall(data[:half])
                    link.cut_bytes = half
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            link.close()

    def cut(self, rng: random.Random) -> str:
        """Cut one agent connection mid-frame; say how."""
        deadline = time.monotonic() + 10.0
        while True:  # agents that just reconnected (after another fault) get a moment first
            with self.lock:
                live = [x for x in self.links if not x.closed.is_set() and time.monotonic() - x.opened > 1.0]
            if live or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if not live:
            return "no live agent connection to cut"
        link = rng.choice(live)
        link.cut.set()
        if not link.closed.wait(3.0):  # nothing crossed it: cut between frames instead
            link.close()
            return "cut between frames (idle link)"
        return f"cut mid-chunk after {link.cut_bytes} bytes"

    def close(self) -> None:
        self.listener.close()
        with self.lock:
            for link in self.links:
                link.close()


# -- the stack -----------------------------------------------------------------------------------


@dataclass
class Role:
    """One supervised process: how to start it again, and its log per incarnation."""

    name: str
    argv: list[str]
    env: dict[str, str]
    popen: subprocess.Popen | None = None
    incarnation: int = 0
    logs: list[Path] = field(default_factory=list)


class Stack:
    """The processes of the run, each in its own process group, restarted like a supervisor would."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.env = env
        self.roles: dict[str, Role] = {}
        self.unexpected_exits: list[str] = []

    def add(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Role:
        role = Role(name, argv, {**self.env, **(env or {})})
        self.roles[name] = role
        self.start(name)
        return role

    def start(self, name: str) -> None:
        role = self.roles[name]
        role.incarnation += 1
        path = self.workdir / f"{name}.{role.incarnation}.log"
        role.logs.append(path)
        with path.open("ab") as handle:
            role.popen = subprocess.Popen(role.argv, cwd=ROOT, env=role.env, stdout=handle, stderr=subprocess.STDOUT,
                                          start_new_session=True)

    def kill(self, name: str, signum: int = signal.SIGKILL) -> None:
        popen = self.roles[name].popen
        if popen is None:
            return
        try:
            os.killpg(popen.pid, signum)
        except ProcessLookupError:
            pass
        try:
            popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def restart(self, name: str) -> None:
        self.kill(name)
        time.sleep(SUPERVISOR_DELAY_S)
        self.start(name)

    def supervise(self) -> list[str]:
        """Restart=always: whatever exited on its own is started again; say what did."""
        exits = []
        for name, role in self.roles.items():
            if role.popen is not None and role.popen.poll() is not None:
                exits.append(f"{name} exited on its own with status {role.popen.returncode} ({role.logs[-1].name})")
                log(f"{exits[-1]}; restarting it")
                self.restart(name)
        self.unexpected_exits += exits
        return exits

    def pid(self, name: str) -> int:
        popen = self.roles[name].popen
        return popen.pid if popen is not None else -1

    def stop_all(self) -> None:
        for name in reversed(list(self.roles)):
            popen = self.roles[name].popen
            if popen is not None and popen.poll() is None:
                try:
                    os.killpg(popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for role in self.roles.values():
            if role.popen is not None:
                try:
                    role.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass


def _process_table() -> dict[int, tuple[int, dict[str, str]]]:
    """pid -> (parent pid, the OMNI_JOB/OMNI_RUN_ID of its environment, if any)."""
    table: dict[int, tuple[int, dict[str, str]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        tags = {}
        for item in environ:
            if item.startswith((b"OMNI_JOB=", b"OMNI_RUN_ID=")):
                key, _, value = item.decode(errors="replace").partition("=")
                tags[key] = value
        table[int(entry)] = (ppid, tags)
    return table


def _descendants(table: dict[int, tuple[int, dict[str, str]]], root: int) -> list[int]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, (ppid, _) in table.items():
        children[ppid].append(pid)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


# -- the checks ----------------------------------------------------------------------------------


class Checker:
    """The invariants every fault must leave intact, read from the database, the agents' logs and
    the process table. Keeps, across polls, when each running job last advanced."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.runs_dir = stack.workdir / "runs"
        self.progress: dict[tuple[str, str], tuple[int, float]] = {}
        self.lost: set[str] = set()
        self.duplicated: set[str] = set()

    def agent_logs(self) -> list[Path]:
        return [p for node in REAL_NODES + SIMULATED_NODES for p in self.stack.roles[f"agent-{node}"].logs]

    def problems(self) -> list[tuple[str, str]]:
        """(check, detail) for everything wrong now; empty when the stack is consistent."""
        from django.utils import timezone

        from jobs.audit import verify_chain
        from jobs.models import Allocation, Command, ElasticEvent, EventKind, Job
        from trainer_agent.launch import safe_name
        from trainer_agent.workers import resumes_simulated

        out: list[tuple[str, str]] = []
        now = timezone.now()

        # Commands: applied at most once per agent process, every one answered or explained. The
        # commands are read before the logs: an agent writes "applying" before it sends the ack,
        # so a command acked or done in this read has its line in the logs read after it (read
        # the other way round, a command applied between the two reads looked lost).
        commands = list(Command.objects.select_related("node", "job"))
        applied: set[str] = set()
        for path in self.agent_logs():
            try:
                ids = APPLIED.findall(path.read_text(errors="replace"))
            except OSError:
                continue
            applied.update(ids)
            for command_id, n in collections.Counter(ids).items():
                if n > 1:
                    out.append(("commands_duplicated", f"{command_id} applied {n} times by {path.name}"))
                    self.duplicated.add(command_id)
        outcomes = collections.Counter(
            ElasticEvent.objects.filter(kind=EventKind.OUTCOME).values_list("command", flat=True))
        for command_id, n in outcomes.items():
            if command_id and n > 1:
                out.append(("commands_duplicated", f"{command_id} has {n} outcome rows"))
                self.duplicated.add(str(command_id))
        open_bound_s = ACK_TIMEOUT_S * MAX_ATTEMPTS + 15
        for c in commands:
            what = f"{c.kind} {c.job.name if c.job_id else ''} on {c.node.name} ({c.id})"
            if c.state in ("done", "acked") and str(c.id) not in applied:
                out.append(("commands_lost", f"{what} is {c.state} but no agent ever applied it"))
                self.lost.add(str(c.id))
            elif c.state in ("pending", "sent") and (now - c.created_at).total_seconds() > open_bound_s:
                out.append(("commands_lost", f"{what} still {c.state} {(now - c.created_at).total_seconds():.0f}s "
                            f"after it was written (attempts {c.attempts})"))
                self.lost.add(str(c.id))
            elif c.state == "acked" and (now - c.acked_at).total_seconds() > DONE_TIMEOUT_S + 15:
                out.append(("commands_lost", f"{what} acked {(now - c.acked_at).total_seconds():.0f}s ago, "
                            "never done nor expired"))
                self.lost.add(str(c.id))
            elif c.state == "expired" and not c.error:
                out.append(("commands_lost", f"{what} expired without a reason"))
                self.lost.add(str(c.id))

        # Allocations: only jobs that run hold GPUs, a running job holds exactly its layout.
        held = collections.Counter(Allocation.objects.values_list("job_id", flat=True))
        for a in Allocation.objects.select_related("node", "job"):
            if a.gpu_index >= a.node.gpu_count:
                out.append(("allocation_half_written", f"{a.job.name} holds {a.node.name}/gpu{a.gpu_index}, "
                            f"which does not exist"))
        table = _process_table()
        placed: dict[str, dict[str, set[str]]] = {}  # node -> run id -> job
        for job in Job.objects.all():
            n = held.get(job.id, 0)
            if job.state not in ACTIVE_STATES and n:
                out.append(("allocation_half_written", f"{job.name} is {job.state} but holds {n} GPUs"))
            if job.state == "running" and n != job.tp * job.pp * job.dp:
                out.append(("allocation_half_written", f"{job.name} is running at dp {job.dp} but holds {n} GPUs"))
            if job.state == "pending" and not job.pending_reason:
                out.append(("job_waiting_without_reason", f"{job.name} is pending with no reason"))
            if job.state == "recovering" and not job.pending_reason:
                out.append(("job_not_settled", f"{job.name} is recovering and the planner has not said why it waits"))
            if job.state in ("checkpointing", "resizing"):
                out.append(("job_not_settled", f"{job.name} is still {job.state}"))
            if job.state != "running":
                continue
            nodes = sorted(set(job.allocations.values_list("node__name", flat=True)))
            for node in nodes:
                placed.setdefault(node, {})[job.run_id] = job.name
            launches = Command.objects.filter(job=job, kind__in=["start", "resume"], payload__run_id=job.run_id)
            undone = [c.node.name for c in launches.select_related("node") if c.state != "done"]
            if undone:
                out.append(("job_not_settled", f"{job.name}'s launch on {', '.join(undone)} is not done yet"))
                continue
            # A reference job whose newest checkpoint simulated workers saved, or that spans a simulated
            # node, runs simulated on a real node too (the agent's own rule, trainer_agent.node):
            # no ranks to find there, only steps.
            simulated = (resumes_simulated(self.runs_dir / safe_name(job.name))
                         or any(node in SIMULATED_NODES for node in nodes))
            for node in nodes:
                if node in REAL_NODES and not simulated and not any(
                        table[pid][1].get("OMNI_JOB") == job.name and table[pid][1].get("OMNI_RUN_ID") == job.run_id
                        for pid in _descendants(table, self.stack.pid(f"agent-{node}")) if pid in table):
                    out.append(("job_not_where_db_says", f"{job.name} runs on {node} per the database, but that "
                                f"agent has no rank of run {job.run_id}"))
            key = (job.name, job.run_id)
            seen = self.progress.get(key)
            if seen is None or seen[0] != job.committed_steps:
                self.progress[key] = (job.committed_steps, time.monotonic())
            elif time.monotonic() - seen[1] > STALL_S:
                out.append(("job_not_where_db_says", f"{job.name} is running per the database but made no step "
                            f"for {time.monotonic() - seen[1]:.0f}s (step {job.committed_steps})"))
        for node in REAL_NODES:
            for pid in _descendants(table, self.stack.pid(f"agent-{node}")):
                tags = table.get(pid, (0, {}))[1]
                if tags.get("OMNI_JOB") and tags.get("OMNI_RUN_ID") not in placed.get(node, {}):
                    out.append(("job_not_where_db_says", f"{node} runs ranks of {tags['OMNI_JOB']} run "
                                f"{tags.get('OMNI_RUN_ID')}, which the database does not place there"))
                    break

        report = verify_chain()
        if not report.ok:
            out.append(("audit_chain", f"breaks at event {report.first_bad_id}: {report.problem}"))
        return out


# -- the run -------------------------------------------------------------------------------------


def _job_spec(name: str, *, dp: int, total_steps: int, priority: str = "best_effort", elastic: bool = False,
              step_s: float = 0.5) -> dict[str, Any]:
    return {"name": name, "priority": priority, "dp": dp, "dp_min": 1 if elastic else dp,
            "dp_max": dp + 1 if elastic else dp, "global_batch": 4 * dp * (dp + 1), "micro_batch": 2,
            "total_steps": total_steps, "step_s": step_s, "checkpoint_every_steps": 3, "checkpoint_save_s": 0.3,
            "checkpoint_load_s": 0.3, "max_restarts": 100, "min_run_s": 0}


def run(seed: int, faults: int, settle_s: float, keep_logs: bool = False,
        kinds: tuple[str, ...] = KINDS) -> dict[str, Any]:
    started = time.monotonic()
    rng = random.Random(seed)
    workdir = Path(tempfile.mkdtemp(prefix="omni-faults-"))
    log(f"seed {seed}; {faults} faults; logs in {workdir}")
    pg = PrivatePostgres()
    pg.start()
    import psycopg

    with psycopg.connect(pg.url("postgres"), autocommit=True) as conn:
        conn.execute('CREATE DATABASE "omni_faults"')
    redis_port = free_port()
    asgi_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update({
        "DATABASE_URL": pg.url("omni_faults"), "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "SECRET_KEY": "omni-faults-not-secret", "OMNI_VAR_DIR": str(workdir / "var"), "OMNI_INPROCESS_LOOP": "0",
        "OMNI_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S), "OMNI_HEARTBEAT_MISSES": str(HEARTBEAT_MISSES),
        "OMNI_PLANNER_INTERVAL_S": "1", "OMNI_COMMAND_ACK_TIMEOUT_S": str(ACK_TIMEOUT_S),
        "OMNI_COMMAND_MAX_ATTEMPTS": str(MAX_ATTEMPTS), "OMNI_COMMAND_DONE_TIMEOUT_S": str(DONE_TIMEOUT_S),
        "OMNI_PLANNER_OVERRIDES": '{"startup_s": 1, "reclaim_margin_s": 3, "min_loan_steps": 2}',
        "OMNI_RDZV_PORTS": f"{(base := random.randrange(20000, 32000))}-{base + 199}",
        "OMP_NUM_THREADS": "1", "LOG_LEVEL": "INFO", "PYTHONUNBUFFERED": "1",
    })
    os.environ.update({k: env[k] for k in env if k.startswith("OMNI_") or k in ("DATABASE_URL", "REDIS_URL",
                                                                                  "SECRET_KEY")})
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "omniweb.settings")
    stack = Stack(workdir, env)
    proxy: CuttingProxy | None = None
    kept = False
    try:
        redis_argv = [shutil.which("redis-server") or "redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                      "--save", "", "--appendonly", "no"]
        stack.add("redis", redis_argv)
        wait_for(lambda: answers(redis_port), 20, "redis-server")
        subprocess.run([PY, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
        import django

        django.setup()
        from django.contrib.auth import get_user_model
        from django.db import connections
        from django.utils import timezone

        from jobs import actions
        from jobs.models import Command, ElasticEvent, Job, Node

        boss = get_user_model().objects.create_superuser("faults", "faults@example.com", "faults-pass-1234")
        tokens = {}
        for name in REAL_NODES + SIMULATED_NODES:
            node = Node.objects.create(name=name, rack="r0", switch=f"r0s{name[0]}",
                                       gpu_count=1 if name in REAL_NODES else 2)
            tokens[name] = node.issue_token()
            node.save(update_fields=["agent_token_hash"])

        stack.add("daphne", [PY, "manage.py", "serve", "--no-loop", "--port", str(asgi_port)])
        stack.add("celery", [str(Path(PY).with_name("celery")), "-A", "omniweb", "worker", "-B", "-s",
                             str(workdir / "beat-schedule"), "--pool=solo", "-Q", "planner,control,telemetry,celery",
                             "--loglevel=INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"],
                  {"OMNI_PLANNER_PASS_HOLD_S": "0.3"})  # passes that apply hold their lock: kills land mid-pass
        wait_for(lambda: answers(asgi_port), 60, "daphne")
        proxy = CuttingProxy(asgi_port)
        server = f"http://127.0.0.1:{proxy.port}"
        for name in REAL_NODES + SIMULATED_NODES:
            clock = workdir / f"clock-{name}"
            clock.write_text("0")
            argv = [PY, "-m", "trainer_agent.node", "--server", server, f"--token={tokens[name]}", "--node", name,
                    "--simulate-gpus", "1" if name in REAL_NODES else "2", "--runs-dir", str(workdir / "runs"),
                    "--log-level", "INFO"]
            if name in SIMULATED_NODES:
                argv += ["--simulated-workers", "--time-scale", "0.5"]
            stack.add(f"agent-{name}", argv, {"OMNI_AGENT_TEST_CLOCK_FILE": str(clock)})
        wait_for(lambda: Node.objects.filter(last_heartbeat_at__isnull=False).count() == 4, 90, "every agent")

        actions.submit_job(boss, **_job_spec("long", dp=1, total_steps=100000, priority="regular"))
        actions.submit_job(boss, **_job_spec("elastic", dp=2, total_steps=100000, elastic=True))
        crit = actions.submit_job(boss, **_job_spec("crit", dp=2, total_steps=100000, priority="critical"))
        actions.create_reservation(boss, name="window", gpus=2, job=crit,
                                   start_at=timezone.now() + timedelta(seconds=40), period_s=120,
                                   active_s=40)
        wait_for(lambda: Command.objects.filter(state="done").count() >= 2, 90, "the first jobs to start")
        log(f"stack up in {time.monotonic() - started:.0f}s")

        checker = Checker(stack)
        schedule = [kinds[i % len(kinds)] for i in range(faults)]
        rng.shuffle(schedule)
        by_kind = {k: {"injected": 0, "survived": 0} for k in KINDS}
        failures: list[dict[str, Any]] = []
        settle_times: list[float] = []
        repairs = 0
        churn_n = 0
        for i, kind in enumerate(schedule, 1):
            churn_n += _churn(rng, boss, churn_n)
            if kind == "kill9_rank" and not _wait_for_rank(stack, RANK_WAIT_S):
                later = next((j for j in range(i, len(schedule)) if schedule[j] != "kill9_rank"), None)
                if later is not None:  # no rank under a real agent now: that fault later, a later one now
                    log(f"[{i}/{faults}] no rank alive after {RANK_WAIT_S:.0f}s: kill9_rank swapped with "
                        f"fault {later + 1} ({schedule[later]})")
                    schedule[i - 1], schedule[later] = schedule[later], kind
                    kind = schedule[i - 1]
            events_before = ElasticEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0
            kind, target = _inject(kind, rng, stack, proxy, pg, workdir, connections)
            by_kind[kind]["injected"] += 1
            fault_at = time.monotonic()
            time.sleep(1.0)  # let the fault's effects start before judging them
            problems: list[tuple[str, str]] = []
            survived = False
            clean_since: float | None = None
            crashed: list[str] = []
            deadline = fault_at + settle_s
            while time.monotonic() < deadline:
                crashed += stack.supervise()
                try:
                    repairs += _repair_failed_nodes(boss, stack)
                    problems = checker.problems()
                except Exception as exc:  # the database may still be coming back
                    connections.close_all()
                    problems = [("database", f"{type(exc).__name__}: {str(exc).strip()[:200]}")]
                if problems:
                    clean_since = None
                elif clean_since is None:
                    clean_since = time.monotonic()
                elif time.monotonic() - clean_since >= QUIET_S:
                    survived = True
                    break
                time.sleep(0.5)
            settle = (clean_since if survived else time.monotonic()) - fault_at
            if crashed:  # restarted and settled, but a process that should have ridden it out died
                survived = False
                problems = [("process_crashed", text) for text in crashed] + problems
            effects = _events_since(events_before)
            if survived:
                by_kind[kind]["survived"] += 1
                settle_times.append(settle)
            else:
                _dump_state(workdir / f"fault-{i}-state.json", problems)
                failures.append({"fault": i, "kind": kind, "target": target, "seed": seed,
                                 "checks": sorted({c for c, _ in problems}),
                                 "details": [f"{c}: {d}" for c, d in problems[:8]]})
            log(f"[{i}/{faults}] {kind} ({target}): {'survived' if survived else 'FAILED'}, settled in {settle:.1f}s; "
                f"audit rows since: {effects or 'none'}" + ("" if survived else f"; {problems[:3]}"))

        time.sleep(2 * HEARTBEAT_S)  # the last frames' resends after the last fault
        missing = _step_records_missing()
        log(f"step records missing: {missing}")
        injected = sum(v["injected"] for v in by_kind.values())
        survived_n = sum(v["survived"] for v in by_kind.values())
        kept = bool(failures) or keep_logs
        return {
            "seed": seed,
            "faults_injected": injected,
            "faults_survived": survived_n,
            "commands_lost": len(checker.lost),
            "commands_duplicated": len(checker.duplicated),
            "step_records_missing": missing,
            "by_kind": by_kind,
            "failures": failures,
            "settle_s_p50": round(statistics.median(settle_times), 1) if settle_times else None,
            "settle_s_max": round(max(settle_times), 1) if settle_times else None,
            "nodes_repaired": repairs,
            "unexpected_exits": stack.unexpected_exits,
            "commands": Command.objects.count(),
            "jobs": Job.objects.count(),
            "jobs_submitted_during_run": churn_n,
            "elapsed_s": round(time.monotonic() - started, 1),
            "logs": str(workdir) if kept else None,
        }
    except BaseException:
        kept = True
        log(f"logs kept in {workdir}")
        raise
    finally:
        stack.stop_all()
        if proxy is not None:
            proxy.close()
        try:
            from django.db import connections

            connections.close_all()
        except Exception:
            pass
        pg.destroy()
        if not kept:
            shutil.rmtree(workdir, ignore_errors=True)


def _step_records_missing() -> dict[str, dict[str, Any]]:
    """Per job, the steps from 1 to its newest stored record that have no stored record (rank 0's
    view, what the agent forwards): how many, and the first gaps (``"12-40"``). A ``steps`` frame
    is kept by the agent until the server acknowledges it stored (docs/control-loop.md), so only
    the kill of an agent (the records it had read and not yet sent die with it) and a clock
    jumped past ``OMNI_TELEMETRY_MAX_FUTURE_S`` (its batches refused) should leave a gap."""
    from jobs.models import Job
    from telemetry.models import StepRecord

    names = dict(Job.objects.values_list("id", "name"))
    steps_of: dict[int, list[int]] = collections.defaultdict(list)
    for job_id, step in (StepRecord.objects.filter(rank=0, step__gte=1).values_list("job_id", "step")
                         .distinct().order_by("job_id", "step")):
        steps_of[job_id].append(step)
    out: dict[str, dict[str, Any]] = {}
    for job_id, steps in steps_of.items():
        gaps, last = [], 0
        for step in steps:
            if step > last + 1:
                gaps.append(f"{last + 1}-{step - 1}" if step > last + 2 else str(last + 1))
            last = step
        if gaps:
            out[names.get(job_id, str(job_id))] = {"missing": steps[-1] - len(steps), "newest": steps[-1],
                                                   "gaps": gaps[:5]}
    return out


def _churn(rng: random.Random, boss, n: int) -> int:
    """What users do between faults: sometimes a new short job, sometimes a cancel."""
    from jobs import actions
    from jobs.models import Job
    from jobs.models.states import IllegalTransition

    submitted = 0
    active = list(Job.objects.filter(state__in=["pending", "running"]).exclude(name__in=["long", "elastic", "crit"]))
    if rng.random() < 0.5 and len(active) < 4:
        actions.submit_job(boss, **_job_spec(f"short-{n:03d}", dp=rng.choice([1, 1, 2]),
                                             total_steps=rng.randrange(15, 40), elastic=rng.random() < 0.5,
                                             priority=rng.choice(["best_effort", "regular"])))
        submitted = 1
    if active and rng.random() < 0.25:
        try:
            actions.cancel_job(rng.choice(active), boss)
        except IllegalTransition:
            pass  # it finished since it was read: refused, as it would be to a user
    return submitted


def _dump_state(path: Path, problems: list[tuple[str, str]]) -> None:
    """For a failed fault, the database rows that explain it (the private cluster goes with the
    run): every job a problem names, with its allocations, commands and audit rows, as JSON."""
    from jobs.models import Allocation, Command, ElasticEvent, Job

    try:
        named = [job for job in Job.objects.all() if any(re.search(rf"\b{re.escape(job.name)}\b", d)
                                                         for _, d in problems)]
        out = {"problems": problems, "jobs": []}
        for job in named:
            out["jobs"].append({
                "name": job.name, "state": job.state, "run_id": job.run_id, "dp": job.dp,
                "committed_steps": job.committed_steps, "total_steps": job.total_steps,
                "last_checkpoint_step": job.last_checkpoint_step, "pending_reason": job.pending_reason,
                "allocations": [f"{node}/gpu{gpu}" for node, gpu in
                                Allocation.objects.filter(job=job).values_list("node__name", "gpu_index")],
                "commands": [{"id": str(c.id), "kind": c.kind, "node": c.node.name, "state": c.state,
                              "attempts": c.attempts, "run_id": c.payload.get("run_id"),
                              "leader": c.payload.get("leader"), "created_at": str(c.created_at),
                              "acked_at": str(c.acked_at), "finished_at": str(c.finished_at),
                              "outcome": c.outcome, "error": c.error}
                             for c in Command.objects.filter(job=job).select_related("node").order_by("created_at")],
                "events": [{"id": e.id, "at": str(e.at), "kind": e.kind, "actor": e.actor,
                            "nodes_before": e.nodes_before, "nodes_after": e.nodes_after,
                            "text": (e.reason or {}).get("text"), "outcome": e.outcome}
                           for e in ElasticEvent.objects.filter(job=job).order_by("id")],
            })
        path.write_text(json.dumps(out, indent=1, default=str))
    except Exception as exc:  # the database may be the thing that failed
        path.write_text(json.dumps({"problems": problems, "error": f"{type(exc).__name__}: {exc}"}))


def _events_since(last_id: int) -> str:
    """The audit rows written since ``last_id``, by kind: what the fault set in motion."""
    from jobs.models import ElasticEvent

    try:
        kinds = collections.Counter(ElasticEvent.objects.filter(id__gt=last_id).values_list("kind", flat=True))
    except Exception:
        return "unknown (database unreachable)"
    return ", ".join(f"{kind} x{n}" for kind, n in sorted(kinds.items()) if kind not in ("ack", "outcome"))


def _planner_lock_held() -> bool:
    from django.db import connection

    from jobs.actions import PLANNER_LOCK_KEY

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 0 AND objid = %s "
                       "AND pid <> pg_backend_pid()", [PLANNER_LOCK_KEY])
        return cursor.fetchone()[0] > 0


def _live_ranks(table: dict[int, tuple[int, dict[str, str]]], stack: Stack) -> list[tuple[str, int]]:
    """(node, pid) of every training process under a real agent: the leaves tagged with a job."""
    ranks = []
    for node in REAL_NODES:
        pids = _descendants(table, stack.pid(f"agent-{node}"))
        parents = {table[p][0] for p in pids if p in table}
        ranks += [(node, p) for p in pids if p in table and table[p][1].get("OMNI_JOB") and p not in parents]
    return ranks


def _wait_for_rank(stack: Stack, timeout_s: float) -> bool:
    """Whether a rank is alive under a real agent within ``timeout_s``: the planner may have every
    job on the simulated nodes for a while (a reclaim, a restart's back-off)."""
    deadline = time.monotonic() + timeout_s
    while not _live_ranks(_process_table(), stack):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)
    return True


def _inject(kind: str, rng: random.Random, stack: Stack, proxy: CuttingProxy, pg: PrivatePostgres, workdir: Path,
            connections) -> tuple[str, str]:
    """Do one fault and the supervisor's restart; return (the kind done, what it hit)."""
    if kind == "kill9_rank":
        table = _process_table()
        ranks = _live_ranks(table, stack)
        if ranks:
            node, pid = rng.choice(ranks)
            job = table[pid][1]["OMNI_JOB"]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return kind, f"rank pid {pid} of {job} on {node}"
        kind = "kill9_agent"  # no rank alive right now: the agent that would host one instead
    if kind == "kill9_celery":
        try:
            mid_pass = bool(wait_for(_planner_lock_held, 4.0, "a planner pass", every_s=0.05))
        except RuntimeError:
            mid_pass = False
        stack.restart("celery")
        return kind, "mid-pass" if mid_pass else "between passes"
    if kind == "kill9_asgi":
        killed_at = time.monotonic()
        stack.restart("daphne")
        wait_for(lambda: answers(stack_port(stack)), 60, "daphne after its restart")
        return kind, f"daphne, answering again after {time.monotonic() - killed_at:.1f}s"
    if kind == "kill9_agent":
        node = rng.choice(REAL_NODES + SIMULATED_NODES)
        stack.restart(f"agent-{node}")
        return kind, f"agent-{node}"
    if kind == "restart_redis":
        stack.kill("redis")
        time.sleep(1.0)
        stack.start("redis")
        return kind, "redis-server"
    if kind == "restart_postgres":
        pg.crash()
        connections.close_all()
        time.sleep(1.0)
        pg.start()
        return kind, "postgres (immediate stop, start)"
    if kind == "cut_socket":
        return kind, proxy.cut(rng)
    if kind == "clock_jump":
        node = rng.choice(REAL_NODES + SIMULATED_NODES)
        offset = rng.choice([-1, 1]) * rng.randrange(30, 3600)
        (workdir / f"clock-{node}").write_text(str(offset))
        return kind, f"agent-{node} clock {offset:+d}s"
    raise ValueError(f"unknown fault kind {kind!r}")


def stack_port(stack: Stack) -> int:
    argv = stack.roles["daphne"].argv
    return int(argv[argv.index("--port") + 1])


def _repair_failed_nodes(boss, stack: Stack) -> int:
    """An operator's part: a node failed while its agent was restarting comes back into service
    once its agent answers again (a failed node stays failed until someone says so)."""
    from django.utils import timezone

    from jobs import actions
    from jobs.models import Node

    recent = timezone.now() - timedelta(seconds=2 * HEARTBEAT_S)
    repaired = 0
    for node in Node.objects.filter(state="failed", last_heartbeat_at__gte=recent):
        log(f"{node.name} was marked failed; repairing it as an operator would")
        actions.mark_node_repaired(node, boss)
        repaired += 1
    return repaired


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seed", type=int, default=None, help="fault schedule seed (default: random, printed)")
    parser.add_argument("--faults", type=int, default=100, help="faults to inject")
    parser.add_argument("--settle-s", type=float, default=45.0, help="how long each fault may take to settle")
    parser.add_argument("--keep-logs", action="store_true", help="keep the run's logs even when every fault survived")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated fault kinds to draw from (default: all of {', '.join(KINDS)})")
    args = parser.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        parser.error(f"--kinds: unknown fault kind {unknown[0]!r} (known: {', '.join(KINDS)})" if unknown
                     else "--kinds: name at least one fault kind")
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    # A timeout's SIGTERM unwinds like Ctrl-C, so the stack and the private services go with us.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    result = run(seed, args.faults, args.settle_s, args.keep_logs, kinds)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>26}: {value}")
    return 0 if result["faults_survived"] == result["faults_injected"] else 1


if __name__ == "__main__":
    sys.exit(main())

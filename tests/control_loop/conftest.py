"""Real processes for the control-loop tests: a daphne ASGI server, a Celery worker with beat,
node agents, and (for the outage test) a private redis-server, all pointed at the pytest-django
test database through DATABASE_URL. Every process runs in its own process group and is killed
at teardown; logs land in the test's tmp dir and are printed when a test fails."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import pytest

from bench import procs

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
HEARTBEAT_S = 1.0
REDIS_TEST_DB = 13


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.2) -> Any:
    """``bench.procs.wait_for``, failing the test (AssertionError) where it raises RuntimeError."""
    try:
        return procs.wait_for(predicate, timeout_s, what, every_s)
    except RuntimeError as exc:
        raise AssertionError(str(exc)) from None


def wait_port(port: int, timeout_s: float = 30.0) -> None:
    def answers() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            return False

    wait_for(answers, timeout_s, f"127.0.0.1:{port} to accept connections")


def run_output(run_dir: Path) -> str:
    """Everything the ranks of every run of a job printed (trainer_agent/rank.py's log files)."""
    out = []
    for path in sorted((run_dir / "logs").glob("*/*/rank-*.*")):
        try:
            out.append(path.read_text(errors="replace"))
        except OSError:
            continue
    return "".join(out)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def kill(self, signum: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.popen.pid, signum)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class Cluster:
    """The processes of one test and the environment they share."""

    tmp: Path
    env: dict[str, str]
    port: int
    procs: list[Proc] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.tmp / f"{name}.log"
        handle = log.open("ab")
        popen = subprocess.Popen(argv, cwd=ROOT, env={**self.env, **(env or {})}, stdout=handle,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        handle.close()
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def start_server(self) -> Proc:
        proc = self.spawn("daphne", [PY, "manage.py", "serve", "--no-loop", "--port", str(self.port)])
        wait_port(self.port)
        return proc

    def start_worker(self, name: str = "celery", env: dict[str, str] | None = None) -> Proc:
        schedule = self.tmp / f"{name}-beat-schedule"
        return self.spawn(name, [
            str(Path(PY).with_name("celery")), "-A", "omniweb", "worker", "-B", "-s", str(schedule),
            "--pool=solo", "-Q", "planner,control,telemetry,celery", "--loglevel=INFO", "-n", f"{name}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ], env)

    def start_agent(self, node: str, token: str, *, gpus: int, simulated: bool = False, name: str | None = None,
                    extra: list[str] | None = None) -> Proc:
        argv = [PY, "-m", "trainer_agent.node", "--server", self.url, f"--token={token}", "--node", node,
                "--simulate-gpus", str(gpus), "--runs-dir", str(self.tmp / "runs")]
        if simulated:
            argv.append("--simulated-workers")
        return self.spawn(name or f"agent-{node}", argv + (extra or []))

    def logs(self) -> str:
        out = []
        for proc in self.procs:
            try:
                text = proc.log.read_text(errors="replace")
            except OSError:
                continue
            out.append(f"----- {proc.name} (last 3000 chars) -----\n{text[-3000:]}")
        return "\n".join(out)

    def story(self) -> str:
        """What the control plane and the runs say happened: each job's state and failure, the
        last audit rows, and per run and node every rank's exit record and torchrun's last lines."""
        from jobs.models import ElasticEvent, Job

        out = ["----- jobs -----"]
        try:
            for job in Job.objects.order_by("name"):
                out.append(f"{job.name}: {job.state} run={job.run_id} failure={job.failure}")
            out.append("----- audit (last 20) -----")
            for event in reversed(ElasticEvent.objects.order_by("-id")[:20]):
                out.append(f"{event.kind} {event.job_name}: {(event.reason or {}).get('text')} "
                           f"outcome={event.outcome}")
        except Exception as exc:  # the story must never hide the failure it explains
            out.append(f"(database unreadable: {exc})")
        for state in sorted((self.tmp / "runs").glob("*/.omni/*/*")):
            exits = [p.read_text(errors="replace") for p in sorted(state.glob("rank-*.exit.json"))]
            out.append(f"----- {state.relative_to(self.tmp)}: exits {exits}")
            log = state.parents[2] / "logs" / state.parent.name / state.name / "torchrun.log"
            if log.exists():
                out.append(log.read_text(errors="replace")[-1500:])
        return "\n".join(out)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def _database_url(settings_dict: dict[str, Any]) -> str:
    user = quote(settings_dict.get("USER") or "")
    password = quote(settings_dict.get("PASSWORD") or "")
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or 5432
    return f"postgres://{auth}{host}:{port}/{settings_dict['NAME']}"


def _redis_url_with_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", "", ""))


@pytest.fixture
def control_cluster(request, transactional_db, tmp_path) -> Iterator[Cluster]:
    """Environment and process bookkeeping for one end-to-end test (processes started by it)."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL")
    redis_url = os.environ.get("OMNI_TEST_REDIS_URL")
    if not redis_url:
        pytest.skip("needs Redis")
    redis_url = _redis_url_with_db(redis_url, REDIS_TEST_DB)
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
        "DATABASE_URL": _database_url(connection.settings_dict),
        "REDIS_URL": redis_url,
        "SECRET_KEY": "omni-control-loop-tests",
        "OMNI_VAR_DIR": str(tmp_path / "var"),
        "OMNI_INPROCESS_LOOP": "0",
        "OMNI_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S),
        "OMNI_HEARTBEAT_MISSES": "3",
        "OMNI_PLANNER_INTERVAL_S": "1",
        "OMNI_COMMAND_ACK_TIMEOUT_S": "3",
        "OMNI_COMMAND_MAX_ATTEMPTS": "3",
        "OMNI_PLANNER_OVERRIDES": '{"startup_s": 1, "reclaim_margin_s": 3, "min_loan_steps": 2}',
        "OMP_NUM_THREADS": "1",
        # Rendezvous ports of this test's jobs: a random block, so suites running side by side
        # on one machine do not pick the same ones, below Linux's ephemeral ports (32768-60999),
        # which any outgoing connection may hold.
        "OMNI_RDZV_PORTS": f"{(base := random.randrange(20000, 32000))}-{base + 199}",
        "LOG_LEVEL": "INFO",
        "PYTHONUNBUFFERED": "1",
    }
    cluster = Cluster(tmp=tmp_path, env=env, port=free_port())
    (tmp_path / "runs").mkdir()
    yield cluster
    cluster.stop_all()
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        print(cluster.logs())
        print(cluster.story())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def boss(transactional_db, django_user_model):
    """A superuser (operator role): may submit critical jobs and reservations."""
    return django_user_model.objects.create_superuser("boss", "boss@example.com", "boss-pass-1234")


def make_node(name: str, gpus: int, rack: str = "r0", switch: str = "r0s0") -> tuple[Any, str]:
    """A node row and its freshly issued agent token."""
    from jobs.models import Node

    node = Node.objects.create(name=name, rack=rack, switch=switch, gpu_count=gpus)
    token = node.issue_token()
    node.save(update_fields=["agent_token_hash"])
    return node, token


def db_fingerprint() -> dict[str, Any]:
    """Everything a refused frame must not change."""
    from jobs.models import Allocation, Command, ElasticEvent, Job, Node

    return {
        "commands": sorted((str(c.id), c.state, c.attempts) for c in Command.objects.all()),
        "events": ElasticEvent.objects.count(),
        "jobs": sorted(Job.objects.values_list("name", "state", "committed_steps", "last_checkpoint_step")),
        "allocations": sorted(Allocation.objects.values_list("node__name", "gpu_index", "job__name")),
        "nodes": sorted(Node.objects.values_list("name", "state")),
    }

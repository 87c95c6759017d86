"""Load on the production shape: ``python -m bench.load --json``.

Starts, on 127.0.0.1 against a scratch PostgreSQL database and a Redis db of its own, what
production runs: two ASGI servers (``manage.py serve --no-loop``, daphne) sharing the
``channels_redis`` layer, two Celery workers (one with beat), and two agent processes playing
``--agents`` virtual nodes (``trainer_agent.node --virtual-nodes``: hello, heartbeats, command
acks, simulated ranks), each half on one server. It then opens ``--browsers`` signed-in
``/ws/live/`` sockets (half on each server, each following the cluster stream and a probe node's)
and measures twice, first quiet (one API client) and then under load (``--users`` locust
researchers for ``--seconds``, bench/locustfile_api.py, split over both servers):

* ``api_p50_ms`` / ``api_p95_ms``   every API request of the locust users (reads and writes);
* ``live_fanout_ms_p95``           a GPU sample POSTed for the probe node (to each server in turn)
                                   until it arrives on a socket, over every (sample, socket);
* ``planner_pass_ms``              median ``PlannerRun.duration_ms`` of the passes in the window;
* ``errors``                       failed requests, dropped or reconnected sockets, undelivered
                                   samples, failed planner passes, nodes taken for silent,
                                   tracebacks in the servers' and workers' logs: must be 0;

with each quiet figure beside it (``*_quiet``) and the ratio load/quiet. Every process is in its
own process group, killed at the end however the bench ends. See docs/load.md.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.procs import answers, free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
LOCUSTFILE = ROOT / "bench" / "locustfile_api.py"
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/omni"
# The bench flushes its Redis db at start and end: one no other part of the project uses.
DEFAULT_REDIS_DB = 12
PROBE_NODE = "load-probe"
_STARTED = time.monotonic()


def _say(message: str) -> None:
    sys.stderr.write(f"[bench.load {time.monotonic() - _STARTED:6.1f}s] {message}\n")
    sys.stderr.flush()


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile, ``q`` in 0..100 (None for no values)."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _ratio(load: float | None, quiet: float | None) -> float | None:
    return round(load / quiet, 2) if load is not None and quiet else None








def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the bench dies, even by SIGKILL (Linux prctl), so
    no server or worker outlives a bench killed by a CI timeout."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: stop_all still ends them on every ordinary exit


class Stack:
    """The bench's processes, each in its own process group, all ended by ``stop_all``."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.env = env
        self.procs: dict[str, subprocess.Popen] = {}

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        with self.log(name).open("ab") as log:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env or self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        self.procs[name] = proc
        return proc

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None and not name.startswith("locust"):
                tail = self.log(name).read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}; its log ends:\n{tail}")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the group: anything it started goes too
            except ProcessLookupError:
                pass
            proc.wait()


# -- the scratch database and Redis db -------------------------------------------------------------


def _server_url(url: str, dbname: str) -> str:
    return url.rsplit("/", 1)[0] + f"/{dbname}"


def create_database(base_url: str, prefix: str) -> str:
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_server_url(base_url, "postgres"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name


def drop_database(base_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(_server_url(base_url, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def flush_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


# -- data --------------------------------------------------------------------------------------


def seed(agents: int, users: int, browsers: int, gpus_per_node: int) -> dict[str, Any]:
    """Nodes with agent tokens, researchers with API tokens and browser sessions, a probe node
    (cordoned, no agent: the bench posts its samples) and some running work, through the actions."""
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from django.test import Client

    from jobs import actions
    from jobs.actions.accounts import issue_api_token
    from jobs.models import Node
    from jobs.roles import RESEARCHER

    user_model = get_user_model()
    operator = user_model.objects.create_superuser("load-operator", "load@example.com", "load-operator-pass-1234")
    researchers = []
    group = Group.objects.get(name=RESEARCHER)
    for i in range(max(users, 1)):
        user = user_model.objects.create_user(f"load-r{i:03d}", password=f"load-r{i:03d}-pass-1234")
        user.groups.add(group)
        researchers.append(user)
    tokens = [issue_api_token(None, user, label="bench.load")[1] for user in researchers]

    virtual = []
    for i in range(agents):
        node = Node.objects.create(name=f"load{i:03d}", rack=f"lr{i // 8}", switch=f"lr{i // 8}s0",
                                   gpu_count=gpus_per_node)
        token = node.issue_token()
        node.save(update_fields=["agent_token_hash"])
        virtual.append({"node": node.name, "token": token, "gpus": gpus_per_node})
    probe = Node.objects.create(name=PROBE_NODE, rack="probe", switch="probe-s0", gpu_count=1)
    probe_token = probe.issue_token()
    probe.save(update_fields=["agent_token_hash"])
    actions.cordon_node(probe, operator)  # no agent answers for it: the planner must not place there

    # Running work before the load: a quarter of the nodes' worth of 8-GPU jobs, and a few queued.
    for i in range(max(1, agents // 4) + 4):
        actions.submit_job(researchers[i % len(researchers)], name=f"seed-{i:03d}", priority="regular", dp=gpus_per_node,
                           dp_min=1, dp_max=gpus_per_node, global_batch=gpus_per_node * 8, micro_batch=1,
                           total_steps=1_000_000, step_s=5.0, checkpoint_every_steps=100, checkpoint_save_s=0.2,
                           checkpoint_load_s=0.2)

    cookies = []
    for i in range(browsers):
        client = Client()
        client.force_login(researchers[i % len(researchers)])
        cookies.append(f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}")
    return {"virtual": virtual, "tokens": tokens, "cookies": cookies, "probe_id": probe.pk,
            "probe_token": probe_token}


# -- browsers and the fan-out probe ----------------------------------------------------------------


class Browsers:
    """The signed-in sockets on /ws/live/, each following the cluster and the probe node, and the
    arrival time of each probe sample on each of them."""

    def __init__(self, probe_id: int) -> None:
        self.probe_id = probe_id
        self.sockets: list[Any] = []
        self.listeners: list[asyncio.Task] = []
        self.arrivals: dict[float, list[float]] = {}
        self.messages = 0
        self.by_event: Counter[str] = Counter()  # frames received, by event, over every socket
        self.drops = 0
        self.closing = False

    async def open(self, ports: list[int], cookies: list[str], parallel: int = 20) -> None:
        from websockets.asyncio.client import connect

        gate = asyncio.Semaphore(parallel)

        async def one(i: int) -> Any:
            port = ports[i % len(ports)]
            async with gate:
                ws = await connect(f"ws://127.0.0.1:{port}/ws/live/", open_timeout=30, max_queue=None,
                                   additional_headers={"Cookie": cookies[i], "Origin": f"http://127.0.0.1:{port}"})
                hello = json.loads(await ws.recv())
                if hello.get("type") != "hello":
                    raise RuntimeError(f"browser socket {i}: expected hello, got {hello}")
                for stream, object_id in (("cluster", None), ("node", self.probe_id)):
                    await ws.send(json.dumps({"action": "subscribe", "stream": stream, "id": object_id}))
                    while True:  # live messages of the first stream may come before the second's reply
                        reply = json.loads(await ws.recv())
                        if reply.get("type") in ("subscribed", "error") and reply.get("stream") == stream:
                            break
                    if reply["type"] != "subscribed":
                        raise RuntimeError(f"browser socket {i}: subscribe {stream} refused: {reply}")
                return ws

        self.sockets = list(await asyncio.gather(*(one(i) for i in range(len(cookies)))))
        self.listeners = [asyncio.create_task(self._listen(ws)) for ws in self.sockets]

    async def _listen(self, ws: Any) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            async for raw in ws:
                now = time.perf_counter()
                self.messages += 1
                message = json.loads(raw)
                self.by_event[message.get("event") or message.get("type") or "?"] += 1
                if message.get("event") != "gpu_samples":
                    continue
                for payload in message.get("batch") or [message.get("payload") or {}]:
                    if payload.get("node") != self.probe_id:
                        continue
                    for point in payload.get("points", []):
                        self.arrivals.setdefault(round(point["at"], 3), []).append(now)
        except ConnectionClosed:
            pass
        if not self.closing:
            self.drops += 1

    async def close(self) -> None:
        self.closing = True
        await asyncio.gather(*(ws.close() for ws in self.sockets), return_exceptions=True)
        for task in self.listeners:
            task.cancel()


def post_probe_sample(port: int, token: str, at: float) -> None:
    """One GPU sample of the probe node through the real ingestion endpoint (agent token)."""
    body = json.dumps({"source": "bench-load", "seq": int(at * 1000),
                       "samples": [{"gpu": 0, "at": at, "util_pct": 50.0, "mem_used_bytes": 1}]}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/telemetry/gpu", data=body, method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}", "X-Omni-Node": PROBE_NODE},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


async def probe_fanout(browsers: Browsers, ports: list[int], token: str, spacing_s: float,
                       until: asyncio.Future) -> dict[str, Any]:
    """Post a probe sample every ``spacing_s`` (servers in turn) until ``until`` is done: each
    delivery's latency, the last socket's per sample, and the deliveries that never came.

    A sample that reaches a server within its live throttle's interval of the one before is held
    and rides with the next (telemetry/ingest/live.py): its wait counts in its latency. So after
    the window one more sample goes to each server, past the interval, to release what is held;
    those are not counted. What has not arrived 10 s later is missing."""
    sent: dict[float, float] = {}
    failed_posts = 0

    async def post(port: int) -> tuple[float, float]:
        nonlocal failed_posts
        at = round(time.time(), 3)
        started = time.perf_counter()
        try:
            await asyncio.to_thread(post_probe_sample, port, token, at)
        except OSError as exc:
            failed_posts += 1
            _say(f"probe sample POST failed: {exc}")
        return at, started

    while not until.done():
        at, started = await post(ports[len(sent) % len(ports)])
        sent[at] = started
        await asyncio.sleep(max(0.0, spacing_s - (time.perf_counter() - started)))
    await asyncio.sleep(spacing_s)
    for port in ports:
        await post(port)
    deadline = time.perf_counter() + 10
    while time.perf_counter() < deadline and any(len(browsers.arrivals.get(at, [])) < len(browsers.sockets)
                                                 for at in sent):
        await asyncio.sleep(0.05)
    deliveries, last, missing = [], [], 0
    for at, started in sent.items():
        got = browsers.arrivals.get(at, [])
        missing += len(browsers.sockets) - len(got)
        deliveries += [(t - started) * 1000 for t in got]
        if got:
            last.append((max(got) - started) * 1000)
    return {"deliveries": deliveries, "last": last, "missing": missing, "failed_posts": failed_posts,
            "samples": len(sent)}


# -- the API load ----------------------------------------------------------------------------------


def locust(stack: Stack, name: str, hosts: list[str], tokens_file: Path, users: int, seconds: int) -> Path:
    """Run the locustfile headless for ``seconds`` with ``users`` users; return its samples file."""
    samples = stack.workdir / f"{name}-samples.jsonl"
    samples.touch()
    env = {**stack.env, "OMNI_LOAD_HOSTS": ",".join(hosts), "OMNI_LOAD_TOKENS": str(tokens_file),
           "OMNI_LOAD_SAMPLES": str(samples)}
    proc = stack.spawn(name, [str(Path(PY).with_name("locust")), "-f", str(LOCUSTFILE), "--headless",
                              "-u", str(users), "-r", str(max(1, users // 2)), "--run-time", f"{seconds}s",
                              "--stop-timeout", "5", "--host", hosts[0], "--only-summary",
                              "--loglevel", "WARNING"], env=env)
    try:
        rc = proc.wait(timeout=seconds + 60)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"locust ({name}) ran past {seconds + 60} s; see {stack.log(name)}") from exc
    if rc not in (0, 1):  # 1: some request failed, counted from the samples
        raise RuntimeError(f"locust ({name}) exited with {rc}:\n{stack.log(name).read_text()[-2000:]}")
    return samples


def read_samples(path: Path) -> tuple[list[float], int, list[str], int]:
    """(latencies ms, requests, the first failures, failure count) of a locust samples file."""
    latencies, failures, failed = [], [], 0
    lines = path.read_text().splitlines()
    for line in lines:
        sample = json.loads(line)
        latencies.append(float(sample["ms"]))
        if sample["error"] or not 200 <= sample["status"] < 300:
            failed += 1
            if len(failures) < 5:
                failures.append(f"{sample['name']}: {sample['status']} {sample['error']}")
    return latencies, len(lines), failures, failed


# -- the run ---------------------------------------------------------------------------------------


def planner_passes(since: datetime, until: datetime) -> tuple[list[float], int]:
    """Durations (ms) of the planner passes that started in [since, until), and how many failed."""
    from jobs.models import PlannerRun

    runs = PlannerRun.objects.filter(started_at__gte=since, started_at__lt=until, duration_ms__isnull=False)
    return [r.duration_ms for r in runs], runs.exclude(error="").count()


def commands_in(since: datetime, until: datetime) -> tuple[list[float], int]:
    """Command written -> agent ack (ms) for the commands written in [since, until), and how many of
    them no agent had acknowledged by the end of the window (piling up, if it grows)."""
    from jobs.models import Command

    commands = Command.objects.filter(created_at__gte=since, created_at__lt=until)
    acks = [(c.acked_at - c.created_at).total_seconds() * 1000 for c in commands.filter(acked_at__isnull=False)]
    return acks, commands.filter(acked_at__isnull=True).count()


async def measure(args, stack: Stack, ports: list[int], data: dict[str, Any], tokens_file: Path,
                  spacing_s: float) -> dict[str, Any]:
    """Open the browsers, then a quiet window (one API user) and a loaded one (``--users``)."""
    from jobs.models import Job, JobState

    hosts = [f"http://127.0.0.1:{port}" for port in ports]
    browsers = Browsers(data["probe_id"])
    started = time.perf_counter()
    await browsers.open(ports, data["cookies"])
    _say(f"{len(browsers.sockets)} browser sockets open in {time.perf_counter() - started:.1f} s")
    phases = {}
    for phase, users, seconds in (("quiet", 1, args.quiet_seconds), ("load", args.users, args.seconds)):
        _say(f"{phase}: {users} API user(s) for {seconds} s, fan-out probes every {spacing_s:.1f} s")
        since = datetime.now(UTC)
        runner = asyncio.ensure_future(asyncio.to_thread(locust, stack, f"locust-{phase}", hosts, tokens_file,
                                                         users, seconds))
        fan = await probe_fanout(browsers, ports, data["probe_token"], spacing_s, runner)
        samples = runner.result()
        until = datetime.now(UTC)
        passes, failed_passes = await asyncio.to_thread(planner_passes, since, until)
        acks, unacked = await asyncio.to_thread(commands_in, since, until)
        latencies, requests, failures, failed = read_samples(samples)
        phases[phase] = {"fan": fan, "latencies": latencies, "requests": requests, "failures": failures,
                         "failed": failed, "passes": passes, "failed_passes": failed_passes, "seconds": seconds,
                         "acks": acks, "unacked": unacked}
        stack.check_alive()
    jobs_running = await asyncio.to_thread(lambda: Job.objects.filter(state=JobState.RUNNING).count())
    sockets_open = len(browsers.sockets) - browsers.drops
    messages = browsers.messages
    by_event = dict(browsers.by_event.most_common())
    drops = browsers.drops
    await browsers.close()
    return {"phases": phases, "sockets_open": sockets_open, "browser_drops": drops, "browser_messages": messages,
            "browser_messages_by_event": by_event, "jobs_running": jobs_running}


def count_in_logs(stack: Stack, prefixes: tuple[str, ...], needle: str) -> int:
    return sum(path.read_text(errors="replace").count(needle) for path in stack.workdir.glob("*.log")
               if path.name.startswith(prefixes))


def run(args) -> dict[str, Any]:
    """Scratch database and Redis db, the stack, the two windows, the figures; always cleans up."""
    base_url = args.database_url or os.environ.get("DATABASE_URL") or DEFAULT_DATABASE_URL
    redis_url = args.redis_url or _server_url(os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0",
                                              str(DEFAULT_REDIS_DB))
    workdir = Path(tempfile.mkdtemp(prefix="omni-bench-load-"))
    dbname = create_database(base_url, args.database_prefix)
    flush_redis(redis_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "DJANGO_"))}
    env.update({
        "DATABASE_URL": _server_url(base_url, dbname), "REDIS_URL": redis_url, "SECRET_KEY": "omni-bench-load-not-secret",
        "OMNI_VAR_DIR": str(workdir / "var"), "OMNI_PLANNER_INTERVAL_S": str(args.planner_interval_s),
        "LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1", "DJANGO_SETTINGS_MODULE": "omniweb.settings",
    })
    os.environ.clear()
    os.environ.update(env)
    stack = Stack(workdir, env)
    ok = False
    try:
        _say(f"migrating scratch database {dbname}")
        subprocess.run([PY, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
        sys.path.insert(0, str(ROOT))
        import django

        django.setup()
        from django.conf import settings

        from jobs.models import Node, NodeState

        data = seed(args.agents, args.users, args.browsers, args.gpus_per_node)
        tokens_file = workdir / "tokens.json"
        tokens_file.write_text(json.dumps(data["tokens"]))
        ports = [free_port(), free_port()]
        for i, port in enumerate(ports):
            stack.spawn(f"daphne{i}", [PY, "manage.py", "serve", "--no-loop", "--host", "127.0.0.1",
                                       "--port", str(port)])
        celery = str(Path(PY).with_name("celery"))
        for i in range(2):
            stack.spawn(f"celery{i}", [celery, "-A", "omniweb", "worker", *(["-B", "-s", str(workdir / "beat")] if i == 0 else []),
                                       "-n", f"load{i}@%h", "--pool=solo", "-Q", "planner,control,telemetry,celery",
                                       "--loglevel=WARNING", "--without-gossip", "--without-mingle",
                                       "--without-heartbeat"])
        for port in ports:
            wait_for(lambda port=port: answers(port) or stack.check_alive(), 90, f"the ASGI server on port {port}")
        halves = [data["virtual"][0::2], data["virtual"][1::2]]
        for i, (port, half) in enumerate(zip(ports, halves, strict=True)):
            if not half:
                continue
            spec = workdir / f"agents{i}.json"
            spec.write_text(json.dumps(half))
            stack.spawn(f"agents{i}", [PY, "-m", "trainer_agent.node", "--server", f"http://127.0.0.1:{port}",
                                       "--virtual-nodes", str(spec), "--runs-dir", str(workdir / "runs"),
                                       "--log-level", "INFO"])
        agent_nodes = Node.objects.exclude(name=PROBE_NODE)
        wait_for(lambda: stack.check_alive() or agent_nodes.filter(last_heartbeat_at__isnull=False).count() == args.agents,
              120, f"all {args.agents} agents' heartbeats")
        _say(f"stack up: 2 ASGI servers ({ports[0]}, {ports[1]}), 2 Celery workers, {args.agents} agents")
        spacing_s = max(settings.OMNI_TELEMETRY_LIVE_INTERVAL_S, 0.25) + 0.1
        measured = asyncio.run(measure(args, stack, ports, data, tokens_file, spacing_s))

        connected = count_in_logs(stack, ("agents",), " connected to ")
        silent_nodes = agent_nodes.filter(state__in=[NodeState.SUSPECT, NodeState.FAILED]).count()
        tracebacks = count_in_logs(stack, ("daphne", "celery"), "Traceback")
        result = summarise(args, measured, connected, silent_nodes, tracebacks)
        ok = result["errors"] == 0  # otherwise the logs stay, for the tracebacks and refusals
        return result
    finally:
        stack.stop_all()
        try:
            from django.db import connections

            connections.close_all()
        except Exception:  # noqa: BLE001 - Django may not have been set up yet
            pass
        drop_database(base_url, dbname)
        flush_redis(redis_url)
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            _say(f"logs kept in {workdir}")


def summarise(args, measured: dict[str, Any], connected: int, silent_nodes: int, tracebacks: int) -> dict[str, Any]:
    quiet, load = measured["phases"]["quiet"], measured["phases"]["load"]
    errors = {
        "api_failed_requests": quiet["failed"] + load["failed"],
        "browser_socket_drops": measured["browser_drops"],
        "agent_reconnects": max(0, connected - args.agents),
        "undelivered_samples": quiet["fan"]["missing"] + load["fan"]["missing"],
        "probe_posts_failed": quiet["fan"]["failed_posts"] + load["fan"]["failed_posts"],
        "planner_passes_failed": quiet["failed_passes"] + load["failed_passes"],
        "nodes_suspect_or_failed": silent_nodes,
        "server_tracebacks": tracebacks,
    }
    figures = {}
    for key, phase in (("", load), ("_quiet", quiet)):
        figures[f"api_p50_ms{key}"] = _ms(_percentile(phase["latencies"], 50))
        figures[f"api_p95_ms{key}"] = _ms(_percentile(phase["latencies"], 95))
        figures[f"live_fanout_ms_p50{key}"] = _ms(_percentile(phase["fan"]["deliveries"], 50))
        figures[f"live_fanout_ms_p95{key}"] = _ms(_percentile(phase["fan"]["deliveries"], 95))
        figures[f"live_fanout_all_sockets_ms_p95{key}"] = _ms(_percentile(phase["fan"]["last"], 95))
        figures[f"planner_pass_ms{key}"] = _ms(_percentile(phase["passes"], 50))
        figures[f"planner_pass_ms_p95{key}"] = _ms(_percentile(phase["passes"], 95))
        figures[f"command_ack_ms_p95{key}"] = _ms(_percentile(phase["acks"], 95))
    return {
        "api_p50_ms": figures["api_p50_ms"],
        "api_p95_ms": figures["api_p95_ms"],
        "errors": sum(errors.values()),
        "live_fanout_ms_p95": figures["live_fanout_ms_p95"],
        "planner_pass_ms": figures["planner_pass_ms"],
        **figures,
        "api_p95_ratio": _ratio(figures["api_p95_ms"], figures["api_p95_ms_quiet"]),
        "live_fanout_p95_ratio": _ratio(figures["live_fanout_ms_p95"], figures["live_fanout_ms_p95_quiet"]),
        "planner_pass_ratio": _ratio(figures["planner_pass_ms"], figures["planner_pass_ms_quiet"]),
        "error_counts": errors,
        "api_failures": (quiet["failures"] + load["failures"])[:5],
        "api_requests": load["requests"],
        "api_requests_quiet": quiet["requests"],
        "api_rps": round(load["requests"] / load["seconds"], 1),
        "api_users": args.users,
        "load_seconds": args.seconds,
        "browsers": args.browsers,
        "browser_sockets_open": measured["sockets_open"],
        "browser_messages": measured["browser_messages"],
        "browser_messages_by_event": measured["browser_messages_by_event"],
        "agents": args.agents,
        "agent_sockets_open": min(connected, args.agents) - silent_nodes,
        "fanout_samples": load["fan"]["samples"],
        "fanout_deliveries": len(load["fan"]["deliveries"]),
        "planner_passes": len(load["passes"]),
        "planner_passes_quiet": len(quiet["passes"]),
        "commands_acked": len(load["acks"]),
        "commands_unacked_at_end": load["unacked"],
        "jobs_running_at_end": measured["jobs_running"],
        "asgi_servers": 2,
        "celery_workers": 2,
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m bench.load --json``."""
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--browsers", type=int, default=200, help="signed-in /ws/live/ sockets")
    parser.add_argument("--agents", type=int, default=100, help="virtual nodes, each an agent socket")
    parser.add_argument("--users", type=int, default=20, help="locust API users under load")
    parser.add_argument("--seconds", type=int, default=60, help="length of the loaded window")
    parser.add_argument("--quiet-seconds", type=int, default=15, help="length of the quiet window before it")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--planner-interval-s", type=float, default=2.0,
                        help="beat's planner tick (OMNI_PLANNER_INTERVAL_S); submits trigger passes too")
    parser.add_argument("--database-url", help=f"PostgreSQL server (default: DATABASE_URL, else {DEFAULT_DATABASE_URL})")
    parser.add_argument("--database-prefix", default="omni_load", help="name prefix of the scratch database")
    parser.add_argument("--redis-url", help=f"Redis db the bench owns and flushes (default: db {DEFAULT_REDIS_DB} "
                                            "on REDIS_URL's server)")
    args = parser.parse_args(argv)
    if args.browsers < 1 or args.agents < 1 or args.users < 1 or args.seconds < 1 or args.quiet_seconds < 1:
        parser.error("--browsers, --agents, --users, --seconds and --quiet-seconds must be at least 1")
    # A SIGTERM (a CI timeout, Ctrl-C's cousin) unwinds through run()'s cleanup like an exception.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>34}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

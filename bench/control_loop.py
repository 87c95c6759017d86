"""Control-loop figures from one real run: ``python -m bench.control_loop --json``.

Starts the real pieces on 127.0.0.1 (daphne; with PostgreSQL and Redis answering, also a Celery
worker with beat against a scratch database, otherwise the embedded mode's in-process loop on
a scratch SQLite file), a process of simulated node agents and one more agent for the node that
will die. It submits a stream of small jobs, then ``kill -9``s the agent holding a long job and
reports, in one JSON object:

``ack_ms_p50`` / ``ack_ms_p95``  planner decision (Command row written) -> agent ``ack`` received;
``detect_s``                     kill -> node marked failed;
``recover_s``                    kill -> the job's workers relaunched elsewhere (resume done);
``recover_first_step_s``         kill -> its first step recorded after the recovery.
See docs/control-loop.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.procs import answers, free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def _wait(predicate, timeout_s: float, what: str):
    """``procs.wait_for`` polling every 50 ms: the figures here are latencies."""
    return wait_for(predicate, timeout_s, what, every_s=0.05)








def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


class Stack:
    """The processes of the run; all in their own process groups, all killed at the end."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.env = env
        self.procs: dict[str, subprocess.Popen] = {}

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = (self.workdir / f"{name}.log").open("ab")
        proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def kill(self, name: str, signum: int = signal.SIGKILL) -> None:
        proc = self.procs.get(name)
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            self.kill(name, signal.SIGTERM)
        time.sleep(1.0)
        for name in list(self.procs):
            self.kill(name, signal.SIGKILL)
            try:
                self.procs[name].wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _scratch_postgres(base_url: str) -> tuple[str, str]:
    import psycopg

    name = f"omni_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(base_url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return base_url.rsplit("/", 1)[0] + f"/{name}", name


def _drop_postgres(base_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(base_url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def run(mode: str, jobs: int, heartbeat_s: float, nodes: int) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="omni-bench-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update({
        "OMNI_VAR_DIR": str(workdir / "var"), "SECRET_KEY": "omni-bench-not-secret",
        "OMNI_HEARTBEAT_INTERVAL_S": str(heartbeat_s), "OMNI_HEARTBEAT_MISSES": "3",
        "OMNI_PLANNER_INTERVAL_S": "1", "OMNI_COMMAND_ACK_TIMEOUT_S": "5", "LOG_LEVEL": "WARNING",
        "OMNI_PLANNER_OVERRIDES": '{"startup_s": 1, "reclaim_margin_s": 2, "min_loan_steps": 2}',
        "PYTHONUNBUFFERED": "1",
    })
    pg_base = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/omni")
    scratch_db = None
    if mode == "services":
        env["DATABASE_URL"], scratch_db = _scratch_postgres(pg_base)
        redis_base = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0").rsplit("/", 1)[0]
        env["REDIS_URL"] = f"{redis_base}/14"
        import redis

        redis.Redis.from_url(env["REDIS_URL"]).flushdb()
    os.environ.update({k: env[k] for k in ("OMNI_VAR_DIR", "SECRET_KEY", "OMNI_HEARTBEAT_INTERVAL_S",
                                           "OMNI_PLANNER_INTERVAL_S", "OMNI_COMMAND_ACK_TIMEOUT_S")})
    for key in ("DATABASE_URL", "REDIS_URL"):
        if key in env:
            os.environ[key] = env[key]
        else:
            os.environ.pop(key, None)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "omniweb.settings")
    stack = Stack(workdir, env)
    failed = False
    try:
        subprocess.run([PY, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
        import django

        django.setup()
        from django.contrib.auth import get_user_model

        from jobs import actions
        from jobs.models import Command, ElasticEvent, EventKind, Job, Node

        user = get_user_model().objects.create_superuser("bench", "bench@example.com", "bench-pass-1234")
        spec = []
        for i in range(nodes):
            node = Node.objects.create(name=f"b{i:02d}", rack=f"r{i // 4}", switch=f"r{i // 4}s0", gpu_count=4)
            token = node.issue_token()
            node.save(update_fields=["agent_token_hash"])
            spec.append({"node": node.name, "token": token, "gpus": 4})
        victim = spec.pop()  # its own agent process, the one that dies
        (workdir / "virtual.json").write_text(json.dumps(spec))

        stack.spawn("daphne", [PY, "manage.py", "serve", "--port", str(port)] + (["--no-loop"] if mode == "services" else []))
        if mode == "services":
            stack.spawn("celery", [str(Path(PY).with_name("celery")), "-A", "omniweb", "worker", "-B",
                                   "-s", str(workdir / "beat-schedule"), "--pool=solo",
                                   "-Q", "planner,control,telemetry,celery", "--loglevel=WARNING",
                                   "--without-gossip", "--without-mingle", "--without-heartbeat"])
        _wait(lambda: answers(port), 60, "the ASGI server")
        url = f"http://127.0.0.1:{port}"
        runs = str(workdir / "runs")
        stack.spawn("agents", [PY, "-m", "trainer_agent.node", "--server", url, "--virtual-nodes",
                               str(workdir / "virtual.json"), "--runs-dir", runs, "--time-scale", "0.25",
                               "--log-level", "WARNING"])
        stack.spawn("victim", [PY, "-m", "trainer_agent.node", "--server", url, f"--token={victim['token']}",
                               "--node", victim["node"], "--simulate-gpus", "4", "--simulated-workers",
                               "--runs-dir", runs, "--time-scale", "0.25", "--log-level", "WARNING"])
        _wait(lambda: Node.objects.filter(last_heartbeat_at__isnull=False).count() == nodes, 60, "every agent")

        # A long job that fills the victim node first (it is the only one free), then a stream
        # of short jobs whose starts and completions give the ack-latency sample.
        others = Node.objects.exclude(name=victim["node"])
        for node in others:
            actions.cordon_node(node, user)
        actions.submit_job(user, name="long", priority="regular", dp=4, global_batch=16, micro_batch=2,
                           total_steps=100000, step_s=0.4, checkpoint_every_steps=5, checkpoint_save_s=0.2,
                           checkpoint_load_s=0.2, min_run_s=0)
        _wait(lambda: Command.objects.filter(job__name="long", kind="start", state="done").exists(), 30,
              "the long job to start")
        for node in Node.objects.exclude(name=victim["node"]):
            actions.uncordon_node(node, user)
        for i in range(jobs):
            actions.submit_job(user, name=f"short-{i:03d}", priority="best_effort", dp=1, global_batch=16,
                               micro_batch=2, total_steps=6, step_s=0.4, checkpoint_every_steps=3,
                               checkpoint_save_s=0.2, checkpoint_load_s=0.2)
            time.sleep(0.15)
        _wait(lambda: Job.objects.filter(name__startswith="short-", state="completed").count() >= jobs * 0.8, 180,
              "most short jobs to complete")
        _wait(lambda: Job.objects.get(name="long").last_checkpoint_step >= 5, 60, "a checkpoint of the long job")

        stack.kill("victim")
        killed_at = time.time()
        failed = _wait(lambda: ElasticEvent.objects.filter(kind=EventKind.NODE_FAILED, job__isnull=True,
                                                           nodes_after=[victim["node"]]).first(),
                       60, "the node failure")
        fault = ElasticEvent.objects.get(kind=EventKind.NODE_FAILED, job__name="long")
        resume_from = fault.outcome["resume_from_step"]
        resumed = _wait(lambda: Command.objects.filter(job__name="long", kind="resume", state="done",
                                                       created_at__gt=failed.at).first(), 120,
                        "the long job's recovery")
        _wait(lambda: Job.objects.get(name="long").committed_steps > resume_from, 60, "a step after recovery")
        first_step_at = time.time()

        acks = [
            (c.acked_at - c.created_at).total_seconds() * 1000.0
            for c in Command.objects.filter(acked_at__isnull=False)
        ]
        dispatch = [
            (c.sent_at - c.created_at).total_seconds() * 1000.0
            for c in Command.objects.filter(acked_at__isnull=False, sent_at__isnull=False)
        ]
        return {
            "mode": mode,
            "dispatch_ms_p50": round(_percentile(dispatch, 0.50), 1),
            "nodes": nodes,
            "jobs": jobs + 1,
            "commands_acked": len(acks),
            "ack_ms_p50": round(_percentile(acks, 0.50), 1),
            "ack_ms_p95": round(_percentile(acks, 0.95), 1),
            "ack_ms_mean": round(statistics.fmean(acks), 1) if acks else None,
            "heartbeat_interval_s": heartbeat_s,
            "heartbeat_misses": 3,
            "detect_s": round(failed.at.timestamp() - killed_at, 2),
            "recover_s": round(resumed.finished_at.timestamp() - killed_at, 2),
            "recover_first_step_s": round(first_step_at - killed_at, 2),
            "resumed_from_step": resume_from,
            "recovered_on": resumed.node.name,
        }
    except BaseException:
        failed = True
        print(f"bench: logs kept in {workdir}", file=sys.stderr)
        raise
    finally:
        stack.stop_all()
        if scratch_db:
            from django.db import connections

            connections.close_all()
            _drop_postgres(pg_base, scratch_db)
        if not failed:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.control_loop", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--mode", choices=("auto", "services", "embedded"), default="auto",
                        help="services: PostgreSQL + Redis + Celery; embedded: SQLite + in-process loop")
    parser.add_argument("--jobs", type=int, default=40, help="short jobs submitted for the latency sample")
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--heartbeat-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    mode = args.mode
    if mode == "auto":
        mode = "services" if answers(5432) and answers(6379) else "embedded"
    result = run(mode, args.jobs, args.heartbeat_s, args.nodes)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>22}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

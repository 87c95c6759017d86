"""Workload launch and stop figures from real runs: ``python -m bench.workloads --json``.

Starts the control plane in embedded mode (daphne with the in-process planner loop on a scratch
SQLite file) and two real node agents of 2 simulated GPUs each, and runs
``examples/signal_script/train.py`` in signal mode through them, several times:

``launch_1node_s``   start command written -> every rank's process running (dp=2, one node);
``launch_2node_s``   the same for dp=4 over both nodes (one torchrun per node, c10d rendezvous);
``sigterm_release_s`` preempt command received by the agent (SIGTERM sent) -> the job's GPUs
                     released in the database (the ranks saved and exited; signal mode);
``sigterm_exit_s``   the agent's part of it: SIGTERM sent -> its torchrun exited.

The baseline, measured in the same run on the same machine: the same script started by plain
``torchrun`` (``--standalone`` for one node; two torchruns with a c10d rendezvous for two) to
every rank running, and SIGTERM to the ranks -> torchrun exited. Each figure is the median of
``--runs`` runs; the ratios say what the control plane adds. See docs/workloads.md.
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
from pathlib import Path
from typing import Any

from bench.control_loop import PY, ROOT, Stack, _answers, _free_port, _wait

EXAMPLE = ROOT / "examples" / "signal_script" / "train.py"


def _ranks(state_dirs: list[Path]) -> list[dict[str, Any]]:
    out = []
    for directory in state_dirs:
        for path in directory.glob("rank-*.json"):
            if path.name.endswith(".exit.json"):
                continue
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
    return out


def _all_running(state_dirs: list[Path], count: int) -> float | None:
    """When the last of ``count`` ranks started (wall clock), once all have."""
    ranks = _ranks(state_dirs)
    return max(r["started_at"] for r in ranks) if len(ranks) >= count else None


def _trained(log_dirs: list[Path], steps: int = 3) -> bool:
    """Whether rank 0 has printed ``step N`` (the script is past its start-up)."""
    for directory in log_dirs:
        path = directory / "rank-0.out"
        if path.exists() and f"step {steps} " in path.read_text(errors="replace"):
            return True
    return False


# -- the baseline: plain torchrun ------------------------------------------------------------


def baseline_launch(workdir: Path, nodes: int, gpus: int, env: dict[str, str], run: int) -> tuple[float, float]:
    """Plain torchrun: (start -> all ranks running, SIGTERM -> torchrun exited)."""
    from trainer_agent.launch import RunPaths, rank_env, torchrun_argv

    run_id = f"baseline-{nodes}-{run}"
    placement = [{"node": f"b{i}", "gpus": list(range(gpus)), "address": "127.0.0.1"} for i in range(nodes)]
    payload = {"job": run_id, "run_id": run_id, "placement": placement,
               "rdzv": {"host": "127.0.0.1", "port": _free_port()}, "dp": nodes * gpus, "accum": 1,
               "micro_batch": 32 // (nodes * gpus), "global_batch": 32, "total_steps": 100000,
               "workload": {"entrypoint": [str(EXAMPLE), "--step-s", "0.2"], "integration": "signal"}}
    procs, state_dirs, log_dirs = [], [], []
    started = time.time()
    for entry in placement:
        paths = RunPaths.of(workdir / "baseline", run_id, run_id, entry["node"])
        for directory in (paths.checkpoint_dir, paths.log_dir, paths.state_dir):
            directory.mkdir(parents=True, exist_ok=True)
        state_dirs.append(paths.state_dir)
        log_dirs.append(paths.log_dir)
        procs.append(subprocess.Popen(
            torchrun_argv(payload, entry["node"], PY), cwd=paths.run_dir,
            env=rank_env(payload, entry["node"], paths, env, device="cpu"),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
    running_at = _wait(lambda: _all_running(state_dirs, nodes * gpus), 180, "the baseline's ranks")
    _wait(lambda: _trained(log_dirs), 180, "the baseline's first steps")  # past start-up, as measured
    term_at = time.time()
    for rank in _ranks(state_dirs):
        os.kill(rank["pid"], signal.SIGTERM)
    for proc in procs:
        proc.wait(timeout=120)
    return running_at - started, time.time() - term_at


# -- through Omni ----------------------------------------------------------------------------


def omni_runs(workdir: Path, runs: int, env: dict[str, str]) -> dict[str, list[float]]:
    port = _free_port()
    env = {**env, "OMNI_VAR_DIR": str(workdir / "var"), "SECRET_KEY": "omni-bench-not-secret",
           "OMNI_HEARTBEAT_INTERVAL_S": "1", "OMNI_PLANNER_INTERVAL_S": "0.5", "LOG_LEVEL": "WARNING",
           "OMNI_PLANNER_OVERRIDES": '{"startup_s": 1, "reclaim_margin_s": 2, "min_loan_steps": 2}'}
    for key in ("DATABASE_URL", "REDIS_URL"):
        env.pop(key, None)
        os.environ.pop(key, None)
    os.environ.update({k: env[k] for k in ("OMNI_VAR_DIR", "SECRET_KEY")})
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "omniweb.settings")
    stack = Stack(workdir, env)
    out: dict[str, list[float]] = {"launch_1node_s": [], "launch_2node_s": [], "sigterm_release_s": [],
                                   "sigterm_exit_s": []}
    try:
        subprocess.run([PY, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
        import django

        django.setup()
        from django.contrib.auth import get_user_model

        from jobs import actions
        from jobs.models import Command, ElasticEvent, EventKind, Job, Node

        user = get_user_model().objects.create_superuser("bench", "bench@example.com", "bench-pass-1234")
        tokens = {}
        for name in ("w1", "w2"):
            node = Node.objects.create(name=name, rack="r0", switch="r0s0", gpu_count=2)
            tokens[name] = node.issue_token()
            node.save(update_fields=["agent_token_hash"])
        stack.spawn("daphne", [PY, "manage.py", "serve", "--port", str(port)])
        _wait(lambda: _answers(port), 60, "the ASGI server")
        for name, token in tokens.items():
            stack.spawn(f"agent-{name}", [PY, "-m", "trainer_agent.node", "--server", f"http://127.0.0.1:{port}",
                                          f"--token={token}", "--node", name, "--simulate-gpus", "2",
                                          "--runs-dir", str(workdir / "runs"), "--log-level", "WARNING"])
        _wait(lambda: Node.objects.filter(last_heartbeat_at__isnull=False).count() == 2, 60, "both agents")

        def launch(name: str, dp: int) -> tuple[Job, float]:
            job = actions.submit_job(user, name=name, priority="regular", dp=dp, global_batch=32,
                                     micro_batch=32 // dp, total_steps=100000, step_s=0.2,
                                     entrypoint=[str(EXAMPLE), "--step-s", "0.2"], integration="signal",
                                     grace_s=30.0)
            start = _wait(lambda: Command.objects.filter(job=job, kind="start").order_by("created_at").first(), 60,
                          f"{name} to be placed")
            job.refresh_from_db()
            run_dir = workdir / "runs" / name / ".omni" / job.run_id
            state_dirs = [run_dir / n for n in ("w1", "w2")]
            running_at = _wait(lambda: _all_running(state_dirs, dp), 180, f"{name}'s ranks")
            log_dirs = [workdir / "runs" / name / "logs" / job.run_id / n for n in ("w1", "w2")]
            _wait(lambda: _trained(log_dirs), 180, f"{name}'s first steps")
            return job, running_at - start.created_at.timestamp()

        for run in range(runs):
            print(f"bench.workloads: run {run + 1}/{runs}", file=sys.stderr, flush=True)
            one, took = launch(f"one-{run}", 2)
            out["launch_1node_s"].append(took)
            node = Node.objects.get(allocations__job=one, allocations__gpu_index=0)
            actions.drain_node(node, user)
            preempt = _wait(lambda j=one: Command.objects.filter(job=j, kind="preempt", acked_at__isnull=False).first(),
                            60, "the preempt to reach the agent")
            released = _wait(lambda j=one: ElasticEvent.objects.filter(kind=EventKind.OUTCOME, job_name=j.name,
                                                                       outcome__kind="preempt").first(), 120,
                             "the GPUs to be released")
            out["sigterm_release_s"].append(released.at.timestamp() - preempt.acked_at.timestamp())
            out["sigterm_exit_s"].append(float(released.outcome.get("exit_s") or 0.0))
            actions.cancel_job(Job.objects.get(pk=one.pk), user)
            actions.uncordon_node(Node.objects.get(pk=node.pk), user)

            two, took = launch(f"two-{run}", 4)
            out["launch_2node_s"].append(took)
            actions.cancel_job(Job.objects.get(pk=two.pk), user)
            _wait(lambda j=two: not Job.objects.get(pk=j.pk).allocations.exists(), 30, "the cancel")
            time.sleep(2.0)
        return out
    finally:
        stack.stop_all()


def run(runs: int) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="omni-bench-workloads-"))
    env = {k: v for k, v in os.environ.items()}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    ok = False
    try:
        base: dict[str, list[float]] = {"launch_1node_s": [], "launch_2node_s": [], "sigterm_release_s": []}
        for run_index in range(runs):
            launch_s, term_s = baseline_launch(workdir, 1, 2, env, run_index)
            base["launch_1node_s"].append(launch_s)
            base["sigterm_release_s"].append(term_s)
            launch_s, _ = baseline_launch(workdir, 2, 2, env, run_index)
            base["launch_2node_s"].append(launch_s)
        omni = omni_runs(workdir, runs, env)
        result: dict[str, Any] = {"runs": runs, "script": "examples/signal_script/train.py (signal mode)",
                                  "machine_cpus": os.cpu_count()}
        for key in ("launch_1node_s", "launch_2node_s", "sigterm_release_s"):
            omni_median, base_median = statistics.median(omni[key]), statistics.median(base[key])
            result[key] = round(omni_median, 3)
            result[f"{key}_baseline"] = round(base_median, 3)
            result[f"{key}_ratio"] = round(omni_median / base_median, 2) if base_median > 0 else None
            result[f"{key}_all"] = [round(v, 3) for v in omni[key]]
        # The agent's own view of the same stop: SIGTERM sent -> its torchrun exited.
        result["sigterm_exit_s"] = round(statistics.median(omni["sigterm_exit_s"]), 3)
        ok = True
        return result
    finally:
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"bench: logs kept in {workdir}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.workloads", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--runs", type=int, default=3, help="runs of each measurement (median reported)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        print("bench.workloads: error: --runs must be at least 1", file=sys.stderr)
        return 2
    result = run(args.runs)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

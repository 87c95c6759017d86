"""Measured-rhythm benchmark: ``python -m bench.rhythm --json [--steps N]``.

Real runs of the reference trainer (``python -m trainer_agent.train``, 2 CPU ranks, gloo), their
step records folded into ``jobs.rhythm.RhythmState`` one by one as the control plane does, and
the planner pass with and without what was measured. One JSON object with
- ``step_pred_err_p50``, ``step_pred_err_p95``: relative error of the predicted step time (the
  window's mean, what the planner plans on before its safety factor), on a plain run; baseline in
  the same run: ``last_value_err_p50``/``p95``, predicting each step by the one before it; and
  ``next10_pred_err_p50``/``p95``, the same mean predicting the time of the next 10 steps;
- ``straggler_detect_steps``, ``straggler_detect_s``: steps (and seconds of training) until a
  rank slowed 2x (``--slow-rank 1 --slow-factor 2``) is flagged at the planner's straggler
  factor; baseline in the same run: ``false_stragglers_plain``, ranks flagged in the plain run;
- ``ms_10240_measured``, ``ms_10240_spec``: CPU milliseconds of one planner pass on bench.planner's
  10,240-GPU snapshot with every running job's 200 measured step times, an idle phase and 2%
  of nodes measured slow, and on the same snapshot planned on the submitted values (medians).
Targets (docs/rhythm.md): p95 < 0.10, detection < 50 steps, measured pass < 250 ms.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.planner import build_snapshot, time_pass
from jobs.planner import IdlePhase, PlannerConfig, Rhythm
from jobs.rhythm import RhythmState

ROOT = Path(__file__).resolve().parents[1]


def reference_run(run_dir: Path, steps: int, model: str, *extra: str) -> list[dict[str, Any]]:
    """The reference trainer for ``steps`` steps at DP 2; its step records."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    command = [sys.executable, "-m", "trainer_agent.train", "--run-dir", str(run_dir), "--steps", str(steps),
               "--dp", "2", "--checkpoint-every", str(steps), "--model", model, *extra]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"bench.rhythm: the reference run failed: {done.stderr[-2000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def prediction_errors(records: list[dict[str, Any]], warmup: int = 5) -> dict[str, float]:
    state = RhythmState()
    state.observe(records[:warmup], dp=2)
    state.errors.clear()
    last = [abs(b["step_s"] - a["step_s"]) / b["step_s"] for a, b in zip(records[warmup - 1:], records[warmup:], strict=False)]
    state.observe(records[warmup:], dp=2)
    p50, p95 = state.error_percentiles()
    ordered = sorted(last)
    # What the planner's times rest on is rather the sum of many steps (a reclaim lead, a loan
    # window, the rest of a run): the error of the window mean predicting the next 10 steps.
    times = [r["step_s"] for r in records]
    window = []
    for i in range(warmup + 10, len(times) - 10):
        predicted = statistics.fmean(times[max(0, i - 200):i]) * 10
        actual = sum(times[i:i + 10])
        window.append(abs(actual - predicted) / actual)
    window.sort()
    return {"step_pred_err_p50": round(p50, 4), "step_pred_err_p95": round(p95, 4),
            "last_value_err_p50": round(statistics.median(ordered), 4),
            "last_value_err_p95": round(ordered[int(0.95 * (len(ordered) - 1))], 4), "steps_scored": len(state.errors),
            "next10_pred_err_p50": round(statistics.median(window), 4),
            "next10_pred_err_p95": round(window[int(0.95 * (len(window) - 1))], 4)}


def detection(records: list[dict[str, Any]], factor: float) -> tuple[int | None, float | None]:
    """The first step at which a rank is a straggler, and the training seconds until then."""
    state = RhythmState()
    elapsed = 0.0
    for record in records:
        state.observe([record], dp=2)
        elapsed += record["step_s"]
        if state.stragglers(factor):
            return record["step"], elapsed
    return None, None


def planner_passes(repeats: int, seed: int = 0) -> dict[str, float]:
    measured = build_snapshot(10, seed)
    rng = random.Random(seed)
    jobs = tuple(dataclasses.replace(j, idle_phases=(IdlePhase(rng.choice((50, 100, 200)), rng.uniform(30, 300)),))
                 if j.holdings else j for j in measured.jobs)
    nodes = tuple(dataclasses.replace(n, speed_factor=2.0) if rng.random() < 0.02 else n for n in measured.nodes)
    measured = dataclasses.replace(measured, jobs=jobs, nodes=nodes)
    spec = dataclasses.replace(measured, jobs=tuple(dataclasses.replace(j, rhythm=Rhythm(), idle_phases=())
                                                    for j in measured.jobs),
                               nodes=tuple(dataclasses.replace(n, speed_factor=1.0) for n in measured.nodes))
    out = {}
    for name, snapshot in (("measured", measured), ("spec", spec)):
        cpu_ms, _wall_ms, actions = time_pass(snapshot, repeats)
        out[f"ms_10240_{name}"] = round(cpu_ms, 2)
        out[f"actions_10240_{name}"] = actions
    out["gpus"] = sum(n.gpus for n in measured.nodes)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the figures."""
    parser = argparse.ArgumentParser(prog="python -m bench.rhythm", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (the only output format)")
    parser.add_argument("--steps", type=int, default=120, help="steps of each reference run")
    parser.add_argument("--repeats", type=int, default=5, help="planner passes timed per snapshot")
    parser.add_argument("--model", choices=("tiny", "small"), default="small", help="the reference model preset")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    factor = PlannerConfig().straggler_factor
    with tempfile.TemporaryDirectory(prefix="omni-bench-rhythm-") as tmp:
        plain = reference_run(Path(tmp) / "plain", args.steps, args.model)
        slowed = reference_run(Path(tmp) / "slow", args.steps, args.model, "--slow-rank", "1", "--slow-factor", "2")
    steps, seconds = detection(slowed, factor)
    false_plain, _ = detection(plain, factor)
    report: dict[str, Any] = {
        **prediction_errors(plain),
        "straggler_detect_steps": steps, "straggler_detect_s": round(seconds, 2) if seconds is not None else None,
        "false_stragglers_plain": 0 if false_plain is None else 1, "straggler_factor": factor,
        "slow_rank_compute_ratio_median": round(statistics.median(
            r["rank_compute_s"][1] / r["rank_compute_s"][0] for r in slowed if r["rank_compute_s"][0] > 0), 2),
        "mean_step_s_plain": round(statistics.mean(r["step_s"] for r in plain), 4), "model": args.model,
        **planner_passes(args.repeats),
        "cpus": os.cpu_count(),
    }
    report["bench_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

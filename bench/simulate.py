"""Benchmark: replay a 7-day, ~1,000-GPU, 5,000+-job scenario under the planner.

``python -m bench.simulate --json`` replays ``jobs/scenarios/philly-week.json`` (the trace-driven
week built by ``manage.py import_trace philly``) when it exists, otherwise a synthetic week
generated here with the same shape (1,024 GPUs, 5,200 jobs with Poisson arrivals and trace-like
sizes and durations, two reservations, a few node faults), under every policy by default
(``--policy NAME`` for one). Prints one JSON object: ``philly_week_all_s``, the CPU seconds of
all the policies' replays together (one core's work, steadier on a shared machine than wall
time; target: at most 120), the per-policy wall and CPU times and headline metrics beside it
(with ``where_pct``: where the policy's healthy GPU-seconds went),
and each policy's CPU time over ``static``'s (the baseline measured in the same run), and
``omni_verdict``: on how many of the figures the issue races the peers on omni leads or ties,
the ones it does not with the best peer's value, and whether its two bounds hold
(``jobs.simulator.verdict``; worked out after the timed replays).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

from jobs.simulator import parse_scenario, simulate
from jobs.simulator.policies import POLICIES
from jobs.simulator.results import where_gpu_s_went
from jobs.simulator.scenario import ScenarioError, load_scenario
from jobs.simulator.verdict import verdict

PHILLY = Path(__file__).resolve().parents[1] / "jobs" / "scenarios" / "philly-week.json"
WEEK_S = 7 * 86400
TARGET_ALL_S = 120.0  # issue 15: every policy's replay of the week, together, on one core


def synthetic_week(seed: int = 0, jobs: int = 5200) -> dict[str, Any]:
    """A 7-day scenario on 1,024 GPUs with ``jobs`` jobs (see the module docstring)."""
    rng = random.Random(seed)
    out = []
    t = 0.0
    mean_gap = WEEK_S * 0.95 / jobs
    for i in range(jobs):
        t += rng.expovariate(1.0 / mean_gap)
        gpus = rng.choice((1, 1, 1, 2, 4, 8, 8, 16, 32))
        tp = min(gpus, 8)
        dp = max(1, gpus // tp)
        r = rng.random()
        priority = "regular" if r < 0.55 else "best_effort"
        step_s = rng.uniform(0.5, 4.0)
        duration = min(3 * 86400.0, math.exp(rng.gauss(math.log(3600), 1.2)))
        micro = 2
        out.append({
            "name": f"job{i:05d}", "priority": priority, "submit_s": round(t, 1), "tp": tp, "dp": dp,
            "dp_min": max(1, dp // 2), "dp_max": dp * 2 if dp > 1 else 1, "global_batch": micro * 4 * dp * 2,
            "micro_batch": micro, "total_steps": max(10, int(duration / step_s)), "step_s": round(step_s, 3),
            "checkpoint": {"every_steps": 500, "save_s": 20, "load_s": 40},
        })
    out.append({"name": "crit-a", "priority": "critical", "tp": 8, "dp": 8, "global_batch": 1024,
                "micro_batch": 8, "total_steps": 10_000_000, "step_s": 3.0,
                "checkpoint": {"every_steps": 300, "save_s": 30, "load_s": 60}})
    out.append({"name": "crit-b", "priority": "critical", "tp": 8, "dp": 4, "global_batch": 512,
                "micro_batch": 8, "total_steps": 10_000_000, "step_s": 2.0,
                "checkpoint": {"every_steps": 300, "save_s": 25, "load_s": 50}})
    return {
        "name": "synthetic-week", "horizon_s": WEEK_S, "seed": seed,
        "comment": "Synthetic 7-day, 1,024-GPU, 5,200-job week for the simulator benchmark.",
        "cluster": {"racks": 4, "switches_per_rack": 4, "nodes_per_switch": 8, "gpus_per_node": 8},
        "jobs": out,
        "reservations": [
            {"name": "crit-a-res", "job": "crit-a", "gpus": 64, "spares": 8, "start_s": 86400},
            {"name": "crit-b-hourly", "job": "crit-b", "gpus": 32, "period_s": 3600, "active_s": 2400},
        ],
        "events": [{"at_s": 200_000 + k * 90_000, "kind": "node_down", "node": f"r{k % 4}s1n2"} for k in range(4)]
        + [{"at_s": 210_000 + k * 90_000, "kind": "node_up", "node": f"r{k % 4}s1n2"} for k in range(4)],
    }


def replay(scenario: Any, policy: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One policy's replay: its wall and CPU seconds and headline figures, and its whole result
    (for the verdict)."""
    t0, c0 = time.perf_counter(), time.process_time()
    result = simulate(scenario, policy)
    return {
        "wall_s": round(time.perf_counter() - t0, 3),
        "cpu_s": round(time.process_time() - c0, 3),
        "planner_calls": result["planner_calls"],
        "utilization": result["utilization"],
        "reservation_shortfall": result["reservation_shortfall"],
        "lost_gpu_s": result["lost_gpu_s"],
        "invariant_violations": len(result["invariant_violations"]),
        # Where the healthy GPU-seconds went, in % (``results.where_gpu_s_went``).
        "where_pct": {k: round(v * 100, 3) for k, v in (where_gpu_s_went(result) or {}).items()},
    }, result


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the result."""
    parser = argparse.ArgumentParser(prog="bench.simulate", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--policy", default="all", choices=("all", *POLICIES),
                        help="replay under one policy (default: all of them, for philly_week_all_s)")
    parser.add_argument("--synthetic", action="store_true", help="use the synthetic week even if the trace week exists")
    parser.add_argument("--scenario", type=Path, help="replay this scenario file instead of the week")
    args = parser.parse_args(argv)
    if args.scenario is not None:
        try:
            scenario = load_scenario(args.scenario)
        except ScenarioError as exc:
            parser.exit(2, f"bench.simulate: {exc}\n")
        source = str(args.scenario)
    elif PHILLY.exists() and not args.synthetic:
        scenario = load_scenario(PHILLY)
        source = str(PHILLY.relative_to(PHILLY.parents[2]))
    else:
        scenario = parse_scenario(synthetic_week())
        source = "synthetic"
    policies = POLICIES if args.policy == "all" else (args.policy,)
    runs = {}
    results: list[dict[str, Any]] = []
    for policy in policies:
        if not args.json:
            print(f"replaying under {policy} ...", flush=True)
        runs[policy], result = replay(scenario, policy)
        results.append(result)
    out: dict[str, Any] = {
        "scenario": scenario.name,
        "source": source,
        "gpus": scenario.total_gpus,
        "jobs": len(scenario.jobs),
        "horizon_days": round(scenario.horizon_s / 86400, 2),
    }
    if len(runs) == 1:
        out.update({"policy": policies[0], **runs[policies[0]]})
    else:
        total = sum(r["cpu_s"] for r in runs.values())
        out.update({
            "philly_week_all_s": round(total, 2),
            "philly_week_all_wall_s": round(sum(r["wall_s"] for r in runs.values()), 2),
            "target_s": TARGET_ALL_S,
            "within_target": total <= TARGET_ALL_S,
            "cpu_s_by_policy": {p: r["cpu_s"] for p, r in runs.items()},
            "cpu_ratio_to_static": {p: round(r["cpu_s"] / max(runs["static"]["cpu_s"], 1e-9), 2)
                                    for p, r in runs.items()},
            "policies": runs,
        })
        found = verdict(results)
        if found is not None:
            out["omni_verdict"] = {
                "ahead_or_level": found["ahead"], "figures": found["of"],
                "behind": {r["figure"]: {"omni": r["omni"], r["best_peer"]: r["best_peer_value"]}
                           for r in found["behind"]},
                "bounds_met": all(b["met"] for b in found["bounds"]),
            }
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:>22}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

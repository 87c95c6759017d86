"""Benchmark: one planner pass at 1,024 and at 10,240 GPUs.

``python -m bench.planner --json`` builds a synthetic but realistic snapshot for each size
(pods of 1,024 GPUs on 8-GPU nodes with 200 jobs each: 10% critical, 50% regular, 40%
best-effort; sizes as in public traces, mostly 1-8 GPUs with a tail to 64 (TP 1-8, PP 1-2,
DP 1-8), elastic bounds; about 85% of the unreserved GPUs held, the remaining jobs waiting;
per pod one active reservation with a hot spare and one future reservation lent out; 200
measured step times per running job). The 10,240-GPU case is ten such pods, 2,000 jobs. It times
``plan()`` several times (after one warm-up pass) and prints one JSON object with the median
CPU milliseconds of one pass, ``ms_1024`` and ``ms_10240``, their ``ratio``, and the wall-clock
medians; ``ms_10240_teams`` is the 10,240-GPU case shared by 50 teams (``with_teams``: quotas,
borrowing limits, fair share), in the same run. Targets: under 250 ms at 10,240 GPUs on one
core (with teams too), ratio under 12.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from dataclasses import replace

from jobs.planner import (
    CheckpointSpec,
    Gpu,
    Holding,
    Job,
    Node,
    PlannerConfig,
    Reservation,
    Rhythm,
    Snapshot,
    plan,
)
from jobs.planner.snapshot import Team

NOW_S = 1_764_460_800.0  # production clocks are Unix seconds


def build_pod(pod: int, rng: random.Random, jobs: int = 200) -> tuple[list[Node], list[Job], list[Reservation]]:
    """One 1,024-GPU pod: 4 racks x 4 switches x 8 nodes x 8 GPUs, ``jobs`` jobs, 2 pools."""
    p = f"p{pod:02d}"
    nodes = [
        Node(f"{p}r{r}s{s}n{n}", f"{p}r{r}", f"{p}r{r}s{s}", 8)
        for r in range(4) for s in range(4) for n in range(8)
    ]
    # Two reservation pools of 4 nodes (3 guaranteed + 1 spare) at the end of the pod: one
    # active with its owner running, one starting in two hours and lent out meanwhile.
    pools = [[n.name for n in nodes[-4:]], [n.name for n in nodes[-8:-4]]]
    reservations = [
        Reservation(f"{p}-res-now", f"{p}-crit-owner", gpus=24, spares=8, start_s=NOW_S - 600.0,
                    nodes=tuple(pools[0])),
        Reservation(f"{p}-res-later", f"{p}-crit-later", gpus=32, start_s=NOW_S + 7200.0,
                    nodes=tuple(pools[1])),
    ]
    pooled = set(pools[0]) | set(pools[1])
    general = [n.name for n in nodes if n.name not in pooled]
    free_slots = {name: list(range(8)) for name in general}

    def take(tp: int, groups: int, where: list[str]) -> list[Gpu] | None:
        out: list[Gpu] = []
        for name in where:
            slots = free_slots.get(name, [])
            while len(slots) >= tp and groups > 0:
                out.extend(Gpu(name, slots.pop(0)) for _ in range(tp))
                groups -= 1
            if groups == 0:
                return out
        for g in out:
            free_slots[g.node].append(g.index)
            free_slots[g.node].sort()
        return None

    def make(name: str, priority: str, tp: int, pp: int, dp: int, holdings: tuple[Holding, ...]) -> Job:
        step = rng.uniform(0.5, 8.0)
        ring = tuple(step * rng.gauss(1.0, 0.02) for _ in range(200)) if holdings else ()
        committed = rng.randrange(0, 5000)
        micro = rng.choice((1, 2, 4))
        dp_max = dp * rng.choice((1, 2))
        return Job(
            name=name, priority=priority, tp=tp, pp=pp, dp=dp, dp_min=max(1, dp // 2), dp_max=dp_max,
            global_batch=micro * 8 * dp_max, micro_batch=micro,
            total_steps=committed + rng.randrange(1000, 100_000), step_s=step, comm_fraction=0.1,
            checkpoint=CheckpointSpec(every_steps=500, save_s=rng.uniform(10, 60), load_s=rng.uniform(20, 120)),
            min_run_s=7200.0 if priority == "regular" else 0.0,
            submit_s=NOW_S - rng.uniform(0, 86400),
            phase="running" if holdings else "pending",
            committed_steps=committed, last_checkpoint_step=committed - committed % 500,
            run_started_s=NOW_S - rng.uniform(0, 20000) if holdings else None,
            queued_since_s=None if holdings else NOW_S - rng.uniform(0, 20000),
            holdings=holdings, rhythm=Rhythm(step_s=ring),
        )

    out: list[Job] = []
    owner_gpus = take_pool = [Gpu(n, i) for n in pools[0][:3] for i in range(8)]
    del take_pool
    out.append(make(f"{p}-crit-owner", "critical", 8, 1, 3, tuple(Holding(g) for g in owner_gpus)))
    lent = tuple(Holding(Gpu(n, i), f"{p}-res-later") for n in pools[1][:2] for i in range(8))
    out.append(make(f"{p}-borrower", "best_effort", 8, 1, 2, lent))
    out.append(make(f"{p}-crit-later", "critical", 8, 1, 4, ()))
    target_busy = int(len(general) * 8 * 0.85)
    busy = 0
    order = list(general)
    for i in range(jobs - len(out)):
        r = rng.random()
        priority = "critical" if r < 0.1 else "regular" if r < 0.6 else "best_effort"
        tp = rng.choice((1, 1, 2, 4, 8))
        pp = rng.choice((1, 1, 1, 1, 2))
        dp = rng.choice((1, 1, 1, 2, 2, 4, 8))
        holdings: tuple[Holding, ...] = ()
        if busy < target_busy and rng.random() < 0.85:
            start = rng.randrange(len(order))
            placed = take(tp, dp * pp, order[start:] + order[:start])
            if placed:
                holdings = tuple(Holding(g) for g in placed)
                busy += len(placed)
        out.append(make(f"{p}-job{i:04d}", priority, tp, pp, dp, holdings))
    return nodes, out, reservations


def build_snapshot(pods: int, seed: int = 0) -> Snapshot:
    """``pods`` pods of 1,024 GPUs and 200 jobs each (see ``build_pod``), as one cluster.

    The 10,240-GPU case is ten pods drawn from the same distribution as the one-pod case, so
    the ratio of the two timings measures how the planner scales, not a different workload.
    """
    rng = random.Random(seed)
    nodes: list[Node] = []
    jobs: list[Job] = []
    reservations: list[Reservation] = []
    for pod in range(pods):
        n, j, r = build_pod(pod, rng)
        nodes += n
        jobs += j
        reservations += r
    return Snapshot(tuple(nodes), tuple(jobs), tuple(reservations))


def with_teams(snapshot: Snapshot, teams: int = 50, seed: int = 0) -> Snapshot:
    """The same cluster shared by ``teams`` teams under five organisations (rule 9): every job
    in a team, quotas summing to 90% of the GPUs in random proportions, a borrowing limit on
    every third team, random past usage, so the pass orders, caps and reclaims by quota."""
    rng = random.Random(seed)
    gpus = sum(n.gpus for n in snapshot.nodes)
    shares = [rng.uniform(0.5, 2.0) for _ in range(teams)]
    total = sum(shares)
    orgs = [Team(f"org{o}") for o in range(5)]
    members = [
        Team(f"team{t:02d}", parent=f"org{t % 5}", quota_gpus=int(0.9 * gpus * shares[t] / total),
             borrow_limit_gpus=rng.choice((64, 256)) if t % 3 == 0 else None, weight=rng.choice((1.0, 2.0)),
             usage_gpu_s=rng.uniform(0, 3e6))
        for t in range(teams)
    ]
    orgs = [replace(o, quota_gpus=sum(m.quota_gpus for m in members if m.parent == o.name)) for o in orgs]
    jobs = tuple(replace(j, team=f"team{rng.randrange(teams):02d}") for j in snapshot.jobs)
    return replace(snapshot, jobs=jobs, teams=tuple(orgs + members))


def time_pass(snapshot: Snapshot, repeats: int) -> tuple[float, float, int]:
    """Median CPU and wall milliseconds of ``repeats`` planning passes, and the action count.

    CPU time (``process_time``) is what one core spends on the pass; on a shared machine it is
    far steadier than wall time, which is reported alongside. Each pass reads a copy of the
    snapshot made before its clock starts, as the live planner reads one built afresh from the
    database: nothing a pass keeps by a snapshot object's identity (``jobs.planner.kept``) is
    found again, as it is by the simulator's passes.
    """
    config = PlannerConfig()
    cpu, wall = [], []
    actions = 0
    plan(copy.deepcopy(snapshot), NOW_S, config)  # warm what a long-running worker keeps warm
    for _ in range(repeats):
        fresh = copy.deepcopy(snapshot)
        c0, w0 = time.process_time(), time.perf_counter()
        result = plan(fresh, NOW_S, config)
        cpu.append((time.process_time() - c0) * 1000.0)
        wall.append((time.perf_counter() - w0) * 1000.0)
        actions = len(result.actions)
    return statistics.median(cpu), statistics.median(wall), actions


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the result."""
    parser = argparse.ArgumentParser(prog="bench.planner", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    small = build_snapshot(1, seed=1)
    large = build_snapshot(10, seed=1)
    ms_small, wall_small, actions_small = time_pass(small, args.repeats * 3)
    ms_large, wall_large, actions_large = time_pass(large, args.repeats)
    teamed = with_teams(large, teams=50, seed=1)
    ms_teams, wall_teams, actions_teams = time_pass(teamed, args.repeats)
    result = {
        "ms_1024": round(ms_small, 2),
        "ms_10240": round(ms_large, 2),
        "ratio": round(ms_large / ms_small, 2),
        "wall_ms_1024": round(wall_small, 2),
        "wall_ms_10240": round(wall_large, 2),
        "jobs_1024": len(small.jobs),
        "jobs_10240": len(large.jobs),
        "gpus_1024": sum(n.gpus for n in small.nodes),
        "gpus_10240": sum(n.gpus for n in large.nodes),
        "held_gpus_10240": sum(len(j.holdings) for j in large.jobs),
        "waiting_jobs_10240": sum(1 for j in large.jobs if not j.holdings),
        "actions_1024": actions_small,
        "actions_10240": actions_large,
        "ms_10240_teams": round(ms_teams, 2),
        "wall_ms_10240_teams": round(wall_teams, 2),
        "teams_10240": len(teamed.teams) - 5,
        "actions_10240_teams": actions_teams,
        "repeats": args.repeats,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>18}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Small builders for planner snapshots used by the rule tests."""

from __future__ import annotations

from jobs.planner import CheckpointSpec, Gpu, Holding, Job, Node, Reservation, Snapshot
from jobs.planner.snapshot import Command, IdlePhase, Rhythm


def cluster(racks: int = 1, switches: int = 2, per_switch: int = 4, gpus: int = 8, **health: str) -> tuple[Node, ...]:
    """Nodes named r{rack}s{switch}n{node}; keyword args set a node's health."""
    return tuple(
        Node(f"r{r}s{s}n{n}", f"r{r}", f"r{r}s{s}", gpus, health.get(f"r{r}s{s}n{n}", "healthy"))
        for r in range(racks)
        for s in range(switches)
        for n in range(per_switch)
    )


def gpus_on(*nodes: str, per_node: int = 8, start: int = 0) -> tuple[Gpu, ...]:
    """``per_node`` GPUs on each node, in order."""
    return tuple(Gpu(n, i) for n in nodes for i in range(start, start + per_node))


def job(
    name: str,
    priority: str = "regular",
    tp: int = 8,
    pp: int = 1,
    dp: int = 1,
    dp_min: int | None = None,
    dp_max: int | None = None,
    global_batch: int | None = None,
    micro_batch: int = 1,
    total_steps: int = 10_000,
    step_s: float = 1.0,
    gpus: tuple[Gpu, ...] = (),
    borrowed_from: str | None = None,
    phase: str | None = None,
    save_s: float = 10.0,
    load_s: float = 20.0,
    step_times: tuple[float, ...] = (),
    idle_phases: tuple[IdlePhase, ...] = (),
    **extra: object,
) -> Job:
    """A job; ``gpus`` given means it is running on them."""
    running = bool(gpus)
    return Job(
        name=name, priority=priority, tp=tp, pp=pp, dp=dp,
        dp_min=dp if dp_min is None else dp_min, dp_max=dp if dp_max is None else dp_max,
        global_batch=global_batch if global_batch is not None else 64 * dp * micro_batch,
        micro_batch=micro_batch, total_steps=total_steps, step_s=step_s,
        checkpoint=CheckpointSpec(every_steps=100, save_s=save_s, load_s=load_s),
        idle_phases=idle_phases,
        phase=phase or ("running" if running else "pending"),
        holdings=tuple(Holding(g, borrowed_from) for g in gpus),
        rhythm=Rhythm(step_s=step_times),
        run_started_s=extra.pop("run_started_s", 0.0 if running else None),  # type: ignore[arg-type]
        **extra,  # type: ignore[arg-type]
    )


def snapshot(
    nodes: tuple[Node, ...],
    jobs: list[Job] | tuple[Job, ...],
    reservations: tuple[Reservation, ...] = (),
    commands: tuple[Command, ...] = (),
    paused: bool = False,
) -> Snapshot:
    """A snapshot from parts."""
    return Snapshot(tuple(nodes), tuple(jobs), tuple(reservations), tuple(commands), paused)

"""Rows <-> the pure planner's dataclasses: the one place the database is read for a planner pass.

``load_snapshot`` turns nodes, live jobs with their allocations, reservations (a job's or a
team's), teams with their decayed past usage (``team_usage_gpu_s``) and in-flight commands into
a ``jobs.planner.snapshot.Snapshot``; times become Unix epoch seconds, the
planner's production clock. ``planner_config`` builds the knobs from ``PlannerControl`` plus
``settings.OMNI_PLANNER_OVERRIDES``, and tells the planner its clock is the wall clock of
``settings.TIME_ZONE`` (its sentences then read ``14:05 UTC``, not epoch seconds).
See docs/control-loop.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime, timedelta

from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist
from django.db.models import Q

from jobs.models import (
    Allocation,
    AllocationSpan,
    Command,
    Job,
    Node,
    NodeState,
    PlannerControl,
    Reservation,
    Team,
)
from jobs.models.commands import TERMINAL_COMMAND_STATES
from jobs.models.jobs import TERMINAL_JOB_STATES
from jobs.planner import snapshot as ps
from jobs.planner.config import PlannerConfig
from jobs.rhythm import RhythmState
from jobs.vocab import CommandKind


def epoch_s(value: datetime | None) -> float | None:
    """A timezone-aware datetime as Unix seconds (``None`` stays ``None``)."""
    return value.timestamp() if value is not None else None


def planner_config(control: PlannerControl | None = None) -> PlannerConfig:
    """The planner's knobs: operator controls, the heartbeat timeout, and any env overrides."""
    control = control or PlannerControl.load()
    config = PlannerConfig(
        safety_factor=control.safety_factor,
        min_run_s=float(control.min_run_s),
        reclaim_grace_s=float(control.reclaim_grace_s),
        heartbeat_timeout_s=settings.OMNI_HEARTBEAT_INTERVAL_S * settings.OMNI_HEARTBEAT_MISSES,
        # The planner's times are Unix seconds here: its sentences give them as clock times.
        wall_clock_zone=settings.TIME_ZONE or "UTC",
        min_free_disk_bytes=settings.OMNI_MIN_FREE_DISK_BYTES,
        fair_share_half_life_s=settings.OMNI_FAIR_SHARE_HALF_LIFE_S,
    )
    overrides = getattr(settings, "OMNI_PLANNER_OVERRIDES", None) or {}
    return config.with_overrides(overrides) if overrides else config


def straggler_factor() -> float:
    """The planner's straggler factor. It is not an operator control, so no ``PlannerControl``
    read: the step-record path asks for it on every frame."""
    overrides = getattr(settings, "OMNI_PLANNER_OVERRIDES", None) or {}
    return PlannerConfig().with_overrides(overrides).straggler_factor


def _node_row(node: Node) -> ps.Node:
    # A node whose agent has never registered cannot run anything yet: the planner sees it as
    # cordoned (what runs there stays, nothing new lands) until its first heartbeat.
    health = node.state
    if node.last_heartbeat_at is None and node.state == NodeState.HEALTHY:
        health = NodeState.CORDONED
    return ps.Node(
        name=node.name,
        rack=node.rack,
        switch=node.switch,
        gpus=node.gpu_count,
        health=str(health),
        speed_factor=node.speed_factor,
        low_disk=low_on_disk(node),
        disk_free_bytes=node.disk_free_bytes,
    )


def low_on_disk(node: Node) -> bool:
    """Whether the node's runs dir, as its agent last reported it, has less free space than
    ``OMNI_MIN_FREE_DISK_BYTES`` (docs/storage.md): it then takes no new work. Never reported:
    not low (an agent too old to say is not shut out)."""
    return node.disk_free_bytes is not None and node.disk_free_bytes < settings.OMNI_MIN_FREE_DISK_BYTES


def measured_rhythm(job: Job) -> RhythmState | None:
    """The job's measured rhythm (jobs/rhythm.py), or ``None`` before its first step record."""
    try:
        row = job.rhythm
    except ObjectDoesNotExist:
        return None
    return row.load()


def _job_row(job: Job, holdings: tuple[ps.Holding, ...]) -> ps.Job:
    save_s = job.measured_save_s if job.measured_save_s is not None else job.checkpoint_save_s
    load_s = job.measured_load_s if job.measured_load_s is not None else job.checkpoint_load_s
    # What was measured, not what was typed at submit: the step-time ring at the current DP, the
    # measured saves and loads, the idle phases that recur (docs/rhythm.md).
    measured = measured_rhythm(job)
    rhythm, idle = ps.Rhythm(), ()
    if measured is not None:
        rhythm = ps.Rhythm(step_s=tuple(measured.step_s) if measured.dp == job.dp else (),
                           save_s=tuple(measured.save_s), load_s=tuple(measured.load_s))
        idle = tuple(ps.IdlePhase(p.every_steps, p.duration_s, p.offset_steps)
                     for p in measured.phases(checkpoint_every=job.checkpoint_every_steps))
    waiting = job.state in ps.WAITING_PHASES or job.state == "recovering"
    return ps.Job(
        name=job.name,
        priority=job.priority,
        tp=job.tp,
        pp=job.pp,
        dp=job.dp,
        dp_min=job.dp_min,
        dp_max=job.dp_max,
        global_batch=job.global_batch,
        micro_batch=job.micro_batch,
        total_steps=job.total_steps,
        step_s=job.step_s,
        comm_fraction=job.comm_fraction,
        checkpoint=ps.CheckpointSpec(job.checkpoint_every_steps, float(save_s), float(load_s)),
        min_run_s=float(job.min_run_s),
        submit_s=job.submitted_at.timestamp(),
        owner=job.owner.get_username(),
        phase=job.state,
        committed_steps=job.committed_steps,
        last_checkpoint_step=job.last_checkpoint_step,
        last_checkpoint_s=epoch_s(job.last_checkpoint_at),
        run_started_s=epoch_s(job.started_at) if job.state not in ps.WAITING_PHASES else None,
        last_resize_s=epoch_s(job.last_resized_at),
        # Waiting: since its state changed; holding GPUs: when the wait its run followed began
        # (as the simulator keeps it), which is how the planner knows a promoted run.
        queued_since_s=(job.state_changed_at if waiting else job.queued_at or job.submitted_at).timestamp(),
        holdings=holdings,
        preemptions=job.preemptions,
        rhythm=rhythm,
        idle_phases=idle,
        integration=job.integration,
        grace_s=float(job.grace_s),
        team=job.team.name if job.team_id else None,
    )


def reservation_pools(reservations: list[Reservation], nodes: list[Node]) -> dict[str, tuple[str, ...]]:
    """Which machines hold each reservation's ``gpus + spares``.

    The database does not pin reservations to machines, so the pool is derived the same way on
    every pass: the owner's current nodes first, then healthy nodes in topology order (rack,
    switch, name) that no earlier reservation took, until the pool is big enough. Stable as
    long as the cluster is, which is what the planner's harvesting needs.
    """
    taken: set[str] = set()
    pools: dict[str, tuple[str, ...]] = {}
    usable = [n for n in nodes if n.state not in (NodeState.FAILED,)]
    # The owner's nodes: a job reservation's job's, a team reservation's critical jobs'.
    owner_nodes: dict[tuple[str, int], list[str]] = {}
    team_ids = [r.team_id for r in reservations if r.team_id]
    held = (Allocation.objects.filter(Q(job__in=[r.job_id for r in reservations if r.job_id])
                                      | Q(job__team__in=team_ids, job__priority="critical"))
            .select_related("node", "job").order_by("job__submitted_at", "job_id", "node__name"))
    for alloc in held:
        keys = [("job", alloc.job_id)] + ([("team", alloc.job.team_id)] if alloc.job.team_id in team_ids else [])
        for key in keys:
            names = owner_nodes.setdefault(key, [])
            if alloc.node.name not in names:
                names.append(alloc.node.name)
    by_name = {n.name: n for n in usable}
    for res in reservations:
        want = res.gpus + res.spares
        pool: list[str] = []
        size = 0
        owner = ("team", res.team_id) if res.team_id else ("job", res.job_id)
        candidates = owner_nodes.get(owner, []) + [n.name for n in usable]
        for name in candidates:
            if size >= want:
                break
            if name in taken or name in pool or name not in by_name:
                continue
            pool.append(name)
            size += by_name[name].gpu_count
        taken.update(pool)
        pools[res.name] = tuple(pool)
    return pools


# Spans that ended more than this many half-lives ago add under 0.1% of what they weighed: left out.
USAGE_HORIZON_HALF_LIVES = 10


def decayed_gpu_s(start_s: float, end_s: float, now_s: float, half_life_s: float) -> float:
    """One GPU held from ``start_s`` to ``end_s``, as GPU-seconds decayed to ``now_s``: the integral
    of ``2^(-(now - t)/h)`` over the span, ``h/ln2 * (2^(-(now-end)/h) - 2^(-(now-start)/h))``
    (``quota.accrue`` for one GPU held throughout). A half-life of 0: no memory at all."""
    end_s = min(end_s, now_s)
    if end_s <= start_s:
        return 0.0
    if half_life_s <= 0:
        return 0.0
    return half_life_s / math.log(2) * (2 ** (-(now_s - end_s) / half_life_s) - 2 ** (-(now_s - start_s) / half_life_s))


def team_usage_gpu_s(teams: Iterable[Team], now: datetime, half_life_s: float) -> dict[int, float]:
    """Each team's past GPU-seconds, decayed with ``half_life_s`` up to ``now``, its descendants'
    included (a parent's jobs are its teams' jobs), by team id.

    One query: the allocation spans of teamed jobs that ended within ``USAGE_HORIZON_HALF_LIVES``
    half-lives (or are open), summed here in Python. That scales with the spans in the horizon
    (one row per GPU per hold: a 1,000-GPU cluster re-planning hourly holds ~170k in a week,
    fine; a much larger or busier one wants the sum in SQL, or a per-team running total kept
    with ``quota.accrue`` on each pass); the teams and their tree are small at any scale.
    """
    teams = list(teams)
    if not teams:
        return {}
    now_s = now.timestamp()
    own: dict[int, float] = dict.fromkeys((t.pk for t in teams), 0.0)
    horizon = now - timedelta(seconds=half_life_s * USAGE_HORIZON_HALF_LIVES)
    if half_life_s > 0:
        spans = (AllocationSpan.objects.filter(job__team__isnull=False)
                 .filter(Q(ended_at__isnull=True) | Q(ended_at__gt=horizon))
                 .values_list("job__team_id", "started_at", "ended_at"))
        for team_id, started_at, ended_at in spans.iterator(chunk_size=5000):
            end_s = ended_at.timestamp() if ended_at is not None else now_s
            own[team_id] = own.get(team_id, 0.0) + decayed_gpu_s(started_at.timestamp(), end_s, now_s, half_life_s)
    parent_of = {t.pk: t.parent_id for t in teams}
    total = dict.fromkeys(own, 0.0)
    for team_id, usage in own.items():
        seen: set[int] = set()
        at: int | None = team_id
        while at is not None and at in total and at not in seen:  # the team, then each ancestor
            seen.add(at)
            total[at] += usage
            at = parent_of.get(at)
    return total


def _team_row(team: Team, names: dict[int, str], usage_gpu_s: float) -> ps.Team:
    return ps.Team(
        name=team.name,
        parent=names.get(team.parent_id) if team.parent_id else None,
        quota_gpus=team.quota_gpus,
        borrow_limit_gpus=team.borrow_limit_gpus,
        weight=float(team.weight),
        usage_gpu_s=usage_gpu_s,
    )


def load_snapshot(now: datetime) -> ps.Snapshot:
    """Read the cluster into a planner snapshot (call inside the pass's transaction)."""
    control = PlannerControl.load()
    half_life_s = planner_config(control).fair_share_half_life_s
    teams = list(Team.objects.order_by("name"))
    team_names = {t.pk: t.name for t in teams}
    usage = team_usage_gpu_s(teams, now, half_life_s)
    nodes = list(Node.objects.order_by("rack", "switch", "name"))
    jobs = list(
        Job.objects.exclude(state__in=TERMINAL_JOB_STATES).select_related("owner", "rhythm", "team")
        .order_by("submitted_at", "id")
    )
    holdings: dict[int, list[ps.Holding]] = {job.id: [] for job in jobs}
    allocations = (
        Allocation.objects.filter(job__in=jobs)
        .select_related("node", "borrowed_from")
        .order_by("job_id", "node__rack", "node__switch", "node__name", "gpu_index")
    )
    for alloc in allocations:
        holdings[alloc.job_id].append(
            ps.Holding(ps.Gpu(alloc.node.name, alloc.gpu_index), alloc.borrowed_from.name if alloc.borrowed_from else None)
        )
    # A team's reservation outlives its jobs; a job's ends with it.
    reservations = list(Reservation.objects.in_force(now).select_related("job", "team").order_by("start_at", "id"))
    pools = reservation_pools(reservations, nodes)
    # A ``clean`` removes a finished job's run dir: nothing the planner waits for.
    commands = (
        Command.objects.exclude(state__in=TERMINAL_COMMAND_STATES)
        .exclude(kind=CommandKind.CLEAN)
        .filter(job__isnull=False)
        .select_related("job")
        .order_by("created_at")
    )
    return ps.Snapshot(
        nodes=tuple(_node_row(n) for n in nodes),
        jobs=tuple(_job_row(j, tuple(holdings[j.id])) for j in jobs),
        reservations=tuple(
            ps.Reservation(
                name=r.name,
                job=r.job.name if r.job_id else "",
                team=r.team.name if r.team_id else None,
                gpus=r.gpus,
                spares=r.spares,
                start_s=r.start_at.timestamp(),
                end_s=epoch_s(r.end_at),
                period_s=float(r.period_s) if r.period_s else None,
                active_s=float(r.active_s) if r.active_s else None,
                nodes=pools.get(r.name, ()),
            )
            for r in reservations
        ),
        commands=tuple(
            ps.Command(id=str(c.id), job=c.job.name, kind=c.kind, deadline_s=epoch_s(c.deadline_at)) for c in commands
        ),
        paused=control.paused,
        teams=tuple(_team_row(t, team_names, usage.get(t.pk, 0.0)) for t in teams),
    )

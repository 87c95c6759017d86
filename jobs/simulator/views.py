"""The planner's view of the simulated cluster: each pass's ``Snapshot``, kept between passes.

A job's view (a ``Job``) is made anew only when the job changed (``Simulation._touch``) or, while
it computes, when its progress is ``SNAPSHOT_PROGRESS_S`` old, like an agent's heartbeat. The
active jobs are kept in name order as they come and go; a waiting job with nothing lent and no
stop in flight is not looked at again until touched, so a pass over a long queue revisits only
the jobs that hold, lend or stop. Under ``full_check`` every pass compares what was kept with a
fresh look at every active job.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from jobs.planner import quota
from jobs.planner.snapshot import (
    Command,
    Holding,
    Job,
    Node,
    Reservation,
    Rhythm,
    Snapshot,
    Team,
    built_live_jobs_by_name,
    note_live_jobs_by_name,
)
from jobs.simulator.state import SimJob

if TYPE_CHECKING:
    from jobs.simulator.engine import Simulation

#: Between milestones a job's step count reaches the planner at most this often.
SNAPSHOT_PROGRESS_S = 300.0


def current(job: SimJob, now: float) -> bool:
    """Whether the job's last view still holds at ``now``: nothing changed since, and its progress
    is either still fresh or not moving."""
    cached = job.cached
    return cached is not None and job.cached_version == job.version and (
        now - job.cached_at < SNAPSHOT_PROGRESS_S
        or (job.activity != "computing" and cached.committed_steps == job.committed))


def job_view(job: SimJob, now: float) -> Job:
    """The planner's view of one job at ``now`` (kept on the job as ``cached``)."""
    live = job.live_committed(now)
    spec = job.spec
    if job.activity == "parked":
        phase = "preempted"
    elif job.recovering and job.activity == "waiting":
        phase = "recovering"
    elif job.activity == "waiting":
        phase = "preempted" if job.ever_started and not job.dormant else "pending"
    elif job.activity == "saving":
        phase = "checkpointing"
    else:
        phase = "running"
    if job.cached is not None and job.cached_version == job.version:
        holdings, rhythm = job.cached.holdings, job.cached.rhythm
    else:
        holdings = tuple(Holding(g, job.borrowed.get(g)) for g in job.gpus + job.incoming)
        rhythm = Rhythm(tuple(job.ring), tuple(job.save_hist), tuple(job.load_hist))
    view = Job(
        name=spec.name, priority=spec.priority, tp=spec.tp, pp=spec.pp, dp=spec.dp,
        dp_min=spec.dp_min, dp_max=spec.dp_max, global_batch=spec.global_batch,
        micro_batch=spec.micro_batch, total_steps=spec.total_steps, step_s=spec.step_s,
        comm_fraction=spec.comm_fraction, checkpoint=spec.checkpoint, idle_phases=spec.idle_phases,
        min_run_s=spec.min_run_s, submit_s=spec.submit_s, owner=spec.owner, phase=phase,
        team=spec.team, committed_steps=live, last_checkpoint_step=job.last_ckpt_step,
        last_checkpoint_s=job.last_ckpt_t, run_started_s=job.run_started,
        last_resize_s=job.last_resize, queued_since_s=job.queued_since, holdings=holdings,
        rhythm=rhythm,
        preemptions=job.preemptions,
        idle_until_s=job.idle_until,
        parked=tuple(job.parked),
    )
    job.cached = view
    job.cached_version = job.version
    job.cached_at = now
    return view


class PlannerView:
    """What the last snapshot showed: the active jobs' names in order, each one's view, and those
    ``snapshot`` looks at again on every pass (holding, lending or stopping: their progress moves,
    and a stop's command stands)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.views: dict[str, Job] = {}
        self.loud: set[str] = set()
        self.touched: set[str] = set()  # changed since the last snapshot
        self.nodes: tuple[Node, ...] | None = None  # None: health or speed may have changed

    def join(self, name: str) -> None:
        """A job is submitted."""
        bisect.insort(self.names, name)
        self.touched.add(name)

    def leave(self, name: str) -> None:
        """A job is done or cancelled."""
        i = bisect.bisect_left(self.names, name)
        if i < len(self.names) and self.names[i] == name:
            del self.names[i]
        self.views.pop(name, None)
        self.loud.discard(name)

    def snapshot(self, sim: Simulation) -> Snapshot:
        """The planner's view of ``sim`` now."""
        if self.nodes is None:
            self.nodes = tuple(Node(n.name, n.rack, n.switch, n.gpus, sim.health[n.name], sim.speed[n.name])
                               for n in sim.scenario.nodes)
        parked: list[SimJob] = []
        with_op: list[SimJob] = []
        now = sim.now
        views, loud = self.views, self.loud
        for name in sorted(loud | self.touched) if self.touched else sorted(loud):
            if name not in sim.active_names:
                continue
            job = sim.jobs[name]
            views[name] = job.cached if current(job, now) else job_view(job, now)
            if job.parked:
                parked.append(job)
            if job.op is not None:
                with_op.append(job)
            # A waiting job with nothing lent and no stop in flight keeps its view until touched.
            if job.activity == "waiting" and not job.parked and job.op is None:
                loud.discard(name)
            else:
                loud.add(name)
        self.touched.clear()
        jobs = tuple(map(views.__getitem__, self.names))
        # The active jobs are live and kept in name order: the pass's index of them is this.
        by_name = dict(zip(self.names, jobs, strict=True))
        note_live_jobs_by_name(jobs, by_name)
        if sim.full_check:
            self.check(sim, jobs, parked, with_op)
            if list(by_name.items()) != list(built_live_jobs_by_name(jobs).items()):
                raise RuntimeError(f"snapshot at t={sim.now}: the jobs by name noted are not the live jobs in name order")
        # A team's reservation outlives its jobs: the planner resolves whom it guarantees.
        reservations = tuple(r for r in sim.reservations if r.team or sim.jobs[r.job].terminal is None)
        if parked:
            reservations += tuple(
                Reservation(f"idle:{j.spec.name}", j.spec.name, len(j.parked),
                            start_s=j.parked_until if j.parked_until is not None else now,
                            nodes=tuple(sorted({g.node for g in j.parked})))
                for j in parked
            )
        commands = tuple(
            Command(j.op.cmd_id, j.spec.name, j.op.action_kind, j.op.deadline_s,
                    tuple(g for g in j.gpus if g not in set(j.op.after)))
            for j in with_op
        )
        teams = sim.ledger.snapshot_teams() if sim.ledger is not None else ()
        if sim.full_check and sim.ledger is not None:
            self.check_charged(sim, jobs, reservations, teams)
        return Snapshot(self.nodes, jobs, reservations, commands, teams=teams)

    @staticmethod
    def check_charged(sim: Simulation, jobs: tuple[Job, ...], reservations: tuple[Reservation, ...],
                      teams: tuple[Team, ...]) -> None:
        """What the engine's ledger holds against each team's quota is what the planner's
        ``quota.TeamBook`` counts over this snapshot (``quota.charged_gpus``, a node's zone being
        the first pool by name that covers it, as ``topology`` has it; raises otherwise)."""
        assert sim.ledger is not None
        zone_of_node: dict[str, str | None] = {}
        for r in sorted(reservations, key=lambda r: r.name):
            for node in r.nodes:
                zone_of_node.setdefault(node, r.name)
        pool_team = quota.pool_teams(reservations, jobs)
        book = quota.TeamBook(teams, jobs,
                              lambda job, gpus: quota.charged_gpus(job.team, gpus, zone_of_node, pool_team))
        if book.held != sim.ledger.charged:
            wrong = {t: (n, book.held[t]) for t, n in sim.ledger.charged.items() if n != book.held[t]}
            raise RuntimeError(f"snapshot at t={sim.now}: GPUs charged to teams (ledger, planner) differ: {wrong}")

    @staticmethod
    def check(sim: Simulation, jobs: tuple[Job, ...], parked: list[SimJob], with_op: list[SimJob]) -> None:
        """The views kept are every active job's, in name order, each as current as a fresh look
        at every job would have it (raises otherwise)."""
        active = [sim.jobs[name] for name in sorted(sim.active_names)]
        stale = [j.spec.name for j in active if not current(j, sim.now)]
        if stale or len(active) != len(jobs) or any(j.cached is not v for j, v in zip(active, jobs, strict=True)):
            raise RuntimeError(f"snapshot at t={sim.now}: kept views out of date ({stale[:5]})")
        if [j for j in active if j.parked] != parked or [j for j in active if j.op is not None] != with_op:
            raise RuntimeError(f"snapshot at t={sim.now}: lenders or stops in flight missed")

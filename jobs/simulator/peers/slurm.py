"""The ``slurm`` peer: Slurm's ``sched/backfill`` with ``priority/multifactor`` and
``preempt/partition_prio``, ``PreemptMode=REQUEUE`` and a ``GraceTime``, at the configuration
that serves these scenarios best.

What it models, and the documentation it follows:

- **Partitions by class.** One partition per priority class, ``PriorityTier`` critical >
  regular > best_effort. Jobs of a higher tier are scheduled first and may preempt jobs of a
  lower tier (``PreemptType=preempt/partition_prio``; https://slurm.schedmd.com/preempt.html:
  "The PriorityTier of the Partition of the job ... can be used to identify which jobs can
  preempt or be preempted by other jobs"). Jobs of one tier never preempt each other.
- **Multifactor priority within a tier** (https://slurm.schedmd.com/priority_multifactor.html):
  ``PriorityWeightAge * age_factor + PriorityWeightFairshare * fairshare_factor`` with
  ``age_factor = min(1, wait / PriorityMaxAge)`` and the classic fair-share factor
  ``2 ** (-U / S)``: ``U`` the account's (team's) decayed usage share, ``S`` its share of the
  shares (its quota, else its weight). Without teams every job has the same fair share and the
  age factor alone orders a tier (first come, first served). ``PriorityDecayHalfLife`` is the
  scenario's ``fair_share_half_life_s`` (the snapshot's ``Team.usage_gpu_s`` is decayed with it).
- **EASY backfill** (https://slurm.schedmd.com/sched_config.html, ``sched/backfill``:
  "Backfill scheduling will initiate lower-priority jobs if doing so does not delay the expected
  initiation time of any higher priority job"). The first job that cannot start gets a
  reservation at its *shadow time* (when enough running jobs have ended); a later job starts now
  only if it ends before the shadow time or fits in the GPUs the reserved job will not need.
  Run times are known exactly (a perfect ``--time`` limit: the job's remaining steps at its
  size, its saves and idle phases), Slurm's best case; the backfill runs at every pass (a small
  ``bf_interval``).
- **Node ranges.** A job asks for ``--nodes=min-max`` in replicas ``[dp_min, dp]`` and is
  given "as many as possible within the range ... without delaying the initiation of the job"
  (sbatch ``--nodes``); it never grows or shrinks afterwards.
- **Preemption by requeue with a grace time** (preempt.html: "Once a job has been selected for
  preemption, its end time is set to the current time plus GraceTime. The job is immediately
  sent SIGCONT and SIGTERM signals ... followed by the SIGCONT, SIGTERM and SIGKILL signal
  sequence upon reaching its new end time"). The job saves a checkpoint on SIGTERM and is
  requeued (``PreemptMode=REQUEUE``); on restart it loads that checkpoint. ``GraceTime`` is set
  to cover the slowest save in the scenario plus two steps (best configuration), so every
  preemption is graceful; a job whose save would not fit is killed and restarts from its last
  periodic checkpoint. Victims: lowest tier first, then the most recently started
  (``PreemptParameters=youngest_first``), pruned to a minimal set.
- **PreemptExemptTime** = the job's ``min_run_s``: a regular job is not preempted before it
  (what every policy honours), except for a critical job's active reservation: the owner's
  partition (``PriorityTier`` above all) takes its GPUs whatever their age, as FORMAT.md's
  guarantee requires of every policy.
- **Reservations.** Slurm's advanced reservations would hold the GPUs idle (the ``static``
  baseline does that); its best configuration instead puts the reserved job in the top tier and
  lets lower tiers use those GPUs until it needs them, when it preempts them *at that moment*:
  no lead time, so the owner waits for the borrowers' saves (within ``GraceTime``).
- **Faults.** ``JobRequeue=1``: a job on a failed node is requeued whole and restarts from its
  last checkpoint (the surviving GPUs are given back if it cannot restart at once).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from jobs.planner.config import PlannerConfig
from jobs.planner.decisions import Plan
from jobs.planner.rhythm import step_time_at
from jobs.planner.snapshot import PRIORITY_RANK, Job, Snapshot
from jobs.simulator.peers.common import INFINITY, Option, PeerPass, est_remaining_s, valid_sizes

#: Slurm's defaults for the multifactor weights we use, and PriorityMaxAge (7 days).
WEIGHT_AGE = 1000.0
WEIGHT_FAIRSHARE = 1000.0
PRIORITY_MAX_AGE_S = 7 * 86400.0
BEHIND = "Waits for GPUs behind higher-priority jobs (it cannot be backfilled without delaying them)."


@dataclass(frozen=True, slots=True)
class SlurmConfig:
    """The slurm.conf values that matter here."""

    grace_time_s: float = 120.0
    weight_age: float = WEIGHT_AGE
    weight_fairshare: float = WEIGHT_FAIRSHARE
    priority_max_age_s: float = PRIORITY_MAX_AGE_S


def grace_time_for(jobs: list[tuple[float, float]]) -> float:
    """The smallest ``GraceTime`` (whole 10 s) that covers every job's save plus two steps:
    ``jobs`` is ``(save_s, step_s)`` pairs."""
    need = max((save + 2 * step for save, step in jobs), default=60.0)
    return float(max(30, math.ceil(need / 10.0) * 10))


class SlurmPass(PeerPass):
    """One scheduling pass of the ``slurm`` peer (see the module docstring)."""

    name = "slurm"

    def __init__(self, snapshot: Snapshot, now_s: float, config: PlannerConfig, slurm: SlurmConfig) -> None:
        super().__init__(snapshot, now_s, config)
        self.slurm = slurm
        teams = [t for t in snapshot.teams]
        total_usage = sum(t.usage_gpu_s for t in teams)
        shares = {t.name: (t.quota_gpus if any(x.quota_gpus for x in teams) else t.weight) for t in teams}
        total_shares = sum(shares.values()) or 1.0
        self.fairshare: dict[str | None, float] = {}
        for t in teams:
            u = t.usage_gpu_s / total_usage if total_usage > 0 else 0.0
            s = shares[t.name] / total_shares
            self.fairshare[t.name] = 2.0 ** (-u / s) if s > 0 else 0.0
        # EASY backfill: when the first job that cannot start could (its shadow time), and the
        # GPUs free then beyond its need, which later jobs may use.
        self.shadow_s: float | None = None
        self.spare = 0

    def priority(self, job: Job) -> float:
        """The multifactor priority within the job's tier."""
        age = min(1.0, max(0.0, self.now - job.submit_s) / self.slurm.priority_max_age_s)
        fs = self.fairshare.get(job.team, 0.5) if self.fairshare else 1.0
        return self.slurm.weight_age * age + self.slurm.weight_fairshare * fs

    def graceful_for(self, job: Job) -> bool:
        """Whether a SIGTERM'd job can save within ``GraceTime`` (else SIGKILL finds it unsaved)."""
        return job.checkpoint.save_s + 2 * step_time_at(job, max(1, job.current_dp)) <= self.slurm.grace_time_s

    def queue_key(self, job: Job) -> tuple:
        """Scheduling order: entitled jobs first, then by tier, multifactor priority, submit time."""
        return (0 if self.entitled_gpus(job) else 1, PRIORITY_RANK[job.priority], -self.priority(job),
                job.submit_s, job.name)

    def schedule(self) -> None:
        self.drains()
        # Within a shape (same class and fair share) priority order is submit order, older first.
        # No shape is hopeless before the backfill reservation: the first job that finds nothing
        # takes it.
        self.walk_queue(self.queue_key, self.decide)

    def decide(self, job: Job) -> None:
        """Start, backfill, preempt for or hold one job of the queue, in order."""
        low, high = self.size_range(job)
        shadow_s = self.shadow_s
        layout = self.fit_largest(job, low, high, job.gpus)
        no_fit = layout is None
        if layout is not None and shadow_s is not None:
            runs_s = est_remaining_s(job, len(layout) // job.replica_gpus)
            if self.now + runs_s > shadow_s + 1e-6:
                if len(layout) - len(job.gpus) <= self.spare:
                    self.spare -= len(layout) - len(job.gpus)
                else:
                    layout = None
        if layout is not None:
            rule = "slurm.backfill" if shadow_s is not None else "slurm.schedule"
            self.start(job, layout, rule, f"Starts on {len(layout)} GPUs "
                       f"({'backfilled: it does not delay the reserved job' if shadow_s is not None else 'in priority order'}).",
                       priority=round(self.priority(job), 3))
            return
        if self.wait_for_release(job, low, high):
            return
        if self.preempt_for(job, low, high):
            return
        self.release_survivors(job)
        if no_fit:
            self.mark_hopeless(job, low, high)
        if shadow_s is None:
            self.shadow_s, self.spare = self.shadow(job, low)
            text = ("Waits for GPUs; it holds the backfill reservation"
                    + (f" from t={self.shadow_s:.0f}s." if self.shadow_s < INFINITY else "."))
        else:
            text = BEHIND
        self.hold(job, "capacity", text, gpus_needed=low * job.replica_gpus)

    def shadow(self, job: Job, low: int) -> tuple[float, int]:
        """When the reserved job could start (running jobs ending at their exact run times) and the
        GPUs free then beyond its need."""
        need = low * job.replica_gpus
        avail = self.free_count() + len(self.releasing)
        if avail >= need:
            return self.now, avail - need
        ends = sorted((self.now + est_remaining_s(j), len(j.gpus)) for j in self.holding_jobs
                      if j.name != job.name and j.name not in self.busy
                      and self.owner.get(j.gpus[0]) == j.name)
        for end_s, n in ends:
            avail += n
            if avail >= need:
                return end_s, avail - need
        return INFINITY, 1 << 30

    def preempt_for(self, job: Job, low: int, high: int) -> bool:
        """Requeue lower-tier jobs for ``job`` (``preempt/partition_prio``), if that lets it start."""
        rank = PRIORITY_RANK[job.priority]
        entitled = bool(self.entitled_gpus(job))

        def build() -> list[Option]:
            cands = [v for v in self.running() if PRIORITY_RANK[v.priority] > rank and v.priority != "critical"
                     and (entitled or not self.protected(v))]
            cands.sort(key=lambda v: (-PRIORITY_RANK[v.priority], -(v.run_started_s or 0.0), v.name))
            return [Option(v, ()) for v in cands]

        options = self.cached(("victims", rank, entitled), build)
        if not options:
            if not entitled:
                self.wake_protection(job)
            return False
        for d in valid_sizes(job, low, high):
            found = self.make_room(job, d, options, job.gpus)
            if found is None:
                continue
            victims, layout = found
            graceful = all(self.graceful_for(o.job) for o in victims)
            why = ("its reservation is active" if entitled else
                   f"it is in a partition of higher PriorityTier ({job.priority})")
            for opt in victims:
                one = self.graceful_for(opt.job)
                self.stop_victims([opt], job, "entitlement" if entitled else "slurm.preempt", graceful=one,
                                  forced=entitled, deadline_s=self.now + self.slurm.grace_time_s, why=why)
            if graceful:
                self.claim([g for g in layout if g not in set(job.gpus)], job)
                self.hold(job, "waiting_for_release", f"Waits for {len(layout)} GPUs from the jobs it "
                          f"preempted (GraceTime {self.slurm.grace_time_s:.0f}s).", gpus_needed=len(layout))
            else:
                # Killed victims' GPUs are free at once, a grace-saved one's later: start when all are back.
                now = self.fit(job, d, job.gpus)
                if now is not None:
                    self.start(job, now, "slurm.preempt", "Starts on the GPUs of the jobs it preempted.")
                else:
                    self.claim([g for g in layout if g not in set(job.gpus)], job)
                    self.hold(job, "waiting_for_release", "Waits for the GPUs of the jobs it preempted.")
            return True
        if not entitled:
            self.wake_protection(job)
        return False

    def wake_protection(self, job: Job) -> None:
        """Ask for a pass when the next lower-tier job's PreemptExemptTime ends."""
        rank = PRIORITY_RANK[job.priority]
        if ("woken", rank) in self._memo:
            return
        self._memo[("woken", rank)] = True
        for v in self.running():
            if PRIORITY_RANK[v.priority] > rank and self.protected(v) and v.run_started_s is not None:
                self.wake_at(v.run_started_s + v.min_run_s)


def slurm_planner(slurm: SlurmConfig) -> Callable[[Snapshot, float, PlannerConfig], Plan]:
    """The ``slurm`` peer's plan function for one scenario's configuration."""

    def plan_slurm(snapshot: Snapshot, now_s: float, config: PlannerConfig) -> Plan:
        return SlurmPass(snapshot, now_s, config, slurm).run()

    return plan_slurm

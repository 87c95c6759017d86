"""The ``kueue`` peer: Kueue's ClusterQueues in one cohort, with borrowing and preemption, at
the configuration that serves these scenarios best.

What it models, and the documentation it follows (https://kueue.sigs.k8s.io/docs/concepts/
cluster_queue/ and .../concepts/preemption/):

- **One ClusterQueue per team** with ``nominalQuota`` = the team's ``quota_gpus`` and
  ``borrowingLimit`` = its ``borrow_limit_gpus`` (none: unlimited), all in one cohort
  (hierarchical cohorts for parent teams: a child's usage counts against its parent's). A job of
  no team sits in a queue with no nominal quota: it only borrows. Without teams the whole
  cluster is one ClusterQueue. "Borrowable resources are the unused nominal quota of all the
  ClusterQueues in a cohort."
- **Admission** in ``BestEffortFIFO`` order: workloads that stay within their nominal quota
  first, then higher ``WorkloadPriorityClass`` (critical > regular > best_effort), then the
  oldest; a workload that does not fit does not block the ones behind it. A workload is
  admitted at its requested size (``dp`` replicas; ``dp_max`` for none, Kueue does not resize a
  running job) or, with **partial admission** (``kueue.x-k8s.io/job-min-parallelism``), at the
  largest count down to ``dp_min`` that fits when the full size does not.
- **Preemption** (``ClusterQueue.spec.preemption``), best configuration:
  ``reclaimWithinCohort: Any`` (a queue within its nominal quota takes back what other queues
  borrow, whatever their priority, never more than each holds beyond its own quota),
  ``withinClusterQueue: LowerPriority`` (a workload preempts lower-priority ones of its own
  queue), and ``borrowWithinCohort: {policy: LowerPriority}`` (a borrowing workload may preempt
  lower-priority workloads of queues that borrow; kubernetes-sigs/kueue#1397). Candidates:
  borrowing queues first, then lower priority, then the most recently admitted, pruned to a
  minimal set ("minimal preemptions", as Kueue's preemptor does).
- **A preempted workload is evicted and requeued**: its pods are deleted (the trainer gets no
  checkpoint-and-stop protocol), so it loses the steps since its last periodic checkpoint and
  restarts from that checkpoint when readmitted. The preemptor is admitted at once.
- ``min_run_s`` (which the scenario gives every policy) protects a recent start from
  preemption, except for a critical job's active reservation, modelled as a ClusterQueue whose
  quota its owner reclaims with the highest priority. Critical workloads are never victims.
- **Faults**: a workload on a failed node is evicted and requeued whole.

Reservations have no Kueue object: the reserved job is the highest-priority workload of its
queue and preempts at the moment it needs the GPUs, with no lead time.
"""

from __future__ import annotations

from jobs.planner.config import PlannerConfig
from jobs.planner.decisions import Plan
from jobs.planner.quota import TeamBook
from jobs.planner.snapshot import PRIORITY_RANK, Job, Snapshot
from jobs.simulator.peers.common import Option, PeerPass, valid_sizes

PENDING = "Pending: no quota or GPUs free, and nothing it may preempt would make room."


class KueuePass(PeerPass):
    """One scheduling pass of the ``kueue`` peer (see the module docstring)."""

    name = "kueue"

    def __init__(self, snapshot: Snapshot, now_s: float, config: PlannerConfig) -> None:
        super().__init__(snapshot, now_s, config)
        self.book = TeamBook(snapshot.teams, self.jobs.values())

    def within_nominal(self, job: Job, gpus: int) -> bool:
        """Whether admitting ``gpus`` more keeps the job's queue within its nominal quota."""
        return bool(self.book) and job.team is not None and self.book.below_quota_by(job.team) >= gpus

    def may_borrow(self, job: Job, gpus: int) -> bool:
        """Whether the queue's ``borrowingLimit`` (and its parents') allows ``gpus`` more."""
        if not self.book:
            return True
        return self.book.may_use(job.team) >= gpus

    def borrowing(self, team: str | None) -> bool:
        """Whether a queue holds more than its nominal quota (a queue of no team always borrows)."""
        if not self.book:
            return False
        return team is None or team not in self.book.teams or self.book.above_quota_by(team) > 0

    def schedule(self) -> None:
        self.drains()
        # The queue's order is the one it has as the pass starts: whether admitting a job keeps its
        # ClusterQueue within its nominal quota is read per (team, smallest size) before any
        # admission changes the book (the walk keys jobs as it reaches them).
        nominal: dict[tuple[str | None, int], bool] = {}

        def freeze(jobs: list[Job]) -> None:
            for job in jobs:  # the jobs keyed one by one, and one of each shape (same team and size)
                need = job.dp_min * job.replica_gpus
                if (job.team, need) not in nominal:
                    nominal[(job.team, need)] = self.within_nominal(job, need)

        # Worded holds say why each job waits (quota or capacity): then every job is visited.
        self.walk_queue(lambda j: (
            0 if self.entitled_gpus(j) else 1,
            0 if nominal[(j.team, j.dp_min * j.replica_gpus)] else 1,
            PRIORITY_RANK[j.priority], j.submit_s, j.name), self.admit, grouped=not self.config.explain_holds,
            prepare=freeze)

    def admit(self, job: Job) -> None:
        low, high = self.size_range(job)
        if not self.config.explain_holds and self.hopeless(job, low, high):
            # Held either way (for quota or for capacity): with no hold to word, skip sizing it.
            self.skip(job)
            return
        rep = job.replica_gpus
        sizes = [d for d in valid_sizes(job, low, high) if self.may_borrow(job, d * rep - len(job.gpus))]
        if not sizes:
            self.release_survivors(job)
            self.hold(job, "quota", f"Its ClusterQueue is at its borrowing limit ({self.book.limit_words(job.team)}).")
            return
        if self.hopeless(job, low, high):
            self.skip(job)
            return
        for d in sizes:
            layout = self.fit_pool_first(job, d, job.gpus)
            if layout is not None:
                self.book.add(job.team, len(layout) - len(job.gpus))
                self.start(job, layout, "kueue.admit", f"Admitted on {len(layout)} GPUs"
                           + (" (partial admission)" if d < high else "") + ".")
                return
            if self.preempt_for(job, d):
                return
        self.release_survivors(job)
        self.mark_hopeless(job, low, high)
        self.hold(job, "capacity", PENDING, gpus_needed=low * rep)

    def candidates(self, job: Job, gpus: int) -> list[Option]:
        """Workloads ``job`` may preempt for ``gpus`` GPUs, in Kueue's candidate order."""
        rank = PRIORITY_RANK[job.priority]
        entitled = bool(self.entitled_gpus(job))
        reclaim = self.within_nominal(job, gpus)
        book = self.book
        out: list[tuple[tuple, Job]] = []
        taken_from: dict[str, int] = {}
        for v in self.running():
            if v.priority == "critical" or (self.protected(v) and not entitled):
                continue
            lower = PRIORITY_RANK[v.priority] > rank
            same_queue = (v.team == job.team) if book else True
            if same_queue:
                ok = lower  # withinClusterQueue: LowerPriority
            elif reclaim and not book.related(v.team, job.team):
                # reclaimWithinCohort: Any, never more from a queue than it borrows.
                room = book.reclaimable(v, job.team)
                got = taken_from.get(v.team or "", 0)
                ok = got + len(v.gpus) <= room
                if ok:
                    taken_from[v.team or ""] = got + len(v.gpus)
            else:
                ok = lower and self.borrowing(v.team)  # borrowWithinCohort: LowerPriority
            if ok:
                key = (0 if self.borrowing(v.team) else 1, -PRIORITY_RANK[v.priority], -(v.run_started_s or 0.0), v.name)
                out.append((key, v))
        out.sort(key=lambda kv: kv[0])
        return [Option(v, ()) for _, v in out]

    def preempt_for(self, job: Job, d: int) -> bool:
        need = d * job.replica_gpus
        options = self.cached(("victims", job.team, job.priority, bool(self.entitled_gpus(job)),
                               self.within_nominal(job, need - len(job.gpus))),
                              lambda: self.candidates(job, need - len(job.gpus)))
        if not options:
            return False
        found = self.make_room(job, d, options, job.gpus)
        if found is None:
            return False
        victims, _ = found
        entitled = bool(self.entitled_gpus(job))
        why = ("its reservation is active" if entitled else
               "its ClusterQueue reclaims quota lent to the cohort" if self.within_nominal(job, need - len(job.gpus))
               else "it has a higher priority")
        self.stop_victims(victims, job, "entitlement" if entitled else "kueue.preempt", graceful=False,
                          forced=entitled, deadline_s=self.now, why=why)
        for opt in victims:
            self.book.add(opt.job.team, -len(opt.job.gpus))
        layout = self.fit(job, d, job.gpus)
        if layout is None:  # cannot happen: the victims' GPUs are free at once
            self.hold(job, "capacity", "Pending after preempting: GPUs do not fit.")
            return True
        self.book.add(job.team, len(layout) - len(job.gpus))
        self.start(job, layout, "kueue.admit", f"Admitted on {len(layout)} GPUs after preempting "
                   f"{', '.join(o.job.name for o in victims)}.")
        return True


def plan_kueue(snapshot: Snapshot, now_s: float, config: PlannerConfig) -> Plan:
    """One pass of the ``kueue`` peer."""
    return KueuePass(snapshot, now_s, config).run()

"""The ``elastic`` peer: elastic training as TorchElastic (``torchrun --nnodes=MIN:MAX``) and
DLRover run it under a priority scheduler: jobs start on whatever fits between their minimum
and maximum size, grow into GPUs that become free, and shrink, checkpoint first, at the moment
another job needs the GPUs, with no prediction and no lead time.

What it models, and the documentation it follows:

- **Elastic size** (https://docs.pytorch.org/docs/stable/elastic/quickstart.html): "To launch
  an elastic job, run the following on at least MIN_SIZE nodes and at most MAX_SIZE nodes";
  "TorchElastic models failures as membership changes. When a node fails, this is treated as a
  'scale down' event. When the failed node is replaced by the scheduler, it is a 'scale up'
  event." Every membership change restarts the worker group from its last checkpoint
  (https://pytorch.org/docs/stable/elastic/run.html: "Worker failures are handled gracefully by
  restarting all workers"; "Number of nodes is allowed to change between minimum and maximum
  sizes"), so each resize here costs a save and a load, like the planner's.
- **Scale-up** (DLRover's elastic scheduling, https://github.com/intelligent-machine-learning/
  dlrover: jobs scale out when resources are free): a running job grows to the largest
  batch-exact size up to ``dp_max`` that the free GPUs allow, as soon as they are free and
  nobody of its class or higher waits; a job with less than two resizes' worth of work left
  does not grow (best configuration: the restart would not pay).
- **Scale-down at the moment of need**: a waiting job takes GPUs by shrinking running jobs,
  checkpoint first (graceful: the engine saves, then reloads at the smaller size): first lower
  classes down to ``dp_min``, then jobs of its own class that grew beyond their preferred
  ``dp``; then it preempts (checkpoint, requeue) lower-class jobs. Nothing is foreseen: a
  reservation's owner asks when its window opens and waits for the borrowers' saves.
- Jobs start in class order (critical, regular, best_effort), oldest first, at the largest size
  up to ``dp_max`` that the free GPUs allow (``dp_min`` at least).
- ``min_run_s`` protects a recent start from shrinking and preemption (FORMAT.md), except for a
  critical job's active reservation.
- **Faults**: the job continues on its surviving replicas (a scale-down) and grows back later;
  a drained node's replicas are dropped the same way.
"""

from __future__ import annotations

from jobs.planner.config import PlannerConfig
from jobs.planner.decisions import Plan
from jobs.planner.layout import batch_divides
from jobs.planner.snapshot import PRIORITY_RANK, Job, Snapshot
from jobs.planner.topology import choose_gpus
from jobs.simulator.peers.common import Option, PeerPass, est_remaining_s, valid_sizes

WAITS = "Waits for GPUs: nothing it may shrink or preempt would make room."


class ElasticPass(PeerPass):
    """One scheduling pass of the ``elastic`` peer (see the module docstring)."""

    name = "elastic"

    def schedule(self) -> None:
        self.drains(shrink=True)
        self.walk_queue(lambda j: (0 if self.entitled_gpus(j) else 1, PRIORITY_RANK[j.priority], j.submit_s, j.name),
                        self.admit)
        self.grow()

    def size_range(self, job: Job) -> tuple[int, int]:
        low, _ = super().size_range(job)
        return low, job.dp_max

    @staticmethod
    def plain_range(job: Job) -> tuple[int, int]:
        return job.dp_min, job.dp_max

    def admit(self, job: Job) -> None:
        low, high = self.size_range(job)
        if self.hopeless(job, low, high):
            self.skip(job)
            return
        # A job hit by a fault scales down: it continues on its survivors plus whatever is free.
        layout = self.fit_largest(job, low, high, job.gpus)
        if layout is not None:
            self.start(job, layout, "elastic.start", f"Starts on {len(layout)} GPUs "
                       f"(elastic between {job.dp_min} and {job.dp_max} replicas)"
                       + (", restarting from its last checkpoint after a fault." if job.phase == "recovering" else "."))
            return
        if self.wait_for_release(job, low, high):
            return
        if self.take_for(job, low):
            return
        self.release_survivors(job)
        self.mark_hopeless(job, low, high)
        self.hold(job, "capacity", WAITS, gpus_needed=low * job.replica_gpus)

    def options_for(self, job: Job) -> list[Option]:
        """Shrinks, then preemptions, that may give ``job`` GPUs now."""
        rank = PRIORITY_RANK[job.priority]
        entitled = bool(self.entitled_gpus(job))
        shrinks: list[tuple[tuple, Option]] = []
        stops: list[tuple[tuple, Option]] = []
        for v in self.running():
            vr = PRIORITY_RANK[v.priority]
            if v.priority == "critical" or vr < rank or (self.protected(v) and not entitled):
                continue
            floor = v.dp_min if vr > rank else v.dp
            d = v.current_dp
            target = next((x for x in range(d - 1, floor - 1, -1) if batch_divides(v, x)), None)
            if target is not None:
                after = v.gpus[: target * v.replica_gpus]
                shrinks.append(((0 if vr > rank else 1, -vr, -(v.run_started_s or 0.0), v.name), Option(v, after)))
            if vr > rank:
                stops.append(((-vr, -(v.run_started_s or 0.0), v.name), Option(v, ())))
        shrinks.sort(key=lambda kv: kv[0])
        stops.sort(key=lambda kv: kv[0])
        return [o for _, o in shrinks] + [o for _, o in stops]

    def take_for(self, job: Job, low: int) -> bool:
        options = self.cached(("options", job.priority, bool(self.entitled_gpus(job))), lambda: self.options_for(job))
        if not options:
            return False
        entitled = bool(self.entitled_gpus(job))
        for d in valid_sizes(job, low, max(low, min(job.dp, self.size_range(job)[1]))):
            found = self.make_room(job, d, options, job.gpus)
            if found is None:
                continue
            victims, layout = found
            why = "its reservation is active" if entitled else f"it is a waiting {job.priority} job"
            self.stop_victims(victims, job, "entitlement" if entitled else "elastic.scale_down", graceful=True,
                              forced=entitled, deadline_s=self.now, why=why)
            self.claim([g for g in layout if g not in set(job.gpus)], job)
            self.hold(job, "waiting_for_release", f"Waits for {len(layout)} GPUs that "
                      f"{', '.join(o.job.name for o in victims)} give back after saving.", gpus_needed=len(layout))
            return True
        return False

    def grow(self) -> None:
        """Scale up into free GPUs, higher class and older jobs first."""
        if not self.free:
            return
        growers = sorted((j for j in self.running() if j.current_dp < j.dp_max and j.phase == "running"
                          and j.idle_until_s is None),
                         key=lambda j: (PRIORITY_RANK[j.priority], j.submit_s, j.name))
        for job in growers:
            if PRIORITY_RANK[job.priority] >= self.blocked_rank or not self.free:
                continue
            cost_s = job.checkpoint.save_s + job.checkpoint.load_s
            if est_remaining_s(job) < 2 * cost_s:
                continue
            d = job.current_dp
            cand = {n: sorted(idx) for n, idx in self.free.items()}
            free = sum(len(v) for v in cand.values())
            anchor = sorted({g.node for g in job.gpus})
            for target in range(job.dp_max, d, -1):
                if not batch_divides(job, target) or (target - d) * job.replica_gpus > free:
                    continue
                new = choose_gpus(cand, self.nodes, job.tp, job.pp, target - d, anchor)
                if new is None:
                    continue
                self.emit("grow", job, tuple(job.gpus) + tuple(new), "elastic.scale_up",
                          f"{len(new)} GPUs are free: the job restarts from a fresh checkpoint at dp {target} "
                          f"(was {d}).", dp_before=d, dp_after=target)
                break


def plan_elastic(snapshot: Snapshot, now_s: float, config: PlannerConfig) -> Plan:
    """One pass of the ``elastic`` peer."""
    return ElasticPass(snapshot, now_s, config).run()

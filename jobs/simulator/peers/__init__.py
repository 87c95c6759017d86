"""The peers' policies: what our users could run instead of Omni, each modelled on the published
behaviour of the system it is named after (sources in each module's docstring):

- ``slurm`` (``peers.slurm``): multifactor priority (age, fair share), EASY backfill, preemption
  by partition ``PriorityTier`` with ``PreemptMode=REQUEUE`` and a ``GraceTime``;
- ``kueue`` (``peers.kueue``): ClusterQueues with nominal quotas in one cohort, borrowing,
  ``reclaimWithinCohort`` / ``withinClusterQueue`` preemption that kills and requeues;
- ``elastic`` (``peers.elastic``): TorchElastic / DLRover elastic scaling, growing into free
  GPUs and shrinking checkpoint-first at the moment of need, without lead time.

Each is a baseline, not the planner: it reads the planner's ``Snapshot`` and returns its
``Plan``, sharing only the mechanics in ``peers.common``. See docs/simulator.md.
"""

from jobs.simulator.peers.elastic import plan_elastic
from jobs.simulator.peers.kueue import plan_kueue
from jobs.simulator.peers.slurm import SlurmConfig, grace_time_for, slurm_planner

__all__ = ["SlurmConfig", "grace_time_for", "plan_elastic", "plan_kueue", "slurm_planner"]

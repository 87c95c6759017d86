"""Rule 8, no starvation: ``min_run_s`` protection, ageing of long waiters, and the queue's order.

Once started, a job is not preempted before its ``min_run_s`` of continuous run (regular jobs
default to the policy's 2 hours) except to honour a reservation, a fault or a drain. Every
``ageing_s`` a non-critical job waits raises its queue standing by one class step (never above
regular, never ahead of critical work), and a regular job that has waited ``ageing_s`` may
take GPUs from regular jobs that have had their turn (``turn_s``: ``min_run_s``, doubled for each
time they were stopped before) and that, stopped, would wait behind it in the queue
(``requeues_behind``) — so nobody is preempted over and over without progress, nobody is
stopped only to take its GPUs back at once, and nobody waits forever behind a stream of
newcomers. Within
a class and standing the queue goes by wait, a regular job's weighed with its length
(``queue_order_s``), so short work is not stuck behind multi-day jobs.

Ageing alone lifts a best-effort job to the regular standing but keeps it behind every regular
job, so on a cluster whose regular queue never empties it still waits for ever. A best-effort
job that has waited ``promote_after_s`` is *promoted* (``promoted``): it queues as a regular job
by right (``class_rank``), standing as one that came ``promote_after_s`` after it began waiting
(``queue_order_s``), and the run it then starts has the regular class's ``min_run_s``
(``min_run_of``), so the next regular arrival does not stop it at once.
"""

from __future__ import annotations

from jobs.planner.config import PlannerConfig
from jobs.planner.snapshot import PRIORITY_RANK, Job


def waiting_since_s(job: Job) -> float:
    """When the job began waiting for GPUs: its last stop, else its submission."""
    return job.queued_since_s if job.queued_since_s is not None else job.submit_s


def waited_s(job: Job, now_s: float) -> float:
    """How long the job has been waiting for GPUs now (0 if it holds some)."""
    return max(0.0, now_s - waiting_since_s(job))


def is_aged(job: Job, now_s: float, config: PlannerConfig) -> bool:
    """Whether the job has waited at least ``ageing_s``."""
    return not job.holdings and waited_s(job, now_s) >= config.ageing_s


def effective_rank(job: Job, now_s: float, config: PlannerConfig) -> int:
    """Queue standing: the class rank lowered by one per ``ageing_s`` waited (floor: regular)."""
    base = PRIORITY_RANK[job.priority]
    if base == 0 or config.ageing_s <= 0:
        return base
    steps = int(waited_s(job, now_s) // config.ageing_s)
    return max(1, base - steps)


def run_s(job: Job, now_s: float) -> float:
    """Continuous run so far (0 if not running)."""
    if job.run_started_s is None or not job.holdings:
        return 0.0
    return max(0.0, now_s - job.run_started_s)


def promotes(priority: str, waited_s: float, config: PlannerConfig) -> bool:
    """Whether a wait of ``waited_s`` promotes a job of ``priority``: a best-effort one, once it is
    ``promote_after_s`` long (0: never)."""
    return priority == "best_effort" and 0 < config.promote_after_s <= waited_s


def promoted(job: Job, now_s: float, config: PlannerConfig) -> bool:
    """Whether a waiting best-effort job stands as a regular job by right: its wait has lasted
    ``promote_after_s`` (``promotes``). The run it then starts is protected (``min_run_of``)."""
    return not job.holdings and promotes(job.priority, now_s - waiting_since_s(job), config)


def class_rank(job: Job, now_s: float, config: PlannerConfig) -> int:
    """The class the queue puts the job in among jobs of its standing: its own, regular for a
    promoted best-effort job (``promoted``)."""
    return PRIORITY_RANK["regular"] if promoted(job, now_s, config) else PRIORITY_RANK[job.priority]


def min_run_of(job: Job, config: PlannerConfig) -> float:
    """The continuous run that protects the job: its own ``min_run_s``, the policy's (the
    regular class's) for the run of a promoted best-effort job."""
    if not job.holdings or job.run_started_s is None:
        return job.min_run_s
    return run_protection_s(job.priority, job.min_run_s, job.run_started_s - waiting_since_s(job), config)


def run_protection_s(priority: str, min_run_s: float, waited_before_run_s: float, config: PlannerConfig) -> float:
    """``min_run_of`` from plain facts (the simulator's quota invariant reads it too): a
    best-effort run that followed a wait of ``promote_after_s`` has the policy's ``min_run_s``."""
    if min_run_s < config.min_run_s and promotes(priority, waited_before_run_s, config):
        return config.min_run_s
    return min_run_s


def protected_by_min_run(job: Job, now_s: float, config: PlannerConfig) -> bool:
    """Whether ``min_run_of`` still protects the job from a non-forced preemption."""
    min_run = min_run_of(job, config)
    return min_run > 0 and job.run_started_s is not None and run_s(job, now_s) < min_run


def protected_from_long_waiters(job: Job, now_s: float) -> bool:
    """Whether a long waiter of the job's own class may not stop it yet: it has run less than
    ``min_run_s`` doubled for every time it was stopped before (``turn_s``). Each stop doubles
    the next run's turn, so jobs of one class that all wait long take turns ever less often (a
    save and a restart per turn) instead of every ``min_run_s``: a job is stopped by turns at
    most about log2(its run / ``min_run_s``) times."""
    return job.min_run_s > 0 and job.run_started_s is not None and run_s(job, now_s) < turn_s(job)


def turn_s(job: Job) -> float:
    """How long the job runs, once restarted, before a long waiter of its class may stop it:
    ``min_run_s`` x 2 ^ (times it was stopped before). The exponent is capped where the turn
    outlasts any run (2 ^ 40 x a second is 35,000 years)."""
    return job.min_run_s * 2.0 ** min(job.preemptions, 40)


def queue_key(job: Job, now_s: float, config: PlannerConfig, tier: int) -> tuple:
    """Sort key for waiting jobs: tier (entitled, recovering...), aged class, class (a promoted
    job's regular: ``class_rank``), wait (with a regular job's length, ``queue_order_s``), name.

    An aged job moves up among the jobs of the class it aged into but stays behind the jobs
    that belong to that class by right when both have the same standing, until it is promoted.
    """
    since = waiting_since_s(job)
    return (tier, effective_rank(job, now_s, config), class_rank(job, now_s, config),
            queue_order_s(job, since, config), job.name)


def requeues_behind(victim: Job, standing_s: float, now_s: float, config: PlannerConfig) -> bool:
    """Whether ``victim``, stopped at ``now_s``, would wait behind a job of its class whose
    ``queue_order_s`` is ``standing_s``: only such a job may a long waiter stop. One that would
    wait ahead (a short job, under ``queue_length_weight``) would take the GPUs back at the next
    pass, and the stop would buy the waiter nothing but a save and a restart for the victim."""
    return queue_order_s(victim, now_s, config) > standing_s


def queue_order_s(job: Job, since: float, config: PlannerConfig) -> float:
    """Where a waiting job stands among the jobs of its class and standing: a regular job at
    ``since`` (when it began waiting) plus ``queue_length_weight`` x its remaining run at its
    preferred size (remaining steps x its step time), a best-effort job at ``since`` plus
    ``promote_after_s`` (where it stands among regular work once ``promoted``: as a regular job
    that came then; the same shift for every best-effort job, so their own order is their wait's),
    a critical one at ``since``.

    So among regular work a short job goes ahead of a long one that began waiting up to that
    fraction of the difference in their runs earlier (a deadline proportional to the job's length,
    as for an equal slowdown), and still behind one that has waited longer than that: the long
    job's standing does not move as newcomers arrive, so nobody is passed over for ever. It does
    not change while the job waits (its remaining steps do not), so a queue kept between passes
    stays in order. Best-effort work keeps the order of its wait: measured on the trace weeks, the
    same rule there cost more than it gave (docs/simulator.md, "What changed on 2026-12-05").
    """
    if job.priority == "best_effort" and config.promote_after_s > 0:
        # Its deadline among regular work, once promoted: promote_after_s after it began waiting.
        return since + config.promote_after_s
    if job.priority != "regular" or config.queue_length_weight <= 0:
        return since
    return since + config.queue_length_weight * job.remaining_steps * job.step_s

"""Every periodic task in one place: Celery beat reads it in production, and the embedded mode's
in-process loop (omniweb.loop) runs the very same task functions on the same intervals."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Queue(StrEnum):
    """Celery queues. The planner gets its own so a flood of telemetry never delays a decision."""

    PLANNER = "planner"
    CONTROL = "control"
    TELEMETRY = "telemetry"
    DEFAULT = "celery"


@dataclass(frozen=True)
class PeriodicTask:
    name: str  # the Celery task's registered name
    interval_s: float
    queue: Queue
    expires_s: float  # a tick not started by then is dropped: the next one supersedes it


# The schedule. Interval schedules are right here: these are sub-minute ticks of the control
# loop, idempotent and superseded by the next one, so a restart that resets them loses nothing;
# ``expires_s`` keeps a backlog from piling up while workers are down. Add each new periodic
# task to this list, nowhere else.
def _control_loop_tasks() -> list[PeriodicTask]:
    # The control loop (docs/control-loop.md); intervals come from settings so tests shorten them.
    from django.conf import settings

    planner_s = settings.OMNI_PLANNER_INTERVAL_S
    monitor_s = min(1.0, settings.OMNI_HEARTBEAT_INTERVAL_S / 4.0)
    sweep_s = min(2.0, settings.OMNI_COMMAND_ACK_TIMEOUT_S / 4.0)
    return [
        PeriodicTask("jobs.plan_tick", planner_s, Queue.PLANNER, expires_s=planner_s),
        PeriodicTask("jobs.monitor_heartbeats", monitor_s, Queue.CONTROL, expires_s=max(1.0, monitor_s)),
        PeriodicTask("jobs.sweep_commands", sweep_s, Queue.CONTROL, expires_s=max(1.0, sweep_s)),
    ]


def _telemetry_tasks() -> list[PeriodicTask]:
    # Telemetry rollups and partition upkeep (docs/telemetry.md); both idempotent.
    from django.conf import settings

    rollup_s = settings.OMNI_TELEMETRY_ROLLUP_INTERVAL_S
    return [
        PeriodicTask("telemetry.roll_up", rollup_s, Queue.TELEMETRY, expires_s=rollup_s),
        PeriodicTask("telemetry.maintain_partitions", 600.0, Queue.TELEMETRY, expires_s=600.0),
    ]


def _retention_tasks() -> list[PeriodicTask]:
    # Log lines past OMNI_LOG_RETENTION_S (docs/logs.md). Hourly is plenty for a retention of
    # days; beat keeps its last run in its schedule file and the in-process loop runs it at
    # start, so a restart delays it at most one interval. Idempotent, batched.
    return [PeriodicTask("jobs.prune_logs", 3600.0, Queue.TELEMETRY, expires_s=600.0)]


def _storage_tasks() -> list[PeriodicTask]:
    # Run dirs of cancelled and failed jobs past OMNI_RUN_DIR_RETENTION_S (docs/storage.md): a
    # tenth of the retention, at most every 10 minutes. Idempotent (a job with an open clean
    # command is skipped), batched.
    from django.conf import settings

    sweep_s = min(600.0, max(5.0, settings.OMNI_RUN_DIR_RETENTION_S / 10.0))
    return [PeriodicTask("jobs.sweep_run_dirs", sweep_s, Queue.CONTROL, expires_s=sweep_s)]


def _audit_tasks() -> list[PeriodicTask]:
    # The audit chain's head, appended to a file outside the database (docs/audit-log.md): what was
    # recorded before a publication cannot be deleted or rewritten unseen. Skipped when unmoved.
    from django.conf import settings

    every_s = settings.OMNI_AUDIT_HEAD_EVERY_S
    return [PeriodicTask("jobs.publish_audit_head", every_s, Queue.CONTROL, expires_s=every_s)]


PERIODIC_TASKS: list[PeriodicTask] = [
    *_control_loop_tasks(), *_telemetry_tasks(), *_retention_tasks(), *_storage_tasks(), *_audit_tasks(),
]


def setup_periodic_tasks(app) -> None:
    for task in PERIODIC_TASKS:
        app.add_periodic_task(
            task.interval_s,
            app.signature(task.name, queue=str(task.queue)),
            name=task.name,
            expires=task.expires_s,
        )

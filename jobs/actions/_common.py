"""What several action modules share: actor names, a job's GPUs and checkpoints, and the
after-commit trigger of a planner pass. Everything here runs inside the caller's transaction."""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.utils import timezone

from jobs.models import Allocation, Integration, Job, JobState
from jobs.planner.wording import duration_words
from omniweb.celery import app

control_logger = logging.getLogger("jobs.control")

PLANNER_ACTOR = "planner"
# The states in which a job's workers run and report progress and checkpoints.
WORKING_JOB_STATES = (JobState.RUNNING, JobState.CHECKPOINTING, JobState.RESIZING)
# Registered in jobs/tasks.py. Named, not imported: tasks call actions, never the reverse.
PLAN_TICK_TASK = "jobs.plan_tick"


def actor_name(user) -> str:
    return user.get_username() if user is not None else "system"


def agent_actor(node) -> str:
    return f"agent:{node.name}"


def job_nodes(job: Job) -> list[str]:
    return sorted({a.node.name for a in job.allocations.select_related("node")})


def release_allocations(job: Job) -> list[str]:
    """Free every GPU of the job (closing their spans); return the names of the nodes they were on."""
    nodes = job_nodes(job)
    Allocation.objects.filter(job=job).release()
    return nodes


def stopped_layout(job: Job) -> dict[str, int]:
    """An audit row's layout fields for a run that ends (completed, cancelled, failed, faulted):
    the DP and accumulation it ran at, to no replica (the audit page's "2×8 → 0")."""
    return {"dp_before": job.dp, "accum_before": job.accum_steps, "dp_after": 0}


def kept_layout(job: Job) -> dict[str, int]:
    """An audit row's layout fields for a decision that changes no layout (a hold, a health check):
    the same on both sides (the audit page's "2×8")."""
    return {"dp_before": job.dp, "accum_before": job.accum_steps, "dp_after": job.dp, "accum_after": job.accum_steps}


def lose_unsaved_steps(job: Job) -> int:
    """Roll progress back to the last completed checkpoint; return how many steps were lost."""
    lost = max(0, job.committed_steps - job.last_checkpoint_step)
    job.committed_steps = job.last_checkpoint_step
    return lost


def lost_facts(job: Job, lost: int, *, resumes: bool = True) -> tuple[dict[str, Any], str]:
    """What a kill or a fault cost ``job`` once its progress was rolled back (``lost`` steps), as
    far as Omni can tell: the audit outcome's facts and a clause for its sentence. An ``omni``
    job resumes from its last checkpoint (named, unless it ``resumes`` no more: it failed). A
    ``signal`` job's checkpoints are its own: the steps it reported were not saved where Omni can
    see, so the cost is the time since its last start, and its progress shows again as the next
    run reports steps (docs/workloads.md)."""
    if job.integration != Integration.SIGNAL:
        facts = {"steps_lost": lost, **({"resume_from_step": job.last_checkpoint_step} if resumes else {})}
        return facts, f"{lost} steps lost (resumes from step {job.last_checkpoint_step})"
    ran_s = max(0.0, (timezone.now() - job.started_at).total_seconds()) if job.started_at else 0.0
    reported = f" (it had reported step {lost})" if lost else ""
    return ({"time_lost_s": round(ran_s, 1), "steps_reported": lost},
            f"its script resumes from its own last save, which Omni cannot see: up to {duration_words(ran_s)} "
            f"of work since its last start may be lost{reported}")


def kill_and_release(job: Job) -> int:
    """Take a job's GPUs without a checkpoint: progress falls back to the last save."""
    lost = lose_unsaved_steps(job)
    fields = ["committed_steps", "preemptions"]
    if job.state == JobState.RUNNING:
        fields += job.transition_to(JobState.CHECKPOINTING)
    fields += job.transition_to(JobState.PREEMPTED)
    job.preemptions += 1
    job.save(update_fields=fields)
    Allocation.objects.filter(job=job).release()
    return lost


def note_checkpoint(job: Job, outcome: dict[str, Any]) -> list[str]:
    """Take the checkpoint step and save/load times an agent reported; return the fields set."""
    step = outcome.get("checkpoint_step")
    fields: list[str] = []
    if isinstance(step, int) and 0 <= step <= job.total_steps and step >= job.last_checkpoint_step:
        job.last_checkpoint_step = step
        job.last_checkpoint_at = timezone.now()
        job.committed_steps = step
        fields += ["last_checkpoint_step", "last_checkpoint_at", "committed_steps"]
    save_s = outcome.get("save_s")
    if isinstance(save_s, (int, float)) and save_s >= 0:
        job.measured_save_s = float(save_s)
        fields.append("measured_save_s")
    load_s = outcome.get("load_s")
    if isinstance(load_s, (int, float)) and load_s >= 0:
        job.measured_load_s = float(load_s)
        fields.append("measured_load_s")
    if "measured_save_s" in fields or "measured_load_s" in fields:
        from jobs.actions.rhythm import observe_checkpoint

        observe_checkpoint(job, save_s=job.measured_save_s if "measured_save_s" in fields else None,
                           load_s=job.measured_load_s if "measured_load_s" in fields else None)
    return fields


def trigger_plan(trigger: str) -> None:
    """Ask for a planner pass once the transaction commits (eagerly, in embedded mode)."""
    app.tasks[PLAN_TICK_TASK].delay_on_commit(trigger)


def trigger_plan_with_broker(trigger: str) -> None:
    """Ask for a planner pass after commit when a worker fleet serves the queue. Eager (embedded
    and unit-test) runs leave it to the in-process loop's next tick instead of planning inline
    inside a user's request."""
    if not settings.CELERY_TASK_ALWAYS_EAGER:
        trigger_plan(trigger)


def change_value_words(field: str, value: Any) -> str:
    """A changed value as a person reads it: ``on``/``off``, ``120 s``, ``none``; never ``False``."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == "":
        return "none"
    if field.endswith("_s") and isinstance(value, int | float):
        return f"{value:g} s"
    return str(value)


def describe_changes(before: dict[str, Any], after: dict[str, Any]) -> str:
    """``gpu_model H100-80GB → H200-141GB, min run 60 s → 120 s``: fields and values in words."""
    return ", ".join(
        f"{field.removesuffix('_s').replace('_', ' ')} {change_value_words(field, before[field])} → "
        f"{change_value_words(field, after[field])}"
        for field in before if field in after
    )

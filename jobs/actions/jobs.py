"""Writes on jobs by people (and the seed): submit, cancel, and place a job on given GPUs."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from jobs.actions._common import actor_name, release_allocations, trigger_plan_with_broker
from jobs.actions.commands import dispatch_on_commit, write_stop_commands
from jobs.audit import record_event
from jobs.models import Allocation, Job, JobState, Node, PlannerControl, Priority, Reservation
from jobs.models.jobs import ACTIVE_JOB_STATES
from jobs.roles import require_job_actor, require_operator
from jobs.vocab import EventKind


@transaction.atomic
def submit_job(
    owner,
    *,
    name: str,
    priority: str,
    dp: int,
    global_batch: int,
    micro_batch: int,
    total_steps: int,
    step_s: float,
    tp: int = 1,
    pp: int = 1,
    dp_min: int | None = None,
    dp_max: int | None = None,
    comm_fraction: float = 0.1,
    min_run_s: int | None = None,
    checkpoint_every_steps: int = 500,
    checkpoint_save_s: float = 30.0,
    checkpoint_load_s: float = 60.0,
) -> Job:
    """Queue a new job at its preferred DP; the planner places it."""
    if priority == Priority.CRITICAL:
        require_operator(owner, "submit critical jobs (they carry reservations and SLAs)")
    dp_min = dp if dp_min is None else dp_min
    dp_max = dp if dp_max is None else dp_max
    errors: dict[str, str] = {}
    if micro_batch and dp and global_batch % (micro_batch * dp):
        errors["global_batch"] = (
            f"global batch {global_batch} does not split into {dp} replicas of micro-batch {micro_batch}"
        )
    if dp_min > dp_max:
        errors["dp_min"] = f"dp_min {dp_min} is larger than dp_max {dp_max}"
    elif not dp_min <= dp <= dp_max:
        errors["dp"] = f"dp {dp} is outside [dp_min {dp_min}, dp_max {dp_max}]"
    if Job.objects.filter(name=name).exists():
        errors["name"] = f"a job named {name!r} already exists"
    if errors:
        raise ValidationError(errors)
    if min_run_s is None:
        min_run_s = PlannerControl.load().min_run_s if priority == Priority.REGULAR else 0
    job = Job(
        name=name,
        owner=owner,
        priority=priority,
        tp=tp,
        pp=pp,
        dp=dp,
        dp_min=dp_min,
        dp_max=dp_max,
        global_batch=global_batch,
        micro_batch=micro_batch,
        accum_steps=global_batch // (micro_batch * dp),
        total_steps=total_steps,
        step_s=step_s,
        comm_fraction=comm_fraction,
        min_run_s=min_run_s,
        checkpoint_every_steps=checkpoint_every_steps,
        checkpoint_save_s=checkpoint_save_s,
        checkpoint_load_s=checkpoint_load_s,
    )
    job.full_clean()
    job.save()
    record_event(
        EventKind.SUBMIT,
        job=job,
        actor=actor_name(owner),
        actor_user=owner,
        dp_after=job.dp,
        accum_after=job.accum_steps,
        global_batch=job.global_batch,
        gpus_after=job.gpus_wanted,
        reason={
            "rule": "submit",
            "text": f"{owner.get_username()} submitted {job.name} ({job.get_priority_display().lower()}, "
            f"{job.tp}x{job.pp}x{job.dp} = {job.gpus_wanted} GPUs, global batch {job.global_batch}).",
            "inputs": {"tp": tp, "pp": pp, "dp": dp, "dp_min": dp_min, "dp_max": dp_max},
        },
    )
    trigger_plan_with_broker("job_submitted")
    return job


@transaction.atomic
def cancel_job(job: Job, actor) -> Job:
    """Cancel a job: stop its workers and free its GPUs. Terminal jobs answer 409."""
    job = Job.objects.select_for_update().get(pk=job.pk)
    require_job_actor(actor, job, "cancel")
    was_active = job.state in ACTIVE_JOB_STATES
    gpus_before = job.allocations.count()
    job.save(update_fields=job.transition_to(JobState.CANCELLED))
    nodes = release_allocations(job)
    if was_active:
        stopped = list(Node.objects.filter(name__in=nodes))
        write_stop_commands(job, stopped, kill=False)
        dispatch_on_commit({n.id for n in stopped})
    trigger_plan_with_broker("job_cancelled")
    record_event(
        EventKind.CANCEL,
        job=job,
        actor=actor_name(actor),
        actor_user=actor,
        nodes_before=nodes,
        gpus_before=gpus_before,
        gpus_after=0,
        dp_before=job.dp,
        global_batch=job.global_batch,
        reason={"rule": "cancel", "text": f"{actor_name(actor)} cancelled {job.name}.", "inputs": {}},
    )
    return job


@transaction.atomic
def place_job(
    job: Job,
    gpus: list[tuple[Node, int]],
    *,
    actor: str,
    reason: dict[str, Any],
    borrowed_from: Reservation | None = None,
    loan_until: datetime | None = None,
) -> Job:
    """Start a pending or preempted job on ``gpus`` (whole replicas), at the DP they make.

    The planner places through its pass (jobs.actions.planner_pass); this seeds a running job
    without agents: ``seed_demo``, the benchmarks and tests.
    """
    job = Job.objects.select_for_update().get(pk=job.pk)
    if len(gpus) % job.replica_gpus:
        raise ValidationError({"gpus": f"{len(gpus)} GPUs is not a whole number of {job.replica_gpus}-GPU replicas"})
    if any(not node.is_schedulable for node, _ in gpus):
        raise ValidationError({"gpus": "every GPU must be on a healthy node"})
    dp_before, accum_before = job.dp, job.accum_steps
    job.set_dp(len(gpus) // job.replica_gpus)
    fields = job.transition_to(JobState.RUNNING)
    job.pending_reason = ""
    job.save(update_fields=[*fields, "dp", "accum_steps", "pending_reason"])
    Allocation.objects.bulk_create(
        Allocation(job=job, node=node, gpu_index=index, borrowed_from=borrowed_from, loan_until=loan_until)
        for node, index in gpus
    )
    record_event(
        EventKind.LEND if borrowed_from is not None else EventKind.PLACE,
        job=job,
        actor=actor,
        nodes_after=[node.name for node, _ in gpus],
        gpus_before=0,
        gpus_after=len(gpus),
        dp_before=dp_before,
        dp_after=job.dp,
        accum_before=accum_before,
        accum_after=job.accum_steps,
        global_batch=job.global_batch,
        reason=reason,
    )
    return job

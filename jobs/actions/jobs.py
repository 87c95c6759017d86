"""Writes on jobs by people (and the seed): submit, cancel, an operator's edit, and place a job
on given GPUs."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from jobs.actions._common import actor_name, describe_changes, release_allocations, trigger_plan_with_broker
from jobs.actions.commands import dispatch_on_commit, write_stop_commands
from jobs.actions.edits import changed_facts, refuse_invalid, wait_for_planner, with_changes
from jobs.audit import record_event
from jobs.models import Allocation, Job, JobState, Node, PlannerControl, Priority, Reservation
from jobs.models.jobs import ACTIVE_JOB_STATES
from jobs.planner.layout import fit_problems
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
    """Queue a new job at its preferred DP; the planner places it.

    Refused with a message per field (the API's 400) when the spec is inconsistent or the job
    could never run on this cluster (``jobs.planner.layout.fit_problems``: a tensor-parallel
    group larger than the largest node, more replicas at the least than the cluster holds).
    """
    if priority == Priority.CRITICAL:
        require_operator(owner, "submit critical jobs (they carry reservations and SLAs)")
    min_field = "dp" if dp_min is None else "dp_min"  # name the field the submitter sent
    dp_min = dp if dp_min is None else dp_min
    dp_max = dp if dp_max is None else dp_max
    errors: dict[str, str] = {}
    if micro_batch and dp and global_batch % (micro_batch * dp):
        errors["global_batch"] = (
            f"global batch {global_batch} is not micro-batch {micro_batch} × dp {dp} × a whole number of "
            f"accumulation steps ({micro_batch * dp} does not divide {global_batch})"
        )
    if dp_min > dp_max:
        errors["dp_min"] = f"dp_min {dp_min} is larger than dp_max {dp_max}"
    elif not dp_min <= dp <= dp_max:
        errors["dp"] = f"dp {dp} is outside [dp_min {dp_min}, dp_max {dp_max}]"
    if tp >= 1 and pp >= 1 and dp_min >= 1:
        node_gpus = list(Node.objects.values_list("gpu_count", flat=True))
        for field, problem in fit_problems(tp, pp, dp_min, node_gpus).items():
            errors.setdefault(min_field if field == "dp_min" else field, problem)
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


# -- an operator's edit ---------------------------------------------------------------------------

# What the planner reads afresh on every pass and nothing on a node depends on: an operator may
# change it until the job ends.
JOB_EDITABLE_UNTIL_DONE = ("owner", "priority", "min_run_s")
# The spec the job's workers are launched with (layout, batch, steps, checkpoint cadence) and the
# estimates the planner sizes it by: fixed once the job has started, since its running workers
# and its checkpoints would no longer match. DP and accumulation are the planner's throughout.
JOB_EDITABLE_WHILE_PENDING = (
    "tp", "pp", "dp_min", "dp_max", "global_batch", "micro_batch", "total_steps", "step_s", "comm_fraction",
    "checkpoint_every_steps", "checkpoint_save_s", "checkpoint_load_s",
)


def job_editable_fields(job: Job) -> tuple[str, ...]:
    """The fields an operator may change on ``job`` in its present state."""
    if job.is_terminal:
        return ()
    if job.state == JobState.PENDING:
        return JOB_EDITABLE_UNTIL_DONE + JOB_EDITABLE_WHILE_PENDING
    return JOB_EDITABLE_UNTIL_DONE


def _why_fixed(job: Job, field: str) -> str:
    if job.is_terminal:
        return f"{job.name} is {job.state}: it can no longer change"
    if field in JOB_EDITABLE_WHILE_PENDING:
        return f"only a pending job's {field} can change; {job.name} is {job.state}"
    return "this field cannot be changed here"


def _live_reservations(job: Job) -> list[Reservation]:
    ended = Q(cancelled_at__isnull=False) | Q(end_at__lte=timezone.now())
    return list(job.reservations.exclude(ended))


def job_with_changes(job: Job, changes: dict[str, Any]) -> Job:
    """The job as the edit would leave it, its accumulation recomputed so the global batch holds,
    or a ValidationError naming each refused field. The admin's form asks it; ``edit_job`` asks
    again under its locks."""
    errors = {field: [_why_fixed(job, field)] for field in sorted(set(changes) - set(job_editable_fields(job)))}
    edited = with_changes(job, changes)
    for field in ("tp", "pp", "dp_min", "global_batch", "micro_batch"):
        if getattr(edited, field) < 1:
            errors[field] = [f"{field} is at least 1"]
    if errors:
        raise ValidationError(errors)  # the checks below divide by these
    owner = changes.get("owner")
    if owner is not None and not owner.is_active:
        errors["owner"] = [f"{owner} is a disabled account"]
    reservations = _live_reservations(job) if job.priority == Priority.CRITICAL else []
    if reservations and edited.priority != Priority.CRITICAL:
        held = ", ".join(r.name for r in reservations)
        errors["priority"] = [f"only critical jobs hold reservations: cancel {held} first"]
    for reservation in reservations:
        if reservation.gpus % edited.replica_gpus:
            errors.setdefault("pp" if "pp" in changes else "tp", []).append(
                f"reservation {reservation.name} holds {reservation.gpus} GPUs, not a whole number of "
                f"{edited.tp}x{edited.pp}-GPU replicas"
            )
    if not edited.dp_min <= edited.dp <= edited.dp_max:
        errors["dp_min" if "dp_min" in changes else "dp_max"] = [
            f"{job.name} is at DP {edited.dp}: [dp_min {edited.dp_min}, dp_max {edited.dp_max}] must include it"
        ]
    elif edited.global_batch % (edited.micro_batch * edited.dp):
        errors["global_batch" if "global_batch" in changes else "micro_batch"] = [
            f"global batch {edited.global_batch} does not split into {edited.dp} replicas of micro-batch "
            f"{edited.micro_batch}"
        ]
    else:
        edited.accum_steps = edited.global_batch // (edited.micro_batch * edited.dp)
    if edited.total_steps < edited.committed_steps:
        errors["total_steps"] = [f"{job.name} has already run {edited.committed_steps} steps"]
    if {"tp", "pp", "dp_min"} & set(changes):  # the same "can it ever run here" rule as submit_job
        node_gpus = list(Node.objects.values_list("gpu_count", flat=True))
        for field, problem in fit_problems(edited.tp, edited.pp, edited.dp_min, node_gpus).items():
            errors.setdefault(field, []).append(problem)
    refuse_invalid(edited, errors)
    return edited


@transaction.atomic
def edit_job(job: Job, actor, **changes: Any) -> Job:
    """Change a job's owner, priority or run guarantee, or a pending job's spec (see
    ``job_editable_fields``); the audit row keeps the before and after. Jobs are never deleted:
    they are cancelled."""
    require_operator(actor, "edit jobs")
    wait_for_planner()
    job = Job.objects.select_for_update().get(pk=job.pk)
    edited = job_with_changes(job, changes)
    before, after = changed_facts(job, edited, [*changes, "accum_steps"])
    if not before:
        return job
    edited.save(update_fields=list(before))
    record_event(
        EventKind.JOB_EDITED,
        job=edited,
        actor=actor_name(actor),
        actor_user=actor,
        dp_before=job.dp,
        dp_after=edited.dp,
        accum_before=job.accum_steps,
        accum_after=edited.accum_steps,
        global_batch=edited.global_batch,
        reason={
            "rule": "job_edited",
            "text": f"{actor_name(actor)} changed job {job.name}: {describe_changes(before, after)}.",
            "inputs": {"job": job.name, "before": before, "after": after},
        },
    )
    trigger_plan_with_broker("job_edited")
    return edited


@transaction.atomic
def place_job(
    job: Job,
    gpus: list[tuple[Node, int]],
    *,
    actor: str,
    reason: dict[str, Any],
    borrowed_from: Reservation | None = None,
    loan_until: datetime | None = None,
    since: datetime | None = None,
) -> Job:
    """Start a pending or preempted job on ``gpus`` (whole replicas), at the DP they make.

    The planner places through its pass (jobs.actions.planner_pass); this seeds a running job
    without agents: ``seed_demo``, the benchmarks and tests. ``since`` (default now) is when the
    job took the GPUs: a seed that also writes past telemetry places the job before it, since a
    job's charts show each GPU only from then on.
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
    since = since or timezone.now()
    Allocation.objects.bulk_create(
        Allocation(job=job, node=node, gpu_index=index, borrowed_from=borrowed_from, loan_until=loan_until,
                   since=since)
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

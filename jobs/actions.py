"""Every write that touches more than one row: atomic, permission-checked, audited.

Views, the API, consumers, tasks and admin actions all call these functions, never the ORM
directly, so each change records its audit event in the same transaction (Zulip's
``zerver/actions``). Illegal state changes raise ``IllegalTransition`` (the API answers 409),
bad input raises ``ValidationError`` (400), the wrong role ``PermissionDenied`` (403).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from jobs.audit import record_event
from jobs.models import (
    Allocation,
    Command,
    CommandKind,
    EventKind,
    Job,
    JobState,
    Node,
    NodeState,
    PlannerControl,
    Priority,
    Reservation,
)
from jobs.models.jobs import ACTIVE_JOB_STATES
from jobs.roles import require_job_actor, require_operator

# -- jobs ------------------------------------------------------------------------------------


def _actor_name(user) -> str:
    return user.get_username() if user is not None else "system"


def _job_nodes(job: Job) -> list[str]:
    return sorted({a.node.name for a in job.allocations.select_related("node")})


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
        actor=_actor_name(owner),
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
    return job


def _release_allocations(job: Job) -> list[str]:
    nodes = _job_nodes(job)
    Allocation.objects.filter(job=job).delete()
    return nodes


@transaction.atomic
def cancel_job(job: Job, actor) -> Job:
    """Cancel a job: stop its workers and free its GPUs. Terminal jobs answer 409."""
    job = Job.objects.select_for_update().get(pk=job.pk)
    require_job_actor(actor, job, "cancel")
    was_active = job.state in ACTIVE_JOB_STATES
    gpus_before = job.allocations.count()
    job.transition_to(JobState.CANCELLED)
    job.save(update_fields=["state", "state_changed_at", "finished_at"])
    nodes = _release_allocations(job)
    if was_active:
        for node in Node.objects.filter(name__in=nodes):
            Command.objects.create(node=node, job=job, kind=CommandKind.STOP, payload={"job": job.name})
    record_event(
        EventKind.CANCEL,
        job=job,
        actor=_actor_name(actor),
        actor_user=actor,
        nodes_before=nodes,
        gpus_before=gpus_before,
        gpus_after=0,
        dp_before=job.dp,
        global_batch=job.global_batch,
        reason={"rule": "cancel", "text": f"{_actor_name(actor)} cancelled {job.name}.", "inputs": {}},
    )
    return job


# -- nodes -----------------------------------------------------------------------------------


def _node_action(node: Node, actor, target: str, kind: str, text: str) -> Node:
    node = Node.objects.select_for_update().get(pk=node.pk)
    before = node.state
    node.transition_to(target)
    node.save(update_fields=["state", "state_changed_at"])
    record_event(
        kind,
        actor=_actor_name(actor),
        actor_user=actor,
        nodes_before=[node.name],
        nodes_after=[node.name],
        reason={"rule": kind, "text": text, "inputs": {"node": node.name, "from": before, "to": target}},
    )
    return node


@transaction.atomic
def cordon_node(node: Node, actor) -> Node:
    """No new work lands on the node; what runs there stays."""
    require_operator(actor, "cordon nodes")
    return _node_action(
        node, actor, NodeState.CORDONED, EventKind.CORDON,
        f"{_actor_name(actor)} cordoned {node.name}: no new work will be placed there.",
    )


@transaction.atomic
def uncordon_node(node: Node, actor) -> Node:
    """Return a cordoned or draining node to service."""
    require_operator(actor, "uncordon nodes")
    return _node_action(
        node, actor, NodeState.HEALTHY, EventKind.UNCORDON,
        f"{_actor_name(actor)} returned {node.name} to service.",
    )


@transaction.atomic
def drain_node(node: Node, actor) -> Node:
    """No new work; the planner moves what runs there off gracefully (checkpoint first)."""
    require_operator(actor, "drain nodes")
    held = Allocation.objects.filter(node=node).values_list("job__name", flat=True).distinct()
    jobs_text = ", ".join(sorted(held)) or "nothing"
    return _node_action(
        node, actor, NodeState.DRAINING, EventKind.DRAIN,
        f"{_actor_name(actor)} drained {node.name}; running there: {jobs_text}.",
    )


@transaction.atomic
def mark_node_repaired(node: Node, actor) -> Node:
    """An operator (or a health check) re-admits a failed or suspect node."""
    require_operator(actor, "mark nodes repaired")
    return _node_action(
        node, actor, NodeState.HEALTHY, EventKind.NODE_REPAIRED,
        f"{_actor_name(actor)} marked {node.name} repaired and healthy.",
    )


# -- reservations ----------------------------------------------------------------------------


def _validate_reservation(reservation: Reservation) -> None:
    errors: dict[str, str] = {}
    job = reservation.job
    if job.priority != Priority.CRITICAL:
        errors["job"] = f"job {job.name!r} is {job.priority}; only critical jobs hold reservations"
    elif job.is_terminal:
        errors["job"] = f"job {job.name!r} is {job.state}; it needs no reservation"
    if reservation.gpus and reservation.gpus % job.replica_gpus:
        errors["gpus"] = (
            f"{reservation.gpus} GPUs is not a whole number of {job.name}'s replicas "
            f"({job.tp}x{job.pp} = {job.replica_gpus} GPUs each)"
        )
    if (reservation.period_s is None) != (reservation.active_s is None):
        errors["period_s"] = "a recurring reservation needs both period_s and active_s"
    elif reservation.period_s is not None and not 0 < reservation.active_s <= reservation.period_s:
        errors["active_s"] = f"active_s must be between 1 and period_s ({reservation.period_s})"
    if reservation.end_at is not None and reservation.end_at <= reservation.start_at:
        errors["end_at"] = "end_at must be after start_at"
    if errors:
        raise ValidationError(errors)


def _reservation_facts(reservation: Reservation) -> dict[str, Any]:
    return {
        "gpus": reservation.gpus,
        "spares": reservation.spares,
        "start_at": reservation.start_at.isoformat(),
        "end_at": reservation.end_at.isoformat() if reservation.end_at else None,
        "period_s": reservation.period_s,
        "active_s": reservation.active_s,
    }


@transaction.atomic
def create_reservation(
    actor,
    *,
    name: str,
    job: Job,
    gpus: int,
    start_at: datetime,
    spares: int = 0,
    end_at: datetime | None = None,
    period_s: int | None = None,
    active_s: int | None = None,
) -> Reservation:
    """Guarantee ``gpus`` to a critical job over a span (optionally recurring)."""
    require_operator(actor, "create reservations")
    if Reservation.objects.filter(name=name).exists():
        raise ValidationError({"name": f"a reservation named {name!r} already exists"})
    reservation = Reservation(
        name=name, job=job, gpus=gpus, spares=spares, start_at=start_at, end_at=end_at,
        period_s=period_s, active_s=active_s, created_by=actor,
    )
    _validate_reservation(reservation)
    reservation.save()
    window = f"every {period_s}s for {active_s}s" if period_s else "continuously"
    record_event(
        EventKind.RESERVE,
        job=job,
        actor=_actor_name(actor),
        actor_user=actor,
        gpus_after=gpus,
        reason={
            "rule": "reserve",
            "text": f"{_actor_name(actor)} reserved {gpus} GPUs (+{spares} spares) for {job.name} "
            f"from {start_at:%Y-%m-%d %H:%M} UTC, {window}.",
            "inputs": {"reservation": name, **_reservation_facts(reservation)},
        },
    )
    return reservation


RESERVATION_EDITABLE = ("gpus", "spares", "start_at", "end_at", "period_s", "active_s")


@transaction.atomic
def update_reservation(reservation: Reservation, actor, **changes: Any) -> Reservation:
    """Edit a reservation's size or windows; the audit keeps the before and after."""
    require_operator(actor, "edit reservations")
    unknown = set(changes) - set(RESERVATION_EDITABLE)
    if unknown:
        raise ValidationError({field: "this field cannot be changed" for field in sorted(unknown)})
    reservation = Reservation.objects.select_for_update().get(pk=reservation.pk)
    if reservation.cancelled_at is not None:
        raise ValidationError({"name": "a cancelled reservation cannot be edited"})
    before = _reservation_facts(reservation)
    for field, value in changes.items():
        setattr(reservation, field, value)
    _validate_reservation(reservation)
    reservation.save(update_fields=list(changes))
    record_event(
        EventKind.RESERVATION_CHANGE,
        job=reservation.job,
        actor=_actor_name(actor),
        actor_user=actor,
        gpus_before=before["gpus"],
        gpus_after=reservation.gpus,
        reason={
            "rule": "reservation_change",
            "text": f"{_actor_name(actor)} changed reservation {reservation.name}.",
            "inputs": {"before": before, "after": _reservation_facts(reservation)},
        },
    )
    return reservation


@transaction.atomic
def cancel_reservation(reservation: Reservation, actor) -> Reservation:
    """End a reservation now; its loans are no longer owed back."""
    require_operator(actor, "cancel reservations")
    reservation = Reservation.objects.select_for_update().get(pk=reservation.pk)
    if reservation.cancelled_at is not None:
        raise ValidationError({"name": "the reservation is already cancelled"})
    reservation.cancelled_at = timezone.now()
    reservation.save(update_fields=["cancelled_at"])
    record_event(
        EventKind.RESERVATION_CANCEL,
        job=reservation.job,
        actor=_actor_name(actor),
        actor_user=actor,
        gpus_before=reservation.gpus,
        gpus_after=0,
        reason={
            "rule": "reservation_cancel",
            "text": f"{_actor_name(actor)} cancelled reservation {reservation.name}.",
            "inputs": _reservation_facts(reservation),
        },
    )
    return reservation


# -- planner controls ------------------------------------------------------------------------

PLANNER_KNOBS = ("paused", "dry_run", "safety_factor", "min_run_s", "reclaim_grace_s")


@transaction.atomic
def set_planner_control(actor, **changes: Any) -> PlannerControl:
    """Pause/resume the planner, switch dry-run, or turn its knobs; each change is audited."""
    require_operator(actor, "change the planner's controls")
    unknown = set(changes) - set(PLANNER_KNOBS)
    if unknown:
        raise ValidationError({field: "not a planner control" for field in sorted(unknown)})
    if "safety_factor" in changes and not 1.0 <= float(changes["safety_factor"]) <= 10.0:
        raise ValidationError({"safety_factor": "must be between 1.0 and 10.0"})
    PlannerControl.load()
    control = PlannerControl.objects.select_for_update().get(pk=1)
    before = {knob: getattr(control, knob) for knob in changes}
    for knob, value in changes.items():
        setattr(control, knob, value)
    control.updated_at = timezone.now()
    control.updated_by = actor
    control.save(update_fields=[*changes, "updated_at", "updated_by"])
    described = ", ".join(f"{knob} {before[knob]} -> {value}" for knob, value in changes.items())
    record_event(
        EventKind.OVERRIDE,
        actor=_actor_name(actor),
        actor_user=actor,
        reason={
            "rule": "planner_control",
            "text": f"{_actor_name(actor)} changed the planner: {described}.",
            "inputs": {"before": before, "after": changes},
        },
    )
    return control


# -- placement -------------------------------------------------------------------------------


@transaction.atomic
def place_job(
    job: Job,
    gpus: list[tuple[Node, int]],
    *,
    actor: str,
    reason: dict[str, Any],
    borrowed_from: Reservation | None = None,
    loan_until: datetime | None = None,
    planner_run=None,
) -> Job:
    """Start a pending or preempted job on ``gpus`` (whole replicas), at the DP they make."""
    job = Job.objects.select_for_update().get(pk=job.pk)
    if len(gpus) % job.replica_gpus:
        raise ValidationError({"gpus": f"{len(gpus)} GPUs is not a whole number of {job.replica_gpus}-GPU replicas"})
    if any(not node.is_schedulable for node, _ in gpus):
        raise ValidationError({"gpus": "every GPU must be on a healthy node"})
    dp_before, accum_before = job.dp, job.accum_steps
    job.set_dp(len(gpus) // job.replica_gpus)
    job.transition_to(JobState.RUNNING)
    job.pending_reason = ""
    job.save(update_fields=["dp", "accum_steps", "state", "state_changed_at", "started_at",
                            "first_started_at", "pending_reason"])
    Allocation.objects.bulk_create(
        Allocation(job=job, node=node, gpu_index=index, borrowed_from=borrowed_from, loan_until=loan_until)
        for node, index in gpus
    )
    record_event(
        EventKind.LEND if borrowed_from is not None else EventKind.PLACE,
        job=job,
        actor=actor,
        planner_run=planner_run,
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

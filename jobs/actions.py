"""Every write that touches more than one row: atomic, permission-checked, audited.

Views, the API, consumers, tasks and admin actions all call these functions, never the ORM
directly, so each change records its audit event in the same transaction (Zulip's
``zerver/actions``). Illegal state changes raise ``IllegalTransition`` (the API answers 409),
bad input raises ``ValidationError`` (400), the wrong role ``PermissionDenied`` (403).
"""

from __future__ import annotations

import logging
import time as _time
from dataclasses import dataclass
from dataclasses import field as dc_field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from jobs.audit import record_event
from jobs.models import (
    Allocation,
    Command,
    CommandKind,
    ElasticEvent,
    EventKind,
    Job,
    JobState,
    Node,
    NodeState,
    PlannerControl,
    PlannerRun,
    Priority,
    Reservation,
)
from jobs.models.commands import CommandState
from jobs.models.jobs import ACTIVE_JOB_STATES, TERMINAL_JOB_STATES
from jobs.models.states import BatchInvariantError, IllegalTransition
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
    _trigger_plan_with_broker("job_submitted")
    return job


def _trigger_plan_with_broker(trigger: str) -> None:
    """Ask for a planner pass after commit when a worker fleet serves the queue. Eager (embedded
    and unit-test) runs leave it to the in-process loop's next tick instead of planning inline
    inside a user's request."""
    if not settings.CELERY_TASK_ALWAYS_EAGER:
        _trigger_plan(trigger)


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
        _dispatch_on_commit(set(Node.objects.filter(name__in=nodes).values_list("id", flat=True)))
    _trigger_plan_with_broker("job_cancelled")
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
    # A set, not .distinct(): Allocation's default ordering would make each GPU a distinct row.
    held = set(Allocation.objects.filter(node=node).values_list("job__name", flat=True))
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


# -- the control loop: planner passes, commands, agents, heartbeats (docs/control-loop.md) ----
#
# The planner decides from a snapshot; ``run_planner_pass`` writes the whole plan (allocations,
# Command rows, audit rows, the PlannerRun) in ONE transaction and only then, on commit, asks
# Celery to dispatch. GPUs leave a job only when its agent confirmed the checkpoint (``done``)
# or its deadline passed (recorded as a kill with the steps lost).

control_logger = logging.getLogger("jobs.control")

PLANNER_ACTOR = "planner"
# The key of the PostgreSQL advisory lock that allows one planner pass at a time cluster-wide.
PLANNER_LOCK_KEY = 0x4F4D4E50  # "OMNP"
OPEN_COMMAND_STATES = (CommandState.PENDING, CommandState.SENT, CommandState.ACKED)
START_ACTIONS = frozenset({"place", "lend", "recover"})
RESIZE_ACTIONS = frozenset({"shrink", "grow", "migrate", "reclaim"})


class UnknownCommand(Exception):
    """An agent named a command id that does not exist or belongs to another node."""


class Deferred(Exception):
    """A planned action whose preconditions no longer hold; the next pass re-plans it."""


def _agent_actor(node: Node) -> str:
    return f"agent:{node.name}"


def _trigger_plan(trigger: str) -> None:
    from jobs.tasks import plan_tick

    plan_tick.delay_on_commit(trigger)


def _dispatch_on_commit(node_ids: set[int]) -> None:
    """Send the nodes' new commands once the transaction commits.

    The send runs right in the committing process, not through a Celery hop: the outbox rows
    are already durable, so a send lost here is re-sent by ``sweep_commands`` after the ack
    timeout (and replayed on reconnect), while the common case saves a broker round trip.
    """
    from jobs.tasks import dispatch_node_commands

    def send(node_id: int) -> None:
        try:
            dispatch_node_commands(node_id)
        except Exception:
            control_logger.warning("dispatch to node %s failed; the sweep will resend", node_id, exc_info=True)

    for node_id in sorted(node_ids):
        transaction.on_commit(lambda node_id=node_id: send(node_id))


def _job_payload(job: Job, gpus: list[tuple[str, int]], node_name: str, leader: str) -> dict[str, Any]:
    """What an agent needs to run (its share of) a job: layout, batch, steps, GPUs on this node."""
    return {
        "job": job.name,
        "leader": node_name == leader,
        "leader_node": leader,
        "nodes": sorted({n for n, _ in gpus}),
        "gpus": [i for n, i in gpus if n == node_name],
        "dp": len(gpus) // job.replica_gpus,
        "tp": job.tp,
        "pp": job.pp,
        "accum": job.global_batch // (job.micro_batch * max(1, len(gpus) // job.replica_gpus)),
        "global_batch": job.global_batch,
        "micro_batch": job.micro_batch,
        "total_steps": job.total_steps,
        "checkpoint_every": job.checkpoint_every_steps,
        "step_s": job.step_s,
        "resume_step": job.last_checkpoint_step,
    }


def _nodes_in_order(gpus: list[tuple[str, int]]) -> list[str]:
    seen: list[str] = []
    for name, _ in gpus:
        if name not in seen:
            seen.append(name)
    return seen


def _issue_commands(
    job: Job,
    kind: str,
    gpus: list[tuple[str, int]],
    nodes: dict[str, Node],
    *,
    leader: str,
    targets: list[str] | None = None,
    deadline_at: datetime | None = None,
    extra: dict[str, Any] | None = None,
) -> Command:
    """One command per target node (leader first); returns the leader's, which the audit names."""
    targets = targets or _nodes_in_order(gpus)
    targets = [leader, *[t for t in targets if t != leader]]
    leader_command: Command | None = None
    for name in targets:
        payload = _job_payload(job, gpus, name, leader)
        payload.update(extra or {})
        command = Command.objects.create(
            node=nodes[name], job=job, kind=kind, payload=payload, deadline_at=deadline_at
        )
        if name == leader:
            leader_command = command
    assert leader_command is not None
    return leader_command


def _allocations_of(job: Job) -> list[tuple[str, int]]:
    return [
        (a.node.name, a.gpu_index)
        for a in Allocation.objects.filter(job=job).select_related("node").order_by("node__name", "gpu_index")
    ]


def _lose_unsaved_steps(job: Job) -> int:
    """Roll progress back to the last completed checkpoint; return how many steps were lost."""
    lost = max(0, job.committed_steps - job.last_checkpoint_step)
    job.committed_steps = job.last_checkpoint_step
    return lost


@dataclass
class PassResult:
    """What one planner pass did: its run, how many actions it applied and which it deferred."""

    run: PlannerRun | None
    applied: int = 0
    deferred: list[str] = dc_field(default_factory=list)
    commands: int = 0


def _borrowed_from_for(action, nodes_by_name: dict[str, Node], pools: dict[str, tuple[str, ...]]):
    """Map each GPU of a ``lend`` to the reservation it is borrowed from (by the pool's nodes)."""
    names = list(action.borrowed_from)
    if not names:
        return {}
    reservations = {r.name: r for r in Reservation.objects.filter(name__in=names)}
    mapping: dict[tuple[str, int], Reservation] = {}
    for gpu in action.gpus_after:
        for name in names:
            pool = pools.get(name, ())
            if (not pool or gpu.node in pool) and name in reservations:
                mapping[(gpu.node, gpu.index)] = reservations[name]
                break
    return mapping


def _apply_action(action, *, run: PlannerRun, now: datetime, nodes: dict[str, Node],
                  pools: dict[str, tuple[str, ...]], touched: set[int]) -> int:
    """Apply one planner action inside the pass's transaction; return commands written."""
    job = Job.objects.select_for_update().get(name=action.job)
    reason = action.reason.to_dict()
    if action.kind == "hold":
        text = action.reason.text
        if job.pending_reason != text:
            job.pending_reason = text
            job.save(update_fields=["pending_reason"])
            record_event(EventKind.HOLD, job=job, actor=PLANNER_ACTOR, planner_run=run.id, reason=reason,
                         dp_before=job.dp, global_batch=job.global_batch)
        return 0
    if job.is_terminal:
        raise Deferred(f"{job.name} is {job.state}")
    before = _allocations_of(job)
    after = [(g.node, g.index) for g in action.gpus_after]
    new_gpus = [g for g in after if g not in before]
    for name, _ in new_gpus:
        if name not in nodes or not nodes[name].is_schedulable:
            raise Deferred(f"{name} is not schedulable")
    if new_gpus:
        held = Allocation.objects.filter(node__name__in={n for n, _ in new_gpus}).exclude(job=job)
        busy = {(a.node.name, a.gpu_index): a.job.name for a in held.select_related("node", "job")}
        clash = [f"{n}:{i} (held by {busy[(n, i)]})" for n, i in new_gpus if (n, i) in busy]
        if clash:
            # The holder has not confirmed its checkpoint yet: never hand its GPUs over early.
            raise Deferred(f"{job.name}: GPUs not yet released: {', '.join(clash)}")
    kind = action.kind
    if kind == "reclaim":
        kind = "preempt" if not after else "shrink"
    deadline_at = None
    if action.deadline_s is not None:
        deadline_at = datetime.fromtimestamp(action.deadline_s, tz=now.tzinfo)
    dp_before, accum_before = job.dp, job.accum_steps
    commands = 0
    decision_kind = {"place": EventKind.PLACE, "lend": EventKind.LEND, "recover": EventKind.RECOVER,
                     "preempt": EventKind.PREEMPT, "shrink": EventKind.SHRINK, "grow": EventKind.GROW,
                     "migrate": EventKind.MIGRATE}[kind]
    if action.kind == "reclaim":
        decision_kind = EventKind.RECLAIM
    leader_command: Command | None = None

    if kind in START_ACTIONS:
        if job.state not in (JobState.PENDING, JobState.PREEMPTED, JobState.RECOVERING):
            raise Deferred(f"{job.name} is {job.state}; cannot {kind}")
        if not after:
            raise Deferred(f"{kind} of {job.name} names no GPUs")
        Allocation.objects.filter(job=job).exclude(
            pk__in=[a.pk for a in Allocation.objects.filter(job=job).select_related("node")
                    if (a.node.name, a.gpu_index) in after]
        ).delete()
        job.set_dp(len(after) // job.replica_gpus)
        job.transition_to(JobState.RUNNING)
        job.pending_reason = ""
        job.save(update_fields=["dp", "accum_steps", "state", "state_changed_at", "started_at",
                                "first_started_at", "pending_reason"])
        borrowed = _borrowed_from_for(action, nodes, pools)
        Allocation.objects.bulk_create(
            Allocation(job=job, node=nodes[n], gpu_index=i, borrowed_from=borrowed.get((n, i)),
                       loan_until=deadline_at if (n, i) in borrowed else None, since=now)
            for n, i in new_gpus
        )
        first = job.committed_steps == 0 and job.last_checkpoint_step == 0 and job.preemptions == 0
        command_kind = CommandKind.START if first and kind != "recover" else CommandKind.RESUME
        leader = after[0][0]
        leader_command = _issue_commands(job, command_kind, after, nodes, leader=leader)
        commands = len(_nodes_in_order(after))
    elif kind == "preempt":
        if job.state != JobState.RUNNING:
            raise Deferred(f"{job.name} is {job.state}; cannot preempt")
        if not before:
            raise Deferred(f"{job.name} holds no GPUs")
        leader = before[0][0]
        if action.graceful:
            job.transition_to(JobState.CHECKPOINTING)
            job.save(update_fields=["state", "state_changed_at"])
            if deadline_at is None:
                deadline_at = now + timedelta(
                    seconds=(job.measured_save_s or job.checkpoint_save_s) * 2 + settings.OMNI_COMMAND_ACK_TIMEOUT_S
                )
            leader_command = _issue_commands(job, CommandKind.PREEMPT, before, nodes, leader=leader,
                                             deadline_at=deadline_at)
        else:
            lost = _kill_and_release(job, now)
            reason = {**reason, "inputs": {**reason.get("inputs", {}), "steps_lost": lost}}
            decision_kind = EventKind.KILL
            leader_command = _issue_commands(job, CommandKind.STOP, before, nodes, leader=leader,
                                             extra={"kill": True})
        commands = len(_nodes_in_order(before))
    else:  # shrink / grow / migrate: checkpoint, then continue on the new layout
        if job.state != JobState.RUNNING:
            raise Deferred(f"{job.name} is {job.state}; cannot {kind}")
        if not before or not after:
            raise Deferred(f"{kind} of {job.name} needs GPUs before and after")
        job.transition_to(JobState.RESIZING)
        job.last_resized_at = now
        job.save(update_fields=["state", "state_changed_at", "last_resized_at"])
        Allocation.objects.bulk_create(Allocation(job=job, node=nodes[n], gpu_index=i, since=now) for n, i in new_gpus)
        leader_before, leader_after = before[0][0], after[0][0]
        release = [[n, i] for n, i in before if (n, i) not in after]
        targets = _nodes_in_order(before) + [n for n in _nodes_in_order(after) if n not in _nodes_in_order(before)]
        leader_command = _issue_commands(
            job, CommandKind.RESIZE, after, nodes, leader=leader_before, targets=targets, deadline_at=deadline_at,
            extra={"relaunch": leader_before == leader_after, "release": release,
                   "dp_after": len(after) // job.replica_gpus, "layout": [[n, i] for n, i in after]},
        )
        commands = len(targets)
    touched.update(nodes[n].id for n in {n for n, _ in before} | {n for n, _ in after} if n in nodes)
    record_event(
        decision_kind,
        job=job,
        actor=PLANNER_ACTOR,
        planner_run=run.id,
        command=leader_command.id if leader_command else None,
        nodes_before=[n for n, _ in before],
        nodes_after=[n for n, _ in after],
        gpus_before=len(before),
        gpus_after=len(after),
        dp_before=dp_before,
        dp_after=action.dp_after if action.dp_after else (len(after) // job.replica_gpus if after else 0),
        accum_before=accum_before,
        accum_after=action.accum_after,
        global_batch=job.global_batch,
        reason={**reason, "inputs": {**reason.get("inputs", {}), "deadline_s": action.deadline_s,
                                     "graceful": action.graceful}},
    )
    return commands


def _kill_and_release(job: Job, now: datetime) -> int:
    """Take a job's GPUs without a checkpoint: progress falls back to the last save."""
    lost = _lose_unsaved_steps(job)
    if job.state == JobState.RUNNING:
        job.transition_to(JobState.CHECKPOINTING)
    job.transition_to(JobState.PREEMPTED)
    job.preemptions += 1
    job.save(update_fields=["state", "state_changed_at", "committed_steps", "preemptions"])
    Allocation.objects.filter(job=job).delete()
    return lost


def _planner_lock() -> bool:
    """Take the cluster-wide planner lock for this transaction (SQLite: the single loop)."""
    if connection.vendor != "postgresql":
        return True
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [PLANNER_LOCK_KEY])
        return bool(cursor.fetchone()[0])


@transaction.atomic
def run_planner_pass(trigger: str = "beat", now: datetime | None = None) -> PassResult:
    """Snapshot -> pure planner -> one transaction of allocations, commands, audit and the run.

    Returns ``PassResult(run=None)`` when another pass holds the lock. Dispatch of the written
    commands is queued with ``delay_on_commit``: nothing leaves the database before it commits,
    and a worker killed mid-pass rolls the whole plan back.
    """
    from jobs.planner import plan as make_plan
    from jobs.snapshot import load_snapshot, planner_config

    if not _planner_lock():
        return PassResult(run=None)
    started = _time.perf_counter()
    now = now or timezone.now()
    control = PlannerControl.load()
    snapshot = load_snapshot(now)
    result = make_plan(snapshot, now.timestamp(), planner_config(control))
    run = PlannerRun(started_at=now, trigger=trigger[:64], dry_run=control.dry_run)
    run.save()
    outcome = PassResult(run=run)
    touched: set[int] = set()
    if not control.dry_run and not result.paused:
        nodes = {n.name: n for n in Node.objects.all()}
        pools = {r.name: r.nodes for r in snapshot.reservations}
        for action in result.actions:
            try:
                with transaction.atomic():
                    outcome.commands += _apply_action(action, run=run, now=now, nodes=nodes, pools=pools,
                                                      touched=touched)
                if action.kind != "hold":
                    outcome.applied += 1
            except (Deferred, IllegalTransition, BatchInvariantError, ValidationError, IntegrityError) as exc:
                outcome.deferred.append(f"{action.kind} {action.job}: {exc}")
    run.finished_at = timezone.now()
    run.duration_ms = (_time.perf_counter() - started) * 1000.0
    run.actions = len([a for a in result.actions if a.kind != "hold"])
    run.applied = not control.dry_run and not result.paused
    run.summary = {
        "applied": outcome.applied,
        "deferred": outcome.deferred[:50],
        "commands": outcome.commands,
        "wake_at_s": result.wake_at_s,
        "paused": result.paused,
        "actions": [a.to_audit() for a in result.actions][:100] if control.dry_run else [],
    }
    run.save(update_fields=["finished_at", "duration_ms", "actions", "applied", "summary"])
    if settings.OMNI_PLANNER_PASS_HOLD_S and outcome.applied:
        _time.sleep(settings.OMNI_PLANNER_PASS_HOLD_S)  # fault injection (tests only)
    _dispatch_on_commit(touched)
    return outcome


# -- commands: delivery, acknowledgement, outcome --------------------------------------------


@transaction.atomic
def claim_commands_for_dispatch(node_id: int, *, include_sent: bool = False) -> list[Command]:
    """Move a node's pending commands to ``sent`` (one attempt each) and return what to send.

    ``include_sent`` also returns commands already sent but not acknowledged: a (re)connecting
    agent gets every unacknowledged command again (at-least-once; the agent dedups by id).
    """
    out: list[Command] = []
    states = [CommandState.PENDING, CommandState.SENT] if include_sent else [CommandState.PENDING]
    for command in (
        Command.objects.select_for_update(of=("self",)).filter(node_id=node_id, state__in=states)
        .select_related("job").order_by("created_at")
    ):
        if command.state == CommandState.PENDING:
            command.transition_to(CommandState.SENT)
            command.save(update_fields=["state", "sent_at", "attempts"])
        out.append(command)
    return out


def command_frame(command: Command) -> dict[str, Any]:
    """The ``command`` frame for an agent (docs/control-loop.md)."""
    return {
        "type": "command",
        "id": str(command.id),
        "kind": command.kind,
        "job": command.job.name if command.job_id else None,
        "payload": command.payload,
        "deadline": command.deadline_at.timestamp() if command.deadline_at else None,
        "attempt": command.attempts,
    }


def _decision_of(command: Command) -> ElasticEvent | None:
    return ElasticEvent.objects.filter(command=command.id).order_by("id").first()


def _own_command(node: Node, command_id: str) -> Command:
    import uuid

    try:
        key = uuid.UUID(str(command_id))
    except ValueError:
        raise UnknownCommand(f"{command_id!r} is not a command id") from None
    try:
        return Command.objects.select_for_update(of=("self",)).select_related("job").get(pk=key, node=node)
    except Command.DoesNotExist:
        raise UnknownCommand(f"no command {command_id} for node {node.name}") from None


@transaction.atomic
def record_command_ack(node: Node, command_id: str) -> Command:
    """The agent received the command. Idempotent: a repeated or late ack changes nothing."""
    command = _own_command(node, command_id)
    if command.state == CommandState.PENDING:
        command.transition_to(CommandState.SENT)
    if command.state == CommandState.SENT:
        command.transition_to(CommandState.ACKED)
        command.save(update_fields=["state", "sent_at", "attempts", "acked_at"])
        decision = _decision_of(command)
        if decision is not None and command.payload.get("leader", True):
            record_event(
                EventKind.ACK, job=command.job, actor=_agent_actor(node), command=command.id, refers_to=decision,
                outcome={"kind": command.kind, "attempts": command.attempts,
                         "ack_ms": round((command.acked_at - command.created_at).total_seconds() * 1000.0, 1)},
                reason={"rule": "ack", "text": f"{node.name} acknowledged {command.kind} of "
                        f"{command.job.name if command.job_id else '-'}.", "inputs": {}},
            )
    return command


@transaction.atomic
def record_command_outcome(node: Node, command_id: str, *, ok: bool, outcome: dict[str, Any]) -> Command:
    """The agent finished a command. Applies its effect once; a duplicate ``done`` is ignored."""
    command = _own_command(node, command_id)
    if command.is_terminal:
        return command
    if command.state == CommandState.PENDING:
        command.transition_to(CommandState.SENT)
    if command.state == CommandState.SENT:
        command.transition_to(CommandState.ACKED)
    clean = {k: outcome.get(k) for k in ("checkpoint_step", "save_s", "load_s", "step", "error", "outcome", "pid")
             if k in outcome}
    command.outcome = clean
    command.error = str(outcome.get("error") or "")[:2000]
    command.transition_to(CommandState.DONE if ok else CommandState.FAILED)
    command.save(update_fields=["state", "sent_at", "attempts", "acked_at", "finished_at", "outcome", "error"])
    if command.job_id is None or not command.payload.get("leader", True):
        return command
    job = Job.objects.select_for_update().get(pk=command.job_id)
    decision = _decision_of(command)
    _apply_outcome(node, command, job, ok, clean, decision)
    _trigger_plan("command_done")
    return command


def _note_checkpoint(job: Job, outcome: dict[str, Any]) -> list[str]:
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
    return fields


def _apply_outcome(node: Node, command: Command, job: Job, ok: bool, outcome: dict[str, Any],
                   decision: ElasticEvent | None) -> None:
    actor = _agent_actor(node)
    text = f"{command.kind} of {job.name} on {node.name}: " + ("done" if ok else f"failed ({command.error})")
    extra: dict[str, Any] = {"kind": command.kind, "ok": ok, **outcome}
    gpus_before = job.allocations.count()
    if command.kind == CommandKind.PREEMPT and job.state == JobState.CHECKPOINTING:
        if ok:
            fields = _note_checkpoint(job, outcome)
            job.transition_to(JobState.PREEMPTED)
            job.preemptions += 1
            job.save(update_fields=[*fields, "state", "state_changed_at", "preemptions"])
            nodes = _release_allocations(job)
            extra["steps_lost"] = 0
            text += f"; checkpoint at step {job.last_checkpoint_step} saved, GPUs released"
            record_event(EventKind.OUTCOME, job=job, actor=actor, command=command.id, refers_to=decision,
                         nodes_before=nodes, gpus_before=gpus_before, gpus_after=0, outcome=extra,
                         reason={"rule": "outcome", "text": text, "inputs": {}})
        else:
            nodes = _job_nodes(job)
            lost = _kill_and_release(job, timezone.now())
            extra["steps_lost"] = lost
            record_event(EventKind.KILL, job=job, actor=actor, command=command.id, refers_to=decision,
                         nodes_before=nodes, gpus_before=gpus_before, gpus_after=0, outcome=extra,
                         reason={"rule": "checkpoint_failed", "text": text + f"; {lost} steps lost", "inputs": {}})
        return
    if command.kind == CommandKind.RESIZE and job.state == JobState.RESIZING:
        if ok:
            fields = _note_checkpoint(job, outcome)
            release = {(n, i) for n, i in command.payload.get("release", [])}
            for alloc in list(job.allocations.select_related("node")):
                if (alloc.node.name, alloc.gpu_index) in release:
                    alloc.delete()
            job.set_dp(int(command.payload["dp_after"]))
            fields += ["dp", "accum_steps"]
            if command.payload.get("relaunch"):
                job.transition_to(JobState.RUNNING)
                fields += ["state", "state_changed_at", "started_at", "first_started_at"]
            job.save(update_fields=fields)
            if not command.payload.get("relaunch"):
                layout = [(n, i) for n, i in command.payload.get("layout", [])]
                nodes = {n.name: n for n in Node.objects.filter(name__in={n for n, _ in layout})}
                resume = _issue_commands(job, CommandKind.RESUME, layout, nodes, leader=layout[0][0])
                _dispatch_on_commit({n.id for n in nodes.values()})
                extra["resume_command"] = str(resume.id)
            record_event(EventKind.OUTCOME, job=job, actor=actor, command=command.id, refers_to=decision,
                         gpus_before=gpus_before, gpus_after=job.allocations.count(), dp_after=job.dp,
                         accum_after=job.accum_steps, global_batch=job.global_batch, outcome=extra,
                         reason={"rule": "outcome", "text": text, "inputs": {}})
        else:
            _to_recovering(job, actor, text, command=command, refers_to=decision)
        return
    if command.kind in (CommandKind.START, CommandKind.RESUME):
        if not ok and job.state in (JobState.RUNNING, JobState.RESIZING):
            _to_recovering(job, actor, text, command=command, refers_to=decision)
            return
        if ok:
            fields = []
            load_s = outcome.get("load_s")
            if isinstance(load_s, (int, float)) and load_s >= 0:
                job.measured_load_s = float(load_s)
                fields.append("measured_load_s")
            resumed = outcome.get("checkpoint_step")
            if isinstance(resumed, int) and job.last_checkpoint_step < resumed <= job.total_steps:
                # A checkpoint newer than the last one a heartbeat reported (saved just before a
                # fault): the run continues from there, so progress does too.
                job.last_checkpoint_step = resumed
                job.committed_steps = max(job.committed_steps, resumed)
                fields += ["last_checkpoint_step", "committed_steps"]
            if job.state == JobState.RESIZING:
                job.transition_to(JobState.RUNNING)
                fields += ["state", "state_changed_at", "started_at", "first_started_at"]
            if fields:
                job.save(update_fields=fields)
        record_event(EventKind.OUTCOME, job=job, actor=actor, command=command.id, refers_to=decision,
                     outcome=extra, reason={"rule": "outcome", "text": text, "inputs": {}})


def _to_recovering(job: Job, actor: str, text: str, *, command: Command | None = None,
                   refers_to: ElasticEvent | None = None, kind: str = EventKind.FAIL) -> int:
    """A fault hit the job: back to its last checkpoint, GPUs released, the planner recovers it."""
    gpus_before = job.allocations.count()
    lost = _lose_unsaved_steps(job)
    job.transition_to(JobState.RECOVERING)
    job.save(update_fields=["state", "state_changed_at", "committed_steps"])
    nodes = _job_nodes(job)
    survivors = Node.objects.filter(name__in=nodes).exclude(state=NodeState.FAILED)
    Allocation.objects.filter(job=job).delete()
    for other in survivors:
        # Fence the workers that survived: they must stop before anyone else resumes the run.
        Command.objects.create(node=other, job=job, kind=CommandKind.STOP,
                               payload={"job": job.name, "leader": False, "kill": True})
    _dispatch_on_commit({n.id for n in survivors})
    record_event(kind, job=job, actor=actor, command=command.id if command else None, refers_to=refers_to,
                 nodes_before=nodes, gpus_before=gpus_before, gpus_after=0, dp_before=job.dp,
                 global_batch=job.global_batch,
                 outcome={"steps_lost": lost, "resume_from_step": job.last_checkpoint_step},
                 reason={"rule": "fault", "text": f"{text}; {job.name} recovers from step "
                         f"{job.last_checkpoint_step} ({lost} steps lost).", "inputs": {}})
    return lost


@transaction.atomic
def expire_overdue_commands(now: datetime | None = None) -> dict[str, int]:
    """Retry sent commands not acknowledged in time; expire them after the last attempt; treat a
    preempt past its deadline as a kill. The planner is told about every expiry."""
    now = now or timezone.now()
    counts = {"retried": 0, "expired": 0, "killed": 0}
    timeout = timedelta(seconds=settings.OMNI_COMMAND_ACK_TIMEOUT_S)
    retry_nodes: set[int] = set()
    overdue = Command.objects.select_for_update(of=("self",)).filter(state=CommandState.SENT, sent_at__lt=now - timeout)
    for command in overdue.select_related("node", "job"):
        if command.attempts < settings.OMNI_COMMAND_MAX_ATTEMPTS:
            command.transition_to(CommandState.PENDING)
            command.save(update_fields=["state"])
            retry_nodes.add(command.node_id)
            counts["retried"] += 1
        else:
            _expire(command, f"not acknowledged after {command.attempts} attempts")
            counts["expired"] += 1
    late = Command.objects.select_for_update(of=("self",)).filter(
        kind=CommandKind.PREEMPT, state__in=OPEN_COMMAND_STATES, deadline_at__lt=now
    )
    for command in late.select_related("node", "job"):
        _expire(command, "checkpoint not confirmed by the deadline")
        counts["killed"] += 1
    _dispatch_on_commit(retry_nodes)
    if counts["expired"] or counts["killed"]:
        _trigger_plan("command_expired")
    return counts


def _expire(command: Command, why: str) -> None:
    command.error = why
    command.transition_to(CommandState.EXPIRED)
    command.save(update_fields=["state", "finished_at", "error"])
    control_logger.warning("command %s (%s on %s) expired: %s", command.id, command.kind, command.node.name, why)
    if command.job_id is None or not command.payload.get("leader", True):
        return
    job = Job.objects.select_for_update().get(pk=command.job_id)
    decision = _decision_of(command)
    actor = "system"
    if command.kind == CommandKind.PREEMPT and job.state == JobState.CHECKPOINTING:
        nodes = _job_nodes(job)
        gpus_before = job.allocations.count()
        lost = _kill_and_release(job, timezone.now())
        for node in Node.objects.filter(name__in=nodes):
            Command.objects.create(node=node, job=job, kind=CommandKind.STOP,
                                   payload={"job": job.name, "leader": False, "kill": True})
        _dispatch_on_commit(set(Node.objects.filter(name__in=nodes).values_list("id", flat=True)))
        record_event(EventKind.KILL, job=job, actor=actor, command=command.id, refers_to=decision,
                     nodes_before=nodes, gpus_before=gpus_before, gpus_after=0,
                     outcome={"steps_lost": lost, "resume_from_step": job.last_checkpoint_step},
                     reason={"rule": "deadline", "text": f"{job.name}: {why}; killed, GPUs released, "
                             f"{lost} steps lost (resumes from step {job.last_checkpoint_step}).", "inputs": {}})
    elif command.kind in (CommandKind.START, CommandKind.RESUME, CommandKind.RESIZE) and job.state in (
        JobState.RUNNING, JobState.RESIZING
    ):
        _to_recovering(job, actor, f"{command.kind} of {job.name} on {command.node.name} expired: {why}",
                       command=command, refers_to=decision)


# -- agents: hello, heartbeats, step records, worker exits, node health -----------------------


@transaction.atomic
def record_agent_hello(node: Node, workers: list[dict[str, Any]]) -> list[Command]:
    """An agent (re)connected: note it alive and fence its stray workers."""
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now())
    return fence_stray_workers(node, workers)


@transaction.atomic
def fence_stray_workers(node: Node, workers: list[dict[str, Any]]) -> list[Command]:
    """Stop any worker the agent runs for a job no longer placed on its node (a node back from a
    failure, or cut off for a while, must not keep training a job that moved on)."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    placed = set(Allocation.objects.filter(node=node).values_list("job__name", flat=True))
    fenced: list[Command] = []
    open_stops = set(
        Command.objects.filter(node=node, kind=CommandKind.STOP, state__in=OPEN_COMMAND_STATES)
        .values_list("job__name", flat=True)
    )
    for worker in workers:
        name = worker.get("job")
        if not isinstance(name, str) or name in placed or name in open_stops:
            continue
        job = Job.objects.filter(name=name).first()
        if job is None:
            continue
        fenced.append(Command.objects.create(node=node, job=job, kind=CommandKind.STOP,
                                             payload={"job": name, "leader": False, "kill": True}))
        control_logger.warning("fencing %s on %s: the job is not placed there", name, node.name)
    if fenced:
        _dispatch_on_commit({node.id})
    return fenced


def record_heartbeat(node: Node, workers: list[dict[str, Any]]) -> None:
    """A heartbeat: the node is alive (a suspect node is healthy again; a failed one stays
    failed until repaired), and each worker's newest complete checkpoint is noted."""
    now = timezone.now()
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now)
    # The caller's Node may be stale (a consumer holds it for the whole connection): ask the row.
    if Node.objects.filter(pk=node.pk, state=NodeState.SUSPECT).exists():
        with transaction.atomic():
            fresh = Node.objects.select_for_update().get(pk=node.pk)
            if fresh.state == NodeState.SUSPECT:
                fresh.transition_to(NodeState.HEALTHY)
                fresh.save(update_fields=["state", "state_changed_at"])
                record_event(EventKind.NODE_REPAIRED, actor=_agent_actor(node), nodes_after=[node.name],
                             reason={"rule": "heartbeat", "text": f"{node.name} answered heartbeats again; "
                                     "healthy.", "inputs": {"node": node.name, "from": "suspect"}})
    placed = set(Allocation.objects.filter(node=node).values_list("job_id", flat=True))
    placed_names = set(Job.objects.filter(id__in=placed).values_list("name", flat=True))
    strays = [w for w in workers if w.get("state") not in ("member", "exited") and w.get("job") not in placed_names]
    if strays:
        fence_stray_workers(node, strays)
    for worker in workers:
        step = worker.get("checkpoint_step")
        name = worker.get("job")
        if not isinstance(step, int) or not isinstance(name, str) or step < 0:
            continue
        Job.objects.filter(
            name=name, id__in=placed, last_checkpoint_step__lt=step, total_steps__gte=step,
            state__in=[JobState.RUNNING, JobState.CHECKPOINTING, JobState.RESIZING],
        ).update(last_checkpoint_step=step, last_checkpoint_at=now)


def record_step_records(node: Node, job_name: str, records: list[dict[str, Any]]) -> tuple[int, int | None]:
    """Progress from a worker's step records: the job's committed step moves forward (never back
    past a fault's rollback, which resets it). Returns (newest step, job id), (-1, None) when
    the job is not running on this node."""
    steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    if not steps:
        return -1, None
    newest = max(steps)
    job = Job.objects.filter(name=job_name, allocations__node=node).distinct().first()
    if job is None or job.state not in (JobState.RUNNING, JobState.CHECKPOINTING, JobState.RESIZING):
        return -1, None
    newest = min(newest, job.total_steps)
    Job.objects.filter(pk=job.pk, committed_steps__lt=newest).update(committed_steps=newest)
    return newest, job.pk


@transaction.atomic
def record_worker_exit(node: Node, job_name: str, outcome: dict[str, Any]) -> Job | None:
    """A job's workers exited on their own: completed (GPUs freed) or crashed (the job recovers)."""
    job = Job.objects.select_for_update().filter(name=job_name).first()
    if job is None or job.state not in (JobState.RUNNING,) or not job.allocations.filter(node=node).exists():
        return None
    result = outcome.get("outcome")
    actor = _agent_actor(node)
    if result == "completed":
        step = outcome.get("step")
        fields = _note_checkpoint(job, {"checkpoint_step": step}) if isinstance(step, int) else []
        gpus_before = job.allocations.count()
        job.committed_steps = job.total_steps if not isinstance(step, int) else min(step, job.total_steps)
        job.transition_to(JobState.COMPLETED)
        job.save(update_fields=sorted({*fields, "committed_steps", "state", "state_changed_at", "finished_at"}))
        nodes = _release_allocations(job)
        record_event(EventKind.COMPLETE, job=job, actor=actor, nodes_before=nodes, gpus_before=gpus_before,
                     gpus_after=0, dp_before=job.dp, global_batch=job.global_batch,
                     outcome={"step": job.committed_steps},
                     reason={"rule": "complete", "text": f"{job.name} finished at step {job.committed_steps}.",
                             "inputs": {}})
    elif result in ("failed", "crashed"):
        _to_recovering(job, actor, f"{job.name}'s workers on {node.name} exited: {outcome.get('error') or result}")
    else:
        return None
    _trigger_plan("worker_exit")
    return job


@transaction.atomic
def mark_node_suspect(node: Node, silence_s: float) -> Node:
    """A node missed a heartbeat: suspect (nothing moves yet)."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    node.transition_to(NodeState.SUSPECT)
    node.save(update_fields=["state", "state_changed_at"])
    record_event(EventKind.NODE_SUSPECT, actor="system", nodes_before=[node.name], nodes_after=[node.name],
                 reason={"rule": "heartbeat", "text": f"{node.name} silent for {silence_s:.1f}s; suspect.",
                         "inputs": {"node": node.name, "silence_s": round(silence_s, 2)}})
    return node


@transaction.atomic
def mark_node_failed(node: Node, silence_s: float) -> Node:
    """A node missed too many heartbeats: failed. Its jobs lose their unsaved steps and go to
    ``recovering``; its open commands expire; the planner recovers the jobs elsewhere."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    before = node.state
    node.transition_to(NodeState.FAILED)
    node.save(update_fields=["state", "state_changed_at"])
    misses = silence_s / settings.OMNI_HEARTBEAT_INTERVAL_S
    record_event(EventKind.NODE_FAILED, actor="system", nodes_before=[node.name], nodes_after=[node.name],
                 reason={"rule": "heartbeat", "text": f"{node.name} silent for {silence_s:.1f}s "
                         f"({misses:.1f} heartbeat intervals); failed.",
                         "inputs": {"node": node.name, "from": before, "silence_s": round(silence_s, 2)}})
    for command in Command.objects.select_for_update().filter(node=node, state__in=OPEN_COMMAND_STATES):
        command.error = "node failed"
        command.transition_to(CommandState.EXPIRED)
        command.save(update_fields=["state", "finished_at", "error"])
    job_ids = set(Allocation.objects.filter(node=node).values_list("job_id", flat=True))
    for job in Job.objects.select_for_update().filter(pk__in=job_ids).order_by("pk"):
        if job.state in (JobState.RUNNING, JobState.CHECKPOINTING, JobState.RESIZING):
            _to_recovering(job, "system", f"{node.name} failed under {job.name}", kind=EventKind.NODE_FAILED)
    _trigger_plan("node_failed")
    return node


def heartbeat_verdicts(now: datetime) -> tuple[list[tuple[Node, float]], list[tuple[Node, float]]]:
    """Which nodes to mark suspect and which failed, by the silence since their last heartbeat.

    Suspect after 1.5 intervals (one heartbeat missed); failed once ``OMNI_HEARTBEAT_MISSES``
    intervals have passed, less the monitor's own tick, so detection lands within that many
    intervals of the last sign of life. Nodes that never sent a heartbeat are not judged.
    """
    interval = settings.OMNI_HEARTBEAT_INTERVAL_S
    fail_after = max(interval, interval * settings.OMNI_HEARTBEAT_MISSES - monitor_tick_s())
    suspect: list[tuple[Node, float]] = []
    failed: list[tuple[Node, float]] = []
    watched = Node.objects.filter(
        last_heartbeat_at__isnull=False,
        state__in=[NodeState.HEALTHY, NodeState.SUSPECT, NodeState.DRAINING, NodeState.CORDONED],
    )
    for node in watched:
        silence_s = (now - node.last_heartbeat_at).total_seconds()
        if silence_s >= fail_after:
            failed.append((node, silence_s))
        elif silence_s >= 1.5 * interval and node.state == NodeState.HEALTHY:
            suspect.append((node, silence_s))
    return suspect, failed


def monitor_tick_s() -> float:
    """How often monitor_heartbeats runs: a quarter heartbeat interval, at most a second."""
    return min(1.0, settings.OMNI_HEARTBEAT_INTERVAL_S / 4.0)


def active_job_names() -> set[str]:
    """Names of jobs not yet in a terminal state (for agents' reconciliation)."""
    return set(Job.objects.exclude(state__in=TERMINAL_JOB_STATES).values_list("name", flat=True))

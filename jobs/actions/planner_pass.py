"""The planner pass (docs/control-loop.md): snapshot -> pure planner -> one transaction that
applies the plan (allocations, the command outbox, audit rows, the PlannerRun); and the
operator's controls that the pass reads.

GPUs leave a job only when its agent confirmed the checkpoint or its deadline passed
(jobs.actions.commands); an action whose GPUs are still held by another job is deferred and
re-planned by the next pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dc_field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from jobs.actions._common import (
    PLANNER_ACTOR,
    actor_name,
    describe_changes,
    kept_layout,
    kill_and_release,
    lost_facts,
)
from jobs.actions.commands import dispatch_on_commit, nodes_in_order, write_commands
from jobs.audit import record_event
from jobs.models import Allocation, Command, Job, JobState, Node, PlannerControl, PlannerRun, Reservation
from jobs.models.states import BatchInvariantError, IllegalTransition
from jobs.planner import Action
from jobs.planner import plan as make_plan
from jobs.roles import require_operator
from jobs.snapshot import load_snapshot, planner_config
from jobs.vocab import DECISION_EVENTS, ActionKind, CommandKind, EventKind

# The key of the PostgreSQL advisory lock that allows one planner pass at a time cluster-wide.
PLANNER_LOCK_KEY = 0x4F4D4E50  # "OMNP"
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
    control = PlannerControl.objects.select_for_update(no_key=True).get(pk=1)
    before = {knob: getattr(control, knob) for knob in changes}
    for knob, value in changes.items():
        setattr(control, knob, value)
    control.updated_at = timezone.now()
    control.updated_by = actor
    control.save(update_fields=[*changes, "updated_at", "updated_by"])
    described = describe_changes(before, changes)
    record_event(
        EventKind.OVERRIDE,
        actor=actor_name(actor),
        actor_user=actor,
        reason={
            "rule": "planner_control",
            "text": f"{actor_name(actor)} changed the planner: {described}.",
            "inputs": {"before": before, "after": changes},
        },
    )
    return control


# -- the pass --------------------------------------------------------------------------------


class Deferred(Exception):
    """A planned action whose preconditions no longer hold; the next pass re-plans it."""


@dataclass
class PassResult:
    """What one planner pass did: its run, how many actions it applied and which it deferred."""

    run: PlannerRun | None
    applied: int = 0
    deferred: list[str] = dc_field(default_factory=list)
    commands: int = 0


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

    Returns ``PassResult(run=None)`` when another pass holds the lock. The written commands are
    sent only after commit: nothing leaves the database before it commits, and a worker killed
    mid-pass rolls the whole plan back.
    """
    if not _planner_lock():
        return PassResult(run=None)
    started = time.perf_counter()
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
                if action.kind != ActionKind.HOLD:
                    outcome.applied += 1
            except (Deferred, IllegalTransition, BatchInvariantError, ValidationError, IntegrityError) as exc:
                outcome.deferred.append(f"{action.kind} {action.job}: {exc}")
    run.finished_at = timezone.now()
    run.duration_ms = (time.perf_counter() - started) * 1000.0
    run.actions = len([a for a in result.actions if a.kind != ActionKind.HOLD])
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
        time.sleep(settings.OMNI_PLANNER_PASS_HOLD_S)  # fault injection (tests only)
    dispatch_on_commit(touched)
    return outcome


# -- applying one action ---------------------------------------------------------------------


@dataclass
class _Applying:
    """One planner action being applied inside the pass's transaction (in its own savepoint)."""

    action: Action
    job: Job
    run: PlannerRun
    now: datetime
    nodes: dict[str, Node]  # every node, by name
    pools: dict[str, tuple[str, ...]]  # each reservation's node pool, by reservation name
    touched: set[int]  # ids of the nodes whose agents get commands after commit


@dataclass
class _Move:
    """The GPUs an action moves a job from and to, checked against the database."""

    before: list[tuple[str, int]]
    after: list[tuple[str, int]]
    new_gpus: list[tuple[str, int]]  # in ``after`` but not yet the job's
    deadline_at: datetime | None
    dp_before: int
    accum_before: int
    reason: dict[str, Any]


def _apply_action(action: Action, *, run: PlannerRun, now: datetime, nodes: dict[str, Node],
                  pools: dict[str, tuple[str, ...]], touched: set[int]) -> int:
    """Apply one planner action inside the pass's transaction; return commands written."""
    job = Job.objects.select_for_update(no_key=True).get(name=action.job)
    applying = _Applying(action=action, job=job, run=run, now=now, nodes=nodes, pools=pools, touched=touched)
    return ACTION_HANDLERS[action.kind](applying)


def _allocations_of(job: Job) -> list[tuple[str, int]]:
    return [
        (a.node.name, a.gpu_index)
        for a in Allocation.objects.filter(job=job).select_related("node").order_by("node__name", "gpu_index")
    ]


def _check_move(a: _Applying) -> _Move:
    """The action's GPUs before and after, or Deferred when the move cannot happen now."""
    job, action, nodes = a.job, a.action, a.nodes
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
        busy = {(al.node.name, al.gpu_index): al.job.name for al in held.select_related("node", "job")}
        clash = [f"{n}:{i} (held by {busy[(n, i)]})" for n, i in new_gpus if (n, i) in busy]
        if clash:
            # The holder has not confirmed its checkpoint yet: never hand its GPUs over early.
            raise Deferred(f"{job.name}: GPUs not yet released: {', '.join(clash)}")
    deadline_at = None
    if action.deadline_s is not None:
        deadline_at = datetime.fromtimestamp(action.deadline_s, tz=a.now.tzinfo)
    return _Move(before=before, after=after, new_gpus=new_gpus, deadline_at=deadline_at, dp_before=job.dp,
                 accum_before=job.accum_steps, reason=action.reason.to_dict())


def _record_decision(a: _Applying, move: _Move, kind: EventKind, leader_command: Command, commands: int) -> int:
    """Note the nodes to send to and write the decision's audit row; return commands written."""
    job, action, nodes = a.job, a.action, a.nodes
    moved = {n for n, _ in move.before} | {n for n, _ in move.after}
    a.touched.update(nodes[n].id for n in moved if n in nodes)
    reason = move.reason
    record_event(
        kind,
        job=job,
        actor=PLANNER_ACTOR,
        planner_run=a.run.id,
        command=leader_command.id,
        nodes_before=[n for n, _ in move.before],
        nodes_after=[n for n, _ in move.after],
        gpus_before=len(move.before),
        gpus_after=len(move.after),
        dp_before=move.dp_before,
        dp_after=action.dp_after if action.dp_after else (len(move.after) // job.replica_gpus if move.after else 0),
        accum_before=move.accum_before,
        accum_after=action.accum_after,
        global_batch=job.global_batch,
        reason={**reason, "inputs": {**reason.get("inputs", {}), "deadline_s": action.deadline_s,
                                     "graceful": action.graceful}},
    )
    return commands


def _borrowed_from_for(a: _Applying) -> dict[tuple[str, int], Reservation]:
    """Map each GPU of a ``lend`` to the reservation it is borrowed from (by the pool's nodes)."""
    names = list(a.action.borrowed_from)
    if not names:
        return {}
    reservations = {r.name: r for r in Reservation.objects.filter(name__in=names)}
    mapping: dict[tuple[str, int], Reservation] = {}
    for gpu in a.action.gpus_after:
        for name in names:
            pool = a.pools.get(name, ())
            if (not pool or gpu.node in pool) and name in reservations:
                mapping[(gpu.node, gpu.index)] = reservations[name]
                break
    return mapping


def _hold(a: _Applying) -> int:
    """The job keeps waiting: keep its sentence current, and audit the hold only when its cause
    changes (a pass every few seconds would otherwise repeat it); ``pending_since`` is when the
    current cause began."""
    job, action = a.job, a.action
    text = action.reason.text
    cause = str(action.reason.inputs.get("cause", ""))[:32]
    if job.pending_cause == cause and job.pending_since is not None:
        if job.pending_reason != text:
            job.pending_reason = text
            job.save(update_fields=["pending_reason"])
        return 0
    job.pending_reason, job.pending_cause, job.pending_since = text, cause, a.now
    job.save(update_fields=["pending_reason", "pending_cause", "pending_since"])
    record_event(EventKind.HOLD, job=job, actor=PLANNER_ACTOR, planner_run=a.run.id,
                 reason=action.reason.to_dict(), **kept_layout(job), global_batch=job.global_batch)
    return 0


def _start(a: _Applying) -> int:
    """place, lend, recover: run a waiting job on its new GPUs, from its last checkpoint unless
    this is its very first start."""
    job, kind, nodes = a.job, a.action.kind, a.nodes
    move = _check_move(a)
    after = move.after
    if job.state not in (JobState.PENDING, JobState.PREEMPTED, JobState.RECOVERING):
        raise Deferred(f"{job.name} is {job.state}; cannot {kind}")
    if not after:
        raise Deferred(f"{kind} of {job.name} names no GPUs")
    Allocation.objects.filter(job=job).exclude(
        pk__in=[al.pk for al in Allocation.objects.filter(job=job).select_related("node")
                if (al.node.name, al.gpu_index) in after]
    ).release(at=a.now)
    job.set_dp(len(after) // job.replica_gpus)
    fields = job.transition_to(JobState.RUNNING)
    job.pending_reason = ""
    job.save(update_fields=[*fields, "dp", "accum_steps", "pending_reason"])
    borrowed = _borrowed_from_for(a)
    Allocation.objects.bulk_create(
        Allocation(job=job, node=nodes[n], gpu_index=i, borrowed_from=borrowed.get((n, i)),
                   loan_until=move.deadline_at if (n, i) in borrowed else None, since=a.now)
        for n, i in move.new_gpus
    )
    first = job.committed_steps == 0 and job.last_checkpoint_step == 0 and job.preemptions == 0
    command_kind = CommandKind.START if first and kind != ActionKind.RECOVER else CommandKind.RESUME
    leader_command = write_commands(job, command_kind, after, nodes, leader=after[0][0])
    return _record_decision(a, move, DECISION_EVENTS[kind], leader_command, len(nodes_in_order(after)))


def _preempt(a: _Applying, *, event: EventKind = EventKind.PREEMPT) -> int:
    """Release every GPU: checkpoint first (graceful; the GPUs stay held until the agent confirms
    the save) or kill at once (audited as a ``kill`` with the steps lost)."""
    job, nodes = a.job, a.nodes
    move = _check_move(a)
    before = move.before
    if job.state != JobState.RUNNING:
        raise Deferred(f"{job.name} is {job.state}; cannot preempt")
    if not before:
        raise Deferred(f"{job.name} holds no GPUs")
    leader = before[0][0]
    if a.action.graceful:
        job.save(update_fields=job.transition_to(JobState.CHECKPOINTING))
        deadline_at = move.deadline_at
        if deadline_at is None:
            deadline_at = a.now + timedelta(
                seconds=(job.measured_save_s or job.checkpoint_save_s) * 2 + settings.OMNI_COMMAND_ACK_TIMEOUT_S
            )
        leader_command = write_commands(job, CommandKind.PREEMPT, before, nodes, leader=leader,
                                        deadline_at=deadline_at)
    else:
        facts, _ = lost_facts(job, kill_and_release(job))
        move.reason = {**move.reason, "inputs": {**move.reason.get("inputs", {}), **facts}}
        event = EventKind.KILL
        leader_command = write_commands(job, CommandKind.STOP, before, nodes, leader=leader, extra={"kill": True})
    return _record_decision(a, move, event, leader_command, len(nodes_in_order(before)))


def _resize(a: _Applying, *, kind: ActionKind | None = None, event: EventKind | None = None) -> int:
    """shrink, grow, migrate: checkpoint, then continue on the new layout. Only the new GPUs are
    allocated now; the released ones go when the agent confirms (jobs.actions.commands)."""
    job, nodes = a.job, a.nodes
    kind = kind or ActionKind(a.action.kind)
    move = _check_move(a)
    before, after = move.before, move.after
    if job.state != JobState.RUNNING:
        raise Deferred(f"{job.name} is {job.state}; cannot {kind}")
    if not before or not after:
        raise Deferred(f"{kind} of {job.name} needs GPUs before and after")
    job.last_resized_at = a.now
    job.save(update_fields=[*job.transition_to(JobState.RESIZING), "last_resized_at"])
    Allocation.objects.bulk_create(
        Allocation(job=job, node=nodes[n], gpu_index=i, since=a.now) for n, i in move.new_gpus
    )
    leader_before = before[0][0]
    release = [[n, i] for n, i in before if (n, i) not in after]
    targets = nodes_in_order(before) + [n for n in nodes_in_order(after) if n not in nodes_in_order(before)]
    leader_command = write_commands(
        job, CommandKind.RESIZE, after, nodes, leader=leader_before, targets=targets, deadline_at=move.deadline_at,
        # Every node stops its ranks at a checkpoint; the new layout then starts as a new run
        # (a ``resume``, new rendezvous), since torchrun's world is fixed per launch.
        extra={"relaunch": False, "release": release,
               "dp_after": len(after) // job.replica_gpus, "layout": [[n, i] for n, i in after]},
    )
    return _record_decision(a, move, event or DECISION_EVENTS[kind], leader_command, len(targets))


def _reclaim(a: _Applying) -> int:
    """A borrower gives lent GPUs back by the deadline: a preempt when it keeps none, else a
    shrink; audited as a ``reclaim`` (a ``kill`` when not graceful)."""
    if not a.action.gpus_after:
        return _preempt(a, event=EventKind.RECLAIM)
    return _resize(a, kind=ActionKind.SHRINK, event=EventKind.RECLAIM)


# What applying each planner action kind does (jobs/planner/decisions.py says what each means).
ACTION_HANDLERS: dict[ActionKind, Callable[[_Applying], int]] = {
    ActionKind.PLACE: _start,
    ActionKind.LEND: _start,
    ActionKind.RECOVER: _start,
    ActionKind.PREEMPT: _preempt,
    ActionKind.SHRINK: _resize,
    ActionKind.GROW: _resize,
    ActionKind.MIGRATE: _resize,
    ActionKind.RECLAIM: _reclaim,
    ActionKind.HOLD: _hold,
}

"""Reservations: an operator guarantees GPUs over a span to a critical job or to a team (whichever
of its critical jobs runs: docs/teams.md), edits or cancels it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from jobs.actions._common import actor_name
from jobs.audit import record_event
from jobs.models import Job, Priority, Reservation, Team
from jobs.planner.wording import duration_words, plural
from jobs.roles import require_operator
from jobs.vocab import EventKind

# ``team``: a job's reservation handed to its team, so that it outlives the job (docs/teams.md).
RESERVATION_EDITABLE = ("gpus", "spares", "start_at", "end_at", "period_s", "active_s", "team")


def _validate_reservation(reservation: Reservation) -> None:
    errors: dict[str, str] = {}
    job, team = reservation.job, reservation.team
    if (job is None) == (team is None):
        errors["job" if job is None else "team"] = "a reservation is for one critical job or for one team"
    elif job is not None:
        # A finished job needs none; its team's next critical job may have one (a team reservation).
        if job.priority != Priority.CRITICAL:
            errors["job"] = f"job {job.name!r} is {job.priority}; only critical jobs hold reservations"
        elif job.is_terminal:
            team_words = f" (a reservation for team {job.team.name} outlives its jobs)" if job.team_id else ""
            errors["job"] = f"job {job.name!r} is {job.state}; it needs no reservation{team_words}"
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
        "job": reservation.job.name if reservation.job_id else None,
        "team": reservation.team.name if reservation.team_id else None,
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
    gpus: int,
    start_at: datetime,
    spares: int = 0,
    end_at: datetime | None = None,
    period_s: int | None = None,
    active_s: int | None = None,
    job: Job | None = None,
    team: Team | None = None,
) -> Reservation:
    """Guarantee ``gpus`` over a span (optionally recurring) to a critical job, or to a team: then
    to whichever of its critical jobs runs, the earliest submitted first, whether or not one
    exists yet (the planner resolves it on every pass)."""
    require_operator(actor, "create reservations")
    if Reservation.objects.filter(name=name).exists():
        raise ValidationError({"name": f"a reservation named {name!r} already exists"})
    reservation = Reservation(
        name=name, job=job, team=team, gpus=gpus, spares=spares, start_at=start_at, end_at=end_at,
        period_s=period_s, active_s=active_s, created_by=actor,
    )
    _validate_reservation(reservation)
    reservation.save()
    window = f"{duration_words(active_s)} of every {duration_words(period_s)}" if period_s else "continuously"
    record_event(
        EventKind.RESERVE,
        job=job,
        actor=actor_name(actor),
        actor_user=actor,
        gpus_after=gpus,
        reason={
            "rule": "reserve",
            "text": f"{actor_name(actor)} reserved {plural(gpus, 'GPU')} (+{plural(spares, 'spare')}) for "
            f"{job.name if job is not None else f'team {team.name}'} "
            f"from {start_at:%Y-%m-%d %H:%M} UTC, {window}.",
            "inputs": {"reservation": name, **_reservation_facts(reservation)},
        },
    )
    return reservation


@transaction.atomic
def update_reservation(reservation: Reservation, actor, **changes: Any) -> Reservation:
    """Edit a reservation's size or windows; the audit keeps the before and after."""
    require_operator(actor, "edit reservations")
    unknown = set(changes) - set(RESERVATION_EDITABLE)
    if unknown:
        raise ValidationError({field: "this field cannot be changed" for field in sorted(unknown)})
    reservation = Reservation.objects.select_for_update(no_key=True).get(pk=reservation.pk)
    if reservation.cancelled_at is not None:
        raise ValidationError({"name": "a cancelled reservation cannot be edited"})
    before = _reservation_facts(reservation)
    for field, value in changes.items():
        setattr(reservation, field, value)
    fields = list(changes)
    if changes.get("team") is not None and reservation.job_id is not None:
        reservation.job = None  # handed to the team: it no longer ends with its job
        fields.append("job")
    _validate_reservation(reservation)
    reservation.save(update_fields=fields)
    record_event(
        EventKind.RESERVATION_CHANGE,
        job=reservation.job,
        actor=actor_name(actor),
        actor_user=actor,
        gpus_before=before["gpus"],
        gpus_after=reservation.gpus,
        reason={
            "rule": "reservation_change",
            "text": f"{actor_name(actor)} changed reservation {reservation.name}"
            f"{f' (now for team {reservation.team.name})' if 'job' in fields else ''}.",
            "inputs": {"before": before, "after": _reservation_facts(reservation)},
        },
    )
    return reservation


@transaction.atomic
def cancel_reservation(reservation: Reservation, actor) -> Reservation:
    """End a reservation now; its loans are no longer owed back."""
    require_operator(actor, "cancel reservations")
    reservation = Reservation.objects.select_for_update(no_key=True).get(pk=reservation.pk)
    if reservation.cancelled_at is not None:
        raise ValidationError({"name": "the reservation is already cancelled"})
    reservation.cancelled_at = timezone.now()
    reservation.save(update_fields=["cancelled_at"])
    record_event(
        EventKind.RESERVATION_CANCEL,
        job=reservation.job,
        actor=actor_name(actor),
        actor_user=actor,
        gpus_before=reservation.gpus,
        gpus_after=0,
        reason={
            "rule": "reservation_cancel",
            "text": f"{actor_name(actor)} cancelled reservation {reservation.name}.",
            "inputs": _reservation_facts(reservation),
        },
    )
    return reservation

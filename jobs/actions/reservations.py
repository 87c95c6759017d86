"""Reservations: an operator guarantees a critical job GPUs over a span, edits or cancels it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from jobs.actions._common import actor_name
from jobs.audit import record_event
from jobs.models import Job, Priority, Reservation
from jobs.planner.wording import duration_words
from jobs.roles import require_operator
from jobs.vocab import EventKind

RESERVATION_EDITABLE = ("gpus", "spares", "start_at", "end_at", "period_s", "active_s")


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
    window = f"{duration_words(active_s)} of every {duration_words(period_s)}" if period_s else "continuously"
    record_event(
        EventKind.RESERVE,
        job=job,
        actor=actor_name(actor),
        actor_user=actor,
        gpus_after=gpus,
        reason={
            "rule": "reserve",
            "text": f"{actor_name(actor)} reserved {gpus} GPUs (+{spares} spares) for {job.name} "
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
        actor=actor_name(actor),
        actor_user=actor,
        gpus_before=before["gpus"],
        gpus_after=reservation.gpus,
        reason={
            "rule": "reservation_change",
            "text": f"{actor_name(actor)} changed reservation {reservation.name}.",
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

"""Reservations: time slices of guaranteed GPUs for a critical job or a team's critical jobs,
lendable while unused."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import models
from django.db.models import F, Q


class ReservationQuerySet(models.QuerySet):
    def in_force(self, now: datetime) -> ReservationQuerySet:
        """The reservations that still guarantee something at ``now`` or after: not cancelled,
        not past their end, and not for a job that has ended (``Reservation.over_at``); a team's
        outlives its jobs. The planner's snapshot and a team's page read the same set."""
        from jobs.models.jobs import TERMINAL_JOB_STATES

        return (self.filter(cancelled_at__isnull=True).filter(Q(end_at__isnull=True) | Q(end_at__gt=now))
                .exclude(job__state__in=TERMINAL_JOB_STATES))


class Reservation(models.Model):
    """``gpus`` (+ ``spares``) guaranteed to a critical job, or to a team's critical jobs (whichever
    is running: the planner resolves it, and the reservation outlives any one of them), from
    ``start_at`` to ``end_at``. Exactly one of ``job`` and ``team`` is set.

    With ``period_s``/``active_s`` it recurs: active for the first ``active_s`` seconds of every
    ``period_s`` from ``start_at`` (the seed's "40 of every 60 minutes").
    """

    name = models.CharField(max_length=128, unique=True)
    job = models.ForeignKey("jobs.Job", on_delete=models.PROTECT, null=True, blank=True, related_name="reservations")
    team = models.ForeignKey(
        "jobs.Team", on_delete=models.PROTECT, null=True, blank=True, related_name="reservations",
        help_text="A team's reservation: its GPUs go to whichever of the team's critical jobs runs.",
    )
    gpus = models.PositiveIntegerField()
    spares = models.PositiveIntegerField(default=0, help_text="Hot spares for fault recovery; lendable.")
    start_at = models.DateTimeField()
    end_at = models.DateTimeField(null=True, blank=True)
    period_s = models.PositiveIntegerField(null=True, blank=True)
    active_s = models.PositiveIntegerField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    objects = ReservationQuerySet.as_manager()

    class Meta:
        ordering = ["start_at", "name"]
        constraints = [
            models.CheckConstraint(condition=Q(gpus__gte=1), name="reservation_has_gpus"),
            models.CheckConstraint(
                condition=(Q(job__isnull=False) & Q(team__isnull=True)) | (Q(job__isnull=True) & Q(team__isnull=False)),
                name="reservation_for_a_job_or_a_team",
            ),
            models.CheckConstraint(
                condition=Q(end_at__isnull=True) | Q(end_at__gt=F("start_at")), name="reservation_ends_after_start"
            ),
            models.CheckConstraint(
                condition=(Q(period_s__isnull=True) & Q(active_s__isnull=True))
                | (Q(period_s__isnull=False) & Q(active_s__isnull=False) & Q(active_s__lte=F("period_s"))),
                name="reservation_recurrence_complete",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def holder_words(self) -> str:
        """``job omni-7b`` or ``team vision``: whom it guarantees GPUs to, in words."""
        return f"team {self.team.name}" if self.team_id else f"job {self.job.name}"

    @property
    def is_recurring(self) -> bool:
        return self.period_s is not None

    @property
    def job_ended_at(self) -> datetime | None:
        """For a job's reservation, when that job ended (completed, failed or cancelled); else
        ``None``. Nothing is held for a job that has ended: the planner's snapshot leaves such a
        reservation out (docs/planner.md), so its later windows guarantee nothing."""
        if self.job_id is None or not self.job.is_terminal:
            return None
        return self.job.finished_at

    @property
    def over_at(self) -> datetime | None:
        """When it stopped guaranteeing anything ahead of its ``end_at``: its cancellation, or
        the end of the job it is for (``job_ended_at``), whichever came first."""
        ends = [t for t in (self.cancelled_at, self.job_ended_at) if t is not None]
        return min(ends) if ends else None

    def is_active_at(self, t: datetime) -> bool:
        """Whether the guarantee holds at ``t`` (inside the span and, if recurring, a window; not
        after ``over_at``)."""
        over = self.over_at
        if over is not None and t >= over:
            return False
        if t < self.start_at or (self.end_at is not None and t >= self.end_at):
            return False
        if not self.is_recurring:
            return True
        offset_s = (t - self.start_at).total_seconds() % self.period_s
        return offset_s < self.active_s

    def next_window_start(self, t: datetime) -> datetime | None:
        """The start of the next window at or after ``t`` (``t`` itself when one begins then);
        ``None`` when no window starts after ``t``. An active window that began before ``t``
        is not "next": use :meth:`is_active_at` for that. None after ``over_at`` either."""
        over = self.over_at
        if over is not None and t >= over:
            return None
        if t <= self.start_at:
            candidate = self.start_at
        elif not self.is_recurring:
            return None
        else:
            elapsed_s = (t - self.start_at).total_seconds()
            periods = -(-elapsed_s // self.period_s)  # ceiling
            candidate = self.start_at + timedelta(seconds=periods * self.period_s)
        if self.end_at is not None and candidate >= self.end_at:
            return None
        return candidate

    def window_end(self, window_start: datetime) -> datetime:
        """When the window beginning at ``window_start`` ends."""
        end = window_start + timedelta(seconds=self.active_s) if self.is_recurring else self.end_at
        if end is None:
            return datetime.max.replace(tzinfo=window_start.tzinfo)
        return min(end, self.end_at) if self.end_at is not None else end

"""The planner's controls (operator knobs, pause, dry run) and the record of each planner pass."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone


class PlannerControl(models.Model):
    """The single row of operator controls for the planner (pk is always 1)."""

    paused = models.BooleanField(default=False)
    dry_run = models.BooleanField(default=False, help_text="Plan and record, but apply nothing.")
    safety_factor = models.FloatField(default=1.5)
    min_run_s = models.PositiveIntegerField(default=7200)
    reclaim_grace_s = models.PositiveIntegerField(default=60)
    updated_at = models.DateTimeField(default=timezone.now)
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )

    class Meta:
        verbose_name = "planner control"
        constraints = [
            models.CheckConstraint(condition=models.Q(safety_factor__gte=1.0), name="planner_safety_at_least_one"),
        ]

    def __str__(self) -> str:
        return "planner (paused)" if self.paused else "planner"

    @classmethod
    def load(cls) -> PlannerControl:
        control, _ = cls.objects.get_or_create(pk=1)
        return control


class PlannerRun(models.Model):
    """One planner pass: when, how long, how many actions, and whether it was applied."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    started_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)
    actions = models.PositiveIntegerField(default=0)
    applied = models.BooleanField(default=False)
    dry_run = models.BooleanField(default=False)
    trigger = models.CharField(max_length=64, blank=True, default="")
    error = models.TextField(blank=True, default="")
    summary = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-started_at"]

    def __str__(self) -> str:
        return f"planner run {self.id}"

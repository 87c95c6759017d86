"""Celery tasks of the telemetry app: thin shells, declared periodic in omniweb.scheduled."""

from __future__ import annotations

from celery import shared_task

from telemetry import partitions, rollups


@shared_task(name="telemetry.roll_up", ignore_result=True)
def roll_up() -> None:
    """Bring the 1-minute and 1-hour rollups up to date."""
    rollups.roll_up()


@shared_task(name="telemetry.maintain_partitions", ignore_result=True)
def maintain_partitions() -> None:
    """Create partitions ahead and drop those past retention (row deletes on SQLite)."""
    partitions.maintain()

"""A job's measured rhythm, one row per job, updated as its step records arrive (jobs/rhythm.py)."""

from __future__ import annotations

from django.db import models

from jobs.rhythm import RhythmState


class JobRhythm(models.Model):
    """The state ``jobs.rhythm.RhythmState`` keeps for one job, and its headline figures as
    columns (for the pages, the API and ``/metrics`` without parsing the state)."""

    job = models.OneToOneField("jobs.Job", on_delete=models.CASCADE, primary_key=True, related_name="rhythm")
    state = models.JSONField(default=dict, help_text="jobs.rhythm.RhythmState as JSON.")
    samples = models.PositiveIntegerField(default=0, help_text="Step times in the window.")
    mean_step_s = models.FloatField(null=True, blank=True)
    stdev_step_s = models.FloatField(null=True, blank=True)
    error_p50 = models.FloatField(null=True, blank=True, help_text="Step-time prediction error, median (relative).")
    error_p95 = models.FloatField(null=True, blank=True)
    lost_share = models.FloatField(null=True, blank=True,
                                   help_text="Share of the job's wall time its GPUs do not compute (recent steps).")
    accuracy = models.JSONField(default=dict, blank=True,
                                help_text="Prediction error by kind: {step|save|idle|reclaim: {p50, p95, n}}.")
    lost_to = models.CharField(max_length=16, blank=True, help_text="What takes most of that time (jobs.rhythm.LOSS_PARTS).")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"rhythm of job {self.job_id}"

    def load(self) -> RhythmState:
        return RhythmState.from_json(self.state)

    def store(self, state: RhythmState) -> None:
        """Keep ``state`` and refresh the columns (the caller saves)."""
        self.state = state.as_json()
        self.samples = len(state.step_s)
        self.mean_step_s = state.mean_s if state.step_s else None
        self.stdev_step_s = state.stdev_s if state.step_s else None
        self.error_p50, self.error_p95 = state.error_percentiles()
        self.accuracy = state.accuracy()
        lost = state.lost()
        self.lost_share, self.lost_to = lost if lost is not None else (None, "")

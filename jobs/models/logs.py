"""What the ranks of a job printed: one row per line, shipped by the node agents.

Lines are keyed by where they sit in the rank's log file (run, rank, stream, byte offset), so
a chunk sent again after a reconnect is stored once. Kept for ``OMNI_LOG_RETENTION_S``
(docs/logs.md).
"""

from __future__ import annotations

from django.db import models


class LogStream(models.TextChoices):
    STDOUT = "out", "stdout"
    STDERR = "err", "stderr"


class JobLogLine(models.Model):
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="log_lines")
    run_id = models.CharField(max_length=64)
    node = models.CharField(max_length=64, help_text="The node the rank ran on.")
    rank = models.PositiveIntegerField()
    stream = models.CharField(max_length=3, choices=LogStream.choices)
    offset = models.BigIntegerField(help_text="Byte offset of the line in the rank's log file.")
    at = models.DateTimeField(help_text="When the agent read the line.")
    text = models.TextField()

    class Meta:
        ordering = ["id"]
        constraints = [
            models.UniqueConstraint(fields=["job", "run_id", "rank", "stream", "offset"], name="log_line_once"),
        ]
        indexes = [
            models.Index(fields=["job", "id"], name="log_job_id"),
            models.Index(fields=["job", "rank", "id"], name="log_job_rank_id"),
            models.Index(fields=["at"], name="log_at"),
        ]

    def __str__(self) -> str:
        return f"{self.job_id} rank {self.rank} {self.stream} @{self.offset}"

"""The elastic-adjustment audit log: append-only, hash-chained, one row per decision or outcome.

Each row stores ``hash = sha256(prev_hash + canonical_json(row))``, so editing, deleting or
reordering any row breaks the chain from there on (``manage.py verify_audit`` finds it). On
PostgreSQL a trigger also rejects UPDATE and DELETE outright. Outcomes that arrive later (an
agent's ack, the measured checkpoint time) are new rows that point at the decision through
``refers_to``; nothing is ever rewritten. With ``OMNI_AUDIT_KEY`` set each row also stores
``mac = HMAC-SHA256(key, hash)``, which nobody without the key can forge. See docs/audit-log.md.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from jobs.vocab import EVENT_KIND_LABELS, choices


class AppendOnlyQuerySet(models.QuerySet):
    """Refuses bulk updates and deletes: the audit log only grows."""

    def update(self, **kwargs):  # type: ignore[override]
        raise PermissionError("the audit log is append-only: rows cannot be updated")

    def delete(self):  # type: ignore[override]
        raise PermissionError("the audit log is append-only: rows cannot be deleted")


class ElasticEvent(models.Model):
    """One audit record: what was decided or happened, by whom, why, and the before/after."""

    at = models.DateTimeField(db_index=True)
    kind = models.CharField(max_length=24, choices=choices(EVENT_KIND_LABELS), db_index=True)
    job = models.ForeignKey(
        "jobs.Job", on_delete=models.PROTECT, null=True, blank=True, related_name="events"
    )
    job_name = models.CharField(max_length=128, blank=True, default="")
    nodes_before = models.JSONField(default=list, blank=True)
    nodes_after = models.JSONField(default=list, blank=True)
    gpus_before = models.PositiveIntegerField(null=True, blank=True)
    gpus_after = models.PositiveIntegerField(null=True, blank=True)
    dp_before = models.PositiveIntegerField(null=True, blank=True)
    dp_after = models.PositiveIntegerField(null=True, blank=True)
    accum_before = models.PositiveIntegerField(null=True, blank=True)
    accum_after = models.PositiveIntegerField(null=True, blank=True)
    global_batch = models.PositiveIntegerField(null=True, blank=True)
    actor_user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    actor = models.CharField(max_length=150, help_text="A user name, 'planner', 'agent:<node>' or 'system'.")
    planner_run = models.UUIDField(null=True, blank=True, db_index=True)
    command = models.UUIDField(null=True, blank=True, help_text="The command this decision sent, if any.")
    refers_to = models.ForeignKey(
        "self", on_delete=models.PROTECT, null=True, blank=True, related_name="outcomes"
    )
    reason = models.JSONField(default=dict, blank=True, help_text="{rule, text, inputs}")
    outcome = models.JSONField(default=dict, blank=True)
    prev_hash = models.CharField(max_length=64, editable=False)
    hash = models.CharField(max_length=64, editable=False, unique=True)
    mac = models.CharField(
        max_length=64, blank=True, default="", editable=False,
        help_text="HMAC-SHA256(OMNI_AUDIT_KEY, hash); blank for rows written without a key.",
    )

    objects = AppendOnlyQuerySet.as_manager()

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["job", "at"], name="event_job_at")]

    def __str__(self) -> str:
        return f"#{self.pk} {self.kind} {self.job_name}".strip()

    def save(self, *args, **kwargs) -> None:
        if self.pk is not None:
            raise PermissionError("the audit log is append-only: rows cannot be updated")
        if not self.hash:
            raise ValueError("audit rows are written by jobs.audit.record_event, which chains them")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise PermissionError("the audit log is append-only: rows cannot be deleted")

    @property
    def reason_text(self) -> str:
        return str(self.reason.get("text", "")) if isinstance(self.reason, dict) else ""

"""The command outbox: what the control plane has told (or will tell) a node's agent to do.

Rows are written in the same transaction as the decision that caused them and delivered only
after commit, at least once; agents apply each id at most once. See docs/control-loop.md.
"""

from __future__ import annotations

import uuid

from django.db import models
from django.utils import timezone

from jobs.models.states import check_transition
from jobs.vocab import COMMAND_KIND_LABELS, choices


class CommandState(models.TextChoices):
    PENDING = "pending", "Pending"
    SENT = "sent", "Sent"
    ACKED = "acked", "Acknowledged"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"
    EXPIRED = "expired", "Expired"


TERMINAL_COMMAND_STATES = frozenset({CommandState.DONE, CommandState.FAILED, CommandState.EXPIRED})

# A sent command that is not acknowledged in time goes back to pending for a retry, until its
# attempts run out and it expires.
COMMAND_TRANSITIONS: dict[str, frozenset[str]] = {
    CommandState.PENDING: frozenset({CommandState.SENT, CommandState.EXPIRED, CommandState.FAILED}),
    CommandState.SENT: frozenset(
        {CommandState.ACKED, CommandState.PENDING, CommandState.DONE, CommandState.FAILED, CommandState.EXPIRED}
    ),
    CommandState.ACKED: frozenset({CommandState.DONE, CommandState.FAILED, CommandState.EXPIRED}),
    CommandState.DONE: frozenset(),
    CommandState.FAILED: frozenset(),
    CommandState.EXPIRED: frozenset(),
}


class Command(models.Model):
    """One instruction for one node's agent about one job, with its delivery state."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    node = models.ForeignKey("jobs.Node", on_delete=models.PROTECT, related_name="commands")
    job = models.ForeignKey("jobs.Job", on_delete=models.PROTECT, null=True, blank=True, related_name="commands")
    kind = models.CharField(max_length=16, choices=choices(COMMAND_KIND_LABELS))
    payload = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=16, choices=CommandState.choices, default=CommandState.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    deadline_at = models.DateTimeField(
        null=True, blank=True, help_text="For preempt: when the checkpoint must be saved."
    )
    outcome = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    sent_at = models.DateTimeField(null=True, blank=True)
    acked_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at"]
        indexes = [models.Index(fields=["node", "state"], name="command_node_state")]

    def __str__(self) -> str:
        return f"{self.kind} {self.job.name if self.job_id else ''} on {self.node.name} ({self.state})"

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_COMMAND_STATES

    def transition_to(self, target: str) -> list[str]:
        """Move to ``target`` or raise IllegalTransition, stamping the matching time; return the
        fields changed, for the caller's ``save(update_fields=...)``."""
        check_transition(COMMAND_TRANSITIONS, "Command", str(self.id), self.state, target)
        now = timezone.now()
        changed = ["state"]
        if target == CommandState.SENT:
            self.sent_at = now
            self.attempts += 1
            changed += ["sent_at", "attempts"]
        elif target == CommandState.ACKED:
            self.acked_at = now
            changed.append("acked_at")
        elif target in TERMINAL_COMMAND_STATES:
            self.finished_at = now
            changed.append("finished_at")
        self.state = target
        return changed

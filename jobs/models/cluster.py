"""The machines: nodes with their topology and health, and which GPU each job holds."""

from __future__ import annotations

import hashlib
import secrets

from django.db import models
from django.utils import timezone

from jobs.models.states import check_transition


class NodeState(models.TextChoices):
    HEALTHY = "healthy", "Healthy"
    SUSPECT = "suspect", "Suspect (missed heartbeats)"
    FAILED = "failed", "Failed"
    CORDONED = "cordoned", "Cordoned"
    DRAINING = "draining", "Draining"


# Who may move a node where. A failed node comes back only through an operator or a health
# check ("mark repaired"), never by itself answering heartbeats again.
NODE_TRANSITIONS: dict[str, frozenset[str]] = {
    NodeState.HEALTHY: frozenset({NodeState.SUSPECT, NodeState.FAILED, NodeState.CORDONED, NodeState.DRAINING}),
    NodeState.SUSPECT: frozenset({NodeState.HEALTHY, NodeState.FAILED, NodeState.CORDONED, NodeState.DRAINING}),
    NodeState.FAILED: frozenset({NodeState.HEALTHY, NodeState.CORDONED}),
    NodeState.CORDONED: frozenset({NodeState.HEALTHY, NodeState.DRAINING, NodeState.FAILED}),
    NodeState.DRAINING: frozenset({NodeState.CORDONED, NodeState.HEALTHY, NodeState.FAILED}),
}

SCHEDULABLE_NODE_STATES = (NodeState.HEALTHY,)


def hash_agent_token(token: str) -> str:
    """Agent tokens are stored only as SHA-256 digests; they are long random strings, so no salt."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class Node(models.Model):
    """A GPU machine: where it sits in the network, how healthy it is, and its agent's credential."""

    name = models.CharField(max_length=64, unique=True)
    rack = models.CharField(max_length=64)
    switch = models.CharField(max_length=64, help_text="Leaf switch; nodes on one switch are closest.")
    gpu_count = models.PositiveSmallIntegerField()
    gpu_model = models.CharField(max_length=64, default="H100-80GB")
    state = models.CharField(max_length=16, choices=NodeState.choices, default=NodeState.HEALTHY)
    state_changed_at = models.DateTimeField(default=timezone.now)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    speed_factor = models.FloatField(
        default=1.0, help_text="Measured step-time multiplier; above 1 means a straggler."
    )
    agent_token_hash = models.CharField(max_length=64, blank=True, default="", editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["rack", "switch", "name"]
        constraints = [
            models.CheckConstraint(condition=models.Q(gpu_count__gte=1), name="node_has_gpus"),
            models.CheckConstraint(condition=models.Q(speed_factor__gt=0), name="node_speed_positive"),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def is_schedulable(self) -> bool:
        return self.state in SCHEDULABLE_NODE_STATES

    def transition_to(self, target: str) -> list[str]:
        """Move to ``target`` or raise IllegalTransition; return the fields changed, for the
        caller's ``save(update_fields=...)``."""
        check_transition(NODE_TRANSITIONS, "Node", self.name, self.state, target)
        self.state = target
        self.state_changed_at = timezone.now()
        return ["state", "state_changed_at"]

    def issue_token(self) -> str:
        """Make a new agent token, keep only its hash, and return it (shown once)."""
        token = secrets.token_urlsafe(32)
        self.agent_token_hash = hash_agent_token(token)
        return token

    def token_matches(self, token: str) -> bool:
        if not self.agent_token_hash or not token:
            return False
        return secrets.compare_digest(self.agent_token_hash, hash_agent_token(token))


class Allocation(models.Model):
    """One GPU (node + index) that a job holds now, its own or borrowed from a reservation."""

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="allocations")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="allocations")
    gpu_index = models.PositiveSmallIntegerField()
    borrowed_from = models.ForeignKey(
        "jobs.Reservation",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="loans",
        help_text="Set when the GPU is reserved for another job and only lent to this one.",
    )
    loan_until = models.DateTimeField(
        null=True, blank=True, help_text="When a loan must be returned, checkpoint saved."
    )
    since = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["node__name", "gpu_index"]
        constraints = [
            # No GPU is held by two jobs at once.
            models.UniqueConstraint(fields=["node", "gpu_index"], name="one_holder_per_gpu"),
        ]

    def __str__(self) -> str:
        return f"{self.node.name}/gpu{self.gpu_index} -> {self.job.name}"

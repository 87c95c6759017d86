"""The machines: nodes with their topology and health, which GPU each job holds now, and which
GPUs each job held when (the history its GPU charts are drawn from)."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from django.db import models, transaction
from django.db.models import Exists, F, OuterRef, Q, Value
from django.db.models.functions import Greatest
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
    address = models.CharField(
        max_length=255, blank=True, default="",
        help_text="Where other nodes reach this one (rendezvous); reported by its agent.",
    )
    disk_free_bytes = models.BigIntegerField(null=True, blank=True, help_text="Free space of the agent's runs dir.")
    disk_total_bytes = models.BigIntegerField(null=True, blank=True)
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


class AllocationQuerySet(models.QuerySet):
    """Allocations that keep their history: every row made opens an ``AllocationSpan`` and every
    row removed closes it, in the same transaction, whichever path makes or removes the row
    (the actions, an instance's ``save``/``delete``, a queryset's ``delete``)."""

    def bulk_create(self, objs, *args, **kwargs):
        if kwargs.get("ignore_conflicts") or kwargs.get("update_conflicts"):
            # A skipped or rewritten row would leave its span wrong; a GPU that changes hands is
            # a release and a new allocation.
            raise ValueError("allocations are created, never upserted")
        with transaction.atomic(using=self.db, savepoint=False):
            created = super().bulk_create(objs, *args, **kwargs)
            AllocationSpan.objects.using(self.db).bulk_create(AllocationSpan.opened_by(a) for a in created)
        return created

    def release(self, at: datetime | None = None) -> int:
        """Free these GPUs: close their spans at ``at`` (default now), delete the rows; return
        how many were freed. Two statements however many rows."""
        at = at or timezone.now()
        with transaction.atomic(using=self.db, savepoint=False):
            held = self.filter(job_id=OuterRef("job_id"), node_id=OuterRef("node_id"),
                               gpu_index=OuterRef("gpu_index"))
            AllocationSpan.objects.using(self.db).filter(ended_at__isnull=True).filter(Exists(held)).update(
                ended_at=Greatest(Value(at), F("started_at"))
            )
            released, _ = super().delete()
        return released

    release.alters_data = True
    release.queryset_only = True

    def delete(self) -> tuple[int, dict[str, int]]:
        released = self.release()
        return released, {self.model._meta.label: released}

    delete.alters_data = True
    delete.queryset_only = True


class Allocation(models.Model):
    """One GPU (node + index) that a job holds now, its own or borrowed from a reservation.

    Its job, node and index never change in place: a GPU that changes hands is a release and a
    new allocation, so that its ``AllocationSpan`` is closed and another opened.
    """

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

    objects = AllocationQuerySet.as_manager()

    class Meta:
        ordering = ["node__name", "gpu_index"]
        constraints = [
            # No GPU is held by two jobs at once.
            models.UniqueConstraint(fields=["node", "gpu_index"], name="one_holder_per_gpu"),
        ]

    def __str__(self) -> str:
        return f"{self.node.name}/gpu{self.gpu_index} -> {self.job.name}"

    def save(self, *args, **kwargs) -> None:
        if not self._state.adding:
            super().save(*args, **kwargs)
            return
        using = kwargs.get("using") or self._state.db or "default"
        with transaction.atomic(using=using, savepoint=False):
            super().save(*args, **kwargs)
            AllocationSpan.opened_by(self).save(using=using)

    def delete(self, using: str | None = None, keep_parents: bool = False) -> tuple[int, dict[str, int]]:
        released = Allocation.objects.using(using or self._state.db).filter(pk=self.pk).release()
        self.pk = None
        return released, {self._meta.label: released}


class AllocationSpanQuerySet(models.QuerySet):
    def overlapping(self, start: datetime, end: datetime) -> AllocationSpanQuerySet:
        """Spans that held their GPU at some moment of [start, end)."""
        return self.filter(started_at__lt=end).filter(Q(ended_at__isnull=True) | Q(ended_at__gt=start))


class AllocationSpan(models.Model):
    """One GPU held by one job from ``started_at`` until ``ended_at`` (open while it still holds it).

    Opened and closed by ``Allocation`` itself (``AllocationQuerySet``), so the open spans are
    always exactly the current allocations. A job's GPU charts read telemetry through these:
    each GPU only over the time this job held it (docs/telemetry.md, "Queries").
    """

    # Deletes behave as Allocation's: the history of work done on a node or under a reservation
    # keeps it. Job and node are not indexed alone: the composite indexes below lead with them.
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="allocation_spans", db_index=False)
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="allocation_spans", db_index=False)
    gpu_index = models.PositiveSmallIntegerField()
    borrowed_from = models.ForeignKey(
        "jobs.Reservation", on_delete=models.PROTECT, null=True, blank=True, related_name="+",
        help_text="The reservation the GPU was lent from, if it was a loan.",
    )
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True, help_text="Empty while the job still holds the GPU.")

    objects = AllocationSpanQuerySet.as_manager()

    class Meta:
        ordering = ["started_at", "id"]
        indexes = [
            models.Index(fields=["job", "started_at"], name="span_by_job"),
            models.Index(fields=["node", "gpu_index", "started_at"], name="span_by_gpu"),
        ]
        constraints = [
            # As Allocation's one_holder_per_gpu: one job holds a GPU at a time.
            models.UniqueConstraint(
                fields=["node", "gpu_index"], condition=Q(ended_at__isnull=True), name="one_open_span_per_gpu"
            ),
            models.CheckConstraint(
                condition=Q(ended_at__isnull=True) | Q(ended_at__gte=F("started_at")), name="span_ends_after_start"
            ),
        ]

    def __str__(self) -> str:
        until = f"{self.ended_at:%Y-%m-%d %H:%M:%S}" if self.ended_at else "now"
        return f"job {self.job_id} on node {self.node_id}/gpu{self.gpu_index}, {self.started_at:%Y-%m-%d %H:%M:%S}-{until}"

    @classmethod
    def opened_by(cls, allocation: Allocation) -> AllocationSpan:
        """The open span of a just-made allocation."""
        return cls(job_id=allocation.job_id, node_id=allocation.node_id, gpu_index=allocation.gpu_index,
                   borrowed_from_id=allocation.borrowed_from_id, started_at=allocation.since)

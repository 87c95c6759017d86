"""Training jobs: their parallel layout, elastic bounds, batch configuration, progress and state."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import F, Q
from django.utils import timezone

from jobs.models.states import BatchInvariantError, check_transition


class Priority(models.TextChoices):
    CRITICAL = "critical", "Critical"
    REGULAR = "regular", "Regular"
    BEST_EFFORT = "best_effort", "Best effort"


class Integration(models.TextChoices):
    """How a job's code works with Omni (docs/workloads.md).

    ``omni``: it uses ``trainer_agent.runtime`` (cooperative checkpoint-and-stop, step records,
    elastic DP). ``signal``: any script; preempt is SIGTERM, ``grace_s``, then SIGKILL; not elastic.
    """

    OMNI = "omni", "Omni runtime (cooperative, elastic)"
    SIGNAL = "signal", "Signal (SIGTERM, grace, SIGKILL; not elastic)"


# The reference trainer (trainer_agent.reference): the demo's workload and the default one.
REFERENCE_ENTRYPOINT = ("-m", "trainer_agent.reference")


def reference_entrypoint() -> list[str]:
    return list(REFERENCE_ENTRYPOINT)


class JobState(models.TextChoices):
    PENDING = "pending", "Pending"
    RUNNING = "running", "Running"
    CHECKPOINTING = "checkpointing", "Checkpointing"
    PREEMPTED = "preempted", "Preempted"
    RESIZING = "resizing", "Resizing"
    RECOVERING = "recovering", "Recovering"
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


TERMINAL_JOB_STATES = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})
# The job holds no GPUs of its own and waits for the planner (recovering: after a fault).
WAITING_JOB_STATES = frozenset({JobState.PENDING, JobState.PREEMPTED, JobState.RECOVERING})
ACTIVE_JOB_STATES = frozenset(
    {JobState.RUNNING, JobState.CHECKPOINTING, JobState.RESIZING, JobState.RECOVERING}
)

# The job lifecycle. Checkpointing is the graceful half of a preemption (save, then release);
# resizing is a save-and-restart at a new DP; recovering follows a fault and restarts from the
# last completed checkpoint.
JOB_TRANSITIONS: dict[str, frozenset[str]] = {
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.CANCELLED, JobState.FAILED}),
    JobState.RUNNING: frozenset(
        {
            JobState.CHECKPOINTING,
            JobState.RESIZING,
            JobState.RECOVERING,
            JobState.COMPLETED,
            JobState.FAILED,
            JobState.CANCELLED,
        }
    ),
    JobState.CHECKPOINTING: frozenset(
        {JobState.PREEMPTED, JobState.RUNNING, JobState.RECOVERING, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.PREEMPTED: frozenset({JobState.RUNNING, JobState.CANCELLED, JobState.FAILED}),
    JobState.RESIZING: frozenset({JobState.RUNNING, JobState.RECOVERING, JobState.FAILED, JobState.CANCELLED}),
    JobState.RECOVERING: frozenset(
        {JobState.RUNNING, JobState.PREEMPTED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class Job(models.Model):
    """A training job: who owns it, how it is partitioned (TP x PP x DP), its batch and progress.

    One data-parallel replica is ``tp * pp`` GPUs; elasticity adds or removes whole replicas and
    keeps ``global_batch == micro_batch * dp * accum_steps`` by changing the accumulation.
    """

    name = models.CharField(max_length=128, unique=True)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs")
    priority = models.CharField(max_length=16, choices=Priority.choices, default=Priority.REGULAR)
    # Its team's quota and borrowing limit apply to it (docs/teams.md); none: it only borrows.
    team = models.ForeignKey(
        "jobs.Team", on_delete=models.PROTECT, null=True, blank=True, related_name="jobs",
        help_text="The team whose quota it runs under; empty: no quota, it only borrows idle GPUs.",
    )
    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.PENDING)

    tp = models.PositiveSmallIntegerField(default=1, help_text="Tensor-parallel degree (within one node).")
    pp = models.PositiveSmallIntegerField(default=1, help_text="Pipeline-parallel degree.")
    dp = models.PositiveIntegerField(help_text="Data-parallel replicas in the current configuration.")
    dp_min = models.PositiveIntegerField()
    dp_max = models.PositiveIntegerField()
    global_batch = models.PositiveIntegerField()
    micro_batch = models.PositiveIntegerField()
    accum_steps = models.PositiveIntegerField()

    total_steps = models.PositiveIntegerField()
    committed_steps = models.PositiveIntegerField(default=0)
    step_s = models.FloatField(help_text="Expected seconds per step at the preferred DP (spec).")
    comm_fraction = models.FloatField(default=0.1, help_text="Share of a step that does not shrink with DP.")
    min_run_s = models.PositiveIntegerField(
        default=0, help_text="Guaranteed continuous run before a preemption other than for a reservation or fault."
    )

    checkpoint_every_steps = models.PositiveIntegerField(default=500)
    checkpoint_save_s = models.FloatField(default=30.0, help_text="Expected save seconds (spec).")
    checkpoint_load_s = models.FloatField(default=60.0, help_text="Expected load seconds (spec).")
    last_checkpoint_step = models.PositiveIntegerField(default=0)
    last_checkpoint_at = models.DateTimeField(null=True, blank=True)
    measured_save_s = models.FloatField(null=True, blank=True, help_text="Last measured save seconds.")
    measured_load_s = models.FloatField(null=True, blank=True, help_text="Last measured load seconds.")

    preemptions = models.PositiveIntegerField(default=0)
    pending_reason = models.TextField(blank=True, default="", help_text="The planner's last word on why it waits.")
    # A hold is audited only when its cause changes (jobs.actions.planner_pass._hold); the
    # sentence above is kept current on every pass, these say what it is and since when.
    pending_cause = models.CharField(
        max_length=32, blank=True, default="",
        help_text="The cause of the planner's current hold (capacity, cannot_fit, ...); empty when not held.",
    )
    pending_since = models.DateTimeField(null=True, blank=True, help_text="When the current hold cause began.")

    # The workload: what runs on the GPUs (docs/workloads.md). One torchrun per node the job holds
    # starts ``entrypoint`` on every GPU there.
    entrypoint = models.JSONField(
        default=reference_entrypoint,
        help_text="argv: a first word ending in .py or '-m MODULE' runs with the node's Python; else an executable.",
    )
    workdir = models.CharField(max_length=1024, blank=True, default="",
                               help_text="Working directory of the ranks (default: the job's run dir).")
    env = models.JSONField(default=dict, blank=True, help_text="Extra environment of the ranks (values never shown back).")
    integration = models.CharField(max_length=8, choices=Integration.choices, default=Integration.OMNI)
    grace_s = models.FloatField(default=30.0, help_text="Signal mode: seconds from SIGTERM to SIGKILL.")
    max_restarts = models.PositiveSmallIntegerField(default=0, help_text="Restarts after the script fails.")
    restarts = models.PositiveSmallIntegerField(default=0, help_text="Restarts used so far.")
    keep_checkpoints = models.PositiveSmallIntegerField(default=3, help_text="Omni jobs keep the last K checkpoints.")
    # The current run (one per launch: start, resume, resize): its rendezvous id and port.
    run_id = models.CharField(max_length=64, blank=True, default="")
    rdzv_port = models.PositiveIntegerField(null=True, blank=True)
    failure = models.JSONField(
        default=dict, blank=True,
        help_text="The last failure of the job's code: exit code, rank, node, last lines of its log.",
    )
    run_dir_removed_at = models.DateTimeField(null=True, blank=True)

    submitted_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True, help_text="Start of the current continuous run.")
    queued_at = models.DateTimeField(
        null=True, blank=True,
        help_text="When the job last began waiting for GPUs (empty: at its submission); kept while it runs.",
    )
    first_started_at = models.DateTimeField(null=True, blank=True)
    last_resized_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    state_changed_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-submitted_at", "name"]
        indexes = [models.Index(fields=["state", "priority"], name="job_state_priority")]
        constraints = [
            models.CheckConstraint(
                condition=Q(global_batch=F("micro_batch") * F("dp") * F("accum_steps")),
                name="job_batch_invariant",
            ),
            models.CheckConstraint(
                condition=Q(dp_min__lte=F("dp")) & Q(dp__lte=F("dp_max")), name="job_dp_within_bounds"
            ),
            models.CheckConstraint(condition=Q(dp_min__gte=1), name="job_dp_min_positive"),
            models.CheckConstraint(condition=Q(committed_steps__lte=F("total_steps")), name="job_steps_bounded"),
            models.CheckConstraint(
                condition=Q(integration="omni") | (Q(dp_min=F("dp")) & Q(dp_max=F("dp"))),
                name="job_signal_not_elastic",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def save(self, *args, **kwargs) -> None:
        # The batch invariant is checked on every save, whatever the caller updates.
        self.check_batch_invariant()
        super().save(*args, **kwargs)

    # -- derived facts -------------------------------------------------------------------------

    @property
    def replica_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def gpus_wanted(self) -> int:
        return self.replica_gpus * self.dp

    @property
    def is_elastic(self) -> bool:
        return self.integration == Integration.OMNI and self.dp_min < self.dp_max

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_JOB_STATES

    @property
    def is_waiting(self) -> bool:
        """Pending, preempted or recovering: the states whose page says why the job waits."""
        return self.state in WAITING_JOB_STATES

    @property
    def progress(self) -> float:
        return self.committed_steps / self.total_steps if self.total_steps else 1.0

    def valid_dps(self) -> list[int]:
        """Every DP within bounds at which the global batch splits exactly into micro-batches."""
        return [
            d for d in range(self.dp_min, self.dp_max + 1) if self.global_batch % (self.micro_batch * d) == 0
        ]

    # -- the batch invariant and the state machine --------------------------------------------

    def check_batch_invariant(self) -> None:
        if self.micro_batch * self.dp * self.accum_steps != self.global_batch:
            raise BatchInvariantError(
                f"job {self.name!r}: micro_batch {self.micro_batch} x dp {self.dp} x accum_steps "
                f"{self.accum_steps} = {self.micro_batch * self.dp * self.accum_steps}, "
                f"not the global batch {self.global_batch}"
            )

    def set_dp(self, dp: int) -> None:
        """Change DP and recompute the accumulation; the global batch never changes."""
        if not self.dp_min <= dp <= self.dp_max:
            raise BatchInvariantError(f"job {self.name!r}: dp {dp} outside [{self.dp_min}, {self.dp_max}]")
        if self.global_batch % (self.micro_batch * dp):
            raise BatchInvariantError(
                f"job {self.name!r}: global batch {self.global_batch} does not split into "
                f"{dp} replicas of micro-batch {self.micro_batch}"
            )
        self.dp = dp
        self.accum_steps = self.global_batch // (self.micro_batch * dp)

    def transition_to(self, target: str) -> list[str]:
        """Move to ``target`` or raise IllegalTransition; return the fields changed, for the
        caller's ``save(update_fields=...)``."""
        check_transition(JOB_TRANSITIONS, "Job", self.name, self.state, target)
        now = timezone.now()
        changed = ["state", "state_changed_at"]
        if target == JobState.RUNNING and self.state != JobState.RUNNING:
            self.started_at = now
            self.first_started_at = self.first_started_at or now
            changed += ["started_at", "first_started_at"]
        if target == JobState.RUNNING and self.state in WAITING_JOB_STATES:
            # It no longer waits: nothing may go on saying why it does.
            self.pending_reason, self.pending_cause, self.pending_since = "", "", None
            changed += ["pending_reason", "pending_cause", "pending_since"]
        if target in WAITING_JOB_STATES and self.state not in WAITING_JOB_STATES:
            # A stop or a fault: the wait the next run begins after starts now (the planner
            # reads it while that run goes on: a promoted best-effort job's minimum run).
            self.queued_at = now
            changed.append("queued_at")
        if target in TERMINAL_JOB_STATES:
            self.finished_at = now
            changed.append("finished_at")
        self.state = target
        self.state_changed_at = now
        return changed

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if self.dp_min and self.dp_max and self.dp_min > self.dp_max:
            errors["dp_min"] = f"dp_min {self.dp_min} is larger than dp_max {self.dp_max}"
        if self.dp is not None and self.dp_min and self.dp_max and not self.dp_min <= self.dp <= self.dp_max:
            errors["dp"] = f"dp {self.dp} is outside [dp_min {self.dp_min}, dp_max {self.dp_max}]"
        try:
            self.check_batch_invariant()
        except BatchInvariantError as exc:
            errors["accum_steps"] = str(exc)
        if errors:
            raise ValidationError(errors)

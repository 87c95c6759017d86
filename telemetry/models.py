"""Telemetry storage: raw GPU samples and step records, their 1-minute and 1-hour rollups, and
the sender streams used to de-duplicate batches.

The sample and rollup tables are time series. On PostgreSQL they are natively partitioned by
time (daily; hourly rollups monthly) and created by migration 0001 in SQL, so these models are
``managed = False``: Django reads and (in embedded SQLite mode) bulk-writes them, but never
alters them. Foreign keys to nodes and jobs are not enforced by the database: a per-row
referential check would halve COPY speed, and ingestion validates node and job ids itself.
See docs/telemetry.md.
"""

from __future__ import annotations

from django.db import models


class GpuSample(models.Model):
    """One reading of one GPU: utilisation, memory, power, temperature, XID error count."""

    pk = models.CompositePrimaryKey("node", "gpu_index", "at")
    node = models.ForeignKey(
        "jobs.Node", on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    gpu_index = models.SmallIntegerField()
    at = models.DateTimeField()
    util_pct = models.FloatField()
    mem_used_bytes = models.BigIntegerField()
    power_w = models.FloatField(null=True)
    temp_c = models.FloatField(null=True)
    xid_errors = models.IntegerField(default=0)

    class Meta:
        managed = False
        db_table = "telemetry_gpusample"

    def __str__(self) -> str:
        return f"node {self.node_id} gpu {self.gpu_index} at {self.at:%Y-%m-%d %H:%M:%S}"


class StepRecord(models.Model):
    """One training step of one rank: where the time went, tokens per modality, loss."""

    pk = models.CompositePrimaryKey("job", "rank", "step", "at")
    job = models.ForeignKey("jobs.Job", on_delete=models.DO_NOTHING, db_constraint=False, related_name="+")
    rank = models.IntegerField()
    step = models.BigIntegerField()
    at = models.DateTimeField(help_text="When the step finished.")
    node = models.ForeignKey(
        "jobs.Node", on_delete=models.DO_NOTHING, db_constraint=False, related_name="+",
        help_text="The node that reported it.",
    )
    step_s = models.FloatField()
    data_wait_s = models.FloatField(null=True)
    compute_s = models.FloatField(null=True)
    comm_s = models.FloatField(null=True)
    tokens_text = models.BigIntegerField(null=True)
    tokens_image = models.BigIntegerField(null=True)
    tokens_video = models.BigIntegerField(null=True)
    tokens_audio = models.BigIntegerField(null=True)
    loss = models.FloatField(null=True)

    class Meta:
        managed = False
        db_table = "telemetry_steprecord"

    def __str__(self) -> str:
        return f"job {self.job_id} rank {self.rank} step {self.step}"


class GpuRollup(models.Model):
    """Aggregates of one GPU over one bucket (a minute or an hour); see the two concrete tables."""

    pk = models.CompositePrimaryKey("node", "gpu_index", "bucket")
    node = models.ForeignKey(
        "jobs.Node", on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    gpu_index = models.SmallIntegerField()
    bucket = models.DateTimeField(help_text="Start of the bucket.")
    samples = models.IntegerField()
    util_mean_pct = models.FloatField()
    util_max_pct = models.FloatField()
    util_p95_pct = models.FloatField(null=True, help_text="PostgreSQL only (percentile_cont).")
    mem_mean_bytes = models.BigIntegerField()
    mem_max_bytes = models.BigIntegerField()
    power_mean_w = models.FloatField(null=True)
    power_max_w = models.FloatField(null=True)
    temp_mean_c = models.FloatField(null=True)
    temp_max_c = models.FloatField(null=True)
    xid_errors_max = models.IntegerField()

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"node {self.node_id} gpu {self.gpu_index} from {self.bucket:%Y-%m-%d %H:%M}"


class GpuMinute(GpuRollup):
    """1-minute GPU aggregates, kept 30 days by default."""

    class Meta:
        managed = False
        db_table = "telemetry_gpuminute"


class GpuHour(GpuRollup):
    """1-hour GPU aggregates, kept forever by default."""

    class Meta:
        managed = False
        db_table = "telemetry_gpuhour"


class StepRollup(models.Model):
    """Aggregates of one job's step records (all ranks) over one bucket."""

    pk = models.CompositePrimaryKey("job", "bucket")
    job = models.ForeignKey("jobs.Job", on_delete=models.DO_NOTHING, db_constraint=False, related_name="+")
    bucket = models.DateTimeField(help_text="Start of the bucket.")
    records = models.IntegerField()
    ranks = models.IntegerField()
    step_max = models.BigIntegerField()
    step_s_mean = models.FloatField()
    step_s_max = models.FloatField()
    step_s_p95 = models.FloatField(null=True, help_text="PostgreSQL only (percentile_cont).")
    data_wait_s_mean = models.FloatField(null=True)
    compute_s_mean = models.FloatField(null=True)
    comm_s_mean = models.FloatField(null=True)
    tokens_text_sum = models.BigIntegerField(null=True)
    tokens_image_sum = models.BigIntegerField(null=True)
    tokens_video_sum = models.BigIntegerField(null=True)
    tokens_audio_sum = models.BigIntegerField(null=True)
    loss_mean = models.FloatField(null=True)

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"job {self.job_id} from {self.bucket:%Y-%m-%d %H:%M}"


class StepMinute(StepRollup):
    """1-minute step aggregates per job."""

    class Meta:
        managed = False
        db_table = "telemetry_stepminute"


class StepHour(StepRollup):
    """1-hour step aggregates per job."""

    class Meta:
        managed = False
        db_table = "telemetry_stephour"


class BatchKind(models.TextChoices):
    GPU = "gpu", "GPU samples"
    STEPS = "steps", "Step records"


class TelemetrySource(models.Model):
    """One sender stream (an agent process, an importer) of one kind of batch, with the
    anti-replay window over its sequence numbers and running totals for /metrics.

    ``window`` holds bit ``i`` set when batch ``high_seq - i`` was stored (IPsec-style), so a
    re-sent batch is recognised without keeping a row per batch forever.
    """

    node = models.ForeignKey("jobs.Node", on_delete=models.CASCADE, related_name="telemetry_sources")
    name = models.CharField(max_length=128)
    kind = models.CharField(max_length=8, choices=BatchKind.choices)
    high_seq = models.BigIntegerField(default=-1)
    window = models.BinaryField(default=b"", editable=False)
    batches_total = models.BigIntegerField(default=0)
    samples_total = models.BigIntegerField(default=0)
    duplicates_total = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    last_batch_at = models.DateTimeField(null=True, blank=True)
    last_sample_at = models.DateTimeField(null=True, blank=True)
    last_lag_s = models.FloatField(
        null=True, blank=True, help_text="Acceptance time minus the newest sample's time, last batch."
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["node", "name", "kind"], name="telemetry_source_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.kind})"


class RollupWatermark(models.Model):
    """How far each rollup level has been computed: buckets before ``rolled_until`` are final
    (late samples within the grace period are re-rolled)."""

    level = models.CharField(max_length=32, unique=True)
    rolled_until = models.DateTimeField()
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.level} until {self.rolled_until:%Y-%m-%d %H:%M}"

"""Ingestion, stage 3: write a validated, new batch in bulk in one transaction.

PostgreSQL: one binary ``COPY`` of all rows (``telemetry.copy``) into the day's partition
(created on demand, ``telemetry.partitions``), ``synchronous_commit`` off unless the caller
holds a transaction. SQLite: the same rows through ``bulk_create``. The source's sequence
window is advanced in the same transaction (``sequence``); after commit the batch is counted
and handed to the live stage (``live.send_live``), the one call out of this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import connection, transaction

from jobs.models import Node
from telemetry import metrics
from telemetry.copy import binary_payload
from telemetry.ingest.live import send_live
from telemetry.ingest.sequence import advance_source, record_batch, record_duplicate, remember_committed
from telemetry.ingest.validate import SampleRows
from telemetry.models import BatchKind, GpuSample, StepRecord
from telemetry.partitions import ensure_partitions

GPU_COLUMNS: tuple[tuple[str, str], ...] = (
    ("node_id", "bigint"), ("gpu_index", "smallint"), ("at", "timestamptz"), ("util_pct", "real"),
    ("mem_used_bytes", "bigint"), ("power_w", "real"), ("temp_c", "real"), ("xid_errors", "integer"),
)
STEP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("job_id", "bigint"), ("rank", "integer"), ("step", "bigint"), ("at", "timestamptz"), ("node_id", "bigint"),
    ("step_s", "real"), ("data_wait_s", "real"), ("compute_s", "real"), ("comm_s", "real"),
    ("tokens_text", "bigint"), ("tokens_image", "bigint"), ("tokens_video", "bigint"), ("tokens_audio", "bigint"),
    ("loss", "real"),
)


@dataclass(frozen=True)
class IngestResult:
    """What happened to one batch."""

    kind: str  # "gpu" or "steps"
    source: str
    seq: int
    accepted: int  # samples stored (0 for a duplicate)
    duplicate: bool
    newest_at: datetime | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind), "source": self.source, "seq": self.seq, "accepted": self.accepted,
            "duplicate": self.duplicate,
        }


def copy_rows(table: str, columns: Sequence[tuple[str, str]], rows: SampleRows, *, on_conflict_skip: bool) -> None:
    """One binary COPY into ``table`` (through a staging table when duplicates must be skipped)."""
    payload = binary_payload(columns, rows.values, rows.nulls)
    names = ", ".join(name for name, _ in columns)
    with connection.cursor() as wrapper:
        cursor = wrapper.cursor
        if not on_conflict_skip:
            with cursor.copy(f"COPY {table} ({names}) FROM STDIN (FORMAT BINARY)") as copy:
                copy.write(payload)
            return
        cursor.execute(f"CREATE TEMP TABLE IF NOT EXISTS {table}_stage (LIKE {table}) ON COMMIT DELETE ROWS")
        with cursor.copy(f"COPY {table}_stage ({names}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.write(payload)
        cursor.execute(f"INSERT INTO {table} ({names}) SELECT {names} FROM {table}_stage ON CONFLICT DO NOTHING")


def bulk_create_rows(model: type, columns: Sequence[tuple[str, str]], rows: SampleRows) -> None:
    """SQLite: the same rows through the ORM (INSERT OR IGNORE for rows already there)."""
    objects = []
    epoch = rows.epoch_s.tolist()
    names = [name for name, _ in columns if name != "at"]
    lists = {name: rows.values[name].tolist() for name in names}
    null_lists = {name: rows.nulls[name].tolist() for name in rows.nulls}
    for i, at_s in enumerate(epoch):
        fields = {
            name: (None if name in null_lists and null_lists[name][i] else lists[name][i]) for name in names
        }
        objects.append(model(at=datetime.fromtimestamp(at_s, tz=UTC), **fields))
    model.objects.bulk_create(objects, batch_size=500, ignore_conflicts=True)


def store_batch(kind: str, node: Node, source_name: str, seq: int, rows: SampleRows, now: datetime,
                *, on_conflict_skip: bool) -> IngestResult:
    """Store ``rows`` unless ``(source_name, seq)`` was stored before; live frames follow commit."""
    table, columns, model = (
        ("telemetry_gpusample", GPU_COLUMNS, GpuSample) if kind == BatchKind.GPU
        else ("telemetry_steprecord", STEP_COLUMNS, StepRecord)
    )
    first_s, last_s = float(rows.epoch_s.min()), float(rows.epoch_s.max())
    newest = datetime.fromtimestamp(last_s, tz=UTC)
    lag_s = max(0.0, now.timestamp() - last_s)
    postgres = connection.vendor == "postgresql"
    # Inside a caller's transaction the commit is the caller's: its durability is not ours to relax.
    async_commit = settings.OMNI_TELEMETRY_ASYNC_COMMIT and not connection.in_atomic_block
    with transaction.atomic():
        update = [len(rows), now, newest, newest, lag_s]
        advance = advance_source(node, source_name, kind, seq, now, update, async_commit=async_commit)
        if not advance.is_new:
            record_duplicate(advance)
            metrics.count("omni_telemetry_batches_total", f"{kind},duplicate")
            return IngestResult(kind, source_name, seq, 0, True, None)
        if postgres:
            if not advance.recorded:
                record_batch(advance, update)
            ensure_partitions(table, datetime.fromtimestamp(first_s, tz=UTC), newest)
            copy_rows(table, columns, rows, on_conflict_skip=on_conflict_skip)
        else:
            bulk_create_rows(model, columns, rows)
            record_batch(advance, update)

        def committed() -> None:
            remember_committed(node, source_name, kind, advance)
            metrics.count("omni_telemetry_batches_total", f"{kind},stored")
            metrics.samples_stored(kind, len(rows))
            send_live(kind, node, rows)

        transaction.on_commit(committed)
    return IngestResult(kind, source_name, seq, len(rows), False, newest)

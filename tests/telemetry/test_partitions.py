"""Time partitions (PostgreSQL): created on demand and ahead, dropped whole past retention."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, transaction
from django.test import override_settings

from telemetry import partitions
from telemetry.ingest import ingest_gpu_batch
from telemetry.models import GpuSample
from tests.telemetry.conftest import gpu_batch


def _tables() -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT relname FROM pg_class WHERE relname LIKE 'telemetry_%%'")
        return {row[0] for row in cursor.fetchall()}


@pytest.mark.postgres
@pytest.mark.django_db
def test_ingest_creates_the_partition_of_the_batch_day(node):
    ingest_gpu_batch(node, gpu_batch(samples=8))
    table = partitions.TABLES_BY_NAME["telemetry_gpusample"]
    start, _ = partitions.partition_bounds(table, datetime.now(UTC) - timedelta(seconds=2))
    name = partitions.partition_name(table, start)
    assert name in _tables()
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {name}")
        assert cursor.fetchone()[0] == 8


@pytest.mark.postgres
@pytest.mark.django_db
def test_maintenance_creates_partitions_ahead_and_drops_expired_ones_whole():
    now = datetime(2026, 6, 15, 12, 0, tzinfo=UTC)
    report = partitions.maintain(now)
    assert "telemetry_gpusample_p20260618" in report.created  # 3 days ahead by default
    assert "telemetry_gpuhour_p20260601" in report.created  # monthly
    # A partition from 10 days earlier holds a row; raw retention is 48 h, so it goes.
    with transaction.atomic():
        partitions.ensure_partitions("telemetry_gpusample", now - timedelta(days=10), now - timedelta(days=10))
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO telemetry_gpusample (node_id, gpu_index, at, util_pct, mem_used_bytes) "
                "VALUES (1, 0, %s, 1, 1)", [now - timedelta(days=10)]
            )
    assert "telemetry_gpusample_p20260605" in _tables()
    report = partitions.maintain(now)
    assert "telemetry_gpusample_p20260605" in report.dropped
    assert "telemetry_gpusample_p20260605" not in _tables()
    assert "telemetry_gpusample_p20260614" in _tables()  # yesterday: inside 48 h
    assert not GpuSample.objects.filter(at__lt=now - timedelta(days=5)).exists()
    # 1-minute rollups keep 30 days, hourly ones forever.
    with override_settings(OMNI_TELEMETRY_MINUTE_RETENTION_D=1):
        later = partitions.maintain(now + timedelta(days=3))
    assert "telemetry_gpuminute_p20260614" in later.dropped
    assert not any(name.startswith("telemetry_gpuhour") for name in later.dropped)


@pytest.mark.django_db
def test_sqlite_retention_deletes_old_rows(node):
    if connection.vendor == "postgresql":
        pytest.skip("PostgreSQL drops partitions (tested above)")
    ingest_gpu_batch(node, gpu_batch(samples=8))
    partitions.maintain(datetime.now(UTC) + timedelta(hours=49))
    assert GpuSample.objects.count() == 0

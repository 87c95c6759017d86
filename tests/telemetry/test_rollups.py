"""Rollups: 1-minute and 1-hour aggregates computed from raw samples, with watermarks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from django.db import connection

from telemetry import rollups
from telemetry.ingest import ingest_gpu_batch, ingest_step_batch
from telemetry.models import GpuHour, GpuMinute, RollupWatermark, StepMinute

pytestmark = pytest.mark.django_db


def _minute_ago(minutes: int) -> datetime:
    return datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=minutes)


def _roll_up_until_done(now: datetime | None = None) -> None:
    for _ in range(12):
        if not rollups.roll_up(now).windows:
            return


def test_minute_rollup_has_mean_max_and_p95(node):
    start = _minute_ago(5)
    first = [{"gpu": 0, "at": start.timestamp() + s, "util_pct": float(s), "mem_used_bytes": 1000 + s,
              "power_w": 300.0 + s} for s in range(60)]
    second = [{"gpu": 0, "at": start.timestamp() + 60 + s, "util_pct": 100.0, "mem_used_bytes": 5000}
              for s in range(30)]
    ingest_gpu_batch(node, {"source": "a", "seq": 0, "samples": first + second})
    _roll_up_until_done()
    rows = {row.bucket: row for row in GpuMinute.objects.filter(node=node, gpu_index=0)}
    one = rows[start]
    assert one.samples == 60
    assert one.util_mean_pct == pytest.approx(29.5)
    assert one.util_max_pct == 59.0
    assert one.mem_max_bytes == 1059
    assert one.power_mean_w == pytest.approx(329.5)
    if connection.vendor == "postgresql":
        assert one.util_p95_pct == pytest.approx(np.percentile(np.arange(60.0), 95))
    two = rows[start + timedelta(minutes=1)]
    assert (two.samples, two.util_mean_pct, two.power_mean_w) == (30, 100.0, None)
    assert RollupWatermark.objects.get(level="gpu-minute").rolled_until >= start + timedelta(minutes=5)


def test_late_samples_within_grace_are_rolled_again(node):
    start = _minute_ago(2)
    ingest_gpu_batch(node, {"source": "a", "seq": 0, "samples": [
        {"gpu": 1, "at": start.timestamp() + 1, "util_pct": 10.0, "mem_used_bytes": 1}]})
    _roll_up_until_done()
    ingest_gpu_batch(node, {"source": "a", "seq": 1, "samples": [
        {"gpu": 1, "at": start.timestamp() + 2, "util_pct": 30.0, "mem_used_bytes": 1}]})
    rollups.roll_up()
    row = GpuMinute.objects.get(node=node, gpu_index=1, bucket=start)
    assert (row.samples, row.util_mean_pct) == (2, 20.0)


def test_hour_rollup_waits_for_the_hour_to_close_then_aggregates_raw(node):
    start = _minute_ago(30)
    samples = [{"gpu": 2, "at": start.timestamp() + 10 * i, "util_pct": float(i % 100), "mem_used_bytes": 7}
               for i in range(150)]
    ingest_gpu_batch(node, {"source": "a", "seq": 0, "samples": samples})
    _roll_up_until_done()
    _roll_up_until_done(datetime.now(UTC) + timedelta(hours=2))
    hours = list(GpuHour.objects.filter(node=node, gpu_index=2).order_by("bucket"))
    assert sum(h.samples for h in hours) == 150
    total = sum(h.util_mean_pct * h.samples for h in hours)
    assert total == pytest.approx(sum(float(i % 100) for i in range(150)), rel=1e-5)
    assert max(h.util_max_pct for h in hours) == 99.0


def test_step_minute_rollup_averages_over_ranks(node, make_job):
    job = make_job()
    start = _minute_ago(3)
    records = [{"job": job.pk, "rank": rank, "step": step, "at": start.timestamp() + step, "step_s": 1.0 + rank,
                "tokens": {"text": 100}} for rank in range(4) for step in range(10)]
    ingest_step_batch(node, {"source": "s", "seq": 0, "samples": records})
    _roll_up_until_done()
    row = StepMinute.objects.get(job=job, bucket=start)
    assert (row.records, row.ranks, row.step_max, row.tokens_text_sum) == (40, 4, 9, 4000)
    assert (row.step_s_mean, row.step_s_max) == (pytest.approx(2.5), 4.0)


def test_step_series_reads_token_means_from_rollups(node, make_job):
    from telemetry import queries

    job = make_job()
    start = _minute_ago(3)
    records = [{"job": job.pk, "rank": rank, "step": step, "at": start.timestamp() + step, "step_s": 1.0,
                "tokens": {"text": 100, "image": 10 * rank}} for rank in range(2) for step in range(30)]
    ingest_step_batch(node, {"source": "s", "seq": 0, "samples": records})
    _roll_up_until_done()
    end = datetime.now(UTC)
    result = queries.step_series(job.pk, start=end - timedelta(days=3), end=end, max_points=2000,
                                 metrics=("tokens_text", "tokens_image"))
    assert result["level"] == "minute"
    trace = result["traces"]["job"]
    assert sum(trace["samples"]) == 60
    assert set(trace["tokens_text"]) == {100.0}
    assert set(trace["tokens_image"]) == {5.0}

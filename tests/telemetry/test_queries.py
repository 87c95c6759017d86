"""Downsampled queries: level choice, at most N points per trace, values that match the data."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from jobs import actions
from telemetry import queries, rollups
from telemetry.ingest import ingest_gpu_batch, ingest_step_batch

NOW = datetime(2026, 6, 15, 12, 0, 7, tzinfo=UTC)


@pytest.mark.parametrize(
    ("span", "level", "bucket_s"),
    [
        (timedelta(minutes=10), "raw", 1),
        (timedelta(hours=1), "raw", 2),
        (timedelta(hours=20), "raw", 36),
        (timedelta(days=2), "minute", 120),
        (timedelta(days=7), "minute", 360),
        (timedelta(days=60), "hour", 3600),
        (timedelta(days=400), "hour", 18000),
    ],
)
def test_plan_picks_the_cheapest_level_that_resolves_the_range(span, level, bucket_s, settings):
    plan = queries.choose_plan(NOW - span, NOW, 2000, now=NOW)
    assert (plan.level, plan.bucket_s) == (level, bucket_s)


@pytest.mark.parametrize(
    ("gpus", "span", "level"),
    [
        (8, timedelta(days=7), "minute"),
        (64, timedelta(days=7), "hour"),
        (64, timedelta(hours=1), "raw"),
        (64, timedelta(hours=2), "minute"),
        (10_000, timedelta(minutes=20), "minute"),
    ],
)
def test_plan_keeps_the_rows_scanned_within_budget(gpus, span, level):
    assert queries.choose_plan(NOW - span, NOW, 2000, now=NOW, traces=gpus).level == level


@pytest.mark.parametrize("max_points", [1, 7, 100, 2000])
@pytest.mark.parametrize("span_s", [5, 61, 3599, 86_400, 7 * 86_400 + 13, 45 * 86_400])
def test_plan_never_allows_more_than_max_points(max_points, span_s):
    start = NOW - timedelta(seconds=span_s)
    plan = queries.choose_plan(start, NOW, max_points, now=NOW)
    bins = math.ceil((NOW.timestamp() - plan.origin_s) / plan.bucket_s)
    assert bins <= max_points
    assert plan.origin_s <= start.timestamp()


@pytest.mark.django_db
def test_raw_series_are_bucketed_means_within_the_point_budget(node):
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
    util = np.random.default_rng(1).uniform(0, 100, size=(600, 2))
    samples = [{"gpu": g, "at": start.timestamp() + s, "util_pct": float(util[s, g]), "mem_used_bytes": 1}
               for s in range(600) for g in range(2)]
    ingest_gpu_batch(node, {"source": "q", "seq": 0, "samples": samples})
    result = queries.gpu_utilisation_series(start=start, end=start + timedelta(minutes=10), max_points=30,
                                            node_ids=[node.pk])
    assert result["level"] == "raw"
    assert set(result["traces"]) == {f"{node.name}/0", f"{node.name}/1"}
    trace = result["traces"][f"{node.name}/1"]
    assert len(trace["t"]) <= 30
    assert sum(trace["samples"]) == 600
    width = result["bucket_s"]
    first = [u for s, u in enumerate(util[:, 1]) if start.timestamp() + s < trace["t"][0] + width]
    assert trace["util_pct"][0] == pytest.approx(np.mean(np.float32(first)), rel=1e-5)
    assert trace["util_max_pct"][0] == pytest.approx(np.max(np.float32(first)))


@pytest.mark.django_db
def test_rollup_levels_merge_with_the_fresh_raw_tail(node):
    # The late sample (one second ago) must fall in the current, not yet rolled-up minute.
    if datetime.now(UTC).second < 2:
        time.sleep(2.1)
    start = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=5)
    samples = [{"gpu": 0, "at": start.timestamp() + s, "util_pct": 40.0 + (s % 2) * 20, "mem_used_bytes": 1}
               for s in range(290)]
    ingest_gpu_batch(node, {"source": "q", "seq": 0, "samples": samples})
    for _ in range(6):
        rollups.roll_up()
    # Samples after the rollup ran: only in raw, still in the chart.
    late = [{"gpu": 0, "at": datetime.now(UTC).timestamp() - 1, "util_pct": 100.0, "mem_used_bytes": 1}]
    ingest_gpu_batch(node, {"source": "q", "seq": 1, "samples": late})
    end = datetime.now(UTC) + timedelta(seconds=1)
    result = queries.gpu_utilisation_series(start=end - timedelta(days=2), end=end, max_points=2000)
    assert result["level"] == "minute"
    trace = result["traces"][f"{node.name}/0"]
    assert sum(trace["samples"]) == 291
    assert len(trace["t"]) <= 2000
    mean = sum(u * n for u, n in zip(trace["util_pct"], trace["samples"], strict=True)) / 291
    assert mean == pytest.approx((290 * 50.0 - 10 * 0 + 100.0) / 291, abs=0.1)
    cluster = queries.cluster_utilisation(start=end - timedelta(days=2), end=end, max_points=50)
    assert len(cluster["traces"]["cluster"]["t"]) <= 50
    assert sum(cluster["traces"]["cluster"]["samples"]) == 291


@pytest.mark.django_db
def test_job_series_cover_the_gpus_it_holds_and_its_steps(node, make_job):
    job = make_job(dp=2, dp_min=1, dp_max=2)
    actions.place_job(job, [(node, 0), (node, 1)], actor="test", reason={"rule": "test", "text": "test"},
                      since=datetime.now(UTC) - timedelta(minutes=1))
    now = datetime.now(UTC).timestamp()
    ingest_gpu_batch(node, {"source": "q", "seq": 0, "samples": [
        {"gpu": g, "at": now - 5, "util_pct": 90.0, "mem_used_bytes": 1} for g in range(4)]})
    ingest_step_batch(node, {"source": "s", "seq": 0, "samples": [
        {"job": job.pk, "rank": r, "step": 3, "at": now - 2, "step_s": 0.5 + r, "loss": 2.0} for r in range(2)]})
    start, end = datetime.fromtimestamp(now - 60, UTC), datetime.fromtimestamp(now + 1, UTC)
    gpus = queries.gpu_utilisation_series(start=start, end=end, max_points=10, job_id=job.pk)
    assert sorted(gpus["traces"]) == [f"{node.name}/0", f"{node.name}/1"]
    steps = queries.step_series(job.pk, start=start, end=end, max_points=10)
    trace = steps["traces"]["job"]
    assert (trace["step"], trace["step_s"], trace["step_s_max"], trace["loss"]) == ([3.0], [1.0], [1.5], [2.0])
    tokens = queries.step_series(job.pk, start=start, end=end, max_points=10, metrics=("tokens_text",))
    assert tokens["traces"]["job"]["tokens_text"] == [None]  # no token counts were sent
    # The job page draws no tokens chart of zeros for them: it says it has none.
    from jobs.live_data import job_series

    series = job_series(job, start, end)
    assert series["step"]["t"] and series["tokens"]["t"] == []
    ingest_step_batch(node, {"source": "s", "seq": 1, "samples": [
        {"job": job.pk, "rank": 0, "step": 4, "at": now - 1, "step_s": 0.5, "tokens": {"text": 900}}]})
    assert job_series(job, start, end)["tokens"]["text"][-1] == 900.0
    latest = queries.latest_gpu_samples(node_ids=[node.pk])
    assert latest[(node.pk, 3)]["util_pct"] == 90.0


@pytest.mark.django_db
def test_rollup_read_at_its_own_resolution_gives_one_point_per_bucket(node):
    start = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=4)
    samples = [{"gpu": 5, "at": start.timestamp() + s, "util_pct": float(s // 60 * 10), "mem_used_bytes": 1}
               for s in range(180)]
    ingest_gpu_batch(node, {"source": "q", "seq": 0, "samples": samples})
    for _ in range(6):
        rollups.roll_up()
    end = start + timedelta(minutes=5)
    result = queries.gpu_utilisation_series(start=end - timedelta(hours=20), end=end, max_points=1200,
                                            gpus=[(node.pk, 5)])
    assert (result["level"], result["bucket_s"]) == ("minute", 60)
    trace = result["traces"][f"{node.name}/5"]
    assert trace["samples"] == [60, 60, 60]
    assert trace["util_pct"] == [0.0, 10.0, 20.0]
    assert trace["t"] == [start.timestamp() + 60 * i for i in range(3)]


@pytest.mark.django_db
def test_cluster_chart_skips_a_raw_tail_too_large_for_the_row_budget(node):
    from jobs.models import Node

    now = datetime.now(UTC)
    ingest_gpu_batch(node, {"source": "q", "seq": 0, "samples": [
        {"gpu": 0, "at": now.timestamp() - 30, "util_pct": 50.0, "mem_used_bytes": 1}]})
    start = now - timedelta(minutes=10)
    small = queries.cluster_utilisation(start=start, end=now, max_points=10)
    assert sum(small["traces"]["cluster"]["samples"]) == 1  # 8 GPUs: the raw tail is cheap, read
    Node.objects.create(name="huge", rack="r9", switch="r9s0", gpu_count=30_000)
    big = queries.cluster_utilisation(start=start, end=now, max_points=10)
    assert big["traces"] == {}  # 30,008 GPUs: even the 1-minute tail would exceed the budget, skipped

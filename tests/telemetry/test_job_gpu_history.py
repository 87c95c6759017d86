"""A job's GPU charts show the GPUs it held over the time it held them, never another job's
readings of the same GPU, on raw data and on rollups alike; its live frames carry only the GPUs
it holds now."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from jobs import actions, live
from jobs.live import job_group
from jobs.live_data import job_series
from jobs.models import Allocation
from telemetry import queries, rollups
from telemetry.ingest import forget_allocations, ingest_gpu_batch
from tests.layer import receive, received_within
from tests.telemetry.conftest import gpu_batch

pytestmark = pytest.mark.django_db


def _readings(node, gpu: int, start: datetime, seconds: int, util_pct: float, seq: int) -> None:
    """One reading a second of one GPU, from ``start`` for ``seconds``."""
    samples = [{"gpu": gpu, "at": start.timestamp() + s, "util_pct": util_pct, "mem_used_bytes": 1}
               for s in range(seconds)]
    ingest_gpu_batch(node, {"source": f"gpu{gpu}", "seq": seq, "samples": samples})


def _handover(node, make_job, researcher):
    """GPU 0 of ``node``: job A for ten minutes (at 10 %), then job B for ten minutes (at 90 %),
    the hand-over in the middle of a minute, all in the past."""
    handover = datetime.now(UTC).replace(second=30, microsecond=0) - timedelta(minutes=20)
    first, second = make_job(dp=1, dp_min=1, dp_max=1), make_job(dp=1, dp_min=1, dp_max=1)
    actions.place_job(first, [(node, 0)], actor="test", reason={}, since=handover - timedelta(minutes=10))
    Allocation.objects.filter(job=first).release(at=handover)
    actions.place_job(second, [(node, 0)], actor="test", reason={}, since=handover)
    _readings(node, 0, handover - timedelta(minutes=10), 600, 10.0, seq=0)
    _readings(node, 0, handover, 600, 90.0, seq=1)
    return first, second


def _only(trace: dict, util_pct: float, samples: int) -> None:
    assert sum(trace["samples"]) == samples
    assert {round(u, 3) for u in trace["util_pct"]} == {util_pct}


def test_a_gpu_handed_over_shows_each_job_only_its_own_readings(node, make_job, researcher):
    first, second = _handover(node, make_job, researcher)
    end = datetime.now(UTC)
    for job, util in ((first, 10.0), (second, 90.0)):
        result = queries.gpu_utilisation_series(start=end - timedelta(hours=1), end=end, max_points=600, job_id=job.pk)
        assert result["level"] == "raw"
        assert list(result["traces"]) == [f"{node.name}/0"]
        _only(result["traces"][f"{node.name}/0"], util, 600)
    # The job page's own series (jobs.live_data, what the chart draws) says the same.
    page = job_series(second, end - timedelta(hours=1), end)
    assert set(page["gpus"][f"{node.name}/0"]["util"]) == {90.0}


def test_rollups_never_mix_the_previous_holders_readings_into_a_bucket(node, make_job, researcher):
    first, second = _handover(node, make_job, researcher)
    for _ in range(6):
        rollups.roll_up()
    end = datetime.now(UTC).replace(second=0, microsecond=0)
    for job, util in ((first, 10.0), (second, 90.0)):
        # 20 h in 1,200 points: one-minute rollups, read as they are; the hand-over minute is
        # half A's and half B's, so it comes from raw samples instead.
        result = queries.gpu_utilisation_series(start=end - timedelta(hours=20), end=end, max_points=1200,
                                                job_id=job.pk)
        assert (result["level"], result["bucket_s"]) == ("minute", 60)
        _only(result["traces"][f"{node.name}/0"], util, 600)
        # A week from hourly rollups: the job's ten minutes are no whole hour, so they come from
        # the finer levels, still only the job's own readings.
        week = queries.gpu_utilisation_series(start=end - timedelta(days=7), end=end, max_points=100, job_id=job.pk)
        assert week["level"] == "hour"
        _only(week["traces"][f"{node.name}/0"], util, 600)
    # The node's own chart still shows both.
    whole = queries.gpu_utilisation_series(start=end - timedelta(hours=20), end=end, max_points=1200,
                                           gpus=[(node.pk, 0)])
    assert sum(whole["traces"][f"{node.name}/0"]["samples"]) == 1200


def test_a_job_that_moved_shows_the_first_node_then_the_second(make_nodes, make_job):
    x, y = make_nodes(racks=1, switches=1, nodes=2, gpus=8)
    job = make_job(dp=1, dp_min=1, dp_max=1)
    moved = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
    actions.place_job(job, [(x, 0)], actor="test", reason={}, since=moved - timedelta(minutes=10))
    Allocation.objects.filter(job=job).release(at=moved)
    Allocation.objects.create(job=job, node=y, gpu_index=0, since=moved)  # as a migration's pass writes it
    for seq, node in enumerate((x, y)):  # both GPUs report all along
        _readings(node, 0, moved - timedelta(minutes=15), 1500, 50.0, seq=seq)
    end = datetime.now(UTC)
    result = queries.gpu_utilisation_series(start=end - timedelta(hours=1), end=end, max_points=4000,
                                            job_id=job.pk)
    assert result["bucket_s"] == 1
    before, after = result["traces"][f"{x.name}/0"], result["traces"][f"{y.name}/0"]
    assert (min(before["t"]), max(before["t"]) + 1) == (moved.timestamp() - 600, moved.timestamp())
    assert (min(after["t"]), max(after["t"]) + 1) == (moved.timestamp(), moved.timestamp() + 600)


def test_a_job_that_never_held_a_gpu_has_no_gpu_series(node, make_job):
    job = make_job()
    _readings(node, 0, datetime.now(UTC) - timedelta(minutes=5), 60, 50.0, seq=0)
    end = datetime.now(UTC)
    result = queries.gpu_utilisation_series(start=end - timedelta(hours=1), end=end, job_id=job.pk)
    assert result["traces"] == {}


def test_live_frames_reach_only_the_job_that_holds_the_gpu_now(node, make_job, researcher,
                                                               django_capture_on_commit_callbacks):
    first, second = make_job(dp=1, dp_min=1, dp_max=1), make_job(dp=1, dp_min=1, dp_max=1)
    actions.place_job(first, [(node, 0)], actor="test", reason={})
    actions.cancel_job(first, researcher)
    actions.place_job(second, [(node, 0)], actor="test", reason={})
    forget_allocations()
    layer = get_channel_layer()
    channels = {}
    for job in (first, second):
        channels[job.pk] = async_to_sync(layer.new_channel)()
        async_to_sync(layer.group_add)(job_group(job.pk), channels[job.pk])
    with django_capture_on_commit_callbacks(execute=True):
        ingest_gpu_batch(node, gpu_batch(seq=0, samples=8, start_s=datetime.now(UTC).timestamp()))
    live.wait_sent()
    (message,) = receive(layer, channels[second.pk])["messages"]  # a jobs.live batch
    assert message["payload"]["job"] == second.pk
    assert [p["gpu"] for p in message["payload"]["points"]] == [0]
    assert received_within(layer, channels[first.pk], 0.3) is None


def test_the_console_draws_a_buckets_used_gpus_where_its_readings_were_never_before_them(node, make_job):
    """The console's day is 3-minute buckets: a bucket's mean is drawn when its readings were
    taken on average (a minute rollup counts as read at its middle), never past now, so GPUs read
    from 90 s into a bucket appear neither at its start nor at its middle, before any job held
    them."""
    from jobs.live_data import MAX_POINTS_PER_TRACE, utilisation_series

    now = datetime.now(UTC)
    since = now - timedelta(hours=24)
    plan = queries.choose_plan(since, now, MAX_POINTS_PER_TRACE, traces=node.gpu_count)
    assert (plan.level, plan.bucket_s) == ("minute", 180)
    back = now.timestamp() - 2 * plan.bucket_s  # a whole bucket before the one now is in
    bucket_start = datetime.fromtimestamp(plan.origin_s + (back - plan.origin_s) // plan.bucket_s * plan.bucket_s, UTC)
    first_reading = bucket_start + timedelta(seconds=90)
    _readings(node, 0, first_reading, 90, 50.0, seq=0)
    for _ in range(6):
        rollups.roll_up()
    series = utilisation_series(since, now)
    times_s = [t / 1000.0 for t in series["used_t"]]
    assert times_s, series
    # Readings 90-179 s into the bucket: 30 of them in the minute from 60 s (its middle 90 s), 60 in
    # the one from 120 s (middle 150 s): drawn at 130 s, where the middle of the bucket is 90 s.
    assert times_s[0] == pytest.approx(bucket_start.timestamp() + 130, abs=1e-3)
    assert all(first_reading.timestamp() <= t <= now.timestamp() for t in times_s), times_s


def test_a_raw_bucket_is_drawn_at_its_readings_mean_time_and_a_merged_one_at_both_parts(node):
    """Raw readings give each bucket the mean of their own times; a bucket read partly from a
    rollup and partly from the raw tail after its watermark weighs each part by its readings."""
    now = datetime.now(UTC).replace(microsecond=0)
    start = now - timedelta(minutes=10)
    plan = queries.choose_plan(start, now, 20, traces=node.gpu_count)
    assert (plan.level, plan.bucket_s) == ("raw", 30)
    bucket_start = plan.origin_s + ((start.timestamp() - plan.origin_s) // 30 + 2) * 30
    # 20 readings from the bucket's 5th second: their mean time is 14.5 s into it (the middle: 15 s)
    _readings(node, 0, datetime.fromtimestamp(bucket_start + 5, UTC), 20, 50.0, seq=0)
    trace = queries.cluster_utilisation(start=start, end=now, max_points=20)["traces"]["cluster"]
    assert trace["t"] == [bucket_start] and trace["samples"] == [20]
    assert trace["t_mean"][0] == pytest.approx(bucket_start + 14.5, abs=1e-3)

    head = queries._Trace(np.array([0, 1]), np.array([30.0, 60.0]), {}, np.array([10.0, 70.0]))
    tail = queries._Trace(np.array([1]), np.array([20.0]), {}, np.array([110.0]))
    merged = queries._merge(head, tail, {})
    assert merged.times.tolist() == pytest.approx([10.0, (70.0 * 60 + 110.0 * 20) / 80])

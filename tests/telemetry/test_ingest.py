"""Ingestion: whole-batch validation, de-duplication, storage and the live message after commit."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.test import override_settings
from django.utils import timezone

from jobs import actions, live
from jobs.live import job_group, node_group
from telemetry.ingest import BatchRejected, accept_sequence, ingest_gpu_batch, ingest_step_batch
from telemetry.models import GpuSample, StepRecord, TelemetrySource
from tests.layer import receive, received_within
from tests.telemetry.conftest import gpu_batch

pytestmark = pytest.mark.django_db


def test_valid_batch_is_stored_with_its_values(node):
    result = ingest_gpu_batch(node, gpu_batch(samples=16))
    assert (result.accepted, result.duplicate) == (16, False)
    assert GpuSample.objects.filter(node=node).count() == 16
    row = GpuSample.objects.filter(node=node, gpu_index=3).first()
    assert (row.util_pct, row.mem_used_bytes, row.power_w, row.temp_c) == (50.0, 40 * 2**30, 500.0, 60.0)
    source = TelemetrySource.objects.get(node=node, name="agent-test")
    assert (source.batches_total, source.samples_total, source.high_seq) == (1, 16, 0)


def _bad(field_index: int, **change):
    batch = gpu_batch(samples=8)
    batch["samples"][field_index].update(change)
    return batch


def _drop(index: int, field: str):
    batch = gpu_batch(samples=8)
    del batch["samples"][index][field]
    return batch


@pytest.mark.parametrize(
    ("batch", "key", "fragment"),
    [
        (_bad(2, util_pct=100.5), "samples[2].util_pct", "0-100"),
        (_bad(3, util_pct=-1), "samples[3].util_pct", "0-100"),
        (_bad(1, util_pct="50"), "samples[1].util_pct", "expected a number, got str"),
        (_bad(4, gpu=8), "samples[4].gpu", "unknown GPU 8"),
        (_bad(0, gpu=True), "samples[0].gpu", "expected an integer, got bool"),
        (_bad(5, at=time.time() + 3600), "samples[5].at", "in the future"),
        (_bad(6, at=time.time() - 3 * 86400), "samples[6].at", "older than the raw retention"),
        (_bad(7, at="2026-01-01T00:00:00"), "samples[7].at", "needs a timezone"),
        (_bad(2, mem_used_bytes=1.5), "samples[2].mem_used_bytes", "expected an integer"),
        (_bad(2, temp_c=float("nan")), "samples[2].temp_c", "not finite"),
        (_bad(1, colour="red"), "samples[1].colour", "unknown field"),
        (_drop(3, "util_pct"), "samples[3].util_pct", "required"),
        ({"source": "x", "seq": 0, "samples": [1, 2]}, "samples[0]", "expected an object"),
        ({"source": "x", "seq": -1, "samples": gpu_batch()["samples"]}, "seq", "non-negative"),
        ({"seq": 0, "samples": gpu_batch()["samples"]}, "source", "required"),
        ({"source": "x", "seq": 0, "samples": []}, "samples", "at least one"),
        ({"source": "x", "seq": 0, "samples": {}}, "samples", "expected a list"),
    ],
)
def test_bad_batch_is_rejected_whole_naming_sample_and_field(node, batch, key, fragment):
    with pytest.raises(BatchRejected) as caught:
        ingest_gpu_batch(node, batch)
    errors = caught.value.message_dict
    assert key in errors, errors
    assert any(fragment in message for message in errors[key]), errors[key]
    assert "nothing was stored" in errors["batch"][0]
    assert GpuSample.objects.count() == 0
    assert not TelemetrySource.objects.exists()


def test_one_bad_sample_among_many_stores_nothing(node):
    batch = gpu_batch(samples=400)
    batch["samples"][399]["util_pct"] = 250.0
    with pytest.raises(BatchRejected) as caught:
        ingest_gpu_batch(node, batch)
    assert list(caught.value.message_dict) == ["samples[399].util_pct", "batch"]
    assert "1 of 400 samples invalid" in caught.value.message_dict["batch"][0]
    assert GpuSample.objects.count() == 0


@override_settings(OMNI_TELEMETRY_MAX_BATCH=10)
def test_oversized_batch_is_rejected(node):
    with pytest.raises(BatchRejected) as caught:
        ingest_gpu_batch(node, gpu_batch(samples=11))
    assert "oversized batch: 11 samples, at most 10" in caught.value.message_dict["samples"][0]


def test_two_readings_of_one_gpu_at_one_time_are_rejected(node):
    batch = gpu_batch(samples=8)
    batch["samples"].append(dict(batch["samples"][2]))
    with pytest.raises(BatchRejected) as caught:
        ingest_gpu_batch(node, batch)
    assert caught.value.message_dict["samples[8].at"] == ["duplicate of samples[2] (same key and time)"]


def test_resent_batch_is_recognised_and_not_stored_twice(node):
    batch = gpu_batch(seq=7, samples=16)
    assert ingest_gpu_batch(node, batch).accepted == 16
    again = ingest_gpu_batch(node, batch)
    assert (again.accepted, again.duplicate) == (0, True)
    assert GpuSample.objects.count() == 16
    assert TelemetrySource.objects.get().duplicates_total == 1


def test_batches_out_of_order_are_each_stored_once(node):
    start = time.time() - 100
    for seq in (5, 3, 4, 3, 5):
        ingest_gpu_batch(node, gpu_batch(seq=seq, samples=8, start_s=start + seq))
    assert GpuSample.objects.count() == 24
    assert TelemetrySource.objects.get().duplicates_total == 2


def test_sequence_far_behind_the_window_is_refused():
    assert accept_sequence(-1, 0, 0) == (True, 0, 1)
    assert accept_sequence(2000, 1, 1999)[0] is True
    with pytest.raises(BatchRejected) as caught:
        accept_sequence(5000, 1, 10)
    assert "new source id" in caught.value.message_dict["seq"][0]


def test_rows_already_stored_under_another_source_are_skipped(node):
    batch = gpu_batch(seq=0, samples=16)
    ingest_gpu_batch(node, batch)
    restarted = dict(batch, source="agent-test-restarted")
    restarted["samples"] = batch["samples"] + gpu_batch(samples=8, start_s=time.time() - 1)["samples"]
    assert ingest_gpu_batch(node, restarted).accepted == 24
    assert GpuSample.objects.count() == 24


def test_step_batch_is_stored_and_unknown_job_rejected(node, make_job):
    job = make_job()
    now = time.time()
    records = [
        {"job": job.pk, "rank": rank, "step": 10, "at": now - 1, "step_s": 1.2, "data_wait_s": 0.1,
         "compute_s": 0.9, "comm_s": 0.2, "tokens": {"text": 4096, "image": 1024}, "loss": 2.5}
        for rank in range(4)
    ]
    assert ingest_step_batch(node, {"source": "steps", "seq": 0, "samples": records}).accepted == 4
    stored = StepRecord.objects.get(job=job, rank=2)
    assert (stored.tokens_text, stored.tokens_image, stored.tokens_video, stored.node_id) == (4096, 1024, None, node.pk)
    bad = [dict(records[0], job=job.pk + 999), dict(records[1], tokens={"smell": 3})]
    with pytest.raises(BatchRejected) as caught:
        ingest_step_batch(node, {"source": "steps", "seq": 1, "samples": bad})
    assert caught.value.message_dict["samples[0].job"] == [f"unknown job {job.pk + 999}"]
    assert "unknown modality" in caught.value.message_dict["samples[1].tokens.smell"][0]
    assert StepRecord.objects.count() == 4


def test_live_message_follows_commit_with_the_new_points_and_is_throttled(
    node, make_job, django_capture_on_commit_callbacks
):
    job = make_job(dp=2, dp_min=1, dp_max=2)
    actions.place_job(job, [(node, 0), (node, 1)], actor="test", reason={"rule": "test", "text": "test"},
                      since=timezone.now() - timedelta(minutes=1))
    layer = get_channel_layer()
    node_channel = async_to_sync(layer.new_channel)()
    job_channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(node_group(node.pk), node_channel)
    async_to_sync(layer.group_add)(job_group(job.pk), job_channel)
    with django_capture_on_commit_callbacks(execute=True):
        ingest_gpu_batch(node, gpu_batch(seq=0, samples=8))
    assert live.wait_sent()
    (message,) = receive(layer, node_channel)["messages"]
    assert message["event"] == "gpu_samples"
    assert message["payload"]["node"] == node.pk
    assert sorted(p["gpu"] for p in message["payload"]["points"]) == list(range(8))
    assert set(message["payload"]["points"][0]) == {"gpu", "at", "util_pct", "mem_used_bytes", "power_w",
                                                    "temp_c", "xid_errors"}
    (for_job,) = receive(layer, job_channel)["messages"]
    assert for_job["payload"]["job"] == job.pk
    assert sorted(p["gpu"] for p in for_job["payload"]["points"]) == [0, 1]
    # A second batch within the throttle interval is held back, to ride along with the next.
    with django_capture_on_commit_callbacks(execute=True):
        ingest_gpu_batch(node, gpu_batch(seq=1, samples=8, start_s=time.time() - 50))
    from telemetry.ingest import throttle

    assert sum(len(chunk) for chunk in throttle._pending[f"gpu:{node.pk}"]) == 8
    # With no next batch in time, they go out by themselves at the interval's end.
    deadline = time.monotonic() + 5
    while not throttle.idle() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert live.wait_sent()
    (held,) = receive(layer, node_channel)["messages"]
    assert held["event"] == "gpu_samples" and len(held["payload"]["points"]) == 8
    assert f"gpu:{node.pk}" not in throttle._pending


def test_points_from_before_a_job_took_its_gpu_never_reach_its_page(node, make_job,
                                                                   django_capture_on_commit_callbacks):
    job = make_job(dp=2, dp_min=1, dp_max=2)
    actions.place_job(job, [(node, 0), (node, 1)], actor="test", reason={"rule": "test", "text": "test"})
    layer = get_channel_layer()
    job_channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(job_group(job.pk), job_channel)
    # Samples of the last minute, before the placement: the previous holder's, not this job's.
    with django_capture_on_commit_callbacks(execute=True):
        ingest_gpu_batch(node, gpu_batch(seq=0, samples=16, start_s=time.time() - 60))
    assert live.wait_sent()
    assert received_within(layer, job_channel, 0.3) is None


def test_step_records_reach_the_job_page_with_tokens(node, make_job, django_capture_on_commit_callbacks):
    job = make_job()
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(job_group(job.pk), channel)
    record = {"job": job.pk, "rank": 0, "step": 5, "at": time.time() - 1, "step_s": 1.5,
              "tokens": {"text": 10, "video": 20}, "loss": 1.25}
    with django_capture_on_commit_callbacks(execute=True):
        ingest_step_batch(node, {"source": "steps", "seq": 0, "samples": [record]})
    assert live.wait_sent()
    (message,) = receive(layer, channel)["messages"]
    assert message["event"] == "step_records"
    (point,) = message["payload"]["points"]
    assert (point["step"], point["step_s"], point["loss"], point["tokens"]) == (5, 1.5, 1.25, {"text": 10, "video": 20})


def test_source_state_known_to_this_process_is_checked_not_trusted(node, django_capture_on_commit_callbacks):
    start = time.time() - 200
    with django_capture_on_commit_callbacks(execute=True):
        ingest_gpu_batch(node, gpu_batch(seq=0, samples=8, start_s=start))
    with django_capture_on_commit_callbacks(execute=True):
        ingest_gpu_batch(node, gpu_batch(seq=1, samples=8, start_s=start + 1))
    source = TelemetrySource.objects.get()
    assert (source.high_seq, source.batches_total, source.samples_total) == (1, 2, 16)
    # Another process stores seq 5 behind this one's back: the guess is stale and must lose.
    TelemetrySource.objects.filter(pk=source.pk).update(high_seq=5, window=(0b110001).to_bytes(128, "big"))
    with django_capture_on_commit_callbacks(execute=True):
        ingest_gpu_batch(node, gpu_batch(seq=2, samples=8, start_s=start + 2))
    source.refresh_from_db()
    assert (source.high_seq, source.batches_total) == (5, 3)
    assert int.from_bytes(bytes(source.window), "big") == 0b111001
    assert ingest_gpu_batch(node, gpu_batch(seq=1, samples=8, start_s=start + 1)).duplicate
    assert GpuSample.objects.count() == 24


def test_the_live_stage_hears_of_a_stored_batch_once_and_only_after_commit(
    node, monkeypatch, django_capture_on_commit_callbacks
):
    from telemetry.ingest import store

    heard: list[tuple[str, int, int]] = []
    monkeypatch.setattr(store, "send_live", lambda kind, node, rows: heard.append((str(kind), node.pk, len(rows))))
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        ingest_gpu_batch(node, gpu_batch(seq=0, samples=8))
    assert heard == []
    for callback in callbacks:
        callback()
    assert heard == [("gpu", node.pk, 8)]
    with django_capture_on_commit_callbacks(execute=True):
        assert ingest_gpu_batch(node, gpu_batch(seq=0, samples=8)).duplicate
    assert heard == [("gpu", node.pk, 8)]

"""jobs.actions.logs: a node's log lines stored once, only for runs it ran, sent live after
commit to the job's page, and pruned after the retention period."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs import actions, live
from jobs.actions.logs import MAX_LIVE_LINES, LogsRefused
from jobs.models import Allocation, Job, JobLogLine
from omniweb.scheduled import PERIODIC_TASKS
from trainer_agent import protocol
from trainer_agent.protocol import ProtocolError

pytestmark = pytest.mark.django_db


def logs_frame(job: str = "trains", run_id: str = "run-1", *chunks: dict, ship: int = 1) -> dict:
    return {"type": "logs", "job": job, "run_id": run_id, "ship": ship, "chunks": list(chunks)}


def chunk(lines: list[str], rank: int = 0, stream: str = "out", offset: int = 0, **extra) -> dict:
    return {"rank": rank, "stream": stream, "offset": offset, "lines": lines,
            "sizes": [len(line.encode()) + 1 for line in lines], "at": time.time(), **extra}


@pytest.fixture
def flushes(monkeypatch):
    sent: list[dict[str, list[dict]]] = []
    monkeypatch.setattr(live._sender, "submit", lambda layer, batches: sent.append(batches))
    return sent


@pytest.fixture
def running(make_job, make_nodes):
    """A job running on the first of two nodes in run ``run-1``."""
    nodes = make_nodes(racks=1, switches=1, nodes=2, gpus=4)
    job = actions.place_job(make_job(name="trains", dp=2), [(nodes[0], 0), (nodes[0], 1)], actor="planner",
                            reason={"rule": "place", "text": "Placed.", "inputs": {}})
    Job.objects.filter(pk=job.pk).update(run_id="run-1")
    job.refresh_from_db()
    return job, nodes


def test_lines_are_stored_with_their_offsets_and_node(running):
    job, nodes = running
    frame = logs_frame("trains", "run-1", chunk(["hello", "wörld"]), chunk(["oops"], rank=1, stream="err"))
    assert actions.record_log_lines(nodes[0], frame) == 3
    rows = list(JobLogLine.objects.order_by("id").values_list("run_id", "node", "rank", "stream", "offset", "text"))
    assert rows == [("run-1", nodes[0].name, 0, "out", 0, "hello"), ("run-1", nodes[0].name, 0, "out", 6, "wörld"),
                    ("run-1", nodes[0].name, 1, "err", 0, "oops")]


def test_a_chunk_sent_again_is_stored_once(running):
    job, nodes = running
    actions.record_log_lines(nodes[0], logs_frame("trains", "run-1", chunk(["a", "b"])))
    # After a reconnect the agent re-sends from its acknowledged offset, with more lines behind.
    assert actions.record_log_lines(nodes[0], logs_frame("trains", "run-1", chunk(["a", "b", "c"]), ship=2)) == 1
    assert list(JobLogLine.objects.order_by("offset").values_list("text", flat=True)) == ["a", "b", "c"]
    assert actions.record_log_lines(nodes[0], logs_frame("trains", "run-1", chunk(["a", "b", "c"]), ship=3)) == 0


def test_new_lines_go_to_the_jobs_group_after_commit_with_their_ids(running, flushes,
                                                                    django_capture_on_commit_callbacks):
    job, nodes = running
    with django_capture_on_commit_callbacks(execute=True):
        actions.record_log_lines(nodes[0], logs_frame("trains", "run-1", chunk(["one", "two"])))
        assert flushes == []
    [batch] = flushes
    [message] = batch[f"job-{job.pk}"]
    assert message["event"] == "job_logs"
    payload = message["payload"]
    ids = list(JobLogLine.objects.order_by("id").values_list("id", flat=True))
    assert payload["job"] == job.pk and payload["node"] == nodes[0].name and payload["skipped"] == 0
    assert [(line["id"], line["rank"], line["stream"], line["text"]) for line in payload["lines"]] == [
        (ids[0], 0, "out", "one"), (ids[1], 0, "out", "two")]
    with django_capture_on_commit_callbacks(execute=True):  # a re-sent chunk: nothing new, nothing sent
        actions.record_log_lines(nodes[0], logs_frame("trains", "run-1", chunk(["one", "two"]), ship=2))
    assert len(flushes) == 1


def test_a_burst_sends_its_newest_lines_live_and_says_how_many_it_left_out(running, flushes,
                                                                           django_capture_on_commit_callbacks):
    job, nodes = running
    lines = [f"line {i}" for i in range(MAX_LIVE_LINES + 20)]
    offsets = [sum(len(x) + 1 for x in lines[:i]) for i in range(len(lines))]
    with django_capture_on_commit_callbacks(execute=True):
        actions.record_log_lines(nodes[0], logs_frame("trains", "run-1", chunk(lines)))
    payload = flushes[0][f"job-{job.pk}"][0]["payload"]
    assert payload["skipped"] == 20 and len(payload["lines"]) == MAX_LIVE_LINES
    assert payload["lines"][-1]["text"] == lines[-1]
    assert JobLogLine.objects.filter(offset__in=offsets).count() == len(lines)


def test_storing_a_frame_takes_a_constant_number_of_queries(running):
    job, nodes = running
    big = logs_frame("trains", "run-1", *[chunk([f"r{r} {i}" for i in range(200)], rank=r) for r in range(4)])
    with CaptureQueriesContext(connection) as queries:
        assert actions.record_log_lines(nodes[0], big) == 800
    # the job, the GPUs it held on the node, the lines already stored, the new lines' ids; and the
    # insert (one statement on PostgreSQL, split by SQLite's limit on query parameters)
    statements = [q["sql"] for q in queries if "SAVEPOINT" not in q["sql"]]
    inserts = [sql for sql in statements if sql.startswith("INSERT")]
    assert len(statements) - len(inserts) == 4, statements
    assert inserts and (len(inserts) == 1 or connection.vendor == "sqlite")


def test_the_last_lines_of_a_stopped_run_are_still_taken(running, researcher):
    job, nodes = running
    actions.cancel_job(job, researcher)
    job.refresh_from_db()
    assert job.is_terminal and not job.allocations.exists()
    assert actions.record_log_lines(nodes[0], logs_frame("trains", "run-1", chunk(["Traceback ..."]))) == 1


def test_an_earlier_run_this_node_was_shipping_keeps_its_tail(running):
    job, nodes = running
    actions.record_log_lines(nodes[0], logs_frame("trains", "run-1", chunk(["step 1"])))
    Job.objects.filter(pk=job.pk).update(run_id="run-2")  # relaunched meanwhile
    assert actions.record_log_lines(nodes[0], logs_frame("trains", "run-1", chunk(["saved"], offset=7))) == 1


@pytest.mark.parametrize(("job_name", "run_id", "node_index", "why"), [
    ("trains", "run-1", 1, "did not run"),  # a node that never held the job's GPUs
    ("trains", "run-0", 0, "did not run"),  # a run id that is not the job's
    ("nobody", "run-1", 0, "no job"),
])
def test_lines_for_a_job_or_run_the_node_did_not_run_are_refused(running, job_name, run_id, node_index, why):
    job, nodes = running
    with pytest.raises(LogsRefused, match=why):
        actions.record_log_lines(nodes[node_index], logs_frame(job_name, run_id, chunk(["spoof"])))
    assert not JobLogLine.objects.exists()


def test_a_node_that_held_the_job_only_before_this_run_is_refused(running):
    job, nodes = running
    Allocation.objects.filter(job=job).release()
    # The job's current run began after it left this node (elsewhere, in a later run).
    Job.objects.filter(pk=job.pk).update(started_at=timezone.now() + timedelta(seconds=5))
    with pytest.raises(LogsRefused):
        actions.record_log_lines(nodes[0], logs_frame("trains", "run-1", chunk(["late"])))


@pytest.mark.parametrize(("mutate", "code"), [
    (lambda f: f.pop("ship"), "missing_field"),
    (lambda f: f.update(ship="7"), "bad_field"),
    (lambda f: f.update(run_id=""), "bad_field"),
    (lambda f: f.update(chunks="lines"), "bad_field"),
    (lambda f: f["chunks"].append("nope"), "bad_record"),
    (lambda f: f["chunks"][0].update(stream="both"), "bad_record"),
    (lambda f: f["chunks"][0].update(rank=-1), "bad_record"),
    (lambda f: f["chunks"][0].update(rank=True), "bad_field"),
    (lambda f: f["chunks"][0].update(sizes=[1]), "bad_record"),
    (lambda f: f["chunks"][0].update(sizes=[0, 2]), "bad_record"),
    (lambda f: f["chunks"][0].update(lines=[1, 2]), "bad_record"),
    (lambda f: f["chunks"][0].update(at="noon"), "bad_field"),
    (lambda f: f["chunks"][0].update(lines=["x"] * 2, sizes=[protocol.MAX_LOG_FRAME_BYTES] * 2), "bad_record"),
    (lambda f: f["chunks"][0].update(lines=["x"] * 10, sizes=[protocol.MAX_LOG_LINE_BYTES] * 10), "frame_too_large"),
    (lambda f: f["chunks"][0].update(lines=["x"] * (protocol.MAX_LOG_LINES_PER_FRAME + 1),
                                     sizes=[2] * (protocol.MAX_LOG_LINES_PER_FRAME + 1)), "too_many_records"),
])
def test_malformed_frames_are_refused_with_a_code_and_change_nothing(running, mutate, code):
    job, nodes = running
    frame = logs_frame("trains", "run-1", chunk(["a", "b"]))
    mutate(frame)
    with pytest.raises(ProtocolError) as refused:
        actions.record_log_lines(nodes[0], frame)
    assert refused.value.code == code
    assert not JobLogLine.objects.exists()


def test_a_nul_byte_is_stored_as_a_replacement_character(running):
    job, nodes = running
    actions.record_log_lines(nodes[0], logs_frame("trains", "run-1", chunk(["a\x00b"])))
    assert JobLogLine.objects.get().text == "a\ufffdb"


def test_a_read_time_far_from_the_servers_clock_is_taken_as_the_servers(running):
    job, nodes = running
    actions.record_log_lines(nodes[0], logs_frame("trains", "run-1", chunk(["future"], at=time.time() + 86400),
                                                  chunk(["past"], rank=1, at=0)))
    future, past = JobLogLine.objects.order_by("rank")
    assert future.at <= timezone.now()
    assert past.at >= timezone.now() - timedelta(minutes=6)


def test_pruning_deletes_only_lines_past_the_retention(running, settings, monkeypatch):
    job, nodes = running
    settings.OMNI_LOG_RETENTION_S = 3600
    actions.record_log_lines(nodes[0], logs_frame("trains", "run-1", chunk([f"l{i}" for i in range(30)])))
    old = list(JobLogLine.objects.order_by("id").values_list("id", flat=True)[:25])
    JobLogLine.objects.filter(id__in=old).update(at=timezone.now() - timedelta(hours=2))
    monkeypatch.setattr("jobs.actions.logs.PRUNE_BATCH", 10)  # three batches
    assert actions.prune_logs(timezone.now()) == 25
    assert JobLogLine.objects.count() == 5
    assert actions.prune_logs(timezone.now()) == 0


def test_pruning_is_a_periodic_task_of_beat_and_of_the_embedded_loop(running, settings):
    from omniweb.celery import app
    from omniweb.loop import InProcessLoop

    [task] = [t for t in PERIODIC_TASKS if t.name == "jobs.prune_logs"]
    assert task.interval_s == 3600 and task.expires_s > 0
    assert "jobs.prune_logs" in [t.name for t in InProcessLoop().tasks]
    job, nodes = running
    actions.record_log_lines(nodes[0], logs_frame("trains", "run-1", chunk(["old"])))
    JobLogLine.objects.update(at=timezone.now() - timedelta(days=15))
    app.tasks["jobs.prune_logs"]()  # what beat's worker and the loop both call
    assert not JobLogLine.objects.exists()
    assert settings.OMNI_LOG_RETENTION_S == 14 * 86400

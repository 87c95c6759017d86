"""jobs.live, the one broadcaster: after commit, once per transaction, coalesced, never raising;
and the audit rows of a transaction built together in a constant number of queries."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs import actions, live, live_data, live_events
from jobs.audit import record_event
from jobs.models import EventKind, PlannerControl
from tests.layer import receive


@pytest.fixture
def flushes(monkeypatch):
    """Every flush handed to the channel layer, as {group: [{"event", "payload"}, ...]}."""
    sent: list[dict[str, list[dict]]] = []
    monkeypatch.setattr(live._sender, "submit", lambda layer, batches: sent.append(batches))
    return sent


def events(batches: dict[str, list[dict]]) -> list[tuple[str, str, object]]:
    return [(group, m["event"], m["payload"]) for group, messages in batches.items() for m in messages]


# -- after commit, once ----------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_transaction_sends_nothing_before_commit_and_everything_in_one_flush_after(flushes):
    with transaction.atomic():
        for i in range(5):
            live.send("cluster", "node", {"id": i, "state": "healthy"})
        live.send("audit", "audit", {"id": 99})
        assert flushes == []
    assert len(flushes) == 1
    assert events(flushes[0]) == [("cluster", "node", {"id": i, "state": "healthy"}) for i in range(5)] + [
        ("audit", "audit", {"id": 99})]


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_transaction_sends_nothing_and_the_next_one_only_its_own(flushes):
    with pytest.raises(RuntimeError), transaction.atomic():
        live.send("cluster", "node", {"id": 1, "state": "failed"})
        raise RuntimeError("rolled back")
    assert flushes == []
    with transaction.atomic():
        live.send("cluster", "node", {"id": 2, "state": "healthy"})
    assert [events(batches) for batches in flushes] == [[("cluster", "node", {"id": 2, "state": "healthy"})]]


@pytest.mark.django_db(transaction=True)
def test_a_savepoint_that_rolls_back_takes_its_messages_and_the_rest_go_in_one_flush(flushes):
    with transaction.atomic():
        live.send("audit", "audit", {"id": 1})
        with pytest.raises(RuntimeError), transaction.atomic():
            live.send("audit", "audit", {"id": 2})
            raise RuntimeError("this savepoint rolls back")
        with transaction.atomic():
            live.send("audit", "audit", {"id": 3})
        live.send("audit", "audit", {"id": 4})
    assert len(flushes) == 1
    assert [payload["id"] for _, _, payload in events(flushes[0])] == [1, 3, 4]


@pytest.mark.django_db(transaction=True)
def test_the_first_savepoint_rolling_back_does_not_lose_the_outer_messages(flushes):
    with transaction.atomic():
        with pytest.raises(RuntimeError), transaction.atomic():
            live.send("audit", "audit", {"id": 1})
            raise RuntimeError("the first sender's savepoint rolls back")
        live.send("audit", "audit", {"id": 2})
    assert [[p["id"] for _, _, p in events(batches)] for batches in flushes] == [[2]]


def test_a_flat_transaction_registers_one_on_commit_callback(db, flushes, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True) as callbacks, transaction.atomic():
        for i in range(20):
            live.send(live.job_group(i), "job_event", {"event": {"id": i}})
    assert len(callbacks) == 1
    assert len(flushes) == 1 and len(flushes[0]) == 20


@pytest.mark.django_db(transaction=True)
def test_outside_a_transaction_a_message_goes_at_once(flushes):
    live.send("cluster", "node", {"id": 1})
    assert [events(batches) for batches in flushes] == [[("cluster", "node", {"id": 1})]]


# -- coalescing ---------------------------------------------------------------------------------------------


def test_the_latest_message_about_an_object_replaces_earlier_ones_and_the_rest_keep_their_order():
    batches = live.coalesce([
        live.message("cluster", "job", {"id": 7, "state": "pending"}),
        live.message("cluster", "node", {"id": 1, "state": "healthy"}),
        live.message("job-7", "job_event", {"event": {"id": 10}}),
        live.message("cluster", "job", {"id": 7, "state": "running"}),
        live.message("job-7", "job_event", {"event": {"id": 11}}),
        live.message("node-1", "node", {"id": 1, "state": "healthy"}),  # another group: kept
        live.message("cluster", "cluster_summary", {"queue": [1]}, key="cluster"),
        live.message("cluster", "cluster_summary", {"queue": []}, key="cluster"),
        live.message("cluster", "gpu_samples", {"points": [1]}),  # no id: never coalesced
        live.message("cluster", "gpu_samples", {"points": [2]}),
    ])
    assert list(batches) == ["cluster", "job-7", "node-1"]
    assert batches["cluster"] == [
        {"event": "node", "payload": {"id": 1, "state": "healthy"}},
        {"event": "job", "payload": {"id": 7, "state": "running"}},
        {"event": "cluster_summary", "payload": {"queue": []}},
        {"event": "gpu_samples", "payload": {"points": [1]}},
        {"event": "gpu_samples", "payload": {"points": [2]}},
    ]
    assert [m["payload"]["event"]["id"] for m in batches["job-7"]] == [10, 11]


@pytest.mark.django_db(transaction=True)
def test_a_builder_runs_once_per_transaction_with_every_item_in_order(flushes):
    calls: list[list] = []

    def build(items: list) -> list[live.Message]:
        calls.append(items)
        return [live.message("audit", "audit", {"id": item}) for item in items]

    with transaction.atomic():
        for item in (3, 1, 3, 2):
            live.send_built(build, item)
        live.send("cluster", "node", {"id": 5})
    assert calls == [[3, 1, 2]]
    assert [(group, p["id"]) for group, _, p in events(flushes[0])] == [("audit", 3), ("audit", 1), ("audit", 2),
                                                                          ("cluster", 5)]


# -- the channel layer ----------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_one_channel_layer_message_per_group_and_flush():
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)("cluster", channel)
    with transaction.atomic():
        live.send("cluster", "node", {"id": 1})
        live.send("cluster", "node", {"id": 2})
    assert live.wait_sent()
    message = receive(layer, channel)
    assert message == {"type": "live.batch", "messages": [{"event": "node", "payload": {"id": 1}},
                                                          {"event": "node", "payload": {"id": 2}}]}


class SlowLayer:
    """A channel layer whose first send waits for ``gate``: flushes queue up behind it."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[int]]] = []
        self.gate = threading.Event()

    async def group_send(self, group: str, message: dict) -> None:
        self.sent.append((group, [m["payload"]["id"] for m in message["messages"]]))
        while not self.gate.is_set():
            await asyncio.sleep(0.005)


def test_flushes_queued_behind_a_send_in_progress_go_as_one_message_per_group():
    layer = SlowLayer()

    def flush(**groups: list[int]) -> None:
        live._sender.submit(layer, {group: [{"event": "job", "payload": {"id": i}} for i in ids]
                                    for group, ids in groups.items()})

    flush(cluster=[1])
    deadline = time.monotonic() + 5
    while not layer.sent and time.monotonic() < deadline:  # the first send is in progress
        time.sleep(0.005)
    flush(cluster=[2], audit=[20])
    flush(cluster=[3])
    flush(audit=[21], cluster=[4])
    layer.gate.set()
    assert live.wait_sent()
    assert layer.sent == [("cluster", [1]), ("cluster", [2, 3, 4]), ("audit", [20, 21])]


@pytest.mark.django_db(transaction=True)
def test_a_failing_channel_layer_is_logged_never_raised(monkeypatch, caplog):
    layer = get_channel_layer()

    async def broken(group, message):
        raise ConnectionError("redis went away")

    monkeypatch.setattr(layer, "group_send", broken)
    with caplog.at_level(logging.ERROR, logger="jobs.live"), transaction.atomic():
        live.send("cluster", "node", {"id": 1})
    assert live.wait_sent()
    assert "live batch to cluster failed" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_failing_builder_is_logged_and_the_other_messages_still_go(flushes, caplog):
    def broken(items: list) -> list[live.Message]:
        raise ValueError("no such row")

    with caplog.at_level(logging.ERROR, logger="jobs.live"), transaction.atomic():
        live.send_built(broken, 1)
        live.send("cluster", "node", {"id": 1})
    assert "building live messages with" in caplog.text
    assert events(flushes[0]) == [("cluster", "node", {"id": 1})]


# -- audit rows: payloads built together -------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_an_action_sends_its_row_the_jobs_summary_and_the_cluster_summary_after_commit(flushes, researcher, make_job):
    job = make_job()
    live_events.reset_summaries()  # the submit's summary went out just now: this one would be held
    flushes.clear()
    actions.cancel_job(job, researcher)
    (batches,) = flushes
    sent = {(group, event) for group, event, _ in events(batches)}
    assert sent == {("audit", "audit"), ("audit", "chain"), (f"job-{job.pk}", "job_event"), ("cluster", "job"),
                    ("cluster", "cluster_summary")}
    summary = next(p for _, event, p in events(batches) if event == "cluster_summary")
    assert summary["queue"] == []  # the cancelled job left the queue


def _summaries(flushes) -> list[dict]:
    return [p for batches in flushes for _, event, p in events(batches) if event == "cluster_summary"]


@pytest.mark.django_db(transaction=True)
# Long enough for the four cancels to fall inside it on a loaded 2-core machine (at 0.4 s they did
# not always: two summaries before the trailing one).
@override_settings(OMNI_LIVE_SUMMARY_INTERVAL_S=1.5)
def test_the_cluster_summary_goes_at_most_once_an_interval_and_the_last_state_always(flushes, researcher, make_job):
    jobs = [make_job(name=f"j{i}") for i in range(4)]
    live_events.reset_summaries()
    flushes.clear()
    for job in jobs:  # four transactions within the interval
        actions.cancel_job(job, researcher)
    assert len(_summaries(flushes)) == 1  # the first at once, with three jobs still queued
    assert len(_summaries(flushes)[0]["queue"]) == 3
    deadline = time.monotonic() + 5
    while len(_summaries(flushes)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(1.7)  # and no more than one trailing summary for the three held
    first, last = _summaries(flushes)
    assert last["queue"] == []  # the state after the last cancel
    assert "cluster" in flushes[-1] and len(flushes[-1]) == 1  # it went by itself, after the interval


# -- the summary across processes (jobs.live.SharedTrailingThrottle) -----------------------------------------


@pytest.fixture
def shared_redis():
    """settings.REDIS_URL on the test Redis, as the servers and workers of production have it."""
    import os

    import redis

    url = os.environ["OMNI_TEST_REDIS_URL"]
    client = redis.Redis.from_url(url)
    for key in client.scan_iter("omni:live:throttle:*"):
        client.delete(key)
    with override_settings(REDIS_URL=url):
        yield client


@pytest.mark.redis
def test_two_processes_go_once_an_interval_together_and_the_held_state_goes_once(shared_redis):
    """Two throttles with one name are two processes: the first goes, the other is held, and at
    the interval's end one trailing go carries both held changes (not one each)."""
    first, second = live.SharedTrailingThrottle("test-pair"), live.SharedTrailingThrottle("test-pair")
    trailing: list[str] = []
    assert first.go("cluster", 0.3, lambda: trailing.append("first"))
    assert not second.go("cluster", 0.3, lambda: trailing.append("second"))
    assert not first.go("cluster", 0.3, lambda: trailing.append("first"))
    deadline = time.monotonic() + 3
    while not (first.idle() and second.idle()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(trailing) == 1, trailing
    time.sleep(0.35)  # the trailing go's own interval: then anyone goes at once again
    assert second.go("cluster", 0.3, lambda: trailing.append("second"))
    assert len(trailing) == 1


@pytest.mark.redis
@pytest.mark.django_db(transaction=True)
@override_settings(OMNI_LIVE_SUMMARY_INTERVAL_S=0.4)
def test_the_cluster_summary_waits_while_another_process_sent_one_and_then_goes_with_the_last_state(
        shared_redis, flushes, researcher, make_job):
    job = make_job()
    live_events.reset_summaries()  # the submit's summary went out just now: this process holds the claim
    shared_redis.delete("omni:live:throttle:cluster-summary:cluster")
    flushes.clear()
    # Another server sent a summary just now.
    shared_redis.set("omni:live:throttle:cluster-summary:cluster", "daphne-on-another-host", px=400)
    actions.cancel_job(job, researcher)
    assert _summaries(flushes) == []  # the row, the job: but no summary of this process
    deadline = time.monotonic() + 3
    while not _summaries(flushes) and time.monotonic() < deadline:
        time.sleep(0.02)
    (summary,) = _summaries(flushes)
    assert summary["queue"] == []  # built after the cancel
    assert shared_redis.get("omni:live:throttle:cluster-summary:cluster") != b"daphne-on-another-host"


@pytest.mark.django_db(transaction=True)
def test_the_shared_throttle_goes_when_redis_cannot_be_reached(caplog):
    throttle = live.SharedTrailingThrottle("test-down")
    with override_settings(REDIS_URL="redis://127.0.0.1:1/0"), caplog.at_level(logging.WARNING, logger="jobs.live"):
        assert throttle.go("cluster", 5.0, lambda: None)
    assert "could not reach Redis" in caplog.text


def _rows_in_one_transaction(job, nodes, n: int) -> None:
    with transaction.atomic():
        for i in range(n):
            record_event(EventKind.CHECKPOINT, job=job, actor="agent:test", nodes_after=[nodes[i % 2].name],
                         outcome={"checkpoint_step": 100 + i, "save_s": 2.0},
                         reason={"rule": "checkpoint", "text": "Checkpoint saved.", "inputs": {}})


@pytest.mark.django_db(transaction=True)
@override_settings(OMNI_LIVE_SUMMARY_INTERVAL_S=0)  # a summary for each transaction
def test_a_transaction_of_one_or_ten_audit_rows_is_built_with_the_same_queries(flushes, make_job, make_nodes,
                                                                                 monkeypatch):
    nodes = make_nodes(racks=1, switches=1, nodes=2, gpus=4)
    job = actions.place_job(make_job(dp=2, dp_min=1, dp_max=2), [(nodes[0], 0), (nodes[1], 0)], actor="planner",
                            reason={})
    make_job(name="waiting")
    PlannerControl.load()
    monkeypatch.setattr(live_data, "_used_point", (timezone.now(), None))  # no telemetry query this minute
    counted: list[int] = []
    expand = live._expand

    def counting(entries):
        with CaptureQueriesContext(connection) as queries:
            messages = expand(entries)
        counted.append(len(queries))
        return messages

    monkeypatch.setattr(live, "_expand", counting)
    flushes.clear()
    for n in (1, 10):
        _rows_in_one_transaction(job, nodes, n)
    # The rows (with the row before them), their nodes, the allocations; the cluster summary's nine (eight, and one
    # for the teams: there are none; one of them the dashboard header's job counts).
    assert counted == [3 + 9, 3 + 9]
    one, ten = ([p for _, event, p in events(batches) if event == "audit"] for batches in flushes)
    assert (len(one), len(ten)) == (1, 10)
    chain = [p for _, event, p in events(flushes[1]) if event == "chain"]
    assert chain == [{"after_id": one[0]["id"], "first_id": ten[0]["id"], "last_id": ten[-1]["id"], "rows": 10,
                      "last_good_id": ten[-1]["id"], "bad": None}]
    job_events = [p for group, event, p in events(flushes[1]) if event == "job_event"]
    assert len(job_events) == 10 and job_events[0]["job"]["gpus"] == 2
    nodes_sent = [p for group, event, p in events(flushes[1]) if event == "node"]
    assert len(nodes_sent) == 4  # each of the two nodes once on the cluster stream and once on its own


def test_the_audit_builder_pins_three_queries_for_one_row_and_for_ten(db, make_job, make_nodes,
                                                                      django_assert_num_queries):
    nodes = make_nodes(racks=1, switches=1, nodes=2, gpus=4)
    job = actions.place_job(make_job(dp=2, dp_min=1, dp_max=2), [(nodes[0], 0), (nodes[1], 0)], actor="planner",
                            reason={})
    _rows_in_one_transaction(job, nodes, 10)
    ids = list(job.events.order_by("id").values_list("id", flat=True))
    for rows in (ids[-1:], ids[-10:]):
        with django_assert_num_queries(3):
            live_events.audit_messages(rows)


def test_a_changed_row_shows_in_the_chain_message(db, make_job):
    job = make_job()
    event = job.events.get()
    event.reason = {"rule": "edited", "text": "Edited behind the log's back.", "inputs": {}}  # in memory only
    check = live_events.chain_check(None, [event])
    assert check["bad"] == {"id": event.pk, "problem": "its contents do not match its stored hash"}
    assert check["last_good_id"] is None


def test_the_inprocess_loops_updates_go_through_the_servers_loop_in_order():
    """The embedded mode's in-process loop (heartbeat monitor, planner ticks) sends through the
    ASGI server's loop, as the server's own threads do (jobs.live.send_through): the in-memory
    layer wakes the server's consumers only from there, and one loop keeps its batches in order.
    Without it the monitor's "suspect" went through a loop of its own and reached a page after
    the heartbeat that healed the node (docs/live-ui.md, "Out of order")."""
    from omniweb.loop import InProcessLoop
    from omniweb.scheduled import PeriodicTask, Queue

    server = asyncio.new_event_loop()
    threading.Thread(target=server.run_forever, name="a-server-loop", daemon=True).start()
    layer = SlowLayer()
    layer.gate.set()
    sent_on: list[asyncio.AbstractEventLoop] = []
    original = layer.group_send

    async def group_send(group: str, message: dict) -> None:
        sent_on.append(asyncio.get_running_loop())
        await original(group, message)

    layer.group_send = group_send

    class Sending(InProcessLoop):
        def run_once(self, task: PeriodicTask) -> None:
            live._sender.submit(layer, {"cluster": [{"event": "node", "payload": {"id": self.runs[task.name]}}]})
            self.runs[task.name] += 1

    loop = Sending([PeriodicTask("test.send", 0.01, Queue.PLANNER, 1.0)], tick_s=0.01, live_loop=server)
    loop.start()
    try:
        deadline = time.monotonic() + 5
        while loop.runs["test.send"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    assert live.wait_sent()
    assert len(sent_on) >= 3 and all(used is server for used in sent_on)
    ids = [i for _, batch in layer.sent for i in batch]
    assert ids == sorted(ids)
    server.call_soon_threadsafe(server.stop)

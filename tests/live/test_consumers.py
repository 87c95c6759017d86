"""The browsers' socket: who may connect and subscribe, what arrives, and telemetry throttling.

Driven with Channels' WebsocketCommunicator against the real consumer (and, for the session
cookie path, the real ASGI application), with the in-memory channel layer of the embedded mode.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser
from django.test import Client, override_settings

from jobs import actions, live
from jobs.live import job_group, node_group
from jobs.live_consumers import LiveConsumer

pytestmark = pytest.mark.django_db(transaction=True)


def run(scenario) -> None:
    """Run an async scenario to completion from a sync test (no pytest-asyncio needed)."""
    async_to_sync(scenario)()


async def group_send(group: str, event: str, payload) -> None:
    """What jobs.live puts on the channel layer: one batch of one message."""
    await get_channel_layer().group_send(group, {"type": "live.batch", "messages": [{"event": event, "payload": payload}]})


async def receive_all(communicator: WebsocketCommunicator, quiet_s: float = 0.5) -> list[dict]:
    """Every message until the socket has been quiet for ``quiet_s``."""
    messages = []
    while not await communicator.receive_nothing(timeout=quiet_s):
        messages.append(await communicator.receive_json_from(timeout=2))
    return messages


async def connect(user) -> WebsocketCommunicator:
    # What the test's setup sent (after its commits, from jobs.live's own thread) is out first.
    assert await sync_to_async(live.wait_sent, thread_sensitive=False)()
    communicator = WebsocketCommunicator(LiveConsumer.as_asgi(), "/ws/live/")
    communicator.scope["user"] = user
    connected, _ = await communicator.connect()
    assert connected
    hello = await communicator.receive_json_from(timeout=2)
    assert hello["type"] == "hello"
    return communicator


async def subscribe(communicator: WebsocketCommunicator, stream: str, object_id=None) -> dict:
    await communicator.send_json_to({"action": "subscribe", "stream": stream, "id": object_id})
    return await communicator.receive_json_from(timeout=2)


def test_anonymous_socket_is_closed_with_4401():
    async def scenario():
        communicator = WebsocketCommunicator(LiveConsumer.as_asgi(), "/ws/live/")
        communicator.scope["user"] = AnonymousUser()
        connected, code = await communicator.connect()
        assert not connected and code == 4401

    run(scenario)


def test_user_without_a_role_is_closed_with_4403(outsider):
    async def scenario():
        communicator = WebsocketCommunicator(LiveConsumer.as_asgi(), "/ws/live/")
        communicator.scope["user"] = outsider
        connected, code = await communicator.connect()
        assert not connected and code == 4403

    run(scenario)


def test_session_cookie_signs_the_socket_in_through_the_real_asgi_app(researcher):
    from omniweb.asgi import application

    client = Client()
    client.force_login(researcher)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()

    async def scenario():
        communicator = WebsocketCommunicator(
            application, "/ws/live/", headers=[(b"cookie", cookie), (b"origin", b"http://testserver")]
        )
        connected, _ = await communicator.connect()
        assert connected
        hello = await communicator.receive_json_from(timeout=2)
        assert hello == {"type": "hello", "user": "rita", "roles": ["researcher"]}
        await communicator.disconnect()

    run(scenario)


def test_foreign_origin_is_refused(researcher):
    from omniweb.asgi import application

    async def scenario():
        communicator = WebsocketCommunicator(application, "/ws/live/", headers=[(b"origin", b"http://evil.example")])
        connected, _ = await communicator.connect()
        assert not connected

    run(scenario)


def test_researcher_follows_own_job_but_not_anothers(researcher, other_researcher, make_job):
    mine = make_job()
    theirs = make_job(owner=other_researcher)

    async def scenario():
        communicator = await connect(researcher)
        ok = await subscribe(communicator, "job", mine.pk)
        assert ok["type"] == "subscribed" and ok["group"] == f"job-{mine.pk}"
        refused = await subscribe(communicator, "job", theirs.pk)
        assert refused["type"] == "error" and refused["status"] == 403
        missing = await subscribe(communicator, "job", 999999)
        assert missing["status"] == 404
        audit = await subscribe(communicator, "audit")
        assert audit["status"] == 403
        cluster = await subscribe(communicator, "cluster")
        assert cluster["type"] == "subscribed"
        bad = await subscribe(communicator, "planet", 1)
        assert bad["status"] == 400
        await communicator.disconnect()

    run(scenario)


def test_auditor_and_operator_follow_any_job_and_the_audit_log(auditor, operator, make_job):
    job = make_job()

    async def scenario():
        for user in (auditor, operator):
            communicator = await connect(user)
            assert (await subscribe(communicator, "job", job.pk))["type"] == "subscribed"
            assert (await subscribe(communicator, "audit"))["type"] == "subscribed"
            await communicator.disconnect()

    run(scenario)


def test_drain_reaches_audit_and_cluster_subscribers_with_complete_payloads(operator, auditor, make_nodes):
    node = make_nodes(racks=1, switches=1, nodes=1)[0]

    async def scenario():
        watcher = await connect(auditor)
        await subscribe(watcher, "audit")
        await subscribe(watcher, "cluster")
        await database_sync_to_async(actions.drain_node)(node, operator)
        by_event = {m["event"]: m["payload"] for m in await receive_all(watcher)}
        audit = by_event["audit"]
        assert audit["kind"] == "drain" and audit["actor"] == "olive"
        assert "olive drained r0s0n0" in audit["text"]
        assert audit["reason"]["inputs"] == {"node": "r0s0n0", "from": "healthy", "to": "draining"}
        assert len(audit["hash"]) == 64
        assert by_event["node"]["state"] == "draining" and len(by_event["node"]["gpus"]) == 8
        assert by_event["node"]["seq"] == audit["id"]  # read after that row: its version
        chain = by_event["chain"]
        assert (chain["first_id"], chain["last_id"], chain["rows"], chain["bad"]) == (audit["id"], audit["id"], 1, None)
        assert by_event["cluster_summary"]["health"] == [{"state": "draining", "label": "Draining", "count": 1}]
        await watcher.disconnect()

    run(scenario)


def test_job_subscriber_gets_the_event_and_the_jobs_new_summary(researcher, make_job):
    job = make_job()

    async def scenario():
        communicator = await connect(researcher)
        await subscribe(communicator, "job", job.pk)
        await database_sync_to_async(actions.cancel_job)(job, researcher)
        message = await communicator.receive_json_from(timeout=2)
        assert message["event"] == "job_event"
        assert message["payload"]["event"]["kind"] == "cancel"
        assert message["payload"]["job"]["state"] == "cancelled"
        assert message["payload"]["job"]["name"] == job.name
        await communicator.disconnect()

    run(scenario)


def test_telemetry_frames_are_throttled_and_batched_without_losing_samples(researcher, make_job, monkeypatch):
    job = make_job()
    monkeypatch.setattr(LiveConsumer, "FRAME_INTERVAL_S", 0.3)

    async def scenario():
        communicator = await connect(researcher)
        await subscribe(communicator, "job", job.pk)
        for i in range(50):
            await group_send(job_group(job.pk), "gpu_samples", {"job_id": job.pk, "i": i})
        frames = []
        received = 0
        while received < 50:
            frame = await communicator.receive_json_from(timeout=2)
            frames.append(frame)
            received += len(frame["batch"])
        # The first sample goes out at once; the other 49 wait for the next frame, together.
        assert len(frames) == 2
        assert [p["i"] for f in frames for p in f["batch"]] == list(range(50))
        assert await communicator.receive_nothing(timeout=0.4)
        await communicator.disconnect()

    run(scenario)


def test_a_decision_flushes_buffered_telemetry_first_so_order_is_kept(researcher, make_job, monkeypatch):
    job = make_job()
    monkeypatch.setattr(LiveConsumer, "FRAME_INTERVAL_S", 5.0)

    async def scenario():
        communicator = await connect(researcher)
        await subscribe(communicator, "job", job.pk)
        group = job_group(job.pk)
        await group_send(group, "step_records", {"step": 1})
        await group_send(group, "step_records", {"step": 2})
        await group_send(group, "job_event", {"x": 1})
        first = await communicator.receive_json_from(timeout=1)
        second = await communicator.receive_json_from(timeout=1)
        third = await communicator.receive_json_from(timeout=1)
        assert first["batch"] == [{"step": 1}]
        assert second["batch"] == [{"step": 2}]
        assert third == {"type": "live", "event": "job_event", "payload": {"x": 1}}
        await communicator.disconnect()

    run(scenario)


async def frames_within(communicator: WebsocketCommunicator, seconds: float) -> list[dict]:
    """Every frame that arrives in the next ``seconds``."""
    deadline = asyncio.get_running_loop().time() + seconds
    frames = []
    while (left := deadline - asyncio.get_running_loop().time()) > 0:
        if await communicator.receive_nothing(timeout=min(left, 0.05)):
            continue
        frames.append(await communicator.receive_json_from(timeout=1))
    return frames


@override_settings(OMNI_LIVE_SUMMARY_INTERVAL_S=0)  # the setup's summaries out before the socket opens
def test_snapshots_that_pile_up_for_a_socket_go_once_each_in_their_latest_state(operator, make_job, make_nodes,
                                                                                  monkeypatch):
    """job, node and cluster_summary are each the whole state of one object: of those that came
    within the snapshot interval only the newest of each goes out, in the order of the newest."""
    job = make_job()
    node = make_nodes(racks=1, switches=1, nodes=1)[0]
    monkeypatch.setattr(LiveConsumer, "SNAPSHOT_INTERVAL_S", 0.5)

    async def scenario():
        communicator = await connect(operator)
        await subscribe(communicator, "cluster")
        assert (await subscribe(communicator, "node", node.pk))["type"] == "subscribed"
        await group_send("cluster", "job", {"id": job.pk, "v": 1})
        first = await communicator.receive_json_from(timeout=0.2)  # after a quiet spell: at once
        for group, event, payload in [
            ("cluster", "job", {"id": job.pk, "v": 2}),
            ("cluster", "node", {"id": node.pk, "v": "a"}),
            ("cluster", "job", {"id": job.pk + 1, "v": 1}),
            ("cluster", "job", {"id": job.pk, "v": 3}),
            ("cluster", "cluster_summary", {"v": "s1"}),
            (node_group(node.pk), "node", {"id": node.pk, "v": "b"}),  # the same node on its own stream
            ("cluster", "cluster_summary", {"v": "s2"}),
        ]:
            await group_send(group, event, payload)
        held = await frames_within(communicator, 1.0)
        await communicator.disconnect()
        return first, held

    first, held = async_to_sync(scenario)()
    assert (first["event"], first["payload"]) == ("job", {"id": job.pk, "v": 1})
    assert [(f["event"], f["payload"]) for f in held] == [
        ("job", {"id": job.pk + 1, "v": 1}),
        ("job", {"id": job.pk, "v": 3}),
        ("node", {"id": node.pk, "v": "b"}),
        ("cluster_summary", {"v": "s2"}),
    ]


@override_settings(OMNI_LIVE_SUMMARY_INTERVAL_S=0)  # the setup's summaries out before the socket opens
def test_a_socket_that_keeps_up_gets_a_whole_batch_of_snapshots_at_once(operator, make_job, monkeypatch):
    job = make_job()
    monkeypatch.setattr(LiveConsumer, "SNAPSHOT_INTERVAL_S", 0.2)
    batch = [{"event": "job", "payload": {"id": job.pk}}, {"event": "node", "payload": {"id": 1}},
             {"event": "cluster_summary", "payload": {"queue": []}}]

    async def scenario():
        communicator = await connect(operator)
        await subscribe(communicator, "cluster")
        got = []
        for _ in range(2):
            await get_channel_layer().group_send("cluster", {"type": "live.batch", "messages": batch})
            got.append([(await communicator.receive_json_from(timeout=0.1))["event"] for _ in batch])
            await asyncio.sleep(0.3)  # longer than the interval: the next batch is not held
        await communicator.disconnect()
        return got

    assert async_to_sync(scenario)() == [["job", "node", "cluster_summary"]] * 2


@override_settings(OMNI_LIVE_SUMMARY_INTERVAL_S=0)  # the setup's summaries out before the socket opens
def test_a_decision_goes_at_once_after_held_snapshots_and_is_not_overtaken_by_older_ones(
        operator, make_job, monkeypatch):
    """A rescale event (job_event) flushes the snapshots held before it and goes out at once; a
    snapshot of the same job that comes after it follows it, never before it."""
    job = make_job()
    monkeypatch.setattr(LiveConsumer, "SNAPSHOT_INTERVAL_S", 0.5)

    async def scenario():
        communicator = await connect(operator)
        await subscribe(communicator, "cluster")
        await subscribe(communicator, "job", job.pk)
        await group_send("cluster", "job", {"id": job.pk, "dp": 1})  # at once
        await group_send("cluster", "job", {"id": job.pk, "dp": 1, "v": 2})  # held
        await group_send(job_group(job.pk), "job_event", {"event": {"kind": "grow"}, "job": {"dp": 2}})
        await group_send("cluster", "job", {"id": job.pk, "dp": 2})  # held again, after the event
        at_once = await frames_within(communicator, 0.2)
        later = await frames_within(communicator, 0.8)
        await communicator.disconnect()
        return at_once, later

    at_once, later = async_to_sync(scenario)()
    assert [(f["event"], f["payload"].get("v", f["payload"].get("event"))) for f in at_once] == [
        ("job", None), ("job", 2), ("job_event", {"kind": "grow"})]
    assert [(f["event"], f["payload"]) for f in later] == [("job", {"id": job.pk, "dp": 2})]


@override_settings(OMNI_LIVE_SUMMARY_INTERVAL_S=0)  # the setup's summaries out before the socket opens
def test_a_state_built_before_one_already_sent_is_dropped_when_it_arrives_late(operator, researcher, make_job,
                                                                              make_nodes):
    """Batches from two senders can cross (a node marked suspect by the heartbeat monitor's
    thread, healed a moment later by the agent's own socket): a job's or node's state read after
    an earlier audit row (``seq``) than one the socket has already taken is not sent after it,
    whoever the viewer (a researcher's cut drops the field, not the check). Unversioned states
    and other objects go through."""
    job = make_job()
    node = make_nodes(racks=1, switches=1, nodes=1)[0]

    async def scenario(user):
        communicator = await connect(user)
        await subscribe(communicator, "cluster")
        for event, payload in [
            ("node", {"id": node.pk, "state": "healthy", "seq": 12, "gpus": []}),
            ("node", {"id": node.pk, "state": "suspect", "seq": 11, "gpus": []}),  # late: dropped
            ("job", {"id": job.pk, "name": "j", "state": "running", "seq": 12}),
            ("job", {"id": job.pk, "name": "j", "state": "pending", "seq": 10}),  # late: dropped
            ("node", {"id": node.pk + 1, "state": "suspect", "seq": 3, "gpus": []}),  # another node
            ("node", {"id": node.pk, "state": "failed", "seq": 13, "gpus": []}),
            ("job", {"id": job.pk, "name": "j", "state": "completed"}),  # no seq: as before
        ]:
            await group_send("cluster", event, payload)
            await asyncio.sleep(0.3)  # each alone, beyond the snapshot interval: no coalescing
        got = await frames_within(communicator, 0.5)
        await communicator.disconnect()
        return [(f["event"], f["payload"]["id"], f["payload"]["state"]) for f in got
                if f["event"] in ("node", "job")]

    for user in (operator, researcher):
        assert async_to_sync(scenario)(user) == [
            ("node", node.pk, "healthy"), ("job", job.pk, "running"), ("node", node.pk + 1, "suspect"),
            ("node", node.pk, "failed"), ("job", job.pk, "completed")]


def test_unsubscribe_stops_messages(researcher, make_job):
    job = make_job()

    async def scenario():
        communicator = await connect(researcher)
        await subscribe(communicator, "job", job.pk)
        await communicator.send_json_to({"action": "unsubscribe", "stream": "job", "id": job.pk})
        assert (await communicator.receive_json_from(timeout=2))["type"] == "unsubscribed"
        await group_send(job_group(job.pk), "job_event", {})
        assert await communicator.receive_nothing(timeout=0.3)
        await communicator.disconnect()

    run(scenario)


def test_bad_messages_get_an_error_not_a_closed_socket(researcher):
    async def scenario():
        communicator = await connect(researcher)
        await communicator.send_json_to(["not", "an", "object"])
        assert (await communicator.receive_json_from(timeout=2))["status"] == 400
        await communicator.send_json_to({"action": "explode"})
        assert (await communicator.receive_json_from(timeout=2))["status"] == 400
        await communicator.send_json_to({"action": "subscribe", "stream": "job", "id": "x"})
        assert (await communicator.receive_json_from(timeout=2))["status"] == 400
        await communicator.disconnect()

    run(scenario)




def test_live_sockets_are_counted_in_the_metrics_gauge(researcher):
    """/metrics' WebSocket clients gauge follows accepted live sockets, and only those."""
    from telemetry import metrics

    counts: list[int] = []

    async def scenario():
        counts.append(metrics.snapshot()[1].get("live", 0))
        refused = WebsocketCommunicator(LiveConsumer.as_asgi(), "/ws/live/")
        refused.scope["user"] = AnonymousUser()
        connected, _ = await refused.connect()
        assert not connected
        communicator = await connect(researcher)
        counts.append(metrics.snapshot()[1].get("live", 0))
        await communicator.disconnect()
        counts.append(metrics.snapshot()[1].get("live", 0))

    run(scenario)
    before, during, after = counts
    assert during == before + 1 and after == before


# -- who sees what (jobs.roles.job_visibility, OMNI_JOB_VISIBILITY) --------------------------------


@pytest.mark.parametrize(("setting", "answer"), [("summary", 403), ("all", "subscribed"), ("own", 404)])
def test_anothers_job_stream_answers_as_the_setting_says(setting, answer, researcher, other_researcher, make_job):
    theirs = make_job(owner=other_researcher)

    async def scenario():
        communicator = await connect(researcher)
        reply = await subscribe(communicator, "job", theirs.pk)
        assert reply.get("status", reply["type"]) == answer
        await communicator.disconnect()

    with override_settings(OMNI_JOB_VISIBILITY=setting):
        run(scenario)


@pytest.mark.parametrize("setting", ["summary", "all", "own"])
def test_the_cluster_stream_gives_others_jobs_as_the_setting_says(setting, researcher, other_researcher, make_job):
    mine, theirs = make_job(name="mine"), make_job(owner=other_researcher, name="theirs")

    async def scenario():
        communicator = await connect(researcher)
        await subscribe(communicator, "cluster")
        await database_sync_to_async(actions.cancel_job)(theirs, other_researcher)
        jobs = [m["payload"] for m in await receive_all(communicator) if m["event"] == "job"]
        if setting == "own":
            assert jobs == []
        else:
            (payload,) = jobs
            assert payload["name"] == "theirs" and payload["state"] == "cancelled" and payload["owner"] == "rob"
            if setting == "summary":
                assert payload["visibility"] == "summary" and "dp" not in payload and "pending_reason" not in payload
            else:
                assert "dp" in payload and "pending_reason" in payload
        await database_sync_to_async(actions.cancel_job)(mine, researcher)
        (own,) = [m["payload"] for m in await receive_all(communicator) if m["event"] == "job"]
        assert own["name"] == "mine" and "dp" in own
        await communicator.disconnect()

    with override_settings(OMNI_JOB_VISIBILITY=setting):
        run(scenario)


@override_settings(OMNI_JOB_VISIBILITY="own")
def test_node_payloads_do_not_name_jobs_the_viewer_may_not_see(researcher, other_researcher, operator, make_job,
                                                               make_nodes):
    node = make_nodes(racks=1, switches=1, nodes=1)[0]
    theirs = make_job(owner=other_researcher, name="theirs")
    actions.place_job(theirs, [(node, 0), (node, 1)], actor="planner", reason={})

    async def scenario():
        communicator = await connect(researcher)
        await subscribe(communicator, "cluster")
        await subscribe(communicator, "node", node.pk)
        await database_sync_to_async(actions.drain_node)(node, operator)
        nodes = [m["payload"] for m in await receive_all(communicator) if m["event"] == "node"]
        # The node on the cluster stream and on its own: one frame when the second came while the
        # socket held snapshots (they are one object), else two.
        assert 1 <= len(nodes) <= 2
        for node_payload in nodes:
            gpus = node_payload["gpus"]
            assert gpus[0] == {"index": 0, "job": None, "job_id": None, "priority": "regular", "borrowed": False,
                               "held": True}
            assert gpus[2]["job"] is None and "held" not in gpus[2]
        await group_send(node_group(node.pk), "gpu_samples",
                         {"job": theirs.pk, "node": node.pk, "points": [{"gpu": 0, "util_pct": 90.0}]})
        frame = await communicator.receive_json_from(timeout=2)
        assert frame["batch"] == [{"node": node.pk, "points": [{"gpu": 0, "util_pct": 90.0}]}]
        await communicator.disconnect()

    run(scenario)


# Unthrottled, the setup's summaries are out before the socket opens and the hold's at once: with
# the 0.5 s throttle the setup's trailing one came after the socket subscribed, and the hold's,
# refused, came after receive_all had stopped (a slow CI hour got no summary at all).
@override_settings(OMNI_LIVE_SUMMARY_INTERVAL_S=0)
@pytest.mark.parametrize(("setting", "seen"), [("summary", "summary"), ("all", "full"), ("own", None)])
def test_the_cluster_summary_queue_says_why_only_for_jobs_seen_in_full(setting, seen, researcher, other_researcher,
                                                                        make_job):
    from django.db import transaction

    from jobs.audit import record_event
    from jobs.models import EventKind

    make_job(name="mine")
    theirs = make_job(owner=other_researcher, name="theirs")

    def hold() -> None:
        with transaction.atomic():
            record_event(EventKind.HOLD, job=theirs, actor="planner",
                         reason={"rule": "no_capacity", "text": "Waits for a private reason.", "inputs": {}})

    async def scenario():
        communicator = await connect(researcher)
        await subscribe(communicator, "cluster")
        await database_sync_to_async(hold)()
        assert await sync_to_async(live.wait_sent, thread_sensitive=False)()
        (summary,) = [m["payload"] for m in await receive_all(communicator) if m["event"] == "cluster_summary"]
        queue = {item["name"]: item for item in summary["queue"]}
        assert queue["mine"]["why"] == "The planner has not considered this job yet." and "visibility" not in queue["mine"]
        if seen is None:
            assert "theirs" not in queue
        elif seen == "summary":
            assert "why" not in queue["theirs"] and queue["theirs"]["visibility"] == "summary"
        else:
            assert queue["theirs"]["why"] == "Waits for a private reason."
        assert summary["gpus_total"] == 0 and summary["planner"]["paused"] is False
        await communicator.disconnect()

    with override_settings(OMNI_JOB_VISIBILITY=setting):
        run(scenario)


@pytest.mark.redis
def test_each_kind_of_viewer_cuts_and_encodes_a_batch_once_and_gets_its_own_cut(
        researcher, other_researcher, operator, make_job, monkeypatch):
    """On channels_redis every socket of the process gets the same batch object: the cut and the
    JSON are made once per kind of viewer (the owner, another researcher, someone who sees
    everything), and no socket gets another kind's cut."""
    import os

    from channels.layers import channel_layers

    job = make_job(name="mine")
    made = []
    views = LiveConsumer._views

    async def counted(self, message):
        made.append(self.scope["user"].username)
        return await views(self, message)

    monkeypatch.setattr(LiveConsumer, "_views", counted)
    layer = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                         "CONFIG": {"hosts": [os.environ["OMNI_TEST_REDIS_URL"]], "prefix": "omni-test-views"}}}

    async def scenario():
        viewers = [researcher, researcher, other_researcher, other_researcher, operator]
        sockets = [await connect(user) for user in viewers]
        for communicator in sockets:
            await subscribe(communicator, "cluster")
        await database_sync_to_async(actions.cancel_job)(job, researcher)
        seen = []
        for communicator in sockets:
            (payload,) = [m["payload"] for m in await receive_all(communicator) if m["event"] == "job"]
            seen.append(payload)
            await communicator.disconnect()
        return seen

    with override_settings(CHANNEL_LAYERS=layer, OMNI_JOB_VISIBILITY="summary"):
        assert channel_layers.backends == {}
        seen = run_and_return(scenario)
    assert [("dp" in p, p.get("visibility")) for p in seen] == [
        (True, None), (True, None), (False, "summary"), (False, "summary"), (True, None)]
    assert all(p["name"] == "mine" and p["state"] == "cancelled" for p in seen)
    # Each batch once per kind of viewer: without sharing, rita's and rob's two sockets would make it twice.
    counts = Counter(made)
    assert set(counts) == {"rita", "rob", operator.username} and len(set(counts.values())) == 1, made


def run_and_return(scenario):
    return async_to_sync(scenario)()

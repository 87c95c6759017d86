"""The job page's Logs panel and failure box without a browser, and the two sockets the lines
travel over: the agent's (``logs`` in, ``logs_ack`` out) and the page's (``job_logs``)."""

from __future__ import annotations

import json
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client, override_settings
from django.urls import reverse

from jobs import actions, live
from jobs.consumers import AgentConsumer
from jobs.live_consumers import LiveConsumer
from jobs.models import Job, JobLogLine
from jobs.views import LOG_PANEL_LINES
from trainer_agent import protocol


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def logs_frame(job: Job, lines: dict[tuple[int, str], list[str]], ship: int = 1, offset: int = 0) -> dict:
    chunks = [{"rank": rank, "stream": stream, "offset": offset, "lines": texts,
               "sizes": [len(t.encode()) + 1 for t in texts], "at": time.time()}
              for (rank, stream), texts in lines.items()]
    return {"type": "logs", "job": job.name, "run_id": job.run_id, "ship": ship, "chunks": chunks}


@pytest.fixture
def running(researcher, make_job, make_nodes):
    nodes = make_nodes(racks=1, switches=1, nodes=2, gpus=4)
    job = actions.place_job(make_job(name="prints", dp=2), [(nodes[0], 0), (nodes[0], 1)], actor="planner",
                            reason={"rule": "place", "text": "Placed.", "inputs": {}})
    Job.objects.filter(pk=job.pk).update(run_id="prints-1")
    job.refresh_from_db()
    return job, nodes


def panel(html: str) -> str:
    return html[html.index('<section class="card" id="logs"'):]


# -- the page ----------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_panel_shows_the_newest_lines_with_stderr_marked_and_a_rank_filter(researcher, running):
    job, nodes = running
    actions.record_log_lines(nodes[0], logs_frame(job, {(0, "out"): ["loss 2.31 <b>"], (1, "err"): ["Traceback"]}))
    html = panel(client_for(researcher).get(reverse("job-page", args=[job.pk])).content.decode())
    assert 'class="log-line out"' in html and 'data-rank="0"' in html and "loss 2.31 &lt;b&gt;" in html
    assert 'class="log-line err"' in html and 'data-rank="1"' in html
    assert '<option value="">all ranks</option>' in html
    assert '<option value="0">rank 0</option>' in html and '<option value="1">rank 1</option>' in html
    assert f'href="/api/jobs/{job.pk}/logs/"' in html
    assert '<p class="muted empty" hidden>' in html


@pytest.mark.django_db
def test_a_job_without_output_says_so(researcher, running):
    job, _ = running
    html = panel(client_for(researcher).get(reverse("job-page", args=[job.pk])).content.decode())
    assert '<p class="muted empty">No output yet.</p>' in html


@pytest.mark.django_db
def test_the_panel_keeps_the_newest_lines_in_a_constant_number_of_queries(researcher, running,
                                                                          django_assert_max_num_queries):
    job, nodes = running
    client = client_for(researcher)
    actions.record_log_lines(nodes[0], logs_frame(job, {(0, "out"): ["first"]}))
    client.get(reverse("job-page", args=[job.pk]))  # warm: sessions, roles
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as few:
        client.get(reverse("job-page", args=[job.pk]))
    lines = [f"line {i}" for i in range(LOG_PANEL_LINES + 50)]
    actions.record_log_lines(nodes[0], logs_frame(job, {(1, "out"): lines}, ship=2))
    with django_assert_max_num_queries(len(few)):
        html = panel(client.get(reverse("job-page", args=[job.pk])).content.decode())
    assert html.count('class="log-line ') == LOG_PANEL_LINES
    assert f">line {LOG_PANEL_LINES + 49}</span>" in html and ">line 49</span>" not in html and ">first<" not in html


@pytest.mark.django_db
def test_the_failure_box_says_which_rank_failed_where_with_its_tail(researcher, running):
    job, _ = running
    Job.objects.filter(pk=job.pk).update(failure={
        "code": 1, "rank": 1, "signal": None, "node": "node-b", "run_id": "prints-1", "at": 1_760_000_000.0,
        "tail": "Traceback (most recent call last):\n  File \"train.py\", line 3\nValueError: <bad>"})
    html = client_for(researcher).get(reverse("job-page", args=[job.pk])).content.decode()
    box = html[html.index('id="job-failure"'):]
    box = box[: box.index("</div>")]
    assert "Rank 1 on node-b exited with code 1" in box
    assert '<pre class="failure-tail" data-f="tail">Traceback (most recent call last):' in box
    assert "ValueError: &lt;bad&gt;</pre>" in box
    assert '<time datetime="2025-10-09T08:53:20.000Z"' in box and "prints-1" in box


@pytest.mark.django_db
@pytest.mark.parametrize(("failure", "words"), [
    ({"code": None, "rank": 0, "signal": 9, "node": "n1"}, "Rank 0 on n1 exited with signal 9"),
    ({"code": 2, "rank": None, "node": "n1"}, "torchrun on n1 exited with code 2"),
])
def test_the_failure_box_names_a_signal_or_torchrun_itself(researcher, running, failure, words):
    job, _ = running
    Job.objects.filter(pk=job.pk).update(failure=failure)
    html = client_for(researcher).get(reverse("job-page", args=[job.pk])).content.decode()
    assert words in html and 'class="failure-tail"' not in html


@pytest.mark.django_db
def test_no_failure_box_for_a_job_that_has_not_failed(researcher, running):
    job, _ = running
    assert 'id="job-failure"' not in client_for(researcher).get(reverse("job-page", args=[job.pk])).content.decode()


@pytest.mark.django_db
@pytest.mark.parametrize(("setting", "status"), [("summary", 403), ("all", 200), ("own", 404)])
def test_anothers_logs_are_on_their_page_only_for_full_viewers(other_researcher, running, setting, status):
    job, nodes = running
    actions.record_log_lines(nodes[0], logs_frame(job, {(0, "out"): ["private words"]}))
    with override_settings(OMNI_JOB_VISIBILITY=setting):
        response = client_for(other_researcher).get(reverse("job-page", args=[job.pk]))
    assert response.status_code == status
    assert ("private words" in response.content.decode()) is (status == 200)


# -- the sockets ---------------------------------------------------------------------------------------


def run(scenario) -> None:
    async_to_sync(scenario)()


async def agent_socket(token: str) -> WebsocketCommunicator:
    communicator = WebsocketCommunicator(AgentConsumer.as_asgi(), protocol.AGENT_PATH,
                                         headers=[(b"authorization", f"Bearer {token}".encode())])
    connected, _ = await communicator.connect()
    assert connected
    assert json.loads(await communicator.receive_from(timeout=5))["type"] == "welcome"
    return communicator


async def answer(communicator: WebsocketCommunicator, frame: dict | str) -> dict:
    await communicator.send_to(text_data=frame if isinstance(frame, str) else json.dumps(frame))
    return json.loads(await communicator.receive_from(timeout=5))


@pytest.mark.django_db(transaction=True)
def test_the_agent_socket_acknowledges_stored_lines_once_and_refuses_what_it_must(running, monkeypatch):
    from django.db import connections

    # The consumer's worker threads close their connections after each frame, so none is left
    # open on the test database when it is dropped.
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    job, nodes = running
    tokens = []
    for node in nodes:
        tokens.append(node.issue_token())
        node.save(update_fields=["agent_token_hash"])

    async def scenario():
        agent = await agent_socket(tokens[0])
        frame = logs_frame(job, {(0, "out"): ["a", "b"], (0, "err"): ["warn"]}, ship=5)
        assert await answer(agent, frame) == {"type": "logs_ack", "ship": 5, "job": "prints", "run_id": "prints-1",
                                              "stored": 3, "refused": None}
        again = await answer(agent, {**frame, "ship": 6})  # re-sent after a reconnect: stored once
        assert (again["ship"], again["stored"], again["refused"]) == (6, 0, None)
        bad = await answer(agent, {"type": "logs", "job": "prints", "run_id": "prints-1", "ship": 7,
                                   "chunks": [{"rank": 0, "stream": "tty", "offset": 0, "lines": [], "sizes": []}]})
        assert (bad["type"], bad["code"], bad["ref"]) == ("error", "bad_record", 7)
        garbage = await answer(agent, '{"type": "logs"}')
        assert (garbage["type"], garbage["code"]) == ("error", "missing_field")
        await agent.disconnect()
        other = await agent_socket(tokens[1])  # a node that never ran the job
        refused = await answer(other, logs_frame(job, {(0, "out"): ["spoof"]}, ship=1))
        assert refused["type"] == "logs_ack" and refused["stored"] == 0 and "did not run" in refused["refused"]
        await other.disconnect()

    run(scenario)
    assert sorted(JobLogLine.objects.values_list("stream", "text")) == [("err", "warn"), ("out", "a"), ("out", "b")]
    assert set(JobLogLine.objects.values_list("node", flat=True)) == {nodes[0].name}


@pytest.mark.django_db(transaction=True)
def test_new_lines_reach_the_job_pages_socket(researcher, running):
    job, nodes = running

    async def scenario():
        assert await sync_to_async(live.wait_sent, thread_sensitive=False)()
        page = WebsocketCommunicator(LiveConsumer.as_asgi(), "/ws/live/")
        page.scope["user"] = researcher
        assert (await page.connect())[0]
        assert (await page.receive_json_from(timeout=2))["type"] == "hello"
        await page.send_json_to({"action": "subscribe", "stream": "job", "id": job.pk})
        assert (await page.receive_json_from(timeout=2))["type"] == "subscribed"
        await database_sync_to_async(actions.record_log_lines)(nodes[0], logs_frame(job, {(2, "err"): ["boom"]}))
        message = await page.receive_json_from(timeout=3)
        assert message["type"] == "live" and message["event"] == "job_logs"
        [payload] = message["batch"]
        line = await database_sync_to_async(JobLogLine.objects.get)()
        assert payload["lines"] == [{"id": line.pk, "rank": 2, "stream": "err", "at": line.at.isoformat(),
                                     "text": "boom"}]
        await page.disconnect()

    run(scenario)


@pytest.mark.django_db(transaction=True)
def test_the_shipper_and_the_server_agree_across_a_reconnect(running, tmp_path, monkeypatch):
    """Files -> LogShipper -> the agent socket -> rows, with a socket that drops mid-way."""
    from django.db import connections

    from trainer_agent.logship import LogShipper

    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    job, nodes = running
    token = nodes[0].issue_token()
    nodes[0].save(update_fields=["agent_token_hash"])
    log_dir = tmp_path / "logs" / job.run_id
    log_dir.mkdir(parents=True)
    written = {rank: [f"rank {rank} line {i} " + "é" * (i % 7) for i in range(300)] for rank in (0, 1)}
    for rank, lines in written.items():
        (log_dir / f"rank-{rank}.out").write_text("".join(line + "\n" for line in lines[:-1]) + lines[-1])
    shipper = LogShipper(window_bytes=4096, frame_bytes=2048, max_line_bytes=64)
    shipper.watch(job.name, job.run_id, log_dir, ranks=[0, 1])

    async def session(frames_to_ack: int | None) -> None:
        agent = await agent_socket(token)
        shipper.on_disconnect()  # what the agent does on every new session
        acked = 0
        while frames_to_ack is None or acked < frames_to_ack:
            frames = shipper.frames()
            if not frames:
                break
            for frame in frames:
                await agent.send_to(text_data=protocol.dumps(frame))
            for _ in frames:
                reply = json.loads(await agent.receive_from(timeout=5))
                assert reply["type"] == "logs_ack" and reply["refused"] is None
                if frames_to_ack is None or acked < frames_to_ack:
                    shipper.on_ack(reply)
                acked += 1
        await agent.disconnect()

    async_to_sync(session)(3)  # some acks lost with the socket
    shipper.finish(job.name, job.run_id)
    async_to_sync(session)(None)
    assert shipper.watching() == []
    for rank, lines in written.items():
        stored = list(JobLogLine.objects.filter(rank=rank).order_by("offset").values_list("text", flat=True))
        assert stored == lines

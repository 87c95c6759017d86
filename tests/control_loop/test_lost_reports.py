"""Reports an agent sent that the server may never have applied (a frame the socket took, lost
with a consumer that died on the frame before it): each job's last ``exit`` goes again after
every hello (trainer_agent/node.py, ``report_exit``) and is applied once, and the hello's replay
includes the acknowledged commands the agent lists as applied, so it sends their ``done``
again (docs/control-loop.md, "At-least-once exits"). A ``steps`` frame is acknowledged only once
stored, so one lost on the way is sent again, and stored once."""

from __future__ import annotations

import contextlib
import json

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.db import transaction
from django.utils import timezone

from jobs import actions
from jobs.consumers import AgentConsumer
from jobs.models import Command, ElasticEvent, EventKind, Job, JobState, Node
from jobs.models.commands import CommandState
from jobs.vocab import CommandKind
from trainer_agent import protocol


@pytest.fixture
def boss(db, django_user_model):
    return django_user_model.objects.create_superuser("boss", "boss@example.com", "boss-pass-1234")


def _placed(user, name: str = "be") -> tuple[Job, Node]:
    """A job placed on n1, its start sent."""
    node = Node.objects.create(name="n1", rack="r0", switch="r0s0", gpu_count=1, last_heartbeat_at=timezone.now())
    actions.submit_job(user, name=name, priority="best_effort", dp=1, dp_min=1, dp_max=1, global_batch=16,
                       micro_batch=2, total_steps=100, step_s=1.0, checkpoint_every_steps=5, checkpoint_save_s=1.0,
                       checkpoint_load_s=1.0, max_restarts=3)
    actions.run_planner_pass("test")
    job = Job.objects.get(name=name)
    actions.claim_commands_for_dispatch(node.id)
    return job, node


def _running(user, name: str = "be") -> tuple[Job, Node]:
    """A job placed on n1, its start acknowledged and done."""
    job, node = _placed(user, name)
    start = Command.objects.get(job=job, kind=CommandKind.START)
    actions.record_command_ack(node, str(start.id))
    actions.record_command_outcome(node, str(start.id), ok=True, outcome={"checkpoint_step": 0})
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING
    return job, node


def _agent_headers(node: Node) -> list[tuple[bytes, bytes]]:
    """A fresh agent token for ``node``, as the socket's headers."""
    token = node.issue_token()
    node.save(update_fields=["agent_token_hash"])
    return [(b"authorization", f"Bearer {token}".encode())]


async def _connected(headers: list[tuple[bytes, bytes]]) -> WebsocketCommunicator:
    """An agent socket, connected and welcomed."""
    communicator = WebsocketCommunicator(AgentConsumer.as_asgi(), protocol.AGENT_PATH, headers=headers)
    assert (await communicator.connect())[0]
    assert (await communicator.receive_json_from(timeout=2))["type"] == protocol.WELCOME
    return communicator


def _events(job: Job, kind: EventKind) -> int:
    return ElasticEvent.objects.filter(job=job, kind=kind).count()


@pytest.mark.django_db
def test_an_exit_sent_again_after_the_hello_completes_the_job_once(boss):
    job, node = _running(boss)
    start = Command.objects.get(job=job, kind=CommandKind.START)
    completed = {"outcome": "completed", "run_id": job.run_id, "leader": True, "step": 100}
    # The first copy died with the consumer; the agent reconnects, lists its start, sends it again.
    actions.record_agent_hello(node, [], applied=[str(start.id)])
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING
    actions.record_worker_exit(node, job.name, completed)
    actions.record_agent_hello(node, [], applied=[str(start.id)])
    actions.record_worker_exit(node, job.name, completed)
    job.refresh_from_db()
    assert job.state == JobState.COMPLETED and job.committed_steps == 100
    assert _events(job, EventKind.COMPLETE) == 1


@pytest.mark.django_db
def test_a_failed_runs_exit_sent_again_restarts_the_job_once(boss):
    job, node = _running(boss)
    failed = {"outcome": "failed", "run_id": job.run_id, "leader": True, "code": 1, "rank": 0,
              "error": "Traceback ...\nValueError: boom"}
    actions.record_worker_exit(node, job.name, failed)
    actions.record_worker_exit(node, job.name, failed)
    job.refresh_from_db()
    assert job.state == JobState.RECOVERING and job.restarts == 1
    assert _events(job, EventKind.RESTART) == 1


@pytest.mark.django_db(transaction=True)
def test_a_hello_that_lists_an_acknowledged_command_gets_it_again_so_its_done_is_resent(boss):
    job, node = _placed(boss)
    start = Command.objects.get(job=job, kind=CommandKind.START)
    actions.record_command_ack(node, str(start.id))  # the ack arrived; the done behind it did not
    headers = _agent_headers(node)

    async def scenario() -> list[dict]:
        communicator = await _connected(headers)
        await communicator.send_to(text_data=json.dumps({
            "type": "hello", "protocol": protocol.PROTOCOL_VERSION, "node": "n1",
            "inventory": {"gpus": [{"index": 0, "model": "simulated", "mem_bytes": 1}], "address": "127.0.0.1"},
            "workers": [{"job": job.name, "state": "running", "step": 3, "gpus": [0], "run_id": job.run_id,
                         "leader": True}],
            "applied": ["not-a-uuid", str(start.id)],
        }))
        frames = [await communicator.receive_json_from(timeout=5)]
        while not await communicator.receive_nothing(timeout=0.5):
            frames.append(await communicator.receive_json_from(timeout=1))
        await communicator.disconnect()
        return frames

    frames = async_to_sync(scenario)()
    assert [(f["type"], f["id"]) for f in frames] == [("command", str(start.id))]
    # The agent answers the repeated id with its cached done: applied now, once.
    actions.record_command_ack(node, str(start.id))
    for _ in range(2):
        actions.record_command_outcome(node, str(start.id), ok=True, outcome={"checkpoint_step": 0})
    assert Command.objects.get(pk=start.pk).state == CommandState.DONE
    assert ElasticEvent.objects.filter(job=job, kind=EventKind.OUTCOME).count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_steps_frame_is_acknowledged_only_once_stored_and_one_sent_again_is_stored_once(boss, monkeypatch):
    from django.db import connections

    from telemetry.models import StepRecord

    # The consumer's worker threads close their connections after each frame, so none is left
    # open on the test database when it is dropped.
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    job, node = _running(boss)
    headers = _agent_headers(node)
    now = timezone.now().timestamp()

    def steps(seq: int, *numbers: int) -> str:
        return json.dumps({"type": "steps", "job": job.name, "boot": "b1", "seq": seq, "sent_at": now,
                           "records": [{"step": n, "step_s": 1.0, "at": now - 10 + n} for n in numbers]})

    def failing(node, batch):
        raise RuntimeError("the database went away under the frame")

    async def scenario() -> list[list[dict]]:
        communicator = await _connected(headers)
        heard = []
        for text, broken in ((steps(1, 1, 2), False), (steps(2, 3), True), (steps(2, 3), False),
                             (steps(1, 1, 2), False)):
            with monkeypatch.context() as patch:
                if broken:  # jobs.agent_api imports it where it is used
                    patch.setattr("telemetry.ingest.ingest_step_batch", failing)
                await communicator.send_to(text_data=text)
                frames = []
                while not await communicator.receive_nothing(timeout=1.0):
                    frames.append(await communicator.receive_json_from(timeout=1))
            heard.append(frames)
        await communicator.disconnect()
        return heard

    heard = async_to_sync(scenario)()
    assert heard == [[{"type": "steps_ack", "seq": 1}], [], [{"type": "steps_ack", "seq": 2}],
                     [{"type": "steps_ack", "seq": 1}]]
    stored = sorted(StepRecord.objects.filter(job=job).values_list("step", flat=True))
    assert stored == [1, 2, 3]  # frame 2 stored when it came again; frame 1's second copy not again
    assert Job.objects.get(pk=job.pk).committed_steps == 3


@pytest.mark.django_db(transaction=True)
def test_a_server_shutting_down_ends_the_consumers_drains_with_it(boss, monkeypatch):
    """daphne stops by cancelling each application instance, with no ``disconnect``: the step and
    log drains must end with their consumer, not be left pending when the loop closes (logged as
    "Task was destroyed but it is pending!" at every demo's Ctrl-C)."""
    import asyncio

    from django.db import connections

    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    job, node = _running(boss)
    headers = _agent_headers(node)
    now = timezone.now().timestamp()

    def drains() -> list[asyncio.Task]:
        return [task for task in asyncio.all_tasks() if "_drain_" in repr(task.get_coro())]

    async def scenario() -> tuple[int, list[asyncio.Task]]:
        communicator = await _connected(headers)
        await communicator.send_json_to({"type": "steps", "job": job.name, "boot": "b1", "seq": 1, "sent_at": now,
                                         "records": [{"step": 1, "step_s": 1.0, "at": now - 5}]})
        assert await communicator.receive_json_from(timeout=2) == {"type": "steps_ack", "seq": 1}
        running = len(drains())
        communicator.future.cancel()  # what daphne's kill_all_applications does
        with contextlib.suppress(asyncio.CancelledError):
            await communicator.future
        return running, [task for task in drains() if not task.done()]

    running, left = async_to_sync(scenario)()
    assert running == 1 and left == []


@pytest.mark.django_db
def test_late_step_records_of_a_job_that_ran_here_are_stored_as_history_and_move_nothing(boss):
    """The agent holds a frame through an outage and sends it after the job left the node (a
    shrink moved its leader, or a preempt's ``done`` came before its last steps): the steps ran,
    so they are stored, but the job's progress and rhythm belong to its run now."""
    from datetime import timedelta

    from jobs.actions._common import kill_and_release
    from jobs.agent_api import handle_frame
    from jobs.models import AllocationSpan, JobRhythm
    from telemetry.models import StepRecord

    job, node = _running(boss)
    stranger = Node.objects.create(name="n2", rack="r0", switch="r0s0", gpu_count=1, last_heartbeat_at=timezone.now())
    now = timezone.now().timestamp()

    def steps(seq: int, *numbers: int, run: str | None = None) -> dict:
        return {"type": "steps", "job": job.name, "boot": "b1", "seq": seq, "sent_at": now,
                "records": [{"step": n, "step_s": 1.0, "at": now - 60 + n, "run": run or job.run_id}
                            for n in numbers]}

    # Still running here, but the records are an older run's (rolled back and relaunched since).
    assert handle_frame(node, steps(1, 7, 8, run="be-old")) == []
    assert handle_frame(node, steps(2, 2)) == []
    job.refresh_from_db()
    assert job.committed_steps == 2
    assert JobRhythm.objects.get(job=job).samples == 1  # the current run's record alone

    with transaction.atomic():
        kill_and_release(Job.objects.select_for_update().get(pk=job.pk))
    assert handle_frame(node, steps(3, 5, 6)) == []
    assert sorted(StepRecord.objects.filter(job=job).values_list("step", flat=True)) == [2, 5, 6, 7, 8]
    job.refresh_from_db()
    assert job.state == JobState.PREEMPTED and job.committed_steps == 0  # the kill's rollback stands
    assert JobRhythm.objects.get(job=job).samples == 1

    # A node the job never ran on may not write its steps.
    (refused,) = handle_frame(stranger, steps(1, 9))
    assert refused["code"] == "stale_records" and "has not run on n2 lately" in refused["message"]
    # Nor the node it left longer ago than LATE_RECORDS_S.
    long_ago = timezone.now() - timedelta(seconds=actions.agents.LATE_RECORDS_S + 60)
    AllocationSpan.objects.filter(job=job).update(started_at=long_ago - timedelta(hours=1), ended_at=long_ago)
    (refused,) = handle_frame(node, steps(4, 10))
    assert refused["code"] == "stale_records"
    assert sorted(StepRecord.objects.filter(job=job).values_list("step", flat=True)) == [2, 5, 6, 7, 8]


@pytest.mark.django_db(transaction=True)  # outside a test transaction, as the consumer's store runs
def test_an_acknowledged_steps_frame_is_committed_durably_not_asynchronously(boss, monkeypatch):
    """Telemetry commits with ``synchronous_commit`` off by default (a crash may lose its last
    moments); a ``steps`` frame is acknowledged and then never sent again, so its store waits
    for the WAL flush."""
    from django.db import connection

    from jobs.agent_api import handle_frame
    from telemetry.ingest import pipeline

    job, node = _running(boss)
    relaxed = []
    real = pipeline.store_batch

    def spy(*args, **kwargs):
        from django.conf import settings

        relaxed.append(settings.OMNI_TELEMETRY_ASYNC_COMMIT and not connection.in_atomic_block)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "store_batch", spy)
    monkeypatch.setattr("django.conf.settings.OMNI_TELEMETRY_ASYNC_COMMIT", True)
    now = timezone.now().timestamp()
    frame = {"type": "steps", "job": job.name, "boot": "b1", "seq": 1, "sent_at": now,
             "records": [{"step": 1, "step_s": 1.0, "at": now}]}
    assert handle_frame(node, frame) == []
    assert relaxed == [False]

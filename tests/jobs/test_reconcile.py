"""Acknowledged commands are not the end of the story (issue 16, item 5): on ``hello`` the
control plane compares what the agent runs with what it placed there and recovers the runs a
restarted agent lost, and a ``start``, ``resume`` or ``resize`` that stays acknowledged without a
``done`` expires and its job recovers."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.utils import timezone

from jobs import actions
from jobs.consumers import AgentConsumer
from jobs.models import Allocation, Command, ElasticEvent, EventKind, Job, JobState, Node
from jobs.models.commands import CommandState
from jobs.vocab import CommandKind
from trainer_agent import protocol


def _nodes(*names: str, gpus: int = 1) -> list[Node]:
    now = timezone.now()
    return [Node.objects.create(name=n, rack="r0", switch="r0s0", gpu_count=gpus, last_heartbeat_at=now)
            for n in names]


def _placed(user, name: str = "be", *, dp: int = 1) -> Job:
    """A job the planner placed: one ``start`` per node, sent to the agents."""
    actions.submit_job(user, name=name, priority="best_effort", dp=dp, dp_min=dp, dp_max=dp, global_batch=16,
                       micro_batch=2, total_steps=100, step_s=1.0, checkpoint_every_steps=5, checkpoint_save_s=1.0,
                       checkpoint_load_s=1.0)
    actions.run_planner_pass("test")
    job = Job.objects.get(name=name)
    assert job.state == JobState.RUNNING
    for node_id in {c.node_id for c in Command.objects.filter(job=job)}:
        actions.claim_commands_for_dispatch(node_id)
    return job


def _start(job: Job, node: Node | None = None) -> Command:
    commands = Command.objects.filter(job=job, kind=CommandKind.START).select_related("node")
    return commands.get(node=node) if node is not None else commands.get(payload__leader=True)


def _worker(job: Job, **extra) -> dict:
    return {"job": job.name, "state": "running", "step": 3, "gpus": [0], "run_id": job.run_id, "leader": True,
            **extra}


def _lost_events(job: Job) -> list[ElasticEvent]:
    return [e for e in ElasticEvent.objects.filter(job=job, kind=EventKind.FAIL) if "reconnected" in e.reason["text"]]


@pytest.fixture
def boss(db, django_user_model):
    return django_user_model.objects.create_superuser("boss", "boss@example.com", "boss-pass-1234")


# -- hello: the agent's workers against what was placed there ---------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("answered", ["acked", "done"])
def test_an_agent_back_without_the_workers_of_a_run_it_acknowledged_sends_the_job_to_recovery(boss, answered):
    (node,) = _nodes("n1")
    job = _placed(boss)
    start = _start(job)
    actions.record_command_ack(node, str(start.id))
    if answered == "done":
        actions.record_command_outcome(node, str(start.id), ok=True, outcome={"checkpoint_step": 0})
    Job.objects.filter(pk=job.pk).update(committed_steps=12, last_checkpoint_step=10)
    run_id = job.run_id

    # The agent was SIGKILLed and restarted: no workers, no memory of any command.
    actions.record_agent_hello(node, [], "10.0.0.1", applied=[])

    job.refresh_from_db()
    assert job.state == JobState.RECOVERING and job.committed_steps == 10
    assert not Allocation.objects.filter(job=job).exists()
    start.refresh_from_db()
    assert start.state == (CommandState.EXPIRED if answered == "acked" else CommandState.DONE)
    if answered == "acked":
        assert "reconnected without it" in start.error
    (event,) = _lost_events(job)
    assert event.actor == "agent:n1" and event.command == start.id
    assert event.reason["text"].startswith(f"n1 reconnected without the workers of job be (run {run_id}): ")
    assert "recovers from step 10 (2 steps lost)" in event.reason["text"]
    assert event.outcome["run_id"] == run_id and event.outcome["steps_lost"] == 2
    # Anything left of the run on the node is fenced.
    assert Command.objects.filter(job=job, node=node, kind=CommandKind.STOP, state=CommandState.PENDING).exists()

    # Idempotent: the job is no longer placed there, a second hello changes nothing.
    events = ElasticEvent.objects.count()
    actions.record_agent_hello(node, [], applied=[])
    assert ElasticEvent.objects.count() == events


@pytest.mark.django_db
def test_the_planner_places_the_lost_job_again_with_a_resume(boss):
    (node,) = _nodes("n1")
    job = _placed(boss)
    actions.record_command_ack(node, str(_start(job).id))
    old_run = job.run_id
    actions.record_agent_hello(node, [], applied=[])
    # The agent answers the fence ("not running"); then the planner places the job again.
    stop = Command.objects.get(job=job, kind=CommandKind.STOP)
    actions.record_command_outcome(node, str(stop.id), ok=True, outcome={"outcome": "not running"})
    actions.run_planner_pass("test")
    job.refresh_from_db()
    assert job.state == JobState.RUNNING and job.run_id != old_run
    resume = Command.objects.get(job=job, kind=CommandKind.RESUME)
    assert resume.node == node and resume.state == CommandState.PENDING and resume.payload["run_id"] == job.run_id


@pytest.mark.django_db
def test_an_agent_back_with_the_workers_of_the_current_run_changes_nothing(boss):
    (node,) = _nodes("n1")
    job = _placed(boss)
    actions.record_command_ack(node, str(_start(job).id))
    events = ElasticEvent.objects.count()
    actions.record_agent_hello(node, [_worker(job)], applied=[])
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING
    assert ElasticEvent.objects.count() == events
    assert _start(job).state == CommandState.ACKED


@pytest.mark.django_db
def test_a_start_still_unacknowledged_is_replayed_not_treated_as_lost(boss):
    (node,) = _nodes("n1")
    job = _placed(boss)
    start = _start(job)
    assert start.state == CommandState.SENT
    actions.record_agent_hello(node, [], applied=[])
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING and not _lost_events(job)
    replay = actions.claim_commands_for_dispatch(node.id, include_sent=True)
    assert [c.id for c in replay] == [start.id]


@pytest.mark.django_db
def test_workers_that_ended_while_the_socket_was_down_wait_for_their_exit_report(boss):
    """The same agent process, reconnected: it lists the start it applied, its workers are gone
    because they finished, and the ``exit`` frame queued meanwhile arrives after the hello."""
    (node,) = _nodes("n1")
    job = _placed(boss)
    start = _start(job)
    actions.record_command_ack(node, str(start.id))
    actions.record_command_outcome(node, str(start.id), ok=True, outcome={"checkpoint_step": 0})
    actions.record_agent_hello(node, [], applied=[str(start.id)])
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING and not _lost_events(job)
    actions.record_worker_exit(node, "be", {"outcome": "completed", "run_id": job.run_id, "leader": True,
                                            "step": 100})
    assert Job.objects.get(pk=job.pk).state == JobState.COMPLETED


@pytest.mark.django_db
def test_a_worker_of_an_older_run_does_not_count_as_the_current_runs(boss):
    (node,) = _nodes("n1")
    job = _placed(boss)
    actions.record_command_ack(node, str(_start(job).id))
    actions.record_agent_hello(node, [_worker(job, run_id="be-0ldrun00")], applied=[])
    assert Job.objects.get(pk=job.pk).state == JobState.RECOVERING and len(_lost_events(job)) == 1


@pytest.mark.django_db
def test_a_restarted_member_node_of_a_two_node_job_recovers_the_whole_job(boss):
    _nodes("n1", "n2")
    job = _placed(boss, dp=2)
    assert sorted(Allocation.objects.filter(job=job).values_list("node__name", flat=True)) == ["n1", "n2"]
    starts = {c.node.name: c for c in Command.objects.filter(job=job, kind=CommandKind.START).select_related("node")}
    for command in starts.values():
        actions.record_command_ack(command.node, str(command.id))
        actions.record_command_outcome(command.node, str(command.id), ok=True, outcome={"checkpoint_step": 0})
    member = next(n for n, c in starts.items() if not c.payload["leader"])
    node = Node.objects.get(name=member)
    # The leader's agent still has its workers; the member's restarted without its share.
    actions.record_agent_hello(node, [], applied=[])
    job.refresh_from_db()
    assert job.state == JobState.RECOVERING
    (event,) = _lost_events(job)
    assert event.reason["text"].startswith(f"{member} reconnected without the workers of job be")
    # Both nodes' ranks are stopped: the leader's cannot go on without the member's.
    assert set(Command.objects.filter(job=job, kind=CommandKind.STOP).values_list("node__name", flat=True)) == {
        "n1", "n2"}


@pytest.mark.django_db
def test_a_resizing_jobs_new_node_that_has_not_been_started_yet_is_not_lost(boss):
    """A grow allocates the new node's GPUs first; its ``resume`` comes after the checkpoint."""
    first, new = _nodes("n1", "n2")
    job = _placed(boss)
    start = _start(job)
    actions.record_command_ack(first, str(start.id))
    actions.record_command_outcome(first, str(start.id), ok=True, outcome={"checkpoint_step": 0})
    Job.objects.filter(pk=job.pk).update(state=JobState.RESIZING)
    Allocation.objects.create(job=job, node=new, gpu_index=0, since=timezone.now())
    actions.record_agent_hello(new, [], applied=[])
    assert Job.objects.get(pk=job.pk).state == JobState.RESIZING and not _lost_events(job)


@pytest.mark.django_db(transaction=True)
def test_a_hello_frame_on_the_socket_recovers_the_lost_run_and_sends_the_fence(boss):
    (node,) = _nodes("n1")
    token = node.issue_token()
    node.save(update_fields=["agent_token_hash"])
    job = _placed(boss)
    start = _start(job)
    actions.record_command_ack(node, str(start.id))
    headers = [(b"authorization", f"Bearer {token}".encode())]

    async def scenario() -> list[dict]:
        communicator = WebsocketCommunicator(AgentConsumer.as_asgi(), protocol.AGENT_PATH, headers=headers)
        assert (await communicator.connect())[0]
        assert (await communicator.receive_json_from(timeout=2))["type"] == protocol.WELCOME
        await communicator.send_to(text_data=json.dumps({
            "type": "hello", "protocol": protocol.PROTOCOL_VERSION, "node": "n1",
            "inventory": {"gpus": [{"index": 0, "model": "simulated", "mem_bytes": 1}], "address": "127.0.0.1"},
            "workers": [], "applied": [],
        }))
        frames = [await communicator.receive_json_from(timeout=5)]
        while not await communicator.receive_nothing(timeout=0.5):
            frames.append(await communicator.receive_json_from(timeout=1))
        await communicator.disconnect()
        return frames

    frames = async_to_sync(scenario)()
    assert {(f["type"], f["kind"], f["job"]) for f in frames} == {("command", "stop", "be")}
    assert Job.objects.get(pk=job.pk).state == JobState.RECOVERING
    assert Command.objects.get(pk=start.pk).state == CommandState.EXPIRED
    assert len(_lost_events(job)) == 1


# -- acknowledged launches that are never done expire ------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("kind", [CommandKind.START, CommandKind.RESUME])
def test_a_launch_acknowledged_but_never_done_expires_after_the_bound_and_the_job_recovers(boss, settings, kind):
    settings.OMNI_COMMAND_DONE_TIMEOUT_S = 120.0
    (node,) = _nodes("n1")
    job = _placed(boss)
    start = _start(job)
    if kind == CommandKind.RESUME:
        Command.objects.filter(pk=start.pk).update(kind=kind)
    actions.record_command_ack(node, str(start.id))
    acked_at = Command.objects.get(pk=start.pk).acked_at

    early = actions.expire_overdue_commands(now=acked_at + timedelta(seconds=119))
    assert early["stalled"] == 0 and Command.objects.get(pk=start.pk).state == CommandState.ACKED

    counts = actions.expire_overdue_commands(now=acked_at + timedelta(seconds=121))
    assert counts["stalled"] == 1
    start.refresh_from_db()
    assert start.state == CommandState.EXPIRED and "never reported done" in start.error
    job.refresh_from_db()
    assert job.state == JobState.RECOVERING and not Allocation.objects.filter(job=job).exists()
    event = ElasticEvent.objects.get(job=job, kind=EventKind.FAIL)
    assert event.command == start.id and event.actor == "system"
    assert event.reason["text"].startswith(f"{kind} of be on n1 expired: acknowledged 121 s ago but never reported done")
    # Once is enough: nothing left to expire.
    assert actions.expire_overdue_commands(now=acked_at + timedelta(days=1))["stalled"] == 0


@pytest.mark.django_db
def test_a_launch_done_in_time_never_expires(boss):
    (node,) = _nodes("n1")
    job = _placed(boss)
    start = _start(job)
    actions.record_command_ack(node, str(start.id))
    actions.record_command_outcome(node, str(start.id), ok=True, outcome={"checkpoint_step": 0})
    assert actions.expire_overdue_commands(now=timezone.now() + timedelta(days=1))["stalled"] == 0
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING


@pytest.mark.django_db
def test_a_member_nodes_stalled_start_also_recovers_the_job(boss, settings):
    _nodes("n1", "n2")
    job = _placed(boss, dp=2)
    leader = _start(job)
    member = Command.objects.get(job=job, kind=CommandKind.START, payload__leader=False)
    for command in (leader, member):
        actions.record_command_ack(command.node, str(command.id))
    actions.record_command_outcome(leader.node, str(leader.id), ok=True, outcome={"checkpoint_step": 0})
    later = timezone.now() + timedelta(seconds=settings.OMNI_COMMAND_DONE_TIMEOUT_S + 1)
    assert actions.expire_overdue_commands(now=later)["stalled"] == 1
    assert Command.objects.get(pk=member.pk).state == CommandState.EXPIRED
    assert Job.objects.get(pk=job.pk).state == JobState.RECOVERING


@pytest.mark.django_db
def test_a_stalled_launch_of_an_older_run_expires_without_touching_the_current_run(boss, settings):
    (node,) = _nodes("n1")
    job = _placed(boss)
    start = _start(job)
    actions.record_command_ack(node, str(start.id))
    Job.objects.filter(pk=job.pk).update(run_id="be-newer000")  # the job moved on to another run
    later = timezone.now() + timedelta(seconds=settings.OMNI_COMMAND_DONE_TIMEOUT_S + 1)
    assert actions.expire_overdue_commands(now=later)["stalled"] == 1
    assert Command.objects.get(pk=start.pk).state == CommandState.EXPIRED
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING
    assert not ElasticEvent.objects.filter(job=job, kind=EventKind.FAIL).exists()


@pytest.mark.django_db
def test_an_acknowledged_resize_waits_for_its_deadline_before_it_expires(boss, settings):
    settings.OMNI_COMMAND_DONE_TIMEOUT_S = 60.0
    (node,) = _nodes("n1")
    job = _placed(boss)
    start = _start(job)
    actions.record_command_ack(node, str(start.id))
    actions.record_command_outcome(node, str(start.id), ok=True, outcome={"checkpoint_step": 0})
    deadline = timezone.now() + timedelta(seconds=600)
    Job.objects.filter(pk=job.pk).update(state=JobState.RESIZING)
    resize = Command.objects.create(node=node, job=job, kind=CommandKind.RESIZE, deadline_at=deadline,
                                    payload={"job": "be", "leader": True, "run_id": job.run_id, "dp_after": 1,
                                             "release": [], "layout": [["n1", 0]]})
    actions.claim_commands_for_dispatch(node.id)
    actions.record_command_ack(node, str(resize.id))
    assert actions.expire_overdue_commands(now=deadline - timedelta(seconds=1))["stalled"] == 0
    assert actions.expire_overdue_commands(now=deadline + timedelta(seconds=1))["stalled"] == 1
    assert Job.objects.get(pk=job.pk).state == JobState.RECOVERING


@pytest.mark.django_db
def test_a_stop_acknowledged_but_never_done_expires_with_its_reason(boss, settings):
    settings.OMNI_COMMAND_DONE_TIMEOUT_S = 60.0
    (node,) = _nodes("n1")
    job = _placed(boss)
    stop = Command.objects.create(node=node, job=job, kind=CommandKind.STOP, payload={"job": "be"})
    actions.claim_commands_for_dispatch(node.id)
    actions.record_command_ack(node, str(stop.id))
    acked_at = Command.objects.get(pk=stop.pk).acked_at
    assert actions.expire_overdue_commands(now=acked_at + timedelta(seconds=59))["stalled"] == 0
    assert actions.expire_overdue_commands(now=acked_at + timedelta(seconds=61))["stalled"] == 1
    stop.refresh_from_db()
    assert stop.state == CommandState.EXPIRED and "never reported done" in stop.error
    assert not ElasticEvent.objects.filter(job=job, kind=EventKind.FAIL).exists()  # a stop is no launch


@pytest.mark.django_db
def test_a_completion_names_a_checkpoint_only_for_a_run_omni_saw_save(boss):
    """An ``omni`` run saves its last step as it ends; a signal-mode script's saves are its own.
    So only the first's ``complete`` row says "checkpoint at step N" and fills the job page's
    checkpoints table; the second's says how far it went."""
    from jobs.live_data import job_checkpoints
    from jobs.live_events import describe_event

    _nodes("n1", "n2")
    omni = _placed(boss, "omni-run")
    actions.submit_job(boss, name="script", priority="best_effort", dp=1, dp_min=1, dp_max=1, global_batch=16,
                       micro_batch=2, total_steps=100, step_s=1.0, integration="signal", entrypoint=["train.py"])
    actions.run_planner_pass("test")
    script = Job.objects.get(name="script")
    assert script.state == JobState.RUNNING
    for job in (omni, script):
        node = Node.objects.get(pk=_start(job).node_id)
        actions.record_worker_exit(node, job.name, {"outcome": "completed", "run_id": job.run_id, "leader": True,
                                                    "step": 100 if job is omni else None})
    rows = {e.job.name: e for e in ElasticEvent.objects.filter(kind=EventKind.COMPLETE).select_related("job")}
    assert describe_event(rows["omni-run"]).endswith("checkpoint at step 100.")
    assert "checkpoint" not in describe_event(rows["script"]) and rows["script"].outcome == {"steps": 100}
    assert [c["step"] for c in job_checkpoints(Job.objects.get(name="omni-run"))] == [100]
    assert job_checkpoints(Job.objects.get(name="script")) == []

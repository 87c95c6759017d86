"""The control loop's actions without processes: planner passes, the command outbox, outcomes,
deadlines and heartbeats, on whatever database the run uses (SQLite in embedded runs)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from trainer_agent import protocol


@pytest.fixture
def boss(db, django_user_model):
    return django_user_model.objects.create_superuser("boss", "boss@example.com", "boss-pass-1234")


def _nodes(*names, gpus=2, heartbeat=True):
    from jobs.models import Node

    now = timezone.now() if heartbeat else None
    return [Node.objects.create(name=n, rack="r0", switch="r0s0", gpu_count=gpus, last_heartbeat_at=now)
            for n in names]


def _submit(user, name, **overrides):
    from jobs import actions

    spec = dict(priority="best_effort", dp=1, global_batch=16, micro_batch=2, total_steps=100, step_s=1.0,
                checkpoint_every_steps=5, checkpoint_save_s=1.0, checkpoint_load_s=1.0)
    spec.update(overrides)
    return actions.submit_job(user, name=name, **spec)


def test_frames_are_validated_with_one_line_reasons():
    with pytest.raises(protocol.ProtocolError) as exc:
        protocol.validate_agent_frame(protocol.parse_frame('{"type": "done", "command": "x"}'))
    assert exc.value.code == "missing_field"
    with pytest.raises(protocol.ProtocolError) as exc:
        protocol.parse_frame("[]")
    assert exc.value.code == "bad_frame"
    frame = protocol.validate_agent_frame(protocol.parse_frame(
        '{"type": "steps", "job": "a", "records": [{"step": 3, "loss": NaN}]}'))
    assert frame["records"][0]["step"] == 3


def test_a_node_without_an_agent_is_not_schedulable_in_the_snapshot(boss):
    from jobs.snapshot import load_snapshot

    _nodes("a1")
    _nodes("a2", heartbeat=False)
    snapshot = load_snapshot(timezone.now())
    assert {n.name: n.health for n in snapshot.nodes} == {"a1": "healthy", "a2": "cordoned"}


def test_a_pass_writes_allocations_commands_and_audit_together_and_dispatches_after_commit(
    boss, django_capture_on_commit_callbacks
):
    from jobs import actions
    from jobs.models import Allocation, Command, ElasticEvent, Job, PlannerRun

    _nodes("a1")
    _submit(boss, "be")
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        result = actions.run_planner_pass("test")
    assert Command.objects.get(job__name="be").state == "pending", "nothing is sent before commit"
    for callback in callbacks:
        callback()
    assert result.run is not None and result.applied == 1
    job = Job.objects.get(name="be")
    assert job.state == "running" and Allocation.objects.filter(job=job).count() == 1
    command = Command.objects.get(job=job)
    assert command.kind == "start" and command.payload["leader"] and command.payload["dp"] == 1
    # Dispatched on commit: marked sent, one attempt.
    assert command.state == "sent" and command.attempts == 1
    decision = ElasticEvent.objects.get(command=command.id)
    assert decision.kind == "place" and decision.actor == "planner" and decision.planner_run == result.run.id
    assert PlannerRun.objects.get(id=result.run.id).summary["applied"] == 1


def test_acks_and_outcomes_apply_once_and_foreign_ids_are_refused(boss):
    from jobs import actions
    from jobs.models import Command, ElasticEvent, EventKind

    node, other = _nodes("a1", "a2")
    _submit(boss, "be")
    actions.run_planner_pass("test")
    command = Command.objects.get(job__name="be")
    with pytest.raises(actions.UnknownCommand):
        actions.record_command_ack(other if command.node_id == node.id else node, str(command.id))
    holder = command.node
    actions.record_command_ack(holder, str(command.id))
    actions.record_command_ack(holder, str(command.id))
    actions.record_command_outcome(holder, str(command.id), ok=True, outcome={"checkpoint_step": 0})
    actions.record_command_outcome(holder, str(command.id), ok=True, outcome={"checkpoint_step": 0})
    command.refresh_from_db()
    assert command.state == "done"
    assert ElasticEvent.objects.filter(command=command.id, kind=EventKind.ACK).count() == 1
    assert ElasticEvent.objects.filter(command=command.id, kind=EventKind.OUTCOME).count() == 1


def _run_until_running(boss, name, **overrides):
    from jobs import actions
    from jobs.models import Command

    _submit(boss, name, **overrides)
    actions.run_planner_pass("test")
    command = Command.objects.get(job__name=name, kind="start")
    actions.record_command_outcome(command.node, str(command.id), ok=True, outcome={})
    return command.node


def _preempt(job):
    """Drive a graceful preempt through the same path a planner action takes."""
    from django.db import transaction

    from jobs.actions.planner_pass import _apply_action
    from jobs.models import Node, PlannerRun
    from jobs.planner.decisions import Action, Reason
    from jobs.planner.snapshot import Gpu

    run = PlannerRun.objects.create(trigger="test")
    gpus = tuple(Gpu(a.node.name, a.gpu_index) for a in job.allocations.select_related("node"))
    action = Action(kind="preempt", job=job.name, reason=Reason("test", "preempted by the test"),
                    gpus_before=gpus, deadline_s=(timezone.now() + timedelta(seconds=60)).timestamp())
    with transaction.atomic():
        _apply_action(action, run=run, now=timezone.now(), nodes={n.name: n for n in Node.objects.all()},
                      pools={}, touched=set())


def test_preempted_gpus_stay_held_until_the_checkpoint_is_confirmed(boss):
    from jobs import actions
    from jobs.models import Allocation, Command, Job

    _nodes("a1")
    node = _run_until_running(boss, "be")
    job = Job.objects.get(name="be")
    Job.objects.filter(pk=job.pk).update(committed_steps=7)
    _preempt(job)
    job.refresh_from_db()
    assert job.state == "checkpointing" and Allocation.objects.filter(job=job).exists()
    preempt = Command.objects.get(job=job, kind="preempt")
    actions.record_command_outcome(node, str(preempt.id), ok=True, outcome={"checkpoint_step": 7, "save_s": 0.4})
    job.refresh_from_db()
    assert job.state == "preempted" and job.last_checkpoint_step == 7 and job.committed_steps == 7
    assert not Allocation.objects.filter(job=job).exists()
    assert job.measured_save_s == pytest.approx(0.4)


def test_the_audit_says_a_rank_failed_after_the_checkpoint_and_nothing_was_lost(boss):
    """A rank that aborted in teardown after the checkpoint (trainer_agent.workers.failed_after_finish):
    the preempt is clean and its audit row says so."""
    from jobs import actions
    from jobs.models import Command, ElasticEvent, Job

    _nodes("a1")
    node = _run_until_running(boss, "lib")
    job = Job.objects.get(name="lib")
    Job.objects.filter(pk=job.pk).update(committed_steps=7)
    _preempt(job)
    preempt = Command.objects.get(job=job, kind="preempt")
    teardown = "rank 1 exited with signal 6 after the run had ended at step 7"
    actions.record_command_outcome(node, str(preempt.id), ok=True,
                                   outcome={"checkpoint_step": 7, "step": 7, "save_s": 0.4, "teardown": teardown})
    job.refresh_from_db()
    assert job.state == "preempted" and job.last_checkpoint_step == 7
    row = ElasticEvent.objects.filter(job=job, kind="outcome").latest("id")
    assert f"checkpoint at step 7 saved, GPUs released ({teardown}: nothing lost)" in row.reason["text"]


def test_a_preempt_past_its_deadline_is_recorded_as_a_kill_with_the_steps_lost(boss):
    from jobs import actions
    from jobs.models import Allocation, Command, ElasticEvent, EventKind, Job

    _nodes("a1")
    _run_until_running(boss, "be")
    job = Job.objects.get(name="be")
    Job.objects.filter(pk=job.pk).update(committed_steps=9, last_checkpoint_step=5)
    _preempt(Job.objects.get(pk=job.pk))
    preempt = Command.objects.get(job=job, kind="preempt")
    counts = actions.expire_overdue_commands(now=preempt.deadline_at + timedelta(seconds=1))
    assert counts["killed"] == 1
    job.refresh_from_db()
    assert job.state == "preempted" and job.committed_steps == 5
    assert not Allocation.objects.filter(job=job).exists()
    kill = ElasticEvent.objects.get(kind=EventKind.KILL, job=job)
    assert kill.outcome["steps_lost"] == 4
    assert Command.objects.filter(job=job, kind="stop").exists()


def test_unacknowledged_commands_are_retried_then_expire_and_the_job_recovers(boss, settings):
    from jobs import actions
    from jobs.models import Command, Job

    _nodes("a1")
    _submit(boss, "be")
    actions.run_planner_pass("test")
    command = Command.objects.get(job__name="be")
    actions.claim_commands_for_dispatch(command.node_id)
    later = timezone.now()
    for attempt in range(settings.OMNI_COMMAND_MAX_ATTEMPTS):
        later += timedelta(seconds=settings.OMNI_COMMAND_ACK_TIMEOUT_S + 1)
        Command.objects.filter(pk=command.pk).update(sent_at=later - timedelta(seconds=settings.OMNI_COMMAND_ACK_TIMEOUT_S + 1))
        counts = actions.expire_overdue_commands(now=later)
        command.refresh_from_db()
        if attempt < settings.OMNI_COMMAND_MAX_ATTEMPTS - 1:
            assert counts["retried"] == 1
            actions.claim_commands_for_dispatch(command.node_id)
    assert command.state == "expired"
    assert Job.objects.get(name="be").state in ("recovering", "running")  # recovering, or re-placed at once


def test_silent_nodes_go_suspect_then_failed_and_their_jobs_recover(boss, settings):
    from jobs import actions
    from jobs.models import ElasticEvent, EventKind, Job, Node

    _nodes("a1")
    _run_until_running(boss, "be")
    node = Node.objects.get(name="a1")
    interval = settings.OMNI_HEARTBEAT_INTERVAL_S
    # Half an interval late is jitter (a loaded agent or server), not yet a missed heartbeat.
    suspect, failed = actions.heartbeat_verdicts(node.last_heartbeat_at + timedelta(seconds=1.6 * interval))
    assert not suspect and not failed
    suspect, failed = actions.heartbeat_verdicts(node.last_heartbeat_at + timedelta(seconds=2.1 * interval))
    assert [n.name for n, _ in suspect] == ["a1"] and not failed
    actions.mark_node_suspect(node, 2.1 * interval)
    suspect, failed = actions.heartbeat_verdicts(node.last_heartbeat_at + timedelta(seconds=3 * interval))
    assert [n.name for n, _ in failed] == ["a1"]
    actions.mark_node_failed(node, 3 * interval)
    assert Node.objects.get(name="a1").state == "failed"
    job = Job.objects.get(name="be")
    assert job.state == "recovering" and not job.allocations.exists()
    assert ElasticEvent.objects.filter(kind=EventKind.NODE_FAILED, job=job).exists()
    # A heartbeat does not bring a failed node back: an operator must.
    actions.record_heartbeat(Node.objects.get(name="a1"), [])
    assert Node.objects.get(name="a1").state == "failed"


def test_most_nodes_silent_at_once_is_a_control_plane_outage_not_their_failure(boss, settings):
    from jobs import actions
    from jobs.models import Node

    _nodes("m1", "m2", "m3")
    interval = settings.OMNI_HEARTBEAT_INTERVAL_S
    last = Node.objects.get(name="m1").last_heartbeat_at
    Node.objects.filter(name="m3").update(last_heartbeat_at=last + timedelta(seconds=2.6 * interval))
    # m1 and m2 (2 of 3) silent past the failure delay: the server's outage, they stay suspect.
    at = last + timedelta(seconds=3 * interval)
    suspect, failed = actions.heartbeat_verdicts(at)
    assert not failed and sorted(n.name for n, _ in suspect) == ["m1", "m2"]
    # Silent for patience x the delay, they fail after all.
    patience = settings.OMNI_HEARTBEAT_OUTAGE_PATIENCE * settings.OMNI_HEARTBEAT_MISSES * interval
    suspect, failed = actions.heartbeat_verdicts(last + timedelta(seconds=patience + interval))
    assert sorted(n.name for n, _ in failed) == ["m1", "m2", "m3"]
    # One node of three silent is that node's failure, as before (with no outage remembered: this
    # one's silence began with the outage above, which would keep it suspect).
    actions.nodes.forget_outage()
    Node.objects.filter(name="m2").update(last_heartbeat_at=at)
    Node.objects.filter(name="m3").update(last_heartbeat_at=at)
    suspect, failed = actions.heartbeat_verdicts(at + timedelta(seconds=interval))
    assert [n.name for n, _ in failed] == ["m1"]
    # Turned off, the old verdict.
    settings.OMNI_HEARTBEAT_MASS_SILENCE = 1.0
    Node.objects.filter(name="m2").update(last_heartbeat_at=last)
    suspect, failed = actions.heartbeat_verdicts(at)
    assert sorted(n.name for n, _ in failed) == ["m1", "m2"]


def test_the_last_nodes_of_an_outage_do_not_fail_alone_as_the_others_are_heard_again(boss, settings):
    """Nodes are heard again one by one after an outage: the last silent ones fall below the
    share but their silence began with the outage, so they stay suspect; a node heard after the
    outage and silent since fails on its own, as does one silent since long before."""
    from jobs import actions
    from jobs.actions.nodes import monitor_tick_s
    from jobs.models import Node

    _nodes("t1", "t2", "t3", "t4", "t5")
    interval = settings.OMNI_HEARTBEAT_INTERVAL_S
    last = Node.objects.get(name="t1").last_heartbeat_at
    fail_after = interval * settings.OMNI_HEARTBEAT_MISSES - monitor_tick_s()
    # All five silent: an outage, seen by the monitor.
    during = last + timedelta(seconds=fail_after - interval)
    suspect, failed = actions.heartbeat_verdicts(during)
    assert not failed and len(suspect) == 5
    # The server is back: t1-t3 are heard again; t4 and t5 (2 of 5, below the share) pass the delay.
    after = last + timedelta(seconds=fail_after + 0.5 * interval)
    Node.objects.filter(name__in=["t1", "t2", "t3"]).update(last_heartbeat_at=after)
    suspect, failed = actions.heartbeat_verdicts(after)
    assert not failed, "the outage's tail failed alone"
    # Without the outage remembered (a fresh monitor), they would have failed: the old verdict.
    actions.nodes.forget_outage()
    suspect, failed = actions.heartbeat_verdicts(after)
    assert sorted(n.name for n, _ in failed) == ["t4", "t5"]
    # Remembered again; a node heard after the outage and silent since fails on its own.
    actions.heartbeat_verdicts(during)
    Node.objects.filter(name__in=["t4", "t5"]).update(last_heartbeat_at=after)
    later = after + timedelta(seconds=fail_after + 0.5 * interval)
    Node.objects.filter(name__in=["t1", "t2", "t4", "t5"]).update(last_heartbeat_at=later)
    suspect, failed = actions.heartbeat_verdicts(later)
    assert [n.name for n, _ in failed] == ["t3"]


def test_an_outage_is_one_even_when_the_silent_nodes_cross_the_failure_delay_one_by_one(boss, settings):
    """Their last heartbeats are spread over an interval, so in an outage the first node is past
    the failure delay while the others have only missed a beat or two: all stay suspect."""
    from jobs import actions
    from jobs.actions.nodes import monitor_tick_s
    from jobs.models import Node

    _nodes("o1", "o2", "o3", "o4")
    interval = settings.OMNI_HEARTBEAT_INTERVAL_S
    last = Node.objects.get(name="o1").last_heartbeat_at
    for i, name in enumerate(("o2", "o3", "o4"), 1):
        Node.objects.filter(name=name).update(last_heartbeat_at=last + timedelta(seconds=0.3 * i * interval))
    fail_after = interval * settings.OMNI_HEARTBEAT_MISSES - monitor_tick_s()
    at = last + timedelta(seconds=fail_after + 0.05 * interval)  # o1 alone past the delay
    suspect, failed = actions.heartbeat_verdicts(at)
    assert not failed and sorted(n.name for n, _ in suspect) == ["o1", "o2", "o3", "o4"]


def test_a_control_plane_back_after_a_long_stop_counts_silence_from_its_return(boss, settings):
    """Silence the monitor did not watch is not the nodes' (found 2026-12-07 running ``make demo``
    again on its database ten minutes after stopping it: every node failed at the first tick, as
    their agents reconnected, and seven jobs waited to recover for ever). A node still silent a
    failure delay after the monitor is back fails then; one heard meanwhile never does; a monitor
    that keeps ticking keeps its start."""
    from jobs import actions
    from jobs.actions.nodes import monitor_tick_s
    from jobs.models import Node

    _nodes("b1", "b2", "b3")
    interval = settings.OMNI_HEARTBEAT_INTERVAL_S
    fail_after = interval * settings.OMNI_HEARTBEAT_MISSES - monitor_tick_s()
    last = Node.objects.get(name="b1").last_heartbeat_at
    back = last + timedelta(minutes=10)  # the control plane was away; no monitor ran meanwhile

    def tick(at):
        return actions.heartbeat_verdicts(at, actions.monitor_watching_since(at))

    # Judged on the last heartbeats alone (before), all three fail at once.
    assert len(actions.heartbeat_verdicts(back)[1]) == 3
    actions.nodes.forget_outage()
    suspect, failed = tick(back)
    assert not suspect and not failed
    Node.objects.filter(name__in=["b1", "b2"]).update(last_heartbeat_at=back + timedelta(seconds=1))
    at = back
    while at < back + timedelta(seconds=fail_after + 0.5 * interval):  # ticking as the monitor does
        at += timedelta(seconds=monitor_tick_s())
        suspect, failed = tick(at)
        Node.objects.filter(name__in=["b1", "b2"]).update(last_heartbeat_at=at)
        if failed:
            break
    assert [n.name for n, _ in failed] == ["b3"]
    assert (at - back).total_seconds() >= fail_after
    assert actions.monitor_watching_since(at + timedelta(seconds=monitor_tick_s())) == back


def test_an_unreadable_outage_memory_judges_by_the_nodes_silent_now(boss, settings, monkeypatch, caplog):
    """Redis away (restarting): the verdict falls back to the nodes silent now, and says so."""
    from django.core.cache import caches

    from jobs import actions
    from jobs.models import Node

    def refuse(*args, **kwargs):
        raise ConnectionError("Error 111 connecting to 127.0.0.1:6379")

    store = caches["throttle"]
    monkeypatch.setattr(store, "get", refuse)
    monkeypatch.setattr(store, "set", refuse)
    _nodes("u1", "u2", "u3")
    interval = settings.OMNI_HEARTBEAT_INTERVAL_S
    last = Node.objects.get(name="u1").last_heartbeat_at
    suspect, failed = actions.heartbeat_verdicts(last + timedelta(seconds=3 * interval))
    assert not failed and len(suspect) == 3  # still an outage: all three silent at once
    assert "outage memory" in caplog.text

"""Checkpoint storage hygiene on the server (docs/storage.md): heartbeats report the runs dir's
free space, no new work lands on a node low on disk, the console says so, and the run dirs of
cancelled and failed jobs are removed after retention by an audited ``clean`` command."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import actions
from jobs.actions import housekeeping
from jobs.live_events import node_summary
from jobs.models import Command, ElasticEvent, EventKind, Job, JobState, Node
from jobs.models.commands import CommandState
from jobs.planner import plan
from jobs.snapshot import load_snapshot
from jobs.vocab import CommandKind
from omniweb.scheduled import PERIODIC_TASKS
from tests.planner.factory import cluster, gpus_on, job, snapshot

GIB = 1024**3
TOTAL = 2 * 1024**4


def _nodes(count: int = 2, gpus: int = 4) -> list[Node]:
    now = timezone.now()
    return [Node.objects.create(name=f"n{i}", rack="r0", switch="r0s0", gpu_count=gpus, last_heartbeat_at=now)
            for i in range(count)]


def _report(node: Node, free_bytes: int, total_bytes: int = TOTAL) -> None:
    actions.record_heartbeat(node, [], disk={"free_bytes": free_bytes, "total_bytes": total_bytes})


def _nodes_of(job: Job) -> set[str]:
    return set(job.allocations.values_list("node__name", flat=True))


# -- the planner, pure -----------------------------------------------------------------------


def _low(nodes, name: str, free: int = int(1.2 * GIB)):
    """``nodes`` with ``name`` low on disk, as production's snapshot marks it."""
    return tuple(replace(n, low_disk=True, disk_free_bytes=free) if n.name == name else n for n in nodes)


def test_the_planner_places_nothing_on_a_node_low_on_disk() -> None:
    nodes = _low(cluster(switches=1, per_switch=2), "r0s0n0")
    result = plan(snapshot(nodes, [job("a"), job("b")]), 100.0)
    (place,) = result.by_kind("place")
    assert {g.node for g in place.gpus_after} == {"r0s0n1"}
    (hold,) = result.by_kind("hold")
    assert "8 GPUs are free on r0s0n0, but no new work goes there: r0s0n0 has 1.2 GiB free in its runs dir, " \
           "under the 2 GiB minimum" in hold.reason.text
    assert hold.reason.inputs["low_disk_nodes"] == ["r0s0n0"]


def test_work_running_on_a_node_low_on_disk_keeps_running_and_frees_nothing_for_others() -> None:
    nodes = _low(cluster(switches=1, per_switch=2), "r0s0n0")
    running = job("be", "best_effort", gpus=gpus_on("r0s0n0"))
    busy = job("reg", "regular", gpus=gpus_on("r0s0n1"), min_run_s=7200.0, run_started_s=50.0)
    result = plan(snapshot(nodes, [running, busy, job("crit", "critical")]), 100.0)
    # Stopping "be" would free GPUs no job may be placed on: it keeps running, crit waits.
    assert [(a.kind, a.job) for a in result.actions] == [("hold", "crit")]


def test_several_nodes_low_on_disk_read_as_one_phrase() -> None:
    nodes = _low(_low(cluster(switches=1, per_switch=2), "r0s0n0"), "r0s0n1", free=700 * 1024**2)
    (hold,) = plan(snapshot(nodes, [job("a")]), 100.0).actions
    assert "16 GPUs are free on 2 nodes, but no new work goes there: their runs dirs have less than the 2 GiB " \
           "minimum free (r0s0n0 1.2 GiB and r0s0n1 700 MiB)" in hold.reason.text


# -- heartbeats ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_heartbeat_stores_the_runs_dir_space() -> None:
    (node,) = _nodes(1)
    _report(node, 41 * GIB)
    node.refresh_from_db()
    assert (node.disk_free_bytes, node.disk_total_bytes) == (41 * GIB, TOTAL)


@pytest.mark.django_db
@pytest.mark.parametrize("disk", [
    None, "41G", [1, 2], {"free_bytes": "1", "total_bytes": 2}, {"free_bytes": True, "total_bytes": 2},
    {"free_bytes": -1, "total_bytes": 2}, {"free_bytes": 3, "total_bytes": 2}, {"free_bytes": 1},
    {"free_bytes": 1.5, "total_bytes": 2}, {"free_bytes": 1, "total_bytes": 2**70},
])
def test_a_heartbeat_without_a_usable_disk_report_keeps_the_last_good_one(disk) -> None:
    (node,) = _nodes(1)
    _report(node, 41 * GIB)
    actions.record_heartbeat(node, [], disk=disk)
    node.refresh_from_db()
    assert (node.disk_free_bytes, node.disk_total_bytes) == (41 * GIB, TOTAL)
    assert node.last_heartbeat_at is not None


# -- the production pass ---------------------------------------------------------------------


@pytest.mark.django_db
def test_the_production_pass_places_nothing_on_a_node_low_on_disk(make_job) -> None:
    low, roomy = _nodes(2)
    _report(low, GIB)
    _report(roomy, 100 * GIB)
    first = make_job(name="first", dp=4, dp_min=4, dp_max=4)
    actions.run_planner_pass("test")
    first.refresh_from_db()
    assert first.state == JobState.RUNNING and _nodes_of(first) == {"n1"}
    second = make_job(name="second", dp=4, dp_min=4, dp_max=4)
    actions.run_planner_pass("test")
    second.refresh_from_db()
    assert second.state == JobState.PENDING and second.pending_cause == "capacity"
    assert "4 GPUs are free on n0, but no new work goes there: n0 has 1 GiB free in its runs dir, under the " \
           "2 GiB minimum" in second.pending_reason
    # Room again: the next pass places it there.
    _report(low, 10 * GIB)
    actions.run_planner_pass("test")
    second.refresh_from_db()
    assert second.state == JobState.RUNNING and _nodes_of(second) == {"n0"}


@pytest.mark.django_db
def test_a_job_on_a_node_that_runs_low_on_disk_keeps_running(make_job) -> None:
    (node,) = _nodes(1)
    running = make_job(name="running", dp=4, dp_min=4, dp_max=4)
    actions.run_planner_pass("test")
    commands = Command.objects.count()
    _report(node, 100 * 1024**2)
    actions.run_planner_pass("test")
    running.refresh_from_db()
    assert running.state == JobState.RUNNING and Command.objects.count() == commands


@pytest.mark.django_db
def test_the_threshold_is_a_setting(settings, make_job) -> None:
    settings.OMNI_MIN_FREE_DISK_BYTES = 0
    (node,) = _nodes(1)
    _report(node, 0)
    make_job(name="anywhere", dp=4, dp_min=4, dp_max=4)
    actions.run_planner_pass("test")
    assert Job.objects.get(name="anywhere").state == JobState.RUNNING


# -- what the operator sees ------------------------------------------------------------------


@pytest.mark.django_db
def test_the_console_shows_free_space_and_flags_a_node_low_on_disk(client, operator) -> None:
    low, roomy, silent = _nodes(3)
    _report(low, int(1.2 * GIB))
    _report(roomy, 41 * GIB)
    client.force_login(operator)
    page = client.get("/console/").content.decode()
    assert 'data-disk="41 GiB free of 2 TiB"' in page
    assert "n0 · Healthy · low disk: no new placements (1.2 GiB free in its runs dir, under the 2 GiB minimum)" in page
    assert page.count(">low disk</span>") == 1
    low.refresh_from_db()
    silent.refresh_from_db()
    assert node_summary(low, {})["disk"] == {
        "free_bytes": int(1.2 * GIB), "total_bytes": TOTAL, "text": "1.2 GiB free of 2 TiB", "low": True,
        "warning": "low disk: no new placements (1.2 GiB free in its runs dir, under the 2 GiB minimum)",
    }
    assert node_summary(silent, {})["disk"] is None


# -- run dirs past retention -----------------------------------------------------------------


@pytest.fixture
def cancelled(settings, researcher, make_job):
    """A job that ran on n1 (n0 is full) and was cancelled; retention 0, so it is due now."""
    settings.OMNI_RUN_DIR_RETENTION_S = 0
    _nodes(2)
    make_job(name="filler", dp=4, dp_min=4, dp_max=4)
    actions.run_planner_pass("test")
    victim = make_job(name="ablation-a", dp=4, dp_min=4, dp_max=4)
    actions.run_planner_pass("test")
    assert _nodes_of(Job.objects.get(name="ablation-a")) == {"n1"}
    return actions.cancel_job(victim, researcher)


def _cleans(job: Job) -> list[Command]:
    return list(Command.objects.filter(job=job, kind=CommandKind.CLEAN).order_by("created_at"))


@pytest.mark.django_db
def test_the_sweep_asks_the_node_the_job_last_ran_on_to_remove_its_run_dir(cancelled) -> None:
    (command,) = actions.sweep_run_dirs()
    assert (command.kind, command.node.name, command.payload) == ("clean", "n1", {"job": "ablation-a", "clean": True})
    assert _cleans(cancelled) == [command]
    # One open clean at a time: the next sweep writes nothing.
    assert actions.sweep_run_dirs() == []


@pytest.mark.django_db
def test_the_sweep_skips_jobs_that_are_kept_or_not_due(settings, researcher, make_job, cancelled) -> None:
    never_ran = make_job(name="never-ran", dp=4, dp_min=4, dp_max=4)
    actions.cancel_job(never_ran, researcher)
    settings.OMNI_RUN_DIR_RETENTION_S = 3600
    assert actions.sweep_run_dirs() == []
    settings.OMNI_RUN_DIR_RETENTION_S = 0
    assert [c.job.name for c in actions.sweep_run_dirs()] == ["ablation-a"]  # not "filler" (running)


@pytest.mark.django_db
def test_the_sweep_uses_another_connected_node_when_that_one_is_down(cancelled, operator) -> None:
    actions.cordon_node(Node.objects.get(name="n1"), operator)
    (command,) = actions.sweep_run_dirs()
    assert command.node.name == "n0"
    Node.objects.update(last_heartbeat_at=timezone.now() - timedelta(hours=1))
    Command.objects.filter(kind=CommandKind.CLEAN).delete()
    assert actions.sweep_run_dirs() == []  # no agent to ask


@pytest.mark.django_db
def test_a_clean_is_not_a_launch(cancelled) -> None:
    (command,) = actions.sweep_run_dirs()
    assert all(c.kind != "clean" for c in load_snapshot(timezone.now()).commands)
    actions.record_command_ack(command.node, str(command.id))
    assert not ElasticEvent.objects.filter(kind=EventKind.ACK, command=command.id).exists()
    cancelled.refresh_from_db()
    assert cancelled.state == JobState.CANCELLED


@pytest.mark.django_db
def test_the_agents_answer_is_audited_once(cancelled) -> None:
    (command,) = actions.sweep_run_dirs()
    node = command.node
    actions.record_command_outcome(node, str(command.id), ok=True,
                                   outcome={"removed": True, "bytes_freed": int(1.2 * GIB)})
    cancelled.refresh_from_db()
    assert cancelled.run_dir_removed_at is not None and cancelled.state == JobState.CANCELLED
    (row,) = ElasticEvent.objects.filter(kind=EventKind.RUN_DIR_REMOVED)
    assert (row.job_id, row.actor, row.command, row.nodes_after) == (cancelled.pk, "agent:n1", command.id, ["n1"])
    assert row.reason["text"] == "n1 removed the run dir of ablation-a (1.2 GiB freed); the job was cancelled 0 s ago."
    assert row.outcome == {"removed": True, "bytes_freed": int(1.2 * GIB)}
    # A repeated answer and later sweeps change nothing.
    actions.record_command_outcome(node, str(command.id), ok=True, outcome={"removed": True, "bytes_freed": 1})
    assert ElasticEvent.objects.filter(kind=EventKind.RUN_DIR_REMOVED).count() == 1
    assert actions.sweep_run_dirs() == []


@pytest.mark.django_db
def test_nothing_to_remove_is_recorded_too(cancelled) -> None:
    (command,) = actions.sweep_run_dirs()
    actions.record_command_outcome(command.node, str(command.id), ok=True,
                                   outcome={"removed": False, "bytes_freed": 0})
    (row,) = ElasticEvent.objects.filter(kind=EventKind.RUN_DIR_REMOVED)
    assert row.reason["text"] == "n1 found no run dir of ablation-a to remove; the job was cancelled 0 s ago."


@pytest.mark.django_db
def test_a_failed_clean_is_tried_again_later(cancelled, monkeypatch) -> None:
    (command,) = actions.sweep_run_dirs()
    actions.record_command_outcome(command.node, str(command.id), ok=False,
                                   outcome={"error": "ablation-a still has live ranks on n1; not removed"})
    cancelled.refresh_from_db()
    assert cancelled.run_dir_removed_at is None
    assert not ElasticEvent.objects.filter(kind=EventKind.RUN_DIR_REMOVED).exists()
    assert actions.sweep_run_dirs() == []  # not at once
    monkeypatch.setattr(housekeeping, "CLEAN_RETRY_S", 0.0)
    assert [c.node.name for c in actions.sweep_run_dirs()] == ["n1"]


@pytest.mark.django_db
def test_the_periodic_task_sends_the_commands(cancelled) -> None:
    from jobs.tasks import sweep_run_dirs

    assert "jobs.sweep_run_dirs" in {t.name for t in PERIODIC_TASKS}
    sweep_run_dirs()
    (command,) = _cleans(cancelled)
    assert command.state == CommandState.SENT

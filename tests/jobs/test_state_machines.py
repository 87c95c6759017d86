"""Every illegal move of every state machine is refused with a clear error, and legal ones work."""

from __future__ import annotations

import itertools

import pytest

from jobs.models import Command, CommandKind, IllegalTransition, Job, JobState, Node, NodeState
from jobs.models.cluster import NODE_TRANSITIONS
from jobs.models.commands import COMMAND_TRANSITIONS
from jobs.models.jobs import JOB_TRANSITIONS


def _pairs(table, states, legal: bool):
    return [(a, b) for a, b in itertools.product(states, states) if (b in table[a]) == legal]


@pytest.mark.parametrize(("current", "target"), _pairs(JOB_TRANSITIONS, JobState.values, legal=False))
def test_job_refuses_every_illegal_move(current, target):
    job = Job(name="j", state=current)
    with pytest.raises(IllegalTransition) as info:
        job.transition_to(target)
    assert f"from {current!r} to {target!r}" in str(info.value)
    assert job.state == current


@pytest.mark.parametrize(("current", "target"), _pairs(JOB_TRANSITIONS, JobState.values, legal=True))
def test_job_allows_every_legal_move(current, target):
    job = Job(name="j", state=current)
    job.transition_to(target)
    assert job.state == target


def test_terminal_job_states_allow_nothing():
    for state in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED):
        with pytest.raises(IllegalTransition, match="terminal state"):
            Job(name="j", state=state).transition_to(JobState.RUNNING)


def test_running_stamps_start_and_terminal_stamps_finish():
    job = Job(name="j", state=JobState.PENDING)
    job.transition_to(JobState.RUNNING)
    assert job.started_at is not None and job.first_started_at == job.started_at
    job.transition_to(JobState.COMPLETED)
    assert job.finished_at is not None


@pytest.mark.parametrize(("current", "target"), _pairs(NODE_TRANSITIONS, NodeState.values, legal=False))
def test_node_refuses_every_illegal_move(current, target):
    node = Node(name="n", state=current)
    with pytest.raises(IllegalTransition):
        node.transition_to(target)
    assert node.state == current


def test_failed_node_comes_back_only_as_healthy_or_cordoned():
    assert NODE_TRANSITIONS[NodeState.FAILED] == {NodeState.HEALTHY, NodeState.CORDONED}


@pytest.mark.parametrize(
    ("current", "target"), _pairs(COMMAND_TRANSITIONS, [s for s, _ in Command._meta.get_field("state").choices], False)
)
def test_command_refuses_every_illegal_move(current, target):
    command = Command(kind=CommandKind.START, state=current)
    with pytest.raises(IllegalTransition):
        command.transition_to(target)


def test_sending_a_command_counts_an_attempt_and_stamps_times():
    command = Command(kind=CommandKind.PREEMPT)
    command.transition_to("sent")
    command.transition_to("pending")  # not acknowledged in time: back for a retry
    command.transition_to("sent")
    assert command.attempts == 2 and command.sent_at is not None
    command.transition_to("acked")
    command.transition_to("done")
    assert command.acked_at is not None and command.finished_at is not None


def test_a_stop_or_fault_stamps_when_the_wait_began_and_the_next_run_keeps_it():
    # The planner reads what a run waited for (a promoted best-effort job's minimum run): the
    # wait begins at the stop (or the fault), and the run after it keeps that time.
    job = Job(name="j", state=JobState.PENDING)
    assert job.queued_at is None  # since its submission
    job.transition_to(JobState.RUNNING)
    assert job.queued_at is None
    job.transition_to(JobState.CHECKPOINTING)
    assert job.queued_at is None
    job.transition_to(JobState.PREEMPTED)
    stopped = job.queued_at
    assert stopped is not None and stopped == job.state_changed_at
    job.transition_to(JobState.RUNNING)
    assert job.queued_at == stopped and job.started_at >= stopped
    job.transition_to(JobState.RECOVERING)
    assert job.queued_at > stopped

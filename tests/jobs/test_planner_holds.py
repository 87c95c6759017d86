"""Holds in production (jobs.actions.planner_pass._hold): one audit row per reason, not per pass;
``Job.pending_since`` says since when; the sentences give clock times, never epoch seconds."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import actions
from jobs.models import ElasticEvent, EventKind, Job, JobState, Node

pytestmark = pytest.mark.django_db

EPOCH_T = re.compile(r"t=\d{9,}s")


def _nodes(count: int = 1, gpus: int = 4) -> list[Node]:
    now = timezone.now()
    return [Node.objects.create(name=f"n{i}", rack="r0", switch="r0s0", gpu_count=gpus, last_heartbeat_at=now)
            for i in range(count)]


def _holds(job: Job) -> list[ElasticEvent]:
    return list(ElasticEvent.objects.filter(job=job, kind=EventKind.HOLD).order_by("id"))


@pytest.fixture
def waiting(researcher, make_job):
    """One 4-GPU node held by a running job, and a best-effort job waiting for it."""
    _nodes()
    make_job(name="running", dp=4, dp_min=4, dp_max=4, global_batch=64)
    actions.run_planner_pass("test")
    return make_job(name="waiter", priority="best_effort", dp=2, dp_min=2, dp_max=2, global_batch=64)


def test_two_passes_with_the_same_reason_write_one_hold_and_keep_pending_since(waiting):
    first = timezone.now()
    actions.run_planner_pass("test", now=first)
    waiting.refresh_from_db()
    assert (waiting.pending_cause, waiting.pending_since) == ("capacity", first)
    assert waiting.pending_reason.startswith("Needs 2 GPUs; none of the GPUs it may use is free")
    actions.run_planner_pass("test", now=first + timedelta(seconds=30))
    waiting.refresh_from_db()
    assert len(_holds(waiting)) == 1
    assert waiting.pending_since == first


def test_a_changed_reason_writes_a_second_hold_and_restarts_pending_since(researcher, operator, make_job):
    _nodes(count=1)
    spare = Node.objects.create(name="wide", rack="r0", switch="r0s0", gpu_count=8, last_heartbeat_at=timezone.now())
    actions.cordon_node(spare, operator)
    job = make_job(name="waiter", priority="best_effort", tp=8, dp=1, dp_min=1, dp_max=1, global_batch=64)
    first = timezone.now()
    actions.run_planner_pass("test", now=first)
    # The cluster shrinks under the job: the only node wide enough is rebuilt with 4 GPUs.
    actions.edit_node(spare, operator, gpu_count=4)
    later = first + timedelta(minutes=5)
    actions.run_planner_pass("test", now=later)
    actions.run_planner_pass("test", now=later + timedelta(seconds=30))
    job.refresh_from_db()
    assert [h.reason["inputs"]["cause"] for h in _holds(job)] == ["capacity", "cannot_fit"]
    assert job.pending_cause == "cannot_fit" and job.pending_since == later
    assert job.pending_reason.startswith("Cannot fit this cluster: 8 GPUs per tensor-parallel group but the "
                                         "largest node has 4.")


def test_the_sentence_stays_current_without_a_new_audit_row(waiting):
    first = timezone.now()
    actions.run_planner_pass("test", now=first)
    Job.objects.filter(name="waiter").update(dp=2, dp_min=1, dp_max=2, accum_steps=8, global_batch=64, micro_batch=4)
    actions.run_planner_pass("test", now=first + timedelta(seconds=30))
    job = Job.objects.get(name="waiter")
    assert "or at least 1 to start" in job.pending_reason
    assert len(_holds(job)) == 1 and job.pending_since == first


def test_starting_clears_why_it_waited(waiting, researcher):
    actions.run_planner_pass("test")
    actions.cancel_job(Job.objects.get(name="running"), researcher)
    actions.run_planner_pass("test")
    job = Job.objects.get(name="waiter")
    assert job.state == JobState.RUNNING
    assert (job.pending_reason, job.pending_cause, job.pending_since) == ("", "", None)


def test_production_hold_sentences_give_clock_times_not_epoch_seconds(operator, make_job):
    _nodes(count=2)
    critical = make_job(owner=operator, name="crit", priority="critical", dp=2, dp_min=2, dp_max=2, global_batch=64)
    now = timezone.now()
    actions.create_reservation(operator, name="hourly", job=critical, gpus=2, start_at=now - timedelta(minutes=50),
                               period_s=3600, active_s=1800)
    actions.run_planner_pass("test", now=now)
    (hold,) = _holds(critical)
    text = hold.reason["text"]
    assert not EPOCH_T.search(text)
    opens = (now + timedelta(minutes=10)).strftime("%H:%M UTC")
    assert f"the next one opens at {opens}" in text and "after this decision)" in text

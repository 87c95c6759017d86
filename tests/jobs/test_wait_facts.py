"""The snapshot tells the planner when a running job's wait began, as the simulator does."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import actions
from jobs.models import Job
from jobs.snapshot import load_snapshot

pytestmark = pytest.mark.django_db

PLACED = {"rule": "test", "text": "placed by the test", "inputs": {}}


def snapshot_job(name: str):
    return next(j for j in load_snapshot(timezone.now()).jobs if j.name == name)


def test_a_running_jobs_snapshot_says_when_the_wait_before_its_run_began(make_job, make_nodes):
    nodes = make_nodes(racks=1, switches=1, nodes=1, gpus=2)
    job = make_job(name="waited", priority="best_effort", dp=2, dp_min=2, dp_max=2)
    waiting = snapshot_job("waited")
    assert waiting.queued_since_s == pytest.approx(job.state_changed_at.timestamp())
    actions.place_job(job, [(nodes[0], 0), (nodes[0], 1)], actor="planner", reason=PLACED)
    running = snapshot_job("waited")
    assert running.holdings and running.queued_since_s == pytest.approx(job.submitted_at.timestamp())
    # After a stop, the wait began at the stop
    stopped_at = timezone.now() - timedelta(hours=50)
    Job.objects.filter(pk=job.pk).update(queued_at=stopped_at)
    assert snapshot_job("waited").queued_since_s == pytest.approx(stopped_at.timestamp())

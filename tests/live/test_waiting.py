"""Why a job waits, on the job page and the dashboard: shown only for waiting states, in words
that agree with the state badge, with since when; no ETA number for a job that cannot fit."""

from __future__ import annotations

import re

import pytest
from django.db import transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from jobs import actions
from jobs.actions._common import kill_and_release
from jobs.models import Job, JobState, Node

pytestmark = pytest.mark.django_db


def _client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def waits(researcher, operator, make_job):
    """Two 4-GPU nodes: a critical job on one; on the other a job whose node failed (recovering),
    a preempted one, a pending one, and one too wide for any node (submitted before the nodes)."""
    make_job(name="wide", tp=8, dp=1, dp_min=1, dp_max=1, global_batch=64)
    now = timezone.now()
    n0, n1 = (Node.objects.create(name=f"n{i}", rack="r0", switch="r0s0", gpu_count=4, last_heartbeat_at=now)
              for i in range(2))
    crit = make_job(owner=operator, name="crit", priority="critical", dp=4, dp_min=4, dp_max=4, global_batch=64)
    actions.place_job(crit, [(n0, i) for i in range(4)], actor="planner",
                      reason={"rule": "place", "text": "Placed crit.", "inputs": {}})
    crashed = make_job(name="crashed", dp=2, dp_min=2, dp_max=2, global_batch=64)
    actions.place_job(crashed, [(n1, 0), (n1, 1)], actor="planner",
                      reason={"rule": "place", "text": "Placed crashed.", "inputs": {}})
    stopped = make_job(name="stopped", priority="best_effort", dp=2, dp_min=2, dp_max=2, global_batch=64)
    actions.place_job(stopped, [(n1, 2), (n1, 3)], actor="planner",
                      reason={"rule": "place", "text": "Placed stopped.", "inputs": {}})
    with transaction.atomic():
        kill_and_release(Job.objects.select_for_update().get(pk=stopped.pk))
    actions.mark_node_suspect(n1, 8.0)
    actions.mark_node_failed(n1, 20.0)
    make_job(name="later", priority="best_effort", dp=4, dp_min=4, dp_max=4, global_batch=64)
    actions.run_planner_pass("test")
    jobs = {j.name: j for j in Job.objects.all()}
    assert {n: jobs[n].state for n in ("crashed", "stopped", "later", "wide", "crit")} == {
        "crashed": JobState.RECOVERING, "stopped": JobState.PREEMPTED, "later": JobState.PENDING,
        "wide": JobState.PENDING, "crit": JobState.RUNNING}
    return jobs


def _row(body: str, job: Job) -> str:
    match = re.search(rf'<tr data-job-id="{job.pk}".*?</tr>', body, flags=re.S)
    assert match, f"no dashboard row for {job.name}"
    return match.group(0)


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_a_recovering_job_says_recovering_since_when_and_why_never_pending(researcher, waits):
    job = waits["crashed"]
    page = _text(_client(researcher).get(reverse("job-page", args=[job.pk])).content.decode())
    since = job.pending_since.strftime("%H:%M UTC")
    assert f"Why it is waiting Recovering since {since} after a fault, to restart from step 0. Needs 2 GPUs;" in page
    assert "Pending" not in page.replace("Pending</option>", "") and "Waiting since" not in page
    row = _text(_row(_client(researcher).get(reverse("dashboard")).content.decode(), job))
    assert "Recovering" in row and f"Recovering since {since} after a fault" in row and "Waiting" not in row


def test_each_waiting_state_has_its_own_words(researcher, waits):
    body = _client(researcher).get(reverse("dashboard")).content.decode()
    assert "Preempted; waiting since" in _text(_row(body, waits["stopped"]))
    assert "to resume from step 0." in _text(_row(body, waits["stopped"]))
    assert "Waiting since" in _text(_row(body, waits["later"]))


def test_a_running_job_shows_no_waiting_text_even_with_a_stale_note(researcher, operator, waits):
    crit = waits["crit"]
    Job.objects.filter(pk=crit.pk).update(pending_reason="Needs 16 GPUs; stale.", pending_cause="capacity")
    page = _client(operator).get(reverse("job-page", args=[crit.pk])).content.decode()
    assert 'id="why-pending"' not in page and "stale" not in page
    row = _row(_client(operator).get(reverse("dashboard")).content.decode(), crit)
    assert "stale" not in row and "Waiting" not in row and "Placed crit" in row


def test_a_job_that_cannot_fit_has_no_eta_number_and_says_why(researcher, waits):
    job = waits["wide"]
    assert job.pending_cause == "cannot_fit"
    row = _text(_row(_client(researcher).get(reverse("dashboard")).content.decode(), job))
    assert "ETA — cannot fit this cluster" in row and not re.search(r"ETA \d", row)
    assert "Cannot fit this cluster: 8 GPUs per tensor-parallel group but the largest node has 4." in row
    page = _text(_client(researcher).get(reverse("job-page", args=[job.pk])).content.decode())
    assert "— no ETA: it cannot fit this cluster" in page and not re.search(r"ETA at", page)

"""The jobs API: listing and filtering, submitting (400 per field), cancelling (403, 409)."""

from __future__ import annotations

import pytest

from jobs.models import ElasticEvent, Job, JobState
from tests.conftest import api_client

pytestmark = pytest.mark.django_db

SPEC = dict(name="sft-a", priority="regular", tp=2, pp=1, dp=4, dp_min=2, dp_max=8,
            global_batch=128, micro_batch=4, total_steps=1000, step_s=2.0)


def test_researcher_submits_a_job_and_it_is_audited(researcher):
    response = api_client(researcher).post("/api/jobs/", SPEC, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["state"], body["dp"], body["accum_steps"], body["owner"]) == ("pending", 4, 8, "rita")
    event = ElasticEvent.objects.get(job__name="sft-a")
    assert event.kind == "submit" and event.actor == "rita" and event.dp_after == 4


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"global_batch": 100}, "global_batch"),
        ({"dp_min": 9}, "dp_min"),
        ({"dp": 1}, "dp"),
        ({"tp": 0}, "tp"),
        ({"priority": "urgent"}, "priority"),
        ({"name": "bad name!"}, "name"),
        ({"step_s": "fast"}, "step_s"),
        ({"total_steps": None}, "total_steps"),
    ],
)
def test_submit_with_a_bad_field_is_400_naming_it_and_writes_nothing(researcher, change, field):
    response = api_client(researcher).post("/api/jobs/", {**SPEC, **change}, format="json")
    assert response.status_code == 400
    assert field in response.json()
    assert not Job.objects.exists() and not ElasticEvent.objects.exists()


def test_duplicate_name_is_400(researcher):
    client = api_client(researcher)
    assert client.post("/api/jobs/", SPEC, format="json").status_code == 201
    response = client.post("/api/jobs/", SPEC, format="json")
    assert response.status_code == 400 and "name" in response.json()


def test_researcher_may_not_submit_a_critical_job(researcher):
    response = api_client(researcher).post("/api/jobs/", {**SPEC, "priority": "critical"}, format="json")
    assert response.status_code == 403
    assert not Job.objects.exists()


def test_auditor_and_outsider_may_not_submit(auditor, outsider):
    assert api_client(auditor).post("/api/jobs/", SPEC, format="json").status_code == 403
    assert api_client(outsider).post("/api/jobs/", SPEC, format="json").status_code == 403


def test_anonymous_gets_401_naming_the_token_scheme():
    response = api_client().get("/api/jobs/")
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Token"


def test_researcher_cancels_own_job_but_not_anothers(researcher, other_researcher, make_job):
    mine = make_job(name="mine")
    theirs = make_job(owner=other_researcher, name="theirs")
    client = api_client(researcher)
    assert client.post(f"/api/jobs/{mine.pk}/cancel/").status_code == 200
    response = client.post(f"/api/jobs/{theirs.pk}/cancel/")
    assert response.status_code == 403
    theirs.refresh_from_db()
    assert theirs.state == JobState.PENDING


def test_cancelling_a_cancelled_job_is_409_with_the_allowed_moves(researcher, make_job):
    job = make_job()
    client = api_client(researcher)
    assert client.post(f"/api/jobs/{job.pk}/cancel/").status_code == 200
    response = client.post(f"/api/jobs/{job.pk}/cancel/")
    assert response.status_code == 409
    assert response.json()["state"] == "cancelled" and response.json()["allowed"] == []


def test_operator_cancels_any_job_and_running_ones_get_stop_commands(operator, researcher, make_job, make_nodes):
    from jobs import actions

    nodes = make_nodes()
    job = make_job(tp=2, dp=2, dp_min=1, dp_max=2, global_batch=64, micro_batch=4)
    actions.place_job(job, [(nodes[0], 0), (nodes[0], 1), (nodes[1], 0), (nodes[1], 1)],
                      actor="test", reason={"rule": "test", "text": "", "inputs": {}})
    response = api_client(operator).post(f"/api/jobs/{job.pk}/cancel/")
    assert response.status_code == 200
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED and not job.allocations.exists()
    assert sorted(c.node.name for c in job.commands.all()) == sorted([nodes[0].name, nodes[1].name])


def test_list_filters_by_state_priority_and_mine(researcher, other_researcher, make_job):
    make_job(name="a", priority="regular")
    make_job(name="b", priority="best_effort")
    make_job(owner=other_researcher, name="c")
    client = api_client(researcher)
    names = lambda r: sorted(j["name"] for j in r.json()["results"])  # noqa: E731
    assert names(client.get("/api/jobs/?priority=best_effort")) == ["b"]
    assert names(client.get("/api/jobs/?mine=1")) == ["a", "b"]
    assert names(client.get("/api/jobs/?state=pending")) == ["a", "b", "c"]
    bad = client.get("/api/jobs/?state=sleeping")
    assert bad.status_code == 400 and "state" in bad.json()


def test_job_list_query_count_does_not_grow_with_jobs(researcher, make_job, make_nodes, django_assert_max_num_queries):
    from jobs import actions

    nodes = make_nodes(racks=1, switches=1, nodes=4)
    for i in range(12):
        job = make_job(name=f"j{i}", dp=1, dp_min=1, dp_max=1, global_batch=4, micro_batch=4)
        actions.place_job(job, [(nodes[i % 4], i // 4)], actor="t", reason={})
    client = api_client(researcher)
    with django_assert_max_num_queries(6):
        response = client.get("/api/jobs/")
    assert response.json()["count"] == 12


def test_list_is_paginated(researcher, make_job):
    for i in range(55):
        make_job(name=f"p{i}")
    body = api_client(researcher).get("/api/jobs/").json()
    assert body["count"] == 55 and len(body["results"]) == 50 and body["next"]

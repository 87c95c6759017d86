"""Nodes, reservations, events and the schema through the API, with each role."""

from __future__ import annotations

import pytest

from jobs.models import ElasticEvent, Node, NodeState, Reservation
from tests.conftest import api_client

pytestmark = pytest.mark.django_db


def test_operator_cordons_and_drains_a_node_and_it_is_audited(operator, make_nodes):
    node = make_nodes()[0]
    client = api_client(operator)
    assert client.post(f"/api/nodes/{node.pk}/cordon/").json()["state"] == "cordoned"
    assert client.post(f"/api/nodes/{node.pk}/drain/").json()["state"] == "draining"
    kinds = list(ElasticEvent.objects.values_list("kind", flat=True))
    assert kinds == ["cordon", "drain"]


@pytest.mark.parametrize("role", ["researcher", "auditor", "outsider"])
def test_only_operators_act_on_nodes(request, role, make_nodes):
    node = make_nodes()[0]
    response = api_client(request.getfixturevalue(role)).post(f"/api/nodes/{node.pk}/drain/")
    assert response.status_code == 403
    node.refresh_from_db()
    assert node.state == NodeState.HEALTHY and not ElasticEvent.objects.exists()


def test_illegal_node_move_is_409(operator, make_nodes):
    node = make_nodes()[0]
    response = api_client(operator).post(f"/api/nodes/{node.pk}/repair/")  # healthy -> healthy
    assert response.status_code == 409
    assert "cannot go from 'healthy' to 'healthy'" in response.json()["detail"]


def test_everyone_with_a_role_reads_nodes(researcher, auditor, make_nodes):
    make_nodes()
    for user in (researcher, auditor):
        assert api_client(user).get("/api/nodes/").json()["count"] == 4


RES = {"name": "win", "gpus": 16, "spares": 8, "start_at": "2026-12-01T10:00:00Z",
       "period_s": 3600, "active_s": 2400}


@pytest.fixture
def critical_job(operator, make_job):
    return make_job(owner=operator, name="omni-7b", priority="critical", tp=8, dp=2, dp_min=2, dp_max=2,
                    global_batch=256, micro_batch=4)


def test_operator_creates_a_recurring_reservation(operator, critical_job):
    response = api_client(operator).post("/api/reservations/", {**RES, "job": "omni-7b"}, format="json")
    assert response.status_code == 201, response.content
    assert Reservation.objects.get().is_recurring
    assert ElasticEvent.objects.filter(kind="reserve").count() == 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"gpus": 12}, "gpus"),  # not whole 8-GPU replicas
        ({"active_s": None}, "period_s"),
        ({"active_s": 4000}, "active_s"),
        ({"end_at": "2026-12-01T09:00:00Z"}, "end_at"),
        ({"start_at": "tomorrow"}, "start_at"),
        ({"job": "nope"}, "job"),
    ],
)
def test_bad_reservation_is_400_naming_the_field(operator, critical_job, change, field):
    response = api_client(operator).post("/api/reservations/", {**RES, "job": "omni-7b", **change}, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert not Reservation.objects.exists()


def test_reservation_for_a_non_critical_job_is_400(operator, make_job):
    make_job(name="sft", tp=8, dp=2, dp_min=2, dp_max=2, global_batch=256, micro_batch=4)
    response = api_client(operator).post("/api/reservations/", {**RES, "job": "sft"}, format="json")
    assert response.status_code == 400 and "critical" in response.json()["job"][0]


def test_researcher_may_not_create_reservations(researcher, critical_job):
    response = api_client(researcher).post("/api/reservations/", {**RES, "job": "omni-7b"}, format="json")
    assert response.status_code == 403


def test_operator_edits_a_reservation_and_the_audit_keeps_before_and_after(operator, critical_job):
    client = api_client(operator)
    pk = client.post("/api/reservations/", {**RES, "job": "omni-7b"}, format="json").json()["id"]
    response = client.patch(f"/api/reservations/{pk}/", {"gpus": 32}, format="json")
    assert response.status_code == 200 and response.json()["gpus"] == 32
    change = ElasticEvent.objects.get(kind="reservation_change")
    assert change.reason["inputs"]["before"]["gpus"] == 16 and change.reason["inputs"]["after"]["gpus"] == 32
    assert client.patch(f"/api/reservations/{pk}/", {"name": "x"}, format="json").status_code == 400


def test_events_auditor_reads_all_researcher_only_own(auditor, researcher, other_researcher, make_job):
    make_job(name="mine")
    make_job(owner=other_researcher, name="theirs")
    assert api_client(auditor).get("/api/events/").json()["count"] == 2
    own = api_client(researcher).get("/api/events/").json()
    assert [e["job_name"] for e in own["results"]] == ["mine"]
    assert api_client(auditor).get("/api/events/?job=theirs").json()["count"] == 1


def test_events_reject_a_naive_time_filter(auditor):
    response = api_client(auditor).get("/api/events/?since=2026-01-01T00:00:00")
    assert response.status_code == 400 and "since" in response.json()


def test_events_are_read_only(auditor, operator, make_job):
    make_job()
    pk = ElasticEvent.objects.get().pk
    for user in (auditor, operator):
        assert api_client(user).delete(f"/api/events/{pk}/").status_code == 405


def test_openapi_schema_describes_the_api(researcher):
    response = api_client(researcher).get("/api/schema/?format=json")
    assert response.status_code == 200
    paths = response.json()["paths"]
    assert {"/api/jobs/", "/api/jobs/{id}/cancel/", "/api/nodes/{id}/drain/", "/api/reservations/", "/api/events/"} <= set(paths)


def test_session_api_writes_need_csrf(researcher, client):
    client.force_login(researcher)
    from django.test import Client

    strict = Client(enforce_csrf_checks=True)
    strict.force_login(researcher)
    response = strict.post("/api/jobs/", {"name": "x"}, content_type="application/json")
    assert response.status_code == 403 and "CSRF" in response.json()["detail"]
    assert Node.objects.count() == 0

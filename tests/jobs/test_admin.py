"""The admin is an operator's browser: it lists and searches, and never writes around the actions."""

from __future__ import annotations

import pytest

from jobs.models import ElasticEvent, NodeState

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client_logged_in(client, django_user_model):
    client.force_login(django_user_model.objects.create_superuser("root", "root@example.org", "root-pass-1234"))
    return client


def test_audit_log_is_listed_but_cannot_be_added_changed_or_deleted(admin_client_logged_in, make_job):
    make_job()
    event = ElasticEvent.objects.get()
    client = admin_client_logged_in
    assert client.get("/admin/jobs/elasticevent/").status_code == 200
    assert client.get("/admin/jobs/elasticevent/add/").status_code == 403
    assert client.get(f"/admin/jobs/elasticevent/{event.pk}/delete/").status_code == 403
    response = client.post(f"/admin/jobs/elasticevent/{event.pk}/change/", {"actor": "mallory"})
    assert response.status_code == 403
    assert ElasticEvent.objects.get().actor == event.actor


def test_admin_drain_action_goes_through_the_audited_action(admin_client_logged_in, make_nodes):
    node = make_nodes()[0]
    response = admin_client_logged_in.post(
        "/admin/jobs/node/", {"action": "drain", "_selected_action": [node.pk]}, follow=True
    )
    assert response.status_code == 200
    node.refresh_from_db()
    assert node.state == NodeState.DRAINING
    assert ElasticEvent.objects.get().kind == "drain"


def test_every_model_has_an_admin_page(admin_client_logged_in):
    for model in ("node", "job", "reservation", "allocation", "command", "elasticevent", "plannerrun", "plannercontrol"):
        assert admin_client_logged_in.get(f"/admin/jobs/{model}/").status_code == 200, model

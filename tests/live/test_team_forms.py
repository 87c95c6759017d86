"""Operators make and change teams from the Teams pages, through the same actions as the API
(jobs/actions/teams.py): the action's refusals show on the form (400), anyone else gets 403, and
every change is an audit row."""

from __future__ import annotations

import pytest
from django.contrib.messages import get_messages
from django.test import Client
from django.urls import reverse

from jobs import actions
from jobs.models import ElasticEvent, EventKind, Team, TeamMembership

pytestmark = pytest.mark.django_db


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def said(response) -> list[str]:
    """What the page the redirect leads to will say (messages not yet shown pile up without it)."""
    return [str(m) for m in get_messages(response.wsgi_request)][-1:]


def test_only_operators_see_and_use_the_team_controls(researcher, auditor, operator):
    lab = actions.create_team(operator, name="lab", quota_gpus=8)
    for user in (researcher, auditor):
        client = client_for(user)
        assert client.get(reverse("team-page-new")).status_code == 403
        assert client.post(reverse("team-page-new"), {"name": "x", "quota_gpus": 1, "weight": 1}).status_code == 403
        assert client.post(reverse("team-page-edit", args=[lab.pk]), {"quota_gpus": 99, "weight": 1}).status_code == 403
        assert client.post(reverse("team-page-members", args=[lab.pk]), {"user": researcher.username}).status_code == 403
        assert client.post(reverse("team-page-delete", args=[lab.pk])).status_code == 403
        page = client.get(reverse("teams")).content.decode() + client.get(reverse("team-page", args=[lab.pk])).content.decode()
        assert 'id="team-new"' not in page and 'id="team-edit"' not in page and 'id="team-add-member"' not in page
    assert Team.objects.get(pk=lab.pk).quota_gpus == 8 and not Team.objects.filter(name="x").exists()
    page = client_for(operator).get(reverse("teams")).content.decode()
    assert 'id="team-new"' in page


def test_an_operator_creates_a_team_and_a_refused_one_says_why_on_its_fields(operator):
    client = client_for(operator)
    lab = actions.create_team(operator, name="lab", quota_gpus=16)
    response = client.post(reverse("team-page-new"), {"name": "vision", "parent": lab.pk, "quota_gpus": 8,
                                                 "borrow_limit_gpus": 4, "weight": 2})
    vision = Team.objects.get(name="vision")
    assert response.status_code == 302 and response["Location"] == reverse("team-page", args=[vision.pk])
    assert (vision.parent, vision.quota_gpus, vision.borrow_limit_gpus, vision.weight) == (lab, 8, 4, 2.0)
    row = ElasticEvent.objects.filter(kind=EventKind.TEAM_CREATED).latest("id")
    assert row.reason["inputs"]["team"] == "vision" and row.actor_user == operator

    rows = ElasticEvent.objects.count()
    refused = client.post(reverse("team-page-new"), {"name": "vision", "quota_gpus": -1, "weight": 0})
    assert refused.status_code == 400
    form = refused.context["form"]
    assert "quota_gpus" in form.errors and "weight" in form.errors
    taken = client.post(reverse("team-page-new"), {"name": "vision", "quota_gpus": 1, "weight": 1})
    assert taken.status_code == 400 and taken.context["form"].errors["name"] == ["a team named 'vision' already exists"]
    bad_name = client.post(reverse("team-page-new"), {"name": "no spaces", "quota_gpus": 1, "weight": 1})
    assert bad_name.status_code == 400 and "letters, digits" in bad_name.context["form"].errors["name"][0]
    assert ElasticEvent.objects.count() == rows and Team.objects.count() == 2  # nothing half-written


def test_an_operator_edits_a_team_and_a_cycle_is_refused(operator):
    client = client_for(operator)
    lab = actions.create_team(operator, name="lab", quota_gpus=16)
    vision = actions.create_team(operator, name="vision", parent=lab, quota_gpus=8)
    form = client.get(reverse("team-page-edit", args=[vision.pk])).context["form"]
    assert form.fields["name"].disabled and form.initial["quota_gpus"] == 8
    response = client.post(reverse("team-page-edit", args=[vision.pk]),
                           {"name": "ignored", "parent": lab.pk, "quota_gpus": 12, "borrow_limit_gpus": "", "weight": 1})
    assert response.status_code == 302
    vision.refresh_from_db()
    assert (vision.name, vision.quota_gpus) == ("vision", 12)
    edited = ElasticEvent.objects.filter(kind=EventKind.TEAM_EDITED).latest("id")
    assert edited.reason["inputs"]["before"] == {"quota_gpus": 8} and edited.reason["inputs"]["after"] == {"quota_gpus": 12}
    cycle = client.post(reverse("team-page-edit", args=[lab.pk]), {"parent": vision.pk, "quota_gpus": 16, "weight": 1})
    assert cycle.status_code == 400
    assert cycle.context["form"].errors["parent"] == ["team vision is inside team lab: that would make a cycle"]
    lab.refresh_from_db()
    assert lab.parent is None
    rows = ElasticEvent.objects.count()
    same = client.post(reverse("team-page-edit", args=[vision.pk]), {"parent": lab.pk, "quota_gpus": 12, "weight": 1})
    assert same.status_code == 302 and ElasticEvent.objects.count() == rows  # a change of nothing writes nothing
    assert said(same) == ["Team vision unchanged."]


def test_members_are_added_and_removed_and_an_unknown_user_is_named(operator, researcher):
    client = client_for(operator)
    lab = actions.create_team(operator, name="lab", quota_gpus=16)
    url = reverse("team-page-members", args=[lab.pk])
    response = client.post(url, {"user": "nobody"})
    assert response.status_code == 302 and said(response) == ["no user named 'nobody'"]
    response = client.post(url, {"user": researcher.username, "default": "on"})
    assert said(response) == [f"{researcher.username} added to team lab."]
    assert TeamMembership.objects.get(team=lab, user=researcher).is_default
    again = client.post(url, {"user": researcher.username})
    assert said(again) == [f"{researcher.username} is already in team lab"]
    page = client.get(reverse("team-page", args=[lab.pk])).content.decode()
    assert f'data-member="{researcher.username}"' in page
    gone = client.post(url, {"user": researcher.username, "remove": "1"})
    assert said(gone) == [f"{researcher.username} is no longer in team lab."]
    assert not TeamMembership.objects.filter(team=lab).exists()
    kinds = list(ElasticEvent.objects.filter(kind__startswith="team_member").values_list("kind", flat=True))
    assert kinds == [EventKind.TEAM_MEMBER_ADDED, EventKind.TEAM_MEMBER_REMOVED]


def test_a_team_still_named_by_a_job_is_kept_and_an_empty_one_is_deleted(operator, researcher, make_job):
    client = client_for(operator)
    used = actions.create_team(operator, name="used", quota_gpus=4)
    actions.add_team_member(used, operator, researcher)
    make_job(team=used)
    response = client.post(reverse("team-page-delete", args=[used.pk]))
    assert response.status_code == 302 and response["Location"] == reverse("team-page", args=[used.pk])
    assert said(response) == ["Not deleted: team used still has 1 job: move or finish them first."]
    assert Team.objects.filter(pk=used.pk).exists()
    empty = actions.create_team(operator, name="empty")
    response = client.post(reverse("team-page-delete", args=[empty.pk]))
    assert response["Location"] == reverse("teams") and said(response) == ["Team empty deleted."]
    assert not Team.objects.filter(pk=empty.pk).exists()
    assert ElasticEvent.objects.filter(kind=EventKind.TEAM_DELETED).count() == 1


def test_a_team_bars_head_is_drawn_as_the_live_redraw_draws_it(operator):
    """The name and its organisation in one span, the count in the other: as omni.js's teamBar
    redraws it (found 2026-12-07: drawn by the server, "in lab" floated to the middle of the
    head, and jumped back beside the name at the first live update)."""
    lab = actions.create_team(operator, name="lab", quota_gpus=8)
    actions.create_team(operator, name="vision", quota_gpus=4, parent=lab)
    page = client_for(operator).get(reverse("teams")).content.decode()
    head = page.split('data-team="vision"', 1)[1].split('<div class="tbar"', 1)[0]
    assert '<div class="team-bar-head"><span><a href="' in head
    assert '<strong>vision</strong></a> <span class="faint small">in lab</span></span>' in head

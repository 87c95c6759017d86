"""Teams, quotas and fair share on the Django side (docs/teams.md): the model's constraints, the
audited actions, submit with a team, team reservations (and the completed-job bug), the API's
400/403/409, and what the planner's snapshot carries: teams, decayed usage, team reservations."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from jobs import actions
from jobs.live_data import cluster_summary
from jobs.models import (
    Allocation,
    ElasticEvent,
    EventKind,
    Job,
    JobState,
    Node,
    Reservation,
    Team,
    TeamInUse,
    TeamMembership,
)
from jobs.planner import quota
from jobs.snapshot import decayed_gpu_s, load_snapshot, planner_config
from tests.conftest import api_client

pytestmark = pytest.mark.django_db

HOUR = timedelta(hours=1)


@pytest.fixture
def org(operator):
    """An organisation with two teams, made by the real actions."""
    lab = actions.create_team(operator, name="lab", quota_gpus=16)
    vision = actions.create_team(operator, name="vision", parent=lab, quota_gpus=8, borrow_limit_gpus=4)
    speech = actions.create_team(operator, name="speech", parent=lab, quota_gpus=6, weight=2.0)
    return {"lab": lab, "vision": vision, "speech": speech}


def team_events(kind: EventKind) -> list[ElasticEvent]:
    return list(ElasticEvent.objects.filter(kind=kind).order_by("id"))


def finish(job: Job) -> Job:
    """Run a job to completion through its state machine (what the agents' outcomes do)."""
    job.save(update_fields=job.transition_to(JobState.RUNNING))
    job.save(update_fields=job.transition_to(JobState.COMPLETED))
    return job


# -- the model ---------------------------------------------------------------------------------------

def test_a_reservation_is_for_a_job_or_a_team_never_both_nor_neither(operator, org, make_job):
    critical = make_job(owner=operator, name="crit", priority="critical")
    base = dict(gpus=2, start_at=timezone.now())
    for i, holders in enumerate([{}, {"job": critical, "team": org["vision"]}]):
        with pytest.raises(IntegrityError), transaction.atomic():
            Reservation.objects.create(name=f"bad-{i}", **base, **holders)
    Reservation.objects.create(name="for-team", team=org["vision"], **base)
    Reservation.objects.create(name="for-job", job=critical, **base)


def test_a_weight_must_be_positive_and_a_team_is_not_its_own_parent(org):
    with pytest.raises(IntegrityError), transaction.atomic():
        Team.objects.filter(pk=org["vision"].pk).update(weight=0)
    with pytest.raises(IntegrityError), transaction.atomic():
        Team.objects.filter(pk=org["vision"].pk).update(parent=org["vision"].pk)


def test_a_user_has_one_default_team_and_one_membership_per_team(researcher, org):
    TeamMembership.objects.create(team=org["vision"], user=researcher, is_default=True)
    with pytest.raises(IntegrityError), transaction.atomic():
        TeamMembership.objects.create(team=org["speech"], user=researcher, is_default=True)
    with pytest.raises(IntegrityError), transaction.atomic():
        TeamMembership.objects.create(team=org["vision"], user=researcher)


# -- the actions and their audit rows --------------------------------------------------------------

def test_creating_a_team_is_audited_with_its_settings(org):
    rows = team_events(EventKind.TEAM_CREATED)
    assert [r.reason["inputs"]["team"] for r in rows] == ["lab", "vision", "speech"]
    vision = rows[1]
    assert vision.actor == "olive" and vision.job is None
    assert vision.reason["inputs"]["before"] is None
    assert vision.reason["inputs"]["after"] == {"parent": "lab", "quota_gpus": 8, "borrow_limit_gpus": 4, "weight": 1}
    assert vision.reason["text"] == "olive created team vision (quota 8 GPUs, may borrow 4 more, weight 1, inside lab)."


def test_an_edit_records_only_what_changed_and_a_no_op_writes_nothing(operator, org):
    actions.edit_team(org["vision"], operator, quota_gpus=12, borrow_limit_gpus=None, weight=1.0)
    row = team_events(EventKind.TEAM_EDITED)[-1]
    assert row.reason["inputs"] == {"team": "vision", "before": {"quota_gpus": 8, "borrow_limit_gpus": 4},
                                    "after": {"quota_gpus": 12, "borrow_limit_gpus": None}}
    assert "quota gpus 8 → 12" in row.reason["text"]
    actions.edit_team(org["vision"], operator, quota_gpus=12)
    assert len(team_events(EventKind.TEAM_EDITED)) == 1
    org["vision"].refresh_from_db()
    assert org["vision"].quota_gpus == 12 and org["vision"].borrow_limit_gpus is None


def test_a_parent_that_would_make_a_cycle_is_refused(operator, org):
    with pytest.raises(ValidationError) as caught:
        actions.edit_team(org["lab"], operator, parent=org["vision"])
    assert caught.value.message_dict["parent"] == ["team vision is inside team lab: that would make a cycle"]
    with pytest.raises(ValidationError) as caught:
        actions.edit_team(org["lab"], operator, parent=org["lab"])
    assert "own parent" in caught.value.message_dict["parent"][0]
    assert not team_events(EventKind.TEAM_EDITED)


@pytest.mark.parametrize(("field", "value"), [("quota_gpus", -1), ("weight", 0), ("weight", math.inf),
                                              ("borrow_limit_gpus", -2)])
def test_bad_numbers_are_refused_by_field(operator, org, field, value):
    with pytest.raises(ValidationError) as caught:
        actions.edit_team(org["vision"], operator, **{field: value})
    assert list(caught.value.message_dict) == [field]


def test_a_team_with_jobs_or_reservations_or_teams_inside_is_not_deleted(operator, researcher, org, make_job):
    actions.add_team_member(org["vision"], operator, researcher)
    make_job(name="v1")
    with pytest.raises(TeamInUse, match="team vision still has 1 job:"):
        actions.delete_team(org["vision"], operator)
    with pytest.raises(TeamInUse, match="2 teams inside it"):
        actions.delete_team(org["lab"], operator)
    actions.create_reservation(operator, name="speech-window", team=org["speech"], gpus=2, start_at=timezone.now())
    with pytest.raises(TeamInUse, match="still has 1 reservation:"):
        actions.delete_team(org["speech"], operator)
    empty = actions.create_team(operator, name="empty", quota_gpus=2)
    actions.add_team_member(empty, operator, researcher)
    actions.delete_team(empty, operator)
    assert not Team.objects.filter(name="empty").exists()
    row = team_events(EventKind.TEAM_DELETED)[-1]
    assert row.reason["inputs"]["before"]["members"] == ["rita"] and row.reason["inputs"]["after"] is None


def test_members_their_default_team_and_its_successor(operator, researcher, org):
    actions.add_team_member(org["vision"], operator, researcher)
    actions.add_team_member(org["speech"], operator, researcher)
    assert actions.teams.default_team(researcher) == org["vision"]  # the first team they joined
    actions.set_default_team(operator, researcher, org["speech"])
    assert actions.teams.default_team(researcher) == org["speech"]
    row = team_events(EventKind.TEAM_DEFAULT_SET)[-1]
    assert row.reason["inputs"]["before"] == {"default_team": "vision"}
    assert row.reason["inputs"]["after"] == {"default_team": "speech"}
    actions.remove_team_member(org["speech"], operator, researcher)
    assert actions.teams.default_team(researcher) == org["vision"]
    removed = team_events(EventKind.TEAM_MEMBER_REMOVED)[-1]
    assert removed.reason["text"] == "olive removed rita from team speech; their default team is now vision."
    with pytest.raises(ValidationError, match="not in team speech"):
        actions.set_default_team(operator, researcher, org["speech"])
    with pytest.raises(ValidationError, match="already in team vision"):
        actions.add_team_member(org["vision"], operator, researcher)


@pytest.mark.parametrize("role", ["researcher", "auditor"])
def test_only_operators_change_teams(request, role, org):
    user = request.getfixturevalue(role)
    for attempt in (lambda: actions.create_team(user, name="mine"),
                    lambda: actions.edit_team(org["vision"], user, quota_gpus=100),
                    lambda: actions.delete_team(org["vision"], user),
                    lambda: actions.add_team_member(org["vision"], user, user)):
        with pytest.raises(PermissionDenied):
            attempt()


# -- submit with a team ---------------------------------------------------------------------------

def test_a_researchers_submit_goes_to_their_default_team(operator, researcher, org, make_job):
    assert make_job(name="before").team is None  # in no team yet: it only borrows
    actions.add_team_member(org["vision"], operator, researcher)
    job = make_job(name="after")
    assert job.team == org["vision"]
    assert ElasticEvent.objects.get(job=job, kind=EventKind.SUBMIT).reason["inputs"]["team"] == "vision"
    assert make_job(name="opted-out", team=None).team is None


def test_the_job_page_names_the_jobs_team_with_a_link_to_it(operator, researcher, org, make_job, client):
    actions.add_team_member(org["vision"], operator, researcher)
    teamed, loose = make_job(name="teamed"), make_job(name="loose", team=None)
    client.force_login(researcher)
    page = client.get(f"/jobs/{teamed.pk}/").content.decode()
    assert f'team <a href="/teams/{org["vision"].pk}/"><b>vision</b></a>' in page
    assert 'team <b title="a job of no team has no quota: it only borrows">none</b>' in \
        client.get(f"/jobs/{loose.pk}/").content.decode()


def test_a_researcher_submits_only_to_a_team_they_are_in_an_operator_to_any(operator, researcher, org, make_job):
    with pytest.raises(ValidationError) as caught:
        make_job(name="elsewhere", team=org["speech"])
    assert caught.value.message_dict["team"] == [
        "you are not in team speech: submit to a team you belong to (or ask an operator)"]
    assert make_job(owner=operator, name="ops", team=org["speech"]).team == org["speech"]


def test_the_api_submits_with_a_team_and_reads_it_back(operator, researcher, org):
    actions.add_team_member(org["vision"], operator, researcher)
    client = api_client(researcher)
    body = {"name": "api-job", "dp": 1, "global_batch": 8, "micro_batch": 8, "total_steps": 10, "step_s": 1.0}
    assert client.post("/api/jobs/", {**body, "team": "vision"}, format="json").json()["team"] == "vision"
    refused = client.post("/api/jobs/", {**body, "name": "api-2", "team": "speech"}, format="json")
    assert refused.status_code == 400 and list(refused.json()) == ["team"]
    unknown = client.post("/api/jobs/", {**body, "name": "api-3", "team": "nope"}, format="json")
    assert unknown.status_code == 400 and list(unknown.json()) == ["team"]
    none = client.post("/api/jobs/", {**body, "name": "api-4", "team": None}, format="json")
    assert none.status_code == 201 and none.json()["team"] is None
    listed = client.get("/api/jobs/", {"team": "vision"}).json()["results"]
    assert [j["name"] for j in listed] == ["api-job"]


# -- team reservations and the completed-job bug ------------------------------------------------------

def test_a_completed_jobs_reservation_does_not_block_its_teams(operator, org, make_job):
    omni = make_job(owner=operator, name="omni-7b", priority="critical", team=org["vision"])
    old = actions.create_reservation(operator, name="omni-window", job=omni, gpus=2, start_at=timezone.now())
    finish(omni)
    with pytest.raises(ValidationError) as caught:
        actions.create_reservation(operator, name="again", job=omni, gpus=2, start_at=timezone.now())
    assert "job 'omni-7b' is completed; it needs no reservation" in caught.value.message_dict["job"][0]
    # The team's reservation is made whatever became of its last critical job...
    team_res = actions.create_reservation(operator, name="vision-window", team=org["vision"], gpus=2,
                                          start_at=timezone.now())
    assert team_res.job is None and team_res.team == org["vision"]
    # ...and the job's own is handed to the team, to outlive it.
    actions.update_reservation(old, operator, team=org["vision"])
    old.refresh_from_db()
    assert old.job is None and old.team == org["vision"]
    row = ElasticEvent.objects.filter(kind=EventKind.RESERVATION_CHANGE).latest("id")
    assert row.reason["inputs"]["before"]["job"] == "omni-7b" and row.reason["inputs"]["after"]["team"] == "vision"


def test_the_reservations_api_takes_a_team(operator, researcher, org):
    client = api_client(operator)
    body = {"name": "speech-hourly", "team": "speech", "gpus": 2, "start_at": timezone.now().isoformat(),
            "period_s": 3600, "active_s": 1800}
    created = client.post("/api/reservations/", body, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["team"] == "speech" and created.json()["job"] is None
    neither = client.post("/api/reservations/", {**body, "name": "x", "team": None}, format="json")
    assert neither.status_code == 400 and "job" in neither.json()
    assert api_client(researcher).get("/api/reservations/").json()["results"][0]["team"] == "speech"


# -- the API's teams ---------------------------------------------------------------------------

def test_anyone_reads_teams_with_their_standing(researcher, auditor, operator, org, make_job, make_nodes):
    nodes = make_nodes(racks=1, switches=1, nodes=1, gpus=8)
    actions.add_team_member(org["vision"], operator, researcher)
    job = make_job(name="v", dp=2, dp_min=2, dp_max=2)
    actions.place_job(job, [(nodes[0], 0), (nodes[0], 1)], actor="test", reason={})
    for user in (researcher, auditor):
        rows = {r["name"]: r for r in api_client(user).get("/api/teams/").json()["results"]}
        assert rows["vision"]["gpus_held"] == 2 and rows["lab"]["gpus_held"] == 2  # a parent counts its teams'
        assert rows["vision"]["members_count"] == 1 and rows["vision"]["borrow_limit_gpus"] == 4
        assert rows["vision"]["words"] == "2 of 8 guaranteed GPUs; may borrow up to 4"
    detail = api_client(researcher).get(f"/api/teams/{org['vision'].pk}/").json()
    assert detail["members"][0]["user"] == "rita" and detail["members"][0]["default"]
    assert [j["name"] for j in detail["jobs"]] == ["v"]
    mine = api_client(researcher).get("/api/teams/", {"mine": "true"}).json()["results"]
    assert [(t["name"], t["default"]) for t in mine] == [("vision", True)]


def test_a_teams_detail_leaves_out_a_reservation_whose_job_has_ended(operator, researcher, org, make_job):
    """Live reservations only: a job's reservation stops holding anything when the job ends
    (Reservation.over_at; found on the demo's team page, which still listed omni-7b's window "10 min
    of every 30 min" after omni-7b had completed). The team's own reservation stays."""
    actions.add_team_member(org["vision"], operator, researcher)
    critical = make_job(owner=operator, name="crit-v", priority="critical", team=org["vision"])
    now = timezone.now()
    actions.create_reservation(operator, name="crit-v-window", job=critical, gpus=2, start_at=now,
                               period_s=3600, active_s=600)
    actions.create_reservation(operator, name="vision-pool", team=org["vision"], gpus=2, start_at=now)
    names = lambda: [r["name"] for r in api_client(researcher).get(f"/api/teams/{org['vision'].pk}/").json()["reservations"]]  # noqa: E731
    assert names() == ["crit-v-window", "vision-pool"]
    actions.cancel_job(critical, operator)
    assert names() == ["vision-pool"]


def test_the_team_list_takes_the_same_queries_for_3_teams_as_for_30(operator, django_assert_num_queries,
                                                                     django_user_model):
    counts = []
    for n in (3, 27):
        start = Team.objects.count()
        for i in range(start, start + n):
            actions.create_team(operator, name=f"t{i}", quota_gpus=1)
        client = api_client(django_user_model.objects.get(pk=operator.pk))
        with django_assert_num_queries(4):  # roles, teams, GPUs held, cluster size
            response = client.get("/api/teams/")
        counts.append(response.json()["count"])
    assert counts == [3, 30]


def test_operators_write_teams_and_others_get_403(operator, researcher, auditor, org):
    for user in (researcher, auditor):
        client = api_client(user)
        assert client.post("/api/teams/", {"name": "x"}, format="json").status_code == 403
        assert client.patch(f"/api/teams/{org['vision'].pk}/", {"quota_gpus": 1}, format="json").status_code == 403
        assert client.delete(f"/api/teams/{org['speech'].pk}/").status_code == 403
        assert client.post(f"/api/teams/{org['vision'].pk}/members/", {"user": "rita"},
                           format="json").status_code == 403
    client = api_client(operator)
    created = client.post("/api/teams/", {"name": "audio", "parent": "lab", "quota_gpus": 2}, format="json")
    assert created.status_code == 201 and created.json()["parent"] == "lab"
    patched = client.patch(f"/api/teams/{created.json()['id']}/", {"weight": 3}, format="json")
    assert patched.status_code == 200 and patched.json()["weight"] == 3
    assert client.put(f"/api/teams/{created.json()['id']}/", {"name": "audio"}, format="json").status_code == 405


def test_the_apis_refusals_are_400_with_fields_and_409_for_a_team_in_use(operator, researcher, org, make_job):
    client = api_client(operator)
    cycle = client.patch(f"/api/teams/{org['lab'].pk}/", {"parent": "vision"}, format="json")
    assert cycle.status_code == 400 and list(cycle.json()) == ["parent"]
    unknown = client.patch(f"/api/teams/{org['lab'].pk}/", {"quota": 3, "weight": -1}, format="json")
    assert unknown.status_code == 400 and set(unknown.json()) == {"quota", "weight"}
    renamed = client.patch(f"/api/teams/{org['lab'].pk}/", {"name": "other"}, format="json")
    assert renamed.status_code == 400 and list(renamed.json()) == ["name"]
    taken = client.post("/api/teams/", {"name": "vision"}, format="json")
    assert taken.status_code == 400 and list(taken.json()) == ["name"]
    in_use = client.delete(f"/api/teams/{org['lab'].pk}/")
    assert in_use.status_code == 409 and in_use.json()["holders"]["teams inside it"] == 2
    assert client.post(f"/api/teams/{org['vision'].pk}/members/", {"user": "nobody"},
                       format="json").status_code == 400
    assert not team_events(EventKind.TEAM_EDITED)


def test_the_membership_endpoints(operator, researcher, org):
    client = api_client(operator)
    added = client.post(f"/api/teams/{org['vision'].pk}/members/", {"user": "rita"}, format="json")
    assert added.status_code == 201 and added.json() == [{"user": "rita", "default": True,
                                                           "since": added.json()[0]["since"]}]
    client.post(f"/api/teams/{org['speech'].pk}/members/", {"user": "rita"}, format="json")
    made = client.post(f"/api/teams/{org['speech'].pk}/members/rita/default/")
    assert made.status_code == 200 and made.json()[0]["default"]
    assert client.delete(f"/api/teams/{org['vision'].pk}/members/rita/").status_code == 204
    assert list(TeamMembership.objects.filter(user=researcher).values_list("team__name", "is_default")) == [
        ("speech", True)]
    assert client.delete(f"/api/teams/{org['vision'].pk}/members/rita/").status_code == 400
    kinds = [e.kind for e in ElasticEvent.objects.filter(kind__startswith="team_member").order_by("id")]
    assert kinds == ["team_member_added", "team_member_added", "team_member_removed"]


# -- the planner's snapshot ----------------------------------------------------------------------

def test_the_closed_form_is_the_planners_accrual():
    h = 3600.0
    # One GPU held for 2 h ending 1 h ago, decayed to now: accrue for 2 h, then decay 1 h.
    expected = quota.decayed(quota.accrue(0.0, 1, 7200.0, h), 3600.0, h)
    assert decayed_gpu_s(0.0, 7200.0, 10800.0, h) == pytest.approx(expected)
    assert decayed_gpu_s(0.0, 7200.0, 7200.0, 0) == 0.0


def test_the_snapshot_carries_teams_their_decayed_usage_and_team_reservations(settings, operator, researcher, org,
                                                                              make_job, make_nodes):
    settings.OMNI_FAIR_SHARE_HALF_LIFE_S = 3600.0
    node = make_nodes(racks=1, switches=1, nodes=1, gpus=8)[0]
    actions.add_team_member(org["vision"], operator, researcher)
    now = timezone.now()
    past = make_job(name="past", dp=2, dp_min=2, dp_max=2)
    # Two GPUs held from 3 h to 1 h ago (the allocation history), then one still held for the last hour.
    Allocation.objects.bulk_create([Allocation(job=past, node=node, gpu_index=i, since=now - 3 * HOUR) for i in (0, 1)])
    Allocation.objects.filter(job=past).release(at=now - HOUR)
    running = make_job(name="running", dp=1, dp_min=1, dp_max=1, global_batch=8, micro_batch=8)
    Allocation.objects.create(job=running, node=node, gpu_index=2, since=now - HOUR)
    finish(past)
    crit = make_job(owner=operator, name="crit", priority="critical", team=org["speech"])
    actions.create_reservation(operator, name="speech-window", team=org["speech"], gpus=2,
                               start_at=now - HOUR)
    snapshot = load_snapshot(now)
    teams = {t.name: t for t in snapshot.teams}
    h = 3600.0
    expected = 2 * decayed_gpu_s(-3 * h, -h, 0.0, h) + decayed_gpu_s(-h, 0.0, 0.0, h)
    assert teams["vision"].usage_gpu_s == pytest.approx(expected, rel=1e-3)
    assert teams["lab"].usage_gpu_s == pytest.approx(expected, rel=1e-3)  # its teams' usage is its own
    assert teams["speech"].usage_gpu_s == 0.0
    assert teams["vision"] == teams["vision"].__class__(name="vision", parent="lab", quota_gpus=8, borrow_limit_gpus=4,
                                                       weight=1.0, usage_gpu_s=teams["vision"].usage_gpu_s)
    assert teams["speech"].weight == 2.0
    jobs = {j.name: j for j in snapshot.jobs}
    assert jobs["running"].team == "vision" and jobs["crit"].team == "speech"
    (window,) = snapshot.reservations
    assert (window.name, window.job, window.team, window.gpus) == ("speech-window", "", "speech", 2)
    # The team's reservation outlives its critical job; a job's own reservation does not.
    finish(Job.objects.get(pk=crit.pk))
    assert [r.name for r in load_snapshot(now).reservations] == ["speech-window"]


def test_the_half_life_is_the_planners_knob(settings):
    settings.OMNI_FAIR_SHARE_HALF_LIFE_S = 86400.0
    settings.OMNI_PLANNER_OVERRIDES = {}
    assert planner_config().fair_share_half_life_s == 86400.0
    settings.OMNI_PLANNER_OVERRIDES = {"fair_share_half_life_s": 60.0}
    assert planner_config().fair_share_half_life_s == 60.0


def test_the_cluster_summary_carries_the_team_bars(operator, researcher, org, make_job, make_nodes):
    node = make_nodes(racks=1, switches=1, nodes=1, gpus=16)[0]
    actions.add_team_member(org["vision"], operator, researcher)
    job = make_job(name="wide", dp=12, dp_min=12, dp_max=12, global_batch=48, micro_batch=4)
    actions.place_job(job, [(node, i) for i in range(12)], actor="test", reason={})
    rows = {t["name"]: t for t in cluster_summary()["teams"]}
    vision = rows["vision"]
    assert (vision["gpus_held"], vision["gpus_borrowed"], vision["gpus_may_take"]) == (12, 4, 0)
    assert vision["words"] == "12 GPUs: 4 borrowed beyond its quota of 8; may borrow up to 4"
    assert vision["bar"] == {"within_pct": 66.67, "borrowed_pct": 33.33, "quota_pct": 66.67, "scale_gpus": 12}
    assert rows["speech"]["bar"]["within_pct"] == 0.0
    assert Node.objects.count() == 1


def test_gpus_another_teams_reservation_lends_count_against_no_quota(operator, researcher, org, make_job,
                                                                     make_nodes):
    node = make_nodes(racks=1, switches=1, nodes=1, gpus=8)[0]
    actions.add_team_member(org["vision"], operator, researcher)
    speech_res = actions.create_reservation(operator, name="speech-window", team=org["speech"], gpus=4,
                                            start_at=timezone.now() + HOUR)
    vision_res = actions.create_reservation(operator, name="vision-window", team=org["vision"], gpus=2,
                                            start_at=timezone.now() + HOUR)
    lent = make_job(name="on-speechs", dp=4, dp_min=4, dp_max=4)
    actions.place_job(lent, [(node, i) for i in range(4)], actor="test", reason={}, borrowed_from=speech_res)
    own = make_job(name="on-visions", dp=2, dp_min=2, dp_max=2)
    actions.place_job(own, [(node, 4), (node, 5)], actor="test", reason={}, borrowed_from=vision_res)
    rows = {t["name"]: t for t in api_client(researcher).get("/api/teams/").json()["results"]}
    # Speech's GPUs go back to speech's pool when reclaimed, not to a quota; vision's own do count.
    assert (rows["vision"]["gpus_held"], rows["vision"]["gpus_on_loan"]) == (2, 4)
    assert rows["vision"]["words"] == "2 of 8 guaranteed GPUs; may borrow up to 4"
    assert (rows["lab"]["gpus_held"], rows["lab"]["gpus_on_loan"]) == (2, 4)
    assert rows["speech"]["gpus_held"] == 0


def test_a_new_teams_usage_series_begins_when_it_was_made_or_first_held_a_gpu(org, operator, researcher, make_job,
                                                                              make_nodes):
    """A team's page draws its history over the range asked for, but not from before the team (or
    any team inside it) existed: a team made an hour ago is drawn over that hour, not as a day of
    zeros with its history squeezed against the right edge. An allocation older than the team's
    record (a team re-parented under a newer one) still starts the series where it began."""
    from jobs.team_data import team_usage_series

    node = make_nodes(racks=1, switches=1, nodes=1, gpus=8)[0]
    actions.add_team_member(org["vision"], operator, researcher)
    now = timezone.now()
    Team.objects.filter(pk__in=[org["lab"].pk, org["vision"].pk, org["speech"].pk]).update(created_at=now - HOUR)
    day_ago = now - 24 * HOUR
    series = team_usage_series(org["lab"], day_ago, now)
    assert series["t"][0] == (now - HOUR).isoformat() and series["gpus"] == [0, 0]
    # A child made earlier than its parent (re-parented later) starts its parent's series.
    Team.objects.filter(pk=org["speech"].pk).update(created_at=now - 5 * HOUR)
    assert team_usage_series(org["lab"], day_ago, now)["t"][0] == (now - 5 * HOUR).isoformat()
    # GPUs held before any of the teams' records: the series starts where they were first held.
    job = make_job(owner=researcher, name="older", dp=2, dp_min=2, dp_max=2, team=org["vision"])
    Allocation.objects.bulk_create([Allocation(job=job, node=node, gpu_index=i, since=now - 8 * HOUR) for i in (0, 1)])
    Allocation.objects.filter(job=job).release(at=now - 7 * HOUR)
    series = team_usage_series(org["lab"], day_ago, now)
    assert series["t"][0] == (now - 8 * HOUR).isoformat() and series["gpus"] == [2, 0, 0]
    # A range shorter than the team's life is the range, as before.
    assert team_usage_series(org["lab"], now - 2 * HOUR, now)["t"][0] == (now - 2 * HOUR).isoformat()

"""The API answers who may see a job as the pages do (``jobs.roles.job_visibility``): lists, detail,
the audit rows and the reservations, under each ``OMNI_JOB_VISIBILITY``."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.test import override_settings

from jobs import actions
from tests.conftest import api_client

pytestmark = pytest.mark.django_db

SUMMARY_KEYS = {"id", "name", "owner", "priority", "state", "gpus", "visibility"}


@pytest.fixture
def jobs(researcher, other_researcher, make_job):
    return {"mine": make_job(name="mine"), "theirs": make_job(owner=other_researcher, name="theirs")}


def _by_name(response) -> dict[str, dict]:
    assert response.status_code == 200
    return {job["name"]: job for job in response.json()["results"]}


def test_summary_is_the_default():
    assert settings.OMNI_JOB_VISIBILITY == "summary"


def test_list_gives_others_jobs_as_summaries_by_default(researcher, jobs):
    listed = _by_name(api_client(researcher).get("/api/jobs/"))
    assert listed["mine"]["visibility"] == "full" and "global_batch" in listed["mine"]
    assert set(listed["theirs"]) == SUMMARY_KEYS
    assert listed["theirs"] == {"id": jobs["theirs"].pk, "name": "theirs", "owner": "rob", "priority": "regular",
                                "state": "pending", "gpus": 0, "visibility": "summary"}


@override_settings(OMNI_JOB_VISIBILITY="all")
def test_list_gives_every_job_in_full_with_all(researcher, jobs):
    listed = _by_name(api_client(researcher).get("/api/jobs/"))
    assert {job["visibility"] for job in listed.values()} == {"full"} and set(listed) == {"mine", "theirs"}


@override_settings(OMNI_JOB_VISIBILITY="own")
def test_list_leaves_others_jobs_out_with_own(researcher, operator, jobs):
    assert set(_by_name(api_client(researcher).get("/api/jobs/"))) == {"mine"}
    assert set(_by_name(api_client(operator).get("/api/jobs/"))) == {"mine", "theirs"}


@pytest.mark.parametrize(("setting", "status", "keys"), [
    ("summary", 200, SUMMARY_KEYS), ("all", 200, None), ("own", 404, None),
])
def test_detail_of_anothers_job_follows_the_setting(setting, status, keys, researcher, auditor, jobs):
    with override_settings(OMNI_JOB_VISIBILITY=setting):
        response = api_client(researcher).get(f"/api/jobs/{jobs['theirs'].pk}/")
        assert response.status_code == status
        if status == 200 and keys:
            assert set(response.json()) == keys
        elif status == 200:
            assert response.json()["visibility"] == "full" and "allocations" in response.json()
        assert api_client(researcher).get(f"/api/jobs/{jobs['mine'].pk}/").json()["visibility"] == "full"
        assert api_client(auditor).get(f"/api/jobs/{jobs['theirs'].pk}/").json()["visibility"] == "full"


@pytest.mark.parametrize(("setting", "status"), [("summary", 403), ("own", 404)])
def test_cancelling_anothers_job_is_refused_as_its_visibility_says(setting, status, researcher, jobs):
    with override_settings(OMNI_JOB_VISIBILITY=setting):
        assert api_client(researcher).post(f"/api/jobs/{jobs['theirs'].pk}/cancel/").status_code == status


@pytest.mark.parametrize(("setting", "seen"), [("summary", {"mine"}), ("all", {"mine", "theirs"}), ("own", {"mine"})])
def test_audit_rows_are_those_of_jobs_seen_in_full(setting, seen, researcher, operator, jobs, make_nodes):
    node = make_nodes(racks=1, switches=1, nodes=1)[0]
    actions.cordon_node(node, operator)  # a row with no job: for operators and auditors only
    with override_settings(OMNI_JOB_VISIBILITY=setting):
        rows = api_client(researcher).get("/api/events/").json()["results"]
    assert {row["job_name"] for row in rows} == seen


def test_mixed_visibility_list_keeps_its_query_count(researcher, other_researcher, make_job, make_nodes,
                                                      django_assert_max_num_queries):
    nodes = make_nodes(racks=1, switches=1, nodes=4)
    for i in range(12):
        job = make_job(owner=researcher if i % 2 else other_researcher, name=f"j{i}", dp=1, dp_min=1, dp_max=1,
                       global_batch=4, micro_batch=4)
        actions.place_job(job, [(nodes[i % 4], i // 4)], actor="t", reason={})
    with django_assert_max_num_queries(6):
        listed = _by_name(api_client(researcher).get("/api/jobs/"))
    assert sorted(job["visibility"] for job in listed.values()) == ["full"] * 6 + ["summary"] * 6
    assert {job["gpus"] for job in listed.values()} == {1}


def test_a_reservation_names_its_job_only_to_those_who_may_know_it(researcher, operator, make_job):
    from django.utils import timezone

    critical = make_job(owner=operator, name="crit", priority="critical", dp=2, dp_min=2, dp_max=2)
    actions.create_reservation(operator, name="window", job=critical, gpus=2, start_at=timezone.now())
    for setting, named in (("summary", "crit"), ("own", None)):
        with override_settings(OMNI_JOB_VISIBILITY=setting):
            assert api_client(researcher).get("/api/reservations/").json()["results"][0]["job"] == named
    with override_settings(OMNI_JOB_VISIBILITY="own"):
        assert api_client(operator).get("/api/reservations/").json()["results"][0]["job"] == "crit"

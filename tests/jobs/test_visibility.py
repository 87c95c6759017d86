"""The one rule for who sees what of a job (``jobs.roles``), and the setting that chooses it."""

from __future__ import annotations

import pytest
from django.test import override_settings

from jobs import roles
from jobs.models import Job
from jobs.roles import Visibility
from tests.jobs.test_settings import _check

pytestmark = pytest.mark.django_db

FULL, SUMMARY, NONE = Visibility.FULL, Visibility.SUMMARY, Visibility.NONE


@pytest.mark.parametrize(
    ("setting", "others"), [("summary", SUMMARY), ("all", FULL), ("own", NONE)],
)
def test_researchers_see_their_own_jobs_fully_and_others_as_the_setting_says(
    setting, others, researcher, other_researcher, make_job
):
    mine, theirs = make_job(), make_job(owner=other_researcher)
    with override_settings(OMNI_JOB_VISIBILITY=setting):
        assert roles.job_visibility(researcher, mine) is FULL
        assert roles.job_visibility(researcher, theirs) is others


@pytest.mark.parametrize("setting", ["summary", "all", "own"])
def test_operators_and_auditors_see_every_job_fully_and_outsiders_none(
    setting, operator, auditor, outsider, other_researcher, make_job
):
    theirs = make_job(owner=other_researcher)
    with override_settings(OMNI_JOB_VISIBILITY=setting):
        assert roles.job_visibility(operator, theirs) is FULL
        assert roles.job_visibility(auditor, theirs) is FULL
        assert roles.job_visibility(outsider, theirs) is NONE


@pytest.mark.parametrize("setting", ["summary", "all", "own"])
@pytest.mark.parametrize("at_least", [SUMMARY, FULL])
def test_the_queryset_filter_is_the_same_rule(setting, at_least, researcher, other_researcher, operator, outsider,
                                              make_job):
    make_job()
    make_job(owner=other_researcher)
    make_job(owner=operator)
    with override_settings(OMNI_JOB_VISIBILITY=setting):
        for user in (researcher, other_researcher, operator, outsider):
            filtered = set(roles.visible_jobs(user, Job.objects.all(), at_least).values_list("id", flat=True))
            by_rule = {job.pk for job in Job.objects.all() if roles.job_visibility(user, job) >= at_least}
            assert filtered == by_rule, (setting, at_least, user.username)


def test_a_summary_keeps_name_owner_class_state_and_gpus_only():
    record = {"id": 3, "name": "n", "owner": "rob", "priority": "regular", "state": "running", "gpus": 8,
              "dp": 4, "global_batch": 512, "pending_reason": "", "allocations": []}
    assert roles.summarise(record) == {"id": 3, "name": "n", "owner": "rob", "priority": "regular",
                                       "state": "running", "gpus": 8, "visibility": "summary"}


def test_a_bad_job_visibility_stops_startup_naming_the_variable():
    result = _check({"OMNI_JOB_VISIBILITY": "everyone"})
    assert result.returncode == 2
    assert result.stderr.strip().startswith("omni: bad environment: OMNI_JOB_VISIBILITY")

"""Submitting a job that could never run on this cluster is refused with the field that says why,
the same from the action and the API (400); nothing is written."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from jobs import actions
from jobs.models import ElasticEvent, Job
from tests.conftest import api_client

pytestmark = pytest.mark.django_db

SPEC = dict(name="sft-a", priority="regular", tp=8, pp=1, dp=2, dp_min=1, dp_max=4,
            global_batch=64, micro_batch=4, total_steps=1000, step_s=2.0)

# Each case: the change to SPEC, the field named, and the message (cluster: 3 nodes of 8 GPUs).
CANNOT_FIT = [
    ({"tp": 16, "dp": 1, "dp_max": 2}, "tp", "16 GPUs per tensor-parallel group but the largest node has 8"),
    ({"dp": 4, "dp_min": 4, "global_batch": 64}, "dp_min",
     "at least 4 replicas of 8 GPUs (32 GPUs) but the whole cluster has room for 3 (24 GPUs on 3 nodes)"),
    ({"dp": 4, "dp_min": None, "dp_max": None}, "dp",
     "at least 4 replicas of 8 GPUs (32 GPUs) but the whole cluster has room for 3 (24 GPUs on 3 nodes)"),
    ({"tp": 4, "pp": 2, "dp": 4, "dp_min": 4}, "dp_min",
     "at least 4 replicas of 8 GPUs (32 GPUs) but the whole cluster has room for 3 (24 GPUs on 3 nodes)"),
    ({"global_batch": 100}, "global_batch",
     "global batch 100 is not micro-batch 4 × dp 2 × a whole number of accumulation steps (8 does not divide 100)"),
]


@pytest.fixture
def three_nodes(make_nodes):
    return make_nodes(racks=1, switches=1, nodes=3, gpus=8)


def _spec(change: dict) -> dict:
    return {k: v for k, v in {**SPEC, **change}.items() if v is not None}


@pytest.mark.parametrize(("change", "field", "message"), CANNOT_FIT)
def test_the_action_refuses_a_job_that_cannot_fit_naming_the_field(researcher, three_nodes, change, field, message):
    with pytest.raises(ValidationError) as refused:
        actions.submit_job(researcher, **_spec(change))
    assert refused.value.message_dict == {field: [message]}
    assert not Job.objects.exists() and not ElasticEvent.objects.exists()


@pytest.mark.parametrize(("change", "field", "message"), CANNOT_FIT)
def test_the_api_answers_400_naming_the_field(researcher, three_nodes, change, field, message):
    response = api_client(researcher).post("/api/jobs/", _spec(change), format="json")
    assert response.status_code == 400, response.content
    assert response.json() == {field: [message]}
    assert not Job.objects.exists() and not ElasticEvent.objects.exists()


def test_a_job_that_fits_is_accepted(researcher, three_nodes):
    response = api_client(researcher).post("/api/jobs/", _spec({"dp": 3, "dp_max": 3, "global_batch": 96}),
                                           format="json")
    assert response.status_code == 201, response.content


def test_a_cluster_without_nodes_yet_refuses_nothing(researcher):
    assert actions.submit_job(researcher, **_spec({"tp": 64, "dp": 1})).state == "pending"


def test_an_edit_cannot_make_a_pending_job_one_that_never_fits(three_nodes, researcher, operator):
    job = actions.submit_job(researcher, **SPEC)
    rows = ElasticEvent.objects.count()
    with pytest.raises(ValidationError) as refused:
        actions.edit_job(job, operator, tp=16, dp_max=2)
    assert refused.value.message_dict["tp"] == ["16 GPUs per tensor-parallel group but the largest node has 8"]
    job.refresh_from_db()
    assert (job.tp, ElasticEvent.objects.count()) == (8, rows)

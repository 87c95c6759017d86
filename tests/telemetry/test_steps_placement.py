"""``POST /api/telemetry/steps`` takes a node's records only for jobs placed on that node, and the
ingestion endpoints answer hostile JSON with 400, storing nothing (issue 16)."""

from __future__ import annotations

import json
import time

import pytest
from django.test import Client

from jobs.models import Allocation
from telemetry.models import GpuSample, StepRecord

pytestmark = pytest.mark.django_db


def _agent(node) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {node.token}", "HTTP_X_OMNI_NODE": node.name}


def _steps(job_id: int, seq: int = 0) -> dict:
    now = time.time()
    return {"source": "agent-steps", "seq": seq,
            "samples": [{"job": job_id, "rank": 0, "step": s, "at": now - 10 + s, "step_s": 1.0} for s in range(3)]}


def _post(path: str, body: str | dict, node) -> object:
    text = body if isinstance(body, str) else json.dumps(body)
    return Client().post(path, text, content_type="application/json", **_agent(node))


def test_steps_for_a_job_placed_elsewhere_are_refused(node, make_job):
    job = make_job()
    response = _post("/api/telemetry/steps", _steps(job.pk), node)
    assert response.status_code == 400
    assert f"job {job.pk} is not placed on node {node.name}" in response.json()["samples[0].job"][0]
    assert StepRecord.objects.count() == 0


def test_steps_for_a_job_placed_on_the_sender_are_stored(node, make_job):
    job = make_job()
    Allocation.objects.create(job=job, node=node, gpu_index=0)
    response = _post("/api/telemetry/steps", _steps(job.pk), node)
    assert response.status_code == 200, response.content
    assert StepRecord.objects.filter(job=job, node=node).count() == 3


DEEP = "[" * 50_000 + "]" * 50_000


@pytest.mark.parametrize(("path", "body"), [
    ("/api/telemetry/gpu", '{"source": "s", "seq": 0, "samples": ' + DEEP + "}"),
    ("/api/telemetry/steps", DEEP),
    ("/api/telemetry/gpu", '{"source": "s", "seq": 0, "samples": [{"gpu": 0, "at": 1e999, "util_pct": 1, '
                           '"mem_used_bytes": 0}]}'),
    ("/api/telemetry/gpu", '{"source": "s", "seq": 0, "samples": [{"\\ud800": 1}]}'),
    ("/api/telemetry/gpu", '{"source": "\\udfff", "seq": 0, "samples": []}'),
    ("/api/telemetry/steps", '{"source": "s", "seq": 0, "samples": [{"job": 9223372036854775808, "rank": 0, '
                             '"step": 0, "at": 1, "step_s": 1}]}'),
    ("/api/telemetry/steps", '{"source": "s", "seq": 0, "samples": [{"job": 9223372036854775807, "rank": 0, '
                             '"step": 0, "at": 1, "step_s": 1}]}'),
    ("/api/telemetry/steps", '{"source": "s", "seq": 0, "samples": [{"job": -1, "rank": 0, "step": 0, "at": 1, '
                             '"step_s": 1}]}'),
    ("/api/telemetry/gpu", '{"source": "s", "seq": NaN, "samples": []}'),
])
def test_hostile_batches_are_400_and_store_nothing(node, path, body):
    response = _post(path, body, node)
    assert response.status_code == 400, response.content
    assert response.json()
    assert GpuSample.objects.count() == 0 and StepRecord.objects.count() == 0


def test_an_infinite_time_is_refused_by_validation_too(node):
    from telemetry.ingest import BatchRejected, ingest_gpu_batch

    batch = {"source": "s", "seq": 0, "samples": [{"gpu": 0, "at": float("inf"), "util_pct": 1.0,
                                                   "mem_used_bytes": 0}]}
    with pytest.raises(BatchRejected) as refused:
        ingest_gpu_batch(node, batch)
    assert refused.value.errors["samples[0].at"] == ["expected a finite time"]

"""The HTTP ingestion endpoints: per-node agent tokens, 400 bodies, duplicates."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from telemetry.models import GpuSample
from tests.telemetry.conftest import gpu_batch

pytestmark = pytest.mark.django_db


def _post(path: str, body, **headers):
    return Client().post(path, json.dumps(body), content_type="application/json", **headers)


def _agent(node):
    return {"HTTP_AUTHORIZATION": f"Bearer {node.token}", "HTTP_X_OMNI_NODE": node.name}


def test_agent_with_its_token_stores_a_batch(node):
    response = _post("/api/telemetry/gpu", gpu_batch(samples=8), **_agent(node))
    assert response.status_code == 200
    assert response.json() == {"kind": "gpu", "source": "agent-test", "seq": 0, "accepted": 8, "duplicate": False}
    again = _post("/api/telemetry/gpu", gpu_batch(samples=8), **_agent(node))
    assert (again.status_code, again.json()["duplicate"]) == (200, True)
    assert GpuSample.objects.count() == 8


def test_missing_token_is_401(node):
    response = _post("/api/telemetry/gpu", gpu_batch())
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_missing_node_header_is_401(node):
    response = _post("/api/telemetry/gpu", gpu_batch(), HTTP_AUTHORIZATION=f"Bearer {node.token}")
    assert response.status_code == 401


@pytest.mark.parametrize("which", ["wrong token", "unknown node", "another node's token"])
def test_wrong_credentials_are_403_and_store_nothing(node, which):
    headers = _agent(node)
    if which == "wrong token":
        headers["HTTP_AUTHORIZATION"] = "Bearer not-the-token"
    elif which == "unknown node":
        headers["HTTP_X_OMNI_NODE"] = "no-such-node"
    else:
        from jobs.models import Node

        other = Node.objects.create(name="other", rack="r9", switch="r9s0", gpu_count=8)
        other.issue_token()
        other.save(update_fields=["agent_token_hash"])
        headers["HTTP_X_OMNI_NODE"] = other.name
    response = _post("/api/telemetry/gpu", gpu_batch(), **headers)
    assert response.status_code == 403
    assert response.json() == {"detail": "agent token does not match this node"}
    assert GpuSample.objects.count() == 0


def test_bad_batch_is_400_with_a_message_per_sample_and_field(node):
    batch = gpu_batch(samples=8)
    batch["samples"][1]["util_pct"] = 140
    batch["samples"][6]["gpu"] = 12
    response = _post("/api/telemetry/gpu", batch, **_agent(node))
    assert response.status_code == 400
    body = response.json()
    assert body["samples[1].util_pct"] == ["utilisation must be within 0-100, got 140"]
    assert body["samples[6].gpu"] == [f"unknown GPU 12: node {node.name} has GPUs 0-7"]
    assert GpuSample.objects.count() == 0


def test_malformed_json_is_400(node):
    response = Client().post("/api/telemetry/steps", "{nope", content_type="application/json", **_agent(node))
    assert response.status_code == 400


def test_users_cannot_post_telemetry(operator, node):
    client = Client()
    client.force_login(operator)
    response = client.post("/api/telemetry/gpu", json.dumps(gpu_batch()), content_type="application/json")
    assert response.status_code in (401, 403)

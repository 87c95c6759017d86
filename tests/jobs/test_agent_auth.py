"""One agent-authentication function (``jobs.agent_auth``) behind every surface that takes agent
tokens: the agent socket, its HTTP fallback and telemetry ingestion, each with a missing, a wrong
and a good token, and never a token in the log."""

from __future__ import annotations

import json
import logging

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.test import Client

from jobs.agent_auth import authenticate_agent
from jobs.consumers import AgentConsumer
from tests.telemetry.conftest import gpu_batch
from trainer_agent import protocol

CREDENTIALS = {
    "missing": {},
    "wrong": {"authorization": "Bearer not-the-token", "x-omni-node": "{node}"},
    "another node's": {"authorization": "Bearer {token}", "x-omni-node": "someone-else"},
    "good": {"authorization": "Bearer {token}", "x-omni-node": "{node}"},
}


@pytest.fixture
def agent(make_nodes):
    """A node with an issued token; the token is returned, only its hash is stored."""
    node = make_nodes(racks=1, switches=1, nodes=1, gpus=8)[0]
    token = node.issue_token()
    node.save(update_fields=["agent_token_hash"])
    return node, token


def _headers(which: str, node, token: str) -> dict[str, str]:
    return {k: v.format(token=token, node=node.name) for k, v in CREDENTIALS[which].items()}


@pytest.mark.django_db
def test_authenticate_agent_finds_the_tokens_node_and_nothing_else(agent, make_nodes):
    node, token = agent
    assert authenticate_agent(token) == node
    assert authenticate_agent("") is None
    assert authenticate_agent("not-the-token") is None
    assert authenticate_agent(token + "x") is None


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("which", "code"), [
    ("missing", protocol.CLOSE_MISSING_TOKEN), ("wrong", protocol.CLOSE_BAD_TOKEN),
    ("another node's", protocol.CLOSE_BAD_TOKEN), ("good", None),
])
def test_agent_socket(which, code, agent, caplog):
    node, token = agent
    headers = [(k.encode(), v.encode()) for k, v in _headers(which, node, token).items()]

    async def scenario():
        communicator = WebsocketCommunicator(AgentConsumer.as_asgi(), protocol.AGENT_PATH, headers=headers)
        connected, _ = await communicator.connect()
        assert connected  # accepted first, so the refusal can say why
        frame = await communicator.receive_json_from(timeout=2)
        if code is None:
            assert frame["type"] == protocol.WELCOME and frame["node"] == node.name
            await communicator.disconnect()
            return
        assert frame["type"] == protocol.ERROR and frame["code"] == "unauthorized"
        assert await communicator.receive_output(timeout=2) == {"type": "websocket.close", "code": code}

    with caplog.at_level(logging.INFO, logger="jobs.agent"):
        async_to_sync(scenario)()
    assert token not in caplog.text and "not-the-token" not in caplog.text


def _post_as(which: str, agent, path: str, body: dict, caplog):
    """POST ``body`` with the ``which`` credentials; the log must not hold a token either way."""
    node, token = agent
    headers = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in _headers(which, node, token).items()}
    with caplog.at_level(logging.INFO, logger="jobs.agent"):
        response = Client().post(path, json.dumps(body), content_type="application/json", **headers)
    assert token not in caplog.text and "not-the-token" not in caplog.text
    return response


STATUSES = [("missing", 401), ("wrong", 403), ("another node's", 403), ("good", 200)]


@pytest.mark.django_db
@pytest.mark.parametrize(("which", "status"), STATUSES)
def test_http_fallback(which, status, agent, caplog):
    response = _post_as(which, agent, protocol.HTTP_HEARTBEAT_PATH, {"type": "heartbeat", "gpus": [], "workers": []},
                        caplog)
    assert response.status_code == status
    if status != 200:
        assert response.json()["code"] == "unauthorized"
    else:
        agent[0].refresh_from_db()
        assert agent[0].last_heartbeat_at is not None


@pytest.mark.django_db
@pytest.mark.parametrize(("which", "status"), STATUSES)
def test_telemetry_post(which, status, agent, caplog):
    response = _post_as(which, agent, "/api/telemetry/gpu", gpu_batch(samples=8), caplog)
    assert response.status_code == status
    if status == 200:
        assert response.json()["accepted"] == 8

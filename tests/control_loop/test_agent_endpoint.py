"""The agent endpoint refuses what it must: wrong or missing tokens, malformed frames, unknown
command ids, on a real daphne server, and nothing in the database changes."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.control_loop.conftest import db_fingerprint, make_node
from trainer_agent import protocol

pytestmark = [pytest.mark.services, pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(120)]


async def _closed_code(url: str, headers: dict[str, str]) -> tuple[int | None, list[dict]]:
    frames = []
    async with connect(url, additional_headers=headers, open_timeout=10) as ws:
        try:
            while True:
                frames.append(json.loads(await asyncio.wait_for(ws.recv(), timeout=10)))
        except ConnectionClosed as exc:
            return (exc.rcvd.code if exc.rcvd else None), frames
    return None, frames


async def _conversation(url: str, token: str, sends: list[str]) -> list[dict]:
    """Send each raw text frame and collect the server's answers (error frames)."""
    replies = []
    async with connect(url, additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=10) as ws:
        welcome = json.loads(await asyncio.wait_for(ws.recv(), timeout=10))
        assert welcome["type"] == "welcome"
        for text in sends:
            await ws.send(text)
            replies.append(json.loads(await asyncio.wait_for(ws.recv(), timeout=10)))
    return replies


async def _replaced_code(url: str, token: str) -> int | None:
    headers = {"Authorization": f"Bearer {token}"}
    async with connect(url, additional_headers=headers, open_timeout=10) as first:
        assert json.loads(await asyncio.wait_for(first.recv(), timeout=10))["type"] == "welcome"
        async with connect(url, additional_headers=headers, open_timeout=10) as second:
            assert json.loads(await asyncio.wait_for(second.recv(), timeout=10))["type"] == "welcome"
            try:
                while True:
                    await asyncio.wait_for(first.recv(), timeout=10)
            except ConnectionClosed as exc:
                return exc.rcvd.code if exc.rcvd else None
    return None


def _post(url: str, body: bytes, token: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_wrong_or_missing_tokens_and_bad_frames_are_refused_and_change_nothing(control_cluster, caplog):
    node, token = make_node("n1", 2)
    control_cluster.start_server()
    ws_url = control_cluster.url.replace("http", "ws") + protocol.AGENT_PATH
    before = db_fingerprint()

    code, frames = asyncio.run(_closed_code(ws_url, {}))
    assert code == protocol.CLOSE_MISSING_TOKEN
    assert frames and frames[0]["code"] == "unauthorized"
    code, _ = asyncio.run(_closed_code(ws_url, {"Authorization": "Bearer not-the-token"}))
    assert code == protocol.CLOSE_BAD_TOKEN
    code, _ = asyncio.run(_closed_code(ws_url, {"Authorization": f"Bearer {token}", "X-Omni-Node": "someone-else"}))
    assert code == protocol.CLOSE_BAD_TOKEN

    replies = asyncio.run(_conversation(ws_url, token, [
        "this is not json",
        json.dumps([1, 2, 3]),
        json.dumps({"no": "type"}),
        json.dumps({"type": "launch-missiles"}),
        json.dumps({"type": "ack"}),
        json.dumps({"type": "done", "command": "123", "ok": "yes"}),
        json.dumps({"type": "ack", "command": "00000000-0000-0000-0000-000000000000"}),
        json.dumps({"type": "done", "command": "not-a-uuid", "ok": True, "outcome": {}}),
        json.dumps({"type": "steps", "job": "nobody", "records": [{"step": 1}]}),
        json.dumps({"type": "hello", "protocol": 99, "inventory": {}}),
    ]))
    codes = [r["code"] for r in replies]
    assert codes == ["bad_json", "bad_frame", "bad_frame", "unknown_type", "missing_field", "bad_field",
                     "unknown_command", "unknown_command", "stale_records", "bad_version"]
    assert all(r["type"] == "error" and r["message"] for r in replies)

    heartbeat = json.dumps({"type": "heartbeat", "gpus": [], "workers": []}).encode()
    status, body = _post(control_cluster.url + protocol.HTTP_HEARTBEAT_PATH, heartbeat, None)
    assert status == 401 and body["code"] == "unauthorized"
    status, body = _post(control_cluster.url + protocol.HTTP_HEARTBEAT_PATH, heartbeat, "wrong")
    assert status == 403
    status, body = _post(control_cluster.url + protocol.HTTP_HEARTBEAT_PATH, b"{not json", token)
    assert status == 400 and body["code"] == "bad_json"

    assert db_fingerprint() == before
    log = (control_cluster.tmp / "daphne.log").read_text()
    assert "agent refused: no token" in log and "agent refused: unknown token" in log
    assert token not in log and "not-the-token" not in log

    # A second agent for the same node takes over; the first is closed with 4409.
    assert asyncio.run(_replaced_code(ws_url, token)) == protocol.CLOSE_REPLACED

    # The HTTP fallback with the right token is a heartbeat like any other.
    status, body = _post(control_cluster.url + protocol.HTTP_HEARTBEAT_PATH, heartbeat, token)
    assert status == 200 and body["ok"] is True
    node.refresh_from_db()
    assert node.last_heartbeat_at is not None

"""Hardening (issue 16): agents' numbers cannot break the audit chain, an export verifies on its
own, hostile input is refused with a clear answer and writes nothing, fencing is not amplified."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.db import transaction
from django.test import Client, override_settings

from jobs import actions
from jobs.actions.commands import write_stop_commands
from jobs.agent_api import handle_frame
from jobs.audit import canonical_json, canonical_number, record_event, verify_chain
from jobs.consumers import AgentConsumer
from jobs.live_consumers import LiveConsumer
from jobs.models import Command, ElasticEvent, Node
from jobs.models.commands import CommandState
from jobs.vocab import CommandKind
from trainer_agent import protocol

ROOT = Path(__file__).resolve().parents[2]
VERIFIER = ROOT / "tools" / "verify_audit_export.py"


@pytest.fixture
def agent_node(make_nodes):
    node = make_nodes(racks=1, switches=1, nodes=1, gpus=8)[0]
    node.token = node.issue_token()
    node.save(update_fields=["agent_token_hash"])
    return node


def _stop_command(job, node) -> Command:
    with transaction.atomic():
        return write_stop_commands(job, [node])[0]


def _rows() -> tuple[int, int]:
    return ElasticEvent.objects.count(), Command.objects.count()


# -- (1) numbers an agent sends cannot break verification --------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db
@pytest.mark.parametrize("number", [1e15, 1e16, 1e23, 1e300, 2.0**60, 123456789.0])
def test_integral_floats_of_any_size_verify_after_jsonb_gives_them_back_as_integers(number):
    with transaction.atomic():
        record_event("cordon", actor="agent:n0", outcome={"save_s": number, "nested": [number, 0.1]},
                     reason={"rule": "x", "text": "t", "inputs": {"n": number}})
    event = ElasticEvent.objects.get()
    # jsonb keeps a number's decimal digits: "1e+16" comes back as the integer 10**16, while
    # "123456789.0" stays a float; either way the row verifies.
    assert canonical_number(event.outcome["save_s"]) == canonical_number(number)
    assert verify_chain().ok


@pytest.mark.django_db
def test_a_done_with_save_s_1e16_is_refused_and_writes_nothing(agent_node, make_job):
    command = _stop_command(make_job(), agent_node)
    before = _rows()
    frame = {"type": "done", "command": str(command.id), "ok": True, "outcome": {"save_s": 1e16, "step": 3}}
    replies = handle_frame(agent_node, protocol.validate_agent_frame(frame))
    assert replies[0]["code"] == "bad_outcome" and "'save_s'" in replies[0]["message"]
    command.refresh_from_db()
    assert command.state != CommandState.DONE and command.outcome in ({}, None)
    assert _rows() == before


@pytest.mark.django_db
@pytest.mark.parametrize("outcome", [
    {"checkpoint_step": -5}, {"step": 2**60}, {"load_s": -1.0}, {"pid": "12"}, {"killed": 1}, {"code": True},
    {"run_id": "r" * 65}, {"bytes_freed": -1}, {"error": ["a", "list"]},
])
def test_outcome_fields_are_type_and_range_checked(agent_node, make_job, outcome):
    command = _stop_command(make_job(), agent_node)
    with pytest.raises(protocol.ProtocolError) as refused:
        actions.record_command_outcome(agent_node, str(command.id), ok=True, outcome=outcome)
    assert refused.value.code == "bad_outcome" and next(iter(outcome)) in str(refused.value)
    command.refresh_from_db()
    assert command.state == CommandState.PENDING


@pytest.mark.django_db
def test_a_good_outcome_is_kept_with_a_long_error_cut_to_its_tail(agent_node, make_job):
    command = _stop_command(make_job(), agent_node)
    outcome = {"save_s": 2.5, "step": 10, "killed": False, "code": -9, "error": "x" * 9000 + "END", "extra": 1}
    actions.record_command_outcome(agent_node, str(command.id), ok=True, outcome=outcome)
    command.refresh_from_db()
    assert command.state == CommandState.DONE
    assert command.outcome["save_s"] == 2.5 and "extra" not in command.outcome
    assert len(command.outcome["error"]) == 4000 and command.outcome["error"].endswith("END")


# -- (3) an export verifies with the standalone verifier ----------------------------------------


def _verifier():
    spec = importlib.util.spec_from_file_location("verify_audit_export", VERIFIER)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _export(user, **params) -> list[dict]:
    client = Client()
    client.force_login(user)
    response = client.get("/audit/export.json", params)
    assert response.status_code == 200
    return json.loads(b"".join(response.streaming_content))


@pytest.mark.django_db
def test_an_export_holds_every_hashed_field_and_verifies_standalone(auditor, operator, make_job, tmp_path):
    job = make_job(name="exported")
    with transaction.atomic():
        record_event("cordon", job=job, actor=operator.username, actor_user=operator,
                     outcome={"save_s": 1e16, "ratio": 0.1 + 0.2, "tiny": 1.5e-7, "name": "ünïcode"})
        record_event("drain", actor="system", reason={"rule": "r", "text": "t", "inputs": {"big": 1e3}})
    rows = _export(auditor)
    assert len(rows) == ElasticEvent.objects.count() >= 3
    assert {"job_id", "actor_user_id"} <= set(rows[0])
    assert any(r["job_id"] == job.pk for r in rows) and any(r["actor_user_id"] == operator.pk for r in rows)
    verifier = _verifier()
    for row in rows:  # the verifier's canonical form is the server's, row for row
        assert verifier.canonical_text(row) == canonical_json(ElasticEvent.objects.get(pk=row["id"]))

    path = tmp_path / "export.json"
    path.write_text(json.dumps(rows))
    # -I: isolated mode, no project on sys.path: the verifier needs nothing but the standard library.
    run = subprocess.run([sys.executable, "-I", str(VERIFIER), str(path), "--complete"], capture_output=True,
                         text=True, cwd=tmp_path, check=False)
    assert run.returncode == 0, run.stderr
    assert f"{len(rows)} rows recompute" in run.stdout

    rows[1]["actor"] = "mallory"
    path.write_text(json.dumps(rows))
    run = subprocess.run([sys.executable, "-I", str(VERIFIER), str(path)], capture_output=True, text=True,
                         check=False)
    assert run.returncode == 1 and f"row {rows[1]['id']}" in run.stderr


@pytest.mark.django_db
def test_a_filtered_export_verifies_row_by_row_with_its_gaps_counted(auditor, make_job):
    for i in range(3):
        make_job(name=f"j{i}")
    with transaction.atomic():
        record_event("cordon", actor="olive")
    rows = _export(auditor, kind="submit")
    verdict = _verifier().verify(rows)
    assert verdict.ok and verdict.rows == 3
    assert not _verifier().verify(rows, complete=True).ok or rows[0]["prev_hash"] == "0" * 64


# -- (8) bad input: a clear 400 or error frame, nothing written ---------------------------------

DEEP = "[" * 50_000 + "]" * 50_000
HOSTILE_FRAMES = {
    "deep": '{"type": "heartbeat", "gpus": ' + DEEP + "}",
    "infinite at": '{"type": "steps", "job": "j", "records": [{"step": 1, "at": 1e999}], "seq": 1}',
    "surrogate key": '{"type": "heartbeat", "\\ud800": 1}',
    "surrogate job": '{"type": "steps", "job": "\\udc00", "records": [{"step": 1}]}',
    "huge integer": '{"type": "heartbeat", "seq": 9223372036854775808}',
    "negative exit step": '{"type": "exit", "job": "job-0", "outcome": {"outcome": "completed", "step": -5}}',
    "overflowing float": '{"type": "heartbeat", "disk": {"free_bytes": -1e400}}',
    "NUL in job": '{"type": "exit", "job": "a\\u0000b", "outcome": {}}',
    "unhashable worker job": '{"type": "heartbeat", "workers": [{"job": [1]}]}',
    "negative record step": '{"type": "steps", "job": "j", "records": [{"step": -5}]}',
    "not json": "hello there",
}


@pytest.mark.django_db
@pytest.mark.parametrize("name", sorted(HOSTILE_FRAMES))
def test_hostile_heartbeat_posts_are_400_and_write_nothing(agent_node, make_job, name):
    make_job()
    before = _rows()
    response = Client().post(protocol.HTTP_HEARTBEAT_PATH, HOSTILE_FRAMES[name], content_type="application/json",
                             HTTP_AUTHORIZATION=f"Bearer {agent_node.token}")
    assert response.status_code == 400, response.content
    assert response.json()["type"] == "error" and response.json()["message"]
    assert _rows() == before


def test_nan_in_an_agent_frame_is_read_as_null_not_stored_as_a_number():
    frame = protocol.parse_frame('{"type": "steps", "job": "a", "records": [{"step": 3, "loss": NaN, "at": Infinity}]}')
    assert frame["records"][0] == {"step": 3, "loss": None, "at": None}


@pytest.mark.django_db(transaction=True)
def test_hostile_frames_on_the_agent_socket_get_error_frames_not_1011(agent_node):
    headers = [(b"authorization", f"Bearer {agent_node.token}".encode())]

    async def scenario():
        communicator = WebsocketCommunicator(AgentConsumer.as_asgi(), protocol.AGENT_PATH, headers=headers)
        assert (await communicator.connect())[0]
        assert (await communicator.receive_json_from(timeout=2))["type"] == protocol.WELCOME
        for text in HOSTILE_FRAMES.values():
            await communicator.send_to(text_data=text)
            reply = await communicator.receive_json_from(timeout=5)
            assert reply["type"] == protocol.ERROR and reply["message"], text[:60]
        await communicator.send_to(text_data=json.dumps({"type": "heartbeat"}))  # still open, still served
        assert await communicator.receive_nothing(timeout=1)
        await communicator.disconnect()

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_the_live_socket_answers_bad_messages_with_errors_and_stays_open(operator):
    async def scenario():
        communicator = WebsocketCommunicator(LiveConsumer.as_asgi(), "/ws/live/")
        communicator.scope["user"] = operator
        assert (await communicator.connect())[0]
        assert (await communicator.receive_json_from(timeout=2))["type"] == "hello"
        for text in ("not json", DEEP, '{"action": "subscribe", "stream": "\\ud800"}',
                     '{"action": "subscribe", "stream": "job", "id": 9223372036854775808}',
                     '{"action": "subscribe", "stream": "job", "id": "99999999999999999999999"}',
                     '{"action": "subscribe", "stream": "node", "id": 1e300}'):
            await communicator.send_to(text_data=text)
            reply = await communicator.receive_json_from(timeout=5)
            assert reply["type"] == "error" and reply["status"] == 400, (text[:60], reply)
        await communicator.send_to(bytes_data=b"\x00\x01")
        assert (await communicator.receive_json_from(timeout=2))["status"] == 400
        await communicator.send_json_to({"action": "subscribe", "stream": "cluster"})
        assert (await communicator.receive_json_from(timeout=2))["type"] == "subscribed"
        await communicator.disconnect()

    async_to_sync(scenario)()


@pytest.mark.django_db
@override_settings(OMNI_METRICS_TOKEN="metrics-token")
def test_a_non_ascii_bearer_on_metrics_is_403_not_500():
    response = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer m\u00e9trics-\u00fftoken")
    assert response.status_code == 403
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer metrics-token").status_code == 200


# -- (9) fencing is one stop per stray job ------------------------------------------------------


@pytest.mark.django_db
def test_a_hello_listing_one_stray_worker_2000_times_writes_one_stop(agent_node, make_job):
    stray, other = make_job(name="stray"), make_job(name="other-stray")
    workers = [{"job": "stray", "state": "running"}] * 2000 + [{"job": "other-stray"}, {"job": "no-such-job"}]
    fenced = actions.record_agent_hello(agent_node, workers)
    assert sorted(c.job.name for c in fenced) == ["other-stray", "stray"]
    stops = Command.objects.filter(node=agent_node, kind=CommandKind.STOP)
    assert stops.filter(job=stray).count() == 1 and stops.filter(job=other).count() == 1
    assert actions.record_agent_hello(agent_node, workers) == []  # their stops are still open
    assert Node.objects.get(pk=agent_node.pk).last_heartbeat_at is not None

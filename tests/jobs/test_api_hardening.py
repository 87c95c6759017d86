"""Hardening of the REST API (issue 16, items 6, 7, 8 and 10): bounded pages, no Basic and
throttled failed sign-ins and tokens, hostile bodies and ids a 400 or 404 (never a 500), and a
schema that says what the API does (nullable fields, the agents' scheme and bodies, 405s)."""

from __future__ import annotations

import base64
import json
import os
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.db import transaction
from django.test import Client, override_settings
from django.utils import timezone
from drf_spectacular.generators import SchemaGenerator
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from jobs import actions
from jobs.actions.accounts import issue_api_token
from jobs.api import throttles
from jobs.api.pagination import MAX_LIMIT
from jobs.audit import record_event
from jobs.models import ElasticEvent, Job, Node
from telemetry.api.serializers import GpuSampleSerializer, StepRecordSerializer
from telemetry.ingest.validate import GPU_FIELDS, STEP_FIELDS
from tests.conftest import api_client

pytestmark = pytest.mark.django_db

LISTS = ["/api/jobs/", "/api/nodes/", "/api/reservations/", "/api/teams/", "/api/events/"]
SPEC = {"name": "ok", "dp": 1, "global_batch": 4, "micro_batch": 4, "total_steps": 10, "step_s": 1.0}


def _rates(**rates: str):
    """The throttle rates of a test (the others as configured)."""
    current = settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]
    return override_settings(REST_FRAMEWORK={**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {**current, **rates}})


def _token_client(token: str, addr: str = "127.0.0.1") -> Client:
    return Client(HTTP_AUTHORIZATION=f"Token {token}", REMOTE_ADDR=addr)


@pytest.fixture
def agent_node(make_nodes):
    node = make_nodes(racks=1, switches=1, nodes=1, gpus=8)[0]
    node.token = node.issue_token()
    node.save(update_fields=["agent_token_hash"])
    return node


# -- (6) every list has a ceiling ----------------------------------------------------------------


@pytest.fixture
def one_of_each(operator, make_job, make_nodes):
    """A row in every list (an empty table answers any limit without asking the database)."""
    make_nodes()
    critical = make_job(owner=operator, name="crit", priority="critical", dp=1, dp_min=1, dp_max=1)
    actions.create_reservation(operator, name="window", job=critical, gpus=1, start_at=timezone.now(),
                               period_s=3600, active_s=1800)
    actions.create_team(operator, name="vision")


@pytest.mark.parametrize("path", LISTS)
@pytest.mark.parametrize("query", [f"limit={2**64}", f"limit={2**63}", "limit=1000000", f"offset={2**64}",
                                   "limit=lots", "limit=-5", "offset=-3", "offset=lots"])
def test_no_limit_or_offset_is_a_500_on_any_list(researcher, one_of_each, path, query):
    response = api_client(researcher).get(f"{path}?{query}")
    assert response.status_code == 200, response.content[:300]
    assert len(response.json()["results"]) <= MAX_LIMIT


def test_a_million_rows_asked_of_the_audit_log_get_one_page_of_max_limit(auditor):
    with transaction.atomic():
        for i in range(MAX_LIMIT + 5):
            record_event("cordon", actor="test", reason={"rule": "x", "text": f"row {i}", "inputs": {}})
    body = api_client(auditor).get("/api/events/?limit=1000000").json()
    assert body["count"] == MAX_LIMIT + 5
    assert len(body["results"]) == MAX_LIMIT
    assert f"limit={MAX_LIMIT}" in body["next"]


def test_the_schema_says_the_page_bounds():
    schema = SchemaGenerator().get_schema(request=None, public=True)
    for path in LISTS:
        parameters = {p["name"]: p["schema"] for p in schema["paths"][path]["get"]["parameters"]}
        assert parameters["limit"] == {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}
        assert parameters["offset"] == {"type": "integer", "minimum": 0}


# -- (7) no Basic, failed sign-ins and tokens throttled ------------------------------------------


def test_basic_authentication_is_not_accepted_even_with_the_right_password(researcher):
    basic = base64.b64encode(b"rita:rita-pass-1234").decode()
    response = Client(HTTP_AUTHORIZATION=f"Basic {basic}").get("/api/jobs/")
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Token"
    schemes = SchemaGenerator().get_schema(request=None, public=True)["components"]["securitySchemes"]
    assert "basicAuth" not in schemes and {"apiToken", "cookieAuth"} <= set(schemes)


def test_session_and_token_still_sign_in(researcher):
    _, token = issue_api_token(None, researcher)
    assert _token_client(token).get("/api/jobs/").status_code == 200
    session = Client()
    session.force_login(researcher)
    assert session.get("/api/jobs/").status_code == 200


def test_failed_tokens_are_throttled_per_address_with_retry_after(researcher):
    _, token = issue_api_token(None, researcher)
    with _rates(api_token="3/min"):
        for _ in range(3):
            assert _token_client("omni_wrong").get("/api/jobs/").status_code == 401
        refused = _token_client("omni_wrong").get("/api/jobs/")
        assert refused.status_code == 429
        assert 1 <= int(refused["Retry-After"]) <= 60
        assert "too many failed API tokens" in refused.json()["detail"]
        # Locked out: the address is refused before any token is looked up, a good one too ...
        assert _token_client(token).get("/api/jobs/").status_code == 429
        # ... while another address is not.
        assert _token_client(token, addr="10.0.0.7").get("/api/jobs/").status_code == 200


def test_good_tokens_are_never_throttled(researcher):
    _, token = issue_api_token(None, researcher)
    with _rates(api_token="3/min"):
        assert all(_token_client(token).get("/api/jobs/").status_code == 200 for _ in range(10))


def test_the_throttle_forgets_failures_older_than_its_window(researcher, monkeypatch):
    now = [1_000_000.0]
    monkeypatch.setattr(throttles.FailedAttempts, "timer", lambda self: now[0])
    with _rates(api_token="2/min"):
        for _ in range(2):
            _token_client("omni_wrong").get("/api/jobs/")
        assert _token_client("omni_wrong").get("/api/jobs/").status_code == 429
        now[0] += 61
        assert _token_client("omni_wrong").get("/api/jobs/").status_code == 401


def test_a_client_cannot_dodge_the_throttle_with_its_own_forwarded_for(researcher):
    with _rates(api_token="2/min"):
        for i in range(2):
            Client(HTTP_AUTHORIZATION="Token omni_wrong", HTTP_X_FORWARDED_FOR=f"10.9.9.{i}").get("/api/jobs/")
        response = Client(HTTP_AUTHORIZATION="Token omni_wrong", HTTP_X_FORWARDED_FOR="10.9.9.99").get("/api/jobs/")
        assert response.status_code == 429


@pytest.mark.parametrize("path", ["/login/", "/admin/login/"])
def test_failed_logins_are_throttled_before_the_password_is_checked(operator, path, monkeypatch):
    with _rates(login="3/min"):
        for _ in range(3):
            response = Client().post(path, {"username": "olive", "password": "wrong"})
            assert response.status_code == 200  # the form again, with its error
        checked = []
        monkeypatch.setattr("django.contrib.auth.forms.authenticate", lambda *a, **k: checked.append(k))
        refused = Client().post(path, {"username": "olive", "password": "olive-pass-1234"})
        assert refused.status_code == 429 and 1 <= int(refused["Retry-After"]) <= 60
        assert checked == []
        assert Client().get(path).status_code == 200  # the page itself still shows


def test_a_good_login_is_not_counted(operator):
    with _rates(login="2/min"):
        for _ in range(5):
            client = Client()
            assert client.post("/login/", {"username": "olive", "password": "olive-pass-1234"}).status_code == 302


def test_failed_agent_tokens_are_throttled_on_the_telemetry_endpoints(agent_node):
    wrong = {"HTTP_AUTHORIZATION": "Bearer not-the-token", "HTTP_X_OMNI_NODE": agent_node.name}
    good = {"HTTP_AUTHORIZATION": f"Bearer {agent_node.token}", "HTTP_X_OMNI_NODE": agent_node.name}
    body = json.dumps({"source": "s", "seq": 0, "samples": []})
    with _rates(agent_token="2/min"):
        for _ in range(2):
            assert Client().post("/api/telemetry/gpu", body, content_type="application/json", **wrong).status_code == 403
        refused = Client().post("/api/telemetry/gpu", body, content_type="application/json", **good)
        assert refused.status_code == 429 and int(refused["Retry-After"]) >= 1


def test_an_unreachable_throttle_cache_lets_good_tokens_in(researcher):
    _, token = issue_api_token(None, researcher)
    dead = {**settings.CACHES, "throttle": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                                            "LOCATION": "redis://127.0.0.1:1/0"}}
    with override_settings(CACHES=dead):
        assert _token_client(token).get("/api/jobs/").status_code == 200
        assert _token_client("omni_wrong").get("/api/jobs/").status_code == 401


@pytest.mark.redis
def test_failures_are_counted_in_redis_in_production(researcher):
    prefix = f"omni-test-{os.getpid()}"
    caches = {**settings.CACHES, "throttle": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                                              "LOCATION": os.environ["OMNI_TEST_REDIS_URL"], "KEY_PREFIX": prefix}}
    with override_settings(CACHES=caches), _rates(api_token="2/min"):
        try:
            for _ in range(2):
                _token_client("omni_wrong").get("/api/jobs/")
            assert _token_client("omni_wrong").get("/api/jobs/").status_code == 429
        finally:
            throttles.forget_failures()


# -- (8) hostile bodies and ids ------------------------------------------------------------------


@pytest.mark.parametrize(("body", "why"), [
    ("[" * 50_000 + "]" * 50_000, "nested deeper"),
    ('{"\\ud800": 1, "name": "x", "dp": 1}', "surrogate"),
    (json.dumps({**SPEC, "name": "a\ud800b"}), "surrogate"),
    (json.dumps(SPEC).replace('"step_s": 1.0', '"step_s": 1.0, "checkpoint_save_s": 1e999'), ""),
    (json.dumps({**SPEC, "dp": 2**64}), ""),
])
def test_hostile_json_is_a_400_and_writes_nothing(researcher, make_nodes, body, why):
    make_nodes()
    response = api_client(researcher).post("/api/jobs/", body, content_type="application/json")
    assert response.status_code == 400, response.content[:300]
    assert why in json.dumps(response.json())
    assert not Job.objects.exists() and not ElasticEvent.objects.exists()


def test_the_strict_parser_is_every_api_views_json_parser():
    assert settings.REST_FRAMEWORK["DEFAULT_PARSER_CLASSES"][0] == "omniweb.parsers.StrictJSONParser"
    from omniweb.parsers import StrictJSONParser
    from telemetry.api.views import GpuBatchView

    assert GpuBatchView.parser_classes == [StrictJSONParser]


@pytest.mark.parametrize("big", [2**63 - 1, 2**63, 2**64, 10**30])
def test_ids_past_64_bits_in_urls_are_404(researcher, operator, big):
    read, write = api_client(researcher), api_client(operator)
    for path in ["jobs", "nodes", "reservations", "teams", "events"]:
        assert read.get(f"/api/{path}/{big}/").status_code in (403, 404)
    assert read.get(f"/api/jobs/{big}/logs/").status_code == 404
    assert read.post(f"/api/jobs/{big}/cancel/", {}, format="json").status_code == 404
    assert write.post(f"/api/nodes/{big}/cordon/", {}, format="json").status_code == 404
    assert write.post(f"/api/reservations/{big}/cancel/", {}, format="json").status_code == 404
    assert write.patch(f"/api/teams/{big}/", {"weight": 2}, format="json").status_code == 404


# -- (10) the schema says what the API does ------------------------------------------------------


def _openapi_to_jsonschema(node: Any) -> Any:
    """OpenAPI 3.0's ``nullable`` as JSON Schema's null type, recursively."""
    if isinstance(node, list):
        return [_openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _openapi_to_jsonschema(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable"):
        return {"anyOf": [out, {"type": "null"}]}
    return out


def _response_validator(schema: dict, path: str, method: str = "get", code: str = "200") -> Draft202012Validator:
    components = _openapi_to_jsonschema(schema["components"])
    root = Resource.from_contents({"components": components, "$schema": "https://json-schema.org/draft/2020-12/schema"})
    registry = Registry().with_resource("urn:omni", root)
    body = schema["paths"][path][method]["responses"][code]["content"]["application/json"]["schema"]
    body = json.loads(json.dumps(_openapi_to_jsonschema(body)).replace('"#/components', '"urn:omni#/components'))
    return Draft202012Validator(body, registry=registry)


def test_job_reads_match_the_schema_loans_and_teamless_jobs_included(researcher, operator, make_job, make_nodes):
    nodes = make_nodes(racks=1, switches=1, nodes=2, gpus=4)
    critical = make_job(owner=operator, name="crit", priority="critical", dp=2, dp_min=2, dp_max=2, team=None)
    reservation = actions.create_reservation(
        operator, name="window", job=critical, gpus=2, start_at=timezone.now() - timedelta(minutes=5),
        period_s=3600, active_s=1800)
    mine = make_job(name="mine", dp=2, team=None)
    actions.place_job(mine, [(nodes[0], 0), (nodes[0], 1)], actor="planner", borrowed_from=None,
                      reason={"rule": "place", "text": "Placed.", "inputs": {}})
    lent = make_job(name="lent", dp=2, team=None)
    actions.place_job(lent, [(nodes[1], 0), (nodes[1], 1)], actor="planner", borrowed_from=reservation,
                      loan_until=timezone.now() + timedelta(minutes=20),
                      reason={"rule": "lend", "text": "Lent.", "inputs": {}})
    schema = SchemaGenerator().get_schema(request=None, public=True)
    client = api_client(researcher)
    listing = client.get("/api/jobs/").json()
    borrowed = [a["borrowed_from"] for job in listing["results"] for a in job.get("allocations", [])]
    assert None in borrowed and "window" in borrowed
    errors = list(_response_validator(schema, "/api/jobs/").iter_errors(listing))
    assert errors == [], [e.message for e in errors[:5]]
    detail = client.get(f"/api/jobs/{mine.pk}/").json()
    errors = list(_response_validator(schema, "/api/jobs/{id}/").iter_errors(detail))
    assert errors == [], [e.message for e in errors[:5]]


def test_borrowed_from_and_team_are_nullable_in_the_schema():
    components = SchemaGenerator().get_schema(request=None, public=True)["components"]["schemas"]
    assert components["Allocation"]["properties"]["borrowed_from"]["nullable"] is True
    assert components["Job"]["properties"]["team"]["nullable"] is True


def test_the_agent_scheme_and_telemetry_bodies_are_described():
    schema = SchemaGenerator().get_schema(request=None, public=True)
    schemes = schema["components"]["securitySchemes"]
    assert schemes["agentToken"] == {"type": "http", "scheme": "bearer", "description": schemes["agentToken"]["description"]}
    assert schemes["agentNode"]["in"] == "header" and schemes["agentNode"]["name"] == "X-Omni-Node"
    components = schema["components"]["schemas"]
    for path, batch, sample in [("/api/telemetry/gpu", "GpuBatch", "GpuSample"),
                                ("/api/telemetry/steps", "StepBatch", "StepRecord")]:
        post = schema["paths"][path]["post"]
        assert post["security"] == [{"agentToken": [], "agentNode": []}]
        body = post["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{batch}"}
        assert components[batch]["required"] == ["samples", "seq", "source"] or \
            set(components[batch]["required"]) == {"source", "seq", "samples"}
        assert components[batch]["properties"]["samples"]["items"] == {"$ref": f"#/components/schemas/{sample}"}
        assert post["responses"]["200"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/IngestResult"}


def test_the_telemetry_schema_names_the_fields_ingestion_takes():
    assert set(GpuSampleSerializer().fields) == GPU_FIELDS
    assert set(StepRecordSerializer().fields) == STEP_FIELDS


def test_check_deploy_has_no_schema_warnings():
    messages = [m for m in run_checks(include_deployment_checks=True) if m.id.startswith("drf_spectacular")]
    assert messages == [], [m.msg for m in messages]


@pytest.mark.parametrize(("who", "method", "path"), [
    ("researcher", "put", "/api/nodes/{node}/"),
    ("researcher", "delete", "/api/nodes/{node}/"),
    ("researcher", "delete", "/api/reservations/"),
    ("researcher", "put", "/api/teams/{team}/"),
    ("outsider", "put", "/api/jobs/{job}/"),
    ("outsider", "delete", "/api/events/"),
    ("auditor", "patch", "/api/events/"),
    ("operator", "put", "/api/jobs/"),
])
def test_a_method_no_one_may_use_is_a_405_not_a_403(request, researcher, make_job, make_nodes, who, method, path):
    node = make_nodes()[0]
    job = make_job()
    team = actions.create_team(request.getfixturevalue("operator"), name="vision")
    client = api_client(request.getfixturevalue(who))
    response = getattr(client, method)(path.format(node=node.pk, job=job.pk, team=team.pk), {}, format="json")
    assert response.status_code == 405, response.content[:200]
    assert response.json()["detail"] == f'Method "{method.upper()}" not allowed.'


def test_an_allowed_method_still_checks_the_role(researcher, make_nodes):
    node = make_nodes()[0]
    response = api_client(researcher).post(f"/api/nodes/{node.pk}/cordon/", {}, format="json")
    assert response.status_code == 403
    assert Node.objects.get(pk=node.pk).state == node.state


# -- found by the fuzzer (tests/fuzz): answers the schema did not describe -------------------------


def _schema_errors(schema: dict, path: str, method: str, response) -> list[str]:
    validator = _response_validator(schema, path, method, str(response.status_code))
    return [e.message for e in validator.iter_errors(response.json())]


def test_every_operation_documents_the_errors_it_answers():
    """A refusal (400, 401, 403, 429; 404 for a row; 409 for a state change) was an undocumented
    status code to any client that read the schema: only the success was listed."""
    schema = SchemaGenerator().get_schema(request=None, public=True)
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            codes = set(operation["responses"])
            expected = {"400", "401", "403", "429"} | ({"404"} if "{" in path else set())
            if method != "get" and not path.startswith("/api/telemetry/"):
                expected.add("409")
            assert expected <= codes, f"{method.upper()} {path} does not document {sorted(expected - codes)}"


def test_refusals_match_the_documented_error_bodies(researcher, operator, outsider, make_job):
    schema = SchemaGenerator().get_schema(request=None, public=True)
    job = make_job()
    refused = api_client(outsider).get("/api/jobs/")
    assert refused.status_code == 403 and _schema_errors(schema, "/api/jobs/", "get", refused) == []
    missing = api_client(researcher).get("/api/jobs/987654321/")
    assert missing.status_code == 404 and _schema_errors(schema, "/api/jobs/{id}/", "get", missing) == []
    actions.cancel_job(job, researcher)
    conflict = api_client(researcher).post(f"/api/jobs/{job.pk}/cancel/", {}, format="json")
    assert conflict.status_code == 409 and _schema_errors(schema, "/api/jobs/{id}/cancel/", "post", conflict) == []
    unknown = api_client(operator).post("/api/nodes/", {"nmae": "x"}, format="json")
    assert unknown.status_code == 400 and _schema_errors(schema, "/api/nodes/", "post", unknown) == []


def test_team_member_answers_are_the_lists_the_schema_describes(researcher, operator, auditor):
    """The members endpoints answer a list of members; the schema said a team write body (an
    object), and a 200 where adding a member is a 201."""
    schema = SchemaGenerator().get_schema(request=None, public=True)
    team = actions.create_team(operator, name="vision")
    added = api_client(operator).post(f"/api/teams/{team.pk}/members/", {"user": researcher.username}, format="json")
    assert added.status_code == 201, added.content[:200]
    assert _schema_errors(schema, "/api/teams/{id}/members/", "post", added) == []
    listing = api_client(auditor).get(f"/api/teams/{team.pk}/members/")
    assert [m["user"] for m in listing.json()] == [researcher.username]
    assert _schema_errors(schema, "/api/teams/{id}/members/", "get", listing) == []
    default = api_client(operator).post(f"/api/teams/{team.pk}/members/{researcher.username}/default/", {},
                                        format="json")
    assert default.status_code == 200
    assert _schema_errors(schema, "/api/teams/{id}/members/{username}/default/", "post", default) == []


@pytest.mark.parametrize("path", ["/api/telemetry/gpu", "/api/telemetry/steps"])
def test_a_telemetry_body_that_is_not_json_is_the_documented_400(agent_node, path):
    """Bytes that are not UTF-8 are the parser's ``{"detail": "..."}``; the schema allowed only
    lists of messages by field."""
    schema = SchemaGenerator().get_schema(request=None, public=True)
    response = Client().post(path, b"\xf5\x95HU", content_type="application/json",
                             HTTP_AUTHORIZATION=f"Bearer {agent_node.token}", HTTP_X_OMNI_NODE=agent_node.name)
    assert response.status_code == 400
    assert response.json()["detail"].startswith("JSON parse error")
    assert _schema_errors(schema, path, "post", response) == []


@pytest.mark.parametrize(("method", "path", "body", "where"), [
    ("get", "/api/jobs/?q=%5B%00", None, "q"),
    ("get", "/api/jobs/?owner=rita%00", None, "owner"),
    ("get", "/api/events/?actor=%00", None, "actor"),
    ("delete", "/api/teams/{team}/members/rita%00/", None, "username"),
])
def test_a_nul_character_anywhere_is_a_400_not_a_database_500(researcher, operator, method, path, body, where):
    """PostgreSQL text cannot hold NUL: a filter or a looked-up name with one was a 500."""
    team = actions.create_team(operator, name="ml")
    client = api_client(operator)
    response = getattr(client, method)(path.format(team=team.pk), body, format="json")
    assert response.status_code == 400, response.content[:200]
    assert response.json() == {where: ["NUL characters are not allowed."]}
    assert Job.objects.count() == 0


@pytest.mark.parametrize(("path", "body", "where"), [
    ("/api/teams/", {"name": "vision", "parent": "ml\x00"}, "parent"),
    ("/api/jobs/", {**SPEC, "team": "ml\x00"}, "team"),
])
def test_a_nul_character_in_a_form_body_is_a_400(operator, path, body, where):
    """JSON bodies never get this far (the strict parser refuses NUL); form bodies did, to a lookup."""
    actions.create_team(operator, name="ml")
    response = api_client(operator).post(path, body)
    assert response.status_code == 400, response.content[:200]
    assert response.json() == {where: ["NUL characters are not allowed."]}
    assert Job.objects.count() == 0

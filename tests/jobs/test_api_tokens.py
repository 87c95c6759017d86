"""API tokens: ``Authorization: Token <token>`` authenticates as the token's user, without CSRF;
an unknown, revoked or disabled account's token is a 401 that says so; tokens are stored hashed
and never logged."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from jobs.actions.accounts import issue_api_token
from jobs.api import auth
from jobs.models import ApiToken, ElasticEvent, Job, hash_api_token

pytestmark = pytest.mark.django_db

SPEC = dict(name="by-token", priority="regular", dp=2, global_batch=64, micro_batch=4, total_steps=100, step_s=1.0)


def _client(token: str) -> Client:
    # Django's own client, as a script would call: no session, and CSRF checks on.
    return Client(enforce_csrf_checks=True, HTTP_AUTHORIZATION=f"Token {token}")


def test_a_token_authenticates_as_its_user_and_needs_no_csrf(researcher):
    _, token = issue_api_token(None, researcher)
    client = _client(token)
    assert client.get("/api/jobs/").status_code == 200
    response = client.post("/api/jobs/", SPEC, content_type="application/json")
    assert response.status_code == 201, response.content
    assert Job.objects.get().owner == researcher
    assert ElasticEvent.objects.get(kind="submit").actor == "rita"


def test_a_session_write_still_needs_csrf_beside_token_auth(researcher):
    client = Client(enforce_csrf_checks=True)
    client.force_login(researcher)
    response = client.post("/api/jobs/", SPEC, content_type="application/json")
    assert response.status_code == 403 and "CSRF" in response.json()["detail"]


def test_the_token_carries_its_users_role(auditor):
    _, token = issue_api_token(None, auditor)
    response = _client(token).post("/api/jobs/", SPEC, content_type="application/json")
    assert response.status_code == 403
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("Token omni_not-a-real-token", auth.UNKNOWN),
        ("Token", auth.MALFORMED),
        ("Token two words", auth.MALFORMED),
        ("token omni_not-a-real-token", auth.UNKNOWN),  # the scheme is case-insensitive
    ],
)
def test_a_bad_token_is_401_with_a_clear_message(researcher, header, message):
    response = Client(HTTP_AUTHORIZATION=header).get("/api/jobs/")
    assert response.status_code == 401
    assert response.json() == {"detail": message}
    assert response["WWW-Authenticate"] == "Token"


def test_a_revoked_token_is_401(researcher):
    row, token = issue_api_token(None, researcher)
    assert _client(token).get("/api/jobs/").status_code == 200
    row.revoked_at = timezone.now()
    row.save(update_fields=["revoked_at"])
    response = _client(token).get("/api/jobs/")
    assert response.status_code == 401 and response.json() == {"detail": auth.REVOKED}


def test_a_disabled_accounts_token_is_401(researcher):
    _, token = issue_api_token(None, researcher)
    researcher.is_active = False
    researcher.save(update_fields=["is_active"])
    response = _client(token).get("/api/jobs/")
    assert response.status_code == 401 and response.json() == {"detail": auth.DISABLED}


def test_a_token_is_stored_only_as_its_digest(researcher):
    row, token = issue_api_token(None, researcher, label="laptop")
    row.refresh_from_db()
    assert row.digest == hash_api_token(token) and row.digest != token
    stored = [str(value) for value in ApiToken.objects.values_list(flat=False).get()]
    assert token not in stored
    assert token.startswith("omni_") and row.prefix == token[5:11]


def test_issuing_is_audited_without_the_token(researcher):
    row, token = issue_api_token(None, researcher, label="ci")
    event = ElasticEvent.objects.get()
    assert (event.kind, event.actor) == ("token_issued", "system")
    assert event.reason["inputs"] == {"user": "rita", "token": f"{row.prefix}…", "label": "ci"}
    assert token not in str(event.reason) and token[5:] not in str(event.reason)


def test_only_operators_issue_tokens_for_others(researcher, operator, other_researcher):
    from django.core.exceptions import PermissionDenied

    with pytest.raises(PermissionDenied):
        issue_api_token(researcher, other_researcher)
    issue_api_token(operator, other_researcher)
    assert ElasticEvent.objects.get().actor == "olive"


def test_last_used_is_written_at_most_once_a_minute(researcher):
    row, token = issue_api_token(None, researcher)
    client = _client(token)
    client.get("/api/nodes/")
    row.refresh_from_db()
    first = row.last_used_at
    assert first is not None
    client.get("/api/nodes/")
    row.refresh_from_db()
    assert row.last_used_at == first  # within the minute: not written again
    ApiToken.objects.filter(pk=row.pk).update(last_used_at=first - timedelta(minutes=2))
    client.get("/api/nodes/")
    row.refresh_from_db()
    assert row.last_used_at > first


def test_a_refused_token_is_never_logged(researcher, caplog):
    row, token = issue_api_token(None, researcher)
    row.revoked_at = timezone.now()
    row.save(update_fields=["revoked_at"])
    with caplog.at_level(logging.DEBUG):
        _client(token).get("/api/jobs/")
        _client("omni_guessed-token-value").get("/api/jobs/")
    assert "API request refused" in caplog.text
    assert token not in caplog.text and token[11:] not in caplog.text
    assert "guessed-token-value" not in caplog.text


def test_delete_api_token_revokes_the_token_it_is_sent_with_and_audits_it(researcher, outsider):
    from jobs.actions.accounts import revoke_api_token

    row, token = issue_api_token(None, researcher, label="laptop")
    _, kept = issue_api_token(None, researcher)
    client = _client(token)
    assert client.delete("/api/token/", {"all": True}, content_type="application/json").status_code == 400
    response = client.delete("/api/token/")
    assert response.status_code == 204, response.content
    row.refresh_from_db()
    assert row.revoked_at is not None
    assert client.get("/api/jobs/").json()["detail"] == auth.REVOKED
    assert _client(kept).get("/api/jobs/").status_code == 200  # only the token sent is revoked
    event = ElasticEvent.objects.get(kind="token_revoked")
    assert (event.actor, event.reason["text"]) == ("rita", f"rita revoked API token {row.prefix}… of rita (laptop).")
    # A user with no role may revoke their own token; the session names none to revoke.
    _, theirs = issue_api_token(None, outsider)
    assert _client(theirs).delete("/api/token/").status_code == 204
    session = Client()
    session.force_login(researcher)
    refused = session.delete("/api/token/")
    assert refused.status_code == 400 and "carries no API token" in refused.json()["non_field_errors"][0]
    # The action itself: only an operator revokes someone else's token.
    from django.core.exceptions import PermissionDenied

    other, _ = issue_api_token(None, outsider)
    with pytest.raises(PermissionDenied):
        revoke_api_token(researcher, other)
    assert ApiToken.objects.get(pk=other.pk).revoked_at is None

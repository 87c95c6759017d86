"""The real ASGI server (``manage.py serve``) in front of the API: what it answers before Django
sees a request."""

from __future__ import annotations

import pytest
import requests

from tests.live.server import database_url, serve

BOUNDARY = "c637e12e2b1a998d80d1b087531af51c"


@pytest.fixture
def asgi_server(django_db_setup, django_db_blocker):
    with serve({"DATABASE_URL": database_url(django_db_blocker), "SECRET_KEY": "omni-asgi-tests-not-secret"},
               "asgi-server.log") as url:
        yield url


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("body", [f"--{BOUNDARY}--\r\n", "", "not multipart at all"])
def test_a_multipart_body_twisted_cannot_parse_reaches_django(asgi_server, operator, body):
    """Twisted parsed POST form bodies itself and answered an empty multipart one with a bare
    400 (no content type, no body; schemathesis seed 2299020275). Django parses them now: the
    API's own 400, field by field."""
    from jobs import actions

    _row, token = actions.issue_api_token(operator, operator)
    response = requests.post(
        f"{asgi_server}/api/teams/", data=body.encode(), timeout=30,
        headers={"Authorization": f"Token {token}", "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"},
    )
    assert response.status_code == 400, response.text
    assert response.headers["Content-Type"] == "application/json"
    assert "name" in response.json()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_long_query_string_gets_an_answer_not_a_reset(asgi_server, operator):
    """A 26 KiB query string passed Twisted's 16 KiB head limit: it wrote a bare 400 and closed
    while the client was still sending, so the client saw a reset and no answer (schemathesis seed
    2467894874). It reaches Django now, which answers in words."""
    from jobs import actions

    _row, token = actions.issue_api_token(operator, operator)
    query = "&".join(f"rank={i}" for i in range(3000))  # about 30 KiB, 3,000 fields
    response = requests.get(f"{asgi_server}/api/jobs/987654321/logs/?{query}", timeout=30,
                            headers={"Authorization": f"Token {token}"})
    assert response.status_code in (400, 404), response.text
    assert response.headers["Content-Type"] == "application/json"

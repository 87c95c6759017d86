"""API tokens on the REST API: ``Authorization: Token <token>`` authenticates as the token's user.

Tokens come from ``manage.py issue_api_token`` (docs/operators.md) and only their SHA-256 digest
is stored (``jobs.models.tokens``): the digest of the token presented finds its row. A revoked
token, an unknown one or a disabled account is a 401 that says which; the token itself is
never logged. Token requests need no CSRF token (a browser never sends this header on its own,
DRF's TokenAuthentication convention); session requests keep CSRF. ``last_used_at`` is written
at most once a minute, so a busy script does not turn every read into a write. Failed tokens are
counted per client address (``jobs.api.throttles``): past the ``api_token`` rate a token request
is a 429 with ``Retry-After`` before its token is looked up.
"""

from __future__ import annotations

import hmac
import logging
from datetime import timedelta
from typing import NoReturn

from django.db.models import Q
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.plumbing import build_bearer_security_scheme_object
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed, Throttled
from rest_framework.request import Request

from jobs.api.throttles import API_TOKEN, FailedAttempts
from jobs.models import ApiToken, hash_api_token

logger = logging.getLogger("jobs.api")

KEYWORD = "Token"
LAST_USED_EVERY = timedelta(minutes=1)
MALFORMED = "malformed Authorization header: send 'Authorization: Token <token>'"
UNKNOWN = "invalid API token"
REVOKED = "this API token has been revoked"
DISABLED = "the API token's account is disabled"
THROTTLED = "too many failed API tokens from your address"


class ApiTokenAuthentication(BaseAuthentication):
    """The user of an ``Authorization: Token ...`` header; any other header is left to the next
    authentication class (the session's)."""

    def authenticate(self, request: Request):
        words = get_authorization_header(request).split()
        if not words or words[0].lower() != KEYWORD.lower().encode():
            return None
        failures = FailedAttempts(API_TOKEN)
        if (wait := failures.retry_after_s(request)) is not None:
            raise Throttled(wait, detail=f"{THROTTLED}: try again in {wait} s")
        if len(words) != 2:
            self._refuse(request, MALFORMED, None, failures)
        try:
            token = words[1].decode()
        except UnicodeDecodeError:
            self._refuse(request, MALFORMED, None, failures)
        digest = hash_api_token(token)
        row = ApiToken.objects.select_related("user").filter(digest=digest).first()
        if row is None or not hmac.compare_digest(row.digest, digest):
            self._refuse(request, UNKNOWN, None, failures)
        if row.revoked_at is not None:
            self._refuse(request, REVOKED, row, failures)
        if not row.user.is_active:
            self._refuse(request, DISABLED, row, failures)
        self._note_use(row)
        return row.user, row

    def authenticate_header(self, request: Request) -> str:
        # Makes an unauthenticated API request a 401 that names the scheme, not a bare 403.
        return KEYWORD

    def _refuse(self, request: Request, why: str, row: ApiToken | None, failures: FailedAttempts) -> NoReturn:
        failures.record(request)
        who = f"token {row.prefix}… of {row.user.get_username()}" if row is not None else "unknown token"
        logger.warning("API request refused: %s (%s, peer %s)", why, who, request.META.get("REMOTE_ADDR", "-"))
        raise AuthenticationFailed(why)

    def _note_use(self, row: ApiToken) -> None:
        now = timezone.now()
        if row.last_used_at is not None and now - row.last_used_at < LAST_USED_EVERY:
            return
        # Conditional, so concurrent requests write it once.
        stale = Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - LAST_USED_EVERY)
        ApiToken.objects.filter(stale, pk=row.pk).update(last_used_at=now)


class ApiTokenScheme(OpenApiAuthenticationExtension):
    """How the OpenAPI schema names this scheme (drf-spectacular finds it by ``target_class``)."""

    target_class = ApiTokenAuthentication
    name = "apiToken"

    def get_security_definition(self, auto_schema):
        return build_bearer_security_scheme_object(header_name="Authorization", token_prefix=KEYWORD)

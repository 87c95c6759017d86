"""Failed sign-ins and failed tokens, counted per client address: past the rate, that address is
answered 429 with ``Retry-After`` before any password is hashed or token looked up.

Only failures count (a script polling with a good token is never slowed), in the ``throttle``
cache (omniweb/settings.py: Redis in production, so every server process counts together; memory
in embedded mode). The rates are ``REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]``: ``login`` for the
sign-in pages (``/login/``, ``/admin/login/``), ``api_token`` for ``Authorization: Token`` on
the API, ``agent_token`` for node agents' bearer tokens on the telemetry endpoints. The client
address is DRF's (``NUM_PROXIES``: the proxy's ``X-Forwarded-For`` only behind a configured one).
docs/api.md says what a client sees.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import wraps

from django.core.cache import caches
from django.http import HttpRequest, HttpResponse
from rest_framework.settings import api_settings
from rest_framework.throttling import SimpleRateThrottle

CACHE_ALIAS = "throttle"
LOGIN = "login"
API_TOKEN = "api_token"
AGENT_TOKEN = "agent_token"
SCOPES = (LOGIN, API_TOKEN, AGENT_TOKEN)

logger = logging.getLogger("jobs.api")


class FailedAttempts(SimpleRateThrottle):
    """DRF's sliding-window history of one scope, recording failures only: ``retry_after_s`` before
    checking credentials, ``record`` after they fail."""

    def __init__(self, scope: str):
        self.scope = scope
        super().__init__()

    @property
    def cache(self):  # looked up each time, so a test's override_settings(CACHES=...) applies
        return caches[CACHE_ALIAS]

    def get_rate(self) -> str:
        # Read at call time (DRF's class attribute is bound at import), so settings overrides apply.
        return api_settings.DEFAULT_THROTTLE_RATES[self.scope]

    def key_for(self, ident: str | None) -> str:
        return self.cache_format % {"scope": self.scope, "ident": ident}

    def get_cache_key(self, request, view=None) -> str:
        return self.key_for(self.get_ident(request))

    def _window(self, request) -> list[float]:
        self.key = self.get_cache_key(request)
        self.now = self.timer()
        try:
            history = self.cache.get(self.key, [])
        except Exception:  # Redis away: let people in rather than lock everyone out
            logger.warning("throttle cache unreachable; %s failures not counted", self.scope, exc_info=True)
            return []
        return [at for at in history if at > self.now - self.duration]

    def retry_after_s(self, request) -> int | None:
        """Seconds until this address may try again, or None when it may now."""
        history = self._window(request)  # newest first
        if len(history) < self.num_requests:
            return None
        # Allowed again once fewer than num_requests failures lie in the window.
        return max(1, math.ceil(history[self.num_requests - 1] + self.duration - self.now))

    def record(self, request) -> None:
        history = self._window(request)
        try:
            self.cache.set(self.key, [self.now, *history][: self.num_requests + 1], self.duration)
        except Exception:
            logger.warning("throttle cache unreachable; a %s failure not counted", self.scope, exc_info=True)


def forget_failures(ident: str = "127.0.0.1") -> None:
    """Forget the failures counted against one address in every scope (an operator unlocking it
    from ``manage.py shell``; the tests, whose requests all come from 127.0.0.1)."""
    caches[CACHE_ALIAS].delete_many([FailedAttempts(scope).key_for(ident) for scope in SCOPES])


def too_many_sign_ins(retry_after_s: int) -> HttpResponse:
    response = HttpResponse(
        f"Too many failed sign-ins from your address: try again in {retry_after_s} s.\n",
        status=429, content_type="text/plain; charset=utf-8",
    )
    response["Retry-After"] = str(retry_after_s)
    return response


def throttle_failed_logins(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """A sign-in view (Django's LoginView, the admin's) whose failed POSTs count against the client
    address: past the ``login`` rate a POST is a 429 without checking the password. LoginView
    answers bad credentials by showing the form again (200) and a sign-in by a redirect."""

    @wraps(view)
    def guarded(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if request.method != "POST":
            return view(request, *args, **kwargs)
        failures = FailedAttempts(LOGIN)
        if (wait := failures.retry_after_s(request)) is not None:
            return too_many_sign_ins(wait)
        response = view(request, *args, **kwargs)
        if response.status_code == 200:
            failures.record(request)
        return response

    return guarded

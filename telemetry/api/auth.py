"""Per-node agent authentication for the ingestion endpoints.

An agent sends ``Authorization: Bearer <agent token>`` and ``X-Omni-Node: <node name>``; both are
checked by ``jobs.agent_auth.agent_from_headers``, the same function the agent socket and its
HTTP fallback use (tokens come from ``manage.py issue_agent_token``). Here the node header is
required. No credentials: 401. Wrong token or unknown node: 403, with one message for both so
node names cannot be probed. Wrong tokens are counted per client address
(``jobs.api.throttles``): past the ``agent_token`` rate the address is answered 429 with
``Retry-After`` before its token is checked.
"""

from __future__ import annotations

from django.contrib.auth.models import AnonymousUser
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import AuthenticationFailed, PermissionDenied, Throttled
from rest_framework.permissions import BasePermission

from jobs.agent_auth import AgentAuthFailure, agent_from_headers, request_headers
from jobs.api.throttles import AGENT_TOKEN, FailedAttempts
from jobs.models import Node


class NodeTokenAuthentication(BaseAuthentication):
    """Authenticates a node agent; ``request.auth`` is the Node, ``request.user`` anonymous."""

    def authenticate(self, request) -> tuple[AnonymousUser, Node]:
        failures = FailedAttempts(AGENT_TOKEN)
        if (wait := failures.retry_after_s(request)) is not None:
            raise Throttled(wait, detail=f"too many failed agent tokens from your address: try again in {wait} s")
        try:
            node = agent_from_headers(request_headers(request), request.META.get("REMOTE_ADDR", "?"),
                                      node_header_required=True)
        except AgentAuthFailure as exc:
            if exc.missing:
                raise AuthenticationFailed(str(exc)) from None
            failures.record(request)
            raise PermissionDenied(str(exc)) from None
        return AnonymousUser(), node

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="omni-agent"'


class IsNodeAgent(BasePermission):
    """Only an authenticated node agent may send telemetry."""

    message = "telemetry must be sent by a node agent with its token"

    def has_permission(self, request, view) -> bool:
        return isinstance(request.auth, Node)


class NodeTokenScheme(OpenApiAuthenticationExtension):
    """How the OpenAPI schema describes the agent scheme: both headers, required together
    (drf-spectacular finds it by ``target_class``)."""

    target_class = NodeTokenAuthentication
    name = ["agentToken", "agentNode"]

    def get_security_definition(self, auto_schema) -> list[dict]:
        return [
            {"type": "http", "scheme": "bearer",
             "description": "The node's agent token (manage.py issue_agent_token), docs/telemetry.md."},
            {"type": "apiKey", "in": "header", "name": "X-Omni-Node",
             "description": "The name of the node the token was issued for."},
        ]

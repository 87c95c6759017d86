"""Per-node agent authentication for the ingestion endpoints.

An agent sends ``Authorization: Bearer <agent token>`` and ``X-Omni-Node: <node name>``; both are
checked by ``jobs.agent_auth.agent_from_headers``, the same function the agent socket and its
HTTP fallback use (tokens come from ``manage.py issue_agent_token``). Here the node header is
required. No credentials: 401. Wrong token or unknown node: 403, with one message for both so
node names cannot be probed.
"""

from __future__ import annotations

from django.contrib.auth.models import AnonymousUser
from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import AuthenticationFailed, PermissionDenied
from rest_framework.permissions import BasePermission

from jobs.agent_auth import AgentAuthFailure, agent_from_headers, request_headers
from jobs.models import Node


class NodeTokenAuthentication(BaseAuthentication):
    """Authenticates a node agent; ``request.auth`` is the Node, ``request.user`` anonymous."""

    def authenticate(self, request) -> tuple[AnonymousUser, Node]:
        try:
            node = agent_from_headers(request_headers(request), request.META.get("REMOTE_ADDR", "?"),
                                      node_header_required=True)
        except AgentAuthFailure as exc:
            if exc.missing:
                raise AuthenticationFailed(str(exc)) from None
            raise PermissionDenied(str(exc)) from None
        return AnonymousUser(), node

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="omni-agent"'


class IsNodeAgent(BasePermission):
    """Only an authenticated node agent may send telemetry."""

    message = "telemetry must be sent by a node agent with its token"

    def has_permission(self, request, view) -> bool:
        return isinstance(request.auth, Node)

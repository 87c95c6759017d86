"""Per-node agent authentication for the ingestion endpoints.

An agent sends ``Authorization: Bearer <agent token>`` and ``X-Omni-Node: <node name>``; the
token is checked against the node's stored hash (``Node.token_matches``; tokens come from
``manage.py issue_agent_token``). No credentials: 401. Wrong token or unknown node: 403, with
one message for both so node names cannot be probed.
"""

from __future__ import annotations

from django.contrib.auth.models import AnonymousUser
from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import AuthenticationFailed, PermissionDenied
from rest_framework.permissions import BasePermission

from jobs.models import Node

NODE_HEADER = "HTTP_X_OMNI_NODE"


class NodeTokenAuthentication(BaseAuthentication):
    """Authenticates a node agent; ``request.auth`` is the Node, ``request.user`` anonymous."""

    def authenticate(self, request) -> tuple[AnonymousUser, Node] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            return None
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthenticationFailed("expected 'Authorization: Bearer <agent token>'")
        name = request.META.get(NODE_HEADER, "").strip()
        if not name:
            raise AuthenticationFailed("missing the X-Omni-Node header naming the sending node")
        node = Node.objects.filter(name=name).first()
        if node is None or not node.token_matches(token):
            raise PermissionDenied("agent token does not match this node")
        return AnonymousUser(), node

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="omni-agent"'


class IsNodeAgent(BasePermission):
    """Only an authenticated node agent may send telemetry."""

    message = "telemetry must be sent by a node agent with its token"

    def has_permission(self, request, view) -> bool:
        return isinstance(request.auth, Node)

"""How a node agent proves which node it is: one function for every surface that takes agent tokens.

The agent WebSocket (``jobs.consumers``), its HTTP fallback (``jobs.agent_api.heartbeat_view``)
and telemetry ingestion (``telemetry.api.auth``) all call :func:`agent_from_headers`, which
reads ``Authorization: Bearer TOKEN`` and the optional ``X-Omni-Node: NAME`` and asks
:func:`authenticate_agent`. Tokens come from ``manage.py issue_agent_token`` and only their
SHA-256 is stored: the digest of the token presented finds the node, and the stored digest is
then compared in constant time (``Node.token_matches``). A refusal says *missing* (close code
4401, HTTP 401) or *wrong* (4403, 403; an unknown token and another node's token read the same,
so node names cannot be probed), and is logged with the peer and the claimed node, never the
token. Protocol: docs/control-loop.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from jobs.models import Node
from jobs.models.cluster import hash_agent_token
from trainer_agent import protocol

logger = logging.getLogger("jobs.agent")

NODE_HEADER = "x-omni-node"
MISSING_TOKEN = "missing agent token: send 'Authorization: Bearer TOKEN'"
MISSING_NODE = "missing the X-Omni-Node header naming the sending node"
WRONG_TOKEN = "agent token does not match this node"


class AgentAuthFailure(Exception):
    """Why an agent was refused, as the WebSocket close code and HTTP status that say so."""

    def __init__(self, *, missing: bool, message: str) -> None:
        super().__init__(message)
        self.missing = missing

    @property
    def close_code(self) -> int:
        return protocol.CLOSE_MISSING_TOKEN if self.missing else protocol.CLOSE_BAD_TOKEN

    @property
    def http_status(self) -> int:
        return 401 if self.missing else 403


def bearer_token(headers: Mapping[str, str]) -> str:
    """The token from ``Authorization: Bearer ...`` (header names lower-case), or ``""``."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def asgi_headers(scope_headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """ASGI headers as a lower-case dict."""
    return {k.decode("latin1").lower(): v.decode("latin1") for k, v in scope_headers}


def request_headers(request) -> dict[str, str]:
    """A Django (or DRF) request's headers as a lower-case dict."""
    return {k.lower(): v for k, v in request.headers.items()}


def authenticate_agent(token: str) -> Node | None:
    """The node this agent token belongs to, or None (no token, unknown token, no token issued)."""
    if not token:
        return None
    node = Node.objects.filter(agent_token_hash=hash_agent_token(token)).first()
    return node if node is not None and node.token_matches(token) else None


def agent_from_headers(headers: Mapping[str, str], peer: str, *, node_header_required: bool = False) -> Node:
    """The node whose agent sent these (lower-case) headers; raises AgentAuthFailure, and logs why.

    ``X-Omni-Node``, when sent, must name the token's node. Telemetry ingestion requires it
    (``node_header_required``): its batches are attributed to the node they name.
    """
    token = bearer_token(headers)
    claimed = headers.get(NODE_HEADER, "").strip()
    if not token:
        logger.warning("agent refused: no token (peer %s, claimed node %r)", peer, claimed or "-")
        raise AgentAuthFailure(missing=True, message=MISSING_TOKEN)
    if node_header_required and not claimed:
        logger.warning("agent refused: no X-Omni-Node header (peer %s)", peer)
        raise AgentAuthFailure(missing=True, message=MISSING_NODE)
    node = authenticate_agent(token)
    if node is None:
        logger.warning("agent refused: unknown token (peer %s, claimed node %r)", peer, claimed or "-")
        raise AgentAuthFailure(missing=False, message=WRONG_TOKEN)
    if claimed and claimed != node.name:
        logger.warning("agent refused: token of %s presented as %r (peer %s)", node.name, claimed, peer)
        raise AgentAuthFailure(missing=False, message=WRONG_TOKEN)
    return node

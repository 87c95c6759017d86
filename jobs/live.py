"""Live updates to browsers: group names and the one way to broadcast, after commit.

Groups are ``job-{id}``, ``node-{id}``, ``cluster`` and ``audit`` (docs/live-ui.md). A message
is sent only once its transaction commits (``transaction.on_commit``), so a browser never sees a
change that was rolled back; the database row stays the truth, and a page that reconnects
reloads its state from it. Payloads are complete, so a browser never has to re-fetch.
"""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

logger = logging.getLogger(__name__)

CLUSTER_GROUP = "cluster"
AUDIT_GROUP = "audit"


def job_group(job_id: int) -> str:
    return f"job-{job_id}"


def node_group(node_id: int) -> str:
    return f"node-{node_id}"


def broadcast_now(group: str, event: str, payload: dict[str, Any]) -> None:
    """Send ``{"type": "live.message", "event": event, "payload": payload}`` to ``group``.

    Consumers implement ``live_message``. A failing channel layer is logged, never raised: the
    write that caused the message has already committed.
    """
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(group, {"type": "live.message", "event": event, "payload": payload})
    except Exception:
        logger.exception("live broadcast to %s failed", group)


def broadcast_on_commit(group: str, event: str, payload: dict[str, Any]) -> None:
    """Broadcast after the current transaction commits (at once when there is none)."""
    transaction.on_commit(lambda: broadcast_now(group, event, payload))

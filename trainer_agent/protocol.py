"""The agent protocol: JSON frames between a node agent and the control plane (docs/control-loop.md).

Pure Python, no Django: the node agent and the server's consumer both import it, so the two
sides cannot drift. Every frame is one JSON object with a ``type``; ``validate_agent_frame``
checks what an agent sends and returns a one-line reason for anything it refuses.
"""

from __future__ import annotations

import json
from typing import Any

PROTOCOL_VERSION = 1
AGENT_PATH = "/ws/agent/"
HTTP_HEARTBEAT_PATH = "/agent/heartbeat/"

# WebSocket close codes the server uses (4000-4999 are application codes).
CLOSE_MISSING_TOKEN = 4401
CLOSE_BAD_TOKEN = 4403
CLOSE_PROTOCOL_ERROR = 4400
CLOSE_REPLACED = 4409  # a newer connection for the same node took over

# Agent -> server.
HELLO = "hello"
HEARTBEAT = "heartbeat"
ACK = "ack"
DONE = "done"
STEPS = "steps"
EXIT = "exit"
LOGS = "logs"  # lines of the ranks' log files (trainer_agent.logship, docs/logs.md)
# Server -> agent.
WELCOME = "welcome"
COMMAND = "command"
ERROR = "error"
LOGS_ACK = "logs_ack"  # a ``logs`` frame stored (or refused): its ``ship`` id

COMMAND_KINDS = ("start", "preempt", "resize", "resume", "stop", "clean")
MAX_FRAME_BYTES = 1 << 20
MAX_RECORDS_PER_FRAME = 500
# Log frames (docs/logs.md). Sizes are bytes of the rank's file; a frame's JSON stays under
# MAX_FRAME_BYTES even when every byte is escaped (\u0000: 6 characters).
LOG_STREAMS = ("out", "err")
MAX_LOG_FRAME_BYTES = 128 * 1024
MAX_LOG_LINE_BYTES = 16 * 1024
MAX_LOG_LINES_PER_FRAME = 10_000


class ProtocolError(ValueError):
    """A frame the other side must refuse; ``code`` is machine-readable, the message one line."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _require(frame: dict[str, Any], key: str, kinds: type | tuple[type, ...]) -> Any:
    if key not in frame:
        raise ProtocolError("missing_field", f"{frame.get('type')} frame needs {key!r}")
    value = frame[key]
    if isinstance(value, bool) and kinds is not bool and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ProtocolError("bad_field", f"{key!r} must be {kinds}, got a boolean")
    if not isinstance(value, kinds):
        raise ProtocolError("bad_field", f"{key!r} has the wrong type ({type(value).__name__})")
    return value


def _optional_list(frame: dict[str, Any], key: str) -> list[Any]:
    value = frame.get(key, [])
    if not isinstance(value, list):
        raise ProtocolError("bad_field", f"{key!r} must be a list")
    return value


def parse_frame(text: str | bytes | None) -> dict[str, Any]:
    """Decode one text frame into a dict, or raise ProtocolError."""
    if text is None:
        raise ProtocolError("binary_frame", "frames are JSON text, not binary")
    if len(text) > MAX_FRAME_BYTES:
        raise ProtocolError("frame_too_large", f"frame of {len(text)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        frame = json.loads(text)
    except ValueError as exc:
        raise ProtocolError("bad_json", f"frame is not JSON: {exc}") from None
    if not isinstance(frame, dict):
        raise ProtocolError("bad_frame", "frame must be a JSON object")
    if not isinstance(frame.get("type"), str):
        raise ProtocolError("bad_frame", "frame needs a string 'type'")
    return frame


def validate_agent_frame(frame: dict[str, Any]) -> dict[str, Any]:
    """Check an agent -> server frame's shape; return it unchanged or raise ProtocolError."""
    kind = frame["type"]
    if kind == HELLO:
        version = _require(frame, "protocol", int)
        if version != PROTOCOL_VERSION:
            raise ProtocolError("bad_version", f"protocol {version} is not supported (server speaks {PROTOCOL_VERSION})")
        inventory = _require(frame, "inventory", dict)
        if not isinstance(inventory.get("gpus", []), list):
            raise ProtocolError("bad_field", "inventory.gpus must be a list")
        _optional_list(frame, "workers")
    elif kind == HEARTBEAT:
        _optional_list(frame, "gpus")
        _optional_list(frame, "workers")
    elif kind == ACK:
        _require(frame, "command", str)
    elif kind == DONE:
        _require(frame, "command", str)
        _require(frame, "ok", bool)
        outcome = frame.get("outcome", {})
        if not isinstance(outcome, dict):
            raise ProtocolError("bad_field", "'outcome' must be an object")
    elif kind == STEPS:
        _require(frame, "job", str)
        records = _require(frame, "records", list)
        if len(records) > MAX_RECORDS_PER_FRAME:
            raise ProtocolError("too_many_records", f"{len(records)} records exceed {MAX_RECORDS_PER_FRAME} per frame")
        if not all(isinstance(r, dict) and isinstance(r.get("step"), int) for r in records):
            raise ProtocolError("bad_record", "every step record must be an object with an integer 'step'")
    elif kind == EXIT:
        _require(frame, "job", str)
        _require(frame, "outcome", dict)
    else:
        raise ProtocolError("unknown_type", f"unknown frame type {kind!r}")
    return frame


def dumps(frame: dict[str, Any]) -> str:
    """Encode a frame compactly."""
    return json.dumps(frame, separators=(",", ":"), default=str)

"""The agent protocol: JSON frames between a node agent and the control plane (docs/control-loop.md).

Pure Python, no Django: the node agent and the server's consumer both import it, so the two
sides cannot drift. Every frame is one JSON object with a ``type``; ``validate_agent_frame``
checks what an agent sends and returns a one-line reason for anything it refuses.
"""

from __future__ import annotations

import json
import math
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
STEPS_ACK = "steps_ack"  # a ``steps`` frame handled (stored, or refused as stale): its ``seq``

COMMAND_KINDS = ("start", "preempt", "resize", "resume", "stop", "clean")
MAX_FRAME_BYTES = 1 << 20
MAX_RECORDS_PER_FRAME = 500
# Log frames (docs/logs.md). Sizes are bytes of the rank's file; a frame's JSON stays under
# MAX_FRAME_BYTES even when every byte is escaped (\u0000: 6 characters).
LOG_STREAMS = ("out", "err")
MAX_LOG_FRAME_BYTES = 128 * 1024
MAX_LOG_LINE_BYTES = 16 * 1024
MAX_LOG_LINES_PER_FRAME = 10_000
# What any JSON an agent sends may hold (``loads_strict``): nesting at most this deep, integers
# that fit a signed 64-bit column, finite floats, strings that encode as UTF-8.
MAX_JSON_DEPTH = 32
MAX_JSON_INT = 2**63 - 1


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


def _bounded_int(text: str) -> int:
    # Checked on the digits first: a 4,000-digit integer is refused before it is converted.
    if len(text.lstrip("-")) > 19 or abs(value := int(text)) > MAX_JSON_INT:
        raise ProtocolError("bad_number", f"integer {text[:24]}{'...' if len(text) > 24 else ''} does not fit "
                            "in 64 bits")
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ProtocolError("bad_number", f"number {text[:24]} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ProtocolError("bad_number", f"{name} is not a JSON number")


def _constant_as_null(name: str) -> None:
    # Python's json writes a non-finite float as NaN or Infinity: a diverged run's loss, say.
    # In an agent frame it means "no finite value", read as null (never stored as a number).
    return None


def _check_nesting_and_text(value: Any, *, allow_nul: bool) -> None:
    """Walk ``value`` without recursion: refuse deep nesting and strings that are not UTF-8
    (a lone surrogate such as "\\ud800" is valid JSON but no database column can store it),
    and NUL characters (PostgreSQL text cannot hold them) unless ``allow_nul``."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not allow_nul and "\x00" in item:
                raise ProtocolError("bad_text", "a string holds a NUL character")
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise ProtocolError("bad_text", "a string holds a lone surrogate (not UTF-8)") from None
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise ProtocolError("too_deep", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((key, depth) for key in item)
            stack.extend((child, depth + 1) for child in item.values())
        else:
            stack.extend((child, depth + 1) for child in item)


def loads_strict(text: str | bytes, *, allow_nul: bool = False, non_finite_as_null: bool = False) -> Any:
    """``json.loads`` for anything a node agent (or a browser) sends: raises ProtocolError, never
    anything else, for text that is not JSON or holds what the server cannot store (see
    ``MAX_JSON_DEPTH``). Every endpoint that reads agent JSON decodes it here.
    ``non_finite_as_null``: ``NaN``/``Infinity`` tokens become null instead of a refusal."""
    constant = _constant_as_null if non_finite_as_null else _no_constant
    try:
        value = json.loads(text, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=constant)
    except ProtocolError:
        raise
    except RecursionError:
        raise ProtocolError("too_deep", f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # also UnicodeDecodeError: bytes that are not UTF-8
        raise ProtocolError("bad_json", f"not JSON: {str(exc)[:200]}") from None
    _check_nesting_and_text(value, allow_nul=allow_nul)
    return value


def _count(value: Any, key: str, where: str) -> None:
    """A step, rank or exit code: an integer (or null); steps and ranks are never negative."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError("bad_field", f"{where} {key!r} must be an integer")
    if value < 0 and key in ("step", "checkpoint_step", "rank"):
        raise ProtocolError("bad_field", f"{where} {key!r} must be 0 or more, got {value}")


def _workers(frame: dict[str, Any]) -> None:
    for worker in _optional_list(frame, "workers"):
        if not isinstance(worker, dict):
            raise ProtocolError("bad_field", "every entry of 'workers' must be an object")
        if not isinstance(worker.get("job", ""), str):
            raise ProtocolError("bad_field", "a worker's 'job' must be a job name")
        for key in ("step", "checkpoint_step"):
            _count(worker.get(key), key, "a worker's")


def _exit_outcome(outcome: dict[str, Any]) -> None:
    for key in ("step", "rank", "code", "signal"):
        _count(outcome.get(key), key, "an exit's")
    at = outcome.get("at")
    if at is not None and (isinstance(at, bool) or not isinstance(at, (int, float)) or at < 0):
        raise ProtocolError("bad_field", "an exit's 'at' must be Unix seconds")
    for key in ("outcome", "run_id", "error"):
        if outcome.get(key) is not None and not isinstance(outcome[key], str):
            raise ProtocolError("bad_field", f"an exit's {key!r} must be a string")


def parse_frame(text: str | bytes | None) -> dict[str, Any]:
    """Decode one text frame into a dict, or raise ProtocolError."""
    if text is None:
        raise ProtocolError("binary_frame", "frames are JSON text, not binary")
    if len(text) > MAX_FRAME_BYTES:
        raise ProtocolError("frame_too_large", f"frame of {len(text)} bytes exceeds {MAX_FRAME_BYTES}")
    # Log lines may hold NUL (stored as U+FFFD, docs/logs.md); no other frame may. NUL can only
    # arrive escaped, so only a frame whose text holds the escape is walked twice.
    frame = loads_strict(text, allow_nul=True, non_finite_as_null=True)
    if not isinstance(frame, dict):
        raise ProtocolError("bad_frame", "frame must be a JSON object")
    if not isinstance(frame.get("type"), str):
        raise ProtocolError("bad_frame", "frame needs a string 'type'")
    if frame["type"] != LOGS and ("\\u0000" in text if isinstance(text, str) else b"\\u0000" in text):
        _check_nesting_and_text(frame, allow_nul=False)
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
        _workers(frame)
    elif kind == HEARTBEAT:
        _optional_list(frame, "gpus")
        _workers(frame)
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
        if not all(isinstance(r, dict) and type(r.get("step")) is int and r["step"] >= 0 for r in records):
            raise ProtocolError("bad_record", "every step record must be an object with an integer 'step' of 0 or more")
    elif kind == EXIT:
        _require(frame, "job", str)
        _exit_outcome(_require(frame, "outcome", dict))
    else:
        raise ProtocolError("unknown_type", f"unknown frame type {kind!r}")
    return frame


def dumps(frame: dict[str, Any]) -> str:
    """Encode a frame compactly."""
    return json.dumps(frame, separators=(",", ":"), default=str)

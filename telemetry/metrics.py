"""Process-local counters for /metrics: ingestion outcomes and connected WebSocket clients.

Totals that must add up across processes (samples stored, per-source lag) come from the
database (``TelemetrySource``); these counters are what only the process itself can know. Every
ASGI and worker process serves its own values, so Prometheus scrapes each process
(docs/telemetry.md, "Prometheus"). Consumers call ``websocket_opened``/``websocket_closed``.
"""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_counters: Counter[tuple[str, str]] = Counter()
_websockets: Counter[str] = Counter()


def count(name: str, label: str, amount: float = 1) -> None:
    """Add ``amount`` to counter ``name`` with label value ``label``."""
    with _lock:
        _counters[(name, label)] += amount


def websocket_opened(kind: str) -> None:
    """A WebSocket of ``kind`` ("agent", "live") connected to this process."""
    with _lock:
        _websockets[kind] += 1


def websocket_closed(kind: str) -> None:
    """A WebSocket of ``kind`` disconnected from this process."""
    with _lock:
        _websockets[kind] = max(0, _websockets[kind] - 1)


def snapshot() -> tuple[dict[tuple[str, str], float], dict[str, int]]:
    """Copies of the counters and the WebSocket gauge, for rendering."""
    with _lock:
        return dict(_counters), dict(_websockets)


def reset() -> None:
    """Zero everything (tests)."""
    with _lock:
        _counters.clear()
        _websockets.clear()

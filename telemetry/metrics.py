"""Process-local counters for /metrics: ingestion outcomes and connected WebSocket clients.

Totals that must add up across processes (samples stored, per-source lag) come from the
database (``TelemetrySource``); these counters are what only the process itself can know. Every
ASGI and worker process serves its own values, so Prometheus scrapes each process
(docs/telemetry.md, "Prometheus"). Consumers call ``websocket_opened``/``websocket_closed``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

_lock = threading.Lock()
_counters: Counter[tuple[str, str]] = Counter()
_websockets: Counter[str] = Counter()
RATE_WINDOW_S = 60.0
_recent_samples: deque[tuple[float, str, int]] = deque()


def count(name: str, label: str, amount: float = 1) -> None:
    """Add ``amount`` to counter ``name`` with label value ``label``."""
    with _lock:
        _counters[(name, label)] += amount


def samples_stored(kind: str, samples: int) -> None:
    """Count ``samples`` stored in this process now (for the ingest rate over the last minute)."""
    now = time.monotonic()
    with _lock:
        _counters[("omni_telemetry_samples_total", kind)] += samples
        _recent_samples.append((now, kind, samples))
        while _recent_samples and _recent_samples[0][0] < now - RATE_WINDOW_S:
            _recent_samples.popleft()


def ingest_rate_per_s() -> dict[str, float]:
    """Samples per second stored by this process over the last minute, by kind."""
    now = time.monotonic()
    rates: Counter[str] = Counter()
    with _lock:
        while _recent_samples and _recent_samples[0][0] < now - RATE_WINDOW_S:
            _recent_samples.popleft()
        for _, kind, samples in _recent_samples:
            rates[kind] += samples
    return {kind: total / RATE_WINDOW_S for kind, total in rates.items()}


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
        _recent_samples.clear()

"""Small helpers the benchmarks that run real processes share: a free port, whether a port
answers, and waiting for a condition with a deadline."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.2) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); RuntimeError naming
    ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")

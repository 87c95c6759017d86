"""One way to run the real ASGI server (``manage.py serve --no-loop``) on the test database, for
the suites that drive it from outside: the browser tests and the CLI tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def database_url(django_db_blocker) -> str:
    """The test database as a URL for a server subprocess (skips unless it is PostgreSQL)."""
    from django.db import connection

    with django_db_blocker.unblock():
        db = connection.settings_dict
    if connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL: the server subprocess must share the test database")
    auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


@contextmanager
def serve(env_overrides: dict[str, str], log_name: str) -> Iterator[str]:
    """Start the server with ``os.environ`` plus ``env_overrides``, its output in
    tests/artifacts/``log_name``; yield its URL once it accepts connections; stop it after."""
    port = free_port()
    env = {**os.environ, "ALLOWED_HOSTS": "127.0.0.1,localhost", **env_overrides}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with open(ARTIFACTS / log_name, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--host", "127.0.0.1", "--port", str(port), "--no-loop"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                        break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        pytest.fail(f"the ASGI server did not start (see tests/artifacts/{log_name})")
                    time.sleep(0.1)
            yield f"http://127.0.0.1:{port}"
        finally:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()

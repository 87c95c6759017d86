"""Run the whole test suite, against real PostgreSQL and Redis when they are there.

``make test`` calls this. It uses ``DATABASE_URL``/``REDIS_URL`` when set, else PostgreSQL on
127.0.0.1:5432 and Redis on 127.0.0.1:6379 when they answer, else the embedded mode, in which
the tests that need the real servers are skipped with a printed reason and count. With
``OMNI_REQUIRE_SERVICES=1`` a missing server is an error, never a skip; with
``OMNI_TEST_SERVICES=none`` the servers are ignored even when they answer (to check the
embedded run on a machine that has them).
"""

from __future__ import annotations

import os
import socket
import sys

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/omni"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def _answers(host: str, port: int) -> bool:
    if os.environ.get("OMNI_TEST_SERVICES") == "none":
        return False
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _postgres_usable(url: str) -> str | None:
    """None when a connection works, else why not."""
    try:
        import psycopg
    except ImportError as exc:
        return f"psycopg is not installed ({exc})"
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        with psycopg.connect(
            host=parts.hostname, port=parts.port or 5432, user=parts.username or None,
            password=parts.password or None, dbname="postgres", connect_timeout=3,
        ):
            return None
    except psycopg.Error as exc:
        return f"cannot connect: {str(exc).strip().splitlines()[0]}"


def configure_services(environ: dict[str, str]) -> list[str]:
    """Fill in DATABASE_URL/REDIS_URL in ``environ``; return what was decided, line by line."""
    required = environ.get("OMNI_REQUIRE_SERVICES") == "1"
    notes: list[str] = []
    problems: list[str] = []

    database_url = environ.get("DATABASE_URL")
    if not database_url and _answers("127.0.0.1", 5432):
        database_url = DEFAULT_DATABASE_URL
    if database_url:
        why = _postgres_usable(database_url) if database_url.startswith("postgres") else None
        if why:
            problems.append(f"PostgreSQL at {database_url}: {why}")
            database_url = None
    if database_url:
        environ["DATABASE_URL"] = database_url
        notes.append(f"database: PostgreSQL ({database_url.split('@')[-1]})")
    else:
        environ.pop("DATABASE_URL", None)
        notes.append("database: embedded SQLite (no PostgreSQL answered on 127.0.0.1:5432)")
        problems.append("PostgreSQL is not available")

    redis_url = environ.get("REDIS_URL")
    if not redis_url and _answers("127.0.0.1", 6379):
        redis_url = DEFAULT_REDIS_URL
    if redis_url:
        environ["OMNI_TEST_REDIS_URL"] = redis_url
        notes.append(f"redis: {redis_url}")
    else:
        notes.append("redis: none (no Redis answered on 127.0.0.1:6379)")
        problems.append("Redis is not available")
    # The web process under test keeps the embedded in-memory channel layer and eager Celery
    # unless a test starts its own worker; tests that need Redis read OMNI_TEST_REDIS_URL.
    environ.pop("REDIS_URL", None)

    if problems and required:
        raise SystemExit("make test: OMNI_REQUIRE_SERVICES=1 but " + "; ".join(problems))
    if problems:
        notes.append("tests that need the missing servers will be SKIPPED (see the skip summary at the end)")
    return notes


def main(argv: list[str]) -> int:
    environ = dict(os.environ)
    environ.setdefault("SECRET_KEY", "omni-test-suite-key-not-secret")
    for note in configure_services(environ):
        print(f"[omni tests] {note}", flush=True)
    os.environ.clear()
    os.environ.update(environ)
    import pytest

    return pytest.main(["-p", "no:cacheprovider", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

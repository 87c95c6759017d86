"""Settings read the environment strictly: a bad value stops start-up naming the variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omniweb.env import EnvError, database_from_url, env_bool, env_int

ROOT = Path(__file__).resolve().parents[2]


def _check(env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DEBUG")}
    return subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, env={**clean, **env},
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"DEBUG": "maybe"}, "DEBUG"),
        ({"OMNI_HEARTBEAT_MISSES": "three"}, "OMNI_HEARTBEAT_MISSES"),
        ({"DATABASE_URL": "mysql://x/y", "SECRET_KEY": "k"}, "DATABASE_URL"),
        ({"REDIS_URL": "http://localhost"}, "REDIS_URL"),
        ({"DATABASE_URL": "postgres://u@h/db"}, "SECRET_KEY"),
        ({"SECRET_KEY_FILE": "/nonexistent/secret"}, "SECRET_KEY_FILE"),
        ({"OMNI_RDZV_PORTS": "29400-2000"}, "OMNI_RDZV_PORTS"),
        ({"OMNI_RDZV_PORTS": "many"}, "OMNI_RDZV_PORTS"),
    ],
)
def test_bad_environment_stops_startup_naming_the_variable(env, variable):
    result = _check(env)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(f"omni: bad environment: {variable}")
    assert "Traceback" not in result.stderr


def test_secret_may_come_from_a_file(tmp_path):
    secret = tmp_path / "key"
    secret.write_text("from-a-file\n")
    result = subprocess.run(
        [sys.executable, "-c", "from django.conf import settings; print(settings.SECRET_KEY)"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "omniweb.settings", "SECRET_KEY_FILE": str(secret)},
    )
    assert result.stdout.strip() == "from-a-file", result.stderr


def test_env_helpers(monkeypatch):
    monkeypatch.setenv("X_BOOL", "yes")
    monkeypatch.setenv("X_INT", "-1")
    assert env_bool("X_BOOL", False) is True
    with pytest.raises(EnvError, match="X_INT: must be at least 0"):
        env_int("X_INT", 5, minimum=0)
    assert env_int("X_MISSING", 5) == 5


def test_database_url_parsing_keeps_the_password_out_of_errors():
    parsed = database_from_url("DATABASE_URL", "postgres://omni:s3cret@db.example:6543/omni?sslmode=require")
    assert (parsed["HOST"], parsed["PORT"], parsed["NAME"], parsed["OPTIONS"]) == (
        "db.example", "6543", "omni", {"sslmode": "require"})
    with pytest.raises(EnvError) as info:
        database_from_url("DATABASE_URL", "postgres://omni:s3cret@db.example:6543/")
    assert "s3cret" not in str(info.value)

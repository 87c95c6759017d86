"""Production settings pass ``manage.py check --deploy`` once the TLS proxy header is named
(docs/operators.md, "Deploying behind a TLS proxy"); without it nothing changes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _deploy_check(**extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "DJANGO_"))}
    env.update(DATABASE_URL=os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/omni"),
               REDIS_URL="redis://127.0.0.1:6379/0", SECRET_KEY="k" * 20 + "-long-random-production-secret-key-9f3",
               ALLOWED_HOSTS="omni.example.org", **extra)
    # check --deploy reads settings only: it needs no database connection.
    return subprocess.run([sys.executable, "manage.py", "check", "--deploy"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.timeout(240)
def test_check_deploy_passes_behind_the_tls_proxy_header_and_warns_without_it():
    behind = _deploy_check(OMNI_TLS_PROXY_HEADER="X-Forwarded-Proto")
    assert behind.returncode == 0, behind.stderr
    assert "security." not in behind.stdout + behind.stderr
    bare = _deploy_check()
    assert "security.W004" in bare.stdout + bare.stderr and "security.W008" in bare.stdout + bare.stderr


def test_a_bad_proxy_header_name_stops_start_up():
    refused = _deploy_check(OMNI_TLS_PROXY_HEADER="X Forwarded: https")
    assert refused.returncode == 2 and "OMNI_TLS_PROXY_HEADER" in refused.stderr

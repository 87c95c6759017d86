"""The fault-injection suite, seeded subset: ``python -m bench.faults --faults 20`` on one stack of
its own (private PostgreSQL and Redis, daphne, Celery, four agents), a new seed every run,
printed, and ``OMNI_FAULTS_SEED`` to replay one. Every fault must be survived, no command lost
or applied twice (docs/faults.md)."""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from tests.control_loop.conftest import ROOT

pytestmark = [pytest.mark.services, pytest.mark.postgres, pytest.mark.redis, pytest.mark.torch, pytest.mark.slow,
              pytest.mark.timeout(700)]

FAULTS = 20
FAULTS_TIMEOUT_S = 600


def _missing_servers() -> str:
    if not glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        return "PostgreSQL server binaries (/usr/lib/postgresql/*/bin/initdb) are not installed"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed"
    return ""


def test_twenty_seeded_faults_are_all_survived_with_no_command_lost_or_applied_twice():
    missing = _missing_servers()
    if missing:
        if os.environ.get("OMNI_REQUIRE_SERVICES") == "1":
            pytest.fail(f"OMNI_REQUIRE_SERVICES=1 but {missing}", pytrace=False)
        pytest.skip(missing)
    seed = int(os.environ.get("OMNI_FAULTS_SEED") or random.randrange(1 << 31))
    print(f"bench.faults seed {seed} (replay: OMNI_FAULTS_SEED={seed})")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTEST_") and k not in ("DATABASE_URL", "REDIS_URL")}
    bench = subprocess.Popen([sys.executable, "-m", "bench.faults", "--json", "--faults", str(FAULTS), "--seed",
                              str(seed)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = bench.communicate(timeout=FAULTS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        bench.terminate()  # the bench stops its stack and services on SIGTERM
        stdout, stderr = bench.communicate(timeout=60)
        pytest.fail(f"bench.faults seed {seed} ran past {FAULTS_TIMEOUT_S}s\n{stderr[-6000:]}", pytrace=False)
    progress = stderr[-6000:]
    assert stdout.strip(), f"no result (exit {bench.returncode}); seed {seed}\n{progress}"
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["seed"] == seed
    assert result["faults_injected"] == FAULTS, progress
    assert sum(k["injected"] for k in result["by_kind"].values()) == FAULTS
    assert all(k["injected"] >= 1 for k in result["by_kind"].values()), result["by_kind"]
    assert result["faults_survived"] == result["faults_injected"], (
        f"seed {seed}: {json.dumps(result['failures'], indent=1)}\n{progress}")
    assert result["commands_lost"] == 0, f"seed {seed}\n{progress}"
    assert result["commands_duplicated"] == 0, f"seed {seed}\n{progress}"
    assert result["commands"] > 0 and bench.returncode == 0

"""Session fixtures for the trainer tests: the reference run and its preempted twin, computed once."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.trainer.trainer_runs import REFERENCE_ARGS, run_trainer


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted 40-step run at DP=2, shared by every test that compares against it."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = run_trainer(run_dir, *REFERENCE_ARGS, "--dp", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir


@pytest.fixture(scope="session")
def preempted_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The reference configuration preempted by --stop-at-step 17 (copy it before resuming)."""
    run_dir = tmp_path_factory.mktemp("preempted") / "run"
    result = run_trainer(run_dir, *REFERENCE_ARGS, "--dp", "2", "--stop-at-step", "17")
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir, result

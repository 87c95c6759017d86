"""Run the real trainer launcher in a subprocess and read what it wrote (shared by the trainer tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# The reference configuration every process test shares, so runs are comparable step by step.
REFERENCE_ARGS = ("--steps", "40", "--global-batch", "16", "--micro-batch", "2", "--seed", "7", "--checkpoint-every", "5", "--keep", "3")


def trainer_command(run_dir: Path, *args: str) -> list[str]:
    """The launcher command line for ``run_dir``."""
    return [sys.executable, "-m", "trainer_agent.train", "--run-dir", str(run_dir), *args]


def trainer_env(**extra: str) -> dict[str, str]:
    """Environment for a launcher subprocess (repo importable, test hooks added)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_trainer(run_dir: Path, *args: str, timeout_s: float = 600, **env: str) -> subprocess.CompletedProcess[str]:
    """Run the launcher to completion and return its result (stdout/stderr captured)."""
    return subprocess.run(
        trainer_command(run_dir, *args), cwd=REPO_ROOT, env=trainer_env(**env), capture_output=True, text=True, timeout=timeout_s,
    )


def read_records(run_dir: Path) -> dict[int, dict]:
    """Step records of metrics.jsonl, by step (a step appears once: resumes trim what they redo)."""
    records: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert record["step"] not in records, f"step {record['step']} recorded twice"
        records[record["step"]] = record
    return records


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step."""
    return {step: record["loss"] for step, record in read_records(run_dir).items()}

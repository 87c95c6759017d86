"""Framework-owned training loops through the real control plane: the HF Trainer and the
Lightning examples (examples/hf_trainer, examples/lightning) as ``omni`` jobs on a 2-GPU
simulated node. Drained mid-run, the job checkpoints through the framework at the step its
ranks agreed on (SIGTERM to every rank), is preempted with that step reported, resumes when the
node comes back, completes, and its per-step losses equal a plain torchrun run's (the bound in
docs/integrations.md is exact equality for both)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.control_loop.conftest import ROOT, make_node, run_output, wait_for

pytestmark = [pytest.mark.services, pytest.mark.postgres, pytest.mark.redis, pytest.mark.torch,
              pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLES = {"hf": ROOT / "examples" / "hf_trainer", "lightning": ROOT / "examples" / "lightning"}
TOTAL_STEPS = 30
STEP_S = {"hf": "0.3", "lightning": "0.15"}  # the lightning pace is per micro-batch (2 a step)


def step_losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    out: dict[int, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line being written
            out[record["step"]] = record["loss"]
    return out


def plain_torchrun_losses(framework: str, tmp: Path) -> dict[int, float]:
    """The same script and layout, uninterrupted, under plain torchrun (no agent)."""
    run_dir = tmp / f"{framework}-reference"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "PYTEST_"))}
    env.update(OMNI_JOB="reference", OMNI_INTEGRATION="omni", OMNI_RUN_DIR=str(run_dir),
               OMNI_TOTAL_STEPS=str(TOTAL_STEPS), OMNI_GLOBAL_BATCH="16", OMNI_MICRO_BATCH="4", OMNI_DP="2",
               OMNI_ACCUM_STEPS="2", OMNI_CHECKPOINT_EVERY="10", OMNI_KEEP_CHECKPOINTS="2", OMNI_DEVICE="cpu",
               OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    str(EXAMPLES[framework] / "train.py")], env=env, cwd=tmp, check=True, capture_output=True,
                   timeout=180)
    return step_losses(run_dir)


def submit_example(owner, framework: str):
    """The example's job.toml, as ``omni submit`` sends it, with a pace to watch it by."""
    from jobs import actions
    from trainer_agent.cli import load_spec

    spec = load_spec(EXAMPLES[framework] / "job.toml")
    assert spec["integration"] == "omni" and spec["total_steps"] == TOTAL_STEPS
    spec["entrypoint"] = [*spec["entrypoint"], "--step-s", STEP_S[framework]]
    return actions.submit_job(owner, **spec)


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_a_framework_job_is_preempted_at_its_own_checkpoint_and_resumes_on_the_uninterrupted_losses(
        framework, control_cluster, boss):
    from jobs import actions
    from jobs.models import ElasticEvent, EventKind, Job, Node

    _, token = make_node("n1", 2)
    job = submit_example(boss, framework)
    control_cluster.start_server()
    control_cluster.start_worker()
    control_cluster.start_agent("n1", token, gpus=2)
    run_dir = control_cluster.tmp / "runs" / job.name

    first_run = wait_for(lambda: Job.objects.get(pk=job.pk).run_id, 60, "the job to be placed")
    wait_for(lambda: max(step_losses(run_dir), default=0) >= 5, 150, "training steps")

    actions.drain_node(Node.objects.get(name="n1"), boss)
    wait_for(lambda: Job.objects.get(pk=job.pk).state == "preempted", 90, "the job to be preempted")
    job.refresh_from_db()
    preempted = ElasticEvent.objects.filter(kind=EventKind.OUTCOME, job_name=job.name,
                                            outcome__kind="preempt").last()
    exit_info = json.loads((run_dir / "exit.json").read_text())
    assert exit_info["outcome"] == "preempted" and exit_info["reason"] == "SIGTERM"
    saved = exit_info["checkpoint_step"]
    assert 5 <= saved < TOTAL_STEPS and saved == exit_info["step"]
    assert job.last_checkpoint_step == saved and preempted.outcome["checkpoint_step"] == saved
    assert preempted.outcome["steps_lost"] == 0
    assert f"checkpoint at step {saved} saved" in preempted.reason["text"]
    latest = json.loads((run_dir / "checkpoints" / "omni-latest.json").read_text())
    assert latest["step"] == saved and Path(latest["path"]).exists()

    actions.uncordon_node(Node.objects.get(name="n1"), boss)
    wait_for(lambda: Job.objects.get(pk=job.pk).state == "completed", 180, "the job to resume and complete")
    job.refresh_from_db()
    assert job.run_id != first_run
    assert "resuming from" in run_output(run_dir)
    assert json.loads((run_dir / "exit.json").read_text())["outcome"] == "completed"

    resumed = step_losses(run_dir)
    reference = plain_torchrun_losses(framework, control_cluster.tmp)
    assert sorted(resumed) == sorted(reference) == list(range(1, TOTAL_STEPS + 1))
    assert resumed == reference  # bitwise: docs/integrations.md

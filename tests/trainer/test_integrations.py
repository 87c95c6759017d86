"""The framework callbacks with real torch processes: each example (HF Trainer, Lightning) runs
under plain torchrun with 2 CPU ranks and Omni's environment, once straight through and once
stopped mid-way by control.json then relaunched with the same command; the resumed run's
per-step losses (metrics.jsonl) equal the straight run's within the bound docs/integrations.md
gives, and exit.json says preempted, then completed. Plus the checkpoint bookkeeping both share
(``job.note_checkpoint``, ``resume_checkpoint``), in process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {"hf": ROOT / "examples" / "hf_trainer" / "train.py", "lightning": ROOT / "examples" / "lightning" / "train.py"}
# The largest per-step |loss difference| a stop and resume may cause (docs/integrations.md).
RESUME_BOUND = {"hf": 0.0, "lightning": 0.0}
HF_RESIZE_BOUND = 1e-5  # measured 2.4e-7: float32 sums in another order at DP 1
TOTAL_STEPS = 24
STOP_AFTER = 9


def job_env(run_dir: Path, **extra: str) -> dict[str, str]:
    """Omni's variables for a 2-replica CPU job in ``run_dir``, as the node agent sets them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "PYTEST_"))}
    env.update(OMNI_JOB="integration", OMNI_INTEGRATION="omni", OMNI_RUN_DIR=str(run_dir),
               OMNI_CHECKPOINT_DIR=str(run_dir / "checkpoints"), OMNI_TOTAL_STEPS=str(TOTAL_STEPS),
               OMNI_GLOBAL_BATCH="16", OMNI_MICRO_BATCH="4", OMNI_DP="2", OMNI_ACCUM_STEPS="2",
               OMNI_CHECKPOINT_EVERY="6", OMNI_KEEP_CHECKPOINTS="2", OMNI_DEVICE="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def torchrun(script: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(script)], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(proc: subprocess.Popen, timeout_s: float = 180) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out[-4000:]
    return out


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss, from the step records (a relaunch replaces the records past its checkpoint)."""
    out: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out[record["step"]] = record["loss"]
    return out


def ask_to_stop(run_dir: Path, **command: object) -> None:
    """What the node agent does: control.json, written atomically."""
    tmp = run_dir / ".control.json.tmp"
    tmp.write_text(json.dumps({"command": "checkpoint_and_stop", "id": "test", **command}))
    os.replace(tmp, run_dir / "control.json")


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if max(losses(run_dir), default=0) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before step {step}: {proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no step {step} after {timeout_s:.0f}s")


def run_straight(framework: str, tmp_path: Path) -> dict[int, float]:
    run_dir = tmp_path / f"{framework}-straight"
    finish(torchrun(EXAMPLES[framework], job_env(run_dir), tmp_path))
    assert json.loads((run_dir / "exit.json").read_text())["outcome"] == "completed"
    return losses(run_dir)


def run_stopped_and_resumed(framework: str, tmp_path: Path) -> tuple[dict[int, float], dict, dict]:
    run_dir = tmp_path / f"{framework}-resumed"
    env = job_env(run_dir)
    first = torchrun(EXAMPLES[framework], env, tmp_path)
    wait_for_step(run_dir, first, STOP_AFTER)
    ask_to_stop(run_dir)
    finish(first)
    stopped = json.loads((run_dir / "exit.json").read_text())
    latest = json.loads((run_dir / "checkpoints" / "omni-latest.json").read_text())
    assert latest["step"] == stopped["step"] and Path(latest["path"]).exists()
    assert stopped["checkpoint_step"] == stopped["step"]  # so a teardown abort after it is no failure
    assert (run_dir / "control.consumed.json").exists() and not (run_dir / "control.json").exists()
    out = finish(torchrun(EXAMPLES[framework], env, tmp_path))
    assert "resuming from" in out
    return losses(run_dir), stopped, json.loads((run_dir / "exit.json").read_text())


def largest_difference(a: dict[int, float], b: dict[int, float]) -> float:
    assert sorted(a) == sorted(b) == list(range(1, TOTAL_STEPS + 1))
    return max(abs(a[step] - b[step]) for step in a)


@pytest.mark.parametrize("framework", ["hf", "lightning"])
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_stopped_by_control_json_resumes_on_the_uninterrupted_loss_trajectory(framework, tmp_path):
    straight = run_straight(framework, tmp_path)
    resumed, stopped, ended = run_stopped_and_resumed(framework, tmp_path)

    assert stopped["outcome"] == "preempted" and stopped["reason"] == "control file"
    assert STOP_AFTER <= stopped["step"] < TOTAL_STEPS
    assert stopped["checkpoint_step"] == stopped["step"]
    assert ended["outcome"] == "completed" and ended["step"] == TOTAL_STEPS
    assert straight[TOTAL_STEPS] < straight[1]  # it learns
    difference = largest_difference(straight, resumed)
    print(f"{framework}: stopped at step {stopped['step']}, largest |loss difference| {difference:.3g}")
    assert difference <= RESUME_BOUND[framework]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_hf_run_resized_to_one_replica_keeps_the_global_batch_and_the_loss_trajectory(tmp_path):
    straight = run_straight("hf", tmp_path)
    run_dir = tmp_path / "hf-resized"
    first = torchrun(EXAMPLES["hf"], job_env(run_dir), tmp_path)
    wait_for_step(run_dir, first, STOP_AFTER)
    ask_to_stop(run_dir, command="resize", dp=1)
    finish(first)
    stopped = json.loads((run_dir / "exit.json").read_text())
    assert stopped["outcome"] == "resize" and stopped["requested_dp"] == 1

    # The agent relaunches at DP 1 with twice the accumulation: global batch 16 still.
    one = job_env(run_dir, OMNI_DP="1", OMNI_ACCUM_STEPS="4")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                             str(EXAMPLES["hf"])], env=one, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    finish(proc)
    assert json.loads((run_dir / "exit.json").read_text())["outcome"] == "completed"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {(r["dp"], r["accum"]) for r in records if r["step"] > stopped["step"]} == {(1, 4)}
    assert {r["tokens"]["text"] for r in records} == {16 * 32}
    difference = largest_difference(straight, losses(run_dir))
    print(f"hf resize 2 -> 1 at step {stopped['step']}: largest |loss difference| {difference:.3g}")
    assert difference <= HF_RESIZE_BOUND


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_hf_step_records_carry_the_layout_and_the_tokens(tmp_path):
    run_dir = tmp_path / "records"
    finish(torchrun(EXAMPLES["hf"], job_env(run_dir, OMNI_TOTAL_STEPS="3"), tmp_path))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    first = records[0]
    assert (first["dp"], first["accum"], first["micro_batch"], first["global_batch"]) == (2, 2, 4, 16)
    assert first["tokens"]["text"] == 16 * 32  # the global batch of 32-token sequences
    assert first["compute_s"] > 0
    assert [r["opt_step"] for r in records] == [1, 2, 3]  # the optimizer's own count, for the health check
    # The final save is announced too: the agent can see the step it would resume from.
    assert json.loads((run_dir / "checkpoints" / "omni-latest.json").read_text())["step"] == 3


def local_job(tmp_path: Path, rank: int = 0):
    from trainer_agent.runtime import TrainerRuntime
    from trainer_agent.runtime.job import Job, JobSpec

    spec = JobSpec.from_env({"RANK": str(rank), "WORLD_SIZE": "2", "OMNI_RUN_DIR": str(tmp_path),
                             "OMNI_TOTAL_STEPS": "20", "OMNI_MICRO_BATCH": "1", "OMNI_GLOBAL_BATCH": "2",
                             "OMNI_JOB": "local"})
    return Job(spec, TrainerRuntime(rank=rank, world_size=2, handle_signals=False))


def test_a_noted_checkpoint_is_what_the_agent_sees_and_what_a_resume_prefers(tmp_path):
    from trainer_agent.checkpoint import newest_step
    from trainer_agent.integrations import hf

    job = local_job(tmp_path)
    for step in (10, 20):
        (job.checkpoint_dir / f"checkpoint-{step}").mkdir(parents=True)
    assert hf.resume_checkpoint(job) == str(job.checkpoint_dir / "checkpoint-20")  # nothing noted yet
    job.note_checkpoint(10, job.checkpoint_dir / "checkpoint-10")
    # checkpoint-20 was never announced (a save cut short): the resume and the agent take step 10.
    assert hf.resume_checkpoint(job) == str(job.checkpoint_dir / "checkpoint-10")
    assert newest_step(job.checkpoint_dir) == 10
    assert sorted(p.name for p in job.checkpoint_dir.iterdir()) == ["checkpoint-10", "checkpoint-20",
                                                                     "omni-latest.json"]  # no tmp left


def test_only_rank_0_writes_the_note_but_every_rank_reports_it_at_exit(tmp_path):
    job = local_job(tmp_path, rank=1)
    job.note_checkpoint(7, tmp_path / "somewhere")
    assert not (job.checkpoint_dir / "omni-latest.json").exists()
    leader = local_job(tmp_path)
    leader.note_checkpoint(7, tmp_path / "somewhere")
    record = leader.finish(7)
    assert record["outcome"] == "preempted" and record["checkpoint_step"] == 7
    assert json.loads((tmp_path / "exit.json").read_text())["checkpoint"] == str(tmp_path / "somewhere")


def test_the_lightning_sampler_gives_each_replica_its_share_of_every_step_from_the_resumed_one(tmp_path):
    from trainer_agent.integrations.lightning import StepBatchSampler

    replicas = [local_job(tmp_path, rank) for rank in (0, 1)]
    # 20 steps of global batch 2 x micro 1: replica r takes sample 2(n-1)+r at step n.
    assert [list(StepBatchSampler(job, first_step=19)) for job in replicas] == [[[36], [38]], [[37], [39]]]
    assert len(StepBatchSampler(replicas[0], first_step=19)) == 20  # the whole run's length


def test_after_a_resize_the_library_ramps_the_learning_rate_and_puts_it_back(tmp_path):
    import torch

    from trainer_agent.runtime import optimizer_steps
    from trainer_agent.runtime.job import Job, JobSpec

    env = {"RANK": "0", "WORLD_SIZE": "2", "OMNI_RUN_DIR": str(tmp_path), "OMNI_TOTAL_STEPS": "20",
           "OMNI_MICRO_BATCH": "1", "OMNI_GLOBAL_BATCH": "2", "OMNI_CALIBRATION_STEPS": "4",
           "OMNI_CALIBRATION_START": "0.2"}
    from trainer_agent.runtime import TrainerRuntime

    job = Job(JobSpec.from_env(env), TrainerRuntime(rank=0, world_size=2, handle_signals=False))
    job._resumed(10, previous_dp=2)  # a resume at the same DP: no ramp
    assert job.lr_factor(11) == 1.0
    job._resumed(10, previous_dp=1)  # from dp 1 to 2: a resize
    assert [job.lr_factor(s) for s in (10, 11, 12, 13, 14, 15)] == pytest.approx([1.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.AdamW([weight], lr=0.5)
    assert optimizer_steps(optimizer) is None
    seen = []
    weight.grad = torch.ones(1)
    with job.calibrated(optimizer, 11) as factor:
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
    assert factor == pytest.approx(0.2) and seen == [pytest.approx(0.1)]
    assert optimizer.param_groups[0]["lr"] == 0.5  # put back for the scheduler
    assert optimizer_steps(optimizer) == 1


def test_the_calibration_ramp_is_off_outside_omni_and_a_bad_fraction_is_named(tmp_path):
    from trainer_agent.runtime.job import JobEnvironmentError, JobSpec

    base = {"OMNI_RUN_DIR": str(tmp_path), "OMNI_TOTAL_STEPS": "20", "OMNI_MICRO_BATCH": "1"}
    assert JobSpec.from_env(base).calibration_steps == 0
    with pytest.raises(JobEnvironmentError, match="OMNI_CALIBRATION_START='2' is not a fraction"):
        JobSpec.from_env({**base, "OMNI_CALIBRATION_START": "2"})

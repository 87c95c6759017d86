"""The library's checkpointer on torch.distributed.checkpoint: in one process (keep-last-K,
partial writes, a corrupt or truncated newest checkpoint, an asynchronous save that snapshots
before training goes on, everything exact resume needs), and under torchrun with 2 ranks:
FSDP2-sharded state saved at 2 ranks and loaded at 2 and at 1, replicated DDP state the same."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer_agent.checkpoint import CheckpointStore
from trainer_agent.runtime import Checkpointer
from trainer_agent.runtime.job import JobEnvironmentError, JobSpec

pytestmark = pytest.mark.torch
SCRIPT = Path(__file__).with_name("dcp_ranks.py")


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8)  # from the global RNG: a resume must restore it to see the same data
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_a_resume_restores_model_optimizer_schedule_rng_and_extras_exactly(tmp_path: Path) -> None:
    model, opt = _model()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    _train(model, opt, 3)
    scheduler.step()
    random.seed(7)
    np.random.seed(7)
    ckpt = Checkpointer(tmp_path, keep=2)
    info = ckpt.save(3, model=model, optimizer=opt, scheduler=scheduler, batch={"global_batch": 4, "dp": 1},
                     data={"next_sample_index": 12}, extra={"note": "hello"}, manifest={"seed": 5})
    assert info.checkpoint == "step-00000003" and info.blocked_s == info.save_s > 0
    expected = _train(model, opt, 4), random.random(), np.random.rand()

    fresh, fresh_opt = _model(seed=99)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=2, gamma=0.5)
    resumed = Checkpointer(tmp_path, keep=2).load(model=fresh, optimizer=fresh_opt, scheduler=fresh_scheduler)
    assert resumed is not None and resumed.step == 3 and resumed.previous_dp == 1
    assert resumed.data == {"next_sample_index": 12} and resumed.extra == {"note": "hello"}
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert (_train(fresh, fresh_opt, 4), random.random(), np.random.rand()) == expected  # bitwise
    manifest = CheckpointStore(tmp_path).newest_manifest()
    assert manifest["seed"] == 5 and manifest["batch"] == {"global_batch": 4, "dp": 1} and ".metadata" in manifest["files"]


def test_keeps_the_last_k_and_ignores_partial_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, opt = _model()
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        _train(model, opt, 1)
        ckpt.save(step, model=model, optimizer=opt)
    assert CheckpointStore(tmp_path).complete_steps() == [2, 3]
    (tmp_path / ".tmp-step-00000004-dead").mkdir()  # a save that died before its commit
    (tmp_path / "step-00000005").mkdir()  # no manifest: never committed
    resumed = Checkpointer(tmp_path).load(model=_model()[0])
    assert resumed is not None and resumed.step == 3
    assert not (tmp_path / ".tmp-step-00000004-dead").exists()
    assert "removed partial checkpoint write .tmp-step-00000004-dead" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_broken_newest_checkpoint_falls_back_to_the_previous_with_a_warning(
        tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    model, opt = _model()
    ckpt = Checkpointer(tmp_path, keep=3)
    ckpt.save(1, model=model, optimizer=opt)
    weights_at_1 = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, 1)
    ckpt.save(2, model=model, optimizer=opt)
    data = sorted((tmp_path / "step-00000002").glob("*.distcp"))[0]
    if damage == "flip":
        payload = bytearray(data.read_bytes())
        payload[len(payload) // 2] ^= 0xFF
        data.write_bytes(bytes(payload))
    elif damage == "truncate":
        data.write_bytes(data.read_bytes()[:100])
    else:
        data.unlink()
    fresh = _model(seed=3)[0]
    resumed = Checkpointer(tmp_path).load(model=fresh)
    assert resumed is not None and resumed.step == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), weights_at_1, strict=True))
    err = capsys.readouterr().err
    assert "checkpoint step-00000002 is corrupt or incomplete: " in err and data.name in err


def test_nothing_to_resume_from_is_none(tmp_path: Path) -> None:
    assert Checkpointer(tmp_path / "none").load(model=_model()[0]) is None


def test_an_asynchronous_save_snapshots_the_state_before_training_goes_on(tmp_path: Path) -> None:
    model, opt = _model()
    _train(model, opt, 1)
    saved = [p.detach().clone() for p in model.parameters()]
    ckpt = Checkpointer(tmp_path, async_save=True)
    info = ckpt.save(1, model=model, optimizer=opt)
    assert info.asynchronous and info.blocked_s > 0
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # training goes on mutating the live tensors
    done = ckpt.wait()
    assert done is info and info.save_s is not None and info.save_s >= info.blocked_s
    assert CheckpointStore(tmp_path).complete_steps() == [1]
    fresh = _model(seed=5)[0]
    Checkpointer(tmp_path).load(model=fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), saved, strict=True))


def test_the_job_environment_is_read_and_checked() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "OMNI_DP": "2", "OMNI_MICRO_BATCH": "2",
           "OMNI_GLOBAL_BATCH": "16", "OMNI_TOTAL_STEPS": "100", "OMNI_RUN_DIR": "/runs/j", "OMNI_JOB": "j"}
    spec = JobSpec.from_env(env)
    assert (spec.dp, spec.accum, spec.ranks_per_replica, spec.dp_rank) == (2, 4, 2, 1)
    assert spec.checkpoint_dir == Path("/runs/j/checkpoints") and spec.checkpoint_every == 10 and spec.under_omni
    with pytest.raises(JobEnvironmentError, match="OMNI_GLOBAL_BATCH=15 does not split"):
        JobSpec.from_env({**env, "OMNI_GLOBAL_BATCH": "15"})
    with pytest.raises(JobEnvironmentError, match="OMNI_TOTAL_STEPS='ten' is not a whole number"):
        JobSpec.from_env({**env, "OMNI_TOTAL_STEPS": "ten"})
    with pytest.raises(JobEnvironmentError, match="OMNI_RUN_DIR is not set"):
        JobSpec.from_env({k: v for k, v in env.items() if k != "OMNI_RUN_DIR"})


def test_sample_indices_keep_the_global_batch_and_its_order_at_any_dp() -> None:
    def indices(world: int, step: int) -> list[int]:
        out = []
        for rank in range(world):
            env = {"RANK": str(rank), "WORLD_SIZE": str(world), "OMNI_MICRO_BATCH": "2", "OMNI_GLOBAL_BATCH": "8",
                   "OMNI_TOTAL_STEPS": "10", "OMNI_RUN_DIR": "/r"}
            from trainer_agent.runtime.job import Job

            out += [i for mb in Job(JobSpec.from_env(env), None).sample_indices(step) for i in mb]  # type: ignore[arg-type]
        return out

    assert indices(1, 3) == indices(2, 3) == indices(4, 3) == list(range(16, 24))


@pytest.mark.slow
@pytest.mark.parametrize("wrap", ["fsdp2", "ddp"])
def test_state_saved_at_two_ranks_loads_at_two_and_at_one(tmp_path: Path, wrap: str) -> None:
    def torchrun(world: int, mode: str) -> dict:
        out = tmp_path / f"{mode}-{world}.json"
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={world}", str(SCRIPT), wrap, mode, str(tmp_path / "ckpt"), str(out)],
                              capture_output=True, text=True, timeout=240,
                              env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
        assert done.returncode == 0, (mode, world, done.stdout[-3000:], done.stderr[-6000:])
        return json.loads(out.read_text())

    saved = torchrun(2, "save")
    assert torchrun(2, "load") == saved
    assert torchrun(1, "load") == saved

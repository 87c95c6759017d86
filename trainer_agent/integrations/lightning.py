"""Lightning under Omni: one callback, a batch sampler and two helpers.

``trainer_kwargs(job)`` gives ``lightning.Trainer`` the job's layout (devices and nodes as
torchrun started them, accumulation that keeps the global batch, steps); ``OmniCallback(job)``
reports every optimizer step, saves a checkpoint every ``checkpoint_every`` steps and, when the
ranks agree to stop, saves one and ends ``fit``; ``resume_checkpoint(job)`` is the ``ckpt_path``
to resume from; ``StepBatchSampler`` feeds each step the job's own samples, so a resume (which
Lightning starts at the top of a fresh dataloader) continues the sample order exactly.
Lightning owns ``torch.distributed`` here: the script calls ``omni.init(process_group=False)``.
docs/integrations.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from trainer_agent.integrations import forget_recomputed_steps, noted_checkpoint, step_extra
from trainer_agent.runtime.dcp import capture_rng_state, restore_rng_state
from trainer_agent.runtime.job import Job
from trainer_agent.runtime.steps import optimizer_steps

CHECKPOINT_PATTERN = re.compile(r"^lightning-step-(\d+)\.ckpt$")
RNG_KEY = "omni_rng_states"  # every rank's random streams, by rank, in the checkpoint


def checkpoint_path(job: Job, step: int) -> Path:
    """Where the callback saves the checkpoint of ``step``."""
    return job.spec.checkpoint_dir / f"lightning-step-{step:08d}.ckpt"


def saved_checkpoints(job: Job) -> list[tuple[int, Path]]:
    """(step, path) of this job's Lightning checkpoints, oldest first."""
    directory = job.spec.checkpoint_dir
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), entry) for entry in directory.iterdir() if (m := CHECKPOINT_PATTERN.match(entry.name))]
    return sorted(found)


def resume_checkpoint(job: Job) -> str | None:
    """The ``ckpt_path`` to resume from: the one ``omni-latest.json`` names, else the newest
    ``lightning-step-N.ckpt``, else ``None`` (a fresh start)."""
    noted = noted_checkpoint(job.spec.checkpoint_dir)
    if noted:
        return noted
    saved = saved_checkpoints(job)
    return str(saved[-1][1]) if saved else None


def trainer_kwargs(job: Job, **overrides: Any) -> dict[str, Any]:
    """``lightning.Trainer`` keywords for this job's layout; ``overrides`` win.

    Devices and nodes are what torchrun started (Lightning then joins torchrun's world instead of
    launching its own processes); checkpoints are the callback's, so Lightning's own are off."""
    s = job.spec
    local = int(os.environ.get("LOCAL_WORLD_SIZE", s.world_size))
    on_gpu = s.device != "cpu" and torch.cuda.is_available()
    kwargs: dict[str, Any] = {
        "accelerator": "gpu" if on_gpu else "cpu",
        "devices": local,
        "num_nodes": max(1, s.world_size // local),
        "strategy": "ddp" if s.world_size > 1 else "auto",
        "max_steps": s.total_steps,
        "accumulate_grad_batches": s.accum,
        "use_distributed_sampler": False,  # StepBatchSampler already gives each replica its share
        "enable_checkpointing": False,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    kwargs.update(overrides)
    return kwargs


def _plain_rng_state(state: dict[str, Any]) -> dict[str, Any]:
    """The RNG state in types ``torch.load(weights_only=True)`` accepts (NumPy's array as a list)."""
    name, keys, pos, has_gauss, cached = state["numpy"]
    return {**state, "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def _numpy_rng_state(state: dict[str, Any]) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = state["numpy"]
    return {**state, "numpy": (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)}


class StepBatchSampler(Sampler[list[int]]):
    """This replica's micro-batches, step by step from ``first_step`` to the last
    (``job.sample_indices``): step ``n`` holds global samples ``[(n-1) x G, n x G)`` whatever the DP.

    Its length is the whole run's, so Lightning's restored batch count stays in step with it;
    build it in ``train_dataloader()`` with ``first_step = trainer.global_step + 1`` (the restored
    step), since Lightning does not skip the batches a resumed epoch already consumed."""

    def __init__(self, job: Job, first_step: int = 1) -> None:
        self.job = job
        self.first_step = first_step

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.first_step, self.job.spec.total_steps + 1):
            yield from self.job.sample_indices(step)

    def __len__(self) -> int:
        return self.job.spec.total_steps * self.job.spec.accum


class OmniCallback(pl.Callback):
    """Reports each optimizer step (loss, timing) and obeys Omni's stop requests.

    A step opens at its first micro-batch and is agreed by every rank once the optimizer stepped
    (``trainer.global_step`` moved). Then: stop agreed -> save, announce it
    (``job.note_checkpoint``), ``trainer.should_stop``; else save every ``checkpoint_every`` steps
    and at the end. ``on_fit_end`` writes exit.json.
    """

    def __init__(self, job: Job) -> None:
        self.job = job
        self._open_step: int | None = None
        self._compute: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning's SIGTERM handler (installed by fit) raises out of the loop on every rank and
        # broadcasts from inside the handler; Omni's only sets a flag, and the ranks agree on the
        # stop at the end of the step. Put Omni's back.
        self.job.runtime.install_signal_handlers()
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            self.job.runtime.device = pl_module.device  # NCCL gathers only device tensors
        forget_recomputed_steps(self.job, trainer.global_step)  # fit has restored its checkpoint

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._open_step is None:
            self._open_step = trainer.global_step + 1
            self.job.runtime.begin_step(self._open_step)
        self._compute = self.job.runtime.compute()
        self._compute.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._compute is not None:
            self._compute.__exit__(None, None, None)
            self._compute = None
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            # Lightning hands back the micro-batch loss divided by the accumulation: weighting each
            # by 1/accum makes the step loss the mean over every micro-batch of every rank.
            self.job.runtime.add_loss(float(loss), 1.0 / trainer.accumulate_grad_batches)
        if trainer.global_step != self._open_step:
            return  # accumulating: the optimizer has not stepped yet
        step, self._open_step = self._open_step, None
        # The optimizer's own step count, checked for continuity after a resume (docs/rhythm.md).
        self.job.runtime.note(opt_step=optimizer_steps(trainer.optimizers[0]) if trainer.optimizers else None)
        self.job.runtime.end_step(step_extra(self.job))
        if self.job.should_stop():
            self._save(trainer, step)
            trainer.should_stop = True
        elif step % self.job.spec.checkpoint_every == 0 or step >= self.job.spec.total_steps:
            self._save(trainer, step)

    def _save(self, trainer: pl.Trainer, step: int) -> None:
        """Save on every rank (Lightning's save is collective; rank 0 writes), then announce."""
        final = checkpoint_path(self.job, step)
        staging = final.with_name(f".{final.name}.tmp")
        trainer.save_checkpoint(staging)  # ends with a barrier: the file is complete
        if self.job.is_leader:
            os.replace(staging, final)
            for _, old in saved_checkpoints(self.job)[:-self.job.spec.keep_checkpoints]:
                old.unlink(missing_ok=True)
        trainer.strategy.barrier("omni-checkpoint")
        self.job.note_checkpoint(step, final)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        # Lightning keeps no random state, and rank 0 alone writes: gather every rank's, so that
        # dropout after a resume draws what it would have drawn (bitwise equal losses).
        state = _plain_rng_state(capture_rng_state())
        if dist.is_available() and dist.is_initialized():
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, state)
        else:
            states = [state]
        checkpoint[RNG_KEY] = states

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get(RNG_KEY) or []
        if len(states) == self.job.spec.world_size:  # another world (a resize) draws afresh
            restore_rng_state(_numpy_rng_state(states[self.job.spec.rank]))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.job.finish(trainer.global_step)

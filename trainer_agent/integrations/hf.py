"""The Hugging Face ``Trainer`` under Omni: one callback and two helpers.

``training_args_kwargs(job)`` gives ``TrainingArguments`` the job's layout (micro-batch,
accumulation that keeps the global batch, steps, checkpoint directory and period);
``OmniCallback(job)`` reports every optimizer step to Omni and turns a stop request into "save
a ``checkpoint-N`` and stop"; ``resume_checkpoint(job)`` is what ``trainer.train`` resumes from.
The Trainer owns ``torch.distributed`` here, so the script calls
``omni.init(process_group=False)``. docs/integrations.md.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from trainer_agent.integrations import forget_recomputed_steps, noted_checkpoint, step_extra
from trainer_agent.runtime.job import Job
from trainer_agent.runtime.steps import optimizer_steps


def training_args_kwargs(job: Job, **overrides: Any) -> dict[str, Any]:
    """``TrainingArguments`` keywords for this job's layout; ``overrides`` win.

    ``gradient_accumulation_steps`` is ``global_batch / (micro_batch x dp)``, so a relaunch at
    another DP keeps the global batch. Every step is logged: the callback takes the step's loss
    from the Trainer's own log."""
    s = job.spec
    kwargs: dict[str, Any] = {
        "output_dir": str(s.checkpoint_dir),
        "per_device_train_batch_size": s.micro_batch,
        "gradient_accumulation_steps": s.accum,
        "max_steps": s.total_steps,
        "save_strategy": "steps",
        "save_steps": s.checkpoint_every,
        "save_total_limit": s.keep_checkpoints,
        "logging_strategy": "steps",
        "logging_steps": 1,
        "include_num_input_tokens_seen": "all",
        "report_to": "none",
        "disable_tqdm": True,
        # The Trainer runs DDP on the CPU only when told so (else: one process each, unaware).
        "use_cpu": s.device == "cpu" or not torch.cuda.is_available(),
    }
    kwargs.update(overrides)
    return kwargs


def resume_checkpoint(job: Job) -> str | None:
    """The checkpoint to resume from: the one ``omni-latest.json`` names (a save that finished),
    else the newest ``checkpoint-N``, else ``None`` (a fresh start)."""
    directory = job.spec.checkpoint_dir
    if not directory.is_dir():
        return None
    return noted_checkpoint(directory) or get_last_checkpoint(str(directory))


class OmniCallback(TrainerCallback):
    """Reports each optimizer step (loss, tokens, timing) and obeys Omni's stop requests.

    A step opens at ``on_step_begin`` and is agreed by every rank in ``on_log``, right after the
    Trainer has averaged the step's loss over the ranks (the callback asks for a log every step).
    When the ranks agree to stop, the Trainer saves ``checkpoint-N`` and leaves its loop; each save
    is announced to the node agent (``job.note_checkpoint``) and ``on_train_end`` writes exit.json.
    """

    def __init__(self, job: Job) -> None:
        self.job = job
        self._open_step: int | None = None
        self._tokens_seen = 0
        self._compute: Any = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            self.job.runtime.device = args.device  # NCCL gathers only device tensors
        self._tokens_seen = state.num_input_tokens_seen
        forget_recomputed_steps(self.job, state.global_step)  # the Trainer has loaded its checkpoint

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        if self._open_step is not None:
            self._end_step(control)  # the previous step was never logged
        self._open_step = state.global_step + 1
        self.job.runtime.begin_step(self._open_step)
        self._compute = self.job.runtime.compute()  # forward, backward and optimizer, until on_step_end
        self._compute.__enter__()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self._compute is not None:
            self._compute.__exit__(None, None, None)
            self._compute = None
        # The optimizer's own step count, checked for continuity after a resume (docs/rhythm.md).
        self.job.runtime.note(opt_step=optimizer_steps(kwargs.get("optimizer")))
        control.should_log = True  # the log that follows carries the step's loss, on every rank

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if self._open_step is None or not logs or "loss" not in logs or state.global_step != self._open_step:
            return
        if self.job.is_leader:
            # The logged loss is already the mean over every rank: counted once, on rank 0.
            self.job.runtime.add_loss(float(logs["loss"]), 1.0)
            self.job.runtime.count_tokens(text=state.num_input_tokens_seen - self._tokens_seen)
        self._tokens_seen = state.num_input_tokens_seen
        self._end_step(control)

    def _end_step(self, control: TrainerControl) -> None:
        if self._compute is not None:
            self._compute.__exit__(None, None, None)
            self._compute = None
        self.job.runtime.end_step(step_extra(self.job))
        self._open_step = None
        if self.job.should_stop():
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank's part (its RNG state) is on disk before the agent is told
        self.job.note_checkpoint(state.global_step, path)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self._open_step is not None:
            self._end_step(control)
        self.job.finish(state.global_step)

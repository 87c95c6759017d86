"""A tiny GPT-2 trained with the Hugging Face Trainer, under Omni or plain torchrun.

The model is built from a ``GPT2Config`` (no download); the data is synthetic and deterministic
(sample ``i`` is an arithmetic token sequence drawn from a generator seeded with ``i``). Omni's
callback reports every step, saves ``checkpoint-N`` and stops when asked, and the next launch
resumes from it (examples/hf_trainer/README.md, docs/integrations.md).

    torchrun --nproc-per-node 2 examples/hf_trainer/train.py
"""

from __future__ import annotations

import trainer_agent.runtime as omni  # first: a SIGTERM during the imports below is a stop request

# isort: split
import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

from trainer_agent.integrations.hf import OmniCallback, resume_checkpoint, training_args_kwargs  # noqa: E402

SEQ_LEN = 32
VOCAB = 96


class ArithmeticTokens(Dataset):
    """Sample ``i``: ``(start + k * stride) % VOCAB`` for ``k < SEQ_LEN``, seeded by ``i``."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        start, stride = torch.randint(0, VOCAB, (2,), generator=generator).tolist()
        tokens = (start + torch.arange(SEQ_LEN) * (stride % 7 + 1)) % VOCAB
        return {"input_ids": tokens, "labels": tokens.clone()}


class Pace(TrainerCallback):
    """Sleeps ``step_s`` after each step: stands for a model big enough to watch it train."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def on_step_end(self, args, state, control, **kwargs) -> None:
        time.sleep(self.step_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/hf-trainer", help="outside Omni: where metrics and checkpoints go")
    parser.add_argument("--step-s", type=float, default=0.0, help="extra seconds per step")
    args = parser.parse_args()
    job = omni.init(global_batch=16, micro_batch=4, total_steps=30, checkpoint_every=10, run_dir=args.run_dir,
                    process_group=False)

    set_seed(0)
    # No dropout: its masks follow each rank's random stream, so after a resize (other ranks,
    # other streams) they would differ; without it a resize matches to float rounding.
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(**training_args_kwargs(
        job, learning_rate=3e-3, warmup_steps=2, seed=0, data_seed=0, dataloader_drop_last=True))
    trainer = Trainer(model=model, args=training_args, train_dataset=ArithmeticTokens(job.total_steps * job.global_batch),
                      callbacks=[OmniCallback(job), Pace(args.step_s)])
    start = resume_checkpoint(job)
    if start and job.is_leader:
        print(f"resuming from {start}", flush=True)
    trainer.train(resume_from_checkpoint=start)
    if job.is_leader:
        print(f"finished at step {trainer.state.global_step}: {job.stop_reason or 'completed'}", flush=True)


if __name__ == "__main__":
    main()

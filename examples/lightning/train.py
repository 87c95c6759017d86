"""A small Lightning model trained under Omni or plain torchrun.

A two-layer MLP learns to classify synthetic points (sample ``i`` drawn from a generator seeded
with ``i``, its class a fixed function of the point). Omni's callback reports every step, saves
a checkpoint every ``checkpoint_every`` steps and when asked to stop, and the next launch
resumes from it (examples/lightning/README.md, docs/integrations.md).

    torchrun --nproc-per-node 2 examples/lightning/train.py
"""

from __future__ import annotations

import trainer_agent.runtime as omni  # first: a SIGTERM during the imports below is a stop request

# isort: split
import argparse  # noqa: E402
import time  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from trainer_agent.integrations.lightning import (  # noqa: E402
    OmniCallback,
    StepBatchSampler,
    resume_checkpoint,
    trainer_kwargs,
)

FEATURES = 16
CLASSES = 4


class SyntheticPoints(Dataset):
    """Sample ``i``: a point seeded by ``i``; its class is the argmax of a fixed projection."""

    def __init__(self) -> None:
        self.weights = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return 1 << 30  # indexed by the sampler's global sample numbers

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        point = torch.randn(FEATURES, generator=torch.Generator().manual_seed(index))
        return point, (point @ self.weights).argmax()


class Classifier(pl.LightningModule):
    def __init__(self, job: omni.Job) -> None:
        super().__init__()
        self.job = job
        self.net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, CLASSES))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        points, labels = batch
        return nn.functional.cross_entropy(self.net(points), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader:
        # Built after Lightning restored a checkpoint: start at the step after the restored one.
        sampler = StepBatchSampler(self.job, first_step=self.trainer.global_step + 1)
        # Its own generator: a new iterator would otherwise draw its seed from the global stream,
        # one draw the resumed run makes after restoring that stream and the straight run does not.
        return DataLoader(SyntheticPoints(), batch_sampler=sampler, generator=torch.Generator().manual_seed(0))


class Pace(pl.Callback):
    """Sleeps ``step_s`` after each micro-batch's step: stands for a model big enough to watch."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(self.step_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/lightning", help="outside Omni: where metrics and checkpoints go")
    parser.add_argument("--step-s", type=float, default=0.0, help="extra seconds per micro-batch")
    args = parser.parse_args()
    job = omni.init(global_batch=16, micro_batch=4, total_steps=30, checkpoint_every=10, run_dir=args.run_dir,
                    process_group=False)

    pl.seed_everything(0, workers=True, verbose=False)
    model = Classifier(job)
    trainer = pl.Trainer(**trainer_kwargs(job, deterministic=True), callbacks=[OmniCallback(job), Pace(args.step_s)])
    start = resume_checkpoint(job)
    if start and job.is_leader:
        print(f"resuming from {start}", flush=True)
    trainer.fit(model, ckpt_path=start)
    if job.is_leader:
        print(f"finished at step {trainer.global_step}: {job.stop_reason or 'completed'}", flush=True)


if __name__ == "__main__":
    main()

"""A plain PyTorch DDP training loop on Omni's library: the ``omni`` integration.

Run it by hand (the defaults below stand in for the job's environment)::

    torchrun --nproc-per-node 2 examples/ddp_library/train.py --run-dir /tmp/ddp-library

or under Omni: ``omni submit examples/ddp_library/job.toml``. It reports every step (time split
into data wait, compute and communication; loss; samples), checkpoints through
torch.distributed.checkpoint every ``checkpoint_every`` steps and when asked to stop (all ranks
agree on the step), and resumes from the newest checkpoint. Step ``n`` always trains on samples
``[(n-1)G, nG)`` of a fixed synthetic stream, split by ``job.sample_indices``, and the gradient
sum is in a fixed rank order (``exact_ddp``), so a preempted and resumed run ends with exactly
the weights of an uninterrupted one at the same DP; at another DP (a resize), with the same
global batch and the same samples in the same order.
"""

import trainer_agent.runtime as omni  # first: a SIGTERM during `import torch` becomes a stop request

# isort: split
import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from contextlib import nullcontext  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from trainer_agent.runtime.ddp import exact_ddp  # noqa: E402

FEATURES = 16


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``index`` of the synthetic stream: the same tensor whoever draws it, whenever."""
    g = torch.Generator().manual_seed(index)
    x = torch.randn(FEATURES, generator=g)
    y = (x * torch.linspace(-1.0, 1.0, FEATURES)).sum(0, keepdim=True).tanh() + 0.05 * torch.randn(1, generator=g)
    return x, y


def micro_batch(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(sample(i) for i in indices), strict=True)
    return torch.stack(xs), torch.stack(ys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/ddp-library", help="outside Omni: where checkpoints and metrics go")
    parser.add_argument("--step-s", type=float, default=0.0, help="sleep per step (to watch it live)")
    parser.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    args = parser.parse_args()

    job = omni.init(global_batch=32, micro_batch=4, total_steps=60, checkpoint_every=20, run_dir=args.run_dir)
    device = job.torch_device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=job.total_steps)
    checkpointer = job.checkpointer(async_save=args.async_save)
    resumed = checkpointer.load(model=model, optimizer=optimizer, scheduler=scheduler)
    start = resumed.step if resumed else 0
    ddp = exact_ddp(model, job.runtime) if job.world_size > 1 else model

    step = start
    for step in range(start + 1, job.total_steps + 1):
        with job.step(step, lr=scheduler.get_last_lr()[0]) as s:
            with s.data_wait():
                batches = [micro_batch(indices) for indices in job.sample_indices(step)]
            with s.compute():
                optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for i, (x, y) in enumerate(batches):
                    sync = ddp.no_sync() if hasattr(ddp, "no_sync") and i < len(batches) - 1 else nullcontext()
                    with sync:
                        loss = (ddp(x.to(device)) - y.to(device)).pow(2).sum()
                        (loss / job.global_batch).backward()  # exact_ddp sums: the global mean gradient
                    loss_sum += loss.item()
                with job.calibrated(optimizer, step):  # after a resize: a short lr ramp (off otherwise)
                    optimizer.step()
                scheduler.step()
            s.add_loss(loss_sum, job.global_batch // job.dp)  # the step's loss: mean squared error per sample
            # For the control plane's check after a resize or resume: the counts went on.
            s.note(opt_step=omni.optimizer_steps(optimizer), data_pos=step * job.global_batch)
            s.count_tokens(text=job.global_batch // job.dp)
        if job.should_checkpoint(step):
            checkpointer.save(step, model=model, optimizer=optimizer, scheduler=scheduler, batch=job.batch,
                              data={"next_sample_index": step * job.global_batch})
        if job.should_stop():
            if job.is_leader:
                print(f"{job.stop_reason}: checkpoint at step {step}", flush=True)
            break
        time.sleep(args.step_s)

    outcome = job.finish(step, checkpointer)
    if job.is_leader and outcome["outcome"] == "completed":
        weights = [round(v, 8) for p in model.parameters() for v in p.detach().flatten().tolist()[:4]]
        (job.run_dir / "result.json").write_text(json.dumps({"step": step, "weights_head": weights}))
        print(f"completed at step {step}", flush=True)


if __name__ == "__main__":
    main()

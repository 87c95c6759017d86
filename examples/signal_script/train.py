"""A plain PyTorch DDP training script with no Omni import: Omni's ``signal`` integration.

Run it anywhere torchrun runs it::

    torchrun --nproc-per-node 2 examples/signal_script/train.py --steps 40

Under Omni (``"integration": "signal"``) the node agents start it with torchrun on every node the
job holds and preempt it with SIGTERM; it then finishes the step it is in, saves a checkpoint in
``$OMNI_CHECKPOINT_DIR`` (rank 0, atomically) and exits 0 before the job's ``grace_s`` runs out.
The next launch resumes from that checkpoint. Everything is a pure function of the seed and the
step, so a run preempted and resumed ends with exactly the weights of an uninterrupted one (at
the same number of ranks).

Progress, optionally and still without an import: when ``$OMNI_METRICS_FILE`` is set, rank 0
appends one JSON line per step to it (``{"step": N, "step_s": S, "loss": L}``); the node agent
forwards them, and the job page shows the steps, the measured rhythm and an ETA from them.

Options for trying the failure paths: ``--fail-at-step N --fail-rank R`` raises on one rank;
``--ignore-sigterm`` keeps training through SIGTERM (the agent kills it after ``grace_s``).
"""

from __future__ import annotations

import signal
import sys

# Catch SIGTERM before anything slow (importing torch takes seconds): a preemption that arrives
# meanwhile must still end in a checkpoint, not in a rank killed by the signal's default action.
STOP = {"asked": False}


def on_sigterm(_signum: int, _frame: object) -> None:
    STOP["asked"] = True  # act at the end of the step: all ranks agree, rank 0 saves


signal.signal(signal.SIGTERM, on_sigterm)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402


def batch(step: int, global_batch: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step ``step``'s global batch (a pure function of the step)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(global_batch, 16, generator=g)
    y = (x @ torch.linspace(-1.0, 1.0, 16)).unsqueeze(1) + 0.1 * torch.randn(global_batch, 1, generator=g)
    per = global_batch // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def per_tensor_allreduce(_state, bucket):  # DDP checks these annotations: none here
    """Average each gradient on its own. DDP regroups its buckets after the first step, so a
    resumed run's first step would add the ranks' parts in another order than the uninterrupted
    run did; per tensor, the order never changes, and resumes are bitwise exact."""
    world = dist.get_world_size()
    grads = [g.clone() for g in bucket.gradients()]
    for grad in grads:
        dist.all_reduce(grad)
        grad.div_(world)
    future = torch.futures.Future()
    future.set_result(torch.cat([g.flatten() for g in grads]))
    return future


def save(path: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f".ckpt-{os.getpid()}.tmp"
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
    os.replace(tmp, path / "ckpt.pt")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=int(os.environ.get("OMNI_TOTAL_STEPS", "40")))
    parser.add_argument("--global-batch", type=int, default=int(os.environ.get("OMNI_GLOBAL_BATCH", "32")))
    parser.add_argument("--step-s", type=float, default=0.05, help="extra seconds per step (to watch it run)")
    parser.add_argument("--fail-at-step", type=int, default=None)
    parser.add_argument("--fail-rank", type=int, default=0)
    parser.add_argument("--ignore-sigterm", action="store_true")
    args = parser.parse_args()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        print(f"train.py: error: global batch {args.global_batch} does not split over {world} ranks", file=sys.stderr)
        return 2
    ckpt_dir = Path(os.environ.get("OMNI_CHECKPOINT_DIR", "checkpoints"))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))
    model.register_comm_hook(None, per_tensor_allreduce)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    start = 0
    if (ckpt_dir / "ckpt.pt").exists():
        state = torch.load(ckpt_dir / "ckpt.pt", weights_only=False)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        if rank == 0:
            print(f"resumed from step {start}", flush=True)

    # Optional progress for Omni: one JSON line per step (docs/workloads.md, "Progress").
    metrics_path = os.environ.get("OMNI_METRICS_FILE")
    metrics = open(metrics_path, "a", encoding="utf-8") if metrics_path and rank == 0 else None  # noqa: SIM115
    loss = torch.tensor(0.0)
    began = time.monotonic()
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, args.global_batch, rank, world)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if args.fail_at_step == step and rank == args.fail_rank:
            raise RuntimeError(f"deliberate failure at step {step} on rank {rank}")
        time.sleep(args.step_s)
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        if metrics is not None:
            now = time.monotonic()
            metrics.write(json.dumps({"step": step, "step_s": round(now - began, 4), "loss": loss.item()}) + "\n")
            metrics.flush()
            began = now
        stop = torch.tensor([1.0 if STOP["asked"] else 0.0])
        dist.all_reduce(stop)
        if stop.item() > 0 and step < args.steps:
            if rank == 0:
                save(ckpt_dir, step, model.module, optimizer)
                print(f"SIGTERM: checkpoint at step {step} saved; exiting", flush=True)
            dist.barrier()
            dist.destroy_process_group()
            return 0
    if rank == 0:
        save(ckpt_dir, args.steps, model.module, optimizer)
        weights = [p.detach().double().sum().item() for p in model.module.parameters()]
        result = {"step": args.steps, "loss": loss.item(), "weights": weights}
        (ckpt_dir / "result.json").write_text(json.dumps(result))
        print(f"done at step {args.steps}: loss {loss.item():.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown: the process group is destroyed and the work is
    # done, but on a loaded CPU machine gloo's threads can still abort the teardown ("terminate
    # called without an active exception", SIGABRT), which torchrun would report as a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

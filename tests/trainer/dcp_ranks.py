"""Run under torchrun by tests/trainer/test_dcp.py: ``dcp_ranks.py fsdp2|ddp save|load CKPT_DIR OUT``.

``save`` trains a small model 3 steps (FSDP2-sharded or DDP-replicated), checkpoints it through
the library and writes the full weights and the next step's loss to OUT; ``load`` builds the model
at this world size, resumes, and writes the same facts, which must be equal."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trainer_agent.runtime import Checkpointer


def main() -> None:
    wrap, mode, directory, out = sys.argv[1:5]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        trained = model
    else:
        trained = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(trained.parameters(), lr=1e-2)
    x = torch.linspace(-1, 1, 64).reshape(8, 8)

    def step() -> float:
        loss = trained(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    checkpointer = Checkpointer(directory)
    if mode == "save":
        for _ in range(3):
            step()
        checkpointer.save(3, model=trained, optimizer=optimizer)
    else:
        resumed = checkpointer.load(model=trained, optimizer=optimizer)
        assert resumed is not None and resumed.step == 3
    full = get_model_state_dict(trained, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    facts = {"weights": {k: v.flatten().tolist() for k, v in sorted(full.items())}, "next_loss": step()}
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(facts, fh)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: on a loaded machine gloo's threads can abort it
    # ("terminate called without an active exception", SIGABRT) after the work above is done,
    # which is not what this script tests.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

"""The reference workload as a torchrun entrypoint: ``-m trainer_agent.reference [train options]``.

Each rank (torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``...) builds the
reference trainer's configuration from the job's environment (``OMNI_RUN_DIR``,
``OMNI_TOTAL_STEPS``, ``OMNI_GLOBAL_BATCH``, ``OMNI_MICRO_BATCH``, ``OMNI_CHECKPOINT_EVERY``,
``OMNI_KEEP_CHECKPOINTS``, the post-resize ramp's ``OMNI_CALIBRATION_STEPS`` and
``OMNI_CALIBRATION_START``; DP is the world size), lets any ``trainer_agent.train`` option given
after the module override it (``--model small``, ``--seed 3``), and runs one
``trainer_agent.worker`` rank. It is the ``omni`` integration: cooperative checkpoint-and-stop
through ``control.json`` and SIGTERM, step records in ``metrics.jsonl``, resume at any DP from
the newest checkpoint. Every rank resolves the same configuration: the checkpoint it reads is on
shared storage and nothing writes it while the ranks start.
"""

from __future__ import annotations

import os
import sys

from trainer_agent import train


def build_argv(env: dict[str, str], extra: list[str]) -> list[str]:
    """``trainer_agent.train`` arguments from the job's environment, then the user's overrides."""

    def need(name: str) -> str:
        value = env.get(name)
        if not value:
            train.fail(f"{name} is not set; run this under the Omni node agent (or set it yourself)")
        return value

    argv = ["--run-dir", need("OMNI_RUN_DIR"), "--steps", need("OMNI_TOTAL_STEPS"), "--dp", need("WORLD_SIZE")]
    for option, name in (("--global-batch", "OMNI_GLOBAL_BATCH"), ("--micro-batch", "OMNI_MICRO_BATCH"),
                         ("--checkpoint-every", "OMNI_CHECKPOINT_EVERY"), ("--keep", "OMNI_KEEP_CHECKPOINTS"),
                         ("--calibration-steps", "OMNI_CALIBRATION_STEPS"),
                         ("--calibration-start-fraction", "OMNI_CALIBRATION_START")):
        if env.get(name):
            argv += [option, env[name]]
    return argv + extra


def main(argv: list[str] | None = None) -> None:
    args = train.build_parser().parse_args(build_argv(dict(os.environ), list(sys.argv[1:] if argv is None else argv)))
    device = args.device
    args.device = "cpu"  # the CUDA count check is per launcher; under torchrun each node sees its own GPUs
    config = train.resolve_config(args)
    import torch

    config["device"] = "cuda" if device == "cuda" or (torch.cuda.is_available() and os.environ.get("OMNI_DEVICE") != "cpu") else "cpu"
    from trainer_agent import worker

    worker.run(worker.WorkerConfig(**config), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":
    main()

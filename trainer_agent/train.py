"""Launcher of the reference multimodal trainer: ``python -m trainer_agent.train --run-dir DIR --steps N --dp D``.

Validates the batch configuration, starts D worker processes (``trainer_agent.worker``) wired
with torch.distributed, forwards SIGTERM / SIGUSR1 to them, and reports how the run ended.
Re-running the same command resumes from the newest complete checkpoint in the run dir, at any
``--dp`` that divides the (unchanged) global batch. A resize requested through the control file
is carried out here: the workers checkpoint and exit, and the launcher restarts them at the new
DP. Imports no torch until it must, so bad arguments fail in milliseconds. See docs/trainer.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from trainer_agent.checkpoint import CheckpointStore

DEFAULT_GLOBAL_BATCH = 16
DEFAULT_MICRO_BATCH = 2
DEFAULT_SEED = 0
EXIT_FILE = "exit.json"


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one clear line (what operators and agents parse)."""

    def error(self, message: str) -> NoReturn:
        """Exit 2 with ``train: error: MESSAGE`` instead of usage plus message."""
        fail(message, code=2)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``train: error: MESSAGE`` on stderr and exit non-zero."""
    print(f"train: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def build_parser() -> argparse.ArgumentParser:
    """The command-line contract (documented in docs/trainer.md)."""
    p = _OneLineParser(prog="python -m trainer_agent.train", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True, help="directory for checkpoints, metrics.jsonl, exit.json, control.json")
    p.add_argument("--steps", type=int, required=True, help="train until this step (1-based, inclusive)")
    p.add_argument("--dp", type=int, required=True, help="data-parallel replicas (worker processes)")
    p.add_argument("--seed", type=int, default=None, help=f"data and init seed (default {DEFAULT_SEED}, or the checkpoint's)")
    p.add_argument("--global-batch", type=int, default=None, help=f"samples per step (default {DEFAULT_GLOBAL_BATCH}, or the checkpoint's)")
    p.add_argument("--micro-batch", type=int, default=None, help=f"samples per forward pass (default {DEFAULT_MICRO_BATCH}, or the checkpoint's)")
    p.add_argument("--stop-at-step", type=int, default=None, help="act as if preempted after this step")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--checkpoint-every", type=int, default=10, help="save every N steps (and always on stop)")
    p.add_argument("--keep", type=int, default=3, help="complete checkpoints to keep")
    p.add_argument("--balance", action=argparse.BooleanOptionalAction, default=True, help="modality-aware sample assignment")
    p.add_argument("--async-save", action=argparse.BooleanOptionalAction, default=False, help="write periodic checkpoints in the background")
    p.add_argument("--calibration-steps", type=int, default=0, help="after a DP change, ramp lr up over N steps (0: off)")
    p.add_argument("--calibration-start-fraction", type=float, default=0.1, help="lr fraction the calibration ramp starts at")
    p.add_argument("--schedule-steps", type=int, default=None, help="length of the lr schedule (default --steps, or the checkpoint's)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None, help="autocast dtype; fp16 uses a loss scaler (default fp32, or the checkpoint's)")
    p.add_argument("--prefetch-steps", type=int, default=3, help="steps of batches prepared ahead")
    p.add_argument("--model", choices=("tiny", "small"), default=None, help="model preset (default tiny, or the checkpoint's)")
    p.add_argument("--max-dp", type=int, default=64, help="refuse a larger --dp")
    # Test knobs for the measured-rhythm tests and benchmarks (docs/rhythm.md).
    p.add_argument("--slow-on-node", default=None, help="ranks on this node (OMNI_NODE) compute --slow-factor x slower")
    p.add_argument("--slow-rank", type=int, default=None, help="this rank computes --slow-factor x slower")
    p.add_argument("--slow-factor", type=float, default=2.0, help="how much slower the slowed ranks compute")
    p.add_argument("--stall-every", type=int, default=0, help="every N steps the data loader stalls for --stall-s")
    p.add_argument("--stall-s", type=float, default=0.0, help="seconds of each data stall")
    return p


def resolve_config(args: argparse.Namespace) -> dict[str, Any]:
    """Merge arguments with the run dir's newest checkpoint and refuse inconsistent batch settings."""
    run_dir = Path(args.run_dir).resolve()
    if not run_dir.parent.is_dir():
        fail(f"run dir parent {run_dir.parent} does not exist")
    if run_dir.exists() and not run_dir.is_dir():
        fail(f"run dir {run_dir} is not a directory")
    if args.steps < 1:
        fail(f"--steps must be at least 1, got {args.steps}")
    if args.dp < 1:
        fail(f"--dp must be at least 1, got {args.dp}")
    manifest = CheckpointStore(run_dir / "checkpoints").newest_manifest() or {}
    saved_batch = manifest.get("batch", {})

    def pick(name: str, given: int | None, saved: int | None, default: int, must_match: bool) -> int:
        """The argument if given, else the checkpoint's value, else the default; refuse a forbidden change."""
        if given is not None and saved is not None and given != saved and must_match:
            fail(f"--{name.replace('_', '-')} {given} differs from the checkpoint's {saved}; keep it (only --dp and --micro-batch may change on resume)")
        return given if given is not None else saved if saved is not None else default

    global_batch = pick("global_batch", args.global_batch, saved_batch.get("global_batch"), DEFAULT_GLOBAL_BATCH, True)
    micro_batch = pick("micro_batch", args.micro_batch, saved_batch.get("micro_batch"), DEFAULT_MICRO_BATCH, False)
    seed = pick("seed", args.seed, manifest.get("seed"), DEFAULT_SEED, True)
    schedule_steps = pick("schedule_steps", args.schedule_steps, manifest.get("schedule_steps"), args.steps, True)
    saved_model = manifest.get("model")
    if args.model and saved_model and args.model != saved_model:
        fail(f"--model {args.model} differs from the checkpoint's {saved_model}")
    model = args.model or saved_model or "tiny"
    precision = args.precision or manifest.get("precision") or "fp32"
    if global_batch < 1 or micro_batch < 1:
        fail(f"global batch ({global_batch}) and micro-batch ({micro_batch}) must be positive")
    validate_dp(args.dp, global_batch, micro_batch, args.max_dp)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            fail("--device cuda but torch sees no CUDA device")
        if args.dp > torch.cuda.device_count():
            fail(f"--dp {args.dp} needs {args.dp} CUDA devices on this node, found {torch.cuda.device_count()}")
    return {
        "run_dir": str(run_dir), "steps": args.steps, "dp": args.dp, "seed": seed, "global_batch": global_batch,
        "micro_batch": micro_batch, "stop_at_step": args.stop_at_step, "device": args.device,
        "checkpoint_every": max(1, args.checkpoint_every), "keep": max(1, args.keep), "balance": args.balance,
        "async_save": args.async_save, "calibration_steps": max(0, args.calibration_steps),
        "calibration_start_fraction": args.calibration_start_fraction, "schedule_steps": schedule_steps,
        "base_lr": args.lr, "warmup_steps": args.warmup_steps, "precision": precision,
        "prefetch_steps": max(1, args.prefetch_steps), "model": model,
        "slow_on_node": args.slow_on_node, "slow_rank": args.slow_rank, "slow_factor": max(1.0, args.slow_factor),
        "stall_every": max(0, args.stall_every), "stall_s": max(0.0, args.stall_s),
    }


def validate_dp(dp: int, global_batch: int, micro_batch: int, max_dp: int) -> None:
    """Refuse a DP the global batch cannot be split over (accumulation must be a whole number)."""
    replicas_allowed = global_batch // micro_batch
    if dp > max_dp or dp > replicas_allowed:
        fail(
            f"--dp {dp} is larger than allowed: global batch {global_batch} / micro-batch {micro_batch} "
            f"allows at most {min(replicas_allowed, max_dp)} replicas"
        )
    if global_batch % (micro_batch * dp) != 0:
        fail(
            f"global batch {global_batch} is not divisible by micro-batch {micro_batch} x dp {dp} = {micro_batch * dp}; "
            "gradient accumulation must be a whole number"
        )


def free_port() -> int:
    """A TCP port nobody listens on right now (for single-process rendezvous, e.g. the benchmark)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WorkerGroup:
    """The D worker processes of one launch, and the signals forwarded to them."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.procs: list[subprocess.Popen[bytes]] = []
        self.signals_forwarded = 0
        self.rendezvous: Path | None = None

    def start(self) -> None:
        """Start one process per rank with the torch.distributed environment."""
        # Rendezvous through a fresh file in the run dir rather than a TCP port: on a node shared
        # with other jobs a port found free can be taken before rank 0 binds it.
        self.rendezvous = Path(self.config["run_dir"]) / f".rendezvous-{os.getpid()}-{time.time_ns()}"
        for rank in range(self.config["dp"]):
            env = dict(os.environ)
            env.update(
                OMNI_TRAINER_CONFIG=json.dumps(self.config), RANK=str(rank), LOCAL_RANK=str(rank),
                WORLD_SIZE=str(self.config["dp"]), OMNI_TRAINER_RENDEZVOUS=f"file://{self.rendezvous}",
                CUBLAS_WORKSPACE_CONFIG=":4096:8", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
                # Spinning OpenMP threads starve the peer ranks (and anyone else) on a shared node:
                # a 2-thread rank spun 5x the CPU of a passive one when the cores were oversubscribed.
                OMP_WAIT_POLICY=env.get("OMP_WAIT_POLICY", "PASSIVE"),
            )
            self.procs.append(subprocess.Popen([sys.executable, "-m", "trainer_agent.worker"], env=env))

    def forward(self, signum: int, _frame: object) -> None:
        """Pass a preemption signal on to every live worker (they finish the step and save)."""
        self.signals_forwarded += 1
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def wait(self) -> int:
        """Wait for all workers; if one fails, stop the rest. Return the first failing code or 0."""
        failed = 0
        while True:
            codes = [proc.poll() for proc in self.procs]
            bad = [c for c in codes if c not in (None, 0)]
            if bad and not failed:
                failed = bad[0]
                for proc in self.procs:
                    if proc.poll() is None:
                        proc.terminate()
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                    time.sleep(0.1)
                for proc in self.procs:
                    if proc.poll() is None:
                        proc.kill()
            if all(c is not None for c in (proc.poll() for proc in self.procs)):
                if self.rendezvous is not None:
                    self.rendezvous.unlink(missing_ok=True)
                return failed
            time.sleep(0.05)


def launch(config: dict[str, Any]) -> int:
    """Run workers (again at a new DP after a requested resize); print the outcome; return the exit code."""
    run_dir = Path(config["run_dir"])
    run_dir.mkdir(exist_ok=True)
    for stale in run_dir.glob(".rendezvous-*"):  # left by a launch that was killed
        stale.unlink(missing_ok=True)
    while True:
        exit_file = run_dir / EXIT_FILE
        exit_file.unlink(missing_ok=True)
        group = WorkerGroup(config)
        previous = {s: signal.signal(s, group.forward) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
        try:
            group.start()
            code = group.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if code != 0:
            print(f"train: error: a worker exited with code {code}; the newest complete checkpoint is intact, re-run to resume", file=sys.stderr, flush=True)
            return 1
        try:
            outcome = json.loads(exit_file.read_text())
        except (OSError, ValueError):
            print("train: error: workers exited without reporting an outcome", file=sys.stderr, flush=True)
            return 1
        step, where = outcome.get("step"), outcome.get("checkpoint", "no new checkpoint")
        if outcome["outcome"] == "resize" and outcome.get("requested_dp"):
            new_dp = int(outcome["requested_dp"])
            validate_dp(new_dp, config["global_batch"], config["micro_batch"], 1 << 30)
            print(f"resizing at step {step}: dp {config['dp']} -> {new_dp} (checkpoint {where})", flush=True)
            config = dict(config, dp=new_dp)
            continue
        if outcome["outcome"] == "preempted":
            print(f"preempted at step {step} ({outcome.get('reason')}); checkpoint {where} saved; re-run the same command to resume", flush=True)
        elif "checkpoint" in outcome:
            print(f"completed at step {step} (checkpoint {where})", flush=True)
        else:
            print(f"completed at step {step} (the newest checkpoint already reached --steps; nothing to train)", flush=True)
        return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    args = build_parser().parse_args(argv)
    return launch(resolve_config(args))


if __name__ == "__main__":
    sys.exit(main())

"""Integration library benchmark: ``python -m bench.sdk --json [--steps N] [--model small]``.

Starts 2 ranks with torchrun (gloo on CPU, or NCCL with ``--device cuda`` and 2 GPUs) training the
reference model in DDP, and prints one JSON object with
- ``overhead``: step time of a bare DDP loop vs the same loop on the library (``omni.init``,
  ``job.step`` with its timers, the per-step agreement across ranks, the step record written to
  metrics.jsonl, the stop and checkpoint checks), pairs of steps on the same batch with the order
  alternating pair by pair so drift cancels: medians, their ratio, and the median paired overhead;
- ``checkpoint``: how long a DCP save blocks training, synchronous vs asynchronous
  (``Checkpointer(async_save=True)``), and the asynchronous save's total time; medians.
The baseline of each figure (the bare loop, the synchronous save) is measured in the same run.
The overhead is a fixed cost per step (the hooks, and one small all-gather for the agreement),
so its share shrinks as steps grow; the figures give it in milliseconds too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import trainer_agent.runtime as omni
    from bench.trainer import _worker_config
    from trainer_agent.worker import build_step_batch, compute_step, report_tokens
    from trainer_agent.workload import MODEL_PRESETS, MultimodalLM

    work = Path(args.work_dir)
    job = omni.init(global_batch=16, micro_batch=2, total_steps=10**6, checkpoint_every=10**6, run_dir=work / "run")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // job.world_size))
    device = job.torch_device()
    config = _worker_config(args.model, dp=job.world_size)
    torch.manual_seed(0)
    net = MultimodalLM(MODEL_PRESETS[args.model]).to(device)
    ddp = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    batches = [build_step_batch(config, MODEL_PRESETS[args.model], job.rank, step) for step in range(1, 9)]

    def bare(step: int) -> None:
        compute_step(ddp, optimizer, batches[step % len(batches)], device, None)

    def library(step: int) -> None:
        with job.step(step) as s:
            with s.data_wait():
                batch = batches[step % len(batches)]
            with s.compute():
                loss = compute_step(ddp, optimizer, batch, device, None)
            report_tokens(s, batch, job.rank, loss)
        job.should_stop()
        job.should_checkpoint(step)

    library_steps = 0
    seconds: dict[str, list[float]] = {"bare": [], "library": []}
    paired: list[float] = []
    for pair in range(args.steps + 2):
        elapsed = {}
        for name in ("library", "bare") if pair % 2 == 0 else ("bare", "library"):
            torch.distributed.barrier()
            started = time.perf_counter()
            (library if name == "library" else bare)(2 * pair + (name == "library") + 1)
            library_steps += name == "library"
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed[name] = time.perf_counter() - started
        if pair >= 2:  # warm-up
            for name, value in elapsed.items():
                seconds[name].append(value)
            paired.append(elapsed["library"] - elapsed["bare"])
    with_, without = statistics.median(seconds["library"]), statistics.median(seconds["bare"])

    sync, asynchronous = job.checkpointer(), job.checkpointer(async_save=True)
    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    async_total: list[float] = []
    for i in range(args.saves):
        compute_step(ddp, optimizer, batches[i % len(batches)], device, None)
        blocked["sync"].append(sync.save(2 * i + 1, model=net, optimizer=optimizer, batch=job.batch).blocked_s)
        compute_step(ddp, optimizer, batches[i % len(batches)], device, None)
        started = time.perf_counter()
        blocked["async"].append(asynchronous.save(2 * i + 2, model=net, optimizer=optimizer, batch=job.batch).blocked_s)
        asynchronous.wait()
        async_total.append(time.perf_counter() - started)
    asynchronous.close()
    state_bytes = sum(f.stat().st_size for f in sync.store.path(2 * args.saves).iterdir())
    report = {
        "overhead": {
            "model": args.model, "ranks": job.world_size, "steps_each": len(seconds["bare"]),
            "step_s_median_library": with_, "step_s_median_bare": without, "ratio_library_over_bare": with_ / without,
            "paired_overhead_fraction_median": statistics.median(paired) / without,
            # Where the library's time goes, per step: its own hooks (timers, record, sink, control
            # poll) and the end-of-step agreement across ranks (one all-gather of 12 floats).
            "hooks_ms_per_step": 1000 * job.runtime.hook_s / library_steps,
            "agreement_ms_per_step": 1000 * job.runtime.agree_s / library_steps,
        },
        "checkpoint": {
            "model": args.model, "ranks": job.world_size, "saves_each": args.saves, "state_bytes": state_bytes,
            "parameters": sum(p.numel() for p in net.parameters()),
            "sync_blocked_s_median": statistics.median(blocked["sync"]),
            "async_blocked_s_median": statistics.median(blocked["async"]),
            "async_total_s_median": statistics.median(async_total),
            "ratio_async_over_sync_blocked": statistics.median(blocked["async"]) / statistics.median(blocked["sync"]),
        },
        "device": str(device),
    }
    if job.is_leader:
        Path(args.out).write_text(json.dumps(report), encoding="utf-8")
    job.finish(0)
    torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (2 ranks under torchrun) and print the figures."""
    parser = argparse.ArgumentParser(prog="python -m bench.sdk", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (the only output format)")
    parser.add_argument("--steps", type=int, default=30, help="step pairs (after 2 warm-up pairs)")
    parser.add_argument("--saves", type=int, default=5, help="saves of each kind")
    parser.add_argument("--model", choices=("tiny", "small"), default="small")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="omni-bench-sdk-") as tmp:
        out = Path(tmp) / "report.json"
        env = {**os.environ, "OMNI_DEVICE": args.device, "OMP_WAIT_POLICY": "PASSIVE"}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "bench.sdk",
                   "--worker", "--out", str(out), "--work-dir", tmp, "--steps", str(args.steps), "--saves", str(args.saves),
                   "--model", args.model]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        if result.returncode != 0 or not out.exists():
            print(f"bench.sdk: the ranks failed (exit {result.returncode}):\n{result.stderr[-4000:]}", file=sys.stderr)
            return 1
        report: dict[str, Any] = json.loads(out.read_text())
    import torch

    report.update(torch=torch.__version__, cpus=os.cpu_count(), bench_s=time.perf_counter() - started)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Trainer runtime benchmark: ``python -m bench.trainer --json [--device cuda]``.

Prints one JSON object with
- ``telemetry``: step time with the runtime's hooks on vs off, interleaved in the same run
  (medians and their ratio), and the hooks' own cost per step measured directly;
- ``imbalance``: per-step slowest/mean rank compute with the modality-aware plan vs the
  contiguous split, each virtual rank's share timed on this machine in turn (no CPU contention
  between ranks), plus the same figure from real worker processes on CPU;
- ``checkpoint``: save and load seconds, and how long an asynchronous save blocks training.
Targets (docs/trainer.md): telemetry overhead < 1% of step time, imbalance <= 1.10 with balancing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

# Before torch loads OpenMP: spinning threads make an oversubscribed machine 100x slower
# (the launcher sets the same for its workers).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from trainer_agent.balancing import plan_step  # noqa: E402
from trainer_agent.runtime import ControlFile, JsonlFileSink, TrainerRuntime  # noqa: E402
from trainer_agent.runtime.dcp import Checkpointer  # noqa: E402
from trainer_agent.runtime.ddp import exact_ddp  # noqa: E402
from trainer_agent.train import free_port  # noqa: E402
from trainer_agent.worker import (  # noqa: E402
    StepBatch,
    WorkerConfig,
    build_step_batch,
    compute_step,
    global_batch_specs,
    report_tokens,
)
from trainer_agent.workload import MODEL_PRESETS, MultimodalLM, collate, render_sample  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker_config(model: str, dp: int, balance: bool = True, global_batch: int = 16, micro_batch: int = 2) -> WorkerConfig:
    return WorkerConfig(
        run_dir="", steps=1000, dp=dp, seed=0, global_batch=global_batch, micro_batch=micro_batch, stop_at_step=None,
        device="cpu", checkpoint_every=1000, keep=1, balance=balance, async_save=False, calibration_steps=0,
        calibration_start_fraction=0.1, schedule_steps=1000, base_lr=3e-3, warmup_steps=5, precision="fp32",
        prefetch_steps=1, model=model,
    )


def bench_telemetry(model: str, steps: int, device: torch.device, work_dir: Path) -> dict[str, Any]:
    """Step time with telemetry on vs off, alternating on/off/off/on so drift cancels; single rank, DDP."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=120))
    try:
        config = _worker_config(model, dp=1)
        torch.manual_seed(0)
        net = MultimodalLM(MODEL_PRESETS[model]).to(device)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        runtime = TrainerRuntime(
            sink=JsonlFileSink(work_dir / "metrics.jsonl"), control=ControlFile(work_dir / "control.json"), device=device, handle_signals=False,
        )
        ddp = exact_ddp(net, runtime, device_ids=[device.index] if device.type == "cuda" else None)
        batches = [build_step_batch(config, MODEL_PRESETS[model], 0, step) for step in range(1, 9)]
        # Pairs of steps on the same batch, one with and one without telemetry, the order
        # alternating pair by pair, so batch size and drift cancel out.
        seconds: dict[bool, list[float]] = {True: [], False: []}
        paired_diff_s: list[float] = []
        for pair in range(steps + 2):
            batch = batches[pair % len(batches)]
            elapsed = {}
            for enabled in (True, False) if pair % 2 == 0 else (False, True):
                runtime.enabled = enabled
                started = time.perf_counter()
                _one_step(runtime, ddp, optimizer, batch, device, 2 * pair + int(enabled) + 1)
                elapsed[enabled] = time.perf_counter() - started
            if pair >= 2:  # warm-up
                seconds[True].append(elapsed[True])
                seconds[False].append(elapsed[False])
                paired_diff_s.append(elapsed[True] - elapsed[False])
        runtime.close()
        on, off = statistics.median(seconds[True]), statistics.median(seconds[False])
        hooks_s = _telemetry_cost_per_step(work_dir)
        return {
            "model": model, "steps_each": len(seconds[True]),
            "step_s_median_with": on, "step_s_median_without": off, "ratio_with_over_without": on / off,
            "paired_overhead_fraction_median": statistics.median(paired_diff_s) / off,
            "hooks_s_per_step": hooks_s, "hooks_fraction_of_step": hooks_s / off,
            "target": "< 0.01 of step time",
        }
    finally:
        dist.destroy_process_group()


def _one_step(runtime: TrainerRuntime, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: StepBatch, device: torch.device, step: int) -> None:
    runtime.begin_step(step)
    with runtime.data_wait():
        pass
    with runtime.compute():
        loss = compute_step(model, optimizer, batch, device, None)
    report_tokens(runtime, batch, 0, loss)
    runtime.end_step({"lr": 1e-3, "dp": 1, "accum": len(batch.micro_batches), "global_batch": 16})


def _telemetry_cost_per_step(work_dir: Path, iterations: int = 2000) -> float:
    """The runtime's per-step cost alone: every hook a real step calls, around no work at all."""
    runtime = TrainerRuntime(sink=JsonlFileSink(work_dir / "hooks.jsonl"), control=ControlFile(work_dir / "control.json"), handle_signals=False)
    started = time.perf_counter()
    for step in range(1, iterations + 1):
        runtime.begin_step(step)
        with runtime.data_wait():
            pass
        with runtime.compute():
            runtime.add_overlapped_comm_s(0.0)
        runtime.count_tokens(image=100, video=50, text=40, image_samples=6, video_samples=2)
        runtime.add_loss(10.0, 40)
        runtime.end_step({"lr": 1e-3, "dp": 1, "accum": 8, "global_batch": 16})
    runtime.close()
    return (time.perf_counter() - started) / iterations


def bench_imbalance(model: str, steps: int, dp: int, device: torch.device, repeats: int = 3) -> dict[str, Any]:
    """Time each virtual rank's share of a step in turn (best of ``repeats``), balanced vs contiguous plan."""
    model_config = MODEL_PRESETS[model]
    torch.manual_seed(0)
    net = MultimodalLM(model_config).to(device)
    threads_before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dp))
    results: dict[str, list[float]] = {"balanced": [], "contiguous": []}
    estimated: dict[str, list[float]] = {"balanced": [], "contiguous": []}
    try:
        for step in range(1, steps + 3):
            specs = global_batch_specs(0, step, 16, model_config.patch_px)
            by_index = {s.index: s for s in specs}
            for name, balance in (("balanced", True), ("contiguous", False)):
                plan = plan_step(specs, dp, 2, model_config, balance)
                rank_s = []
                for rank_batches in plan.ranks:
                    micro = [collate([render_sample(by_index[i], 0) for i in mb]).to(device) for mb in rank_batches]
                    tries_s = []
                    for _ in range(repeats):  # the fastest of a few: other processes only ever add time
                        _sync(device)
                        started = time.perf_counter()
                        for mb in micro:
                            net(mb).backward()
                        _sync(device)
                        tries_s.append(time.perf_counter() - started)
                        net.zero_grad(set_to_none=True)
                    rank_s.append(min(tries_s))
                if step > 2:  # warm-up
                    results[name].append(max(rank_s) / statistics.mean(rank_s))
                    estimated[name].append(plan.estimated_imbalance)
    finally:
        torch.set_num_threads(threads_before)
    return {
        name: {
            "median": statistics.median(values), "mean": statistics.mean(values), "p90": sorted(values)[int(0.9 * (len(values) - 1))],
            "estimated_mean": statistics.mean(estimated[name]),
        }
        for name, values in results.items()
    } | {"model": model, "dp": dp, "steps": steps, "target": "balanced median <= 1.10"}


def bench_processes(model: str, steps: int, dp: int, work_dir: Path) -> dict[str, Any]:
    """Real launcher runs (CPU, gloo) with balancing on and off: medians from metrics.jsonl."""
    figures: dict[str, Any] = {"model": model, "dp": dp, "steps": steps}
    for name, flag in (("balanced", "--balance"), ("contiguous", "--no-balance")):
        run_dir = work_dir / f"run-{name}"
        command = [sys.executable, "-m", "trainer_agent.train", "--run-dir", str(run_dir), "--steps", str(steps), "--dp", str(dp), "--model", model, flag, "--checkpoint-every", "1000"]
        subprocess.run(command, check=True, capture_output=True, timeout=600)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][2:]
        figures[name] = {
            "imbalance_median": statistics.median(r["imbalance"] for r in records),
            "step_s_median": statistics.median(r["step_s"] for r in records),
            "compute_s_median": statistics.median(r["compute_s"] for r in records),
            "comm_s_median": statistics.median(r["comm_s"] for r in records),
            "data_wait_s_median": statistics.median(r["data_wait_s"] for r in records),
            "final_loss": records[-1]["loss"],
        }
    return figures


def bench_checkpoint(model: str, device: torch.device, work_dir: Path, repeats: int = 3) -> dict[str, Any]:
    """Save / load seconds for model + optimizer state through the library's DCP checkpointer, and
    what an asynchronous save blocks (one process; bench.sdk measures 2 ranks)."""
    model_config = MODEL_PRESETS[model]
    torch.manual_seed(0)
    net = MultimodalLM(model_config).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    batch = build_step_batch(_worker_config(model, dp=1), model_config, 0, 1)
    compute_step(net, optimizer, batch, device, None)
    directory = work_dir / f"ckpt-{model}"
    sync, asynchronous = Checkpointer(directory, keep=2), Checkpointer(directory, keep=2, async_save=True)
    save_s, load_s, blocked_s, async_total_s = [], [], [], []
    for i in range(repeats):
        _sync(device)
        save_s.append(sync.save(2 * i + 1, model=net, optimizer=optimizer).blocked_s)
        started = time.perf_counter()
        assert sync.load(model=net, optimizer=optimizer, restore_rng=False) is not None
        _sync(device)
        load_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        blocked_s.append(asynchronous.save(2 * i + 2, model=net, optimizer=optimizer).blocked_s)
        asynchronous.wait()
        async_total_s.append(time.perf_counter() - started)
    size = sum(f.stat().st_size for f in (directory / f"step-{2 * repeats:08d}").iterdir())
    return {
        "model": model, "parameters": sum(p.numel() for p in net.parameters()), "state_bytes": size,
        "save_s": statistics.median(save_s), "load_s": statistics.median(load_s),
        "async_blocked_s": statistics.median(blocked_s), "async_total_s": statistics.median(async_total_s),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the figures."""
    parser = argparse.ArgumentParser(prog="python -m bench.trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (the only output format)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=40, help="steps per telemetry arm")
    parser.add_argument("--imbalance-steps", type=int, default=20)
    parser.add_argument("--dp", type=int, default=2, help="ranks for the imbalance figures")
    parser.add_argument("--processes", action=argparse.BooleanOptionalAction, default=None, help="also run real worker processes (default: on for cpu)")
    args = parser.parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    started = time.perf_counter()
    work_dir = Path(tempfile.mkdtemp(prefix="omni-bench-trainer-"))
    try:
        report: dict[str, Any] = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{os.cpu_count()}",
            "torch": torch.__version__,
            "telemetry": bench_telemetry("tiny", args.steps, device, work_dir),
            "telemetry_small": bench_telemetry("small", max(10, args.steps // 2), device, work_dir),
            "imbalance": {m: bench_imbalance(m, args.imbalance_steps, args.dp, device) for m in ("tiny", "small")},
            "checkpoint": {m: bench_checkpoint(m, device, work_dir) for m in ("tiny", "small")},
        }
        if args.processes if args.processes is not None else device.type == "cpu":
            report["processes"] = bench_processes("small", 20, args.dp, work_dir)
        report["bench_s"] = time.perf_counter() - started
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

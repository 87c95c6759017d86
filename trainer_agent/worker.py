"""One data-parallel rank of the reference trainer, started by ``trainer_agent.train``.

Reads its configuration from the ``OMNI_TRAINER_CONFIG`` environment variable (JSON) and its
place from the torch.distributed variables (``RANK``, ``WORLD_SIZE``, and either
``OMNI_TRAINER_RENDEZVOUS=file://...`` or ``MASTER_ADDR``/``MASTER_PORT``). Trains with DDP and gradient accumulation, reports each step through
``trainer_agent.runtime``, and checkpoints every N steps and when asked to stop.
"""

from __future__ import annotations

import signal

# Catch SIGTERM/SIGUSR1 from the first instruction: importing torch takes a while and a
# preemption that arrives meanwhile must still end in a checkpoint, not a dead worker.
_EARLY_SIGNALS: list[str] = []


def _early_signal(signum: int, _frame: object) -> None:
    _EARLY_SIGNALS.append(signal.Signals(signum).name)


signal.signal(signal.SIGTERM, _early_signal)
signal.signal(signal.SIGUSR1, _early_signal)

import ctypes  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import queue  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, NoReturn  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from trainer_agent.balancing import StepPlan, plan_step  # noqa: E402
from trainer_agent.checkpoint import checkpoint_name  # noqa: E402
from trainer_agent.launch import METRICS_FILE  # noqa: E402
from trainer_agent.runtime import ControlFile, JsonlFileSink, TrainerRuntime, optimizer_steps  # noqa: E402
from trainer_agent.runtime.dcp import Checkpointer  # noqa: E402
from trainer_agent.runtime.ddp import exact_ddp  # noqa: E402
from trainer_agent.runtime.job import trim_records, write_exit  # noqa: E402
from trainer_agent.schedule import LRSchedule  # noqa: E402
from trainer_agent.workload import (  # noqa: E402
    MODEL_PRESETS,
    MicroBatch,
    ModelConfig,
    MultimodalLM,
    SampleSpec,
    collate,
    render_sample,
    sample_spec,
)

CONFIG_ENV = "OMNI_TRAINER_CONFIG"
SAMPLES_PER_EPOCH = 1 << 20


@dataclass(frozen=True)
class WorkerConfig:
    """What the launcher decided; identical on every rank."""

    run_dir: str
    steps: int
    dp: int
    seed: int
    global_batch: int
    micro_batch: int
    stop_at_step: int | None
    device: str
    checkpoint_every: int
    keep: int
    balance: bool
    async_save: bool
    calibration_steps: int
    calibration_start_fraction: float
    schedule_steps: int
    base_lr: float
    warmup_steps: int
    precision: str
    prefetch_steps: int
    model: str = "tiny"
    slow_on_node: str | None = None   # test knob: this node's ranks compute slow_factor x slower
    slow_rank: int | None = None      # test knob: ... or this rank
    slow_factor: float = 1.0
    stall_every: int = 0              # test knob: a data stall of stall_s every stall_every steps
    stall_s: float = 0.0

    @property
    def accum(self) -> int:
        """Micro-batches per rank per step."""
        return self.global_batch // (self.micro_batch * self.dp)


@dataclass
class StepBatch:
    """This rank's share of one step, rendered and padded, plus what the whole global batch holds."""

    step: int
    plan: StepPlan
    micro_batches: list[MicroBatch]
    global_text_tokens: int
    global_specs: list[SampleSpec]


def global_batch_specs(seed: int, step: int, global_batch: int, patch_px: int = 8) -> list[SampleSpec]:
    """The samples of ``step`` (1-based): indices [(step-1)*G, step*G), the same for every DP."""
    first = (step - 1) * global_batch
    return [sample_spec(seed, first + i, patch_px) for i in range(global_batch)]


def build_step_batch(config: WorkerConfig, model_config: ModelConfig, rank: int, step: int) -> StepBatch:
    """Plan the step for all ranks, then render only this rank's micro-batches."""
    specs = global_batch_specs(config.seed, step, config.global_batch, model_config.patch_px)
    plan = plan_step(specs, config.dp, config.micro_batch, model_config, config.balance)
    by_index = {s.index: s for s in specs}
    micro_batches = [collate([render_sample(by_index[i], config.seed) for i in mb]) for mb in plan.ranks[rank]]
    return StepBatch(step, plan, micro_batches, sum(s.text_tokens for s in specs), specs)


class StepPrefetcher:
    """Builds the next ``depth`` steps' batches on a background thread so data rarely stalls compute."""

    def __init__(self, config: WorkerConfig, model_config: ModelConfig, rank: int, first_step: int, last_step: int, depth: int) -> None:
        self._queue: queue.Queue[StepBatch | BaseException] = queue.Queue(maxsize=max(1, depth))
        self._args = (config, model_config, rank)
        self._thread = threading.Thread(target=self._produce, args=(first_step, last_step), daemon=True, name="prefetch")
        self._thread.start()

    def _produce(self, first_step: int, last_step: int) -> None:
        try:
            for step in range(first_step, last_step + 1):
                self._queue.put(build_step_batch(*self._args, step))
        except BaseException as exc:  # surfaced to the training loop on the next get()
            self._queue.put(exc)

    def next(self) -> StepBatch:
        """The next step's batch, waiting if it is not ready."""
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


def compute_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: StepBatch,
    device: torch.device,
    scaler: torch.amp.GradScaler | None,
    autocast: Any = nullcontext,
) -> float:
    """Forward and backward over this rank's micro-batches, accumulating, then the optimizer step.

    Each micro-batch's summed token loss is divided by the *global* batch's token count, and the
    comm hook sums gradients over ranks, so the update is the exact global-batch mean gradient
    whatever DP and the split are. Gradients are synchronised only on the last micro-batch.
    Returns this rank's summed token loss (nats).
    """
    inv_tokens = 1.0 / batch.global_text_tokens
    optimizer.zero_grad(set_to_none=True)
    local_loss = torch.zeros((), dtype=torch.float64, device=device)
    last = len(batch.micro_batches) - 1
    for i, micro in enumerate(batch.micro_batches):
        micro = micro.to(device)
        no_sync = getattr(model, "no_sync", None)
        sync = no_sync() if no_sync is not None and i < last else nullcontext()
        with sync:
            with autocast():
                loss_sum = model(micro)
            scaled = loss_sum * inv_tokens
            if scaler is not None:
                scaler.scale(scaled).backward()
            else:
                scaled.backward()
        local_loss += loss_sum.detach().double()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return float(local_loss)  # waits for the device


def report_tokens(runtime: TrainerRuntime, batch: StepBatch, rank: int, local_loss: float) -> None:
    """Hand this rank's loss, tokens and samples per modality for the step to the runtime."""
    local_tokens = {"image": 0, "video": 0, "text": 0}
    for micro in batch.micro_batches:
        for name, count in micro.tokens.items():
            local_tokens[name] += count
    local_samples = {"image": 0, "video": 0}
    first_index = batch.global_specs[0].index
    for sample_index in (i for mb in batch.plan.ranks[rank] for i in mb):
        local_samples[batch.global_specs[sample_index - first_index].modality] += 1
    runtime.count_tokens(**local_tokens, image_samples=local_samples["image"], video_samples=local_samples["video"])
    runtime.add_loss(local_loss, local_tokens["text"])


def _grad_scaler(device: torch.device, enabled: bool) -> torch.amp.GradScaler:
    """The loss scaler for fp16 (``torch.amp`` API; older torch only had the CUDA one)."""
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler(device.type, enabled=enabled)
    return torch.cuda.amp.GradScaler(enabled=enabled)  # pragma: no cover - torch < 2.3


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _cpu_threads(dp: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // dp)


def run(config: WorkerConfig, rank: int, world_size: int) -> NoReturn:
    """Train this rank until done or preempted, then leave the process (exit status 0)."""
    run_dir = Path(config.run_dir)
    torch.set_num_threads(_cpu_threads(world_size))
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    use_cuda = config.device == "cuda"
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        device = torch.device("cpu")
    # The launcher rendezvouses through a file (OMNI_TRAINER_RENDEZVOUS=file://...); an external
    # launcher can use the usual MASTER_ADDR / MASTER_PORT environment instead.
    dist.init_process_group(
        "nccl" if use_cuda else "gloo", init_method=os.environ.get("OMNI_TRAINER_RENDEZVOUS", "env://"),
        rank=rank, world_size=world_size, timeout=timedelta(seconds=300),
    )
    model_config = MODEL_PRESETS[config.model]
    torch.manual_seed(config.seed)
    model = MultimodalLM(model_config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.base_lr, betas=(0.9, 0.98), weight_decay=0.01)
    schedule = LRSchedule(config.base_lr, config.warmup_steps, config.schedule_steps)
    use_scaler = config.precision == "fp16"
    scaler = _grad_scaler(device, use_scaler)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.precision)
    modality_stats = {"image_tokens": 0, "video_tokens": 0, "text_tokens": 0, "image_samples": 0, "video_samples": 0}
    # The public library's checkpointer (trainer_agent.runtime.dcp): DCP, atomic, keep-last-K,
    # corrupt newest skipped, every rank's RNG; rank 0 picks the checkpoint and every rank loads it.
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=config.keep, async_save=config.async_save)
    resumed = checkpointer.load(model=model, optimizer=optimizer, scaler=scaler if use_scaler else None)
    start_step = 0
    if resumed is not None:
        schedule = LRSchedule.from_state_dict(resumed.extra["lr_schedule"])
        modality_stats = dict(resumed.extra["modality_stats"])
        start_step = resumed.step
        previous_dp = int(resumed.batch["dp"])
        if previous_dp != world_size and config.calibration_steps > 0:
            schedule.start_calibration(start_step + 1, config.calibration_steps, config.calibration_start_fraction)
        if rank == 0:
            trim_records(run_dir / METRICS_FILE, start_step)
            print(
                f"resumed from {checkpoint_name(start_step)}: dp {previous_dp} -> {world_size}, "
                f"accum {resumed.batch['accum']} -> {config.accum}, global batch {config.global_batch}",
                flush=True,
            )
    elif rank == 0:
        trim_records(run_dir / METRICS_FILE, 0)
        print(f"starting fresh: dp {world_size}, accum {config.accum}, global batch {config.global_batch}", flush=True)

    runtime = TrainerRuntime(
        sink=JsonlFileSink(run_dir / METRICS_FILE) if rank == 0 else None,
        control=ControlFile(run_dir / "control.json"),
        rank=rank,
        world_size=world_size,
        device=device,
    )
    for name in _EARLY_SIGNALS:
        runtime.request_stop(name)
    ddp = exact_ddp(model, runtime, device_ids=[device.index] if use_cuda else None)
    batch_config = {"global_batch": config.global_batch, "micro_batch": config.micro_batch, "dp": world_size, "accum": config.accum}
    run_facts = {"schedule_steps": config.schedule_steps, "base_lr": config.base_lr, "warmup_steps": config.warmup_steps}

    def save(step: int) -> dict[str, Any]:
        """Checkpoint after ``step`` (collective: every rank writes its part, rank 0 commits)."""
        info = checkpointer.save(
            step, model=model, optimizer=optimizer, scaler=scaler if use_scaler else None, batch=batch_config,
            data={"seed": config.seed, "next_sample_index": step * config.global_batch,
                  "epoch": (step * config.global_batch) // SAMPLES_PER_EPOCH, "samples_per_epoch": SAMPLES_PER_EPOCH},
            extra={"lr_schedule": schedule.state_dict(), "modality_stats": dict(modality_stats),
                   "precision": config.precision, "model_config": model_config.as_dict(), "run": run_facts},
            manifest={"seed": config.seed, "model": config.model, "precision": config.precision, **run_facts},
        )
        saved = {"checkpoint": info.checkpoint, "save_blocked_s": info.blocked_s}
        if info.save_s is not None:
            saved["save_s"] = info.save_s
        return saved

    stop_at = config.stop_at_step if config.stop_at_step and config.stop_at_step > start_step else None
    last_step = min(config.steps, stop_at) if stop_at else config.steps
    outcome: dict[str, Any] = {"outcome": "completed", "step": start_step}
    prefetcher = StepPrefetcher(config, model_config, rank, start_step + 1, last_step, config.prefetch_steps) if start_step < last_step else None
    autocast = (lambda: torch.autocast(device.type, dtype=autocast_dtype)) if autocast_dtype else nullcontext

    slow = config.slow_factor > 1.0 and (
        (bool(config.slow_on_node) and os.environ.get("OMNI_NODE") == config.slow_on_node) or rank == config.slow_rank)
    for step in range(start_step + 1, last_step + 1):
        runtime.begin_step(step)
        with runtime.data_wait():
            assert prefetcher is not None
            batch = prefetcher.next()
            if config.stall_every and step % config.stall_every == 0:
                time.sleep(config.stall_s)
        lr = schedule.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with runtime.compute():
            started = time.perf_counter()
            local_loss_value = compute_step(ddp, optimizer, batch, device, scaler if use_scaler else None, autocast)
            if slow:
                time.sleep((config.slow_factor - 1.0) * (time.perf_counter() - started))
        report_tokens(runtime, batch, rank, local_loss_value)
        for spec in batch.global_specs:
            modality_stats[f"{spec.modality}_tokens"] += spec.visual_tokens
            modality_stats[f"{spec.modality}_samples"] += 1
            modality_stats["text_tokens"] += spec.text_tokens
        record_extra = {
            "lr": lr, "dp": world_size, "accum": config.accum, "micro_batch": config.micro_batch,
            "global_batch": config.global_batch, "balance": config.balance,
            "estimated_imbalance": batch.plan.estimated_imbalance,
            # Continuity after a resize or resume (docs/rhythm.md): the optimizer's own count and
            # the samples drawn through this step.
            "opt_step": optimizer_steps(optimizer),
            "data_pos": max(spec.index for spec in batch.global_specs) + 1,
        }
        runtime.end_step(record_extra)
        stopping = runtime.should_checkpoint_and_stop() or step == last_step
        if stopping or step % config.checkpoint_every == 0:
            saved = save(step)
            if rank == 0:
                outcome.update(saved)
        outcome["step"] = step
        if runtime.should_checkpoint_and_stop():
            outcome["outcome"] = "resize" if runtime.requested_dp() else "preempted"
            outcome["reason"] = runtime.stop_reason
            outcome["requested_dp"] = runtime.requested_dp()
            break
    else:
        if stop_at is not None and last_step == stop_at and stop_at < config.steps:
            outcome.update(outcome="preempted", reason=f"--stop-at-step {stop_at}")

    last_save = checkpointer.wait()  # an asynchronous save is committed before anyone leaves
    if config.async_save and last_save is not None and last_save.save_s is not None:
        outcome["save_s"] = last_save.save_s
    dist.barrier()
    if rank == 0:
        runtime.acknowledge_control()
        write_exit(run_dir, outcome)
    runtime.close()
    dist.destroy_process_group()
    _exit_without_teardown(0)


def _exit_without_teardown(code: int) -> NoReturn:
    """Leave now, skipping Python's teardown of the DDP model and the gloo group.

    Deallocating DDP's Reducer joins gloo's worker thread while holding the GIL, and that thread
    may be waiting for the GIL to drop a tensor of its last collective: a deadlock seen at exit
    on a loaded machine (rank 1 hung after rank 0 had left). Everything this process owes (the
    checkpoint, metrics.jsonl, exit.json) is written and closed by now.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> NoReturn:
    """Entry point of one worker process."""
    _die_with_parent()
    config = WorkerConfig(**json.loads(os.environ[CONFIG_ENV]))
    run(config, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":
    main()

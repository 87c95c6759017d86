"""The one entry point a training script calls: ``job = omni.init()``.

It reads the job's environment (torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and the node
agent's ``OMNI_*`` variables, docs/workloads.md), joins the process group, and gives the script
its place (rank, world, DP), its batch configuration (micro-batch, accumulation, global batch),
its checkpoint directory, the step reporter and the stop decision, agreed by every rank at the
same step. ``job.finish(step)`` writes what the node agent reads when the ranks leave
(``exit.json``). Outside Omni (plain ``torchrun`` or ``python``) the same script runs on the
defaults given to ``init`` (docs/researchers.md).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from trainer_agent.checkpoint import LATEST_FILE as LATEST_CHECKPOINT_FILE  # note_checkpoint
from trainer_agent.launch import METRICS_FILE  # where the agent reads step records ($OMNI_METRICS_FILE)
from trainer_agent.runtime.steps import ControlFile, JsonlFileSink, TrainerRuntime

EXIT_FILE = "exit.json"
CONTROL_FILE = "control.json"


class JobEnvironmentError(ValueError):
    """A job variable is missing or malformed; the message names it."""


def _int(env: Mapping[str, str], name: str, default: int | None) -> int:
    raw = env.get(name)
    if raw in (None, ""):
        if default is None:
            raise JobEnvironmentError(f"{name} is not set; run under the Omni node agent or torchrun, or pass a default")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise JobEnvironmentError(f"{name}={raw!r} is not a whole number") from None
    if value < 0:
        raise JobEnvironmentError(f"{name}={value} is negative")
    return value


def _fraction(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise JobEnvironmentError(f"{name}={raw!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise JobEnvironmentError(f"{name}={raw!r} is not a fraction in (0, 1]")
    return value


@dataclass(frozen=True)
class JobSpec:
    """The job as its environment describes it (identical on every rank but for the rank fields)."""

    name: str
    rank: int
    local_rank: int
    world_size: int
    dp: int
    micro_batch: int
    global_batch: int
    total_steps: int
    checkpoint_every: int
    keep_checkpoints: int
    run_dir: Path
    checkpoint_dir: Path
    device: str               # "cuda" or "cpu": what the node agent gave this rank
    integration: str          # "omni" or "signal"; "none" outside Omni
    under_omni: bool
    calibration_steps: int = 0        # after a resize, ramp the learning rate up over this many steps
    calibration_start: float = 0.1    # ... from this fraction of it

    @property
    def accum(self) -> int:
        """Micro-batches per replica per step: ``global_batch / (micro_batch x dp)``."""
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def ranks_per_replica(self) -> int:
        """GPUs of one data-parallel replica (TP x PP); ranks of one replica are consecutive."""
        return max(1, self.world_size // self.dp)

    @property
    def dp_rank(self) -> int:
        """Which data-parallel replica this rank belongs to."""
        return self.rank // self.ranks_per_replica

    def torch_device(self) -> Any:
        """``cuda:LOCAL_RANK`` when the node gave this rank a GPU, else the CPU."""
        import torch

        if self.device != "cpu" and torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % max(1, torch.cuda.device_count()))
        return torch.device("cpu")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, global_batch: int | None = None,
                 micro_batch: int | None = None, total_steps: int | None = None, checkpoint_every: int | None = None,
                 keep_checkpoints: int = 3, run_dir: str | Path | None = None,
                 calibration_steps: int = 0) -> JobSpec:
        """Read the environment; the keyword arguments are the defaults used outside Omni."""
        env = os.environ if env is None else env
        world = _int(env, "WORLD_SIZE", 1) or 1
        rank = _int(env, "RANK", 0)
        if rank >= world:
            raise JobEnvironmentError(f"RANK={rank} is not below WORLD_SIZE={world}")
        dp = _int(env, "OMNI_DP", world) or world
        if world % dp:
            raise JobEnvironmentError(f"WORLD_SIZE={world} is not a multiple of OMNI_DP={dp}")
        micro = _int(env, "OMNI_MICRO_BATCH", micro_batch) or 1
        global_ = _int(env, "OMNI_GLOBAL_BATCH", global_batch if global_batch is not None else micro * dp)
        if global_ % (micro * dp):
            raise JobEnvironmentError(
                f"OMNI_GLOBAL_BATCH={global_} does not split into micro-batches of {micro} over {dp} replicas")
        root = env.get("OMNI_RUN_DIR") or (str(run_dir) if run_dir is not None else None)
        if not root:
            raise JobEnvironmentError("OMNI_RUN_DIR is not set; run under the Omni node agent or pass run_dir=")
        checkpoints = env.get("OMNI_CHECKPOINT_DIR") or str(Path(root) / "checkpoints")
        steps = _int(env, "OMNI_TOTAL_STEPS", total_steps)
        return cls(
            name=env.get("OMNI_JOB", "local"), rank=rank, local_rank=_int(env, "LOCAL_RANK", rank), world_size=world,
            dp=dp, micro_batch=micro, global_batch=global_, total_steps=steps,
            checkpoint_every=_int(env, "OMNI_CHECKPOINT_EVERY", checkpoint_every or max(1, steps // 10)) or 1,
            keep_checkpoints=_int(env, "OMNI_KEEP_CHECKPOINTS", keep_checkpoints) or 1,
            run_dir=Path(root), checkpoint_dir=Path(checkpoints),
            device=env.get("OMNI_DEVICE") or "auto", integration=env.get("OMNI_INTEGRATION", "none"),
            under_omni="OMNI_JOB" in env,
            calibration_steps=_int(env, "OMNI_CALIBRATION_STEPS", calibration_steps),
            calibration_start=_fraction(env, "OMNI_CALIBRATION_START", 0.1),
        )


class Job:
    """One rank's view of its job, and its link to the control plane.

    ``job.step(n)`` brackets a step (``with job.step(n) as s: with s.compute(): ...``); at its end
    every rank agrees on the step's global loss and on whether to stop. ``job.should_stop()``
    then says to checkpoint and leave (preemption, a resize: ``job.requested_dp()``, or a signal).
    """

    def __init__(self, spec: JobSpec, runtime: TrainerRuntime) -> None:
        self.spec = spec
        self.runtime = runtime
        self._exit_written = False
        self._noted_checkpoint: tuple[int, str] | None = None
        self._calibration_from: int | None = None  # the first step after a resize, when ramping

    # the job's shape, read-only -------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        return getattr(self.spec, name)  # rank, world_size, dp, accum, micro_batch, checkpoint_dir...

    @property
    def is_leader(self) -> bool:
        """Rank 0: the one that writes shared files."""
        return self.spec.rank == 0

    @property
    def batch(self) -> dict[str, int]:
        """The batch configuration, as checkpoints record it."""
        s = self.spec
        return {"global_batch": s.global_batch, "micro_batch": s.micro_batch, "dp": s.dp, "accum": s.accum}

    def sample_indices(self, step: int) -> list[list[int]]:
        """This replica's micro-batches of step ``step`` (1-based), as global sample indices.

        Step ``n`` holds samples ``[(n-1) * global_batch, n * global_batch)`` whatever the DP;
        replica ``r`` takes its contiguous ``global_batch / dp`` of them, in micro-batches. So a
        run resumed at another DP sees the same samples at every step, in the same order.
        """
        s = self.spec
        per_replica = s.global_batch // s.dp
        first = (step - 1) * s.global_batch + s.dp_rank * per_replica
        return [list(range(first + i * s.micro_batch, first + (i + 1) * s.micro_batch)) for i in range(s.accum)]

    # steps and the control plane --------------------------------------------------------------

    @contextmanager
    def step(self, step: int, **extra: Any) -> Iterator[TrainerRuntime]:
        """Bracket step ``step``: the body times its parts on the yielded runtime; the exit agrees
        the loss and the stop decision with every rank and emits the step record (rank 0)."""
        self.runtime.begin_step(step)
        yield self.runtime
        self.runtime.end_step({"dp": self.spec.dp, "accum": self.spec.accum, "micro_batch": self.spec.micro_batch,
                               "global_batch": self.spec.global_batch, **extra})

    def should_stop(self) -> bool:
        """True once every rank agreed (at the end of the last step) to checkpoint and stop."""
        return self.runtime.should_checkpoint_and_stop()

    def requested_dp(self) -> int | None:
        """The new DP the control plane asked for (a resize), if any: the next launch runs at it."""
        return self.runtime.requested_dp()

    @property
    def stop_reason(self) -> str | None:
        return self.runtime.stop_reason

    def should_checkpoint(self, step: int) -> bool:
        """Save after this step: the period came round, the run ends, or it must stop."""
        s = self.spec
        return self.should_stop() or step >= s.total_steps or step % s.checkpoint_every == 0

    def checkpointer(self, async_save: bool = False) -> Any:
        """A ``Checkpointer`` on this job's checkpoint directory, keeping its ``keep_checkpoints``.

        On resume it also drops this job's step records past the checkpoint (they are recomputed)."""
        from trainer_agent.runtime.dcp import Checkpointer

        checkpointer = Checkpointer(self.spec.checkpoint_dir, keep=self.spec.keep_checkpoints, async_save=async_save)
        checkpointer.on_load = self._resumed
        return checkpointer

    # the post-resize calibration ramp -------------------------------------------------------------

    def lr_factor(self, step: int) -> float:
        """The learning-rate multiplier at ``step``: after a resume at another DP (a resize), a
        linear ramp from ``calibration_start`` to 1 over ``calibration_steps`` steps; else 1.
        Under Omni the ramp is on (5 steps from 10%: ``OMNI_CALIBRATION_STEPS``,
        ``OMNI_CALIBRATION_START`` in the job's env change it; 0 steps turns it off)."""
        first, steps = self._calibration_from, self.spec.calibration_steps
        if first is None or steps <= 0 or step < first or step >= first + steps:
            return 1.0
        start = self.spec.calibration_start
        return start + (1.0 - start) * (step - first) / steps

    @contextmanager
    def calibrated(self, optimizer: Any, step: int) -> Iterator[float]:
        """Around ``optimizer.step()``: every group's learning rate times ``lr_factor(step)``, put
        back after (so an LR scheduler's own state is untouched)."""
        factor = self.lr_factor(step)
        if factor == 1.0:
            yield factor
            return
        saved = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        try:
            yield factor
        finally:
            for group, lr in zip(optimizer.param_groups, saved, strict=True):
                group["lr"] = lr

    def _resumed(self, step: int, previous_dp: int | None) -> None:
        if previous_dp is not None and previous_dp != self.spec.dp:
            self._calibration_from = step + 1
        if not self.is_leader:
            return
        self.forget_steps_after(step)
        s = self.spec
        print(f"resumed from step {step}: dp {previous_dp} -> {s.dp}, accum {s.accum}, global batch {s.global_batch}",
              flush=True)

    def note_checkpoint(self, step: int, path: str | Path) -> None:
        """A framework (HF Trainer, Lightning) has saved its checkpoint of ``step`` at ``path``.

        Rank 0 writes ``{checkpoint_dir}/omni-latest.json`` (``{"step", "path"}``, atomically), the
        node agent's view of checkpoints it did not write itself; ``finish`` reports it as well.
        Call it once the save is complete on every rank."""
        self._noted_checkpoint = (step, os.path.abspath(path))
        if not self.is_leader:
            return
        directory = self.spec.checkpoint_dir
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{LATEST_CHECKPOINT_FILE}.tmp"
        tmp.write_text(json.dumps({"step": step, "path": str(path)}), encoding="utf-8")
        os.replace(tmp, directory / LATEST_CHECKPOINT_FILE)

    def forget_steps_after(self, step: int) -> None:
        """A resume from ``step``: drop this job's step records past it, which are recomputed (rank 0)."""
        if not self.is_leader:
            return
        trim_records(self.spec.run_dir / METRICS_FILE, step)
        if isinstance(self.runtime.sink, JsonlFileSink):
            self.runtime.sink.reopen()  # the trim replaced the file

    def finish(self, step: int, checkpointer: Any = None) -> dict[str, Any]:
        """End the run at ``step``: wait for the checkpoint in flight, tell the node agent how it ended
        (rank 0 writes ``exit.json``), consume the control command, close the step sink (collective)."""
        saved = checkpointer.wait() if checkpointer is not None else None
        if self.should_stop():
            outcome = "resize" if self.requested_dp() else "preempted"
        elif step >= self.spec.total_steps:
            outcome = "completed"
        else:
            outcome = "preempted"  # left early unasked: the job resumes from its checkpoint
        reason = self.stop_reason or (None if outcome == "completed" else f"ended at step {step} of {self.spec.total_steps}")
        record: dict[str, Any] = {"outcome": outcome, "step": step, "reason": reason,
                                  "requested_dp": self.requested_dp()}
        if saved is not None:
            record.update(checkpoint=saved.checkpoint, checkpoint_step=saved.step, save_s=saved.save_s,
                          save_blocked_s=saved.blocked_s)
        elif self._noted_checkpoint is not None:
            record.update(checkpoint_step=self._noted_checkpoint[0], checkpoint=self._noted_checkpoint[1])
        if self.is_leader:
            self.runtime.acknowledge_control()
            write_exit(self.spec.run_dir, record)
        self.runtime.close()
        self._exit_written = True
        return record


def trim_records(path: Path, last_step: int) -> None:
    """Drop step records after ``last_step`` (a resume recomputes them); a torn last line goes too."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("step", 0) <= last_step:
                kept.append(line)
        except ValueError:
            continue
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


def write_exit(run_dir: Path, outcome: dict[str, Any]) -> None:
    """Write ``exit.json`` atomically (what the node agent reports when the ranks are gone), with
    the time it was written: a rank that fails after it, in the interpreter's teardown, failed
    after the run ended (``workers.TorchrunJob.failed_after_finish``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{EXIT_FILE}.tmp"
    tmp.write_text(json.dumps({**outcome, "at": time.time()}), encoding="utf-8")
    os.replace(tmp, run_dir / EXIT_FILE)


def _leave_process_group() -> None:
    """At exit, destroy the process group whoever made it (this library, the HF Trainer,
    Lightning): left to the interpreter's teardown, gloo's threads may abort the process
    ("terminate called without an active exception", exit code 134) after the work is done."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # leaving anyway; nothing is owed any more
        pass


def _join_process_group(spec: JobSpec, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    if spec.world_size <= 1 or not dist.is_available() or dist.is_initialized():
        return
    use_cuda = spec.device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(spec.local_rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s))


def init(*, global_batch: int | None = None, micro_batch: int | None = None, total_steps: int | None = None,
         checkpoint_every: int | None = None, keep_checkpoints: int = 3, run_dir: str | Path | None = None,
         process_group: bool = True, timeout_s: float = 300.0, env: Mapping[str, str] | None = None,
         calibration_steps: int = 0) -> Job:
    """Read the job's environment and join its process group; return the ``Job``.

    Under Omni every value comes from the environment; the keywords are the defaults for running
    the same script by hand. A bad or missing variable exits with status 2 and one line naming it.
    ``process_group=False`` leaves ``torch.distributed`` to a framework (Lightning, HF Trainer).
    """
    from trainer_agent import runtime as package

    try:
        spec = JobSpec.from_env(env, global_batch=global_batch, micro_batch=micro_batch, total_steps=total_steps,
                                checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints, run_dir=run_dir,
                                calibration_steps=calibration_steps)
    except JobEnvironmentError as exc:
        print(f"omni: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if process_group:
        _join_process_group(spec, timeout_s)
    atexit.register(_leave_process_group)
    device = spec.torch_device() if process_group and spec.world_size > 1 else "cpu"
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    runtime = TrainerRuntime(
        sink=JsonlFileSink(spec.run_dir / METRICS_FILE) if spec.rank == 0 else None,
        control=ControlFile(spec.run_dir / CONTROL_FILE),
        rank=spec.rank, world_size=spec.world_size, device=device,
    )
    for name in package.early_signals():
        runtime.request_stop(name)
    return Job(spec, runtime)

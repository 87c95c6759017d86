"""A small library any torch training loop adopts to report its rhythm and obey the control plane.

It times each step's data wait, compute and communication, counts tokens per modality, turns
SIGTERM / SIGUSR1 / a control file into "checkpoint and stop", exposes "what is my new DP?", and
hands one record per committed step to a sink (``JsonlFileSink`` now; the node agent later).
Across ranks it agrees on the step's exact global loss and on the stop decision with a single
small all-gather, so every rank takes the same decision at the same step.

The record format, the control file and a 20-line example are in docs/trainer.md.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

RECORD_FORMAT = "omni-step/1"
CONTROL_CHECKPOINT_AND_STOP = "checkpoint_and_stop"
CONTROL_RESIZE = "resize"


class StepSink(Protocol):
    """Receives one dict per committed step (on rank 0 only)."""

    def emit(self, record: dict[str, Any]) -> None:
        """Take one step record; must not block for long."""

    def close(self) -> None:
        """Flush and release resources."""


class JsonlFileSink:
    """Appends each step record as one JSON line, flushed per line so a tailer sees it at once."""

    def __init__(self, path: Path, fsync: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: Any = None  # opened at the first record: a resume may rewrite the file before
        self._fsync = fsync

    def emit(self, record: dict[str, Any]) -> None:
        """Append ``record`` as a line."""
        if self._file is None:
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())

    def reopen(self) -> None:
        """Write to the path's current file from now on (after it was replaced)."""
        self.close()

    def close(self) -> None:
        """Close the file (the next record opens it again)."""
        if self._file is not None:
            self._file.close()
            self._file = None


class MemorySink:
    """Keeps records in a list; for tests and benchmarks."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def emit(self, record: dict[str, Any]) -> None:
        """Keep ``record``."""
        self.records.append(record)

    def close(self) -> None:
        """Nothing to release."""


@dataclass(frozen=True)
class ControlCommand:
    """A command the node agent left in the run's control file."""

    command: str
    dp: int | None = None
    command_id: str | None = None


class ControlFile:
    """``RUN_DIR/control.json`` written (atomically) by the node agent, polled once per step.

    ``{"command": "checkpoint_and_stop"}`` or ``{"command": "resize", "dp": 4}``, optional ``"id"``.
    A command is consumed by renaming the file to ``control.consumed.json`` so a relaunch does
    not act on it twice. Polling is one ``stat`` when nothing changed.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._seen_mtime_ns: int | None = None

    def poll(self) -> ControlCommand | None:
        """The pending command, if the file exists and parses; otherwise ``None``."""
        try:
            mtime_ns = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        if mtime_ns == self._seen_mtime_ns:
            return None
        try:
            payload = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # half-written by a non-atomic writer: try again next step
        self._seen_mtime_ns = mtime_ns
        dp = payload.get("dp")
        return ControlCommand(str(payload.get("command", "")), int(dp) if dp is not None else None, payload.get("id"))

    def consume(self) -> None:
        """Mark the pending command as handled."""
        try:
            os.replace(self.path, self.path.with_name("control.consumed.json"))
        except FileNotFoundError:
            pass


@dataclass
class _StepState:
    step: int
    started_at: float
    data_wait_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    overlapped_comm_s: float = 0.0
    loss_sum: float = 0.0
    loss_tokens: float = 0.0
    tokens: dict[str, int] = field(default_factory=lambda: {"image": 0, "video": 0, "text": 0})
    samples: dict[str, int] = field(default_factory=lambda: {"image": 0, "video": 0})
    notes: dict[str, Any] = field(default_factory=dict)


def optimizer_steps(optimizer: Any) -> int | None:
    """How many steps ``optimizer`` has taken, from its own state (Adam-family optimizers keep a
    ``step`` per parameter, restored with a checkpoint); ``None`` when it keeps no such count."""
    state = getattr(optimizer, "state", None)
    for group in getattr(optimizer, "param_groups", ()):
        for param in group.get("params", ()):
            value = state.get(param, {}).get("step") if state is not None else None
            if value is not None:
                return int(value.item() if hasattr(value, "item") else value)
    return None


GATHERED_FIELDS = (
    "data_wait_s", "compute_s", "comm_s", "loss_sum", "loss_tokens", "stop", "requested_dp",
    "image_tokens", "video_tokens", "text_tokens", "image_samples", "video_samples",
)


class TrainerRuntime:
    """Step-boundary hooks for one rank of a (possibly distributed) training loop.

    ``begin_step`` / ``end_step`` bracket a step; ``data_wait()``, ``compute()`` and ``comm()``
    are timing contexts; ``end_step`` returns the step record (identical on every rank) and
    emits it to the sink on rank 0. With ``enabled=False`` the timers, sink and control polling
    are skipped (the loss and stop agreement still happen), which is how the overhead is measured.
    """

    def __init__(
        self,
        sink: StepSink | None = None,
        control: ControlFile | None = None,
        rank: int = 0,
        world_size: int = 1,
        device: Any = "cpu",
        enabled: bool = True,
        handle_signals: bool = True,
    ) -> None:
        self.sink = sink
        self.control = control
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.enabled = enabled
        self.stop_reason: str | None = None
        self.signals_received = 0
        self._requested_dp: int | None = None
        self._stop_agreed = False
        self._agreed_dp: int | None = None
        self._pending_command: ControlCommand | None = None
        self._state: _StepState | None = None
        self.hook_s = 0.0  # time spent inside the runtime itself, for the overhead benchmark
        self.agree_s = 0.0  # ... and in the end-of-step agreement across ranks (one all-gather)
        if handle_signals:
            self.install_signal_handlers()

    def install_signal_handlers(self) -> None:
        """Make SIGTERM and SIGUSR1 set the stop flag (again, after a framework replaced them)."""
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, self._on_signal)

    # -- control ---------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: object) -> None:
        # Only set a flag: the step finishes and the checkpoint is written in the normal flow, so
        # a second SIGTERM while saving changes nothing.
        self.signals_received += 1
        if self.stop_reason is None:
            self.stop_reason = signal.Signals(signum).name

    def request_stop(self, reason: str) -> None:
        """Ask this rank to checkpoint and stop at the end of the current step."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def should_checkpoint_and_stop(self) -> bool:
        """True once all ranks agreed (at the last ``end_step``) to checkpoint and stop."""
        return self._stop_agreed

    def requested_dp(self) -> int | None:
        """The data-parallel size the control plane asked for, agreed by all ranks, if any."""
        return self._agreed_dp

    def acknowledge_control(self) -> None:
        """Consume the control command that caused the stop (call after the checkpoint is safe)."""
        if self.control is not None and self.rank == 0 and self._pending_command is not None:
            self.control.consume()
            self._pending_command = None

    def _poll_control(self) -> None:
        if self.control is None or self.rank != 0:
            return
        command = self.control.poll()
        if command is None:
            return
        self._pending_command = command
        if command.command == CONTROL_RESIZE and command.dp:
            self._requested_dp = command.dp
            self.request_stop(f"resize to dp={command.dp}")
        elif command.command == CONTROL_CHECKPOINT_AND_STOP:
            self.request_stop("control file")

    # -- step boundaries -------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Mark the start of ``step`` (1-based)."""
        self._state = _StepState(step=step, started_at=time.perf_counter())

    @contextmanager
    def _timed(self, attribute: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        started = time.perf_counter()
        try:
            yield
        finally:
            state = self._state
            if state is not None:
                setattr(state, attribute, getattr(state, attribute) + time.perf_counter() - started)

    def data_wait(self) -> Any:
        """Context timing the wait for the next batch."""
        return self._timed("data_wait_s")

    def compute(self) -> Any:
        """Context timing forward/backward/optimizer work."""
        return self._timed("compute_s")

    def comm(self) -> Any:
        """Context timing communication outside compute."""
        return self._timed("comm_s")

    def add_overlapped_comm_s(self, seconds: float) -> None:
        """Communication measured inside a ``compute()`` block (e.g. a DDP comm hook)."""
        if self.enabled and self._state is not None:
            self._state.overlapped_comm_s += seconds

    def count_tokens(self, image: int = 0, video: int = 0, text: int = 0, image_samples: int = 0, video_samples: int = 0) -> None:
        """Add this rank's tokens (and samples) per modality for the current step."""
        if not self.enabled or self._state is None:
            return
        t = self._state.tokens
        t["image"] += image
        t["video"] += video
        t["text"] += text
        self._state.samples["image"] += image_samples
        self._state.samples["video"] += video_samples

    def note(self, **fields: Any) -> None:
        """Add fields to the current step's record (rank 0's values are the ones kept): e.g.
        ``opt_step`` (the optimizer's own step count, ``optimizer_steps(optimizer)``) and
        ``data_pos`` (samples drawn through this step), which the control plane checks for
        continuity after a resize or a resume (docs/rhythm.md)."""
        if self._state is not None:
            self._state.notes.update({k: v for k, v in fields.items() if v is not None})

    def add_loss(self, loss_sum: float, loss_tokens: float) -> None:
        """Add this rank's summed token loss and token count; the step loss is sum / tokens over all ranks."""
        if self._state is not None:
            self._state.loss_sum += loss_sum
            self._state.loss_tokens += loss_tokens

    def end_step(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Agree with the other ranks, build the step record, emit it on rank 0 and return it."""
        state = self._state
        assert state is not None, "end_step without begin_step"
        hook_started = time.perf_counter()
        if self.enabled:
            self._poll_control()
        compute_s = max(0.0, state.compute_s - state.overlapped_comm_s)
        local = [
            state.data_wait_s, compute_s, state.comm_s + state.overlapped_comm_s, state.loss_sum, state.loss_tokens,
            1.0 if self.stop_reason else 0.0, float(self._requested_dp or 0),
            state.tokens["image"], state.tokens["video"], state.tokens["text"],
            state.samples["image"], state.samples["video"],
        ]
        gather_started = time.perf_counter()
        rows = self._gather(local)
        gather_s = time.perf_counter() - gather_started
        columns = {name: [row[i] for row in rows] for i, name in enumerate(GATHERED_FIELDS)}
        loss_sum = 0.0
        for value in columns["loss_sum"]:  # fixed rank order: the same sum whatever the timing
            loss_sum += value
        loss_tokens = sum(columns["loss_tokens"])
        self._stop_agreed = any(v > 0 for v in columns["stop"])
        requested = [int(v) for v in columns["requested_dp"] if v > 0]
        self._agreed_dp = max(requested) if requested else None
        if self._stop_agreed and self.stop_reason is None:
            self.stop_reason = "peer rank"
        record: dict[str, Any] = {"format": RECORD_FORMAT, "step": state.step}
        record["loss"] = loss_sum / loss_tokens if loss_tokens else float("nan")
        if extra:
            record.update(extra)
        record.update(state.notes)
        if self.enabled:
            rank_compute = columns["compute_s"]
            mean_compute = sum(rank_compute) / len(rank_compute)
            record.update(
                at=time.time(),  # wall clock at the step's end: gaps between steps are idle phases
                step_s=time.perf_counter() - state.started_at,
                data_wait_s=max(columns["data_wait_s"]),
                compute_s=mean_compute,
                comm_s=max(columns["comm_s"]) + gather_s,
                tokens={
                    "image": int(sum(columns["image_tokens"])),
                    "video": int(sum(columns["video_tokens"])),
                    "text": int(sum(columns["text_tokens"])),
                },
                samples={"image": int(sum(columns["image_samples"])), "video": int(sum(columns["video_samples"]))},
                rank_compute_s=rank_compute,
                rank_data_wait_s=columns["data_wait_s"],
                rank_comm_s=columns["comm_s"],
                imbalance=max(rank_compute) / mean_compute if mean_compute > 0 else 1.0,
            )
            if self._stop_agreed:
                record["stop_requested"] = self.stop_reason
            if self.rank == 0 and self.sink is not None:
                self.sink.emit(record)
        self._state = None
        self.hook_s += time.perf_counter() - hook_started - gather_s
        self.agree_s += gather_s
        return record

    def _gather(self, local: list[float]) -> list[list[float]]:
        if self.world_size <= 1:
            return [local]
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(local, dtype=torch.float64, device=self.device)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor)
        return [t.cpu().tolist() for t in out]

    def close(self) -> None:
        """Close the sink."""
        if self.sink is not None:
            self.sink.close()

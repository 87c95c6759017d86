"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): save and restore all that exact resume needs.

``Checkpointer.save`` and ``Checkpointer.load`` are collectives: every rank calls them at the
same step. The model and optimizer go through DCP's ``get_state_dict`` / ``set_state_dict``, so
replicated state (DDP) and sharded state (FSDP2, any DTensor) both save and load, and a replicated
tensor is written once. Everything else exact resume needs (the LR schedule, the loss scaler,
every rank's RNG streams, the data position, the batch configuration and the script's own extras)
travels in the same DCP checkpoint as one pickled blob. On disk it is the layout of
``trainer_agent.checkpoint``: written into a staging directory, committed atomically by rank 0
with a checksummed manifest, the newest ``keep`` kept, a corrupt newest one skipped on load.

Asynchronous saves (``async_save=True``) use ``dcp.async_save`` on a gloo group of their own: the
caller blocks only while DCP copies the state to CPU; the files are written on a background thread
and rank 0 commits them when DCP's own completion says every rank's part is down. Only one save
is in flight: the next one, ``wait()`` and ``close()`` wait for it.
"""

from __future__ import annotations

import io
import random
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from trainer_agent.checkpoint import CheckpointStore, checkpoint_name

STATE_FORMAT = "omni-train-state/1"


def capture_rng_state() -> dict[str, Any]:
    """This process's random streams: Python's, NumPy's, torch's CPU and every CUDA device's."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what ``capture_rng_state`` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@dataclass(frozen=True)
class Resumed:
    """What a load restored, besides the model and optimizer it filled in place."""

    step: int
    path: Path
    batch: dict[str, Any]          # global_batch, micro_batch, dp, accum at save time
    data: dict[str, Any]           # the data position (next_sample_index...) and the script's own
    extra: dict[str, Any]          # whatever the script passed as ``extra``

    @property
    def previous_dp(self) -> int | None:
        """The data-parallel size of the run that saved it."""
        dp = self.batch.get("dp")
        return int(dp) if dp is not None else None


@dataclass
class SaveInfo:
    """One save: its step and how long the caller was blocked (seconds)."""

    step: int
    checkpoint: str
    blocked_s: float
    save_s: float | None = None    # the whole save, once known (at once when synchronous)
    asynchronous: bool = False


@dataclass
class _InFlight:
    info: SaveInfo
    future: Future
    staging: Path
    manifest_extra: dict[str, Any]
    started: float
    committer: threading.Thread | None = None
    error: list[BaseException] = field(default_factory=list)


class Checkpointer:
    """Checkpoints of one job in ``directory`` (its ``OMNI_CHECKPOINT_DIR``), the newest ``keep`` kept.

    ``save(step, model=..., optimizer=..., ...)`` and ``load(model=..., optimizer=..., ...)`` are
    called by every rank. Works without torch.distributed too (one process).
    """

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = False) -> None:
        self.store = CheckpointStore(Path(directory), keep=keep)
        self.async_save = async_save
        self.rank = dist.get_rank() if _distributed() else 0
        self.world_size = dist.get_world_size() if _distributed() else 1
        self._group: Any = None
        self._in_flight: _InFlight | None = None
        self.last: SaveInfo | None = None
        self.on_load: Any = None  # called as on_load(step, previous_dp) after a resume (Job sets it)

    # -- saving ----------------------------------------------------------------------------

    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        batch: dict[str, Any] | None = None,
        data: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        manifest: dict[str, Any] | None = None,
    ) -> SaveInfo:
        """Checkpoint the state after ``step`` (collective); the result says how long this rank was blocked.

        ``scheduler`` and ``scaler`` are anything with ``state_dict()`` (an LR scheduler, a
        ``GradScaler``); ``batch`` is the batch configuration (``global_batch``, ``micro_batch``,
        ``dp``, ``accum``), ``data`` the data position, ``extra`` the script's own picklable state,
        ``manifest`` JSON facts copied into manifest.json for readers without torch (a launcher).
        """
        started = time.perf_counter()
        self._finish_in_flight()
        rng: list[Any] = [capture_rng_state()]
        if self.world_size > 1:
            rng = [None] * self.world_size
            dist.all_gather_object(rng, capture_rng_state())
        blob = io.BytesIO()
        torch.save({
            "format": STATE_FORMAT, "step": step, "rng": rng, "world_size": self.world_size,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "batch": dict(batch or {}), "data": dict(data or {}), "extra": dict(extra or {}),
        }, blob)
        blob.seek(0)
        state = {**self._model_state(model, optimizer), "omni": blob}
        staging = self._staging_path(step)
        manifest_extra = {**(manifest or {}), "batch": dict(batch or {}), "world_size": self.world_size}
        info = SaveInfo(step=step, checkpoint=checkpoint_name(step), blocked_s=0.0, asynchronous=self.async_save)
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(staging), process_group=self._async_group())
            flight = _InFlight(info, future, staging, manifest_extra, started)
            if self.rank == 0:
                flight.committer = threading.Thread(target=self._commit_when_written, args=(flight,),
                                                    name=f"dcp-commit-{step}", daemon=True)
                flight.committer.start()
            self._in_flight = flight
            info.blocked_s = time.perf_counter() - started
        else:
            dcp.save(state, checkpoint_id=str(staging), no_dist=self.world_size == 1 and not _distributed())
            if self.rank == 0:
                self.store.commit(staging, step, manifest_extra)
            if self.world_size > 1:
                dist.barrier()  # nobody reads or resumes before the commit
            info.blocked_s = info.save_s = time.perf_counter() - started
        self.last = info
        return info

    def _model_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        if optimizer is None:
            return {"model": get_model_state_dict(model)}
        model_state, optimizer_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def _staging_path(self, step: int) -> Path:
        """The staging directory, one name agreed by every rank (rank 0 draws it)."""
        self.store.directory.mkdir(parents=True, exist_ok=True)
        tag = [uuid.uuid4().hex[:8] if self.rank == 0 else None]
        if self.world_size > 1:
            dist.broadcast_object_list(tag, src=0)
        return self.store.staging_path(step, str(tag[0]))

    def _async_group(self) -> Any:
        if self.world_size > 1 and self._group is None:
            self._group = dist.new_group(backend="gloo")  # collectives off the training group
        return self._group

    def _commit_when_written(self, flight: _InFlight) -> None:
        try:
            flight.future.result()  # on the coordinator: every rank's files and the metadata are down
            self.store.commit(flight.staging, flight.info.step, flight.manifest_extra)
            flight.info.save_s = time.perf_counter() - flight.started
        except BaseException as exc:  # reported by wait(); the previous checkpoint is intact
            flight.error.append(exc)

    def _finish_in_flight(self) -> None:
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        if flight.committer is not None:
            flight.committer.join()
        else:
            try:
                flight.future.result()
            except BaseException as exc:
                flight.error.append(exc)
            flight.info.save_s = time.perf_counter() - flight.started
        if flight.error:
            raise RuntimeError(f"asynchronous checkpoint {flight.info.checkpoint} failed") from flight.error[0]

    def wait(self) -> SaveInfo | None:
        """Block until the save in flight (if any) is committed (collective); re-raise its error."""
        self._finish_in_flight()
        if self.world_size > 1:
            dist.barrier()  # rank 0 has committed: every rank may now report the step as saved
        return self.last

    def close(self) -> None:
        """Wait for the save in flight and release the checkpoint group."""
        self.wait()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None

    # -- loading ---------------------------------------------------------------------------

    def newest_step(self) -> int:
        """The newest committed step on disk (unverified; 0 when none)."""
        steps = self.store.complete_steps()
        return steps[-1] if steps else 0

    def load(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        restore_rng: bool = True,
    ) -> Resumed | None:
        """Restore the newest checkpoint that verifies into ``model`` (and the rest) in place (collective).

        Rank 0 removes dead staging directories and picks the checkpoint; every rank loads that one.
        A rank that did not exist at save time (a larger DP) keeps its own seeded RNG. Returns
        ``None`` when there is nothing to resume from.
        """
        choice: list[Any] = [None]
        if self.rank == 0:
            for removed in self.store.remove_partial_writes():
                print(f"removed partial checkpoint write {removed.name}", file=sys.stderr, flush=True)
            newest = self.store.newest_verified()
            choice = [str(newest) if newest else None]
        if self.world_size > 1:
            dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        path = Path(choice[0])
        state = {**self._model_state(model, optimizer), "omni": io.BytesIO()}
        dcp.load(state, checkpoint_id=str(path), no_dist=self.world_size == 1 and not _distributed())
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        state["omni"].seek(0)
        saved = torch.load(state["omni"], map_location="cpu", weights_only=False)
        if scheduler is not None and saved.get("scheduler") is not None:
            scheduler.load_state_dict(saved["scheduler"])
        if scaler is not None and saved.get("scaler") is not None:
            scaler.load_state_dict(saved["scaler"])
        if restore_rng and self.rank < len(saved["rng"]):
            restore_rng_state(saved["rng"][self.rank])
        resumed = Resumed(step=int(saved["step"]), path=path, batch=saved["batch"], data=saved["data"], extra=saved["extra"])
        if self.on_load is not None:
            self.on_load(resumed.step, resumed.previous_dp)
        return resumed

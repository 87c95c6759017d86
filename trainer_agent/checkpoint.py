"""Atomic, checksummed, DP-independent checkpoints with rotation and optional asynchronous writes.

Layout: ``checkpoints/step-00000017/`` holding ``state.pt`` (one ``torch.save`` dict) and
``manifest.json`` (format, step, byte size and SHA-256 of ``state.pt``). A checkpoint is written
into ``checkpoints/.tmp-step-00000017-<pid>/``, every file fsynced, then the directory is renamed
into place and the parent fsynced, so a reader sees either nothing or a complete checkpoint. On
load the newest directory whose manifest and checksum verify wins; a broken one is skipped with
a warning. With DDP the replicas are identical, so rank 0 saves one copy in the plain
(unsharded) layout and any DP can load it. See docs/trainer.md for the contents.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHECKPOINT_FORMAT = "omni-trainer-checkpoint/1"
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
# Test hook: pause this many seconds halfway through writing state.pt (so a kill -9 lands mid-write).
TEST_PAUSE_ENV = "OMNI_TRAINER_TEST_SAVE_PAUSE_S"
TEST_PAUSE_STEP_ENV = "OMNI_TRAINER_TEST_SAVE_PAUSE_STEP"


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step``."""
    return f"step-{step:08d}"


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified checkpoint: where it was and what it holds."""

    path: Path
    step: int
    state: dict[str, Any]


def warn(message: str) -> None:
    """Print a warning line on stderr (the launcher's log is what operators read)."""
    print(f"WARNING: {message}", file=sys.stderr, flush=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, payload: bytes, pause_s: float = 0.0) -> None:
    with path.open("wb") as f:
        if pause_s > 0:
            half = len(payload) // 2
            f.write(payload[:half])
            f.flush()
            print(f"TEST-HOOK: checkpoint write paused for {pause_s}s at {path}", file=sys.stderr, flush=True)
            time.sleep(pause_s)
            f.write(payload[half:])
        else:
            f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def snapshot_to_cpu(obj: Any) -> Any:
    """Deep copy of a nested state with every tensor cloned to CPU (the only blocking part of an async save)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot_to_cpu(v) for v in obj)
    return obj


class CheckpointStore:
    """Checkpoints of one run under ``directory``, keeping the newest ``keep``."""

    def __init__(self, directory: Path, keep: int = 3) -> None:
        self.directory = Path(directory)
        self.keep = max(1, keep)

    def complete_steps(self) -> list[int]:
        """Steps of checkpoint directories that have a manifest, oldest first (not yet verified)."""
        if not self.directory.is_dir():
            return []
        steps = []
        for entry in self.directory.iterdir():
            if entry.name.startswith("step-") and (entry / MANIFEST_FILE).is_file():
                try:
                    steps.append(int(entry.name.removeprefix("step-")))
                except ValueError:
                    continue
        return sorted(steps)

    def remove_partial_writes(self) -> list[Path]:
        """Delete temporary directories left by a writer that died mid-save; return what was removed."""
        removed = []
        if self.directory.is_dir():
            for entry in self.directory.iterdir():
                if entry.name.startswith(".tmp-"):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry)
        return removed

    def save(self, state: dict[str, Any], step: int, manifest_extra: dict[str, Any] | None = None) -> tuple[Path, float]:
        """Write ``state`` as the checkpoint of ``step`` atomically; return its path and seconds taken.

        ``manifest_extra`` (batch configuration, seed) goes into manifest.json so tools that do
        not import torch, like the launcher, can read it.
        """
        import torch

        started = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getvalue()
        final = self.directory / checkpoint_name(step)
        tmp = self.directory / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        pause_s = 0.0
        if os.environ.get(TEST_PAUSE_ENV) and os.environ.get(TEST_PAUSE_STEP_ENV, str(step)) == str(step):
            pause_s = float(os.environ[TEST_PAUSE_ENV])
        _write_file(tmp / STATE_FILE, payload, pause_s)
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "files": {STATE_FILE: {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}},
            "saved_unix_s": time.time(),
            **(manifest_extra or {}),
        }
        _write_file(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        if final.exists():  # re-saving the same step (e.g. after a resume); replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.directory)
        self._rotate()
        return final, time.perf_counter() - started

    def _rotate(self) -> None:
        steps = self.complete_steps()
        for step in steps[: -self.keep]:
            shutil.rmtree(self.directory / checkpoint_name(step), ignore_errors=True)

    def newest_manifest(self) -> dict[str, Any] | None:
        """The manifest of the newest complete checkpoint, unverified (cheap; no torch needed)."""
        for step in reversed(self.complete_steps()):
            try:
                return json.loads((self.directory / checkpoint_name(step) / MANIFEST_FILE).read_text())
            except (OSError, ValueError):
                continue
        return None

    def verify(self, path: Path) -> str | None:
        """Why the checkpoint at ``path`` cannot be trusted, or ``None`` when it verifies."""
        try:
            manifest = json.loads((path / MANIFEST_FILE).read_text())
        except (OSError, ValueError) as exc:
            return f"unreadable manifest ({exc})"
        if manifest.get("format") != CHECKPOINT_FORMAT:
            return f"unknown format {manifest.get('format')!r}"
        expected = manifest.get("files", {}).get(STATE_FILE, {})
        try:
            payload = (path / STATE_FILE).read_bytes()
        except OSError as exc:
            return f"unreadable {STATE_FILE} ({exc})"
        if len(payload) != expected.get("bytes"):
            return f"{STATE_FILE} has {len(payload)} bytes, manifest says {expected.get('bytes')}"
        if hashlib.sha256(payload).hexdigest() != expected.get("sha256"):
            return f"{STATE_FILE} checksum mismatch"
        return None

    def load_latest(self, map_location: str = "cpu") -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies; broken newer ones are reported and skipped."""
        import torch

        for step in reversed(self.complete_steps()):
            path = self.directory / checkpoint_name(step)
            problem = self.verify(path)
            if problem is None:
                try:
                    state = torch.load(path / STATE_FILE, map_location=map_location, weights_only=False)
                except Exception as exc:  # a checksum-valid file that still fails to load is broken too
                    problem = f"failed to load ({exc})"
                else:
                    return LoadedCheckpoint(path=path, step=step, state=state)
            warn(f"checkpoint {path.name} is corrupt or incomplete: {problem}; falling back to the previous one")
        return None


class AsyncCheckpointWriter:
    """Writes checkpoints on a background thread; the caller blocks only for the copy to CPU."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self._thread: threading.Thread | None = None
        self.last_error: BaseException | None = None
        self.last_save_s: float | None = None
        self.last_path: Path | None = None

    def submit(self, state: dict[str, Any], step: int, manifest_extra: dict[str, Any] | None = None) -> float:
        """Snapshot ``state`` to CPU and start writing it; return the seconds the caller was blocked."""
        started = time.perf_counter()
        self.wait()
        snapshot = snapshot_to_cpu(state)
        blocked_s = time.perf_counter() - started
        self._thread = threading.Thread(target=self._write, args=(snapshot, step, manifest_extra), name=f"ckpt-{step}", daemon=True)
        self._thread.start()
        return blocked_s

    def _write(self, snapshot: dict[str, Any], step: int, manifest_extra: dict[str, Any] | None) -> None:
        try:
            self.last_path, self.last_save_s = self.store.save(snapshot, step, manifest_extra)
        except BaseException as exc:  # reported by wait(); the previous checkpoint is still intact
            self.last_error = exc

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.last_error is not None:
            error, self.last_error = self.last_error, None
            raise RuntimeError("asynchronous checkpoint write failed") from error

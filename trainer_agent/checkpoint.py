"""The checkpoint directory of a run: layout, atomic commit, verification and rotation, without torch.

Layout: ``checkpoints/step-00000017/`` holding what ``torch.distributed.checkpoint`` wrote
(``.metadata`` and one ``__R_0.distcp`` file per rank that had something to write) and
``manifest.json`` (format, step, byte size and SHA-256 of every file, batch configuration).
All ranks write into ``checkpoints/.tmp-step-00000017-<tag>/``; when every rank's part is down,
rank 0 fsyncs each file, writes the manifest last, renames the directory into place and fsyncs
the parent, so a reader sees either nothing or a complete checkpoint. On load the newest
directory whose manifest and checksums verify wins; a broken one is skipped with a warning. The
saving and loading (which needs torch) is ``trainer_agent.runtime.dcp``; this module is what the
node agent and the launcher read, so it imports nothing heavy. See docs/trainer.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

CHECKPOINT_FORMAT = "omni-dcp-checkpoint/1"
MANIFEST_FILE = "manifest.json"
# A framework that checkpoints its own way (the HF Trainer's checkpoint-N, a Lightning .ckpt)
# names its newest checkpoint here, through ``Job.note_checkpoint`` (trainer_agent/runtime/job.py).
LATEST_FILE = "omni-latest.json"
# Test hook: rank 0 pauses this many seconds after the ranks wrote their files and before the
# manifest (so a kill -9 lands mid-save); only for the step in TEST_PAUSE_STEP_ENV when set.
TEST_PAUSE_ENV = "OMNI_TRAINER_TEST_SAVE_PAUSE_S"
TEST_PAUSE_STEP_ENV = "OMNI_TRAINER_TEST_SAVE_PAUSE_STEP"
_HASH_CHUNK = 1 << 20


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step``."""
    return f"step-{step:08d}"


def warn(message: str) -> None:
    """Print a warning line on stderr (the rank's log is what operators read)."""
    print(f"WARNING: {message}", file=sys.stderr, flush=True)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def newest_step(directory: Path) -> int:
    """The newest checkpoint step in a job's checkpoint directory, whoever wrote it (0 when none):
    the library's committed DCP checkpoints, or what a framework integration noted."""
    steps = CheckpointStore(directory).complete_steps()
    best = steps[-1] if steps else 0
    try:
        noted = json.loads((Path(directory) / LATEST_FILE).read_text(encoding="utf-8"))
        best = max(best, int(noted["step"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return best


def save_pause_s(step: int) -> float:
    """The test hook's pause for ``step`` (0 when unset)."""
    if os.environ.get(TEST_PAUSE_ENV) and os.environ.get(TEST_PAUSE_STEP_ENV, str(step)) == str(step):
        return float(os.environ[TEST_PAUSE_ENV])
    return 0.0


class CheckpointStore:
    """Checkpoints of one run under ``directory``, keeping the newest ``keep``."""

    def __init__(self, directory: Path, keep: int = 3) -> None:
        self.directory = Path(directory)
        self.keep = max(1, keep)

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` lives once committed."""
        return self.directory / checkpoint_name(step)

    def staging_path(self, step: int, tag: str) -> Path:
        """Where the ranks write the checkpoint of ``step`` before it is committed."""
        return self.directory / f".tmp-{checkpoint_name(step)}-{tag}"

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
        """Delete staging directories left by a save that died midway; return what was removed."""
        removed = []
        if self.directory.is_dir():
            for entry in sorted(self.directory.iterdir()):
                if entry.name.startswith(".tmp-"):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry)
        return removed

    def commit(self, staging: Path, step: int, manifest_extra: dict[str, Any] | None = None) -> Path:
        """Seal a fully written staging directory as the checkpoint of ``step`` (rank 0 only).

        Every file is fsynced and checksummed, the manifest is written last, then the directory is
        renamed into place and the older checkpoints beyond ``keep`` are removed.
        """
        files = {}
        for entry in sorted(staging.iterdir()):
            if entry.is_file() and entry.name != MANIFEST_FILE:
                with entry.open("rb") as fh:
                    os.fsync(fh.fileno())
                files[entry.name] = {"bytes": entry.stat().st_size, "sha256": _digest(entry)}
        pause_s = save_pause_s(step)
        if pause_s > 0:
            print(f"TEST-HOOK: checkpoint commit paused for {pause_s}s at {staging}", file=sys.stderr, flush=True)
            time.sleep(pause_s)
        manifest = {"format": CHECKPOINT_FORMAT, "step": step, "files": files, "saved_unix_s": time.time(),
                    **(manifest_extra or {})}
        tmp = staging / f".{MANIFEST_FILE}.tmp"
        with tmp.open("w", encoding="utf-8") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, staging / MANIFEST_FILE)
        fsync_dir(staging)
        final = self.path(step)
        if final.exists():  # re-saving the same step (e.g. after a resume); replace it whole
            shutil.rmtree(final)
        os.rename(staging, final)
        fsync_dir(self.directory)
        self._rotate()
        return final

    def _rotate(self) -> None:
        steps = self.complete_steps()
        for step in steps[: -self.keep]:
            shutil.rmtree(self.path(step), ignore_errors=True)

    def newest_manifest(self) -> dict[str, Any] | None:
        """The manifest of the newest complete checkpoint, unverified (cheap; no torch needed)."""
        for step in reversed(self.complete_steps()):
            try:
                return json.loads((self.path(step) / MANIFEST_FILE).read_text())
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
        files = manifest.get("files") or {}
        if ".metadata" not in files:
            return "no .metadata in the manifest"
        for name, expected in sorted(files.items()):
            try:
                size = (path / name).stat().st_size
            except OSError as exc:
                return f"missing {name} ({exc.strerror})"
            if size != expected.get("bytes"):
                return f"{name} has {size} bytes, manifest says {expected.get('bytes')}"
            if _digest(path / name) != expected.get("sha256"):
                return f"{name} checksum mismatch"
        return None

    def newest_verified(self) -> Path | None:
        """The newest checkpoint that verifies; broken newer ones are reported and skipped."""
        for step in reversed(self.complete_steps()):
            path = self.path(step)
            problem = self.verify(path)
            if problem is None:
                return path
            warn(f"checkpoint {path.name} is corrupt or incomplete: {problem}; falling back to the previous one")
        return None

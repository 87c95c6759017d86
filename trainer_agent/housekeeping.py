"""Checkpoint storage hygiene on the node (docs/storage.md): how much room the runs dir has, and
removing a finished job's run dir when the control plane asks (a ``clean`` command).

No Django, and of the rest of the agent only ``trainer_agent.launch``: the run dir of job ``J``
is ``RUNS/<launch.safe_name(J)>``, the one rule every run dir is named by.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from trainer_agent import launch


def runs_dir_usage(runs_dir: Path) -> dict[str, int]:
    """``{"free_bytes", "total_bytes"}`` of the file system holding ``runs_dir`` (for an
    unprivileged process: what it may still write). A runs dir not made yet reports the file
    system it will be made on. Raises ``OSError`` when nothing of the path exists."""
    path = Path(runs_dir).absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    usage = shutil.disk_usage(path)
    return {"free_bytes": int(usage.free), "total_bytes": int(usage.total)}


def run_dir_of(runs_dir: Path, job: str) -> Path:
    """The job's run dir, refusing (``ValueError``) any name that would not be a directory
    directly inside ``runs_dir`` (``.``, ``..``, an empty name) or a run dir that is a symbolic
    link (removing it could reach outside the runs dir)."""
    name = launch.safe_name(job)
    if name in ("", ".", ".."):
        raise ValueError(f"job name {job!r} does not name a directory inside the runs dir")
    root = Path(runs_dir).resolve()
    target = root / name
    if target.is_symlink():
        raise ValueError(f"{target} is a symbolic link; not removed")
    if target.resolve().parent != root:
        raise ValueError(f"{target} is not inside the runs dir {root}; not removed")
    return target


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (links not followed, hard links counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for top, _dirs, files in os.walk(path, followlinks=False):
        for name in files:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if stat.S_ISREG(st.st_mode) and key not in seen:
                seen.add(key)
                total += st.st_size
    return total


def remove_run_dir(runs_dir: Path, job: str) -> dict[str, int | bool]:
    """Remove the job's run dir (checkpoints, logs, everything): ``{"removed", "bytes_freed"}``.

    ``removed`` is False when there was nothing to remove. A name or path that would reach
    outside ``runs_dir`` raises ``ValueError``; a failure while deleting raises ``OSError`` (the
    agent answers the command as failed, and the control plane tries again later).
    """
    target = run_dir_of(runs_dir, job)
    if not target.exists():
        return {"removed": False, "bytes_freed": 0}
    if not target.is_dir():
        raise ValueError(f"{target} is not a directory; not removed")
    freed = tree_bytes(target)
    shutil.rmtree(target)
    return {"removed": True, "bytes_freed": freed}

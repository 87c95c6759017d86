"""Omni callbacks for training frameworks that own their loop, process group and checkpoints.

- ``trainer_agent.integrations.hf``: ``OmniCallback`` for the Hugging Face ``Trainer``, plus
  ``training_args_kwargs(job)`` and ``resume_checkpoint(job)``.
- ``trainer_agent.integrations.lightning``: ``OmniCallback`` for Lightning, plus
  ``trainer_kwargs(job)`` and ``resume_checkpoint(job)``.

Each reports one step record per optimizer step, turns Omni's stop request (SIGTERM or
control.json, agreed by every rank) into "save the framework's checkpoint and stop", and tells the
node agent the saved step (``job.note_checkpoint``). The submodules import their framework, so
import the one you use. docs/integrations.md has both, with the resume bounds measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer_agent.runtime.job import LATEST_CHECKPOINT_FILE


def noted_checkpoint(checkpoint_dir: Path) -> str | None:
    """The path ``omni-latest.json`` names, if that file parses and the path still exists.

    It is written only after a save finished on every rank, so it is safer than "the newest
    directory", which may be a save cut short."""
    try:
        entry: Any = json.loads((checkpoint_dir / LATEST_CHECKPOINT_FILE).read_text(encoding="utf-8"))
        path = Path(entry["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return str(path) if path.exists() else None


def step_extra(job: Any) -> dict[str, int]:
    """The layout fields every step record carries (as ``job.step`` adds them)."""
    s = job.spec
    return {"dp": s.dp, "accum": s.accum, "micro_batch": s.micro_batch, "global_batch": s.global_batch}


def forget_recomputed_steps(job: Any, resumed_step: int) -> None:
    """On a resume from ``resumed_step``, drop the step records past it (they are recomputed)."""
    if resumed_step > 0:
        job.forget_steps_after(resumed_step)

"""Omni's integration library for training scripts (no Django): ``import trainer_agent.runtime as omni``.

- ``omni.init()`` -> ``Job``: rank, world, DP, accumulation, micro-batch, the checkpoint
  directory, the step reporter (``with job.step(n) as s``), the stop decision agreed by every
  rank (``job.should_stop()``), the new DP on a resize (``job.requested_dp()``), and
  ``job.finish(step)`` for the node agent (runtime/job.py).
- ``omni.Checkpointer`` (``job.checkpointer()``): checkpoints through
  ``torch.distributed.checkpoint``, synchronous or asynchronous, atomic, keep-last-K, corrupt
  newest skipped (runtime/dcp.py).
- ``TrainerRuntime``, the sinks and the control file: the step hooks underneath (runtime/steps.py).

Importing this package first thing in a script (before torch, which takes seconds to import)
under the node agent makes a SIGTERM that arrives meanwhile a stop request rather than death.
docs/researchers.md shows a whole script; the framework callbacks are in
``trainer_agent.integrations``.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from trainer_agent.runtime.steps import (
    CONTROL_CHECKPOINT_AND_STOP,
    CONTROL_RESIZE,
    GATHERED_FIELDS,
    RECORD_FORMAT,
    ControlCommand,
    ControlFile,
    JsonlFileSink,
    MemorySink,
    StepSink,
    TrainerRuntime,
    optimizer_steps,
)

_EARLY: list[str] = []


def _early_signal(signum: int, _frame: object) -> None:
    _EARLY.append(signal.Signals(signum).name)


def early_signals() -> list[str]:
    """SIGTERM/SIGUSR1 received between this import and the runtime's own handlers."""
    return list(_EARLY)


if os.environ.get("OMNI_INTEGRATION") == "omni":
    for _signum in (signal.SIGTERM, signal.SIGUSR1):
        if signal.getsignal(_signum) in (signal.SIG_DFL, None):
            signal.signal(_signum, _early_signal)

_LAZY = {
    "Job": "trainer_agent.runtime.job", "JobSpec": "trainer_agent.runtime.job", "init": "trainer_agent.runtime.job",
    "JobEnvironmentError": "trainer_agent.runtime.job",
    "Checkpointer": "trainer_agent.runtime.dcp", "Resumed": "trainer_agent.runtime.dcp",
    "SaveInfo": "trainer_agent.runtime.dcp", "capture_rng_state": "trainer_agent.runtime.dcp",
    "restore_rng_state": "trainer_agent.runtime.dcp", "exact_ddp": "trainer_agent.runtime.ddp",
}


def __getattr__(name: str) -> Any:
    # The checkpointer imports torch: loaded on first use, so importing the package stays instant.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainer_agent.runtime' has no attribute {name!r}")


__all__ = [
    "CONTROL_CHECKPOINT_AND_STOP", "CONTROL_RESIZE", "GATHERED_FIELDS", "RECORD_FORMAT", "ControlCommand",
    "ControlFile", "JsonlFileSink", "MemorySink", "StepSink", "TrainerRuntime", "early_signals", "optimizer_steps",
    *_LAZY,
]

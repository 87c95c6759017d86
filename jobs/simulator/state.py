"""The simulator's mutable state of a job (``SimJob``) and of a stop its agent is carrying out
(``Op``): what the engine (``jobs.simulator.engine``) plays, the planner's actions change
(``jobs.simulator.apply``) and the result reports (``jobs.simulator.results``).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from jobs.planner.snapshot import Gpu, Job
from jobs.simulator.scenario import JobSpec

EPS = 1e-6


@dataclass(slots=True)
class Op:
    """A stop the agent is carrying out: what to do once the step is done and saved."""

    kind: str  # release | reconfigure | dormant
    after: list[Gpu]
    graceful: bool
    action_kind: str
    cmd_id: str
    deadline_s: float | None
    preemption: bool
    # GPUs someone waits for now: a team below its quota (rule 9) or a reservation whose need
    # has begun (a reclaim at the moment of need). Planned for at once, never batched.
    awaited: bool = False


@dataclass(slots=True)
class SimJob:
    """The simulator's mutable state of one job."""

    spec: JobSpec
    rng: random.Random
    submitted: bool = False
    activity: str = "unsubmitted"  # waiting|loading|computing|saving|stop_saving|idle|done
    terminal: str | None = None  # completed|cancelled
    recovering: bool = False
    dormant: bool = False
    gpus: list[Gpu] = field(default_factory=list)
    incoming: list[Gpu] = field(default_factory=list)
    borrowed: dict[Gpu, str] = field(default_factory=dict)
    dp: int = 0
    accum: int | None = None
    committed: int = 0
    last_ckpt_step: int = 0
    last_ckpt_t: float | None = None
    ever_started: bool = False
    start_s: float | None = None
    end_s: float | None = None
    run_started: float | None = None
    last_resize: float | None = None
    queued_since: float = 0.0
    preemptions: int = 0
    epoch: int = 0
    seg_t0: float = 0.0
    seg_k: int = 0
    seg_step_s: float = 0.0
    seg_nominal_s: float = 0.0
    activity_end: float = 0.0
    op: Op | None = None
    unsaved_useful: float = 0.0
    lost_gpu_s: float = 0.0
    ring: deque = field(default_factory=lambda: deque(maxlen=200))
    save_hist: deque = field(default_factory=lambda: deque(maxlen=20))
    load_hist: deque = field(default_factory=lambda: deque(maxlen=20))
    interval_start: float | None = None
    hold_cause: str | None = None
    version: int = 0
    cached: Job | None = None
    cached_version: int = -1
    cached_at: float = -math.inf
    cmd_seq: int = 0
    repace: bool = False
    idle_until: float | None = None
    parked: list[Gpu] = field(default_factory=list)
    parked_until: float | None = None

    @property
    def rep(self) -> int:
        """GPUs per replica."""
        return self.spec.tp * self.spec.pp

    def live_committed(self, t: float) -> int:
        """Committed steps including whole steps done so far in the current segment."""
        if self.activity != "computing" or self.seg_step_s <= 0:
            return self.committed
        n = min(self.seg_k, int((t - self.seg_t0) / self.seg_step_s + EPS))
        return self.committed + max(0, n)

"""Learning-rate schedule (linear warm-up, cosine decay) with an optional post-resize calibration ramp.

The schedule is a pure function of the step plus a little state (the calibration window), so it
is saved in every checkpoint and a resumed run gets exactly the same learning rates.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class LRSchedule:
    """Learning rate for a (1-based) step; ``calibration_*`` describe the ramp after a resize."""

    base_lr: float
    warmup_steps: int
    total_steps: int
    min_lr_fraction: float = 0.1
    calibration_first_step: int = 0
    calibration_steps: int = 0
    calibration_start_fraction: float = 1.0

    def scheduled_lr(self, step: int) -> float:
        """The lr the plain schedule gives at ``step`` (no calibration)."""
        if step <= self.warmup_steps:
            return self.base_lr * step / max(1, self.warmup_steps)
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.base_lr * self.min_lr_fraction
        return floor + (self.base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def calibration_factor(self, step: int) -> float:
        """Multiplier ramping linearly from ``calibration_start_fraction`` to 1 over the window."""
        if self.calibration_steps <= 0 or step < self.calibration_first_step:
            return 1.0
        done = step - self.calibration_first_step
        if done >= self.calibration_steps:
            return 1.0
        start = self.calibration_start_fraction
        return start + (1.0 - start) * done / self.calibration_steps

    def lr_at(self, step: int) -> float:
        """The lr actually applied at ``step``."""
        return self.scheduled_lr(step) * self.calibration_factor(step)

    def start_calibration(self, first_step: int, steps: int, start_fraction: float) -> None:
        """Begin a calibration ramp at ``first_step`` (used after a resize)."""
        self.calibration_first_step = first_step
        self.calibration_steps = steps
        self.calibration_start_fraction = start_fraction

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the schedule exactly."""
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> LRSchedule:
        """Rebuild a schedule saved by ``state_dict``."""
        return cls(**state)

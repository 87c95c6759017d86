"""Rule 2, entitlements: how many GPUs each reservation guarantees at a time t.

A reservation is active from ``start_s`` to ``end_s``; a recurring one only for the first
``active_s`` of every ``period_s``. While active and while its job is runnable (submitted and
not done) the job is entitled to ``gpus`` GPUs; ``spares`` more sit in the pool to replace
failed ones. A job whose only reservation is recurring needs no GPUs between windows.
"""

from __future__ import annotations

import math

from jobs.planner.snapshot import Reservation

INFINITY = math.inf


def is_active(res: Reservation, t: float) -> bool:
    """Whether ``res`` guarantees capacity at time ``t``."""
    if t < res.start_s:
        return False
    if res.end_s is not None and t >= res.end_s:
        return False
    if res.period_s:
        offset = (t - res.start_s) % res.period_s
        return offset < (res.active_s or res.period_s)
    return True


def window_end_s(res: Reservation, t: float) -> float:
    """When the active window containing ``t`` ends (``inf`` if open-ended)."""
    end = INFINITY if res.end_s is None else res.end_s
    if res.period_s:
        k = math.floor((t - res.start_s) / res.period_s)
        end = min(end, res.start_s + k * res.period_s + (res.active_s or res.period_s))
    return end


def next_start_s(res: Reservation, t: float) -> float:
    """When the entitlement next begins strictly after ``t`` (``inf`` if never).

    If ``res`` is active at ``t`` this is the start of the following window.
    """
    if t < res.start_s:
        return res.start_s
    if not res.period_s:
        return INFINITY
    k = math.floor((t - res.start_s) / res.period_s) + 1
    start = res.start_s + k * res.period_s
    if res.end_s is not None and start >= res.end_s:
        return INFINITY
    return start


def next_boundary_s(res: Reservation, t: float) -> float:
    """The next time strictly after ``t`` at which ``is_active`` may change."""
    if is_active(res, t):
        return window_end_s(res, t)
    return next_start_s(res, t)


def entitled_gpus(res: Reservation, t: float, job_runnable: bool, job_max_gpus: int | None = None) -> int:
    """GPUs ``res`` guarantees its job at ``t`` (0 when inactive or the job is not runnable)."""
    if not job_runnable or not is_active(res, t):
        return 0
    return res.gpus if job_max_gpus is None else min(res.gpus, job_max_gpus)


def pool_size(res: Reservation) -> int:
    """GPUs the reservation sets aside: guaranteed plus hot spares."""
    return res.gpus + res.spares

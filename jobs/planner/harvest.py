"""Rule 3, harvesting: lend reserved-but-idle GPUs, and plan the reclaim ahead of need.

Each reservation with a node pool is summarised as a ``PoolState``: how many of its GPUs are
free, when the entitlement next needs GPUs (``next_need_s``) and how many must be free then
(``must_be_free``). Free pool GPUs beyond that need (hot spares) may be lent until a fault
asks for them; the rest only into a window that fits start-up + load + some steps + the
reclaim lead time (predicted save x safety factor + margin), so the borrower has saved before
the entitlement begins. Filling such known-free windows beats preempting later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jobs.planner.config import PlannerConfig
from jobs.planner.entitlements import entitled_gpus, is_active, next_start_s
from jobs.planner.rhythm import min_loan_window_s, predict, reclaim_lead_time
from jobs.planner.snapshot import Job, Reservation

INFINITY = math.inf


@dataclass(frozen=True, slots=True)
class PoolState:
    """One reservation pool as one planning pass sees it."""

    reservation: Reservation
    healthy_gpus: int
    free_gpus: int
    owner_held: int
    need_now: int
    next_need_s: float
    must_be_free: int
    #: False while the pool is active but its job has not arrived: the need may come any time.
    need_predictable: bool = True

    @property
    def spare_lendable(self) -> int:
        """Free pool GPUs not needed at ``next_need_s``: lendable until a fault needs them."""
        return max(0, self.free_gpus - self.must_be_free)

    @property
    def deficit(self) -> int:
        """GPUs that must come back from borrowers before ``next_need_s``."""
        return max(0, self.must_be_free - self.free_gpus)


def pool_state(
    res: Reservation,
    owner: Job | None,
    now_s: float,
    healthy_gpus: int,
    free_gpus: int,
    owner_busy: bool = False,
) -> PoolState:
    """Summarise a pool: what its entitlement needs now and next, and what is free.

    ``owner`` is None when the reserved job is not (yet) in the snapshot: an active pool then
    has no known need (the job's arrival cannot be predicted) and an inactive one needs its
    full ``gpus`` at its next start.
    """
    cap = res.gpus if owner is None else min(res.gpus, owner.dp_max * owner.tp * owner.pp)
    held = len(owner.holdings) if owner is not None else 0
    need_now = entitled_gpus(res, now_s, owner is not None, cap)
    if need_now > 0:
        deficit_now = 0 if owner_busy else max(0, need_now - held)
        if deficit_now > 0:
            return PoolState(res, healthy_gpus, free_gpus, held, need_now, now_s, deficit_now)
        if res.period_s:
            nxt = next_start_s(res, now_s)
            return PoolState(res, healthy_gpus, free_gpus, held, need_now, nxt, cap if nxt < INFINITY else 0)
        return PoolState(res, healthy_gpus, free_gpus, held, need_now, INFINITY, 0)
    if owner is None and is_active(res, now_s):
        return PoolState(res, healthy_gpus, free_gpus, held, 0, INFINITY, 0, need_predictable=False)
    nxt = next_start_s(res, now_s) if not is_active(res, now_s) else INFINITY
    if nxt == INFINITY:
        return PoolState(res, healthy_gpus, free_gpus, held, 0, INFINITY, 0)
    still_held = 0 if res.period_s else held
    return PoolState(res, healthy_gpus, free_gpus, held, 0, nxt, max(0, cap - still_held))


def lendable_gpus(pool: PoolState, borrower: Job, dp: int, now_s: float, config: PlannerConfig) -> tuple[int, float, float]:
    """How many of the pool's free GPUs ``borrower`` at ``dp`` may borrow, the window, and the minimum.

    Returns ``(gpus, window_s, needed_s)``: all free GPUs when the window to ``next_need_s``
    fits ``min_loan_window_s``, otherwise only the spare ones.
    """
    window_s = pool.next_need_s - now_s
    needed_s = min_loan_window_s(borrower, dp, config)
    if config.reclaim_mode == "kill":
        needed_s = 0.0
    elif not pool.need_predictable and not fits_in_grace(borrower, config):
        # The reserved job may arrive at any moment: lend only to a borrower that can finish
        # its step and save within reclaim_grace_s of being asked.
        return 0, window_s, needed_s
    if window_s > 0 and window_s >= needed_s:
        return pool.free_gpus, window_s, needed_s
    return pool.spare_lendable, window_s, needed_s


def fits_in_grace(borrower: Job, config: PlannerConfig) -> bool:
    """Whether ``borrower`` can finish its step and save within ``reclaim_grace_s``."""
    p = predict(borrower, config)
    return p.step_s + p.save_s * config.safety_factor <= config.reclaim_grace_s


def reclaim_due_s(borrower: Job, pool: PoolState, config: PlannerConfig) -> float:
    """When ``borrower`` must be told to give the pool's GPUs back.

    ``next_need_s - lead time`` gracefully; at the moment of need in ``kill`` mode.
    """
    if config.reclaim_mode == "kill":
        return pool.next_need_s
    return pool.next_need_s - reclaim_lead_time(borrower, config)

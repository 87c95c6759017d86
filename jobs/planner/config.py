"""Planner knobs, with the defaults the scenario format documents.

``reclaim_mode`` is what separates the project's policy from the ``kill_preempt`` baseline:
``graceful`` reclaims a loan ahead of need so the borrower has saved by then; ``kill`` lends
the same way but takes GPUs back at the moment of need by killing the borrower.

``wall_clock_zone`` says what the planner's clock is, for its sentences: ``None`` in the
simulator (seconds from the scenario's start, written ``t=123s``), a time zone name in
production (Unix seconds, written as that zone's clock time, e.g. ``14:05 UTC``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """Every tunable the planner reads; frozen so a pass cannot change it."""

    safety_factor: float = 1.5
    min_run_s: float = 7200.0
    reclaim_grace_s: float = 60.0
    heartbeat_timeout_s: float = 30.0
    #: Added to every reclaim lead time on top of step + save (rhythm.reclaim_lead_time).
    reclaim_margin_s: float = 30.0
    #: Process start-up allowance before a (re)started job loads its checkpoint.
    startup_s: float = 30.0
    #: A loan is only made into a window fitting start-up + load + this many steps + save.
    min_loan_steps: int = 20
    #: A pool's window that ends in a reclaim is lent to a job that would not finish in it only
    #: if the job takes at least this share of the pool's healthy GPUs: each such borrower is
    #: stopped at the window's end, so a window is cut into at most 1/share stopped loans
    #: (``harvest.takes_window``). The GPUs it keeps from smaller borrowers go to running jobs
    #: that grow into the window (``growth``). 0: any borrower.
    loan_share_min: float = 0.125
    #: A job is not resized again within this many seconds unless forced.
    resize_hysteresis_s: float = 1800.0
    #: Growing must save at least this multiple of its save+load cost over the remaining run.
    grow_gain_factor: float = 2.0
    #: A node is a straggler when its speed factor is at least this.
    straggler_factor: float = 1.2
    #: Migration must save at least this multiple of its cost.
    migrate_gain_factor: float = 2.0
    #: An idle phase is lent out only if at least this much of it remains (rule 3).
    idle_lend_min_s: float = 300.0
    #: Waiting this long raises a job's queue standing by one class step (rule 8).
    ageing_s: float = 7200.0
    #: A best-effort job that has waited this long queues as a regular job by right, standing as
    #: one that came this long after it began waiting, and its run then has ``min_run_s``
    #: (``starvation.promoted``): ageing alone keeps it behind every regular job, for ever on a
    #: cluster whose regular queue never empties. 0: never.
    promote_after_s: float = 172800.0
    #: Within the regular class the queue goes by when a job began waiting plus this many
    #: seconds per second of its remaining run at its preferred size (``starvation.queue_order_s``):
    #: a short job goes ahead of a long one that began waiting up to this fraction of the
    #: difference in their runs earlier. 0: first come, first served.
    queue_length_weight: float = 0.25
    #: ``graceful`` (omni) or ``kill`` (the kill_preempt baseline).
    reclaim_mode: str = "graceful"
    #: Whether a pool whose job may come at any moment (its job not yet arrived) lends also to
    #: borrowers that cannot save within ``reclaim_grace_s``: if the job comes, such a borrower
    #: is stopped without a checkpoint, so the job is never short, and loses the steps since
    #: its last periodic save (harvest.may_borrow_unannounced).
    lend_past_grace: bool = True
    #: The most seconds of steps such a borrower may stand to lose: its checkpoint interval at
    #: its smallest size (``every_steps`` x step time) must not be longer.
    loan_loss_max_s: float = 3600.0
    #: ``None``: scenario seconds (``t=123s``); a zone name: Unix seconds shown as clock times.
    wall_clock_zone: str | None = None
    #: The free runs-dir space under which a node takes no new work. The snapshot's builder
    #: applies it (``Node.low_disk``); the planner only names it in its sentences.
    min_free_disk_bytes: int = 2 * 1024**3
    #: Teams' past usage decays with this half-life for fair share among borrowers (a week).
    fair_share_half_life_s: float = 604800.0
    #: Whether a pass words its ``hold`` actions. The simulator turns it off when it records no
    #: events: it reads a hold only for its event log, and a long queue's holds, each with its
    #: sentence, were most of a replay's time. Every other decision is the same either way.
    explain_holds: bool = True

    def with_overrides(self, overrides: dict[str, Any]) -> PlannerConfig:
        """A copy with scenario ``policy`` keys applied."""
        return replace(self, **overrides)

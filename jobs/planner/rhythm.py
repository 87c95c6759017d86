"""Rule 1, rhythm prediction: what a job's steps, saves and loads will cost.

In steady state a job's step time is very regular, so the planner keeps the last
``RHYTHM_WINDOW`` (200) measured step times and plans with ``mean * safety_factor`` (or
``mean + 3 stdev`` when that is more: an erratic job gets a wider margin). Save
and load costs come from measured history when there is one and from the job's declared
checkpoint spec otherwise. Idle phases are the measured ones (or the spec's), counted from the
committed step count and each phase's offset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jobs.planner.config import PlannerConfig
from jobs.planner.kept import KeptById
from jobs.planner.snapshot import RHYTHM_WINDOW, Job


@dataclass(frozen=True, slots=True)
class RhythmPrediction:
    """Planning figures for one job at its current size (seconds)."""

    mean_step_s: float
    stdev_step_s: float
    step_s: float
    save_s: float
    load_s: float
    samples: int


def ring_push(ring: tuple[float, ...], value: float, window: int = RHYTHM_WINDOW) -> tuple[float, ...]:
    """The ring with ``value`` appended, keeping only the last ``window`` entries."""
    ring = ring + (value,)
    return ring[-window:] if len(ring) > window else ring


def mean_stdev(values: tuple[float, ...]) -> tuple[float, float]:
    """Mean and population standard deviation (0, 0 for no values)."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0
    mu = sum(values) / n
    var = sum((v - mu) * (v - mu) for v in values) / n
    return mu, math.sqrt(var)


def step_time_at(job: Job, dp: int, base_step_s: float | None = None, base_dp: int | None = None) -> float:
    """Step time at ``dp`` replicas from a step time measured at ``base_dp`` (FORMAT.md model).

    ``step(d) = step_s * (comm_fraction + (1 - comm_fraction) * dp_ref / d)``.
    """
    base = job.step_s if base_step_s is None else base_step_s
    ref = job.dp if base_dp is None else base_dp
    cf = job.comm_fraction
    nominal_ref = cf + (1.0 - cf) * job.dp / ref
    nominal_d = cf + (1.0 - cf) * job.dp / max(1, dp)
    return base * nominal_d / nominal_ref


_CACHE = KeptById()  # (job, config, prediction)


def predict(job: Job, config: PlannerConfig) -> RhythmPrediction:
    """Predicted step/save/load seconds for ``job`` at its current DP.

    Measured step times are used when there are any (they were measured at the current DP);
    otherwise the spec's ``step_s`` scaled to the current DP. Planning step = mean x safety.
    Memoised on the identity of the (immutable) job and config objects.
    """
    hit = _CACHE.get(id(job))
    if hit is not None and hit[0] is job and hit[1] is config:
        return hit[2]
    if len(_CACHE) > 50_000:
        _CACHE.clear()
    return _CACHE.keep(job, config, _predict(job, config))[2]


def _predict(job: Job, config: PlannerConfig) -> RhythmPrediction:
    mu, sigma = mean_stdev(job.rhythm.step_s[-RHYTHM_WINDOW:])
    if mu <= 0.0:
        mu = step_time_at(job, job.current_dp or job.dp)
        sigma = 0.0
    save_hist = job.rhythm.save_s[-20:]
    load_hist = job.rhythm.load_s[-20:]
    save_s = max(save_hist) if save_hist else job.checkpoint.save_s
    load_s = max(load_hist) if load_hist else job.checkpoint.load_s
    return RhythmPrediction(
        mean_step_s=mu,
        stdev_step_s=sigma,
        # Mean x safety, wider for an erratic job: at least three deviations above the mean.
        step_s=max(mu * config.safety_factor, mu + 3.0 * sigma),
        save_s=save_s,
        load_s=load_s,
        samples=len(job.rhythm.step_s),
    )


def widened_words(prediction: RhythmPrediction, config: PlannerConfig) -> str:
    """A sentence when the planning step was widened for an erratic job (else empty): what an
    audit row adds so that a wider margin is never silent."""
    if prediction.samples and prediction.step_s > prediction.mean_step_s * config.safety_factor + 1e-9:
        return (f" Its step times vary (mean {prediction.mean_step_s:.2g}s ± {prediction.stdev_step_s:.2g}s over "
                f"{prediction.samples} steps), so its margin is widened: steps planned at "
                f"{prediction.step_s:.2g}s, three deviations above the mean.")
    return ""


def next_idle_phase(job: Job) -> tuple[int, float] | None:
    """The next idle phase as (step it starts after, duration_s), or None.

    An idle phase with ``every_steps = N`` starts after every N-th committed step (counted
    from its ``offset_steps``).
    """
    best: tuple[int, float] | None = None
    for phase in job.idle_phases:
        at = phase.next_after(job.committed_steps)
        if at > job.total_steps:
            continue
        if best is None or at < best[0]:
            best = (at, phase.duration_s)
    return best


def stop_time_s(job: Job, config: PlannerConfig, prediction: RhythmPrediction | None = None) -> float:
    """Seconds from being asked to stop until the job's GPUs are free.

    One predicted step to finish the step in flight plus predicted save x safety factor; a
    signal-mode job is given its ``grace_s`` between SIGTERM and SIGKILL.
    """
    if job.signal:
        return job.grace_s
    p = prediction or predict(job, config)
    return p.step_s + p.save_s * config.safety_factor


def expected_stop_s(job: Job, config: PlannerConfig) -> float:
    """The stop time without its safety margin: the mean step plus the measured save (a signal
    job's grace). What a reclaim's outcome is scored against (docs/rhythm.md)."""
    if job.signal:
        return job.grace_s
    p = predict(job, config)
    return p.mean_step_s + p.save_s


def reclaim_lead_time(job: Job, config: PlannerConfig, prediction: RhythmPrediction | None = None) -> float:
    """Seconds before need a borrower must be told to give GPUs back.

    Enough that the predicted stop (the planning step plus the measured save) ends a margin
    before the need, and that a save taking ``safety_factor`` times as long still ends within
    ``reclaim_grace_s`` of it: ``max(step + save, step + save x safety - grace) + margin``. The
    safety factor covers a slow save, which the grace is for; asking earlier only leaves the
    GPUs idle before the need whenever the save takes its usual time. A signal-mode job is
    given its whole ``grace_s`` (its saves are not seen) ahead of the need.
    """
    p = prediction or predict(job, config)
    if job.signal:
        return job.grace_s + config.reclaim_margin_s
    worst = stop_time_s(job, config, p) - config.reclaim_grace_s
    return max(p.step_s + p.save_s, worst) + config.reclaim_margin_s


def lead_words(job: Job, config: PlannerConfig, prediction: RhythmPrediction | None = None) -> str:
    """How ``reclaim_lead_time`` was made up, for a reclaim's sentence."""
    if job.signal:
        return "its grace + margin"
    p = prediction or predict(job, config)
    if p.step_s + p.save_s >= stop_time_s(job, config, p) - config.reclaim_grace_s:
        return (f"step + predicted save {p.save_s:.0f}s + margin; a save {config.safety_factor:g}x as long "
                f"still ends within the {config.reclaim_grace_s:.0f}s grace")
    return (f"step + predicted save {p.save_s:.0f}s x safety {config.safety_factor:g} + margin, less the "
            f"{config.reclaim_grace_s:.0f}s grace")


def loan_steps(job: Job, config: PlannerConfig) -> int:
    """The steps a loan's window must fit: ``min_loan_steps``, or fewer for a job with fewer left
    (it finishes in the window: ``harvest.finish_window_s``)."""
    return min(config.min_loan_steps, job.remaining_steps)


def min_loan_window_s(job: Job, dp: int, config: PlannerConfig) -> float:
    """The shortest window worth lending into for ``job`` at ``dp`` replicas.

    Start-up + checkpoint load + ``loan_steps`` predicted steps + the reclaim lead time.
    """
    p = predict(job, config)
    step = step_time_at(job, dp) * config.safety_factor
    return config.startup_s + p.load_s + loan_steps(job, config) * step + reclaim_lead_time(job, config, p)

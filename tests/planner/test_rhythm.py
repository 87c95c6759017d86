"""Rule 1: rhythm prediction."""

from __future__ import annotations

import pytest

from jobs.planner import PlannerConfig
from jobs.planner.rhythm import (
    mean_stdev,
    next_idle_phase,
    predict,
    reclaim_lead_time,
    ring_push,
    step_time_at,
)
from jobs.planner.snapshot import IdlePhase, Rhythm
from tests.planner.factory import job


def test_prediction_is_measured_mean_times_safety_factor() -> None:
    j = job("a", step_times=(1.9, 2.0, 2.1))
    p = predict(j, PlannerConfig(safety_factor=1.5))
    assert p.mean_step_s == pytest.approx(2.0)
    assert p.step_s == pytest.approx(3.0)
    assert p.stdev_step_s == pytest.approx(mean_stdev((1.9, 2.0, 2.1))[1])
    assert p.samples == 3


def test_an_erratic_job_is_planned_three_deviations_above_its_mean() -> None:
    j = job("a", step_times=(1.0, 2.0, 3.0))
    p = predict(j, PlannerConfig(safety_factor=1.5))
    assert p.step_s == pytest.approx(2.0 + 3 * mean_stdev((1.0, 2.0, 3.0))[1]) and p.step_s > 3.0


def test_ring_keeps_only_the_last_200_step_times() -> None:
    ring: tuple[float, ...] = ()
    for i in range(250):
        ring = ring_push(ring, float(i))
    assert len(ring) == 200
    assert ring[0] == 50.0 and ring[-1] == 249.0


def test_prediction_falls_back_to_spec_scaled_to_current_dp() -> None:
    from tests.planner.factory import gpus_on

    j = job("a", dp=4, dp_min=2, dp_max=4, global_batch=64, step_s=10.0, comm_fraction=0.2,
            gpus=gpus_on("r0s0n0", "r0s0n1"))
    p = predict(j, PlannerConfig(safety_factor=1.0))
    # 2 replicas instead of 4: 10 * (0.2 + 0.8 * 4/2) = 18
    assert p.mean_step_s == pytest.approx(18.0)
    assert step_time_at(j, 4) == pytest.approx(10.0)


def test_save_and_load_prefer_measured_history_over_spec() -> None:
    j = job("a", save_s=10.0, load_s=20.0)
    assert predict(j, PlannerConfig()).save_s == 10.0
    from dataclasses import replace

    measured = replace(j, rhythm=Rhythm(save_s=(12.0, 14.0), load_s=(25.0,)))
    p = predict(measured, PlannerConfig())
    assert (p.save_s, p.load_s) == (14.0, 25.0)


def test_next_idle_phase_follows_the_next_multiple_of_its_step_count() -> None:
    j = job("a", committed_steps=450, idle_phases=(IdlePhase(every_steps=200, duration_s=600.0),))
    assert next_idle_phase(j) == (600, 600.0)
    assert next_idle_phase(job("b")) is None


def test_reclaim_lead_time_covers_the_predicted_stop_and_a_slow_save_within_the_grace() -> None:
    config = PlannerConfig(safety_factor=1.5, reclaim_margin_s=30.0, reclaim_grace_s=60.0)
    # step 2 s x 1.5 planned. A 20 s save: the predicted stop (3 + 20) decides; a 30 s save
    # would end 7 s before the need, well within the grace.
    quick = job("a", save_s=20.0, step_times=(2.0, 2.0))
    assert reclaim_lead_time(quick, config) == pytest.approx(3.0 + 20.0 + 30.0)
    # A 200 s save: at 1.5x it takes 300 s, which must end within the grace of the need.
    slow = job("b", save_s=200.0, step_times=(2.0, 2.0))
    assert reclaim_lead_time(slow, config) == pytest.approx(3.0 + 200.0 * 1.5 - 60.0 + 30.0)
    # A signal-mode job is given its whole grace_s ahead of the need.
    sig = job("c", integration="signal", grace_s=45.0)
    assert reclaim_lead_time(sig, config) == pytest.approx(45.0 + 30.0)


def test_a_widened_margin_is_said_in_words() -> None:
    from jobs.planner.rhythm import widened_words

    config = PlannerConfig(safety_factor=1.5)
    steady = predict(job("a", step_times=(1.9, 2.0, 2.1)), config)
    erratic = predict(job("b", step_times=(1.0, 2.0, 3.0)), config)
    assert widened_words(steady, config) == ""
    words = widened_words(erratic, config)
    assert words.startswith(" Its step times vary (mean 2s ± 0.82s over 3 steps), so its margin is widened")

"""How the planner's sentences write times, sizes and durations (jobs/planner/wording.py)."""

from __future__ import annotations

import re
from datetime import UTC, datetime

from jobs.planner import PlannerConfig, Reservation, plan
from jobs.planner.wording import duration_words, fmt_t, gpu_shape, returning_sentence
from tests.planner.factory import cluster, gpus_on, job, snapshot

# A bare Unix second in a sentence, the way the first version wrote them.
EPOCH_T = re.compile(r"t=\d{9,}s")
NOW = datetime(2026, 12, 3, 13, 53, tzinfo=UTC).timestamp()
PRODUCTION = PlannerConfig(wall_clock_zone="UTC")


def test_the_simulator_keeps_scenario_seconds() -> None:
    assert fmt_t(123.4) == "t=123s"
    assert fmt_t(float("inf")) == "never"


def test_production_times_are_clock_times_with_the_distance_from_the_decision() -> None:
    assert fmt_t(NOW + 12 * 60, NOW, "UTC") == "14:05 UTC (12 min after this decision)"
    assert fmt_t(NOW - 3600, NOW, "UTC") == "12:53 UTC (1 h before this decision)"


def test_a_time_on_another_day_names_the_date() -> None:
    assert fmt_t(NOW + 20 * 3600, NOW, "UTC") == "09:53 UTC on Dec 4 (20 h after this decision)"
    new_year = datetime(2027, 1, 1, 9, 0, tzinfo=UTC).timestamp()
    assert fmt_t(new_year, NOW, "UTC").startswith("09:00 UTC on Jan 1 2027 (")


def test_a_zone_other_than_utc_says_which() -> None:
    assert fmt_t(NOW + 12 * 60, NOW, "Europe/Berlin") == "15:05 CET (12 min after this decision)"


def test_sizes_and_durations_read_plainly() -> None:
    assert gpu_shape(8, 1, 2) == "16 GPUs (2 replicas of 8, each on one node)"
    assert gpu_shape(8, 1, 1) == "8 GPUs on one node"
    assert gpu_shape(4, 2, 2) == "16 GPUs (2 replicas of 8, in groups of 4 on one node)"
    assert gpu_shape(1, 1, 4) == "4 GPUs"
    assert (duration_words(42), duration_words(2400), duration_words(7200), duration_words(93784)) == (
        "42 s", "40 min", "2 h", "1 d 2 h")


def _window_hold(now_s: float, config: PlannerConfig | None = None) -> str:
    res = Reservation("hourly", "crit", gpus=8, start_s=now_s - 3000.0, period_s=3600.0, active_s=2400.0,
                      nodes=("r0s0n0",))
    snap = snapshot(cluster(switches=1, per_switch=2), [job("crit", "critical", dp=1)], (res,))
    (hold,) = plan(snap, now_s, config).by_kind("hold")
    return hold.reason.text


def test_production_sentences_never_show_epoch_seconds() -> None:
    text = _window_hold(NOW, PRODUCTION)
    assert not EPOCH_T.search(text)
    assert "the next one opens at 14:03 UTC (10 min after this decision)" in text


def test_simulator_sentences_keep_their_seconds() -> None:
    assert "the next one opens at t=4200s" in _window_hold(3600.0)


def test_a_loans_end_reads_as_a_clock_time_in_production() -> None:
    res = Reservation("vlm-window", "vlm", gpus=16, start_s=NOW + 7200.0, nodes=("r0s1n0", "r0s1n1"))
    general = gpus_on("r0s0n0", "r0s0n1", "r0s0n2", "r0s0n3", "r0s1n2", "r0s1n3")  # only the pool is free
    snap = snapshot(cluster(), [job("busy", gpus=general, dp=6), job("sft", dp=2, step_s=1.0)], (res,))
    (lend,) = plan(snap, NOW, PRODUCTION).by_kind("lend")
    assert "The loan ends at 15:53 UTC (2 h after this decision)" in lend.reason.text
    assert not EPOCH_T.search(lend.reason.text)


def test_one_gpu_is_one_gpu_in_every_sentence_of_a_one_gpu_job() -> None:
    """A 1-GPU job's start and its reclaim read "1 GPU", never "1 GPUs"."""
    nodes = cluster(switches=1, per_switch=2)
    small = job("small", "regular", dp=1, dp_max=1, tp=1, global_batch=8)
    (start,) = plan(snapshot(nodes, [small]), NOW, PRODUCTION).by_kind("place")
    assert "Started on 1 replica (1 GPU, " in start.reason.text and "1 GPU was free" in start.reason.text
    assert "1 GPUs" not in start.reason.text
    pair = job("pair", "regular", dp=2, dp_max=2, tp=1, global_batch=8)
    (start,) = plan(snapshot(nodes, [pair]), NOW, PRODUCTION).by_kind("place")
    assert "(2 GPUs, " in start.reason.text and "2 GPUs were free" in start.reason.text


def test_gpus_on_their_way_back_agree_with_their_count_and_their_jobs() -> None:
    """A hold read "1 GPU are on their way back from ablation-lr, which save a checkpoint first"."""
    one = returning_sentence(1, ["ablation-lr"], 1, 1, 1)
    assert one == "1 GPU is on its way back from ablation-lr, which saves a checkpoint first; then it starts with 1 GPU."
    many = returning_sentence(4, ["a", "b"], 1, 1, 4)
    assert many.startswith("4 GPUs are on their way back from a and b, which save a checkpoint first;"), many

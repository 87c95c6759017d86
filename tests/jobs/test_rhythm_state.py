"""The measured rhythm, record by record (jobs/rhythm.py, no database): the ring and its
statistics, a DP change, resumes, gaps and the idle phases that recur, the shares of each step,
prediction errors, stragglers and their recovery, and the JSON round trip."""

from __future__ import annotations

import json
import random
import re

import pytest

from jobs.rhythm import RHYTHM_WINDOW, STRAGGLER_WINDOW, RhythmState, bubble_share


def records(first: int, last: int, *, step_s: float = 1.0, start_at: float = 1000.0, dp: int = 2,
            pause_after: dict[int, float] | None = None, ranks: list[float] | None = None, **extra) -> list[dict]:
    out, at = [], start_at
    for step in range(first, last + 1):
        at += step_s + (pause_after or {}).get(step - 1, 0.0)
        record = {"step": step, "step_s": step_s, "at": at, "dp": dp, "data_wait_s": 0.05 * step_s,
                  "comm_s": 0.15 * step_s, "compute_s": 0.8 * step_s, **extra}
        if ranks is not None:
            record["rank_compute_s"] = ranks
        out.append(record)
    return out


def test_the_ring_keeps_the_last_window_at_the_current_dp():
    state = RhythmState()
    rng = random.Random(3)
    batch = [dict(r, step_s=1.0 + rng.uniform(-0.05, 0.05)) for r in records(1, 250)]
    assert state.observe(batch, dp=2) == 250
    assert len(state.step_s) == RHYTHM_WINDOW and state.last_step == 250
    assert state.mean_s == pytest.approx(1.0, abs=0.01) and 0.01 < state.stdev_s < 0.04
    assert state.observe(records(240, 250), dp=2) == 0  # repeats change nothing
    state.observe(records(251, 255, step_s=0.6, dp=4, start_at=2000.0), dp=4)
    assert state.dp == 4 and state.step_s == [0.6] * 5  # measured at the new size only


def test_a_resume_from_an_older_checkpoint_measures_the_steps_again():
    state = RhythmState()
    state.observe(records(1, 30), dp=2)
    state.observe(records(21, 25, start_at=5000.0), dp=2)
    assert state.last_step == 25 and state.records == 35  # newer records of older steps: a rewind


def test_recurring_pauses_and_checkpoints_become_idle_phases():
    pauses = {s: 30.0 for s in (30, 70, 110, 150)} | {s: 4.0 for s in (20, 40, 60, 80, 100, 120, 140, 160)}
    state = RhythmState()
    state.observe(records(1, 170, pause_after=pauses), dp=2, checkpoint_every=20)
    kinds = {p.kind: p for p in state.phases(checkpoint_every=20)}
    assert kinds["pause"].every_steps == 40 and kinds["pause"].duration_s == pytest.approx(30.0)
    assert kinds["checkpoint"].every_steps == 20 and kinds["checkpoint"].duration_s == pytest.approx(4.0)
    # One gap is not a rhythm.
    once = RhythmState()
    once.observe(records(1, 60, pause_after={30: 30.0}), dp=2)
    assert once.phases() == []


def test_data_stalls_are_gaps_of_their_own_and_shares_follow_the_steps():
    state = RhythmState()
    state.observe(records(1, 100), dp=2)
    assert state.shares["data_wait"] == pytest.approx(0.05, abs=0.01)
    stalled = records(101, 140, step_s=4.0, start_at=3000.0)
    for r in stalled:
        r["data_wait_s"], r["compute_s"], r["comm_s"] = 3.0, 0.8, 0.2
    state.observe(stalled, dp=2)
    assert state.shares["data_wait"] > 0.6
    assert {g.kind for g in state.gaps} == {"data_stall"}


def test_prediction_errors_are_small_for_a_steady_job_and_large_for_an_erratic_one():
    steady, erratic = RhythmState(), RhythmState()
    rng = random.Random(1)
    steady.observe([dict(r, step_s=1.0 + rng.uniform(-0.02, 0.02)) for r in records(1, 100)], dp=2)
    erratic.observe([dict(r, step_s=rng.choice([0.5, 1.0, 2.0])) for r in records(1, 100)], dp=2)
    p50, p95 = steady.error_percentiles()
    assert p95 < 0.05 and p50 < p95
    assert erratic.error_percentiles()[1] > 0.5
    assert RhythmState().error_percentiles() == (None, None)


def test_a_rank_consistently_slower_than_the_median_is_a_straggler_until_it_recovers():
    state = RhythmState()
    state.observe(records(1, STRAGGLER_WINDOW - 1, ranks=[0.8, 0.8, 1.6, 0.8]), dp=4)
    assert state.stragglers(1.2) == {}  # not a whole window yet
    state.observe(records(STRAGGLER_WINDOW, STRAGGLER_WINDOW + 5, start_at=5000, ranks=[0.8, 0.8, 1.6, 0.8]), dp=4)
    assert state.stragglers(1.2) == {2: pytest.approx(2.0)}
    assert not state.recovered(2, 1.2)
    # An occasional slow step is no straggler.
    noisy = RhythmState()
    rows = records(1, 40, ranks=[0.8, 0.8, 0.8, 0.8])
    for r in rows[::5]:
        r["rank_compute_s"] = [0.8, 0.8, 1.6, 0.8]
    noisy.observe(rows, dp=4)
    assert noisy.stragglers(1.2) == {}
    state.observe(records(100, 100 + STRAGGLER_WINDOW, start_at=9000, ranks=[0.8, 0.8, 0.82, 0.8]), dp=4)
    assert state.stragglers(1.2) == {} and state.recovered(2, 1.2)


def test_the_state_round_trips_through_json():
    state = RhythmState()
    state.observe(records(1, 80, pause_after={20: 9.0, 40: 9.0, 60: 9.0}, ranks=[1.0, 1.1],
                          rank_nodes=["n1", "n2"]), dp=2)
    state.observe_checkpoint(save_s=2.5, load_s=4.0)
    again = RhythmState.from_json(json.loads(json.dumps(state.as_json())))
    assert again == state and again.rank_nodes == ["n1", "n2"] and again.save_s == [2.5]
    assert RhythmState.from_json(None) == RhythmState()


def test_bubble_share_is_the_pipeline_formula():
    assert bubble_share(1, 8) == 0.0
    assert bubble_share(4, 8) == pytest.approx(3 / 11)


def test_the_diagnosis_says_where_the_time_goes_and_why_the_busy_share_fell():
    state = RhythmState()
    assert state.diagnosis() is None
    state.observe(records(1, 300), dp=2)
    assert state.diagnosis() == "Each step is 80% compute, 5% data wait and 15% communication."
    assert state.diagnosis(bubble=0.27).startswith("Each step is 80% compute, 5% data wait and 15% communication, "
                                                    "of which about 27% is pipeline bubble")
    stalled = records(301, 330, step_s=2.0, start_at=9000.0)
    for r in stalled:
        r["data_wait_s"], r["compute_s"], r["comm_s"] = 1.0, 0.8, 0.2
    state.observe(stalled, dp=2)
    words = state.diagnosis(clock=lambda t: f"t={t:.0f}")
    assert re.match(r"GPU busy time fell from (7[5-9]|80)% to \d+% of each step at t=\d+: data wait rose from \d+% to \d+%\.$", words), words
    assert " of each step at t=" in words
    # Back to normal: the drop is forgotten, the shares speak again.
    state.observe(records(331, 600, start_at=20000.0), dp=2)
    assert state.drop is None and state.diagnosis().startswith("Each step is 8")
    heavy = RhythmState()
    rows = records(1, 50)
    for r in rows:
        r["data_wait_s"], r["compute_s"], r["comm_s"] = 0.4, 0.5, 0.1
    heavy.observe(rows, dp=2)
    assert heavy.diagnosis().endswith("data wait and 10% communication: the input pipeline holds the GPUs back.")


def _losses(rows: list[dict], start: float, slope: float = -0.001, noise: float = 0.002, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    for i, r in enumerate(rows):
        r["loss"] = start + slope * i + rng.uniform(-noise, noise)
    return rows


def test_after_a_resize_the_loss_and_the_batch_are_checked():
    state = RhythmState()
    before = _losses(records(1, 40, accum=4, micro_batch=4, global_batch=32, run="a"), 2.0)
    state.observe(before, dp=2)
    after = _losses(records(41, 50, start_at=5000.0, dp=4, accum=2, micro_batch=4, global_batch=32, run="b"), 1.96)
    state.observe(after, dp=4)
    (finding,) = state.findings
    assert finding["healthy"] and finding["kind"] == "resize" and finding["step"] == 41
    assert finding["text"].startswith("After the resize at step 41 (dp 2 -> 4) the run is healthy: loss ")
    assert "global batch 32 kept (accumulation 4 -> 2)" in finding["text"] and "steps went on from 41" in finding["text"]


def test_a_loss_spike_or_a_changed_batch_after_a_resume_is_reported():
    state = RhythmState()
    state.observe(_losses(records(1, 40, accum=4, micro_batch=4, global_batch=32, run="a"), 2.0), dp=2)
    spiked = _losses(records(31, 40, start_at=5000.0, accum=4, micro_batch=4, global_batch=32, run="b"), 2.0)
    spiked[1]["loss"] = 3.5
    state.observe(spiked, dp=2)
    (finding,) = state.findings
    assert not finding["healthy"] and finding["kind"] == "resume" and finding["step"] == 31
    assert "the loss spiked to 3.5 against 1.9" in finding["text"]
    broken = _losses(records(41, 46, start_at=9000.0, accum=4, micro_batch=4, global_batch=48, run="c"), 1.95)
    state.observe(broken, dp=2)
    assert "the global batch changed 32 -> 48" in state.findings[-1]["text"]
    assert "is not the global batch 48" in state.findings[-1]["text"]


def test_a_run_that_starts_over_from_step_one_is_not_judged_by_the_trained_runs_loss():
    """A restart with no checkpoint (or a signal-mode script whose own save was lost with its
    node) begins with an untrained model: its high loss is no spike. From any later step it is."""
    state = RhythmState()
    state.observe(_losses(records(1, 40, run="a"), 0.05), dp=2)
    fresh = _losses(records(1, 10, start_at=5000.0, run="b"), 7.0)
    state.observe(fresh, dp=2)
    (finding,) = state.findings
    assert finding["healthy"] and finding["step"] == 1
    assert finding["text"].startswith("After the restart from step 1 the run is healthy: it started over, so its loss "
                                      "is not compared with the run before;"), finding["text"]
    state.observe(_losses(records(11, 60, start_at=6000.0, run="b"), 0.05), dp=2)
    state.observe(_losses(records(2, 11, start_at=9000.0, run="c"), 7.0), dp=2)
    assert not state.findings[-1]["healthy"] and "the loss spiked to 7" in state.findings[-1]["text"]


def test_save_predictions_are_scored_against_the_measured_saves():
    state = RhythmState()
    for seconds in (2.0, 2.0, 2.2, 4.0):
        state.observe_checkpoint(save_s=seconds)
    # Each save against the worst of those before it: 2 vs 2, 2.2 vs 2, 4 vs 2.2.
    assert state.save_errors == pytest.approx([0.0, 0.2 / 2.2, 1.8 / 4.0])
    assert state.error_percentiles(state.save_errors, at_least=3)[0] == pytest.approx(0.2 / 2.2)


def test_shares_never_add_up_to_more_than_the_step():
    state = RhythmState()
    rows = records(1, 30)
    for r in rows:  # the slowest rank's communication plus the mean compute: more than the step
        r["data_wait_s"], r["compute_s"], r["comm_s"] = 0.05, 0.6, 0.65
    state.observe(rows, dp=2)
    assert sum(state.shares.values()) == pytest.approx(1.0)
    assert state.shares["comm"] == pytest.approx(0.65 / 1.3)


def test_the_next_idle_window_is_predicted_and_scored_when_its_step_comes():
    state = RhythmState()
    state.observe(records(1, 60, pause_after={s: 30.0 for s in (20, 40, 60)}), dp=2, checkpoint_every=20)
    assert [(p.kind, p.every_steps, p.offset_steps) for p in state.phases(20)] == [("checkpoint", 20, 0)]
    assert state.next_idle == {"kind": "checkpoint", "after_step": 60, "duration_s": 30.0}
    state.observe(records(61, 81, start_at=1000.0 + 60 + 60.0, pause_after={60: 30.0, 80: 36.0}), dp=2,
                  checkpoint_every=20)
    # The gap after 60 came as predicted (30 s), the one after 80 took 36 s against 30 s predicted.
    assert state.idle_errors == pytest.approx([0.0, 6.0 / 36.0])
    assert state.next_idle["after_step"] == 100
    # A window that does not come scores 1.
    state.observe(records(82, 101, start_at=5000.0), dp=2, checkpoint_every=20)
    assert state.idle_errors[-1] == 1.0
    assert state.accuracy()["idle"]["n"] == 3


def test_a_phase_off_the_multiples_of_its_period_is_predicted_from_where_it_was_seen():
    from jobs.planner.snapshot import IdlePhase

    state = RhythmState()
    state.observe(records(1, 70, pause_after={s: 12.0 for s in (7, 32, 57)}), dp=2)
    (phase,) = state.phases()
    assert (phase.every_steps, phase.offset_steps) == (25, 7)
    assert state.next_idle["after_step"] == 82
    assert IdlePhase(25, 12.0, 7).next_after(57) == 82 and IdlePhase(25, 12.0).next_after(57) == 75


def test_reclaim_stops_are_scored_against_their_prediction():
    state = RhythmState()
    state.observe_reclaim(predicted_s=10.0, lead_s=20.0, took_s=12.5)
    state.observe_reclaim(predicted_s=10.0, lead_s=20.0, took_s=25.0)
    state.observe_reclaim(predicted_s=10.0, lead_s=20.0, took_s=0.5)  # far quicker: near 1, not 19
    assert state.reclaim_errors() == pytest.approx([2.5 / 12.5, 15.0 / 25.0, 9.5 / 10.0])
    assert state.accuracy()["reclaim"] == {"p50": pytest.approx(0.6), "p95": pytest.approx(0.915), "n": 3}


def test_the_gpu_time_lost_names_what_takes_it():
    state = RhythmState()
    rows = records(1, 60, pause_after={s: 9.0 for s in range(10, 61, 10)})  # 9 s off every 10 one-second steps
    state.observe(rows, dp=2)
    share, cause = state.lost()
    assert cause == "pause" and 0.3 < share < 0.7
    stalled = RhythmState()
    rows = records(1, 60)
    for r in rows:
        r["data_wait_s"], r["compute_s"], r["comm_s"] = 0.6, 0.35, 0.05
    stalled.observe(rows, dp=2)
    share, cause = stalled.lost()
    assert cause == "data_wait" and share == pytest.approx(0.65, abs=0.01)
    assert RhythmState().lost() is None


def test_the_optimizer_step_count_and_data_position_must_continue_after_a_change():
    def counted(rows, opt_shift=0, data_shift=0):
        for r in rows:
            r["opt_step"], r["data_pos"] = r["step"] + opt_shift, r["step"] * 32 + data_shift
        return rows

    state = RhythmState()
    state.observe(counted(_losses(records(1, 40, accum=4, micro_batch=4, global_batch=32, run="a"), 2.0)), dp=2)
    state.observe(counted(_losses(records(31, 36, start_at=5000.0, accum=4, micro_batch=4, global_batch=32, run="b"),
                                  2.0)), dp=2)
    assert state.findings[-1]["healthy"]
    assert "optimizer step count continued" in state.findings[-1]["text"]
    assert "data position continued" in state.findings[-1]["text"]
    # A resume whose optimizer state was not restored, and whose data restarted from the beginning.
    state.observe(counted(_losses(records(37, 42, start_at=9000.0, accum=4, micro_batch=4, global_batch=32, run="c"),
                                  2.0), opt_shift=-36, data_shift=-36 * 32), dp=2)
    text = state.findings[-1]["text"]
    assert not state.findings[-1]["healthy"]
    assert "the optimizer step count did not continue: -36 steps" in text
    assert "the data position did not continue: -1152 samples" in text

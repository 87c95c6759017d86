"""In-process tests of the trainer library pieces: runtime hooks, control file, signals,
schedule, balancing and the synthetic data (no worker processes)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from trainer_agent.balancing import balanced_plan, contiguous_plan, imbalance
from trainer_agent.runtime import ControlFile, JsonlFileSink, MemorySink, TrainerRuntime
from trainer_agent.schedule import LRSchedule
from trainer_agent.workload import ModelConfig, render_pixels, render_sample, sample_spec

pytestmark = pytest.mark.torch


def _step(runtime: TrainerRuntime, step: int) -> dict:
    runtime.begin_step(step)
    with runtime.data_wait():
        pass
    with runtime.compute():
        runtime.add_overlapped_comm_s(0.0)
    runtime.count_tokens(image=30, video=12, text=9, image_samples=2, video_samples=1)
    runtime.add_loss(18.0, 9)
    return runtime.end_step({"lr": 0.1, "dp": 1})


def test_runtime_emits_one_record_per_step_with_tokens_per_modality(tmp_path: Path) -> None:
    sink = MemorySink()
    runtime = TrainerRuntime(sink=sink, handle_signals=False)
    record = _step(runtime, 1)
    assert sink.records == [record]
    assert record["loss"] == 2.0 and record["lr"] == 0.1
    assert record["tokens"] == {"image": 30, "video": 12, "text": 9}
    assert record["samples"] == {"image": 2, "video": 1}
    assert {"step_s", "data_wait_s", "compute_s", "comm_s", "rank_compute_s", "imbalance"} <= set(record)
    assert not runtime.should_checkpoint_and_stop()


def test_jsonl_sink_appends_a_line_per_record(tmp_path: Path) -> None:
    runtime = TrainerRuntime(sink=JsonlFileSink(tmp_path / "metrics.jsonl"), handle_signals=False)
    _step(runtime, 1)
    _step(runtime, 2)
    runtime.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_control_file_asks_to_checkpoint_and_stop_and_is_consumed(tmp_path: Path) -> None:
    control = ControlFile(tmp_path / "control.json")
    runtime = TrainerRuntime(sink=MemorySink(), control=control, handle_signals=False)
    _step(runtime, 1)
    (tmp_path / "control.json").write_text(json.dumps({"command": "checkpoint_and_stop", "id": "c1"}))
    record = _step(runtime, 2)
    assert runtime.should_checkpoint_and_stop() and runtime.requested_dp() is None
    assert record["stop_requested"] == "control file"
    runtime.acknowledge_control()
    assert not (tmp_path / "control.json").exists()


def test_control_file_resize_reports_the_new_dp(tmp_path: Path) -> None:
    (tmp_path / "control.json").write_text(json.dumps({"command": "resize", "dp": 4}))
    runtime = TrainerRuntime(control=ControlFile(tmp_path / "control.json"), handle_signals=False)
    _step(runtime, 1)
    assert runtime.should_checkpoint_and_stop() and runtime.requested_dp() == 4


def test_sigusr1_and_sigterm_only_set_the_stop_flag() -> None:
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        runtime = TrainerRuntime()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        _step(runtime, 1)
        assert runtime.should_checkpoint_and_stop()
        assert runtime.stop_reason == "SIGUSR1" and runtime.signals_received == 2
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_schedule_warms_up_decays_and_calibrates_after_a_resize() -> None:
    schedule = LRSchedule(base_lr=1.0, warmup_steps=4, total_steps=20)
    assert schedule.lr_at(2) == 0.5 and schedule.lr_at(4) == 1.0
    assert schedule.lr_at(20) == pytest.approx(0.1)
    schedule.start_calibration(first_step=10, steps=4, start_fraction=0.2)
    assert schedule.lr_at(10) == pytest.approx(0.2 * schedule.scheduled_lr(10))
    assert schedule.lr_at(14) == schedule.scheduled_lr(14)
    assert LRSchedule.from_state_dict(schedule.state_dict()) == schedule


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_plans_cover_the_same_global_batch_whatever_the_dp(dp: int) -> None:
    config = ModelConfig()
    specs = [sample_spec(5, 160 + i) for i in range(16)]
    for plan in (balanced_plan(specs, dp, 2, config), contiguous_plan(specs, dp, 2, config)):
        assert sorted(i for rank in plan.ranks for mb in rank for i in mb) == list(range(160, 176))
        assert all(len(rank) == 16 // (2 * dp) and all(len(mb) == 2 for mb in rank) for rank in plan.ranks)


def test_balanced_plan_lowers_estimated_imbalance() -> None:
    config = ModelConfig()
    balanced, contiguous = [], []
    for step in range(30):
        specs = [sample_spec(0, step * 16 + i) for i in range(16)]
        balanced.append(balanced_plan(specs, 2, 2, config).estimated_imbalance)
        contiguous.append(contiguous_plan(specs, 2, 2, config).estimated_imbalance)
    assert np.mean(balanced) < np.mean(contiguous) and np.mean(balanced) <= 1.05
    assert imbalance([1.0, 1.0]) == 1.0 and imbalance([3.0, 1.0]) == 1.5


def test_samples_are_deterministic_varied_and_described_by_their_captions() -> None:
    a, b = sample_spec(1, 42), sample_spec(1, 42)
    assert a == b and np.array_equal(render_pixels(a, 1), render_pixels(b, 1))
    specs = [sample_spec(1, i) for i in range(200)]
    assert len({s.visual_tokens for s in specs}) >= 5 and len({s.text_tokens for s in specs}) >= 4
    assert {s.modality for s in specs} == {"image", "video"}
    for spec in specs[:20]:
        assert spec.colour in spec.caption and spec.shape in spec.caption
        assert render_sample(spec, 1).patches.shape[0] == spec.visual_tokens

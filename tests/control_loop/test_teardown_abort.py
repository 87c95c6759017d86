"""A rank that aborts in the interpreter's teardown after its run ended well (SIGABRT, "terminate
called without an active exception", seen under load) is no failure: the node agent reads the
order of ``exit.json`` and the rank's exit record, and the checkpoint on disk (the server's audit
row: tests/control_loop/test_control_actions.py). Without torch: the run's files are written as
the library and the rank wrapper write them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from trainer_agent import workers
from trainer_agent.checkpoint import LATEST_FILE


def _ended_run(tmp_path, *, leader=True, outcome="preempted", step=7, checkpoint_step=7, on_disk=7,
               written_at=100.0, failed_at=101.0, code=1, rank_record=True):
    """A two-rank omni run whose torchrun exited with ``code`` after rank 0 wrote ``exit.json``
    (at ``written_at``) and rank 1 exited with SIGABRT (at ``failed_at``)."""
    handle = workers.WorkerHandle(job="lib", gpus=[0, 1], leader=leader, run_id="lib-1", integration="omni",
                                  stop_kind="preempt")
    payload = {"job": "lib", "run_id": "lib-1", "workload": {"entrypoint": ["train.py"], "integration": "omni"}}
    run = workers.TorchrunJob(handle, tmp_path, payload, python="python", node="n1")
    for directory in (run.paths.run_dir, run.paths.checkpoint_dir, run.paths.log_dir, run.paths.state_dir):
        directory.mkdir(parents=True, exist_ok=True)
    (run.run_dir / "exit.json").write_text(json.dumps(
        {"outcome": outcome, "step": step, "checkpoint_step": checkpoint_step, "at": written_at}))
    (run.paths.checkpoint_dir / LATEST_FILE).write_text(json.dumps({"step": on_disk}))
    (run.paths.state_dir / "rank-0.exit.json").write_text(json.dumps(
        {"rank": 0, "code": 0, "signal": None, "at": written_at + 0.2}))
    if rank_record:
        (run.paths.state_dir / "rank-1.exit.json").write_text(json.dumps(
            {"rank": 1, "code": 134, "signal": 6, "at": failed_at}))
        (run.paths.log_dir / "rank-1.err").write_text("terminate called without an active exception\n")
    run.proc = SimpleNamespace(returncode=code, pid=0)
    return run


def test_a_rank_that_aborts_after_the_checkpointed_stop_leaves_a_clean_preempt(tmp_path):
    ok, facts = _ended_run(tmp_path).stop_report()
    assert ok is True and facts["outcome"] == "preempted" and facts["checkpoint_step"] == 7
    assert facts["teardown"] == "rank 1 exited with signal 6 after the run had ended at step 7"
    assert "error" not in facts


def test_a_follower_node_reads_the_leaders_exit_file_the_same_way(tmp_path):
    ok, facts = _ended_run(tmp_path, leader=False).stop_report()
    assert ok is True and "rank 1 exited with signal 6" in facts["teardown"]


@pytest.mark.parametrize(("case", "overrides"), [
    ("the rank failed before the run's end was written", {"failed_at": 99.0}),
    ("the stop's checkpoint is older than its step", {"checkpoint_step": 5}),
    ("the checkpoint it names is not on disk", {"on_disk": 5}),
    ("torchrun failed with no rank's exit record", {"rank_record": False}),
    ("the run ended with no checkpoint", {"outcome": "failed"}),
])
def test_a_non_zero_exit_is_still_a_failed_stop_when(tmp_path, case, overrides):
    ok, facts = _ended_run(tmp_path, **overrides).stop_report()
    assert ok is False, case
    assert "teardown" not in facts and "exited with code 1" in facts["error"]


def test_an_exit_file_without_a_time_is_not_trusted(tmp_path):
    run = _ended_run(tmp_path)
    info = json.loads((run.run_dir / "exit.json").read_text())
    del info["at"]
    (run.run_dir / "exit.json").write_text(json.dumps(info))
    assert run.stop_report()[0] is False


def test_a_completed_run_with_a_teardown_abort_reports_completed_not_failed(tmp_path):
    report = _ended_run(tmp_path, outcome="completed", step=40, checkpoint_step=None).exit_report()
    assert report["outcome"] == "completed" and report["step"] == 40
    assert report["teardown"] == "rank 1 exited with signal 6 after the run had ended at step 40"
    # the same abort before the end was written is a failure of rank 1
    failed = _ended_run(tmp_path / "b", outcome="completed", step=40, failed_at=99.0).exit_report()
    assert failed["outcome"] == "failed" and failed["rank"] == 1 and failed["signal"] == 6

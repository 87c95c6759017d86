"""How the node agent launches a job's share (trainer_agent/launch.py) and what the rank wrapper
does around the researcher's process (trainer_agent/rank.py): argv, environment, registry,
signals, capped logs, exit records. Real processes, no torch, no database."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer_agent import launch
from trainer_agent.rank import STOP_ASKED

ROOT = Path(__file__).resolve().parents[2]


def payload(**overrides):
    value = {
        "job": "my job", "run_id": "my-job-1a2b", "dp": 4, "accum": 2, "micro_batch": 4, "global_batch": 32,
        "total_steps": 100, "checkpoint_every": 10,
        "placement": [{"node": "a", "gpus": [2, 3], "address": "10.0.0.1"},
                      {"node": "b", "gpus": [0, 5], "address": "10.0.0.2"}],
        "rdzv": {"host": "10.0.0.1", "port": 29417},
        "workload": {"entrypoint": ["train.py", "--lr", "3e-4"], "integration": "signal", "keep_checkpoints": 2,
                     "env": {"HF_HOME": "/cache", "RANK": "7", "WORLD_SIZE": "99"}},
    }
    value.update(overrides)
    return value


def test_entrypoints_resolve_with_the_nodes_python():
    assert launch.resolve_entrypoint(["train.py", "-x"], "/py") == ["/py", "train.py", "-x"]
    assert launch.resolve_entrypoint(["-m", "pkg.train"], "/py") == ["/py", "-m", "pkg.train"]
    assert launch.resolve_entrypoint(["/opt/bin/run", "1"], "/py") == ["/opt/bin/run", "1"]
    with pytest.raises(ValueError):
        launch.resolve_entrypoint([], "/py")


def test_one_torchrun_per_node_with_its_rank_and_only_the_leader_hosting_the_rendezvous():
    leader = launch.torchrun_argv(payload(), "a", "/py")
    member = launch.torchrun_argv(payload(), "b", "/py")
    assert leader[:3] == ["/py", "-m", "torch.distributed.run"]
    for argv, rank, host in ((leader, 0, 1), (member, 1, 0)):
        assert "--nnodes=2" in argv and "--nproc-per-node=2" in argv and f"--node-rank={rank}" in argv
        assert "--rdzv-backend=c10d" in argv and "--rdzv-endpoint=10.0.0.1:29417" in argv
        assert "--rdzv-id=my-job-1a2b" in argv and "--max-restarts=0" in argv
        assert any(a.startswith(f"--rdzv-conf=is_host={host},") for a in argv)
        tail = argv[argv.index("--no-python") + 1:]
        assert tail == ["/py", "-m", "trainer_agent.rank", "--", "/py", "train.py", "--lr", "3e-4"]
    with pytest.raises(ValueError):
        launch.torchrun_argv(payload(), "c", "/py")


def test_the_ranks_environment_is_the_jobs_share_and_omnis_contract(tmp_path):
    paths = launch.RunPaths.of(tmp_path, "my job", "my-job-1a2b", "b")
    env = launch.rank_env(payload(), "b", paths, {"PATH": "/bin", "MASTER_PORT": "1", "TORCHELASTIC_X": "1"},
                          device="cpu", log_cap_bytes=1000)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,5"
    assert env["OMNI_JOB"] == "my job" and env["OMNI_NODE"] == "b" and env["OMNI_RUN_ID"] == "my-job-1a2b"
    assert env["OMNI_CHECKPOINT_DIR"] == str(tmp_path / "my_job" / "checkpoints")
    assert env["OMNI_METRICS_FILE"] == str(tmp_path / "my_job" / "metrics.jsonl")
    assert env["OMNI_LOG_DIR"] == str(tmp_path / "my_job" / "logs" / "my-job-1a2b" / "b")
    assert (env["OMNI_DP"], env["OMNI_ACCUM_STEPS"], env["OMNI_MICRO_BATCH"], env["OMNI_GLOBAL_BATCH"]) == \
        ("4", "2", "4", "32")
    assert env["OMNI_KEEP_CHECKPOINTS"] == "2" and env["OMNI_LOG_CAP_BYTES"] == "1000"
    assert env["HF_HOME"] == "/cache"
    # torchrun's own variables are never taken from the job's env or the agent's.
    assert "RANK" not in env and "WORLD_SIZE" not in env and "MASTER_PORT" not in env
    assert "TORCHELASTIC_X" not in env
    assert str(ROOT) in env["PYTHONPATH"].split(os.pathsep)


def _wrapper(tmp_path: Path, argv: list[str], *, rank: int = 3, cap: int | None = None, torchrun: bool = False):
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "1", "OMNI_NODE": "n1",
           "OMNI_RANK_STATE_DIR": str(tmp_path / "state"), "OMNI_LOG_DIR": str(tmp_path / "logs"),
           "OMNI_RANK_REQUIRE_TORCHRUN": "1" if torchrun else "0", "PYTHONPATH": str(ROOT)}
    if cap:
        env["OMNI_LOG_CAP_BYTES"] = str(cap)
    return subprocess.Popen([sys.executable, "-m", "trainer_agent.rank", "--", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_the_wrapper_registers_the_rank_splits_its_logs_and_records_the_exit(tmp_path):
    script = "import sys; print('to stdout'); print('to stderr', file=sys.stderr); sys.exit(7)"
    proc = _wrapper(tmp_path, [sys.executable, "-c", script])
    assert proc.wait(timeout=30) == 7
    registry = json.loads((tmp_path / "state" / "rank-3.json").read_text())
    assert registry["rank"] == 3 and registry["node"] == "n1" and registry["pid"] == proc.pid
    assert (tmp_path / "logs" / "rank-3.out").read_text() == "to stdout\n"
    assert (tmp_path / "logs" / "rank-3.err").read_text() == "to stderr\n"
    exit_record = json.loads((tmp_path / "state" / "rank-3.exit.json").read_text())
    assert exit_record["code"] == 7 and exit_record["signal"] is None


def test_a_capped_log_keeps_its_head_a_notice_and_the_last_lines(tmp_path):
    script = "for i in range(5000): print(f'line {i:05d}')\nraise SystemExit('the end')"
    proc = _wrapper(tmp_path, [sys.executable, "-c", script], cap=2000)
    assert proc.wait(timeout=30) == 1
    out = (tmp_path / "logs" / "rank-3.out").read_text()
    assert out.startswith("line 00000\n")
    assert "[omni: log capped at 2000 bytes; further output dropped]" in out
    assert out.rstrip().endswith("line 04999")
    assert len(out.encode()) < 2000 + 200 * 11 + 200  # head + notice + tail lines
    assert "the end" in (tmp_path / "logs" / "rank-3.err").read_text()


def test_sigterm_reaches_the_researchers_process_and_its_handler_decides(tmp_path):
    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *a: (print('saving', flush=True), sys.exit(0)))\n"
              "print('ready', flush=True)\ntime.sleep(60)")
    proc = _wrapper(tmp_path, [sys.executable, "-c", script])
    log = tmp_path / "logs" / "rank-3.out"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "ready" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert log.read_text() == "ready\nsaving\n"


@pytest.mark.parametrize("asked", [True, False])
def test_a_rank_that_dies_of_the_sigterm_the_agent_asked_for_stopped_as_asked(tmp_path, asked):
    # No handler: the script dies of SIGTERM. Asked for by the agent (stop-asked written first),
    # torchrun is told 0, so the node's torchrun leaves through its exit barrier like the
    # others; from anyone else, it is a failed rank (143). The record keeps the signal either way.
    if asked:
        (tmp_path / "state").mkdir()
        (tmp_path / "state" / STOP_ASKED).touch()
    proc = _wrapper(tmp_path, [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"])
    log = tmp_path / "logs" / "rank-3.out"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "ready" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == (0 if asked else 143)
    record = json.loads((tmp_path / "state" / "rank-3.exit.json").read_text())
    assert record["code"] == 143 and record["signal"] == signal.SIGTERM
    assert record.get("asked", False) is asked


def test_the_wrapper_refuses_to_start_a_rank_when_torchrun_is_not_its_parent(tmp_path):
    proc = _wrapper(tmp_path, [sys.executable, "-c", "print('should not run')"], torchrun=True)
    assert proc.wait(timeout=30) == 3
    assert b"not started by torchrun" in proc.stderr.read()
    assert not (tmp_path / "logs" / "rank-3.out").exists()

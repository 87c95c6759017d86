"""The researcher's own code, end to end with real processes: a plain torch DDP script (no Omni
import) in signal mode on two agents of 2 GPUs each, torchrun on both nodes; drained, it gets
SIGTERM, checkpoints within grace and later resumes to exactly the weights of an uninterrupted
run; a script that ignores SIGTERM is killed after grace_s and the audit says so; a crashing
script fails with its traceback (restarting only up to max_restarts); no rank outlives a cancel
or its agent."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.control_loop.conftest import ROOT, make_node, run_output, wait_for

pytestmark = [pytest.mark.services, pytest.mark.postgres, pytest.mark.redis, pytest.mark.torch,
              pytest.mark.slow, pytest.mark.timeout(420)]

EXAMPLE = ROOT / "examples" / "signal_script" / "train.py"


def rank_pids(job: str) -> list[int]:
    """Every process on this machine whose environment says it is a rank of ``job`` (the rank
    wrappers and the script's processes; torchrun itself has no RANK)."""
    needle = f"OMNI_JOB={job}\0".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read()
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env and b"\0RANK=" in env and state not in (b"Z", b"X"):
            out.append(int(entry))
    return out


def registered_ranks(run_dir: Path, run_id: str) -> dict[str, list[int]]:
    """Node -> the global ranks the rank wrapper registered there for this run."""
    out: dict[str, list[int]] = {}
    for path in (run_dir / ".omni" / run_id).glob("*/rank-*.json"):
        if path.name.endswith(".exit.json"):
            continue
        entry = json.loads(path.read_text())
        out.setdefault(entry["node"], []).append(entry["rank"])
    return {node: sorted(ranks) for node, ranks in out.items()}


def submit(owner, name: str, *, dp: int, args: list[str], **spec):
    from jobs import actions

    values = dict(priority="regular", global_batch=32, micro_batch=32 // dp, total_steps=40, step_s=0.3,
                  checkpoint_every_steps=10, checkpoint_save_s=1.0, checkpoint_load_s=2.0,
                  entrypoint=[str(EXAMPLE), *args], integration="signal", grace_s=20.0)
    values.update(spec)
    return actions.submit_job(owner, name=name, dp=dp, **values)


def one_node(cluster, owner, name: str, **job) -> tuple[object, object, str]:
    """A 2-GPU node n1, the job submitted, then the server, a Celery worker and n1's agent:
    (job, agent process, the node's token)."""
    _, token = make_node("n1", 2)
    submitted = submit(owner, name, dp=2, **job)
    cluster.start_server()
    cluster.start_worker()
    return submitted, cluster.start_agent("n1", token, gpus=2), token


def test_plain_ddp_script_on_two_nodes_is_drained_by_sigterm_and_resumes_to_the_uninterrupted_result(
        control_cluster, boss):
    from jobs import actions
    from jobs.models import ElasticEvent, EventKind, Job, Node

    _, token1 = make_node("n1", 2)
    _, token2 = make_node("n2", 2)
    job = submit(boss, "ddp", dp=4, args=["--step-s", "0.3"])
    control_cluster.start_server()
    control_cluster.start_worker()
    control_cluster.start_agent("n1", token1, gpus=2)
    control_cluster.start_agent("n2", token2, gpus=2)
    run_dir = control_cluster.tmp / "runs" / "ddp"

    # One torchrun per node, 2 ranks each, 4 in all, in one rendezvous.
    run_id = wait_for(lambda: Job.objects.get(pk=job.pk).run_id, 60, "the job to be placed")
    ranks = wait_for(lambda: (r := registered_ranks(run_dir, run_id)) and sum(map(len, r.values())) == 4 and r,
                     120, "4 ranks registered")
    assert sorted(ranks) == ["n1", "n2"] and all(len(r) == 2 for r in ranks.values())
    assert sorted(sum(ranks.values(), [])) == [0, 1, 2, 3]
    wait_for(lambda: "step 5 " in run_output(run_dir), 120, "training steps")
    assert len(rank_pids("ddp")) >= 4
    # The script reports its steps through $OMNI_METRICS_FILE (no import): progress and rhythm.
    wait_for(lambda: Job.objects.get(pk=job.pk).committed_steps >= 5, 60, "the script's steps as the job's progress")
    rhythm = wait_for(lambda: measured_rhythm_of(job.pk), 60, "a step time measured from the script's lines")
    assert 0.2 < rhythm["mean_step_s"] < 5.0

    # Drain a node: the job is not elastic, so it is preempted (SIGTERM on both nodes).
    actions.drain_node(Node.objects.get(name="n2"), boss)
    wait_for(lambda: Job.objects.get(pk=job.pk).state == "preempted", 60, "the job to be preempted")
    preempted = ElasticEvent.objects.filter(kind=EventKind.OUTCOME, job_name="ddp", outcome__kind="preempt").last()
    assert "after SIGTERM" in preempted.reason["text"] and preempted.outcome["steps_lost"] == 0
    assert preempted.outcome["exit_s"] < 20.0
    wait_for(lambda: not rank_pids("ddp"), 15, "no rank process left after the preemption")
    assert "SIGTERM: checkpoint at step" in run_output(run_dir)
    assert (run_dir / "checkpoints" / "ckpt.pt").exists()

    reported = Job.objects.get(pk=job.pk).committed_steps
    assert reported >= 5  # a graceful stop keeps the progress the script reported

    actions.uncordon_node(Node.objects.get(name="n2"), boss)
    wait_for(lambda: Job.objects.get(pk=job.pk).state == "completed", 240, "the job to resume and complete")
    assert Job.objects.get(pk=job.pk).run_id != run_id  # a new run, a new rendezvous
    resumed = int(re.search(r"resumed from step (\d+)", run_output(run_dir)).group(1))
    assert resumed >= 5
    # The agent removed the first run's lines before the second began: its file starts where it resumed.
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == resumed + 1 and lines[-1]["step"] == 40
    assert Job.objects.get(pk=job.pk).committed_steps == 40
    result = json.loads((run_dir / "checkpoints" / "result.json").read_text())

    # The same script, uninterrupted, with plain torchrun: the same weights, bit for bit.
    reference = control_cluster.tmp / "reference"
    env = {**control_cluster.env, "OMNI_CHECKPOINT_DIR": str(reference), "OMNI_TOTAL_STEPS": "40"}
    env.pop("OMNI_JOB", None)
    for _attempt in (1, 2):  # the baseline run, not the system under test: once more if the loaded machine broke it
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                               str(EXAMPLE), "--step-s", "0"], env=env, cwd=control_cluster.tmp,
                              capture_output=True, text=True, timeout=180)
        if done.returncode == 0 and (reference / "result.json").exists():
            break
    assert done.returncode == 0, f"the uninterrupted reference run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    expected = json.loads((reference / "result.json").read_text())
    assert result["weights"] == expected["weights"]
    assert result["loss"] == expected["loss"]
    assert not rank_pids("ddp")


def measured_rhythm_of(pk: int) -> dict | None:
    """The job's measured rhythm as the API shows it, once it has a step time."""
    from jobs.live_data import rhythm_summary
    from jobs.models import Job

    summary = rhythm_summary(Job.objects.get(pk=pk))
    return summary if summary and summary.get("mean_step_s") else None


def test_a_script_that_ignores_sigterm_is_killed_after_its_grace_and_the_audit_says_so(control_cluster, boss):
    from jobs import actions
    from jobs.models import ElasticEvent, EventKind, Job, Node

    job, _, _ = one_node(control_cluster, boss, "stubborn", args=["--ignore-sigterm", "--step-s", "0.3"],
                         total_steps=10000, grace_s=3.0)
    run_dir = control_cluster.tmp / "runs" / "stubborn"
    wait_for(lambda: "step 3 " in run_output(run_dir), 120, "training steps")

    actions.drain_node(Node.objects.get(name="n1"), boss)
    kill = wait_for(lambda: ElasticEvent.objects.filter(kind=EventKind.KILL, job_name="stubborn").first(), 60,
                    "the kill after the grace period")
    assert kill.reason["rule"] == "grace_expired"
    assert "did not exit within grace_s 3 s of SIGTERM" in kill.reason["text"]
    assert kill.outcome["time_lost_s"] > 0 and kill.outcome["killed"] is True
    assert 3.0 <= kill.outcome["exit_s"] < 10.0
    # It had reported its steps; Omni cannot see its saves, so none are claimed kept or lost.
    assert kill.outcome["steps_reported"] >= 3 and "steps_lost" not in kill.outcome
    assert Job.objects.get(pk=job.pk).state == "preempted"
    assert Job.objects.get(pk=job.pk).committed_steps == 0
    wait_for(lambda: not rank_pids("stubborn"), 10, "no rank process left after the kill")


def test_a_crashing_script_restarts_up_to_max_restarts_then_fails_with_its_traceback(control_cluster, boss):
    from django.test import Client

    from jobs.models import ElasticEvent, EventKind, Job

    job, _, _ = one_node(control_cluster, boss, "crashy", args=["--fail-at-step", "2", "--fail-rank", "1",
                                                               "--step-s", "0"], max_restarts=1)
    wait_for(lambda: Job.objects.get(pk=job.pk).state == "failed", 240, "the job to fail")
    job.refresh_from_db()
    assert job.restarts == 1
    # An uncaught exception exits 1, or dies of SIGABRT (code 134, or signal 6 as the rank wrapper
    # sees it) when gloo's threads abort the interpreter's teardown on a loaded machine.
    assert job.failure["rank"] == 1 and job.failure["node"] == "n1"
    assert job.failure["code"] in (1, 134) or job.failure.get("signal") == 6
    assert "RuntimeError: deliberate failure at step 2 on rank 1" in job.failure["tail"]
    assert "Traceback" in job.failure["tail"]
    restart = ElasticEvent.objects.get(kind=EventKind.RESTART, job_name="crashy")
    assert re.search(r"rank 1 on n1 exited with (code (1|134)|signal 6) ", restart.reason["text"])
    assert "restart 1 of 1" in restart.reason["text"]
    assert "starts again: its script resumes from its own last save, which Omni cannot see" in restart.reason["text"]
    assert "resume_from_step" not in restart.outcome and "recovers from step" not in restart.reason["text"]
    fail = ElasticEvent.objects.get(kind=EventKind.FAIL, job_name="crashy")
    assert fail.outcome["failure"]["rank"] == 1 and "deliberate failure" in fail.reason["text"]
    # It does not resume: the failure names no step to resume from, only what ran and was reported.
    assert "resume_from_step" not in fail.outcome and fail.outcome["time_lost_s"] >= 0 and "steps_reported" in fail.outcome
    assert job.allocations.count() == 0

    client = Client()
    client.force_login(boss)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "deliberate failure at step 2 on rank 1" in page
    api = client.get(f"/api/jobs/{job.pk}/").json()
    assert api["failure"]["rank"] == 1
    wait_for(lambda: not rank_pids("crashy"), 10, "no rank process left after the failure")


def test_no_rank_outlives_a_cancel_or_its_agent(control_cluster, boss):
    from jobs import actions
    from jobs.models import Job, Node

    first, agent, token = one_node(control_cluster, boss, "cancelled", args=["--ignore-sigterm", "--step-s", "0.3"],
                                   total_steps=10000, grace_s=2.0)
    wait_for(lambda: len(rank_pids("cancelled")) >= 2, 120, "the ranks to start")
    actions.cancel_job(Job.objects.get(pk=first.pk), boss)
    wait_for(lambda: not rank_pids("cancelled"), 30, "no rank process left after the cancel")

    submit(boss, "orphan-check", dp=2, args=["--step-s", "0.3"], total_steps=10000)
    wait_for(lambda: len(rank_pids("orphan-check")) >= 2, 120, "the second job's ranks")
    agent.kill(signal.SIGKILL)  # the agent alone (its process group); the ranks are in theirs
    wait_for(lambda: not rank_pids("orphan-check"), 15, "no rank process left after the agent died")

    # A stopping agent (SIGTERM) gives its ranks their grace, then leaves none behind.
    wait_for(lambda: Node.objects.get(name="n1").state == "failed", 30, "n1 to be marked failed")
    agent = control_cluster.start_agent("n1", token, gpus=2, name="agent-n1-again")
    since = Node.objects.get(name="n1").last_heartbeat_at
    wait_for(lambda: Node.objects.get(name="n1").last_heartbeat_at > since, 30, "the new agent's heartbeat")
    actions.mark_node_repaired(Node.objects.get(name="n1"), boss)
    wait_for(lambda: len(rank_pids("orphan-check")) >= 2, 120, "the job to run again after the repair")
    os.kill(agent.popen.pid, signal.SIGTERM)
    assert agent.popen.wait(timeout=60) == 0
    assert not rank_pids("orphan-check")

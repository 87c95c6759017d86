"""kill -9 a node's agent after it started a job and bring it back at once, with no workers: the
control plane notices on ``hello`` that the run is gone, sends the job back to its last
checkpoint, and the planner starts it again (issue 16, item 5)."""

from __future__ import annotations

import signal

import pytest

from tests.control_loop.conftest import make_node, wait_for

pytestmark = [pytest.mark.services, pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow,
              pytest.mark.timeout(120)]


def test_an_agent_restarted_without_its_workers_gets_its_job_recovered_and_running_again(control_cluster, boss):
    from jobs import actions
    from jobs.models import Command, ElasticEvent, EventKind, Job

    # The restarted agent must be back before the node could be declared failed: this test is
    # about the reconnect, not about the heartbeat verdicts (test_node_failure.py).
    control_cluster.env["OMNI_HEARTBEAT_MISSES"] = "30"
    _, token = make_node("n1", 1)
    actions.submit_job(boss, name="be", priority="best_effort", dp=1, global_batch=16, micro_batch=2,
                       total_steps=5000, step_s=0.2, checkpoint_every_steps=5, checkpoint_save_s=0.2,
                       checkpoint_load_s=0.2)
    control_cluster.start_server()
    control_cluster.start_worker()
    agent = control_cluster.start_agent("n1", token, gpus=1, simulated=True)

    start = wait_for(lambda: Command.objects.filter(job__name="be", kind="start", state="done").first(), 40,
                     "the start to be acknowledged and done")
    first_run = Job.objects.get(name="be").run_id
    assert start.payload["run_id"] == first_run
    wait_for(lambda: Job.objects.get(name="be").last_checkpoint_step >= 5, 30, "a checkpoint of the first run")

    agent.kill(signal.SIGKILL)  # the workers die with it
    control_cluster.start_agent("n1", token, gpus=1, simulated=True, name="agent-n1-again")

    lost = wait_for(lambda: next((e for e in ElasticEvent.objects.filter(kind=EventKind.FAIL, job__name="be")
                                  if "reconnected without the workers" in e.reason["text"]), None), 30,
                    "the lost run to be noticed on hello")
    assert lost.reason["text"].startswith(f"n1 reconnected without the workers of job be (run {first_run}): ")
    assert lost.actor == "agent:n1" and lost.command == start.id
    resume_from = lost.outcome["resume_from_step"]
    assert resume_from >= 5

    recover = wait_for(lambda: ElasticEvent.objects.filter(kind=EventKind.RECOVER, job_name="be").first(), 30,
                       "the planner to recover the job")
    assert recover.id > lost.id and recover.nodes_after == ["n1"]
    resume = Command.objects.get(id=recover.command)
    assert resume.kind == "resume" and resume.payload["run_id"] != first_run
    wait_for(lambda: Command.objects.get(id=resume.id).state == "done", 30, "the resume to be done")
    wait_for(lambda: Job.objects.get(name="be").committed_steps > resume_from + 5, 30, "progress after recovery")
    job = Job.objects.get(name="be")
    assert job.state == "running" and job.run_id == resume.payload["run_id"]
    # One fault, one recovery: the hello was handled once.
    assert ElasticEvent.objects.filter(kind=EventKind.FAIL, job__name="be").count() == 1

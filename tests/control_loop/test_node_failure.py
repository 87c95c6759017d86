"""kill -9 a node's agent: the node is failed within 3 heartbeat intervals, its job recovers on
another node from its last checkpoint, and the audit log shows every step of it."""

from __future__ import annotations

import signal
import time

import pytest

from tests.control_loop.conftest import HEARTBEAT_S, make_node, run_output, wait_for

pytestmark = [pytest.mark.services, pytest.mark.postgres, pytest.mark.redis, pytest.mark.torch,
              pytest.mark.slow, pytest.mark.timeout(200)]


def test_killed_agent_fails_its_node_and_the_job_recovers_elsewhere_from_its_checkpoint(control_cluster, boss):
    from jobs import actions
    from jobs.models import Allocation, Command, ElasticEvent, EventKind, Job, Node

    _, token1 = make_node("n1", 1)
    _, token2 = make_node("n2", 1)
    actions.submit_job(boss, name="be", priority="best_effort", dp=1, global_batch=16, micro_batch=2,
                       total_steps=100_000, step_s=0.8, checkpoint_every_steps=2, checkpoint_save_s=1.0,
                       checkpoint_load_s=2.0)
    control_cluster.start_server()
    control_cluster.start_worker()
    agents = {"n1": control_cluster.start_agent("n1", token1, gpus=1),
              "n2": control_cluster.start_agent("n2", token2, gpus=1)}
    wait_for(lambda: Node.objects.filter(last_heartbeat_at__isnull=False).count() == 2, 30, "both agents")

    first = wait_for(lambda: Allocation.objects.filter(job__name="be").select_related("node").first(), 30,
                     "the job to be placed").node.name
    other = "n2" if first == "n1" else "n1"
    wait_for(lambda: Job.objects.get(name="be").last_checkpoint_step >= 2, 90, "a periodic checkpoint")

    agents[first].kill(signal.SIGKILL)
    killed_at = time.time()
    failed = wait_for(
        lambda: ElasticEvent.objects.filter(kind=EventKind.NODE_FAILED, job__isnull=True,
                                            nodes_after=[first]).first(),
        15, f"{first} to be marked failed",
    )
    detect_s = failed.at.timestamp() - killed_at
    assert detect_s <= 3 * HEARTBEAT_S + 0.5, f"detected after {detect_s:.2f}s"
    assert Node.objects.get(name=first).state == "failed"

    job_fault = ElasticEvent.objects.get(kind=EventKind.NODE_FAILED, job__name="be")
    resume_from = job_fault.outcome["resume_from_step"]
    assert resume_from >= 2

    recover = wait_for(lambda: ElasticEvent.objects.filter(kind=EventKind.RECOVER, job_name="be").first(), 30,
                       "the planner to recover the job")
    assert recover.nodes_after == [other]
    resume = Command.objects.get(id=recover.command)
    wait_for(lambda: Command.objects.get(id=resume.id).state == "done", 30, "the resume to be done")
    resume.refresh_from_db()
    # The newest complete checkpoint: the one the last heartbeat reported, or one saved between
    # that heartbeat and the kill (then the job's progress moves up to it).
    loaded = resume.outcome["checkpoint_step"]
    assert resume.node.name == other and loaded >= resume_from
    run_dir = control_cluster.tmp / "runs" / "be"
    wait_for(lambda: f"resumed from step-{loaded:08d}" in run_output(run_dir), 60,
             "the trainer on the other node to load the checkpoint")
    assert Job.objects.get(name="be").last_checkpoint_step >= loaded
    wait_for(lambda: Job.objects.get(name="be").committed_steps > loaded, 60, "progress after recovery")
    assert Job.objects.get(name="be").state == "running"

    story = list(
        ElasticEvent.objects.filter(id__gte=failed.id - 1).order_by("id").values_list("kind", "job_name")
    )
    kinds = [k for k, _ in story]
    assert ("node_suspect", "") in story or ElasticEvent.objects.filter(kind="node_suspect").exists()
    for expected in ("node_failed", "recover", "ack", "outcome"):
        assert expected in kinds, f"{expected} missing from {story}"
    assert kinds.index("recover") > kinds.index("node_failed")

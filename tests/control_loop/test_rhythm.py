"""The live planner acts on what it measures (docs/rhythm.md), end to end with real processes:
the reference trainer with its ranks on one node slowed 3x makes that node's speed factor rise
within a bounded number of steps (an audited ``node_speed`` row), the planner moves the job off
it (``migrate``, the reason in words) and the job continues from its checkpoint; a job whose
data loader stalls every few steps is diagnosed as waiting on data and shows the stall as an
idle phase; the planner's snapshot carries the measured step time, not the submitted one."""

from __future__ import annotations

import json

import pytest
from django.utils import timezone

from tests.control_loop.conftest import make_node, run_output, wait_for

pytestmark = [pytest.mark.services, pytest.mark.postgres, pytest.mark.redis, pytest.mark.torch,
              pytest.mark.slow, pytest.mark.timeout(480)]

REFERENCE = ["-m", "trainer_agent.reference"]


def submit(owner, name: str, args: list[str], **spec):
    from jobs import actions

    values = dict(priority="regular", dp=2, dp_min=2, dp_max=2, global_batch=16, micro_batch=2, total_steps=400,
                  step_s=5.0, checkpoint_every_steps=20, checkpoint_save_s=0.5, checkpoint_load_s=1.0,
                  entrypoint=[*REFERENCE, *args], integration="omni")
    values.update(spec)
    return actions.submit_job(owner, name=name, **values)


def test_a_slow_node_is_measured_audited_and_the_job_moved_off_it(control_cluster, boss):
    from jobs import actions
    from jobs.models import ElasticEvent, EventKind, Job, Node

    tokens = {name: make_node(name, 1)[1] for name in ("n1", "n2", "n3")}
    actions.cordon_node(Node.objects.get(name="n3"), boss)  # the job lands on n1 and n2
    job = submit(boss, "slowpoke", ["--slow-on-node", "n2", "--slow-factor", "3"])
    control_cluster.start_server()
    control_cluster.start_worker()
    for name, token in tokens.items():
        control_cluster.start_agent(name, token, gpus=1)
    run_dir = control_cluster.tmp / "runs" / "slowpoke"
    wait_for(lambda: Job.objects.get(pk=job.pk).committed_steps >= 1, 120, "the first steps")
    assert sorted(a.node.name for a in Job.objects.get(pk=job.pk).allocations.select_related("node")) == ["n1", "n2"]
    actions.uncordon_node(Node.objects.get(name="n3"), boss)

    slow = wait_for(lambda: ElasticEvent.objects.filter(kind=EventKind.NODE_SPEED).first(), 120,
                    "the slow node to be measured")
    at_step = Job.objects.get(pk=job.pk).committed_steps
    assert slow.reason["rule"] == "straggler" and slow.nodes_after == ["n2"]
    assert "n2 runs slow: rank" in slow.reason["text"] and "of slowpoke" in slow.reason["text"]
    assert Node.objects.get(name="n2").speed_factor >= 2.0 and Node.objects.get(name="n1").speed_factor == 1.0
    assert at_step <= 80, f"flagged only at step {at_step}"

    moved = wait_for(lambda: ElasticEvent.objects.filter(kind=EventKind.MIGRATE, job_name="slowpoke").first(), 90,
                     "the planner to move the job off n2")
    assert "n2 run" in moved.reason["text"] and "slower" in moved.reason["text"]
    wait_for(lambda: sorted(a.node.name for a in Job.objects.get(pk=job.pk).allocations.select_related("node"))
             == ["n1", "n3"], 60, "the job to hold n1 and n3")
    wait_for(lambda: "resumed from step-" in run_output(run_dir), 120, "the job to resume from its checkpoint")
    before = Job.objects.get(pk=job.pk).committed_steps
    wait_for(lambda: Job.objects.get(pk=job.pk).committed_steps >= before + 10, 120, "steps after the move")


def test_a_stalling_data_loader_is_diagnosed_and_its_stall_is_an_idle_phase(control_cluster, boss):
    from django.test import Client

    from jobs.models import Job
    from jobs.snapshot import load_snapshot

    _, token = make_node("n1", 2)
    job = submit(boss, "stally", ["--stall-every", "8", "--stall-s", "1.5"], total_steps=60)
    control_cluster.start_server()
    control_cluster.start_worker()
    control_cluster.start_agent("n1", token, gpus=2)

    def measured():
        row = Job.objects.select_related("rhythm").get(pk=job.pk)
        from jobs.live_data import rhythm_summary

        summary = rhythm_summary(row)
        return summary if summary and any(p["kind"] == "data_stall" for p in summary["idle_phases"]) else None

    summary = wait_for(measured, 180, "the stalls to show as an idle phase")
    stall = next(p for p in summary["idle_phases"] if p["kind"] == "data_stall")
    assert stall["every_steps"] == 8 and 1.2 <= stall["duration_s"] <= 3.0
    assert summary["shares"]["data_wait"] > 0.05 and "data wait" in summary["diagnosis"]

    planned = next(j for j in load_snapshot(timezone.now()).jobs if j.name == "stally")
    assert planned.rhythm.step_s and max(planned.rhythm.step_s) < 5.0  # measured, not the submitted 5 s
    assert any(p.every_steps == 8 for p in planned.idle_phases)

    client = Client()
    client.force_login(boss)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "data stall every 8 steps" in page
    api = json.loads(client.get(f"/api/jobs/{job.pk}/").content)
    assert api["rhythm"]["samples"] > 0 and api["rhythm"]["idle_phases"]

"""A plain DDP loop on the integration library (examples/ddp_library), end to end with real
processes: under the control plane it reports its steps through the agent, is preempted by a
drain (SIGTERM, the ranks agree on a step, a DCP checkpoint is committed and reported), resumes
as a new run and ends with exactly the weights of an uninterrupted plain-torchrun run; an elastic
job grown onto idle GPUs resumes at the larger DP with the same global batch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.control_loop.conftest import ROOT, make_node, run_output, wait_for

pytestmark = [pytest.mark.services, pytest.mark.postgres, pytest.mark.redis, pytest.mark.torch,
              pytest.mark.slow, pytest.mark.timeout(480)]

EXAMPLE = ROOT / "examples" / "ddp_library" / "train.py"


def submit(owner, name: str, **spec):
    from jobs import actions

    values = dict(priority="regular", dp=2, dp_min=2, dp_max=2, global_batch=32, micro_batch=4, total_steps=40,
                  step_s=0.3, checkpoint_every_steps=10, checkpoint_save_s=1.0, checkpoint_load_s=2.0,
                  entrypoint=[str(EXAMPLE), "--step-s", "0.3"], integration="omni")
    values.update(spec)
    return actions.submit_job(owner, name=name, **values)


def records(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_library_job_is_preempted_at_a_checkpoint_and_resumes_to_the_uninterrupted_weights(control_cluster, boss):
    from jobs import actions
    from jobs.models import ElasticEvent, EventKind, Job, Node

    _, token = make_node("n1", 2)
    job = submit(boss, "lib")
    control_cluster.start_server()
    control_cluster.start_worker()
    control_cluster.start_agent("n1", token, gpus=2)
    run_dir = control_cluster.tmp / "runs" / "lib"

    wait_for(lambda: Job.objects.get(pk=job.pk).committed_steps >= 4, 150, "steps reported through the agent")
    record = records(run_dir)[-1]
    assert record["format"] == "omni-step/1" and record["dp"] == 2 and record["accum"] == 4
    assert {"data_wait_s", "compute_s", "comm_s", "rank_compute_s"} <= set(record)

    actions.drain_node(Node.objects.get(name="n1"), boss)
    wait_for(lambda: Job.objects.get(pk=job.pk).state == "preempted", 90, "the job to be preempted")
    preempted = ElasticEvent.objects.filter(kind=EventKind.OUTCOME, job_name="lib", outcome__kind="preempt").last()
    outcome = json.loads((run_dir / "exit.json").read_text())
    assert outcome["outcome"] == "preempted" and outcome["reason"] in ("SIGTERM", "peer rank", "control file")
    assert outcome["checkpoint_step"] == outcome["step"] > 0
    assert preempted.outcome["steps_lost"] == 0
    assert Job.objects.get(pk=job.pk).last_checkpoint_step == outcome["step"]
    assert f": checkpoint at step {outcome['step']}" in run_output(run_dir)

    actions.uncordon_node(Node.objects.get(name="n1"), boss)
    wait_for(lambda: Job.objects.get(pk=job.pk).state == "completed", 240, "the job to resume and complete")
    assert f"resumed from step {outcome['step']}: dp 2 -> 2" in run_output(run_dir)
    assert [r["step"] for r in records(run_dir)] == list(range(1, 41))  # each step once
    result = json.loads((run_dir / "result.json").read_text())

    reference = control_cluster.tmp / "reference"
    env = {k: v for k, v in control_cluster.env.items() if not k.startswith("OMNI_")}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(EXAMPLE),
                    "--run-dir", str(reference)], env={**env, "OMNI_TOTAL_STEPS": "40", "OMNI_CHECKPOINT_EVERY": "10"},
                   cwd=control_cluster.tmp, check=True, capture_output=True, timeout=180)
    expected = json.loads((reference / "result.json").read_text())
    assert result == expected  # bitwise: the same weights after the preemption and resume


def test_an_elastic_library_job_grows_onto_idle_gpus_keeping_its_global_batch(control_cluster, boss):
    from jobs.models import ElasticEvent, EventKind, Job

    _, token = make_node("n1", 4)
    # A short job holds half the node first, so the grower starts at its preferred 2 replicas
    # (with 4 GPUs free it would start at 4 at once: growth.start_larger) and grows when it ends.
    submit(boss, "first", total_steps=20)
    job = submit(boss, "grower", dp=2, dp_min=1, dp_max=4, total_steps=160, checkpoint_save_s=0.5,
                 checkpoint_load_s=0.5)
    # Growth waits resize_hysteresis_s (30 minutes by default) after a start: 3 s here. And it
    # must pay grow_gain_factor x its cost; on a loaded machine the measured launch (the load
    # cost) can take longer than this short job would gain, so any gain will do: the test is
    # about the library keeping the batch across a grow, not about the economics.
    overrides = json.loads(control_cluster.env["OMNI_PLANNER_OVERRIDES"])
    control_cluster.env["OMNI_PLANNER_OVERRIDES"] = json.dumps({**overrides, "resize_hysteresis_s": 3,
                                                                "grow_gain_factor": 0.01})
    control_cluster.start_server()
    control_cluster.start_worker()
    control_cluster.start_agent("n1", token, gpus=4)
    run_dir = control_cluster.tmp / "runs" / "grower"

    wait_for(lambda: ElasticEvent.objects.filter(kind__in=[EventKind.GROW, EventKind.LEND], job_name="grower").exists(), 150,
             "the planner to lend the idle GPUs")
    wait_for(lambda: any(r["dp"] > 2 for r in records(run_dir)), 120, "steps at the larger DP")
    wait_for(lambda: Job.objects.get(pk=job.pk).state == "completed", 300, "the job to complete")
    steps = records(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 161))
    layouts = {(r["dp"], r["accum"]) for r in steps}
    assert (2, 4) in layouts and any(dp > 2 for dp, _ in layouts), layouts
    assert all(r["global_batch"] == 32 and r["dp"] * r["accum"] * 4 == 32 for r in steps)
    assert "resumed from step" in run_output(run_dir)

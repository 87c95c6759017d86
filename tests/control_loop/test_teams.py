"""Teams end to end (docs/teams.md, planner rule 9), with real Celery, daphne, a node agent and
torch workers: team vision borrows the idle GPUs of team speech; speech submits; vision's job is
asked to give them back, checkpoints and yields within the lead time the planner gave it,
speech's job starts on them, and both "why" texts read right."""

from __future__ import annotations

import pytest

from tests.control_loop.conftest import make_node, run_output, wait_for

pytestmark = [pytest.mark.services, pytest.mark.postgres, pytest.mark.redis, pytest.mark.torch,
              pytest.mark.slow, pytest.mark.timeout(300)]


def _job(name):
    from jobs.models import Job

    return Job.objects.get(name=name)


def test_a_team_below_its_quota_reclaims_what_another_borrowed_checkpoint_first(control_cluster, boss):
    from jobs import actions
    from jobs.models import ElasticEvent, EventKind

    control_cluster.env["OMNI_PLANNER_OVERRIDES"] = '{"startup_s": 1, "reclaim_margin_s": 15}'
    _, token = make_node("n1", 2)
    vision = actions.create_team(boss, name="vision", quota_gpus=0)
    speech = actions.create_team(boss, name="speech", quota_gpus=2)
    spec = dict(priority="regular", dp=2, dp_min=2, dp_max=2, global_batch=16, micro_batch=2, step_s=0.8,
                checkpoint_every_steps=5, checkpoint_save_s=1.0, checkpoint_load_s=2.0, min_run_s=0)
    # Enough steps that vision's job cannot finish soon however fast the tiny model steps (at
    # ~30 ms a step, 2,000 steps were "free within 1 min" and the planner rightly waited).
    actions.submit_job(boss, name="v-train", team=vision, total_steps=100_000, **spec)
    control_cluster.start_server()
    control_cluster.start_worker()
    control_cluster.start_agent("n1", token, gpus=2)

    # 1. Vision, with no quota of its own, borrows both idle GPUs.
    wait_for(lambda: _job("v-train").committed_steps >= 3, 120, "vision's job to run on the idle GPUs")
    assert _job("v-train").allocations.count() == 2

    # 2. Speech is owed its 2 GPUs: the planner reclaims them, checkpoint first, with a lead time.
    actions.submit_job(boss, name="s-train", team=speech, total_steps=12, **spec)
    reclaim = wait_for(lambda: ElasticEvent.objects.filter(job_name="v-train", kind=EventKind.PREEMPT).first(), 60,
                       "the reclaim of vision's borrowed GPUs")
    assert reclaim.reason["rule"] == "quota.reclaim"
    assert reclaim.reason["text"].startswith(
        "s-train needs GPUs: team speech is below its quota (0 of 2 guaranteed GPUs) and reclaims the GPUs other "
        "teams borrowed: team vision holds 2 GPUs, 2 GPUs beyond its quota of 0")
    assert reclaim.reason["text"].endswith("and saves a checkpoint first.")
    inputs = reclaim.reason["inputs"]
    assert inputs["for_team"] == "speech" and inputs["victim_team"] == "vision" and inputs["lead_time_s"] > 0

    # 3. It saved and gave the GPUs back within the lead time, losing nothing.
    outcome = wait_for(lambda: ElasticEvent.objects.filter(job_name="v-train", kind=EventKind.OUTCOME,
                                                           refers_to=reclaim).first(), 90,
                       "vision's job to checkpoint and yield")
    took_s = (outcome.at - reclaim.at).total_seconds()
    print(f"yielded {took_s:.1f} s after the reclaim (lead time {inputs['lead_time_s']:.1f} s)")
    assert outcome.outcome["ok"] and outcome.outcome["steps_lost"] == 0
    assert took_s <= inputs["lead_time_s"] + 5.0  # +5: the agent's done frame and the outcome's transaction
    v = _job("v-train")
    assert v.state == "preempted" and v.last_checkpoint_step >= 3 and v.allocations.count() == 0

    # 4. Vision's job says why it waits (while speech's runs on the GPUs); speech's completes.
    why = wait_for(lambda: (r := _job("v-train").pending_reason) and "team vision" in r and r, 60,
                   "vision's job to say why it waits")
    assert "team vision uses 0 of its 0 guaranteed GPUs and may borrow any idle GPU beyond them; none are idle" in why
    wait_for(lambda: _job("s-train").state == "completed", 180, "speech's job to complete")
    # Once speech is done its GPUs are idle again: vision borrows them and resumes from its checkpoint.
    wait_for(lambda: _job("v-train").state == "running" and _job("v-train").committed_steps > v.last_checkpoint_step,
             180, "vision's job to borrow the idle GPUs again and resume")
    assert "resumed from step" in run_output(control_cluster.tmp / "runs" / "v-train")

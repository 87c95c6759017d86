"""The measured rhythm reaches the planner (jobs/actions/rhythm.py, jobs/snapshot.py): step
records folded into the job's rhythm row through the agent frame path, the snapshot carrying the
measured step times, saves and idle phases instead of the spec's, and stragglers setting their
node's speed factor through an audited row, with hysteresis, cleared on recovery."""

from __future__ import annotations

import pytest
from django.utils import timezone

from jobs import actions
from jobs.models import ElasticEvent, EventKind, JobRhythm, Node
from jobs.planner.rhythm import predict
from jobs.rhythm import STRAGGLER_WINDOW
from jobs.snapshot import load_snapshot, planner_config
from tests.jobs.test_rhythm_state import records

pytestmark = pytest.mark.django_db

PLACED = {"rule": "test", "text": "placed by the test", "inputs": {}}


@pytest.fixture
def running(make_job, make_nodes):
    nodes = make_nodes(racks=1, switches=1, nodes=2, gpus=2)
    job = make_job(name="measured", dp=2, dp_min=2, dp_max=2, step_s=10.0, checkpoint_every_steps=50)
    return actions.place_job(job, [(nodes[0], 0), (nodes[1], 0)], actor="planner", reason=PLACED), nodes


def snapshot_job(name: str):
    return next(j for j in load_snapshot(timezone.now()).jobs if j.name == name)


def test_before_any_record_the_planner_plans_on_the_spec(running):
    job, _ = running
    planned = snapshot_job("measured")
    assert planned.rhythm.step_s == () and planned.idle_phases == ()
    assert predict(planned, planner_config()).mean_step_s == pytest.approx(10.0)


def test_the_measured_step_time_saves_and_idle_phases_reach_the_snapshot(running):
    job, _ = running
    pauses = {s: 40.0 for s in (30, 60, 90, 120)}
    actions.observe_step_records(job.pk, records(1, 130, step_s=2.0, pause_after=pauses))
    actions.observe_step_records(job.pk, records(125, 130, step_s=2.0))  # sent again: ignored
    job.refresh_from_db()
    from jobs.actions._common import note_checkpoint

    note_checkpoint(job, {"save_s": 3.5})
    row = JobRhythm.objects.get(job=job)
    assert row.samples == 130 and row.mean_step_s == pytest.approx(2.0) and row.error_p95 == pytest.approx(0.0)
    planned = snapshot_job("measured")
    assert len(planned.rhythm.step_s) == 130 and set(planned.rhythm.step_s) == {2.0}
    assert planned.rhythm.save_s == (3.5,)
    assert [(p.every_steps, p.duration_s) for p in planned.idle_phases] == [(30, 40.0)]
    prediction = predict(planned, planner_config())
    assert prediction.mean_step_s == pytest.approx(2.0) and prediction.save_s == 3.5  # not the spec's 10 s


def test_a_ring_measured_at_another_dp_is_not_the_current_rhythm(running):
    job, _ = running
    actions.observe_step_records(job.pk, records(1, 20, step_s=2.0, dp=4))
    assert snapshot_job("measured").rhythm.step_s == ()


def test_a_straggling_rank_slows_its_node_through_an_audited_row_and_recovery_clears_it(running):
    job, nodes = running
    slow = ["r0s0n0", "r0s0n1"]
    actions.observe_step_records(job.pk, records(1, 5, ranks=[1.0, 2.0], rank_nodes=slow))
    assert Node.objects.get(name="r0s0n1").speed_factor == 1.0  # not a whole window yet
    actions.observe_step_records(job.pk, records(6, STRAGGLER_WINDOW + 2, start_at=2000, ranks=[1.0, 2.0]))
    node = Node.objects.get(name="r0s0n1")
    assert node.speed_factor == pytest.approx(2.0) and Node.objects.get(name="r0s0n0").speed_factor == 1.0
    row = ElasticEvent.objects.get(kind=EventKind.NODE_SPEED)
    assert row.reason["rule"] == "straggler" and row.job_name == "measured"
    assert "r0s0n1 runs slow: rank 1 (2.00x) of measured" in row.reason["text"]
    assert row.reason["inputs"]["speed_after"] == 2.0
    assert snapshot_job("measured") and next(n for n in load_snapshot(timezone.now()).nodes
                                             if n.name == "r0s0n1").speed_factor == 2.0

    # A small wobble is not rewritten (hysteresis); recovery over a whole window clears it.
    actions.observe_step_records(job.pk, records(100, 100 + STRAGGLER_WINDOW, start_at=5000, ranks=[1.0, 2.1]))
    assert ElasticEvent.objects.filter(kind=EventKind.NODE_SPEED).count() == 1
    actions.observe_step_records(job.pk, records(200, 200 + STRAGGLER_WINDOW, start_at=9000, ranks=[1.0, 1.02]))
    assert Node.objects.get(name="r0s0n1").speed_factor == 1.0
    cleared = ElasticEvent.objects.filter(kind=EventKind.NODE_SPEED).last()
    assert cleared.reason["rule"] == "straggler_recovered" and "runs at speed again" in cleared.reason["text"]


def test_a_resize_is_followed_by_an_audited_health_check(running):
    from tests.jobs.test_rhythm_state import _losses

    job, _ = running
    actions.observe_step_records(job.pk, _losses(records(1, 30, accum=8, micro_batch=4, global_batch=64, run="r1"), 2.0))
    actions.observe_step_records(job.pk, _losses(records(31, 36, start_at=5000.0, dp=4, accum=4, micro_batch=4,
                                                         global_batch=64, run="r2"), 1.97))
    row = ElasticEvent.objects.get(kind=EventKind.HEALTH_CHECK)
    assert row.reason["rule"] == "post_change_health" and row.actor == "omni:rhythm"
    assert row.reason["text"].startswith("After the resize at step 31 (dp 2 -> 4) the run is healthy")
    from jobs.live_data import rhythm_summary
    from jobs.models import Job

    summary = rhythm_summary(Job.objects.select_related("rhythm").get(pk=job.pk))
    assert summary["last_check"]["text"] == row.reason["text"]
    actions.observe_step_records(job.pk, records(37, 40, start_at=6000.0, dp=4, run="r2"))
    assert ElasticEvent.objects.filter(kind=EventKind.HEALTH_CHECK).count() == 1  # one check per change


def test_the_console_lists_the_jobs_losing_most_gpu_time_and_to_what(running, make_job, make_nodes, django_user_model):
    from jobs import roles
    from jobs.live_consumers import payload_for_viewer
    from jobs.live_data import cluster_summary

    job, nodes = running
    stalled = actions.place_job(make_job(name="stalled", dp=1, dp_min=1, dp_max=1, step_s=1.0),
                                [(nodes[0], 1)], actor="planner", reason=PLACED)
    steady = records(1, 30)                     # 5% data wait, 15% communication
    starved = records(1, 30)
    for r in starved:
        r["data_wait_s"], r["compute_s"], r["comm_s"] = 0.7, 0.25, 0.05
    actions.observe_step_records(job.pk, steady)
    actions.observe_step_records(stalled.pk, starved)
    summary = cluster_summary()
    losing = summary["losing"]
    # Both jobs' step times were predicted exactly (constant records): the pooled accuracy says so.
    assert summary["predictions"] == [{"kind": "step", "words": "next step time", "jobs": 2, "p50": 0.0, "p95": 0.0}]
    # One GPU three-quarters lost outweighs two a fifth lost.
    assert [(item["name"], item["gpus"], item["to"]) for item in losing] == [("stalled", 1, "data_wait"), ("measured", 2, "comm")]
    assert losing[1]["lost_gpus"] == pytest.approx(2 * 0.2, abs=0.01)
    assert losing[0]["words"] == "75% of its GPU time, most to data wait"
    # Another researcher sees neither job's name linked ... and one who may not see them, nothing.
    visibility = {job.pk: roles.Visibility.SUMMARY, stalled.pk: roles.Visibility.NONE}
    cut = payload_for_viewer("cluster_summary", cluster_summary(), lambda pk: visibility[pk])
    assert [(item["name"], item.get("visibility")) for item in cut["losing"]] == [("measured", "summary")]
    assert cut["losing"] and all(item["id"] != stalled.pk for item in cut["losing"])


def test_a_reclaim_is_scored_against_its_predicted_stop_and_its_audit_row_says_how_long_it_took(running):
    from jobs.actions.planner_pass import _apply_action
    from jobs.models import Command, CommandState, PlannerRun
    from jobs.planner.decisions import Action, Reason
    from jobs.planner.snapshot import Gpu

    job, _ = running
    before = tuple(Gpu(a.node.name, a.gpu_index) for a in job.allocations.select_related("node"))
    action = Action(kind="preempt", job=job.name, gpus_before=before, gpus_after=(), dp_after=0,
                    reason=Reason("harvest.reclaim", "reclaimed by the test",
                                  {"predicted_stop_s": 4.0, "lead_time_s": 30.0}),
                    deadline_s=timezone.now().timestamp() + 30.0, graceful=True)
    _apply_action(action, run=PlannerRun.objects.create(trigger="test"), now=timezone.now(),
                  nodes={n.name: n for n in Node.objects.all()}, pools={}, touched=set())
    for command in Command.objects.filter(job=job, state=CommandState.PENDING):
        actions.record_command_outcome(command.node, str(command.id), ok=True,
                                       outcome={"checkpoint_step": 0, "save_s": 0.5})
    outcome = ElasticEvent.objects.filter(kind=EventKind.OUTCOME, job_name="measured").last()
    took = outcome.outcome["stop_took_s"]
    assert 0 <= took < 30 and outcome.outcome["within_lead"] is True
    assert outcome.outcome["stop_predicted_s"] == 4.0
    accuracy = JobRhythm.objects.get(job=job).accuracy["reclaim"]
    assert accuracy["n"] == 1 and accuracy["p50"] == pytest.approx(abs(took - 4.0) / max(took, 4.0), rel=0.05)


def test_metrics_export_every_prediction_error_and_the_gpu_time_lost(running):
    from telemetry.views import render_metrics

    job, _ = running
    rows = records(1, 40, pause_after={s: 30.0 for s in (10, 20, 30)})
    actions.observe_step_records(job.pk, rows)
    from jobs.actions.rhythm import observe_checkpoint, observe_reclaim

    for seconds in (2.0, 2.0, 2.5, 2.0):
        observe_checkpoint(job, save_s=seconds)
    observe_reclaim(job, predicted_s=5.0, lead_s=20.0, took_s=4.0)
    text = render_metrics()
    assert 'omni_job_step_prediction_error{job="measured",quantile="0.95"} 0' in text
    assert 'omni_job_prediction_error{job="measured",prediction="reclaim",quantile="0.5"} 0.2' in text
    assert 'omni_job_prediction_error{job="measured",prediction="save",quantile="0.95"}' in text
    assert 'omni_prediction_error_p95_across_jobs{prediction="reclaim",stat="max"} 0.2' in text
    lost = next(line for line in text.splitlines() if line.startswith("omni_job_gpu_time_lost_share{"))
    assert lost.startswith('omni_job_gpu_time_lost_share{job="measured",to="pause"} 0.')


def test_the_card_says_why_it_cannot_say_where_the_time_goes(running):
    """A plain script's records carry only step and step time: the card's "Where the time goes"
    was an empty cell. It says "after 10 steps" until then, and then that they were not measured."""
    from jobs.live_data import rhythm_summary
    from jobs.models import Job

    job, _ = running
    bare = [{"step": r["step"], "step_s": r["step_s"], "at": r["at"]} for r in records(1, 30)]
    actions.observe_step_records(job.pk, bare[:5])
    assert rhythm_summary(Job.objects.select_related("rhythm").get(pk=job.pk))["diagnosis"] == "after 10 steps"
    actions.observe_step_records(job.pk, bare[5:])
    summary = rhythm_summary(Job.objects.select_related("rhythm").get(pk=job.pk))
    assert summary["diagnosis"] == "not measured: its step records give no compute, data-wait and communication times"
    actions.observe_step_records(job.pk, records(31, 45, start_at=2000.0))
    summary = rhythm_summary(Job.objects.select_related("rhythm").get(pk=job.pk))
    assert summary["diagnosis"].startswith("Each step is 80% compute"), summary["diagnosis"]

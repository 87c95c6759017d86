"""The job page's Rhythm card in Chromium (docs/rhythm.md): before any step record it says the
planner uses the submitted step time; as records arrive it fills in, with no reload, from the
API: the measured step time, the prediction error, the idle phases, the diagnosis, the last
health check and the stragglers."""

from __future__ import annotations

from jobs import actions
from jobs.models import Job
from tests.jobs.test_rhythm_state import records
from tests.live import test_browser as shared

pytestmark = shared.pytestmark

asgi_server = shared.asgi_server
shared_channel_layer = shared.shared_channel_layer
browser = shared.browser
open_as = shared.open_as
in_thread = shared.in_thread

REFRESH_MS = 20000  # the card refreshes every 15 s


def test_the_rhythm_card_fills_in_from_the_measured_records(open_as, asgi_server, researcher, make_job, make_nodes):
    nodes = in_thread(lambda: make_nodes(racks=1, switches=1, nodes=2, gpus=2))
    job = in_thread(lambda: make_job(name="rhythmic", dp=2, dp_min=2, dp_max=2, step_s=10.0,
                                     checkpoint_every_steps=50))
    in_thread(lambda: actions.place_job(Job.objects.get(pk=job.pk), [(nodes[0], 0), (nodes[1], 0)], actor="planner",
                                        reason={"rule": "place", "text": "Placed.", "inputs": {}}))
    page = open_as(researcher)
    page.goto(f"{asgi_server}/jobs/{job.pk}/")
    card = page.locator("#rhythm")
    assert "No step records yet: the planner uses the submitted 10.00 s per step." in card.inner_text()

    rows = records(1, 110, step_s=2.0, pause_after={15: 30.0, 35: 30.0, 55: 30.0, 75: 30.0, 95: 30.0},
                   ranks=[1.0, 2.5], rank_nodes=[nodes[0].name, nodes[1].name])
    in_thread(lambda: actions.observe_step_records(job.pk, rows))
    card.locator("[data-rhythm=step]", has_text="2.000 s").wait_for(timeout=REFRESH_MS)
    text = card.inner_text()
    assert "over the last 110 steps at dp 2 (submitted 10.00 s)" in text
    assert "pause (evaluation or other off-step work) every 20 steps, 30.0 s" in text
    assert "Each step is 80% compute, 5% data wait and 15% communication." in text
    assert f"rank 1 on {nodes[1].name} (2.5x)" in text
    assert "p50 0.000, p95 0.000 of a step" in text
    # The pauses' windows were predicted and came (scored), the next is expected after step 100.
    assert "next idle window p50 0.000, p95 0.000 (3 scored" in text
    assert "pause (evaluation or other off-step work) after step 115, about 30.0 s" in text
    assert "of its GPU time, most to pauses off the step loop" in text
    page.screenshot(path=str(shared.ARTIFACTS / "job-rhythm-card.png"), full_page=True)


def test_the_console_lists_the_jobs_losing_gpu_time_live(open_as, asgi_server, operator, make_job, make_nodes):
    nodes = in_thread(lambda: make_nodes(racks=1, switches=1, nodes=1, gpus=2))
    job = in_thread(lambda: make_job(name="starved", dp=2, dp_min=2, dp_max=2, step_s=1.0))
    in_thread(lambda: actions.place_job(Job.objects.get(pk=job.pk), [(nodes[0], 0), (nodes[0], 1)], actor="planner",
                                        reason={"rule": "place", "text": "Placed.", "inputs": {}}))
    page = open_as(operator)
    page.goto(f"{asgi_server}/console/")
    losing = page.locator("#losing")
    assert "No running job is losing GPU time" in losing.inner_text()
    rows = records(1, 30)
    for r in rows:
        r["data_wait_s"], r["compute_s"], r["comm_s"] = 0.6, 0.35, 0.05
    in_thread(lambda: actions.observe_step_records(job.pk, rows))
    # The list is part of the live cluster summary: the next audit row brings it, no reload.
    from django.db import transaction

    from jobs.audit import record_event
    from jobs.models import EventKind

    def audit_row() -> None:
        with transaction.atomic():
            record_event(EventKind.CHECKPOINT, job=Job.objects.get(pk=job.pk), actor="test",
                         reason={"rule": "test", "text": "A checkpoint.", "inputs": {}})

    in_thread(audit_row)
    losing.locator("tr", has_text="starved").wait_for(timeout=REFRESH_MS)
    assert "65% of its GPU time, most to data wait" in losing.inner_text()
    # ... and so is the cluster-wide prediction accuracy: 29 steps scored, all exactly predicted.
    assert "next step time p50 0.000, p95 0.000 (1 job)" in page.locator("#predictions").inner_text()
    page.screenshot(path=str(shared.ARTIFACTS / "console-losing.png"), full_page=True)

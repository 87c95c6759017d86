"""Every live panel of the Cluster page and the audit page's chain banner changes after its cause,
with no reload, in Chromium against ``manage.py serve`` (the fixtures of tests/live/test_browser.py:
the same server on the test database, the same Redis channel layer shared with this process).

Each cause is written here, in a thread of its own, the way a view or a worker writes it; jobs.live
sends the cluster summary and the chain check after commit (docs/live-ui.md).
"""

from __future__ import annotations

import pytest
from django.db import transaction

from jobs import actions
from jobs.audit import record_event
from jobs.models import ElasticEvent, EventKind, Job, Node
from tests.live import test_browser as shared

pytestmark = shared.pytestmark

# The fixtures of the browser tests, shared by name (a module-scoped server of this module's own).
asgi_server = shared.asgi_server
shared_channel_layer = shared.shared_channel_layer
browser = shared.browser
open_as = shared.open_as
in_thread = shared.in_thread
wait_live = shared.wait_live

LIVE_S = 3000  # ms a panel may take to follow its cause


def count(page, name: str) -> str:
    return page.locator(f"#cluster-counts [data-count={name}]").inner_text()


def queue_names(page) -> list[str]:
    return page.locator("#queue tbody tr[data-job-id] td:first-child strong").all_inner_texts()


@pytest.fixture
def cluster(make_nodes):
    """Two nodes of four GPUs, nothing running."""
    return in_thread(lambda: make_nodes(racks=1, switches=1, nodes=2, gpus=4))


def test_header_counts_and_pills_follow_a_placement_a_drain_and_a_pause(open_as, asgi_server, operator, researcher,
                                                                       make_job, cluster):
    job = in_thread(lambda: make_job(name="placed", dp=2, dp_min=1, dp_max=2))
    page = open_as(operator)
    page.goto(f"{asgi_server}/console/")
    wait_live(page)
    assert (count(page, "nodes"), count(page, "gpus_total"), count(page, "gpus_allocated")) == ("2", "8", "0")
    in_thread(lambda: actions.place_job(Job.objects.get(pk=job.pk), [(cluster[0], 0), (cluster[0], 1)],
                                        actor="planner", reason={"rule": "place", "text": "Placed.", "inputs": {}}))
    page.locator("#cluster-counts [data-count=gpus_allocated]", has_text="2").wait_for(timeout=LIVE_S)
    in_thread(lambda: actions.drain_node(Node.objects.get(pk=cluster[1].pk), operator))
    page.locator("#cluster-pills .pill.health-draining", has_text="1 draining").wait_for(timeout=LIVE_S)
    assert page.locator("#cluster-pills .pill.health-healthy").inner_text() == "1 healthy"
    in_thread(lambda: actions.set_planner_control(operator, paused=True))
    page.locator("#cluster-pills .pill", has_text="planner paused").wait_for(timeout=LIVE_S)


def test_the_queue_follows_a_submit_a_start_and_a_cancel(open_as, asgi_server, operator, researcher, make_job,
                                                        cluster):
    first = in_thread(lambda: make_job(name="waits-first", dp=2, dp_min=1, dp_max=2))
    page = open_as(operator)
    page.goto(f"{asgi_server}/console/")
    wait_live(page)
    assert queue_names(page) == ["waits-first"]
    second = in_thread(lambda: make_job(name="waits-second", dp=2, dp_min=1, dp_max=2))
    row = page.locator(f"#queue tr[data-job-id='{second.pk}']")
    row.wait_for(timeout=LIVE_S)
    assert "The planner has not considered this job yet." in row.inner_text()
    assert page.locator("#queue-count").inner_text() == "2"

    def hold() -> None:
        with transaction.atomic():
            record_event(EventKind.HOLD, job=Job.objects.get(pk=second.pk), actor="planner",
                         reason={"rule": "no_capacity", "text": "Waiting for 8 GPUs on one switch.", "inputs": {}})

    in_thread(hold)
    row.locator("td.wrap", has_text="Waiting for 8 GPUs on one switch.").wait_for(timeout=LIVE_S)
    in_thread(lambda: actions.place_job(Job.objects.get(pk=first.pk), [(cluster[0], 0), (cluster[0], 1)],
                                        actor="planner", reason={"rule": "place", "text": "Placed.", "inputs": {}}))
    page.locator(f"#queue tr[data-job-id='{first.pk}']").wait_for(state="detached", timeout=LIVE_S)
    in_thread(lambda: actions.cancel_job(Job.objects.get(pk=second.pk), researcher))
    page.locator("#queue td", has_text="Nothing is waiting.").wait_for(timeout=LIVE_S)
    assert page.locator("#queue-count").inner_text() == "0"


def test_the_planner_line_follows_a_pass_and_its_time_is_relative(open_as, asgi_server, operator, cluster):
    page = open_as(operator)
    page.goto(f"{asgi_server}/console/")
    wait_live(page)
    assert page.locator("#planner-last").inner_text() == ""
    run = in_thread(lambda: actions.run_planner_pass(trigger="browser-test")).run
    line = page.locator("#planner-last", has_text="last pass")
    line.wait_for(timeout=LIVE_S)
    assert line.inner_text() == f"last pass just now, {round(run.duration_ms)} ms, {run.actions} actions"
    # The time is a <time> the page re-renders every 30 s, like every relative time.
    assert page.locator("#planner-last time[data-relative=only]").get_attribute("datetime")[:19] == \
        run.started_at.isoformat()[:19]


def test_the_utilisation_chart_gets_a_point_after_a_change(open_as, asgi_server, operator, make_job, cluster):
    job = in_thread(lambda: make_job(name="grows-the-chart", dp=4, dp_min=1, dp_max=4))
    page = open_as(operator)
    page.goto(f"{asgi_server}/console/")
    wait_live(page)
    points = page.evaluate("document.getElementById('chart-util').data[0].x.length")
    in_thread(lambda: actions.place_job(Job.objects.get(pk=job.pk), [(cluster[0], i) for i in range(4)],
                                        actor="planner", reason={"rule": "place", "text": "Placed.", "inputs": {}}))
    page.wait_for_function(f"document.getElementById('chart-util').data[0].x.length > {points}", timeout=LIVE_S)
    allocated = page.evaluate("document.getElementById('chart-util').data[0].y")
    harvested = page.evaluate("document.getElementById('chart-util').data[2].y")
    assert (allocated[-1], harvested[-1]) == (4, 0)


def test_the_audit_banner_counts_a_new_row(open_as, asgi_server, auditor, make_job):
    in_thread(lambda: make_job(name="first-row"))
    page = open_as(auditor)
    page.goto(f"{asgi_server}/audit/")
    wait_live(page)
    banner = page.locator("#chain-status")
    before = ElasticEvent.objects.count()
    assert f"all {before} rows" in banner.inner_text()
    job = in_thread(lambda: make_job(name="second-row"))
    newest = ElasticEvent.objects.filter(job=job).latest("id").pk
    page.locator("#chain-status", has_text=f"all {before + 1} rows, up to row {newest}").wait_for(timeout=LIVE_S)
    assert "Hash chain verified" in banner.inner_text()


def test_the_audit_page_puts_rows_that_arrive_out_of_order_in_order_and_still_verifies(open_as, asgi_server, auditor,
                                                                                        make_job):
    """Two senders' messages can cross (found 2026-12-07 on the demo's Audit page left open ten
    minutes: the banner read "Verified up to row 82 (82 of 94 rows)" while a reload verified all
    94). Here two transactions' rows are sent newest first: the banner waits for the older check
    and then verifies both, and the table has them newest first, as a reload does."""
    from django.db.models.signals import post_save

    from jobs import live
    from jobs.live_events import _on_event_saved, audit_messages

    UID = "omni-live-audit-broadcast"  # noqa: N806 (jobs.live_events.connect's)

    in_thread(lambda: make_job(name="first-row"))
    page = open_as(auditor)
    page.goto(f"{asgi_server}/audit/")
    wait_live(page)
    before = ElasticEvent.objects.count()

    def two_rows_sent_newest_first() -> tuple[int, int]:
        post_save.disconnect(sender=ElasticEvent, dispatch_uid=UID)  # sent below, by hand
        try:
            ids = []
            for n in (1, 2):
                with transaction.atomic():
                    ids.append(record_event(EventKind.OVERRIDE, actor="olga", reason={
                        "rule": "test", "text": f"row {n}", "inputs": {}}).pk)
        finally:
            post_save.connect(_on_event_saved, sender=ElasticEvent, dispatch_uid=UID)
        for pk in reversed(ids):
            live.send_messages(audit_messages([pk]))
            assert live.wait_sent()
        return ids[0], ids[1]

    older, newer = in_thread(two_rows_sent_newest_first)
    banner = page.locator("#chain-status")
    banner.locator(f"text=all {before + 2} rows, up to row {newer}").wait_for(timeout=LIVE_S)
    assert "Hash chain verified" in banner.inner_text()
    page.locator(f"#audit-table tr[data-event-id='{older}']").wait_for(timeout=LIVE_S)
    ids = [int(i) for i in page.locator("#audit-table tr[data-event-id]").evaluate_all(
        "rows => rows.map((r) => r.dataset.eventId)")]
    assert ids == sorted(ids, reverse=True) and ids[:2] == [newer, older]

"""The live pages without a browser: roles on every page, POST-only actions, pinned query counts,
streamed exports, the chain status and the sentences the logs are written in."""

from __future__ import annotations

import csv
import io
import json
import re
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.cache import cache
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from jobs import actions
from jobs.live_events import compact_nodes, describe_event
from jobs.models import ElasticEvent, EventKind, Job, Node, PlannerControl

pytestmark = pytest.mark.django_db


def client_for(user) -> Client:
    client = Client(enforce_csrf_checks=False)
    if user is not None:
        client.force_login(user)
    return client


@pytest.fixture(autouse=True)
def fresh_chain_cache():
    cache.clear()


@pytest.fixture
def cluster(researcher, other_researcher, operator, make_job, make_nodes):
    """Four nodes, a placed job per researcher, a waiting one, and a reservation with a loan."""
    nodes = make_nodes(racks=1, switches=2, nodes=2, gpus=4)
    mine = make_job(name="mine", dp=2)
    theirs = make_job(owner=other_researcher, name="theirs", dp=2)
    waiting = make_job(name="waiting", dp=4, dp_min=4)
    critical = make_job(owner=operator, name="crit", priority="critical", dp=2, dp_min=2, dp_max=2)
    reservation = actions.create_reservation(
        operator, name="crit-window", job=critical, gpus=2, start_at=timezone.now() - timedelta(minutes=5),
        period_s=3600, active_s=1800,
    )
    actions.place_job(mine, [(nodes[0], 0), (nodes[0], 1)], actor="planner",
                      reason={"rule": "place", "text": "Placed mine.", "inputs": {}})
    actions.place_job(theirs, [(nodes[1], 0), (nodes[1], 1)], actor="planner", borrowed_from=reservation,
                      loan_until=timezone.now() + timedelta(minutes=20),
                      reason={"rule": "lend", "text": "Lent crit-window's GPUs to theirs.", "inputs": {}})
    return {"nodes": nodes, "mine": mine, "theirs": theirs, "waiting": waiting, "reservation": reservation}


PAGES = ["dashboard", "console", "audit"]


@pytest.mark.parametrize("name", PAGES)
def test_anonymous_visitors_are_sent_to_login(name):
    response = Client().get(reverse(name))
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_a_user_without_a_role_gets_the_no_role_page(outsider):
    for name in PAGES:
        assert client_for(outsider).get(reverse(name)).status_code == 403


def test_researcher_sees_own_job_page_but_not_anothers_nor_the_audit(researcher, cluster):
    client = client_for(researcher)
    assert client.get(reverse("job-page", args=[cluster["mine"].pk])).status_code == 200
    assert client.get(reverse("job-page", args=[cluster["theirs"].pk])).status_code == 403
    assert client.get(reverse("audit")).status_code == 403
    assert client.get(reverse("audit-export", args=["csv"])).status_code == 403
    assert client.get(reverse("console")).status_code == 200  # the cluster is visible, read-only


def test_dashboard_lists_only_my_jobs_for_a_researcher(researcher, cluster):
    body = client_for(researcher).get(reverse("dashboard")).content.decode()
    assert "mine" in body and "waiting" in body and "theirs" not in body


def test_dashboard_filters_by_state_and_class(operator, cluster):
    client = client_for(operator)
    body = client.get(reverse("dashboard"), {"state": "waiting"}).content.decode()
    assert f'data-job-id="{cluster["waiting"].pk}"' in body
    assert f'data-job-id="{cluster["mine"].pk}"' not in body
    body = client.get(reverse("dashboard"), {"priority": "critical"}).content.decode()
    assert "crit" in body and f'data-job-id="{cluster["mine"].pk}"' not in body


def test_dashboard_shows_eta_and_the_last_event_in_words(researcher, cluster):
    body = client_for(researcher).get(reverse("dashboard")).content.decode()
    assert "ETA 16 min" in body  # 1000 steps at the spec's 1.0 s/step
    # A waiting job's time is its run once it starts, not when it ends.
    waiting = re.search(rf'data-job-id="{cluster["waiting"].pk}".*?</tr>', body, re.S).group(0)
    assert "run 16 min once it starts" in waiting and "ETA 16" not in waiting
    assert "Placed mine; on r0s0n0." in body


def test_dashboard_query_count_does_not_grow_with_jobs(operator, cluster, make_job, django_assert_max_num_queries):
    for i in range(30):
        make_job(name=f"extra-{i}")
    client = client_for(operator)
    with django_assert_max_num_queries(14):
        assert client.get(reverse("dashboard")).status_code == 200


def test_console_query_count_does_not_grow_with_nodes(operator, cluster, make_nodes, django_assert_max_num_queries):
    Node.objects.bulk_create(Node(name=f"x{i}", rack="x", switch="xs", gpu_count=8) for i in range(40))
    client = client_for(operator)
    # Telemetry's cluster query alone takes 4; the losing jobs 1; the teams' bars 1 with no team (2 with some);
    # the job counts (the dashboard header's, in the cluster summary) 1.
    with django_assert_max_num_queries(24):
        response = client.get(reverse("console"))
    assert response.status_code == 200
    body = response.content.decode()
    assert 'id="node-x39"' in body
    assert "borrowed" in body  # theirs holds loaned GPUs


def test_audit_query_count_is_flat_over_a_page(auditor, cluster, make_job, django_assert_max_num_queries):
    for i in range(60):
        make_job(name=f"sweep-{i}")
    client = client_for(auditor)
    with django_assert_max_num_queries(14):
        assert client.get(reverse("audit")).status_code == 200


def test_job_page_explains_why_it_waits_from_the_planners_last_hold(researcher, cluster):
    from django.db import transaction

    from jobs.audit import record_event

    with transaction.atomic():
        record_event(EventKind.HOLD, job=cluster["waiting"], actor="planner",
                     reason={"rule": "no_capacity", "text": "Needs 4 GPUs; 2 are free until crit-window ends.",
                             "inputs": {}})
    body = client_for(researcher).get(reverse("job-page", args=[cluster["waiting"].pk])).content.decode()
    assert "Why it is waiting" in body
    assert "Needs 4 GPUs; 2 are free until crit-window ends." in body


def test_node_actions_are_post_only_and_operator_only(operator, auditor, researcher, cluster):
    node = cluster["nodes"][2]
    url = reverse("console-node-action", args=[node.pk, "cordon"])
    assert client_for(operator).get(url).status_code == 405
    assert client_for(auditor).post(url).status_code == 403
    assert client_for(researcher).post(url).status_code == 403
    node.refresh_from_db()
    assert node.state == "healthy"
    response = client_for(operator).post(url)
    assert response.status_code == 302
    node.refresh_from_db()
    assert node.state == "cordoned"
    assert ElasticEvent.objects.filter(kind=EventKind.CORDON, actor="olive").count() == 1


def test_an_illegal_node_move_is_explained_not_a_500(operator, cluster):
    node = cluster["nodes"][2]
    response = client_for(operator).post(reverse("console-node-action", args=[node.pk, "uncordon"]), follow=True)
    assert response.status_code == 200
    assert "cannot go from" in response.content.decode()


def test_csrf_is_enforced_on_actions(operator, cluster):
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    response = client.post(reverse("console-node-action", args=[cluster["nodes"][2].pk, "drain"]))
    assert response.status_code == 403


def test_planner_controls_apply_only_what_changed_and_are_audited(operator, auditor, cluster):
    control = PlannerControl.load()
    data = {"paused": "on", "safety_factor": "2.0", "min_run_s": control.min_run_s,
            "reclaim_grace_s": control.reclaim_grace_s}
    assert client_for(auditor).post(reverse("console-planner"), data).status_code == 403
    response = client_for(operator).post(reverse("console-planner"), data)
    assert response.status_code == 302
    control.refresh_from_db()
    assert control.paused and control.safety_factor == 2.0
    event = ElasticEvent.objects.filter(kind=EventKind.OVERRIDE).last()
    assert set(event.reason["inputs"]["after"]) == {"paused", "safety_factor"}


def test_the_console_draws_no_window_of_a_reservation_whose_job_has_ended(operator, cluster):
    """The reservation's row says its job ended and holds nothing since; its timeline row keeps
    only the windows up to then (the planner leaves such a reservation out)."""
    client = client_for(operator)
    before = client.get(reverse("console"))
    assert before.context["console_data"]["gantt"][0]["windows"]  # the open window and those ahead
    actions.cancel_job(cluster["reservation"].job, operator)
    after = client.get(reverse("console"))
    (row,) = after.context["console_data"]["gantt"]
    ended = Job.objects.get(pk=cluster["reservation"].job_id).finished_at
    assert [w[1] for w in row["windows"]] == [ended.isoformat()]  # the open window, cut at the cancel
    assert "its job cancelled" in after.content.decode() and "nothing held since" in after.content.decode()


def test_the_consoles_panels_come_without_its_utilisation_history(operator, cluster):
    """What the Cluster page left open fetches after job rows and every minute: the same page,
    its reservations table marked as a panel and its Gantt's data, without the walk back through
    the log for the utilisation chart."""
    client = client_for(operator)
    full = client.get(reverse("console"))
    panels = client.get(reverse("console"), {"panels": "1"})
    assert full.context["console_data"]["utilisation"] is not None
    assert panels.context["console_data"]["utilisation"] is None
    assert panels.context["console_data"]["gantt"] == full.context["console_data"]["gantt"]
    assert 'data-panel="reservations"' in panels.content.decode() and "crit-window" in panels.content.decode()


def test_reservation_form_shows_the_actions_validation(operator, cluster):
    client = client_for(operator)
    critical = cluster["reservation"].job
    response = client.post(reverse("console-reservation-new"), {
        "name": "odd", "job": critical.pk, "gpus": 3, "spares": 0, "start_at": "2026-12-01T10:00",
        "end_at": "2026-12-01T09:00",
    })
    assert response.status_code == 400
    assert "end_at must be after start_at" in response.content.decode()
    response = client.post(reverse("console-reservation-new"), {
        "name": "half", "job": critical.pk, "gpus": 2, "spares": 0, "start_at": "2026-12-01T10:00", "period_s": 3600,
    })
    assert response.status_code == 400 and "needs both" in response.content.decode()
    response = client.post(reverse("console-reservation-new"), {
        "name": "ok", "job": critical.pk, "gpus": 2, "spares": 1, "start_at": "2026-12-01T10:00",
        "period_s": 3600, "active_s": 600,
    })
    assert response.status_code == 302
    edit = reverse("console-reservation-edit", args=[cluster["reservation"].pk])
    response = client.post(edit, {"gpus": 4, "spares": 0, "start_at": "2026-12-01T10:00",
                                  "period_s": 3600, "active_s": 1800})
    assert response.status_code == 302
    cluster["reservation"].refresh_from_db()
    assert cluster["reservation"].gpus == 4 and cluster["reservation"].name == "crit-window"


def test_researcher_cancels_own_job_not_anothers(researcher, cluster):
    client = client_for(researcher)
    assert client.post(reverse("job-page-cancel", args=[cluster["theirs"].pk])).status_code == 403
    assert client.post(reverse("job-page-cancel", args=[cluster["mine"].pk])).status_code == 302
    cluster["mine"].refresh_from_db()
    assert cluster["mine"].state == "cancelled"


def _streamed(response) -> str:
    assert response.streaming
    return b"".join(response.streaming_content).decode()


def test_csv_and_json_exports_stream_the_filtered_range(auditor, cluster, make_job, monkeypatch):
    from jobs import views

    monkeypatch.setattr(views, "EXPORT_CHUNK_ROWS", 7)  # many keyset pages
    for i in range(25):
        make_job(name=f"sweep-{i}")
    client = client_for(auditor)
    expected = ElasticEvent.objects.filter(kind="submit").count()
    rows = list(csv.reader(io.StringIO(_streamed(client.get(reverse("audit-export", args=["csv"]), {"kind": "submit"})))))
    assert len(rows) - 1 == expected
    assert [int(r[0]) for r in rows[1:]] == sorted(int(r[0]) for r in rows[1:])
    records = json.loads(_streamed(client.get(reverse("audit-export", args=["json"]), {"kind": "submit"})))
    assert len(records) == expected
    assert records[0]["reason"]["rule"] == "submit" and len(records[0]["hash"]) == 64
    by_job = json.loads(_streamed(client.get(reverse("audit-export", args=["json"]), {"job": "mine"})))
    assert {r["job_name"] for r in by_job} == {"mine"}


def test_audit_filters_by_node(auditor, cluster):
    node = cluster["nodes"][0].name
    body = client_for(auditor).get(reverse("audit"), {"node": node}).content.decode()
    assert "Placed mine" in body and "Lent crit-window" not in body


def test_audit_pages_by_keyset(auditor, cluster, make_job):
    for i in range(120):
        make_job(name=f"sweep-{i}")
    client = client_for(auditor)
    first = client.get(reverse("audit"))
    assert first.context["next_before"] is not None
    second = client.get(reverse("audit"), {"before": first.context["next_before"]})
    ids_first = [row["event"].pk for row in first.context["rows"]]
    ids_second = [row["event"].pk for row in second.context["rows"]]
    assert len(ids_first) == 100 and max(ids_second) < min(ids_first)


def test_chain_status_reports_verified_rows(auditor, cluster):
    response = client_for(auditor).get(reverse("audit"))
    chain = response.context["chain"]
    assert chain["bad"] is None and chain["complete"] and chain["checked"] == ElasticEvent.objects.count()
    assert "Hash chain verified" in response.content.decode()


@pytest.mark.postgres
def test_chain_status_names_the_first_broken_row(auditor, cluster):
    from django.db import connection

    target = ElasticEvent.objects.order_by("id")[2]
    with connection.cursor() as cursor:
        # Tamper as a superuser would: with triggers off for this session only.
        cursor.execute("SET LOCAL session_replication_role = replica")
        cursor.execute("UPDATE jobs_elasticevent SET actor = 'mallory' WHERE id = %s", [target.pk])
        cursor.execute("SET LOCAL session_replication_role = origin")
    body = client_for(auditor).get(reverse("audit")).content.decode()
    assert f"Hash chain broken at row {target.pk}" in body


def test_plotly_is_served_by_the_app_with_long_caching(researcher):
    import plotly

    response = client_for(researcher).get(reverse("plotly-js", args=[plotly.__version__]))
    assert response.status_code == 200
    assert response["Cache-Control"] == "public, max-age=31536000, immutable"
    assert b"plotly" in b"".join(response.streaming_content)[:2000].lower()
    assert client_for(researcher).get(reverse("plotly-js", args=["0.0.0"])).status_code == 404


def test_sentences_read_like_the_issue_asks():
    event = ElasticEvent(
        at=timezone.now(), kind=EventKind.PREEMPT, job_name="sft",
        reason={"text": "Preempted to return GPUs reserved for omni-7b, whose window starts 14:05."},
        outcome={"checkpoint_step": 4200, "save_s": 21.3},
    )
    text = describe_event(event, with_time=False)
    assert text == ("Preempted to return GPUs reserved for omni-7b, whose window starts 14:05; "
                    "checkpoint at step 4200 saved in 21 s.")
    assert compact_nodes(["r1s0n2", "r1s0n3", "r1s1n0"]) == "r1s0n2-n3, r1s1n0"


# -- who sees what (jobs.roles.job_visibility, OMNI_JOB_VISIBILITY) --------------------------------

VISIBILITY = ["summary", "all", "own"]
JOB_LINK = re.compile(r'href="(/jobs/\d+/)"')


def _job_row(body: str, job) -> str:
    """The dashboard's <tr> of ``job`` ("" when it is not listed)."""
    match = re.search(rf'<tr data-job-id="{job.pk}".*?</tr>', body, re.S)
    return match.group(0) if match else ""


@pytest.mark.parametrize(("setting", "status"), [("summary", 403), ("all", 200), ("own", 404)])
def test_anothers_job_page_answers_as_the_setting_says(setting, status, researcher, auditor, cluster):
    with override_settings(OMNI_JOB_VISIBILITY=setting):
        assert client_for(researcher).get(reverse("job-page", args=[cluster["theirs"].pk])).status_code == status
        assert client_for(researcher).get(reverse("job-page", args=[cluster["mine"].pk])).status_code == 200
        assert client_for(auditor).get(reverse("job-page", args=[cluster["theirs"].pk])).status_code == 200


def test_everyones_list_shows_others_jobs_as_unlinked_summaries_by_default(researcher, cluster):
    body = client_for(researcher).get(reverse("dashboard"), {"mine": "0"}).content.decode()
    mine, theirs = _job_row(body, cluster["mine"]), _job_row(body, cluster["theirs"])
    assert f'href="/jobs/{cluster["mine"].pk}/"' in mine and "ETA" in mine
    assert theirs and "/jobs/" not in theirs and "rob" in theirs and "Regular" in theirs and "Running" in theirs
    assert "ETA" not in theirs and "per replica" not in theirs and "Lent crit-window" not in theirs
    assert "Details are visible to rob" in theirs


@override_settings(OMNI_JOB_VISIBILITY="all")
def test_everyones_list_links_every_job_with_all(researcher, cluster):
    body = client_for(researcher).get(reverse("dashboard"), {"mine": "0"}).content.decode()
    assert f'href="/jobs/{cluster["theirs"].pk}/"' in _job_row(body, cluster["theirs"])


@override_settings(OMNI_JOB_VISIBILITY="own")
def test_others_jobs_are_nowhere_on_a_researchers_pages_with_own(researcher, cluster):
    client = client_for(researcher)
    body = client.get(reverse("dashboard"), {"mine": "0"}).content.decode()
    assert not _job_row(body, cluster["theirs"]) and _job_row(body, cluster["mine"])
    assert 'id="id_mine"' not in body  # no "Everyone's" to choose
    console = client.get(reverse("console")).content.decode()
    assert "theirs" not in console and "<strong>crit</strong>" not in console and '"crit"' not in console
    assert "gpu0: another user's job" in console  # theirs' GPUs: held, unnamed
    assert "<strong>another user&#x27;s job</strong>" in console  # the reservation for crit


@pytest.mark.parametrize("setting", VISIBILITY)
def test_no_link_on_any_page_leads_to_a_403(setting, researcher, other_researcher, operator, auditor, cluster):
    with override_settings(OMNI_JOB_VISIBILITY=setting):
        for user in (researcher, other_researcher, operator, auditor):
            client = client_for(user)
            links = set()
            for page, query in (("dashboard", {"mine": "0", "state": "all"}), ("dashboard", {}), ("console", {})):
                links |= set(JOB_LINK.findall(client.get(reverse(page), query).content.decode()))
            assert links, user.username
            for link in links:
                assert client.get(link).status_code == 200, (setting, user.username, link)


def test_the_queue_says_why_only_for_jobs_seen_in_full(researcher, other_researcher, operator, make_job, cluster):
    from django.db import transaction

    from jobs.audit import record_event

    waiting = make_job(owner=other_researcher, name="their-wait", dp=4, dp_min=4)
    with transaction.atomic():
        record_event(EventKind.HOLD, job=waiting, actor="planner",
                     reason={"rule": "no_capacity", "text": "Waits for a private reason.", "inputs": {}})
    body = client_for(researcher).get(reverse("console")).content.decode()
    assert "their-wait" in body and "a private reason" not in body
    assert "a private reason" in client_for(operator).get(reverse("console")).content.decode()


def test_a_researchers_everyones_list_keeps_its_query_count(researcher, other_researcher, cluster, make_job,
                                                            django_assert_max_num_queries):
    for i in range(30):
        make_job(owner=other_researcher if i % 2 else researcher, name=f"extra-{i}")
    client = client_for(researcher)
    with django_assert_max_num_queries(14):
        assert client.get(reverse("dashboard"), {"mine": "0"}).status_code == 200


# -- words and pictures: times, audit facts, checkpoints (docs/live-ui.md) ------------------------

EPOCH_SENTENCE = re.compile(r"t=\d{9,}s")
PYTHON_REPRS = ("False -> True", "True -> False", "{'", "→ True", "→ False")
# A bare Unix second in the page's text (not inside a hash or id): 2017..2039.
EPOCH_NUMBER = re.compile(r"(?<![\w.])(1[5-9]|2[0-1])\d{8}(?:\.\d+)?(?![\w.])")


def _visible_text(html: str) -> str:
    """The page's text as read: no scripts (chart data), no raw JSON for auditors, no tags."""
    html = re.sub(r"<script\b.*?</script>", "", html, flags=re.S)
    html = re.sub(r'<details class="raw">.*?</details>', "", html, flags=re.S)
    return re.sub(r"<[^>]+>", " ", html)


def _planner_shaped_row(job, **inputs):
    """An audit row whose inputs carry what a planner pass records: an epoch deadline, nested facts."""
    from django.db import transaction

    from jobs.audit import record_event

    with transaction.atomic():
        return record_event(
            EventKind.RECLAIM, job=job, actor="planner", gpus_before=2, gpus_after=0,
            reason={"rule": "reclaim", "text": f"Reclaimed {job.name}'s loan ahead of the window.",
                    "inputs": {"deadline_s": timezone.now().timestamp() + 600, "graceful": True,
                               "lead_time_s": 34.56, "pool": {"reservation": "crit-window", "gpus": 2},
                               "nodes": ["r0s0n0", "r0s0n1"], **inputs}},
            outcome={"kind": "preempt", "ok": True, "checkpoint_step": 40, "save_s": 2.1, "steps_lost": 0},
        )


def test_no_page_shows_epoch_seconds_or_python_reprs_for_the_seeded_demo(db):
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from jobs.models import Job, Reservation

    call_command("seed_demo", stdout=io.StringIO())
    olga = get_user_model().objects.get(username="olga")
    client = client_for(olga)
    response = client.post(reverse("console-planner"), {
        "paused": "on", "safety_factor": "2.0", "min_run_s": "120", "reclaim_grace_s": "30"}, follow=True)
    assert response.status_code == 200
    actions.update_reservation(Reservation.objects.get(name="vlm-window"), olga, gpus=48)
    _planner_shaped_row(Job.objects.get(name="ablation-lr"))
    pages = [response.content.decode()]
    pages += [client.get(reverse(name)).content.decode() for name in ("dashboard", "console", "audit")]
    pages += [client.get(reverse("job-page", args=[pk])).content.decode()
              for pk in Job.objects.values_list("pk", flat=True)]
    for html in pages:
        assert not EPOCH_SENTENCE.search(html)
        for repr_ in PYTHON_REPRS:
            assert repr_ not in html, repr_
        text = _visible_text(html)
        assert not EPOCH_NUMBER.search(text), EPOCH_NUMBER.search(text).group(0)
    assert "changed the planner: paused off → on" in pages[3]  # the audit page's sentence
    assert "Planner: paused off → on" in pages[0]  # the console's message


def test_every_page_time_is_a_time_element_with_its_utc_timestamp(operator, cluster):
    client = client_for(operator)
    _planner_shaped_row(cluster["theirs"])
    for html in (client.get(reverse(name)).content.decode() for name in ("dashboard", "console", "audit")):
        times = re.findall(r'<time datetime="([^"]+)" data-style="\w+"(?: data-relative="\w+")? title="([^"]+)">', html)
        assert times
        for iso, title in times:
            assert iso.endswith("Z") and title.endswith(" UTC") and title[:16] == iso[:16].replace("T", " ")
    job_page = client.get(reverse("job-page", args=[cluster["theirs"].pk])).content.decode()
    assert "<time" in _job_section(job_page, "event-log") and "due back <time" in job_page


def _job_section(html: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}".*?</(ol|tbody)>', html, re.S)
    return match.group(0) if match else ""


def test_audit_inputs_and_outcome_read_as_a_table_with_the_raw_json_behind_details(auditor, cluster):
    row = _planner_shaped_row(cluster["theirs"])
    html = client_for(auditor).get(reverse("audit")).content.decode()
    detail = re.search(rf'data-event-id="{row.pk}".*?<tr class="detail" hidden>(.*?)\n      </td></tr>', html, re.S).group(1)
    assert '<table class="fact-table">' in detail
    assert re.search(r"<th>deadline_s</th><td><time datetime=", detail)  # an instant, not 17961...
    assert "<th>lead_time_s</th><td>34.56 s</td>" in detail
    assert "<th>graceful</th><td>yes</td>" in detail
    assert "<th>nodes</th><td>r0s0n0, r0s0n1</td>" in detail
    assert '<tr class="d0 group"><th>pool</th><td></td></tr><tr class="d1"><th>gpus</th><td>2</td></tr>' in detail
    assert "<th>checkpoint_step</th><td>40</td>" in detail and "<th>save_s</th><td>2.1 s</td>" in detail
    raw = re.search(r'<details class="raw"><summary>[^<]*</summary><pre>(.*?)</pre></details>', detail, re.S).group(1)
    assert json.loads(raw.replace("&quot;", '"'))["reason"]["inputs"]["graceful"] is True


def test_checkpoint_card_and_table_read_one_source_one_row_per_step(researcher, cluster):
    from django.db import transaction

    from jobs.audit import record_event

    job = cluster["mine"]
    with transaction.atomic():  # a preempt saved step 40; the resume loaded it again (same step)
        record_event(EventKind.OUTCOME, job=job, actor="agent:r0s0n0",
                     outcome={"kind": "preempt", "ok": True, "checkpoint_step": 40, "save_s": 2.1},
                     reason={"rule": "outcome", "text": "preempt of mine: done.", "inputs": {}})
        record_event(EventKind.OUTCOME, job=job, actor="agent:r0s0n0",
                     outcome={"kind": "resume", "ok": True, "checkpoint_step": 40, "step": 40, "load_s": 1.2},
                     reason={"rule": "outcome", "text": "resume of mine: done.", "inputs": {}})
        record_event(EventKind.OUTCOME, job=job, actor="agent:r0s0n0",
                     outcome={"kind": "start", "ok": True, "checkpoint_step": 0, "step": 0},
                     reason={"rule": "outcome", "text": "start of mine: done.", "inputs": {}})
    # A periodic save that only a heartbeat reports (no audit row): step 60.
    actions.record_heartbeat(cluster["nodes"][0], [{"job": "mine", "state": "member", "checkpoint_step": 60}])
    html = client_for(researcher).get(reverse("job-page", args=[job.pk])).content.decode()
    rows = re.findall(r'<tr data-step="(\d+)"><td>(.*?)</td><td class="num">\d+</td><td class="num">([^<]*)</td>',
                      _job_section(html, "checkpoints"))
    assert [(step, saved) for step, _, saved in rows] == [("60", "—"), ("40", "2.1 s")]
    card = re.search(r'id="last-checkpoint"[^>]*><span class="num" data-f="step">(\d+)</span>.*?data-f="at">(.*?)</span>',
                     html, re.S)
    assert card.group(1) == rows[0][0]
    newest_at = re.search(r'datetime="([^"]+)"', rows[0][1]).group(1)
    assert f'datetime="{newest_at}"' in card.group(2)  # saved when the newest row says


def test_an_empty_checkpoint_table_and_card_say_none_yet(researcher, cluster):
    html = client_for(researcher).get(reverse("job-page", args=[cluster["mine"].pk])).content.decode()
    assert "None yet." in _job_section(html, "checkpoints")
    assert '<span class="num" data-f="step">—</span>' in html and 'data-f="at">: none yet</span>' in html


def test_job_page_shows_the_workload_with_env_names_but_never_values(researcher, cluster):
    from jobs.models import Job

    mine = cluster["mine"]
    Job.objects.filter(pk=mine.pk).update(
        dp_min=mine.dp, dp_max=mine.dp, entrypoint=["train.py", "--data", "/data/laion shard"],
        integration="signal", grace_s=45.0,
        env={"WANDB_API_KEY": "wk-secret-value", "HF_HOME": "/cache/hf"}, max_restarts=2, restarts=1)
    body = client_for(researcher).get(reverse("job-page", args=[cluster["mine"].pk])).content.decode()
    workload = body[body.index('id="workload"'):body.index("<h2>Checkpoints</h2>")]
    assert "train.py --data &#x27;/data/laion shard&#x27;" in workload
    assert "SIGTERM, 45 s grace, then SIGKILL; not elastic" in workload
    assert "WANDB_API_KEY" in workload and "HF_HOME" in workload and "1 of 2 used" in workload
    assert "wk-secret-value" not in body and "/cache/hf" not in body
    # Its steps are what its script reported, and its saves are its own: the cards say so.
    assert "steps its script reported" in body and "steps committed" not in body
    assert 'data-f="at">: its script saves its own, which Omni does not see</span>' in body
    assert "This signal-mode script has reported no steps" in body and "$OMNI_METRICS_FILE" in body
    assert "None seen: its script saves its own, which Omni does not see." in _job_section(body, "checkpoints")
    omni = client_for(researcher).get(reverse("job-page", args=[cluster["waiting"].pk])).content.decode()
    assert "steps committed" in omni and "steps its script reported" not in omni


def test_every_page_names_its_icon_and_the_icon_is_a_static_file():
    """Without a ``rel=icon`` link a browser asks for /favicon.ico on every first visit and
    logs the 404 in its console."""
    from django.contrib.staticfiles import finders

    html = Client().get(reverse("login")).content.decode()
    match = re.search(r'<link rel="icon" type="image/svg\+xml" href="/static/([^"]+)">', html)
    assert match, "the login page names no icon"
    found = finders.find(match.group(1))
    assert found and "<svg" in Path(found).read_text()


def test_a_finished_jobs_page_says_how_long_it_took_instead_of_an_eta(researcher, cluster, make_job):
    """A finished job has no ETA: its card says how long it took from submission, and how long
    it ran from its first start (or that it never started). A live job keeps its ETA."""
    client = client_for(researcher)
    live = make_job(name="live", dp=1)
    assert "ETA at" in client.get(reverse("job-page", args=[cluster["mine"].pk])).content.decode()  # it runs
    actions.cancel_job(cluster["mine"], researcher)
    actions.cancel_job(cluster["waiting"], researcher)
    ran = client.get(reverse("job-page", args=[cluster["mine"].pk])).content.decode()
    never = client.get(reverse("job-page", args=[cluster["waiting"].pk])).content.decode()
    for body in (ran, never):
        assert 'id="job-ended"' in body and "from submission to cancelled" in body
        assert "ETA at" not in body
    assert "from its first start" in ran and "it never started" in never
    body = client.get(reverse("job-page", args=[live.pk])).content.decode()
    # It waits: the time is its run once it starts, not when it ends.
    assert "run left once it starts, at 1.00 s/step" in body and 'id="job-ended"' not in body


def test_a_job_pages_panels_come_without_its_charts_series(researcher, cluster):
    """``?panels=1``: the page a job page left open fetches after each audit row, to swap in its
    ``data-panel`` parts: all of them, with no series for the charts (those follow the socket),
    in fewer queries than the whole page."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client = client_for(researcher)
    url = reverse("job-page", args=[cluster["mine"].pk])
    client.get(url)  # the session's first request warms what any request reads once
    with CaptureQueriesContext(connection) as whole_queries:
        whole = client.get(url).content.decode()
    with CaptureQueriesContext(connection) as panel_queries:
        panels = client.get(url + "?panels=1").content.decode()
    assert len(panel_queries) < len(whole_queries)
    names = re.findall(r'data-panel="([a-z]+)"', whole)
    assert sorted(names) == sorted(re.findall(r'data-panel="([a-z]+)"', panels))
    assert {"facts", "actions", "waiting", "steps", "when", "checkpoint", "workload", "checkpoints", "gpus"} <= set(names)
    chart = json.loads(re.search(r'<script id="chart-data" type="application/json">(.*?)</script>', panels).group(1))
    assert chart == {"job_id": cluster["mine"].pk}
    assert '"series"' in re.search(r'<script id="chart-data" type="application/json">(.*?)</script>', whole).group(1)


def test_a_missing_page_is_the_sites_own_404_with_a_way_back(researcher):
    response = client_for(researcher).get("/jobs/987654/")
    assert response.status_code == 404
    body = response.content.decode()
    assert "<h1>Not found</h1>" in body and "<code>/jobs/987654/</code>" in body
    assert 'rel="icon"' in body and reverse("dashboard") in body  # the site's frame, not Django's bare page


def test_a_jobs_charts_are_cut_from_its_own_life_in_the_range_not_the_whole_range(researcher, operator, cluster):
    """A half-minute job on the 6 h view drew two 37 s buckets: the buckets are now cut from the
    part of the range the job lived in (a minute either side)."""
    from jobs.models import Job

    def chart(user, job):
        html = client_for(user).get(reverse("job-page", args=[job.pk]) + "?range=6h").content.decode()
        data = json.loads(re.search(r'<script id="chart-data" type="application/json">(.*?)</script>', html, re.S).group(1))
        return data["series"], html

    series, html = chart(researcher, cluster["mine"])  # submitted a moment ago
    assert (series["level"], series["bucket_s"]) == ("raw", 1), series
    assert "history from raw data, 1 s buckets" in html
    ended = timezone.now() - timedelta(hours=3)
    Job.objects.filter(pk=cluster["theirs"].pk).update(submitted_at=ended - timedelta(minutes=2), finished_at=ended)
    series, _ = chart(operator, cluster["theirs"])  # four minutes, three hours ago
    assert (series["level"], series["bucket_s"]) == ("raw", 1), series
    Job.objects.filter(pk=cluster["theirs"].pk).update(submitted_at=timezone.now() - timedelta(days=2))
    series, _ = chart(operator, cluster["theirs"])  # older than the range: the range's own buckets
    assert series["bucket_s"] > 1, series


def test_a_finished_jobs_header_says_where_it_ran(researcher, cluster):
    """A finished job holds no GPUs: its header read "on —"; it says where its last run was."""
    mine = cluster["mine"]
    page = client_for(researcher).get(reverse("job-page", args=[mine.pk])).content.decode()
    assert re.search(r'<span>on <b class="mono">r\d+s\d+n\d+</b></span>', page) and "ran on" not in page
    actions.cancel_job(mine, researcher)
    page = client_for(researcher).get(reverse("job-page", args=[mine.pk])).content.decode()
    ran = re.search(r'<span>ran on <b class="mono">([^<]+)</b></span>', page)
    assert ran and ran.group(1) == mine.events.get(kind="cancel").nodes_before[0]
    waiting = cluster["waiting"]  # cancelled while waiting: it ran nowhere
    actions.cancel_job(waiting, researcher)
    page = client_for(researcher).get(reverse("job-page", args=[waiting.pk])).content.decode()
    assert '<span>on <b class="mono">—</b></span>' in page and "ran on" not in page

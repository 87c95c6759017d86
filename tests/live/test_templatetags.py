"""The pages' template tags: a time as a <time> element with its UTC title and fallback text, an
audit row's facts as a key/value table, durations in words (jobs/templatetags/omni.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.template import Context, Template
from django.utils import timezone

from jobs.templatetags.omni import duration, fact_value, facts_table, relative_time, timestamp

AT = datetime(2026, 12, 1, 13, 5, 9, 250000, tzinfo=UTC)


def test_timestamp_is_a_time_element_with_the_utc_timestamp_as_title_and_utc_fallback_text():
    assert timestamp(AT) == ('<time datetime="2026-12-01T13:05:09.250Z" data-style="datetime" '
                             'title="2026-12-01 13:05:09 UTC">Dec 1 13:05 UTC</time>')
    assert ">2026-12-01 13:05:09 UTC</time>" in timestamp(AT, "full")
    assert ">13:05 UTC</time>" in timestamp(AT, "time")


def test_timestamp_accepts_iso_strings_and_other_zones_and_says_a_dash_for_none():
    assert 'datetime="2026-12-01T13:05:00.000Z"' in timestamp("2026-12-01T14:05:00+01:00")
    assert timestamp(None) == "—" and timestamp("not a time") == "—"


def test_relative_timestamps_say_in_or_ago_and_are_marked_for_the_30_s_refresh():
    soon = timezone.now() + timedelta(minutes=12, seconds=30)
    only = timestamp(soon, "time", relative="only")
    assert 'data-relative="only"' in only and only.endswith(">in 12 min</time>")
    also = timestamp(timezone.now() - timedelta(minutes=3, seconds=5), "time", relative=True)
    assert 'data-relative="also"' in also and also.endswith(" UTC (3 min ago)</time>")
    now = timezone.now()
    assert relative_time(now + timedelta(seconds=4), now) == "just now"
    assert relative_time(now - timedelta(hours=2), now) == "2 h ago"
    assert relative_time(now + timedelta(days=1, hours=3), now) == "in 1 d 3 h"


def test_the_tag_renders_in_a_template():
    html = Template('{% load omni %}{% timestamp at "time" %}').render(Context({"at": AT}))
    assert html.startswith('<time datetime="2026-12-01T13:05:09.250Z" data-style="time"')


def test_fact_values_are_words_times_and_units_never_epochs_or_reprs():
    assert fact_value("graceful", True) == "yes" and fact_value("forced", False) == "no"
    assert fact_value("end_at", None) == "—" and fact_value("nodes", []) == "—"
    assert fact_value("deadline_s", 1796109730.0).startswith('<time datetime="2026-12-01T')
    assert fact_value("save_s", 21.0) == "21 s" and fact_value("lead_time_s", 34.567) == "34.57 s"
    assert fact_value("ack_ms", 12.5) == "12.5 ms" and fact_value("gpus", 8) == "8"
    assert fact_value("start_at", "2026-12-01T13:05:00+00:00").startswith("<time")
    assert fact_value("nodes", ["r0s0n0", "r0s0n1"]) == "r0s0n0, r0s0n1"
    assert fact_value("moves", [{"gpu": 1}]) == '[{"gpu":1}]'  # as JSON.stringify writes it
    assert fact_value("job", 1796109730) == "1796109730"  # an id-like name: not a time


def test_facts_table_has_one_row_per_key_and_nested_objects_as_sub_rows():
    html = facts_table({"wants": 8, "before": {"gpus": 4, "start_at": None}, "free": 0})
    assert html == (
        '<table class="fact-table"><tbody>'
        '<tr class="d0 group"><th>before</th><td></td></tr>'
        '<tr class="d1"><th>gpus</th><td>4</td></tr>'
        '<tr class="d1"><th>start_at</th><td>—</td></tr>'
        '<tr class="d0"><th>free</th><td>0</td></tr>'
        '<tr class="d0"><th>wants</th><td>8</td></tr>'
        "</tbody></table>"
    )
    assert "none recorded" in facts_table({}) and "none recorded" in facts_table(None)
    assert "&lt;b&gt;" in facts_table({"note": "<b>"})  # values are escaped


def test_duration_filter_reads_like_the_dashboard():
    assert duration(2400) == "40 min" and duration(3600) == "1 h" and duration(5400) == "1 h 30 min"
    assert duration(None) == "—"

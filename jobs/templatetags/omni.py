"""Template tags of the pages: how a job is named (so no link leads to a 403), how a time is
shown (the browser's local time, UTC on hover) and how an audit row's facts read (a small
key/value table, not JSON). docs/live-ui.md, "Words and pictures"."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from django import template
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from jobs import roles
from jobs.live_data import human_duration

register = template.Library()


@register.simple_tag(takes_context=True)
def job_link(context, job) -> SafeString:
    """The job's name, a link to its page only when the viewer may open it (``roles.job_visibility``)."""
    visibility = roles.job_visibility(context["request"].user, job)
    if visibility is roles.Visibility.FULL:
        return format_html('<a href="{}"><strong>{}</strong></a>', reverse("job-page", args=[job.pk]), job.name)
    if visibility is roles.Visibility.SUMMARY:
        return format_html('<strong title="{}">{}</strong>', "details are visible to its owner", job.name)
    return format_html("<strong>{}</strong>", roles.HIDDEN_JOB)


# -- times: <time datetime="..."> that static/js/omni.js rewrites in the browser's time zone ------

# The server's fallback text, in UTC (it cannot know the browser's zone); omni.js's TIME_STYLES
# writes the same shapes in local time.
TIME_STYLES = {"time": "%H:%M", "datetime": "%b %-d %H:%M", "full": "%Y-%m-%d %H:%M:%S"}


def relative_time(value: datetime, now: datetime | None = None) -> str:
    """``"in 12 min"``, ``"3 min ago"``, ``"just now"`` (the words omni.js's ``relativeText`` uses)."""
    seconds = (value - (now or timezone.now())).total_seconds()
    if abs(seconds) < 10:
        return "just now"
    span = human_duration(abs(seconds))
    return f"in {span}" if seconds > 0 else f"{span} ago"


def _as_datetime(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value if timezone.is_aware(value) else timezone.make_aware(value, UTC)
    if isinstance(value, str):
        try:
            return _as_datetime(datetime.fromisoformat(value))
        except ValueError:
            return None
    return None


@register.simple_tag
def timestamp(value: Any, style: str = "datetime", relative: bool | str = False) -> SafeString:
    """``<time datetime="ISO">`` for a datetime (or ISO string); "—" for None.

    omni.js shows it in the browser's local time with the UTC timestamp as its title; with
    ``relative`` it adds "(3 min ago)", with ``relative="only"`` it shows just "3 min ago" (the
    local time moves to the title), re-rendered every 30 s. The text rendered here is UTC,
    for a page read without script.
    """
    at = _as_datetime(value)
    if at is None:
        return mark_safe("—")  # noqa: S308 - a constant
    at = at.astimezone(UTC)
    utc = at.strftime("%Y-%m-%d %H:%M:%S UTC")
    text = at.strftime(TIME_STYLES.get(style, TIME_STYLES["datetime"])) + " UTC"
    if relative == "only":
        text = relative_time(at)
    elif relative:
        text = f"{text} ({relative_time(at)})"
    mode = "only" if relative == "only" else ("also" if relative else "")
    return format_html('<time datetime="{}" data-style="{}"{} title="{}">{}</time>',
                       at.isoformat(timespec="milliseconds").replace("+00:00", "Z"), style,
                       format_html(' data-relative="{}"', mode) if mode else "", utc, text)


# -- an audit row's inputs and outcome as a key/value table ----------------------------------------

# Numbers named like times (``deadline_s``, ``start_at``) in the range of Unix seconds are
# instants, not durations: shown as a time. omni.js's ``factValue`` applies the same rules.
_EPOCH_RANGE = (1e9, 1e10)
_TIME_KEY = re.compile(r"(^|_)(at|t|now|since|until|deadline)$|_(s|at|t)$")
_ISO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d")
_UNITS = (("_ms", " ms"), ("_s", " s"), ("_pct", " %"))


def _number(value: int | float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.2f}".rstrip("0").rstrip(".")


def fact_value(key: str, value: Any) -> str | SafeString:
    """One value in words: times as ``<time>``, units from the key's suffix, lists joined."""
    if value is None or value == [] or value == {}:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        if _TIME_KEY.search(key) and _EPOCH_RANGE[0] <= value < _EPOCH_RANGE[1]:
            return timestamp(datetime.fromtimestamp(value, UTC), "full")
        unit = next((u for suffix, u in _UNITS if key.endswith(suffix)), "")
        return _number(value) + unit
    if isinstance(value, str):
        return timestamp(value, "full") if _ISO_TIME.match(value) else value
    if isinstance(value, list):
        if all(not isinstance(v, (list, dict)) for v in value):
            return format_html_join(", ", "{}", ((fact_value(key, v),) for v in value))
        return json.dumps(value, separators=(",", ":"))  # as JSON.stringify writes it
    return json.dumps(value, separators=(",", ":"))


def fact_rows(facts: dict[str, Any], depth: int = 0) -> list[tuple[int, str, str | SafeString | None]]:
    """``(depth, key, value)`` rows, a nested dict as a heading row (value None) and its rows."""
    rows: list[tuple[int, str, str | SafeString | None]] = []
    for key, value in sorted(facts.items()):
        if isinstance(value, dict) and value:
            rows.append((depth, key, None))
            rows += fact_rows(value, depth + 1)
        else:
            rows.append((depth, key, fact_value(key, value)))
    return rows


@register.simple_tag
def facts_table(facts: Any) -> SafeString:
    """An audit row's inputs (or outcome) as a two-column table; "none recorded" when empty."""
    if not isinstance(facts, dict) or not facts:
        return format_html('<p class="muted small facts-empty">{}</p>', "none recorded")
    body = format_html_join("", '<tr class="d{}{}"><th>{}</th><td>{}</td></tr>', (
        (min(depth, 3), " group" if value is None else "", key, "" if value is None else value)
        for depth, key, value in fact_rows(facts)
    ))
    return format_html('<table class="fact-table"><tbody>{}</tbody></table>', body)


@register.filter
def duration(seconds: float | None) -> str:
    """``2400`` -> ``"40 min"`` (``live_data.human_duration``, as omni.js's ``humanDuration``)."""
    return human_duration(seconds)

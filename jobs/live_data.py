"""Read models for the live pages: the numbers behind the charts, in as few queries as possible.

The pages draw from two sources. Decisions and state come from the jobs models and the audit
log; samples (GPU utilisation, step times, tokens per modality) come from ``telemetry``'s
downsampled queries, which choose raw, 1-minute or 1-hour data by range so a week of 64 GPUs
stays a few thousand points. When the telemetry app offers no data the charts are simply
empty, never wrong. See docs/live-ui.md.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError
from django.db.models import Avg, Max
from django.utils import timezone

from jobs.live_events import describe_event
from jobs.models import Allocation, ElasticEvent, EventKind, Job, Node, Reservation

logger = logging.getLogger(__name__)

RANGES = {"1h": timedelta(hours=1), "6h": timedelta(hours=6), "24h": timedelta(hours=24), "7d": timedelta(days=7)}
MAX_POINTS_PER_TRACE = 600
MODALITIES = ("text", "image", "video", "audio")
# Kinds that change how many GPUs a job holds, with the sign of the change (for utilisation).
JOB_GPU_KINDS = frozenset({
    EventKind.PLACE, EventKind.LEND, EventKind.PREEMPT, EventKind.SHRINK, EventKind.GROW, EventKind.RECLAIM,
    EventKind.RECOVER, EventKind.MIGRATE, EventKind.RECONFIGURE, EventKind.CANCEL, EventKind.COMPLETE,
    EventKind.FAIL, EventKind.KILL,
})
MARKER_KINDS = frozenset({
    EventKind.PLACE, EventKind.LEND, EventKind.PREEMPT, EventKind.SHRINK, EventKind.GROW, EventKind.RECLAIM,
    EventKind.RECOVER, EventKind.MIGRATE, EventKind.RECONFIGURE, EventKind.CHECKPOINT, EventKind.HOLD,
    EventKind.KILL, EventKind.FAIL, EventKind.COMPLETE, EventKind.CANCEL, EventKind.RESERVE,
    EventKind.RESERVATION_CHANGE,
})


def last_events(job_ids: Iterable[int]) -> dict[int, ElasticEvent]:
    """The newest audit row of each job, in one query."""
    ids = list(job_ids)
    if not ids:
        return {}
    newest = (
        ElasticEvent.objects.filter(job_id__in=ids).values("job_id").annotate(last=Max("id")).values("last")
    )
    return {event.job_id: event for event in ElasticEvent.objects.filter(id__in=newest)}


def _telemetry_queries():
    try:
        from telemetry import queries
    except ImportError:  # the telemetry app is optional for the pages
        return None
    return queries


RHYTHM_WINDOW = timedelta(minutes=15)


def measured_step_s(job_ids: Iterable[int], now: datetime | None = None) -> dict[int, float]:
    """Each job's measured mean step time over the last minutes (its rhythm), in one query."""
    ids = list(job_ids)
    if not ids:
        return {}
    try:
        from telemetry.models import StepRecord
    except ImportError:
        return {}
    since = (now or timezone.now()) - RHYTHM_WINDOW
    try:
        rows = (
            StepRecord.objects.filter(job_id__in=ids, at__gte=since)
            .values("job_id").annotate(mean_s=Avg("step_s")).order_by().values_list("job_id", "mean_s")
        )
        return {job_id: mean_s for job_id, mean_s in rows if mean_s}
    except DatabaseError:
        logger.exception("telemetry rhythm query failed")
        return {}


def eta(job: Job, step_s: float | None) -> tuple[float | None, bool]:
    """(seconds left, measured?) at the measured rhythm, else at the spec's step time."""
    remaining = max(job.total_steps - job.committed_steps, 0)
    if job.is_terminal:
        return None, False
    measured = step_s is not None and step_s > 0
    return remaining * (step_s if measured else job.step_s), measured


def human_duration(seconds: float | None) -> str:
    """``93784`` -> ``"1 d 2 h"``; short and readable in a table cell."""
    if seconds is None:
        return "—"
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes = rest // 60
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min" if minutes else f"{seconds} s"


def pending_reason(job: Job, last_hold: ElasticEvent | None) -> str:
    """Why the job waits, in the planner's words: its latest note, else its last hold row."""
    if job.pending_reason:
        return job.pending_reason
    if last_hold is not None and last_hold.reason_text:
        return last_hold.reason_text
    if job.state == "pending":
        return "The planner has not considered this job yet."
    return ""


def last_holds(job_ids: Iterable[int]) -> dict[int, ElasticEvent]:
    """The newest HOLD row of each job, in one query."""
    ids = list(job_ids)
    if not ids:
        return {}
    newest = (
        ElasticEvent.objects.filter(job_id__in=ids, kind=EventKind.HOLD)
        .values("job_id").annotate(last=Max("id")).values("last")
    )
    return {event.job_id: event for event in ElasticEvent.objects.filter(id__in=newest)}


# -- the job page's series -----------------------------------------------------------------


def _iso(value: datetime) -> str:
    return value.isoformat()


def _epochs_to_ms(values: Iterable[float]) -> list[float]:
    # Plotly's date axes take milliseconds since the epoch: no 40,000 isoformat() calls for a
    # week of 64 GPUs, and a smaller page.
    return [v * 1000.0 for v in values]


def job_series(job: Job, since: datetime, until: datetime) -> dict[str, Any]:
    """Step times, tokens per modality and per-GPU utilisation of ``job`` over a range."""
    series: dict[str, Any] = {"step": {"t": [], "step_s": [], "step_s_max": [], "step": []},
                              "tokens": {"t": [], **{m: [] for m in MODALITIES}}, "gpus": {},
                              "level": None, "bucket_s": None}
    queries = _telemetry_queries()
    if queries is None:
        return series
    try:
        token_metrics = tuple(f"tokens_{m}" for m in MODALITIES if f"tokens_{m}" in queries.STEP_METRICS)
        steps = queries.step_series(job.pk, start=since, end=until, max_points=MAX_POINTS_PER_TRACE,
                                    metrics=("step", "step_s", "step_s_max", *token_metrics))
        trace = steps["traces"].get("job")
        series["level"], series["bucket_s"] = steps["level"], steps["bucket_s"]
        if trace:
            t = _epochs_to_ms(trace["t"])
            series["step"] = {"t": t, "step_s": trace["step_s"], "step_s_max": trace["step_s_max"],
                              "step": trace["step"]}
            # Mean tokens per rank-step, by modality (telemetry.queries' tokens_<modality>).
            series["tokens"] = {"t": t, **{m: trace.get(f"tokens_{m}") or [0] * len(t) for m in MODALITIES}}
        gpus = queries.gpu_utilisation_series(start=since, end=until, max_points=MAX_POINTS_PER_TRACE,
                                              job_id=job.pk, metrics=("util_pct",))
        series["gpus"] = {
            name: {"t": _epochs_to_ms(trace["t"]), "util": trace["util_pct"], "node": trace["node"],
                   "gpu": trace["gpu"]}
            for name, trace in gpus["traces"].items()
        }
    except Exception:
        logger.exception("telemetry series query failed for job %s", job.pk)
    return series


def job_markers(job: Job, since: datetime) -> list[dict[str, Any]]:
    """Scheduler events of the job in range, as chart markers with their sentence."""
    events = job.events.filter(at__gte=since, kind__in=MARKER_KINDS).order_by("id")[:500]
    return [{"t": _iso(e.at), "kind": e.kind, "label": e.get_kind_display(), "text": describe_event(e)}
            for e in events]


def reservation_boundaries(job: Job, since: datetime, until: datetime) -> list[dict[str, Any]]:
    """Window starts and ends of the job's reservations in range (markers on the job's charts)."""
    marks: list[dict[str, Any]] = []
    for reservation in job.reservations.filter(cancelled_at__isnull=True):
        for start, end in reservation_windows(reservation, since, until):
            marks.append({"t": _iso(start), "kind": "window_start", "label": f"{reservation.name} window opens"})
            if end <= until:
                marks.append({"t": _iso(end), "kind": "window_end", "label": f"{reservation.name} window closes"})
    return marks


def reservation_windows(reservation: Reservation, since: datetime, until: datetime,
                        limit: int = 200) -> list[tuple[datetime, datetime]]:
    """The reservation's guaranteed windows overlapping ``[since, until)`` (at most ``limit``)."""
    windows: list[tuple[datetime, datetime]] = []
    if reservation.is_recurring:
        first = reservation.start_at
        if since > first:
            periods = int((since - first).total_seconds() // reservation.period_s)
            first = first + timedelta(seconds=periods * reservation.period_s)
        t: datetime | None = first
    else:
        t = reservation.start_at
    while t is not None and t < until and len(windows) < limit:
        end = reservation.window_end(t)
        if reservation.cancelled_at is not None:
            end = min(end, reservation.cancelled_at)
        if end > since and end > t:
            windows.append((t, min(end, until + timedelta(days=3650))))
        if not reservation.is_recurring:
            break
        t = reservation.next_window_start(t + timedelta(seconds=1))
    return windows


# -- the console's utilisation chart -----------------------------------------------------------


def utilisation_series(since: datetime, now: datetime | None = None, *, gpus_total: int | None = None,
                       max_events: int = 20000) -> dict[str, list]:
    """Allocated and harvested (borrowed) GPUs over time, walked back from now through the log.

    The audit log is the source of truth for who held how many GPUs: starting from the
    allocations that exist now, each job-GPU event in range is undone in reverse order, giving
    the step function back to ``since``. Used GPUs (utilisation x GPUs) come from telemetry.
    """
    now = now or timezone.now()
    allocated = Allocation.objects.count()
    harvested = Allocation.objects.filter(borrowed_from__isnull=False).count()
    times, alloc_values, harvest_values = [now], [allocated], [harvested]
    rows = (
        ElasticEvent.objects.filter(at__gte=since, kind__in=JOB_GPU_KINDS)
        .order_by("-id").values_list("at", "kind", "gpus_before", "gpus_after")[:max_events]
    )
    for at, kind, before, after in rows:
        delta = (after or 0) - (before or 0)
        times.append(at)
        alloc_values.append(allocated)
        harvest_values.append(harvested)
        allocated = max(allocated - delta, 0)
        if kind == EventKind.LEND:
            harvested = max(harvested - delta, 0)
        elif kind == EventKind.RECLAIM:
            harvested = harvested - delta
    times.append(since)
    alloc_values.append(allocated)
    harvest_values.append(harvested)
    series: dict[str, list] = {"t": [_iso(t) for t in reversed(times)], "allocated": alloc_values[::-1],
              "harvested": harvest_values[::-1], "used_t": [], "used": []}
    queries = _telemetry_queries()
    if queries is not None:
        # Used GPUs = mean utilisation of the GPUs that reported x the cluster's GPU count.
        try:
            if gpus_total is None:
                gpus_total = sum(Node.objects.values_list("gpu_count", flat=True))
            cluster = queries.cluster_utilisation(start=since, end=now, max_points=MAX_POINTS_PER_TRACE)
            trace = cluster["traces"].get("cluster")
            if trace:
                series["used_t"] = _epochs_to_ms(trace["t"])
                series["used"] = [None if u is None else round(u / 100.0 * gpus_total, 2) for u in trace["util_pct"]]
        except Exception:
            logger.exception("telemetry cluster utilisation query failed")
    return series


def loans_by_reservation() -> dict[int, list[dict[str, Any]]]:
    """Loans in progress (borrowed GPUs), grouped by the reservation they come from."""
    loans: dict[tuple[int, int], dict[str, Any]] = {}
    rows = (
        Allocation.objects.filter(borrowed_from__isnull=False)
        .values_list("borrowed_from_id", "job_id", "job__name", "job__owner_id", "job__priority", "since",
                     "loan_until")
    )
    for reservation_id, job_id, job_name, owner_id, priority, since, until in rows:
        loan = loans.setdefault((reservation_id, job_id), {
            "job": job_name, "job_id": job_id, "owner_id": owner_id, "priority": priority, "gpus": 0,
            "since": since, "until": until,
        })
        loan["gpus"] += 1
        loan["since"] = min(loan["since"], since)
        if until is not None:
            loan["until"] = until if loan["until"] is None else min(loan["until"], until)
    grouped: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for (reservation_id, _), loan in loans.items():
        grouped[reservation_id].append(loan)
    return grouped

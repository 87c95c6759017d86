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
from django.db.models import Avg, Case, Count, Max, Q, Sum, Value, When
from django.utils import timezone

from jobs.live_events import describe_event
from jobs.models import (
    Allocation,
    ElasticEvent,
    EventKind,
    Job,
    JobRhythm,
    JobState,
    Node,
    NodeState,
    PlannerControl,
    PlannerRun,
    Priority,
    Reservation,
)
from jobs.planner.wording import duration_words
from jobs.team_data import team_standings
from jobs.waiting import cannot_fit, pending_reason

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
    """(seconds left, measured?) at the measured rhythm, else at the spec's step time; no
    seconds for a finished job, nor for one that cannot fit the cluster (it may never run)."""
    remaining = max(job.total_steps - job.committed_steps, 0)
    if job.is_terminal or cannot_fit(job):
        return None, False
    measured = step_s is not None and step_s > 0
    return remaining * (step_s if measured else job.step_s), measured


def human_duration(seconds: float | None) -> str:
    """``93784`` -> ``"1 d 2 h"``; short and readable in a table cell (the planner's words too)."""
    return "—" if seconds is None else duration_words(seconds)


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


def _drawn_times_ms(trace: dict[str, list], until: datetime) -> list[float]:
    """Where a chart draws each bucket's mean: when its readings were taken, on average
    (``t_mean``), never past ``until`` (the live edge). At a bucket's start, or even its middle, a
    3-minute bucket of the console's day drew the used GPUs of a cluster whose jobs began two
    minutes into it before any job held a GPU."""
    end_s = until.timestamp()
    return _epochs_to_ms(min(t, end_s) for t in trace["t_mean"])


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
            t = _drawn_times_ms(trace, until)
            series["step"] = {"t": t, "step_s": trace["step_s"], "step_s_max": trace["step_s_max"],
                              "step": trace["step"]}
            # Mean tokens per rank-step, by modality (telemetry.queries' tokens_<modality>); none
            # when its records count no tokens (a plain script's lines, a framework's callback).
            tokens = {m: trace.get(f"tokens_{m}") or [0] * len(t) for m in MODALITIES}
            if any(any(values) for values in tokens.values()):
                series["tokens"] = {"t": t, **tokens}
        gpus = queries.gpu_utilisation_series(start=since, end=until, max_points=MAX_POINTS_PER_TRACE,
                                              job_id=job.pk, metrics=("util_pct",))
        series["gpus"] = {
            name: {"t": _drawn_times_ms(trace, until), "util": trace["util_pct"], "node": trace["node"],
                   "gpu": trace["gpu"]}
            for name, trace in gpus["traces"].items()
        }
    except Exception:
        logger.exception("telemetry series query failed for job %s", job.pk)
    return series


def job_markers(job: Job, since: datetime) -> list[dict[str, Any]]:
    """Scheduler events of the job in range, as chart markers with their sentence."""
    events = job.events.filter(at__gte=since, kind__in=MARKER_KINDS).order_by("id")[:500]
    # The sentence without its hour: the browser prefixes the local time (omni.js).
    return [{"t": _iso(e.at), "kind": e.kind, "label": e.get_kind_display(), "text": describe_event(e, with_time=False)}
            for e in events]


# Kinds whose outcome ``step`` is a saved checkpoint (a completion saves last); elsewhere only
# ``checkpoint_step`` names one (a resume's is the checkpoint it loaded: the same step again).
CHECKPOINT_STEP_KINDS = frozenset({EventKind.CHECKPOINT, EventKind.COMPLETE})


def checkpoint_of(event: ElasticEvent) -> tuple[int, float | None] | None:
    """(step, save seconds or None) if the audit row reports a saved checkpoint."""
    outcome = event.outcome if isinstance(event.outcome, dict) else {}
    step = outcome.get("checkpoint_step")
    if step is None and event.kind in CHECKPOINT_STEP_KINDS:
        step = outcome.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
        return None
    save_s = outcome.get("save_s")
    return step, float(save_s) if isinstance(save_s, (int, float)) and not isinstance(save_s, bool) else None


def job_checkpoints(job: Job, limit: int = 20) -> list[dict[str, Any]]:
    """The job's checkpoints, one row per step, newest first: the job page's card is the first row.

    Two sources say a step was saved: the audit rows (``checkpoint_of``: a preempt's or
    resize's outcome, a completion, a resume naming the step it loaded) and the job's own
    ``last_checkpoint_step``/``_at``, which heartbeats advance without an audit row. A step
    reported by several rows is one checkpoint, saved at the earliest of their times.
    """
    rows: dict[int, dict[str, Any]] = {}

    def note(step: int, at: datetime | None, save_s: float | None) -> None:
        row = rows.setdefault(step, {"step": step, "at": at, "save_s": save_s})
        if at is not None and (row["at"] is None or at < row["at"]):
            row["at"] = at
        if row["save_s"] is None:
            row["save_s"] = save_s

    events = job.events.filter(
        Q(kind__in=CHECKPOINT_STEP_KINDS) | Q(outcome__has_key="checkpoint_step")
    ).order_by("-id")[:500]
    for event in events:
        found = checkpoint_of(event)
        if found is not None:
            note(found[0], event.at, found[1])
    if job.last_checkpoint_step > 0:
        note(job.last_checkpoint_step, job.last_checkpoint_at, None)
    return sorted(rows.values(), key=lambda row: row["step"], reverse=True)[:limit]


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
    """The reservation's guaranteed windows overlapping ``[since, until)`` (at most ``limit``),
    none past its cancellation or the end of the job it is for (``Reservation.over_at``)."""
    windows: list[tuple[datetime, datetime]] = []
    over = reservation.over_at
    if reservation.is_recurring:
        first = reservation.start_at
        if since > first:
            periods = int((since - first).total_seconds() // reservation.period_s)
            first = first + timedelta(seconds=periods * reservation.period_s)
        t: datetime | None = first
    else:
        t = reservation.start_at
    while t is not None and t < until and len(windows) < limit and (over is None or t < over):
        end = reservation.window_end(t)
        if over is not None:
            end = min(end, over)
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
                series["used_t"] = _drawn_times_ms(trace, now)
                series["used"] = [_used_gpus(u, gpus_total) for u in trace["util_pct"]]
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


def _used_gpus(util_pct: float | None, gpus_total: int) -> float | None:
    """Used GPUs: the mean utilisation of the GPUs that reported x the cluster's GPU count."""
    return None if util_pct is None else round(util_pct / 100.0 * gpus_total, 2)


# A live "used" point is the last minute's mean; each process computes one at most this often.
USED_POINT_WINDOW = timedelta(minutes=1)
USED_POINT_INTERVAL_S = 10.0
_used_point: tuple[datetime | None, dict[str, Any] | None] = (None, None)


def used_point(now: datetime, gpus_total: int) -> dict[str, Any] | None:
    """``{"t", "gpus"}``: used GPUs over the last minute (telemetry.queries), for the utilisation
    chart's live line; None when this process made one less than ``USED_POINT_INTERVAL_S`` ago
    or no GPU reported."""
    global _used_point
    made_at, _ = _used_point
    if made_at is not None and abs((now - made_at).total_seconds()) < USED_POINT_INTERVAL_S:
        return None
    point = None
    queries = _telemetry_queries()
    if queries is not None:
        try:
            trace = queries.cluster_utilisation(start=now - USED_POINT_WINDOW, end=now, max_points=1)["traces"].get("cluster")
            values = [u for u in (trace or {}).get("util_pct", []) if u is not None]
            if values:
                point = {"t": _iso(now), "gpus": _used_gpus(values[-1], gpus_total)}
        except Exception:
            logger.exception("telemetry cluster utilisation query failed")
    _used_point = (now, point)
    return point


# -- the Cluster page's summary -------------------------------------------------------------------

# Classes in the order people think of them (the stored values sort alphabetically).
CLASS_ORDER = Case(
    When(priority=Priority.CRITICAL, then=Value(0)),
    When(priority=Priority.REGULAR, then=Value(1)),
    default=Value(2),
)
WAITING_STATES = (JobState.PENDING, JobState.PREEMPTED, JobState.RECOVERING)
QUEUE_LIMIT = 200
#: The dashboard's header: jobs that hold or are moving GPUs, and jobs waiting for them.
RUNNING_COUNTED = (JobState.RUNNING, JobState.CHECKPOINTING, JobState.RESIZING, JobState.RECOVERING)
WAITING_COUNTED = (JobState.PENDING, JobState.PREEMPTED)


def job_counts() -> dict[str, int]:
    """The dashboard's header counts, cluster-wide (one query): ``running`` and ``waiting``."""
    return Job.objects.aggregate(running=Count("id", filter=Q(state__in=RUNNING_COUNTED)),
                                 waiting=Count("id", filter=Q(state__in=WAITING_COUNTED)))


def held_gpus() -> dict[str, int]:
    """GPUs held now, cluster-wide (one query): ``allocated``, and ``borrowed`` from reservations."""
    return Allocation.objects.aggregate(allocated=Count("id"), borrowed=Count("id", filter=Q(borrowed_from__isnull=False)))


def cluster_summary(now: datetime | None = None, *, control: PlannerControl | None = None) -> dict[str, Any]:
    """The Cluster page's header counts, health and planner pills, planner line and queue:
    rendered on load and sent live as ``cluster_summary`` (jobs.live_events, which adds a
    utilisation point). Counts are the cluster's, for everyone; the queue names every waiting
    job with why it waits, and is cut per viewer (``jobs.live_consumers.payload_for_viewer``).
    Ten queries (one less with no job waiting, one less with no team, one less given the planner's
    ``control``): one of them the jobs losing most GPU time and the prediction accuracy
    (``measured_summary``), two the teams' standings (one with no team; ``teams``:
    jobs.team_data.team_standings, the console's team bars; no job named, so no cut).
    """

    now = now or timezone.now()
    nodes = {row["state"]: row for row in Node.objects.order_by().values("state").annotate(n=Count("id"), gpus=Sum("gpu_count"))}
    held = held_gpus()
    queue = list(Job.objects.filter(state__in=WAITING_STATES).select_related("owner")
                 .order_by(CLASS_ORDER, "submitted_at")[:QUEUE_LIMIT])
    holds = last_holds(job.pk for job in queue)
    run = PlannerRun.objects.order_by("-started_at").first()
    control = control or PlannerControl.load()
    gpus_total = sum(row["gpus"] for row in nodes.values())
    losing, predictions = measured_summary()
    return {
        "at": _iso(now),
        "nodes": sum(row["n"] for row in nodes.values()),
        "gpus_total": gpus_total,
        "gpus_allocated": held["allocated"],
        "gpus_borrowed": held["borrowed"],
        "jobs": job_counts(),
        "health": [{"state": state, "label": label, "count": nodes[state]["n"]}
                   for state, label in NodeState.choices if state in nodes],
        "planner": {
            "paused": control.paused,
            "dry_run": control.dry_run,
            "last_run": None if run is None else {
                "started_at": _iso(run.started_at), "duration_ms": run.duration_ms, "actions": run.actions,
            },
        },
        "queue": [
            {"id": job.pk, "name": job.name, "owner": job.owner.get_username() if job.owner_id else "",
             "priority": job.priority,
             "priority_label": job.get_priority_display(), "state": job.state, "state_label": job.get_state_display(),
             "gpus_wanted": job.gpus_wanted, "waiting_s": int((now - job.state_changed_at).total_seconds()),
             "why": pending_reason(job, holds.get(job.pk))}
            for job in queue
        ],
        "losing": losing,
        "predictions": predictions,
        "teams": team_standings(gpus_total=gpus_total),
    }


LOSING_LIMIT = 5


PREDICTION_KINDS = (("step", "next step time"), ("save", "save time"), ("idle", "next idle window"),
                    ("reclaim", "reclaim stop"))


def measured_summary(limit: int = LOSING_LIMIT) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """From the running jobs' measured rhythm (docs/rhythm.md), in one query: the jobs whose GPUs
    compute least, by GPUs x the share of wall time lost, and to what (the operator console's
    list); and how well the planner's predictions came true across them, per kind: the median
    of the jobs' p50 errors and the 95th percentile of their p95s."""
    rows = list(JobRhythm.objects.filter(job__state__in=(JobState.RUNNING, JobState.RESIZING))
                .annotate(gpus=Count("job__allocations")).filter(gpus__gt=0)
                .values("job_id", "job__name", "job__owner__username", "job__priority", "gpus", "lost_share",
                        "lost_to", "accuracy"))
    lossy = sorted((r for r in rows if (r["lost_share"] or 0.0) > 0.005),
                   key=lambda r: (-r["gpus"] * r["lost_share"], r["job__name"]))[:limit]
    losing = [{"id": r["job_id"], "name": r["job__name"], "owner": r["job__owner__username"] or "",
               "priority": r["job__priority"], "priority_label": Priority(r["job__priority"]).label, "gpus": r["gpus"],
               "lost_gpus": round(r["gpus"] * r["lost_share"], 2), "share": round(r["lost_share"], 3),
               "to": r["lost_to"], "words": lost_words(r["lost_share"], r["lost_to"])}
              for r in lossy]
    predictions = []
    for kind, words in PREDICTION_KINDS:
        scored = [r["accuracy"][kind] for r in rows if kind in (r["accuracy"] or {})]
        if not scored:
            continue
        p50s = sorted(a["p50"] for a in scored)
        p95s = sorted(a["p95"] for a in scored)
        predictions.append({"kind": kind, "words": words, "jobs": len(scored), "p50": round(p50s[len(p50s) // 2], 4),
                            "p95": round(p95s[min(len(p95s) - 1, int(0.95 * len(p95s)))], 4)})
    return losing, predictions


# -- measured rhythm (docs/rhythm.md) --------------------------------------------------------------

IDLE_KIND_WORDS = {"pause": "pause (evaluation or other off-step work)", "checkpoint": "checkpoint",
                   "data_stall": "data stall"}


def _clock_words(epoch_s: float) -> str:
    moment = timezone.localtime(datetime.fromtimestamp(epoch_s, tz=timezone.get_current_timezone()))
    return moment.strftime("%H:%M %Z")


def _rounded(value: float | None) -> float | None:
    return round(value, 4) if value is not None else None


def rhythm_summary(job: Job) -> dict[str, Any] | None:
    """What was measured about ``job``'s steps, for its page and the API; ``None`` before its
    first step record. Reads the job's ``rhythm`` row (select it with the job)."""
    from jobs.rhythm import DIAGNOSIS_STEPS, bubble_share
    from jobs.snapshot import measured_rhythm, straggler_factor

    state = measured_rhythm(job)
    if state is None or not state.records:
        return None
    factor = straggler_factor()
    p50, p95 = state.error_percentiles()
    accuracy, lost = state.accuracy(), state.lost()
    bubble = bubble_share(job.pp, job.accum_steps)
    return {
        "samples": len(state.step_s),
        "dp": state.dp,
        "mean_step_s": round(state.mean_s, 4) if state.step_s else None,
        "stdev_step_s": round(state.stdev_s, 4) if state.step_s else None,
        "prediction_error_p50": round(p50, 4) if p50 is not None else None,
        "prediction_error_p95": round(p95, 4) if p95 is not None else None,
        "save_s": state.save_s[-1] if state.save_s else None,
        "save_prediction_error_p50": _rounded(state.error_percentiles(state.save_errors, at_least=3)[0]),
        "save_prediction_error_p95": _rounded(state.error_percentiles(state.save_errors, at_least=3)[1]),
        "load_s": state.load_s[-1] if state.load_s else None,
        "idle_phases": [{"kind": p.kind, "words": IDLE_KIND_WORDS[p.kind], "every_steps": p.every_steps,
                         "duration_s": round(p.duration_s, 2), "seen": p.seen}
                        for p in state.phases(checkpoint_every=job.checkpoint_every_steps)],
        "shares": {name: round(value, 3) for name, value in state.shares.items()},
        "bubble_share": round(bubble, 3),
        "diagnosis": state.diagnosis(bubble, clock=_clock_words) or (
            f"after {DIAGNOSIS_STEPS} steps" if state.records < DIAGNOSIS_STEPS else
            "not measured: its step records give no compute, data-wait and communication times"),
        "last_check": state.findings[-1] if state.findings else None,
        "stragglers": [{"rank": rank, "node": state.rank_nodes[rank] if rank < len(state.rank_nodes) else None,
                        "slowdown": round(ratio, 2)} for rank, ratio in sorted(state.stragglers(factor).items())],
        "accuracy": accuracy,
        "next_idle": state.next_idle,
        "lost": None if lost is None else {"share": round(lost[0], 3), "to": lost[1]},
        "words": {
            "predictions": _prediction_words(accuracy, state),
            "next_idle": (f"{IDLE_KIND_WORDS[state.next_idle['kind']]} after step {state.next_idle['after_step']}, "
                          f"about {state.next_idle['duration_s']:.1f} s" if state.next_idle else "none expected"),
            "lost": lost_words(*lost) if lost is not None else "after 10 steps",
        },
    }


def lost_words(share: float, cause: str) -> str:
    """``38% of its GPU time, most to data wait``: how much of a job's time its GPUs do not compute."""
    from jobs.rhythm import LOSS_WORDS

    if share < 0.005:
        return "none: its GPUs compute all the time"
    return f"{share:.0%} of its GPU time, most to {LOSS_WORDS.get(cause, cause)}"


def _prediction_words(accuracy: dict[str, dict[str, Any]], state: Any) -> str:
    """The idle-window and reclaim predictions against their outcomes, in words."""
    parts = []
    if "idle" in accuracy:
        a = accuracy["idle"]
        parts.append(f"next idle window p50 {a['p50']:.3f}, p95 {a['p95']:.3f} ({a['n']} scored; 1 is one that did not come)")
    if "reclaim" in accuracy:
        a = accuracy["reclaim"]
        late = sum(1 for r in state.reclaims if r["took_s"] > r["lead_s"])
        parts.append(f"reclaim stops p50 {a['p50']:.3f}, p95 {a['p95']:.3f} ({a['n']} scored, {late} past their lead)")
    return "; ".join(parts) or "none scored yet"

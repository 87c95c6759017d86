"""``GET /metrics``: the control plane in Prometheus text exposition format (version 0.0.4).

Written by hand rather than with prometheus_client: a dozen gauges and counters, most computed
from the database at scrape time, so they are right whichever process answers. Process-local
values (this process's ingest rate, batch outcomes, WebSocket clients) carry no pid label;
scrape every process to sum them. Access: an operator's session, or
``Authorization: Bearer <OMNI_METRICS_TOKEN>``. See docs/telemetry.md.
"""

from __future__ import annotations

import secrets
from datetime import timedelta

from django.conf import settings
from django.db.models import Count, Max, Sum
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET

from jobs import roles
from jobs.models import Command, CommandState, Job, JobRhythm, JobState, Node, PlannerRun
from telemetry import metrics
from telemetry.models import TelemetrySource

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PLANNER_WINDOW_S = 15 * 60
ACTIVE_SOURCE_S = 5 * 60


class Exposition:
    """Accumulates metric families: HELP, TYPE, then samples."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self.lines.append(f"{name}{_labels(labels)} {_number(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{key}="{_escape(str(value))}"' for key, value in labels.items()) + "}"


def _number(value: float) -> str:
    if value != value:  # NaN
        return "NaN"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def render_metrics() -> str:
    """The whole exposition, computed now."""
    now = timezone.now()
    out = Exposition()

    # Telemetry ingestion, from the database: right across every ingesting process.
    by_kind = {
        row["kind"]: row
        for row in TelemetrySource.objects.values("kind").annotate(
            samples=Sum("samples_total"), batches=Sum("batches_total"), duplicates=Sum("duplicates_total"),
            newest=Max("last_sample_at"),
        )
    }
    active = TelemetrySource.objects.filter(last_batch_at__gte=now - timedelta(seconds=ACTIVE_SOURCE_S))
    lag = {
        row["kind"]: row for row in active.values("kind").annotate(lag_max=Max("last_lag_s"), sources=Count("id"))
    }
    kinds = ("gpu", "steps")
    out.family("omni_telemetry_samples_stored_total", "counter", "Samples stored, all processes.",
               [({"kind": k}, by_kind.get(k, {}).get("samples") or 0) for k in kinds])
    out.family("omni_telemetry_batches_stored_total", "counter", "Batches stored, all processes.",
               [({"kind": k}, by_kind.get(k, {}).get("batches") or 0) for k in kinds])
    out.family("omni_telemetry_duplicate_batches_total", "counter", "Re-sent batches recognised and skipped.",
               [({"kind": k}, by_kind.get(k, {}).get("duplicates") or 0) for k in kinds])
    out.family("omni_telemetry_active_sources", "gauge", "Sources that sent a batch in the last 5 minutes.",
               [({"kind": k}, lag.get(k, {}).get("sources") or 0) for k in kinds])
    out.family("omni_telemetry_ingest_lag_seconds", "gauge",
               "Worst lag (acceptance time minus newest sample time) of the last batch of active sources.",
               [({"kind": k}, lag[k]["lag_max"]) for k in kinds if lag.get(k, {}).get("lag_max") is not None])
    out.family("omni_telemetry_newest_sample_age_seconds", "gauge", "Age of the newest stored sample.",
               [({"kind": k}, (now - by_kind[k]["newest"]).total_seconds())
                for k in kinds if by_kind.get(k, {}).get("newest")])
    rates = metrics.ingest_rate_per_s()
    out.family("omni_telemetry_ingest_rate_samples_per_second", "gauge",
               "Samples per second stored by this process over the last minute.",
               [({"kind": k}, rates.get(k, 0.0)) for k in kinds])
    counters, websockets = metrics.snapshot()
    outcomes = []
    for (name, label), value in sorted(counters.items()):
        if name == "omni_telemetry_batches_total":
            kind, _, outcome = label.partition(",")
            outcomes.append(({"kind": kind, "outcome": outcome}, value))
    out.family("omni_telemetry_batches_total", "counter",
               "Batches handled by this process, by outcome (stored, duplicate, rejected).", outcomes)
    out.family("omni_telemetry_live_frames_dropped_total", "counter",
               "Live frames this process dropped because the channel layer fell behind.",
               [({}, counters.get(("omni_telemetry_live_frames_dropped_total", "backlog"), 0))])

    # The planner, from its run records.
    recent = sorted(
        d / 1000.0 for d in PlannerRun.objects.filter(
            started_at__gte=now - timedelta(seconds=PLANNER_WINDOW_S), duration_ms__isnull=False
        ).values_list("duration_ms", flat=True)
    )
    last = PlannerRun.objects.filter(duration_ms__isnull=False).order_by("-started_at").first()
    out.family("omni_planner_pass_duration_seconds", "summary", "Planner pass duration over the last 15 minutes.", [
        ({"quantile": "0.5"}, _quantile(recent, 0.5)),
        ({"quantile": "0.95"}, _quantile(recent, 0.95)),
        ({"quantile": "1"}, recent[-1] if recent else float("nan")),
    ])
    out.lines.append(f"omni_planner_pass_duration_seconds_sum {_number(sum(recent))}")
    out.lines.append(f"omni_planner_pass_duration_seconds_count {len(recent)}")
    if last is not None:
        out.family("omni_planner_last_pass_duration_seconds", "gauge", "Duration of the latest planner pass.",
                   [({}, last.duration_ms / 1000.0)])
        out.family("omni_planner_last_pass_age_seconds", "gauge", "Time since the latest planner pass started.",
                   [({}, (now - last.started_at).total_seconds())])

    # Queue, jobs, commands, nodes.
    pending = dict(Job.objects.filter(state=JobState.PENDING).values_list("priority").annotate(n=Count("id")))
    out.family("omni_queue_length", "gauge", "Jobs waiting for GPUs, by priority class.",
               [({"priority": p}, pending.get(p, 0)) for p in ("critical", "regular", "best_effort")])
    jobs = dict(Job.objects.values_list("state").annotate(n=Count("id")))
    out.family("omni_jobs", "gauge", "Jobs by state.", [({"state": s}, jobs.get(s, 0)) for s in JobState.values])
    commands = dict(Command.objects.values_list("state").annotate(n=Count("id")))
    out.family("omni_commands", "gauge", "Commands not yet finished, by state.",
               [({"state": s}, commands.get(s, 0)) for s in (CommandState.PENDING, CommandState.SENT, CommandState.ACKED)])
    out.family("omni_commands_expired_total", "counter", "Commands that expired unacknowledged.",
               [({}, commands.get(CommandState.EXPIRED, 0))])
    nodes = dict(Node.objects.values_list("state").annotate(n=Count("id")))
    out.family("omni_nodes", "gauge", "Nodes by state.", [({"state": s}, nodes.get(s, 0)) for s in sorted(nodes)])
    out.family("omni_websocket_clients", "gauge", "WebSocket clients connected to this process.",
               [({"kind": k}, v) for k, v in sorted(websockets.items())] or [({"kind": "live"}, 0)])
    # Measured rhythm (docs/rhythm.md): how well the planner predicts the step times it plans on.
    rhythms = list(JobRhythm.objects.filter(job__state__in=[JobState.RUNNING, JobState.RESIZING],
                                            error_p95__isnull=False).values_list("job__name", "error_p50", "error_p95"))
    out.family("omni_job_step_prediction_error", "gauge",
               "Relative error of the predicted step time, per running job (p50 and p95 over its last 200 steps).",
               [({"job": name, "quantile": q}, value) for name, p50, p95 in rhythms for q, value in (("0.5", p50), ("0.95", p95))])
    p95s = sorted(p95 for _, _, p95 in rhythms)
    out.family("omni_step_prediction_error_p95_across_jobs", "gauge",
               "Median and worst of the running jobs' p95 step-time prediction errors.",
               [({"stat": "median"}, _quantile(p95s, 0.5)), ({"stat": "max"}, p95s[-1] if p95s else float("nan"))])
    # The other predictions the planner acts on (save time, next idle window, reclaim stop), and
    # the GPU time each running job loses, and to what.
    measured = list(JobRhythm.objects.filter(job__state__in=[JobState.RUNNING, JobState.RESIZING])
                    .values_list("job__name", "accuracy", "lost_share", "lost_to"))
    kinds = ("save", "idle", "reclaim")
    out.family("omni_job_prediction_error", "gauge",
               "Relative error of a running job's predictions by kind (save, idle window, reclaim stop): p50 and p95.",
               [({"job": name, "prediction": kind, "quantile": q}, (accuracy or {})[kind][key])
                for name, accuracy, _, _ in measured for kind in kinds if kind in (accuracy or {})
                for q, key in (("0.5", "p50"), ("0.95", "p95"))])
    out.family("omni_prediction_error_p95_across_jobs", "gauge",
               "Median and worst of the running jobs' p95 prediction errors, by kind.",
               [({"prediction": kind, "stat": stat}, value) for kind in kinds
                for values in [sorted((a or {})[kind]["p95"] for _, a, _, _ in measured if kind in (a or {}))]
                for stat, value in (("median", _quantile(values, 0.5)), ("max", values[-1] if values else float("nan")))])
    out.family("omni_job_gpu_time_lost_share", "gauge",
               "Share of a running job's recent wall time its GPUs did not compute, by what took most of it.",
               [({"job": name, "to": to}, share) for name, _, share, to in measured if share is not None])
    slow = list(Node.objects.filter(speed_factor__gt=1.0).values_list("name", "speed_factor"))
    out.family("omni_node_speed_factor", "gauge", "Nodes measured slow (straggler speed factor above 1).",
               [({"node": name}, factor) for name, factor in slow])
    return out.text()


def _authorised(request: HttpRequest) -> int | None:
    """None when allowed, else the status to answer (401 without credentials, 403 otherwise)."""
    header = request.META.get("HTTP_AUTHORIZATION", "")
    token = settings.OMNI_METRICS_TOKEN
    if header:
        scheme, _, given = header.partition(" ")
        # Compared as bytes: compare_digest refuses str with non-ASCII characters (a TypeError,
        # once a 500 for any Authorization header outside ASCII). Headers arrive as latin-1.
        if token and scheme.lower() == "bearer" and secrets.compare_digest(
            given.strip().encode("utf-8", "surrogateescape"), token.encode("utf-8", "surrogateescape")
        ):
            return None
        return 403
    if request.user.is_authenticated:
        return None if roles.is_operator(request.user) else 403
    return 401


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus scrape endpoint."""
    refused = _authorised(request)
    if refused == 401:
        response = HttpResponse("authentication required\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="omni-metrics"'
        return response
    if refused == 403:
        return HttpResponse("only operators or the metrics token may read /metrics\n", status=403,
                            content_type="text/plain")
    return HttpResponse(render_metrics(), content_type=CONTENT_TYPE)

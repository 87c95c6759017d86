"""One self-contained Plotly HTML page comparing the simulator's policies on one scenario.

``write_html(results, path)`` takes the per-policy result dicts the simulator prints with
``--json`` (metrics, ``jobs``, ``events``, and the sampled ``timeline`` when present) and writes
a page that opens offline (plotly.js is embedded inline, no CDN) with:

1. the metrics side by side (every figure the simulator reports: utilisation, goodput, the
   fluid bound and the share of it, shortfall, preemptions, lost work, and per class the median
   and p95 completion time and queueing delay), then, with omni and a peer among them, omni
   against the peers figure by figure (``jobs.simulator.verdict``), and where each policy's
   healthy GPU-seconds went (``results.where_gpu_s_went``);
2. completion-time CDFs per class, every policy overlaid;
3. utilisation over time (useful / healthy GPUs), every policy overlaid;
4. GPUs over time by priority class, allocated vs useful, one panel per policy;
5. each critical job's entitlement vs delivery, every policy overlaid;
6. a per-job Gantt chart with preemptions marked, one panel per policy.

Pure Python (plotly only, no Django); see ``docs/traces.md`` for how it is used.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from jobs.simulator.results import where_gpu_s_went, where_rows
from jobs.simulator.verdict import verdict, verdict_value

PRIORITY_CLASSES = ("critical", "regular", "best_effort")
CLASS_COLOURS = {"critical": "#d62728", "regular": "#1f77b4", "best_effort": "#2ca02c"}
POLICY_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
POLICY_COLOURS = ("#000000", "#7f7f7f", "#d62728", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b")

# How a Gantt bar ended, when the simulator says so (segments' ``end``): marked with a cross.
SEGMENT_MARKS = {"preempted": ("preemption", "black"), "killed": ("killed (no checkpoint)", "#b00"),
                 "fault": ("node fault", "#f80")}
# Event kinds after which a job holds no GPUs against its will (marked on the Gantt).
PREEMPTION_KINDS = frozenset({"preempt", "kill", "reclaim", "evict"})
# Event kinds whose job loses every GPU (closing its bar) unless the event says otherwise.
RELEASE_KINDS = frozenset({"preempt", "kill", "reclaim", "evict", "finish", "complete", "done", "cancel",
                           "fail", "node_lost", "release"})

MAX_POINTS_PER_SERIES = 4000
MAX_GANTT_JOBS = 150
METRIC_COLUMNS = (
    ("utilization", "utilization", "pct"),
    ("goodput", "goodput (useful / allocated GPU-s)", "pct"),
    ("utilization_bound", "fluid bound on utilization", "pct"),
    ("bound_share", "share of the bound", "pct"),
    ("reservation_shortfall", "reservation shortfall", "pct"),
    ("reservation_shortfall_faults_aside", "shortfall, faults aside", "pct"),
    ("reservation_wait", "reservation wait (undelivered, the grace included)", "pct"),
    ("preemptions", "preemptions", "int"),
    ("graceful_preemptions", "graceful preemptions", "int"),
    ("preemptions_per_completed_job", "preemptions per completed job", "ratio"),
    ("resizes", "resizes", "int"),
    ("lost_gpu_s", "lost GPU-s", "num"),
    ("invariant_violations", "invariant violations", "count"),
    ("useful_gpu_s", "useful GPU-s", "num"),
    ("healthy_gpu_s", "healthy GPU-s", "num"),
    ("planner_calls", "planner calls", "int"),
    ("wall_s", "simulation wall s", "num"),
)

CLASS_COLUMNS = (
    ("jct_median_s", "median completion time"),
    ("jct_p95_s", "p95 completion time"),
    ("jct_horizon_median_s", "median completion time, unfinished jobs counted to the horizon"),
    ("jct_horizon_p95_s", "p95 completion time, unfinished jobs counted to the horizon"),
    ("queue_median_s", "median queueing delay"),
    ("queue_p95_s", "p95 queueing delay"),
)


def write_html(results: list[dict], path: str | Path) -> None:
    """Write the comparison page for one scenario's per-policy results to ``path``."""
    if not results:
        raise ValueError("write_html needs at least one policy result")
    scenario = str(results[0].get("scenario", "scenario"))
    sections: list[tuple[str, str]] = [("Metrics", metrics_table_html(results))]
    found = verdict(results)
    if found is not None:
        sections.append(("omni against the peers", verdict_table_html(found)))
    where = where_table_html(results)
    if where:
        sections.append(("Where the healthy GPU-seconds went", where))
    figures = [
        ("Job completion time CDF per class", completion_cdf_figure(results)),
        ("Utilisation over time: useful / healthy GPUs", utilization_figure(results)),
        ("GPUs over time by class: allocated vs useful", gpu_time_figure(results)),
        ("Critical jobs: entitlement vs delivery", entitlement_figure(results)),
        ("Per-job Gantt (preemptions marked)", gantt_figure(results)),
    ]
    include_js: bool | str = True
    for title, figure in figures:
        if figure is None:
            sections.append((title, "<p>No data for this chart in these results.</p>"))
            continue
        sections.append((title, figure.to_html(full_html=False, include_plotlyjs=include_js,
                                               config={"displaylogo": False})))
        include_js = False
    if include_js is True:  # no figure at all: still a valid, self-contained page
        sections.append(("", ""))
    body = "\n".join(
        f"<section><h2>{html.escape(title)}</h2>\n{content}</section>" if title else content
        for title, content in sections
    )
    page = (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>Omni simulation: {html.escape(scenario)}</title>"
        "<style>body{font-family:system-ui,sans-serif;margin:1.5em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 10px;text-align:right}th:first-child,td:first-child"
        "{text-align:left}.bad{color:#b00}</style></head><body>"
        f"<h1>Omni simulation: {html.escape(scenario)}</h1>"
        f"<p>Policies: {html.escape(', '.join(str(r.get('policy', '?')) for r in results))}</p>\n"
        f"{body}\n</body></html>\n"
    )
    Path(path).write_text(page, encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Metrics


def _format_metric(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "count":
        return str(len(value)) if isinstance(value, Sequence) and not isinstance(value, str) else str(value)
    if kind == "pct" and isinstance(value, int | float):
        return f"{100 * value:.2f}%"
    if kind == "int" and isinstance(value, int | float):
        return f"{int(value)}"
    if kind == "ratio" and isinstance(value, int | float):
        return f"{value:.2f}"
    if kind == "s" and isinstance(value, int | float):
        return f"{value:,.0f} s"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return html.escape(str(value))


def metrics_table_html(results: Sequence[Mapping[str, Any]]) -> str:
    """The side-by-side metrics table, one column per policy, violations listed below it."""
    header = "".join(f"<th>{html.escape(str(r.get('policy', '?')))}</th>" for r in results)
    rows = []
    for key, label, kind in METRIC_COLUMNS:
        cells = "".join(f"<td>{_format_metric(r.get(key), kind)}</td>" for r in results)
        rows.append(f"<tr><td>{html.escape(label)}</td>{cells}</tr>")
    finished = "".join(
        f"<td>{sum(1 for job in r.get('jobs', []) if job.get('end_s') is not None)} / {len(r.get('jobs', []))}</td>"
        for r in results
    )
    rows.append(f"<tr><td>jobs finished</td>{finished}</tr>")
    for cls in PRIORITY_CLASSES:
        if not any(((r.get("classes") or {}).get(cls) or {}).get("jobs") for r in results):
            continue
        for key, label in CLASS_COLUMNS:
            cells = "".join(f"<td>{_format_metric(((r.get('classes') or {}).get(cls) or {}).get(key), 's')}</td>"
                            for r in results)
            rows.append(f"<tr><td>{html.escape(cls)}: {html.escape(label)}</td>{cells}</tr>")
    table = f"<table id=\"metrics\"><tr><th>metric</th>{header}</tr>{''.join(rows)}</table>"
    violations = []
    for r in results:
        for violation in list(r.get("invariant_violations") or [])[:20]:
            violations.append(f"<li class=\"bad\">{html.escape(str(r.get('policy')))}: {html.escape(str(violation))}</li>")
    if violations:
        table += f"<ul>{''.join(violations)}</ul>"
    return table


def where_table_html(results: Sequence[Mapping[str, Any]]) -> str:
    """``where_gpu_s_went`` side by side, a row per use any policy has, in % of the healthy
    GPU-seconds; empty when a result lacks it."""
    shares = [where_gpu_s_went(r) for r in results]
    if any(share is None for share in shares):
        return ""
    header = "".join(f"<th>{html.escape(str(r.get('policy', '?')))}</th>" for r in results)
    rows = []
    for key, _, words in where_rows(shares):
        cells = "".join(f"<td>{share.get(key, 0.0) * 100:.2f}%</td>" for share in shares)
        rows.append(f"<tr><td>{html.escape(words)}</td>{cells}</tr>")
    return f"<table id=\"where\"><tr><th>use</th>{header}</tr>{''.join(rows)}</table>"


def verdict_table_html(found: Mapping[str, Any]) -> str:
    """``verdict``'s figures, one row each: omni's value, the best peer's, and who leads."""
    rows = []
    for row in found["figures"]:
        key = row["figure"]
        lead = "omni (or level)" if row["ahead"] else row["best_peer"]
        cls = "" if row["ahead"] else " class=\"bad\""
        done = ""
        if "best_peer_completed" in row:
            done = f" ({row['best_peer_completed']} done; omni {row['omni_completed']})"
        rows.append(f"<tr{cls}><td>{html.escape(row['words'])}</td><td>{html.escape(verdict_value(key, row['omni']))}</td>"
                    f"<td>{html.escape(row['best_peer'])}: {html.escape(verdict_value(key, row['best_peer_value']))}"
                    f"{html.escape(done)}</td><td>{html.escape(lead)}</td></tr>")
    for bound in found["bounds"]:
        cls = "" if bound["met"] else " class=\"bad\""
        rows.append(f"<tr{cls}><td>{html.escape(bound['words'])}</td>"
                    f"<td>{html.escape(verdict_value(bound['figure'], bound['omni']))}</td>"
                    f"<td>limit {html.escape(verdict_value(bound['figure'], bound['limit']))}</td>"
                    f"<td>{'met' if bound['met'] else 'not met'}</td></tr>")
    summary = (f"<p>Ahead or level on {found['ahead']} of {found['of']} figures against "
               f"{html.escape(', '.join(found['peers']))}.</p>")
    return (f"{summary}<table id=\"verdict\"><tr><th>figure</th><th>omni</th><th>best peer</th><th>leads</th></tr>"
            f"{''.join(rows)}</table>")


# ---------------------------------------------------------------------------------------------
# Policies side by side


def _policy_line(index: int) -> dict[str, Any]:
    return {"color": POLICY_COLOURS[index % len(POLICY_COLOURS)], "dash": POLICY_DASHES[index % len(POLICY_DASHES)]}


def completion_cdf(result: Mapping[str, Any], priority: str) -> tuple[list[float], list[float]]:
    """Sorted completion times (s) of a class and the share of the class's jobs done by each: a
    job that never completes keeps the curve below 1."""
    jobs = [j for j in result.get("jobs", []) if j.get("priority") == priority]
    times = sorted(float(j["jct_s"]) for j in jobs if j.get("jct_s") is not None)
    return times, [(i + 1) / len(jobs) for i in range(len(times))]


def completion_cdf_figure(results: Sequence[Mapping[str, Any]]) -> go.Figure | None:
    """One panel per class with completed jobs, one CDF line per policy (hours on a log axis)."""
    classes = [c for c in PRIORITY_CLASSES if any(completion_cdf(r, c)[0] for r in results)]
    if not classes:
        return None
    figure = make_subplots(rows=1, cols=len(classes), subplot_titles=classes, shared_yaxes=True)
    for col, priority in enumerate(classes, start=1):
        for index, result in enumerate(results):
            times, shares = completion_cdf(result, priority)
            if not times:
                continue
            policy = result.get("policy", "?")
            figure.add_trace(go.Scatter(
                x=[t / 3600.0 for t in _thin(times)], y=_thin(shares), name=f"{policy} completion",
                legendgroup=f"cdf-{policy}", showlegend=col == 1, line={"shape": "hv", **_policy_line(index)},
                hovertemplate=f"{policy}: %{{y:.0%}} of {priority} jobs done within %{{x:.2f}} h",
            ), row=1, col=col)
        figure.update_xaxes(title_text="completion time (hours)", type="log", row=1, col=col)
    figure.update_yaxes(title_text="share of the class's jobs", range=[0, 1.02], row=1, col=1)
    figure.update_layout(height=420, margin={"t": 40, "b": 40})
    return figure


def utilization_figure(results: Sequence[Mapping[str, Any]]) -> go.Figure | None:
    """Useful GPUs over healthy GPUs at each timeline sample, one line per policy."""
    figure = go.Figure()
    for index, result in enumerate(results):
        timeline = _thin([s for s in result.get("timeline") or [] if isinstance(s, Mapping) and "useful" in s])
        if not timeline:
            continue
        policy = result.get("policy", "?")
        share = [sum(float(v) for v in (s.get("useful") or {}).values()) / float(s.get("healthy_gpus") or 1)
                 for s in timeline]
        mean = result.get("utilization")
        label = f"{policy} useful" + (f" (mean {100 * mean:.1f}%)" if isinstance(mean, int | float) else "")
        figure.add_trace(go.Scatter(
            x=[float(s.get("t", 0.0)) / 3600.0 for s in timeline], y=share, name=label,
            line={"shape": "hv", "width": 1.5, **_policy_line(index)},
            hovertemplate=f"{policy}: %{{y:.0%}} useful at %{{x:.2f}} h",
        ))
    if not figure.data:
        return None
    bound = results[0].get("utilization_bound")
    if isinstance(bound, int | float):
        figure.add_hline(y=bound, line={"color": "#999", "dash": "dot"},
                         annotation_text=f"fluid bound {100 * bound:.1f}% (mean)")
    figure.update_layout(height=380, margin={"t": 40, "b": 40}, xaxis_title="hours",
                         yaxis={"title": "useful / healthy GPUs", "range": [0, 1.05], "tickformat": ".0%"})
    return figure


# ---------------------------------------------------------------------------------------------
# Time series


def _thin(points: list[Any], limit: int = MAX_POINTS_PER_SERIES) -> list[Any]:
    """Every k-th sample so a week-long run stays a few MB; the last sample is always kept."""
    if len(points) <= limit:
        return points
    stride = math.ceil(len(points) / limit)
    thinned = points[::stride]
    if thinned[-1] is not points[-1]:
        thinned.append(points[-1])
    return thinned


def _job_classes(result: Mapping[str, Any]) -> dict[str, str]:
    return {str(job.get("name")): str(job.get("priority", "regular")) for job in result.get("jobs", [])}


def _event_gpus(event: Mapping[str, Any], side: str) -> int | None:
    """GPUs a job holds before or after an event, from ``gpus_*`` or the length of ``nodes_*``."""
    for key in (f"gpus_{side}", f"{side}_gpus"):
        if isinstance(event.get(key), int | float):
            return int(event[key])
    nodes = event.get(f"nodes_{side}")
    if isinstance(nodes, Mapping):
        return int(sum(float(count) for count in nodes.values()))
    if isinstance(nodes, list):
        total = 0
        for node in nodes:
            if isinstance(node, Mapping):
                total += int(node.get("gpus", 0))
            elif isinstance(node, list | tuple) and len(node) == 2:
                total += int(node[1])
            else:
                return None
        return total
    return None


def job_segments(result: Mapping[str, Any]) -> dict[str, list[tuple[float, float, int]]]:
    """(start, end, gpus) bars per job: from ``segments`` if the simulator gives them, else from events."""
    horizon_s = _horizon(result)
    given: dict[str, list[tuple[float, float, int]]] = {}
    for job in result.get("jobs", []):
        if job.get("segments"):
            given[str(job["name"])] = [
                (float(s.get("start_s", s.get("start", 0.0))), float(s.get("end_s", s.get("end", horizon_s)) or horizon_s),
                 int(s.get("gpus", 0)))
                for s in job["segments"] if isinstance(s, Mapping)
            ]
    if given:
        return given
    segments: dict[str, list[tuple[float, float, int]]] = {}
    open_bars: dict[str, tuple[float, int]] = {}
    for event in result.get("events", []) or []:
        name = event.get("job")
        if not name:
            continue
        t = float(event.get("t", 0.0))
        after = _event_gpus(event, "after")
        if after is None:
            if event.get("kind") in RELEASE_KINDS:
                after = 0
            else:
                continue
        current = open_bars.pop(name, None)
        if current and t > current[0]:
            segments.setdefault(name, []).append((current[0], t, current[1]))
        if after > 0:
            open_bars[name] = (t, after)
    for name, (start, gpus) in open_bars.items():
        segments.setdefault(name, []).append((start, horizon_s, gpus))
    if not segments:  # no events either: one bar from start to end per job
        for job in result.get("jobs", []):
            if job.get("start_s") is not None:
                end = job.get("end_s")
                segments[str(job["name"])] = [(float(job["start_s"]), float(end if end is not None else horizon_s),
                                               int(job.get("gpus", 0) or 0))]
    return segments


def _horizon(result: Mapping[str, Any]) -> float:
    for key in ("horizon_s", "end_s", "t_end"):
        if isinstance(result.get(key), int | float):
            return float(result[key])
    timeline = result.get("timeline") or []
    if timeline and isinstance(timeline[-1], Mapping):
        return float(timeline[-1].get("t", 0.0))
    ends = [float(job["end_s"]) for job in result.get("jobs", []) if job.get("end_s") is not None]
    events = [float(e.get("t", 0.0)) for e in result.get("events", []) or []]
    return max(ends + events + [0.0])


def healthy_series(result: Mapping[str, Any]) -> list[float] | None:
    """Healthy GPUs at each timeline sample (thinned like ``class_series``), if recorded."""
    timeline = [sample for sample in result.get("timeline") or [] if isinstance(sample, Mapping)]
    if not timeline or not all("healthy_gpus" in sample for sample in timeline):
        return None
    return [float(sample["healthy_gpus"]) for sample in _thin(timeline)]


def class_series(result: Mapping[str, Any]) -> tuple[list[float], dict[str, list[float]], dict[str, list[float]] | None]:
    """Sample times, allocated GPUs per class, and useful GPUs per class (None if not recorded)."""
    timeline = [sample for sample in result.get("timeline") or [] if isinstance(sample, Mapping)]
    if timeline:
        timeline = _thin(timeline)
        times = [float(sample.get("t", 0.0)) for sample in timeline]
        allocated = {c: [float((s.get("allocated") or {}).get(c, 0)) for s in timeline] for c in PRIORITY_CLASSES}
        has_useful = any("useful" in s for s in timeline)
        useful = ({c: [float((s.get("useful") or {}).get(c, 0)) for s in timeline] for c in PRIORITY_CLASSES}
                  if has_useful else None)
        return times, allocated, useful
    # No sampled timeline: rebuild allocation steps from the per-job bars.
    classes = _job_classes(result)
    deltas: dict[float, dict[str, int]] = {}
    for name, bars in job_segments(result).items():
        priority = classes.get(name, "regular")
        for start, end, gpus in bars:
            deltas.setdefault(start, {}).setdefault(priority, 0)
            deltas[start][priority] += gpus
            deltas.setdefault(end, {}).setdefault(priority, 0)
            deltas[end][priority] -= gpus
    times = []
    allocated = {c: [] for c in PRIORITY_CLASSES}
    level = dict.fromkeys(PRIORITY_CLASSES, 0)
    for t in sorted(deltas):
        for priority, delta in deltas[t].items():
            level[priority] = level.get(priority, 0) + delta
        times.append(t)
        for c in PRIORITY_CLASSES:
            allocated[c].append(float(level.get(c, 0)))
    return times, allocated, None


def gpu_time_figure(results: Sequence[Mapping[str, Any]]) -> go.Figure | None:
    """Stacked GPUs by class over time, allocated (dotted) vs useful (filled), one row per policy."""
    series = [class_series(r) for r in results]
    if not any(times for times, _, _ in series):
        return None
    titles = [f"{r.get('policy', '?')}" for r in results]
    figure = make_subplots(rows=len(results), cols=1, shared_xaxes=True, subplot_titles=titles,
                           vertical_spacing=0.08 if len(results) > 1 else 0.0)
    for row, (result, (times, allocated, useful)) in enumerate(zip(results, series, strict=True), start=1):
        hours = [t / 3600.0 for t in times]
        policy = result.get("policy", "?")
        for priority in PRIORITY_CLASSES:
            colour = CLASS_COLOURS[priority]
            if useful is not None:
                figure.add_trace(go.Scatter(
                    x=hours, y=useful[priority], name=f"useful {priority}", legendgroup=f"useful-{priority}",
                    stackgroup=f"useful-{row}", line={"shape": "hv", "width": 0.5, "color": colour},
                    showlegend=row == 1, hovertemplate=f"{policy}: %{{y:.0f}} GPUs useful at %{{x:.2f}} h",
                ), row=row, col=1)
            figure.add_trace(go.Scatter(
                x=hours, y=allocated[priority], name=f"allocated {priority}",
                legendgroup=f"allocated-{priority}", stackgroup=f"allocated-{row}",
                fill="none" if useful is not None else "tonexty",
                line={"shape": "hv", "width": 1.5, "dash": "dot", "color": colour},
                showlegend=row == 1, hovertemplate=f"{policy}: %{{y:.0f}} GPUs allocated at %{{x:.2f}} h",
            ), row=row, col=1)
        healthy = healthy_series(result)
        if healthy is not None and len(healthy) == len(hours):
            figure.add_trace(go.Scatter(
                x=hours, y=healthy, name="healthy GPUs", legendgroup="healthy", showlegend=row == 1,
                line={"shape": "hv", "width": 1, "color": "black"},
                hovertemplate=f"{policy}: %{{y:.0f}} healthy GPUs at %{{x:.2f}} h",
            ), row=row, col=1)
        figure.update_yaxes(title_text="GPUs", row=row, col=1)
    figure.update_xaxes(title_text="hours", row=len(results), col=1)
    figure.update_layout(height=320 * len(results) + 80, margin={"t": 40, "b": 40},
                         legend={"orientation": "h", "y": -0.08})
    return figure


def entitlement_series(result: Mapping[str, Any]) -> dict[str, tuple[list[float], list[float], list[float]]]:
    """Per critical job: sample times, entitled GPUs, delivered GPUs (empty when not recorded)."""
    out: dict[str, tuple[list[float], list[float], list[float]]] = {}
    given = result.get("entitlements")
    if isinstance(given, list):  # [{"job", "t": [...], "entitled": [...], "delivered": [...]}]
        for item in given:
            if isinstance(item, Mapping) and item.get("job"):
                out[str(item["job"])] = (list(map(float, item.get("t", []))), list(map(float, item.get("entitled", []))),
                                         list(map(float, item.get("delivered", []))))
        return out
    timeline = [s for s in result.get("timeline") or [] if isinstance(s, Mapping) and "entitled" in s]
    if not timeline:
        return out
    timeline = _thin(timeline)
    jobs: list[str] = []
    for sample in timeline:
        for name in (sample.get("entitled") or {}):
            if name not in jobs:
                jobs.append(name)
    for name in jobs:
        times = [float(s.get("t", 0.0)) for s in timeline]
        entitled = [float((s.get("entitled") or {}).get(name, 0)) for s in timeline]
        delivered = [float((s.get("delivered") or {}).get(name, 0)) for s in timeline]
        out[name] = (times, entitled, delivered)
    return out


def entitlement_figure(results: Sequence[Mapping[str, Any]]) -> go.Figure | None:
    """One panel per critical job: the entitlement (shaded) and each policy's delivered GPUs."""
    per_policy = [entitlement_series(r) for r in results]
    critical = [name for name, priority in _job_classes(results[0]).items() if priority == "critical"]
    jobs = [name for name in critical if any(name in series for series in per_policy)]
    jobs += sorted({name for series in per_policy for name in series} - set(jobs))
    if not jobs:
        return None
    figure = make_subplots(rows=len(jobs), cols=1, shared_xaxes=True, subplot_titles=jobs,
                           vertical_spacing=min(0.08, 0.3 / len(jobs)))
    for row, name in enumerate(jobs, start=1):
        drawn_entitlement = False
        for index, (result, series) in enumerate(zip(results, per_policy, strict=True)):
            if name not in series:
                continue
            times, entitled, delivered = series[name]
            hours = [t / 3600.0 for t in times]
            if not drawn_entitlement:
                figure.add_trace(go.Scatter(
                    x=hours, y=entitled, name="entitled", legendgroup="entitled", showlegend=row == 1,
                    line={"shape": "hv", "color": "#999"}, fill="tozeroy", fillcolor="rgba(150,150,150,0.25)",
                ), row=row, col=1)
                drawn_entitlement = True
            figure.add_trace(go.Scatter(
                x=hours, y=delivered, name=f"{result.get('policy', '?')} delivered",
                legendgroup=f"delivered-{result.get('policy')}", showlegend=row == 1,
                line={"shape": "hv", "dash": POLICY_DASHES[index % len(POLICY_DASHES)]},
            ), row=row, col=1)
        figure.update_yaxes(title_text="GPUs", row=row, col=1)
    figure.update_xaxes(title_text="hours", row=len(jobs), col=1)
    figure.update_layout(height=220 * len(jobs) + 100, margin={"t": 40, "b": 40})
    return figure


def _gantt_jobs(result: Mapping[str, Any], segments: Mapping[str, list[tuple[float, float, int]]],
                preempted: Mapping[str, list[float]]) -> list[str]:
    """Which jobs get a Gantt row: critical first, then the most preempted, then the largest."""
    classes = _job_classes(result)
    rank = {c: i for i, c in enumerate(PRIORITY_CLASSES)}

    def gpu_s(name: str) -> float:
        return sum((end - start) * gpus for start, end, gpus in segments.get(name, []))

    names = [name for name in segments if segments[name]]
    def losses(name: str) -> int:
        return sum(len(times) for times in preempted.get(name, {}).values())

    names.sort(key=lambda n: (rank.get(classes.get(n, "regular"), 3), -losses(n), -gpu_s(n), n))
    chosen = names[:MAX_GANTT_JOBS]
    return sorted(chosen, key=lambda n: (rank.get(classes.get(n, "regular"), 3), min(s for s, _, _ in segments[n]), n))


def _preemptions(result: Mapping[str, Any]) -> dict[str, dict[str, list[float]]]:
    """Per job, the times it lost its GPUs by kind: ``preempted`` (graceful), ``killed``, ``fault``.

    Read from the bars' ``end`` when the simulator gives segments, else from the event log.
    """
    marks: dict[str, dict[str, list[float]]] = {}
    from_segments = False
    for job in result.get("jobs", []):
        for segment in job.get("segments") or []:
            if not isinstance(segment, Mapping):
                continue
            from_segments = True
            end = segment.get("end")
            if end in SEGMENT_MARKS and segment.get("end_s") is not None:
                marks.setdefault(str(job["name"]), {}).setdefault(str(end), []).append(float(segment["end_s"]))
    if from_segments:
        return marks
    for event in result.get("events", []) or []:
        if event.get("kind") in PREEMPTION_KINDS and event.get("job"):
            kind = "preempted" if event.get("graceful", True) else "killed"
            marks.setdefault(str(event["job"]), {}).setdefault(kind, []).append(float(event.get("t", 0.0)))
    return marks


def gantt_figure(results: Sequence[Mapping[str, Any]]) -> go.Figure | None:
    """Horizontal bars per job (width = held time, colour = class), preemptions as red crosses."""
    panels = []
    for result in results:
        segments = job_segments(result)
        preempted = _preemptions(result)
        panels.append((result, segments, preempted, _gantt_jobs(result, segments, preempted)))
    if not any(jobs for _, _, _, jobs in panels):
        return None
    titles = []
    for result, segments, _, jobs in panels:
        shown = len(jobs)
        total = sum(1 for bars in segments.values() if bars)
        suffix = f" ({shown} of {total} jobs that ran)" if shown < total else ""
        titles.append(f"{result.get('policy', '?')}{suffix}")
    heights = [max(len(jobs), 1) for _, _, _, jobs in panels]
    figure = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, subplot_titles=titles,
                           row_heights=[h / sum(heights) for h in heights], vertical_spacing=0.04)
    shown_marks: set[str] = set()
    for row, (result, segments, preempted, jobs) in enumerate(panels, start=1):
        classes = _job_classes(result)
        for priority in PRIORITY_CLASSES:
            names, starts, widths, texts = [], [], [], []
            for name in jobs:
                if classes.get(name, "regular") != priority:
                    continue
                for start, end, gpus in segments[name]:
                    names.append(name)
                    starts.append(start / 3600.0)
                    widths.append(max(end - start, 0.0) / 3600.0)
                    texts.append(f"{name}: {gpus} GPUs")
            if names:
                figure.add_trace(go.Bar(
                    y=names, x=widths, base=starts, orientation="h", name=f"{priority} running",
                    legendgroup=f"gantt-{priority}", showlegend=row == 1, marker_color=CLASS_COLOURS[priority],
                    hovertext=texts, hoverinfo="text+x",
                ), row=row, col=1)
        for kind, (label, colour) in SEGMENT_MARKS.items():
            marks_y, marks_x = [], []
            for name in jobs:
                for t in preempted.get(name, {}).get(kind, []):
                    marks_y.append(name)
                    marks_x.append(t / 3600.0)
            if marks_x:
                figure.add_trace(go.Scatter(
                    x=marks_x, y=marks_y, mode="markers", name=label, legendgroup=f"mark-{kind}",
                    showlegend=kind not in shown_marks, marker={"symbol": "x", "color": colour, "size": 8},
                    hovertemplate=f"{label} at %{{x:.2f}} h",
                ), row=row, col=1)
                shown_marks.add(kind)
        figure.update_yaxes(type="category", categoryorder="array", categoryarray=list(reversed(jobs)),
                            showticklabels=len(jobs) <= 60, row=row, col=1)
    figure.update_xaxes(title_text="hours", row=len(panels), col=1)
    figure.update_layout(barmode="overlay", height=min(18 * sum(heights) + 200, 6000), margin={"t": 40, "b": 40})
    return figure


def figure_trace_names(figures: Iterable[go.Figure]) -> list[str]:
    """Trace names of the given figures (used by tests and for debugging a report)."""
    return [str(trace.name) for figure in figures for trace in figure.data]

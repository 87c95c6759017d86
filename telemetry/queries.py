"""Downsampled telemetry queries for the live pages and the planner.

Every series function takes a time range and ``max_points`` and returns at most that many
points per trace. It picks the cheapest data that still resolves the bucket width the range
needs (docs/telemetry.md, "Queries"):

* ``raw`` samples when the bucket is under a minute,
* 1-minute rollups when the bucket is under an hour,
* 1-hour rollups otherwise,

and a level is used only when the range lies within its retention and the rows it would scan
(traces x range / resolution, raw samples assumed 1 Hz) stay within ``ROW_BUDGET``; past that
the next coarser level answers with fewer points. So a 7-day chart of one 8-GPU node is drawn
from 1-minute rollups (up to 2,000 points), a 7-day chart of 64 GPUs from hourly ones (168
points), each in well under 100 ms.

The part of the range newer than a rollup level's watermark (not rolled up yet) is read from
the next finer level and merged, so a chart ending "now" is always fresh. Bucketing happens in
the database; on PostgreSQL each trace comes back as one row of arrays.

A job's GPU chart reads each GPU only over the spans the job held it (``AllocationSpan``), as
keyed ``Window``s: a GPU that served another job before shows none of that job's readings. The
part-buckets at a span's ends (a minute or an hour shared by two holders) are read from the
next finer level too, so no rollup bucket mixes them.

Results are plain dicts ready for JSON and Plotly: ``{"level", "bucket_s", "start", "end",
"traces": {key: {"t": [...epoch seconds, bucket start], "t_mean": [...], <metric>: [...],
"samples": [...]}}}``. ``t_mean`` is when a bucket's readings were taken, on average (a rollup
row counts as read at its middle), where a chart draws the bucket's point: a bucket that readings
began or stopped part-way through is drawn where they were, not at its start or middle. A bucket
with no data is simply absent from a trace (gaps stay gaps).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
from django.db import connection, transaction
from django.db.models import Max, Sum

from telemetry.partitions import retention_for

ROW_BUDGET = 250_000  # rows one series query may scan (about 100 ms on a busy 2-core server)
RAW_SAMPLE_INTERVAL_S = 1.0  # the agents' default reporting interval, for the row estimate
LEVEL_RESOLUTION_S = {"raw": 1, "minute": 60, "hour": 3600}
FINER = {"hour": "minute", "minute": "raw"}

# metric name -> (raw column, rollup mean column, rollup max column or None, how it combines)
GPU_METRICS: dict[str, tuple[str, str, str]] = {
    "util_pct": ("util_pct", "util_mean_pct", "mean"),
    "util_max_pct": ("util_pct", "util_max_pct", "max"),
    "mem_used_bytes": ("mem_used_bytes", "mem_mean_bytes", "mean"),
    "power_w": ("power_w", "power_mean_w", "mean"),
    "temp_c": ("temp_c", "temp_mean_c", "mean"),
}
STEP_METRICS: dict[str, tuple[str, str, str]] = {
    "step": ("step", "step_max", "max"),
    "step_s": ("step_s", "step_s_mean", "mean"),
    "step_s_max": ("step_s", "step_s_max", "max"),
    "data_wait_s": ("data_wait_s", "data_wait_s_mean", "mean"),
    "compute_s": ("compute_s", "compute_s_mean", "mean"),
    "comm_s": ("comm_s", "comm_s_mean", "mean"),
    "loss": ("loss", "loss_mean", "mean"),
    # Mean tokens per step record (rank-step), by modality: rollups hold sums.
    **{
        f"tokens_{m}": (f"tokens_{m}", f"CAST(tokens_{m}_sum AS double precision) / NULLIF(records, 0)", "mean")
        for m in ("text", "image", "video", "audio")
    },
}
DEFAULT_GPU_METRICS = ("util_pct", "util_max_pct")
DEFAULT_STEP_METRICS = ("step", "step_s", "step_s_max", "data_wait_s", "compute_s", "comm_s", "loss")


@dataclass(frozen=True)
class Source:
    """Where one level of one series lives."""

    table: str
    time_column: str
    count_column: str | None  # rollups: rows stand for this many samples; raw: None (count(*))


GPU_SOURCES = {
    "raw": Source("telemetry_gpusample", "at", None),
    "minute": Source("telemetry_gpuminute", "bucket", "samples"),
    "hour": Source("telemetry_gpuhour", "bucket", "samples"),
}
STEP_SOURCES = {
    "raw": Source("telemetry_steprecord", "at", None),
    "minute": Source("telemetry_stepminute", "bucket", "records"),
    "hour": Source("telemetry_stephour", "bucket", "records"),
}


@dataclass(frozen=True)
class Plan:
    """The level and bucketing chosen for a range."""

    level: str
    bucket_s: int
    origin_s: int  # epoch seconds of bin 0's start


@dataclass(frozen=True)
class Window:
    """A stretch [lower, upper) of time whose readings count: of the series ``key`` (a GPU's
    ``(node_id, gpu_index)`` over a span a job held it) or, with no key, of every series the
    query selects."""

    lower: datetime
    upper: datetime
    key: tuple[int, ...] = ()


@dataclass
class _Trace:
    bins: np.ndarray
    samples: np.ndarray
    values: dict[str, np.ndarray]
    #: Per bucket, the mean epoch second of its readings (``t_mean``).
    times: np.ndarray


def _epoch(at: datetime) -> float:
    if at.tzinfo is None:
        raise ValueError("telemetry queries need timezone-aware datetimes")
    return at.timestamp()


def choose_plan(
    start: datetime, end: datetime, max_points: int, *, now: datetime | None = None, traces: int = 1,
    row_budget: int = ROW_BUDGET,
) -> Plan:
    """Pick raw, minute or hour data and a bucket width so that [start, end) fits ``max_points``
    and about ``traces`` series (GPUs, ranks) scan at most ``row_budget`` rows where possible."""
    if max_points < 1:
        raise ValueError("max_points must be at least 1")
    if end <= start:
        raise ValueError("end must be after start")
    now = now or datetime.now(UTC)
    span_s = _epoch(end) - _epoch(start)
    for level in ("raw", "minute", "hour"):
        resolution = LEVEL_RESOLUTION_S[level]
        keep = retention_for(level)
        if keep is not None and start < now - keep:
            continue
        row_interval_s = RAW_SAMPLE_INTERVAL_S if level == "raw" else resolution
        if level != "hour" and max(1, traces) * span_s / row_interval_s > row_budget:
            continue
        origin_s = int(math.floor(_epoch(start) / resolution) * resolution)
        bucket_s = max(1, math.ceil((_epoch(end) - origin_s) / max_points))
        bucket_s = math.ceil(bucket_s / resolution) * resolution
        if level == "raw" and bucket_s >= 60:
            continue
        if level == "minute" and bucket_s >= 3600:
            continue
        return Plan(level, bucket_s, origin_s)
    origin_s = int(math.floor(_epoch(start) / 3600) * 3600)
    bucket_s = math.ceil(math.ceil((_epoch(end) - origin_s) / max_points) / 3600) * 3600
    return Plan("hour", bucket_s, origin_s)


# -- SQL -------------------------------------------------------------------------------------


def _postgres() -> bool:
    return connection.vendor == "postgresql"


def _f8(expr: str) -> str:
    return f"CAST({expr} AS double precision)" if _postgres() else f"CAST({expr} AS REAL)"


def _epoch_sql(column: str) -> str:
    """``column`` (a timestamp) as epoch seconds, with its fraction."""
    if _postgres():
        return f"date_part('epoch', {column})"
    return f"((julianday({column}) - 2440587.5) * 86400.0)"


def _time_sql(level: str, column: str, count: str | None) -> str:
    """The mean epoch second of a bucket's readings: of raw rows their own times, of rollup rows
    their middles weighted by the readings each stands for."""
    at = _epoch_sql(column)
    if level == "raw":
        return f"avg({at})"
    return f"sum(({at} + {LEVEL_RESOLUTION_S[level] / 2.0}) * {count}) / NULLIF(sum({count}), 0)"


def _bin_expr(column: str) -> str:
    if _postgres():
        return f"floor(({_epoch_sql(column)} - %s) / %s)::bigint"
    return f"((CAST(strftime('%%s', {column}) AS INTEGER) - %s) / %s)"


def _param(at: datetime) -> Any:
    return connection.ops.adapt_datetimefield_value(at)


def _aligned(at: datetime, resolution_s: int, up: bool) -> datetime:
    """``at`` rounded to a multiple of ``resolution_s`` (up or down)."""
    steps = _epoch(at) / resolution_s
    return datetime.fromtimestamp((math.ceil(steps) if up else math.floor(steps)) * resolution_s, UTC)


def _keyed_windows_sql(source: Source, key_columns: Sequence[str], windows: Sequence[Window]) -> tuple[str, list]:
    """The FROM clause that keeps each key's rows inside that key's windows (they never
    overlap): the table joined to one set of arrays on PostgreSQL whatever the number of
    windows; on SQLite a VALUES list, as the outer loop (``CROSS JOIN``), so each window is a
    range scan of the table's (key, time) index rather than the table a scan per window."""
    width = len(key_columns)
    columns = [f"column{i + 1}" for i in range(width + 2)]
    if _postgres():
        arrays = ", ".join(["%s::bigint[]"] * width + ["%s::timestamptz[]"] * 2)
        joined = f"{source.table} JOIN unnest({arrays}) AS w({', '.join(columns)})"
        params: list[Any] = [[w.key[i] for w in windows] for i in range(width)]
        params += [[w.lower for w in windows], [w.upper for w in windows]]
    else:
        row = f"({', '.join(['%s'] * (width + 2))})"
        # SQLite names a VALUES list's columns column1, column2, ...
        joined = f"(VALUES {', '.join([row] * len(windows))}) AS w CROSS JOIN {source.table}"
        params = [v for w in windows for v in (*w.key, _param(w.lower), _param(w.upper))]
    on = [f"{column} = w.{columns[i]}" for i, column in enumerate(key_columns)]
    on += [f"{source.time_column} >= w.{columns[width]}", f"{source.time_column} < w.{columns[width + 1]}"]
    return f"{joined} ON {' AND '.join(on)}", params


def _metric_sql(level: str, metrics: dict[str, tuple[str, str, str]], names: Sequence[str], count: str) -> list[str]:
    exprs = []
    for name in names:
        raw_col, rollup_col, how = metrics[name]
        if level == "raw":
            exprs.append(f"max({_f8(raw_col)})" if how == "max" else f"avg({_f8(raw_col)})")
        elif how == "max":
            exprs.append(f"max({_f8(rollup_col)})")
        else:
            weight = f"CASE WHEN {rollup_col} IS NULL THEN 0 ELSE {count} END"
            exprs.append(f"sum({_f8(rollup_col)} * {count}) / NULLIF(sum({weight}), 0)")
    return exprs


def _binned(
    source: Source, level: str, plan: Plan, windows: Sequence[Window],
    key_columns: Sequence[str], filters: Sequence[tuple[str, Sequence[int]]],
    metrics: dict[str, tuple[str, str, str]], names: Sequence[str], unique_per_bucket: bool,
) -> dict[tuple, _Trace]:
    """Bucket the rows of one level's table that lie in ``windows`` (keyed ones, or a single one
    for every series); one _Trace per key. ``unique_per_bucket``: the keys and filters pick at
    most one rollup row per bucket (a GPU, a job)."""
    # A rollup read at its own resolution, one row per trace and bucket, needs no re-binning:
    # each row is a point (the common case for week and month charts).
    direct = unique_per_bucket and level != "raw" and plan.bucket_s == LEVEL_RESOLUTION_S[level]
    if direct:
        count = source.count_column
        metric_sql = [_f8(metrics[name][1]) for name in names]
    else:
        count = "count(*)" if source.count_column is None else f"sum({source.count_column})"
        metric_sql = _metric_sql(level, metrics, names, source.count_column or "1")
    # A bucket's mean reading time (``t_mean``), but for a rollup read one row per bucket: that is
    # the row's middle, worked out below without SQL.
    timed = [] if direct else [f"{_time_sql(level, source.time_column, source.count_column)} AS tm"]
    selects = [*key_columns, f"{_bin_expr(source.time_column)} AS b", f"{count} AS n", *timed,
               *(f"{expr} AS m{i}" for i, expr in enumerate(metric_sql))]
    aliases = ["b", "n", *(["tm"] if timed else []), *(f"m{i}" for i in range(len(names)))]
    params: list[Any] = [plan.origin_s, plan.bucket_s]
    from_sql = source.table
    if windows[0].key:
        from_sql, join_params = _keyed_windows_sql(source, key_columns, windows)
        params += join_params
    where: list[str] = []
    if not windows[0].key or _postgres():
        # The bounds of all windows: PostgreSQL skips the partitions outside them. (SQLite would
        # scan its index between them for every window instead of between the window's own.)
        where = [f"{source.time_column} >= %s", f"{source.time_column} < %s"]
        params += [_param(min(w.lower for w in windows)), _param(max(w.upper for w in windows))]
    for column, values in filters:
        values = list(values)
        if not values:
            return {}
        where.append(f"{column} IN ({', '.join(['%s'] * len(values))})")
        params.extend(values)
    group = ", ".join([*key_columns, "b"])
    inner = f"SELECT {', '.join(selects)} FROM {from_sql}" + (f" WHERE {' AND '.join(where)}" if where else "")
    if not direct:
        inner += f" GROUP BY {group}"
    keys = len(key_columns)
    result: dict[tuple, _Trace] = {}
    with connection.cursor() as cursor:
        if _postgres():
            # One row of arrays per trace: far fewer rows for the driver and Python to touch.
            arrays = ", ".join(f"array_agg({column} ORDER BY b)" for column in aliases)
            key_sql = ", ".join(key_columns)
            sql = f"SELECT {key_sql}{', ' if keys else ''}{arrays} FROM ({inner}) AS binned"
            if keys:
                sql += f" GROUP BY {key_sql}"
            cursor.execute(sql, params)
            rows = [(tuple(row[:keys]), row[keys:]) for row in cursor.fetchall() if row[keys] is not None]
        else:
            cursor.execute(f"{inner} ORDER BY {group}", params)
            grouped: dict[tuple, list] = {}
            for row in cursor.fetchall():
                grouped.setdefault(tuple(row[:keys]), []).append(row[keys:])
            rows = [(key, list(zip(*found, strict=True))) for key, found in grouped.items()]
    first = 2 + len(timed)
    for key, columns in rows:
        bins = np.asarray(columns[0], dtype=np.int64)
        result[key] = _Trace(
            bins,
            np.asarray(columns[1], dtype=np.float64),
            {name: np.asarray(columns[first + i], dtype=np.float64) for i, name in enumerate(names)},
            np.asarray(columns[2], dtype=np.float64) if timed
            else plan.origin_s + bins * plan.bucket_s + plan.bucket_s / 2.0,
        )
    return result


def _merge(head: _Trace, tail: _Trace, metrics: dict[str, tuple[str, str, str]]) -> _Trace:
    """Combine two bucketings of the same bins (a rollup level and its fresher tail)."""
    bins = np.concatenate([head.bins, tail.bins])
    unique, inverse = np.unique(bins, return_inverse=True)
    samples_all = np.concatenate([head.samples, tail.samples])
    samples = np.bincount(inverse, weights=samples_all, minlength=len(unique))
    values: dict[str, np.ndarray] = {}
    for name in head.values:
        joined = np.concatenate([head.values[name], tail.values[name]])
        if metrics[name][2] == "max":
            out = np.full(len(unique), -np.inf)
            np.maximum.at(out, inverse, np.where(np.isnan(joined), -np.inf, joined))
            out[np.isinf(out)] = np.nan
        else:
            present = ~np.isnan(joined)
            weight = np.where(present, samples_all, 0.0)
            total = np.bincount(inverse, weights=np.where(present, joined, 0.0) * weight, minlength=len(unique))
            norm = np.bincount(inverse, weights=weight, minlength=len(unique))
            with np.errstate(invalid="ignore", divide="ignore"):
                out = np.where(norm > 0, total / np.where(norm > 0, norm, 1), np.nan)
        values[name] = out
    times_all = np.concatenate([head.times, tail.times])
    with np.errstate(invalid="ignore", divide="ignore"):
        times = np.bincount(inverse, weights=times_all * samples_all, minlength=len(unique)) / samples
    return _Trace(unique, samples, values, times)


def _series(
    sources: dict[str, Source], watermark_prefix: str, plan: Plan, windows: Sequence[Window],
    key_columns: Sequence[str], filters: Sequence[tuple[str, Sequence[int]]],
    metrics: dict[str, tuple[str, str, str]], names: Sequence[str], unique_per_bucket: bool = True,
    traces_hint: int = 1,
) -> dict[tuple, _Trace]:
    """Read ``windows`` from ``plan.level`` up to its watermark and finer levels after it, merged."""
    from telemetry.models import RollupWatermark

    marks = dict(
        RollupWatermark.objects.filter(level__startswith=watermark_prefix).values_list("level", "rolled_until")
    )
    with transaction.atomic():
        if _postgres():
            # Chart queries read few rows; parallel workers' start-up costs more than they save.
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL max_parallel_workers_per_gather = 0")
        return _read_levels(sources, marks, watermark_prefix, plan, windows, key_columns, filters, metrics,
                            names, unique_per_bucket, traces_hint)


def _read_levels(
    sources: dict[str, Source], marks: dict[str, datetime], watermark_prefix: str, plan: Plan,
    windows: Sequence[Window], key_columns: Sequence[str], filters: Sequence[tuple[str, Sequence[int]]],
    metrics: dict[str, tuple[str, str, str]], names: Sequence[str], unique_per_bucket: bool, traces_hint: int,
) -> dict[tuple, _Trace]:
    """The levels from ``plan.level`` down to raw, merged. A rollup level reads each window up to
    its watermark (``_split_at_level``); what is left goes to the next finer level. A finer
    level is skipped when what is left would exceed the row budget there (``traces_hint``
    series for a window without a key, raw at 1 Hz)."""
    traces: dict[tuple, _Trace] = {}
    level: str | None = plan.level
    pending = list(windows)
    while level is not None and pending:
        if level != plan.level:
            row_interval_s = RAW_SAMPLE_INTERVAL_S if level == "raw" else LEVEL_RESOLUTION_S[level]
            rows = sum((1 if w.key else traces_hint) * (_epoch(w.upper) - _epoch(w.lower)) for w in pending)
            if rows / row_interval_s > ROW_BUDGET:
                break  # a whole cluster's freshest tail: the chart ends at the coarser watermark
        if level == "raw":
            readable, pending = pending, []
        else:
            readable, pending = _split_at_level(pending, LEVEL_RESOLUTION_S[level],
                                                marks.get(f"{watermark_prefix}{level}"))
        if readable:
            part = _binned(sources[level], level, plan, readable, key_columns, filters, metrics, names,
                           unique_per_bucket)
            for key, trace in part.items():
                traces[key] = _merge(traces[key], trace, metrics) if key in traces else trace
        level = FINER.get(level)
    return traces


def _split_at_level(windows: Sequence[Window], resolution_s: int,
                    watermark: datetime | None) -> tuple[list[Window], list[Window]]:
    """Split ``windows`` into what a rollup level of ``resolution_s`` answers (up to its
    ``watermark``) and the rest, for a finer level.

    A keyed window (a span a job held a GPU) takes only the whole buckets inside it, so that no
    bucket mixes in another holder's readings: its part-buckets at either end go finer, a cheap
    range scan of one GPU each. A window of every series keeps buckets from its start, as a
    part-bucket at the start of a cluster chart is not worth a scan of the finer level's
    partition for every GPU.
    """
    readable: list[Window] = []
    rest: list[Window] = []
    for window in windows:
        if watermark is None:
            rest.append(window)
            continue
        if window.key:
            lower = _aligned(window.lower, resolution_s, up=True)
            upper = min(_aligned(window.upper, resolution_s, up=False), _aligned(watermark, resolution_s, up=False))
        else:
            lower, upper = window.lower, min(window.upper, watermark)
        if upper <= lower:
            rest.append(window)
            continue
        readable.append(Window(lower, upper, window.key))
        if window.lower < lower:
            rest.append(Window(window.lower, lower, window.key))
        if upper < window.upper:
            rest.append(Window(upper, window.upper, window.key))
    return readable, rest


def _trace_dict(trace: _Trace, plan: Plan, names: Iterable[str]) -> dict[str, list]:
    starts = (plan.origin_s + trace.bins * plan.bucket_s).astype(np.float64)
    out: dict[str, list] = {
        "t": starts.tolist(),
        # Inside its bucket: a rollup row's middle can pass the end of a bucket it starts in.
        "t_mean": np.clip(trace.times, starts, starts + plan.bucket_s).tolist(),
        "samples": trace.samples.astype(np.int64).tolist(),
    }
    for name in names:
        values = trace.values[name]
        out[name] = [None if math.isnan(v) else v for v in values.tolist()]
    return out


def _result(plan: Plan, start: datetime, end: datetime, traces: dict[str, dict]) -> dict[str, Any]:
    return {
        "level": plan.level,
        "bucket_s": plan.bucket_s,
        "start": start.isoformat(),
        "end": end.isoformat(),
        "traces": traces,
    }


# -- public API ------------------------------------------------------------------------------


def gpu_utilisation_series(
    *,
    start: datetime,
    end: datetime,
    max_points: int = 1000,
    node_ids: Sequence[int] | None = None,
    gpus: Sequence[tuple[int, int]] | None = None,
    job_id: int | None = None,
    metrics: Sequence[str] = DEFAULT_GPU_METRICS,
    now: datetime | None = None,
) -> dict[str, Any]:
    """One trace per GPU, keyed ``"<node name>/<gpu index>"``, over [start, end).

    Choose GPUs by ``node_ids`` (all their GPUs), explicit ``gpus`` ``(node_id, gpu_index)``
    pairs, or ``job_id``: every GPU the job held in the range, each only over the time it held
    it (its ``AllocationSpan``s; a job that held none has no traces). With none of them: every
    GPU that reported. ``metrics`` are any of util_pct (mean), util_max_pct, mem_used_bytes,
    power_w, temp_c. Each trace also has ``node``, ``node_name`` and ``gpu``.
    """
    from jobs.models import Node

    unknown = set(metrics) - set(GPU_METRICS)
    if unknown:
        raise ValueError(f"unknown GPU metrics: {sorted(unknown)}")
    if job_id is not None:
        return _job_gpu_series(job_id, start=start, end=end, max_points=max_points, metrics=metrics, now=now)
    wanted: set[tuple[int, int]] | None = None
    if gpus is not None:
        wanted = {(int(n), int(g)) for n, g in gpus}
    filters: list[tuple[str, Sequence[int]]] = []
    if wanted is not None:
        filters.append(("node_id", sorted({n for n, _ in wanted})))
        filters.append(("gpu_index", sorted({g for _, g in wanted})))
        gpu_count = len(wanted)
    else:
        nodes = Node.objects.filter(pk__in=node_ids) if node_ids is not None else Node.objects.all()
        sizes = nodes.aggregate(n=Sum("gpu_count"), most=Max("gpu_count"))
        gpu_count = sizes["n"] or 1
        if node_ids is not None:
            # gpu_index bounds too, so each GPU is a range scan of the (node, gpu, time) key
            # rather than a scan of the whole partition.
            filters.append(("node_id", sorted(set(node_ids))))
            filters.append(("gpu_index", list(range(sizes["most"] or 0))))
    plan = choose_plan(start, end, max_points, now=now, traces=gpu_count)
    traces = _series(GPU_SOURCES, "gpu-", plan, [Window(start, end)], ["node_id", "gpu_index"], filters, GPU_METRICS,
                     metrics, traces_hint=gpu_count)
    if wanted is not None:
        traces = {key: trace for key, trace in traces.items() if key in wanted}
    return _result(plan, start, end, _gpu_traces(traces, plan, metrics))


def _job_gpu_series(
    job_id: int, *, start: datetime, end: datetime, max_points: int, metrics: Sequence[str], now: datetime | None,
) -> dict[str, Any]:
    """``gpu_utilisation_series(job_id=...)``: each GPU over the spans the job held it in range."""
    windows = job_gpu_windows(job_id, start, end)
    # Rows to scan are GPU-seconds held, so a job that moved counts each GPU for its own time.
    held_s = sum(_epoch(w.upper) - _epoch(w.lower) for w in windows)
    plan = choose_plan(start, end, max_points, now=now,
                       traces=max(1, math.ceil(held_s / (_epoch(end) - _epoch(start)))))
    if not windows:
        return _result(plan, start, end, {})
    traces = _series(GPU_SOURCES, "gpu-", plan, windows, ["node_id", "gpu_index"], [], GPU_METRICS, metrics)
    return _result(plan, start, end, _gpu_traces(traces, plan, metrics))


def job_gpu_windows(job_id: int, start: datetime, end: datetime) -> list[Window]:
    """The time each GPU was the job's within [start, end), from its allocation spans: one
    window per stretch, keyed ``(node_id, gpu_index)``, overlapping or touching ones joined."""
    from jobs.models import AllocationSpan

    spans = (
        AllocationSpan.objects.filter(job_id=job_id).overlapping(start, end)
        .order_by("node_id", "gpu_index", "started_at").values_list("node_id", "gpu_index", "started_at", "ended_at")
    )
    windows: list[Window] = []
    for node_id, gpu_index, started_at, ended_at in spans:
        window = Window(max(start, started_at), min(end, ended_at or end), (node_id, gpu_index))
        if window.upper <= window.lower:
            continue
        last = windows[-1] if windows else None
        if last is not None and last.key == window.key and window.lower <= last.upper:
            windows[-1] = Window(last.lower, max(last.upper, window.upper), window.key)
        else:
            windows.append(window)
    return windows


def _gpu_traces(traces: dict[tuple, _Trace], plan: Plan, metrics: Sequence[str]) -> dict[str, dict]:
    """GPU traces keyed ``"<node name>/<gpu index>"``, in node name and index order."""
    from jobs.models import Node

    names = dict(Node.objects.filter(pk__in={k[0] for k in traces}).values_list("pk", "name"))
    out: dict[str, dict] = {}
    for (node_id, gpu_index), trace in sorted(traces.items(), key=lambda kv: (names.get(kv[0][0], ""), kv[0][1])):
        name = names.get(node_id, f"node-{node_id}")
        out[f"{name}/{gpu_index}"] = {
            "node": node_id, "node_name": name, "gpu": gpu_index, **_trace_dict(trace, plan, metrics)
        }
    return out


def cluster_utilisation(
    *, start: datetime, end: datetime, max_points: int = 1000, now: datetime | None = None,
) -> dict[str, Any]:
    """One trace ``"cluster"``: mean and max utilisation over every GPU that reported, per bucket."""
    from jobs.models import Node

    gpu_count = Node.objects.aggregate(n=Sum("gpu_count"))["n"] or 1
    plan = choose_plan(start, end, max_points, now=now, traces=gpu_count)
    names = ("util_pct", "util_max_pct")
    traces = _series(GPU_SOURCES, "gpu-", plan, [Window(start, end)], [], [], GPU_METRICS, names,
                     unique_per_bucket=False, traces_hint=gpu_count)
    out = {"cluster": _trace_dict(trace, plan, names) for trace in traces.values()}  # noqa: B035 - 0 or 1
    return _result(plan, start, end, out)


def step_series(
    job_id: int, *, start: datetime, end: datetime, max_points: int = 1000,
    metrics: Sequence[str] = DEFAULT_STEP_METRICS, now: datetime | None = None,
) -> dict[str, Any]:
    """One trace ``"job"`` of a job's step records over all ranks: latest step, mean and max
    step time (the max shows stragglers), data-wait/compute/communication means, loss, and on
    request ``tokens_<modality>`` (mean tokens per rank-step)."""
    unknown = set(metrics) - set(STEP_METRICS)
    if unknown:
        raise ValueError(f"unknown step metrics: {sorted(unknown)}")
    from jobs.models import Job

    ranks = Job.objects.filter(pk=job_id).values_list("tp", "pp", "dp").first()
    plan = choose_plan(start, end, max_points, now=now, traces=math.prod(ranks) if ranks else 1)
    traces = _series(STEP_SOURCES, "step-", plan, [Window(start, end)], [], [("job_id", [job_id])], STEP_METRICS,
                     metrics)
    out = {"job": _trace_dict(trace, plan, metrics) for trace in traces.values()}  # noqa: B035 - 0 or 1
    return _result(plan, start, end, out)


def latest_gpu_samples(
    *, node_ids: Sequence[int] | None = None, within_s: float = 120.0, now: datetime | None = None,
) -> dict[tuple[int, int], dict[str, Any]]:
    """The newest raw sample of each GPU reported in the last ``within_s`` seconds, keyed
    ``(node_id, gpu_index)`` (for the planner and page loads)."""
    now = now or datetime.now(UTC)
    since = _param(now - timedelta(seconds=within_s))
    where = "at >= %s"
    params: list[Any] = [since]
    if node_ids is not None:
        if not node_ids:
            return {}
        where += f" AND node_id IN ({', '.join(['%s'] * len(node_ids))})"
        params.extend(node_ids)
    sql = (
        "SELECT s.node_id, s.gpu_index, s.at, s.util_pct, s.mem_used_bytes, s.power_w, s.temp_c, s.xid_errors "
        "FROM telemetry_gpusample s JOIN ("
        f"  SELECT node_id, gpu_index, max(at) AS at FROM telemetry_gpusample WHERE {where} GROUP BY node_id, gpu_index"
        ") m ON s.node_id = m.node_id AND s.gpu_index = m.gpu_index AND s.at = m.at"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for node_id, gpu_index, at, util, mem, power, temp, xid in rows:
        if not _postgres():
            at = _sqlite_datetime(at)  # raw SQL on SQLite returns the stored text
        out[(node_id, gpu_index)] = {
            "at": at, "util_pct": util, "mem_used_bytes": mem, "power_w": power, "temp_c": temp,
            "xid_errors": xid,
        }
    return out


def _sqlite_datetime(value: Any) -> datetime:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    return datetime.fromisoformat(str(value)).replace(tzinfo=UTC)

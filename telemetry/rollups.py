"""1-minute and 1-hour rollups of GPU samples and step records, kept by a periodic task.

Each level has a watermark (``RollupWatermark``): buckets before it are computed. A pass
re-computes minutes from ``watermark - grace`` to the last closed minute (so samples up to
``OMNI_TELEMETRY_ROLLUP_GRACE_S`` late are counted), and closed hours once ``grace`` has passed
after their end. Both levels are computed from raw samples, so the hourly p95 is exact. Work is
one ``INSERT ... SELECT ... GROUP BY ... ON CONFLICT DO UPDATE`` per level and series;
PostgreSQL adds p95 by ``percentile_cont``, SQLite leaves it NULL. A first pass on a database
full of raw samples catches up a few hours per level per pass, not everything at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import connection, transaction

from telemetry.models import RollupWatermark
from telemetry.partitions import ensure_partitions, list_partitions, retention_for

logger = logging.getLogger(__name__)

LEVEL_SPAN = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1)}
MAX_CATCHUP = {"minute": timedelta(hours=6), "hour": timedelta(hours=24)}
PG_ORIGIN = "TIMESTAMPTZ '2000-01-01 00:00:00+00'"


@dataclass(frozen=True)
class Series:
    """One raw table and how its rows roll up."""

    name: str  # watermark prefix: "gpu" or "step"
    raw_table: str
    keys: tuple[str, ...]
    columns: tuple[str, ...]  # rollup columns after keys and bucket
    # rollup column -> SQL aggregate over the raw rows; {p95:col} is replaced per vendor
    aggregates: tuple[str, ...]


GPU = Series(
    name="gpu",
    raw_table="telemetry_gpusample",
    keys=("node_id", "gpu_index"),
    columns=(
        "samples", "util_mean_pct", "util_max_pct", "util_p95_pct", "mem_mean_bytes", "mem_max_bytes",
        "power_mean_w", "power_max_w", "temp_mean_c", "temp_max_c", "xid_errors_max",
    ),
    aggregates=(
        "count(*)", "avg(util_pct)", "max(util_pct)", "{p95:util_pct}", "CAST(avg(mem_used_bytes) AS bigint)",
        "max(mem_used_bytes)", "avg(power_w)", "max(power_w)", "avg(temp_c)", "max(temp_c)", "max(xid_errors)",
    ),
)
STEPS = Series(
    name="step",
    raw_table="telemetry_steprecord",
    keys=("job_id",),
    columns=(
        "records", "ranks", "step_max", "step_s_mean", "step_s_max", "step_s_p95", "data_wait_s_mean",
        "compute_s_mean", "comm_s_mean", "tokens_text_sum", "tokens_image_sum", "tokens_video_sum",
        "tokens_audio_sum", "loss_mean",
    ),
    aggregates=(
        "count(*)", "count(DISTINCT rank)", "max(step)", "avg(step_s)", "max(step_s)", "{p95:step_s}",
        "avg(data_wait_s)", "avg(compute_s)", "avg(comm_s)", "sum(tokens_text)", "sum(tokens_image)",
        "sum(tokens_video)", "sum(tokens_audio)", "avg(loss)",
    ),
)
SERIES = (GPU, STEPS)


@dataclass
class RollupReport:
    """The windows one pass computed, per ``<series>-<level>``."""

    windows: dict[str, tuple[datetime, datetime]] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)


def _floor(at: datetime, level: str) -> datetime:
    at = at.astimezone(UTC)
    if level == "minute":
        return at.replace(second=0, microsecond=0)
    return at.replace(minute=0, second=0, microsecond=0)


def rollup_sql(series: Series, level: str) -> str:
    """The upsert that rolls raw rows in [%s, %s) into ``series``'s ``level`` table."""
    postgres = connection.vendor == "postgresql"
    table = f"telemetry_{series.name}{level}"
    if postgres:
        bucket = f"date_bin('1 {level}', at, {PG_ORIGIN})"
    else:
        bucket = "strftime('%%Y-%%m-%%d %%H:%%M:00', at)" if level == "minute" else "strftime('%%Y-%%m-%%d %%H:00:00', at)"
    aggregates = []
    for expr in series.aggregates:
        if expr.startswith("{p95:"):
            column = expr[5:-1]
            expr = f"percentile_cont(0.95) WITHIN GROUP (ORDER BY {column})" if postgres else "NULL"
        aggregates.append(expr)
    keys = ", ".join(series.keys)
    columns = ", ".join([*series.keys, "bucket", *series.columns])
    updates = ", ".join(f"{c} = excluded.{c}" for c in series.columns)
    return (
        f"INSERT INTO {table} ({columns}) "
        f"SELECT {keys}, {bucket} AS bucket, {', '.join(aggregates)} FROM {series.raw_table} "
        f"WHERE at >= %s AND at < %s GROUP BY {keys}, bucket "
        f"ON CONFLICT ({keys}, bucket) DO UPDATE SET {updates}"
    )


def roll_up_window(series: Series, level: str, start: datetime, end: datetime) -> int:
    """Compute ``level`` buckets of ``series`` for raw rows in [start, end); returns rows written."""
    with transaction.atomic(), connection.cursor() as cursor:
        ensure_partitions(f"telemetry_{series.name}{level}", start, end - timedelta(microseconds=1))
        adapt = connection.ops.adapt_datetimefield_value
        cursor.execute(rollup_sql(series, level), [adapt(start), adapt(end)])
        return max(cursor.rowcount, 0)


def _oldest_raw(series: Series) -> datetime | None:
    """Where a first pass starts: the oldest raw partition (PostgreSQL) or row (SQLite)."""
    if connection.vendor == "postgresql":
        found = list_partitions(series.raw_table)
        return found[0][1] if found else None
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT min(at) FROM {series.raw_table}")
        oldest = cursor.fetchone()[0]
    if oldest is None:
        return None
    oldest = datetime.fromisoformat(str(oldest))
    return oldest if oldest.tzinfo else oldest.replace(tzinfo=UTC)


def roll_up(now: datetime | None = None) -> RollupReport:
    """One pass over every series and level (the periodic ``telemetry.roll_up`` task)."""
    now = now or datetime.now(UTC)
    grace = timedelta(seconds=settings.OMNI_TELEMETRY_ROLLUP_GRACE_S)
    raw_keep = retention_for("raw") or timedelta(days=365)
    report = RollupReport()
    for series in SERIES:
        for level in ("minute", "hour"):
            label = f"{series.name}-{level}"
            mark = RollupWatermark.objects.filter(level=label).values_list("rolled_until", flat=True).first()
            if mark is None:
                oldest = _oldest_raw(series)
                start = oldest if oldest is not None else now
            else:
                start = mark - grace if level == "minute" else mark
            end = _floor(now, "minute") if level == "minute" else _floor(now - grace, "hour")
            start = max(_floor(start, level), _floor(now - raw_keep, level))
            end = min(end, start + MAX_CATCHUP[level])
            if end <= start:
                continue
            report.rows[label] = roll_up_window(series, level, start, end)
            report.windows[label] = (start, end)
            if mark is None or end > mark:
                RollupWatermark.objects.update_or_create(level=label, defaults={"rolled_until": end})
    logger.debug("telemetry rollups: %s", report.rows)
    return report

"""Time partitions of the telemetry tables on PostgreSQL, and retention for both vendors.

Raw samples, step records and 1-minute rollups live in daily partitions, hourly rollups in
monthly ones, named ``<table>_pYYYYMMDD`` after the first day they hold. Partitions are created
ahead by the periodic ``telemetry.maintain_partitions`` task and on demand by ingestion (a batch
for a day with no partition creates it in its own transaction). Retention drops whole
partitions whose upper bound is older than the table's retention: no row-by-row DELETE, no
bloat, no vacuum debt. Embedded SQLite has no partitions and deletes old rows instead.

On PostgreSQL both go through the SECURITY DEFINER functions of migration 0002,
``omni_telemetry_create_partition`` and ``omni_telemetry_drop_partition``, whoever the caller
is: the restricted application role of ``grant_app_role`` may not create or drop tables itself
(docs/audit-log.md), and the tables' owner takes the same path.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from django.conf import settings
from django.db import connection, transaction

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartitionedTable:
    """A telemetry table, its time column, its partition span and the setting for its retention."""

    name: str
    time_column: str
    monthly: bool
    retention: str  # "raw", "minute" or "hour"


TABLES: tuple[PartitionedTable, ...] = (
    PartitionedTable("telemetry_gpusample", "at", False, "raw"),
    PartitionedTable("telemetry_steprecord", "at", False, "raw"),
    PartitionedTable("telemetry_gpuminute", "bucket", False, "minute"),
    PartitionedTable("telemetry_stepminute", "bucket", False, "minute"),
    PartitionedTable("telemetry_gpuhour", "bucket", True, "hour"),
    PartitionedTable("telemetry_stephour", "bucket", True, "hour"),
)
TABLES_BY_NAME = {table.name: table for table in TABLES}
_PARTITION_NAME = re.compile(r"^(?P<parent>telemetry_[a-z]+)_p(?P<day>\d{8})$")

# Partitions this process knows exist (committed). Only ever a cache: a miss costs one
# ``CREATE TABLE IF NOT EXISTS``; retention removes what it drops.
_known: set[str] = set()
_known_lock = threading.Lock()


def retention_for(kind: str) -> timedelta | None:
    """How long rows of a retention class are kept; None is forever."""
    if kind == "raw":
        return timedelta(hours=settings.OMNI_TELEMETRY_RAW_RETENTION_H)
    if kind == "minute":
        return timedelta(days=settings.OMNI_TELEMETRY_MINUTE_RETENTION_D)
    days = settings.OMNI_TELEMETRY_HOUR_RETENTION_D
    return timedelta(days=days) if days else None


def partition_bounds(table: PartitionedTable, at: datetime) -> tuple[datetime, datetime]:
    """The [start, end) of the partition of ``table`` that holds time ``at`` (UTC)."""
    day = at.astimezone(UTC).date()
    if table.monthly:
        start = date(day.year, day.month, 1)
        end = date(day.year + day.month // 12, day.month % 12 + 1, 1)
    else:
        start, end = day, day + timedelta(days=1)
    return (
        datetime(start.year, start.month, start.day, tzinfo=UTC),
        datetime(end.year, end.month, end.day, tzinfo=UTC),
    )


def partition_name(table: PartitionedTable, start: datetime) -> str:
    return f"{table.name}_p{start:%Y%m%d}"


def _create_partition(cursor, table: PartitionedTable, start: datetime, end: datetime) -> str:
    # CREATE TABLE IF NOT EXISTS ... PARTITION OF, as the tables' owner (migration 0002).
    cursor.execute("SELECT omni_telemetry_create_partition(%s, %s, %s)", [table.name, start, end])
    return cursor.fetchone()[0]


def _drop_partition(cursor, name: str) -> None:
    # DETACH PARTITION then DROP TABLE, as the tables' owner (migration 0002).
    cursor.execute("SELECT omni_telemetry_drop_partition(%s)", [name])


def ensure_partitions(table_name: str, first: datetime, last: datetime) -> list[str]:
    """Make sure partitions of ``table_name`` cover [first, last] (PostgreSQL; no-op on SQLite).

    Runs inside the caller's transaction, so a partition made for a batch that is then rolled
    back disappears with it; the cache learns of it only after commit.
    """
    if connection.vendor != "postgresql":
        return []
    table = TABLES_BY_NAME[table_name]
    made: list[str] = []
    start, end = partition_bounds(table, first)
    with connection.cursor() as cursor:
        locked = False
        while start <= last:
            name = partition_name(table, start)
            if name not in _known:
                if not locked:
                    # Two transactions creating the same partition at once would both pass
                    # IF NOT EXISTS and one would fail with DuplicateTable: serialise creators
                    # per table until commit (rare: only when a new partition is needed).
                    cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"omni-partitions:{table.name}"])
                    locked = True
                _create_partition(cursor, table, start, end)
                made.append(name)
            start, end = partition_bounds(table, end)
    if made:
        transaction.on_commit(lambda: _remember(made))
    return made


def _remember(names: list[str]) -> None:
    with _known_lock:
        _known.update(names)


def forget_known_partitions() -> None:
    """Empty the cache (tests that drop partitions behind this process's back)."""
    with _known_lock:
        _known.clear()


def list_partitions(table_name: str) -> list[tuple[str, datetime]]:
    """(partition name, start of its range) of ``table_name``, oldest first."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = %s",
            [table_name],
        )
        names = [row[0] for row in cursor.fetchall()]
    found: list[tuple[str, datetime]] = []
    for name in names:
        match = _PARTITION_NAME.match(name)
        if match and match["parent"] == table_name:
            found.append((name, datetime.strptime(match["day"], "%Y%m%d").replace(tzinfo=UTC)))
    return sorted(found, key=lambda item: item[1])


@dataclass
class MaintenanceReport:
    """What one maintenance pass created and dropped (or, on SQLite, how many rows it deleted)."""

    created: list[str]
    dropped: list[str]
    deleted_rows: int = 0


def maintain(now: datetime | None = None) -> MaintenanceReport:
    """Create partitions ahead of ``now`` and enforce retention. Idempotent; safe to run often."""
    now = now or datetime.now(UTC)
    if connection.vendor != "postgresql":
        return MaintenanceReport(created=[], dropped=[], deleted_rows=_delete_expired_rows(now))
    ahead = timedelta(days=settings.OMNI_TELEMETRY_PARTITIONS_AHEAD_D)
    created: list[str] = []
    dropped: list[str] = []
    for table in TABLES:
        with transaction.atomic():
            created += ensure_partitions(table.name, now - timedelta(days=1), now + ahead)
        keep = retention_for(table.retention)
        if keep is None:
            continue
        cutoff = now - keep
        for name, start in list_partitions(table.name):
            _, end = partition_bounds(table, start)
            if end <= cutoff:
                with transaction.atomic(), connection.cursor() as cursor:
                    _drop_partition(cursor, name)
                dropped.append(name)
                with _known_lock:
                    _known.discard(name)
    if created or dropped:
        logger.info("telemetry partitions: created %s, dropped %s", created, dropped)
    return MaintenanceReport(created=created, dropped=dropped)


def _delete_expired_rows(now: datetime) -> int:
    """Embedded SQLite: retention by DELETE (small data, no partitions)."""
    deleted = 0
    with transaction.atomic(), connection.cursor() as cursor:
        for table in TABLES:
            keep = retention_for(table.retention)
            if keep is None:
                continue
            cutoff = connection.ops.adapt_datetimefield_value(now - keep)
            cursor.execute(f"DELETE FROM {table.name} WHERE {table.time_column} < %s", [cutoff])
            deleted += max(cursor.rowcount, 0)
    return deleted

"""Time partitions (PostgreSQL): created on demand and ahead, dropped whole past retention."""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, connections, transaction
from django.test import override_settings

from telemetry import partitions
from telemetry.ingest import ingest_gpu_batch
from telemetry.models import GpuSample
from tests.telemetry.conftest import gpu_batch


def _tables() -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT relname FROM pg_class WHERE relname LIKE 'telemetry_%%'")
        return {row[0] for row in cursor.fetchall()}


@pytest.mark.postgres
@pytest.mark.django_db
def test_ingest_creates_the_partition_of_the_batch_day(node):
    ingest_gpu_batch(node, gpu_batch(samples=8))
    table = partitions.TABLES_BY_NAME["telemetry_gpusample"]
    start, _ = partitions.partition_bounds(table, datetime.now(UTC) - timedelta(seconds=2))
    name = partitions.partition_name(table, start)
    assert name in _tables()
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {name}")
        assert cursor.fetchone()[0] == 8


@pytest.mark.postgres
@pytest.mark.django_db
def test_maintenance_creates_partitions_ahead_and_drops_expired_ones_whole():
    now = datetime(2026, 6, 15, 12, 0, tzinfo=UTC)
    report = partitions.maintain(now)
    assert "telemetry_gpusample_p20260618" in report.created  # 3 days ahead by default
    assert "telemetry_gpuhour_p20260601" in report.created  # monthly
    # A partition from 10 days earlier holds a row; raw retention is 48 h, so it goes.
    with transaction.atomic():
        partitions.ensure_partitions("telemetry_gpusample", now - timedelta(days=10), now - timedelta(days=10))
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO telemetry_gpusample (node_id, gpu_index, at, util_pct, mem_used_bytes) "
                "VALUES (1, 0, %s, 1, 1)", [now - timedelta(days=10)]
            )
    assert "telemetry_gpusample_p20260605" in _tables()
    report = partitions.maintain(now)
    assert "telemetry_gpusample_p20260605" in report.dropped
    assert "telemetry_gpusample_p20260605" not in _tables()
    assert "telemetry_gpusample_p20260614" in _tables()  # yesterday: inside 48 h
    assert not GpuSample.objects.filter(at__lt=now - timedelta(days=5)).exists()
    # 1-minute rollups keep 30 days, hourly ones forever.
    with override_settings(OMNI_TELEMETRY_MINUTE_RETENTION_D=1):
        later = partitions.maintain(now + timedelta(days=3))
    assert "telemetry_gpuminute_p20260614" in later.dropped
    assert not any(name.startswith("telemetry_gpuhour") for name in later.dropped)


@pytest.mark.django_db
def test_sqlite_retention_deletes_old_rows(node):
    if connection.vendor == "postgresql":
        pytest.skip("PostgreSQL drops partitions (tested above)")
    ingest_gpu_batch(node, gpu_batch(samples=8))
    partitions.maintain(datetime.now(UTC) + timedelta(hours=49))
    assert GpuSample.objects.count() == 0


# -- as the restricted application role of grant_app_role (docs/audit-log.md) ------------------------


@pytest.fixture
def app_role(transactional_db):
    """A role prepared by ``grant_app_role``: DML only, no CREATE on the schema, owns no table."""
    from django.core.management import call_command

    role = f"omni_test_tele_{os.getpid()}"
    with connection.cursor() as cursor:
        cursor.execute(f"DROP ROLE IF EXISTS {role}")
        cursor.execute(f"CREATE ROLE {role} LOGIN")
    call_command("grant_app_role", role)
    yield role
    with connection.cursor() as cursor:
        cursor.execute(f"DROP OWNED BY {role}")
        cursor.execute(f"DROP ROLE {role}")


@contextmanager
def _as_role(role: str):
    """Run the application's own code as ``role``: a Django connection standing in for the default."""
    owner = connections["default"]
    app = owner.__class__({**owner.settings_dict, "USER": role, "PASSWORD": ""}, "default")
    connections["default"] = app
    try:
        yield app
    finally:
        app.close()
        connections["default"] = owner


def _raw_as_role(role: str):
    """A bare autocommit psycopg connection as ``role``, for SQL the application never sends."""
    import psycopg

    params = connections["default"].get_connection_params()
    params.update(user=role, password="")
    return psycopg.connect(**{k: v for k, v in params.items() if k != "cursor_factory"}, autocommit=True)


def _drop_if_there(name: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {name}")
    partitions.forget_known_partitions()


@pytest.mark.postgres
def test_the_app_role_ingests_a_sample_for_a_day_without_a_partition(app_role, node):
    table = partitions.TABLES_BY_NAME["telemetry_gpusample"]
    start, _ = partitions.partition_bounds(table, datetime.now(UTC) - timedelta(seconds=2))
    name = partitions.partition_name(table, start)
    _drop_if_there(name)  # earlier tests made today's partition as the owner
    with _as_role(app_role) as app:
        result = ingest_gpu_batch(node, gpu_batch(samples=8))
        with app.cursor() as cursor:
            cursor.execute("SELECT current_user")
            assert cursor.fetchone()[0] == app_role
    assert result.accepted == 8
    assert name in _tables()
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {name}")
        assert cursor.fetchone()[0] == 8
        cursor.execute("SELECT tableowner FROM pg_tables WHERE tablename = %s", [name])
        assert cursor.fetchone()[0] == connection.settings_dict["USER"]  # made by the functions' owner


@pytest.mark.postgres
def test_the_app_role_creates_partitions_ahead_and_drops_expired_ones(app_role):
    now = datetime(2025, 2, 10, 12, 0, tzinfo=UTC)
    old = "telemetry_gpusample_p20250131"
    for name in (old, "telemetry_gpusample_p20250213", "telemetry_gpuhour_p20250201"):
        _drop_if_there(name)
    with _as_role(app_role):
        with transaction.atomic():
            assert partitions.ensure_partitions("telemetry_gpusample", now - timedelta(days=10),
                                                now - timedelta(days=10)) == [old]
            with connection.cursor() as cursor:
                cursor.execute("INSERT INTO telemetry_gpusample (node_id, gpu_index, at, util_pct, mem_used_bytes) "
                               "VALUES (1, 0, %s, 1, 1)", [now - timedelta(days=10)])
        report = partitions.maintain(now)
    assert "telemetry_gpusample_p20250213" in report.created
    assert "telemetry_gpuhour_p20250201" in report.created  # monthly
    assert old in report.dropped
    tables = _tables()
    assert old not in tables and "telemetry_gpusample_p20250213" in tables


def _catalog() -> set[tuple[str, str]]:
    """Every table of the schema and its kind: what a refused call must leave unchanged."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT relname, relkind FROM pg_class WHERE relnamespace = current_schema()::regnamespace "
                       "AND relkind IN ('r', 'p')")
        return set(cursor.fetchall())


@pytest.mark.postgres
@pytest.mark.parametrize("call, args", [
    ("create", ["jobs_elasticevent", "2025-03-01T00:00Z", "2025-03-02T00:00Z"]),
    ("create", ["telemetry_gpusample; DROP TABLE jobs_elasticevent", "2025-03-01T00:00Z", "2025-03-02T00:00Z"]),
    ("create", ['telemetry_gpusample"', "2025-03-01T00:00Z", "2025-03-02T00:00Z"]),
    ("create", ["telemetry_gpusample", "2025-03-01T06:00Z", "2025-03-02T06:00Z"]),  # not from midnight UTC
    ("create", ["telemetry_gpusample", "2025-03-01T00:00Z", "2025-03-08T00:00Z"]),  # not one day
    ("create", ["telemetry_gpuhour", "2025-03-01T00:00Z", "2025-03-02T00:00Z"]),  # hourly rollups: one month
    ("create", ["telemetry_gpusample", None, None]),
    ("drop", ["jobs_elasticevent"]),
    ("drop", ["telemetry_gpusample"]),  # the parent itself
    ("drop", ["telemetry_gpusample_p20250301; DROP TABLE jobs_elasticevent"]),
    ("drop", ["telemetry_gpusample_p2025'0301"]),
    ("drop", ['telemetry_gpusample_p20250301"']),
    ("drop", ["jobs_elasticevent_p20250301"]),
    ("drop", ["telemetry_gpusample_p20250301"]),  # well formed, but no such partition
    ("drop", ["telemetry_gpuhour_p20250301"]),  # exists below, but as a partition of another table
    ("drop", ["telemetry_gpusample_p20991231"]),  # exists below, but a plain table
    ("drop", [None]),
])
def test_the_partition_functions_refuse_what_is_not_ours(app_role, call, args):
    import psycopg

    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS telemetry_gpusample_p20991231, telemetry_gpuhour_p20250301")
        cursor.execute("CREATE TABLE telemetry_gpusample_p20991231 (id integer)")
        cursor.execute("CREATE TABLE telemetry_gpuhour_p20250301 PARTITION OF telemetry_stephour "
                       "FOR VALUES FROM ('2040-01-01T00:00Z') TO ('2040-02-01T00:00Z')")
    before = _catalog()
    sql = {"create": "SELECT omni_telemetry_create_partition(%s, %s, %s)",
           "drop": "SELECT omni_telemetry_drop_partition(%s)"}[call]
    try:
        with _raw_as_role(app_role) as raw:
            with pytest.raises(psycopg.errors.InvalidParameterValue):
                raw.execute(sql, args)
        assert _catalog() == before
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE telemetry_gpusample_p20991231, telemetry_gpuhour_p20250301")


@pytest.mark.postgres
def test_the_app_role_runs_the_functions_but_still_cannot_create_or_drop_tables(app_role):
    import psycopg

    signature = "omni_telemetry_create_partition(text, timestamptz, timestamptz)"
    with connection.cursor() as cursor:
        cursor.execute("SELECT has_function_privilege(%s, %s, 'EXECUTE'), "
                       "has_function_privilege('public', %s, 'EXECUTE'), "
                       "has_function_privilege(%s, 'omni_telemetry_drop_partition(text)', 'EXECUTE'), "
                       "has_schema_privilege(%s, current_schema(), 'CREATE')",
                       [app_role, signature, signature, app_role, app_role])
        assert cursor.fetchone() == (True, False, True, False)
        cursor.execute("SELECT bool_and(prosecdef), bool_and('search_path=pg_catalog, pg_temp' = ANY(proconfig)) "
                       "FROM pg_proc WHERE proname LIKE 'omni_telemetry_%%_partition'")
        assert cursor.fetchone() == (True, True)
    with transaction.atomic():
        partitions.ensure_partitions("telemetry_gpusample", datetime(2025, 2, 13, tzinfo=UTC), datetime(2025, 2, 13, tzinfo=UTC))
    before = _catalog()
    with _raw_as_role(app_role) as raw:
        for sql in ("CREATE TABLE telemetry_gpusample_p20990101 PARTITION OF telemetry_gpusample "
                    "FOR VALUES FROM ('2099-01-01T00:00Z') TO ('2099-01-02T00:00Z')",
                    "CREATE TABLE omni_scratch (id integer)",
                    "DROP TABLE jobs_elasticevent",
                    "ALTER TABLE telemetry_gpusample DETACH PARTITION telemetry_gpusample_p20250213"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied|must be owner"):
                raw.execute(sql)
    assert _catalog() == before

"""The audit chain is anchored outside the database: someone who can write the table but holds
neither the audit key nor the heads file cannot rewrite, re-chain or truncate it unseen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection, connections, transaction

from jobs.audit import compute_hash, publish_head, record_event, verify_chain, verify_heads
from jobs.models import ElasticEvent

KEY = "k" * 40
VERIFIER = Path(__file__).resolve().parents[2] / "tools" / "verify_audit_export.py"


@pytest.fixture(autouse=True)
def _heads_file(tmp_path, settings):
    settings.OMNI_AUDIT_HEADS = tmp_path / "audit-heads.jsonl"
    settings.OMNI_AUDIT_KEY = None
    return settings.OMNI_AUDIT_HEADS


def _events(n: int) -> list[ElasticEvent]:
    rows = []
    for i in range(n):
        with transaction.atomic():
            rows.append(record_event("cordon", actor="olive", reason={"rule": "cordon", "text": f"n{i}"}))
    return rows


def _sql(sql: str, params: list) -> None:
    """Write behind the application's back, as someone with the database's credentials would."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET session_replication_role = replica")  # bypasses the trigger
        cursor.execute(sql, params)
        if connection.vendor == "postgresql":
            cursor.execute("SET session_replication_role = DEFAULT")


def _rewrite_and_rechain(rows: list[ElasticEvent], index: int, *, mac: str | None = None) -> None:
    """Change one row's actor and re-chain every row after it with the project's own hash function."""
    prev = rows[index].prev_hash
    for i, row in enumerate(rows[index:], start=index):
        row = ElasticEvent.objects.get(pk=row.pk)
        if i == index:
            row.actor = "mallory"
        row.prev_hash = prev
        row.hash = compute_hash(row)
        _sql("UPDATE jobs_elasticevent SET actor = %s, prev_hash = %s, hash = %s, mac = %s WHERE id = %s",
             [row.actor, row.prev_hash, row.hash, row.mac if mac is None else mac, row.pk])
        prev = row.hash


@pytest.mark.django_db
def test_rewriting_a_row_and_rechaining_verifies_without_the_key_but_not_with_it(settings):
    settings.OMNI_AUDIT_KEY = KEY
    rows = _events(5)
    assert all(len(row.mac) == 64 for row in rows)
    _rewrite_and_rechain(rows, 2)
    assert verify_chain().ok  # the hash chain alone is fooled
    report = verify_chain(key=KEY.encode())
    assert report.first_bad_id == rows[2].id and "MAC does not match" in report.problem


@pytest.mark.django_db
def test_stripping_the_macs_of_rechained_rows_is_a_break(settings):
    settings.OMNI_AUDIT_KEY = KEY
    rows = _events(4)
    _rewrite_and_rechain(rows, 1, mac="")
    report = verify_chain(key=KEY.encode())
    assert report.first_bad_id == rows[1].id and "no MAC though rows before it do" in report.problem


@pytest.mark.django_db
def test_rows_written_before_the_key_are_counted_not_refused(settings, capsys):
    _events(2)
    settings.OMNI_AUDIT_KEY = KEY
    _events(3)
    report = verify_chain(key=KEY.encode())
    assert report.ok and report.rows_checked == 5 and report.rows_before_key == 2
    call_command("verify_audit")
    assert "2 leading rows have no MAC" in capsys.readouterr().out


@pytest.mark.django_db
def test_deleting_the_last_50_rows_after_a_publication_is_reported(_heads_file, capsys):
    rows = _events(60)
    head = publish_head()
    assert head["id"] == rows[-1].id and head["rows"] == 60
    assert publish_head() is None  # unmoved: nothing appended
    assert len(_heads_file.read_text().splitlines()) == 1
    _sql("DELETE FROM jobs_elasticevent WHERE id > %s", [rows[9].id])
    assert verify_chain().ok  # the chain alone cannot see a shorter end
    with pytest.raises(SystemExit) as info:
        call_command("verify_audit", "--heads", str(_heads_file))
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert f"the chain ends at row {rows[9].id} but a head published at {head['at']} names row {rows[-1].id}" in err


@pytest.mark.django_db
def test_a_row_rewritten_after_a_publication_no_longer_matches_its_head(_heads_file):
    rows = _events(3)
    publish_head()
    _rewrite_and_rechain(rows, 1)
    assert verify_chain().ok
    report = verify_heads(_heads_file)
    assert report.problems == [f"row {rows[-1].id}'s hash is not the one published at "
                               f"{json.loads(_heads_file.read_text())['at']}: the chain was rewritten after "
                               f"that publication"]


@pytest.mark.django_db
def test_a_head_line_with_a_bad_mac_is_reported(_heads_file, settings, capsys):
    settings.OMNI_AUDIT_KEY = KEY
    _events(2)
    head = publish_head(key=KEY.encode())
    third = _events(1)[0]
    forged = {**head, "id": third.id, "hash": third.hash, "rows": 3}  # the old MAC over new fields
    with open(_heads_file, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(forged) + "\n")
    assert verify_heads(_heads_file).ok  # without the key the line looks fine
    problems = verify_heads(_heads_file, key=KEY.encode()).problems
    assert len(problems) == 1 and "line 2" in problems[0] and "bad MAC" in problems[0]
    with pytest.raises(SystemExit):
        call_command("verify_audit")
    assert "bad MAC" in capsys.readouterr().err


@pytest.mark.django_db(transaction=True)
def test_the_periodic_loop_publishes_the_head(_heads_file):
    from omniweb.loop import InProcessLoop
    from omniweb.scheduled import PERIODIC_TASKS

    task = next(t for t in PERIODIC_TASKS if t.name == "jobs.publish_audit_head")
    assert task.interval_s == 300.0
    rows = _events(2)
    loop = InProcessLoop([task])
    loop.run_once(task)
    loop.run_once(task)
    assert loop.runs[task.name] == 2
    lines = [json.loads(line) for line in _heads_file.read_text().splitlines()]
    assert [(line["id"], line["hash"], line["rows"]) for line in lines] == [(rows[-1].id, rows[-1].hash, 2)]


@pytest.mark.django_db
def test_the_export_carries_macs_the_standalone_verifier_checks(auditor, settings, tmp_path):
    from django.test import Client

    settings.OMNI_AUDIT_KEY = KEY
    _events(3)
    client = Client()
    client.force_login(auditor)
    rows = json.loads(b"".join(client.get("/audit/export.json").streaming_content))
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    export = tmp_path / "export.json"

    def verify() -> subprocess.CompletedProcess:
        export.write_text(json.dumps(rows))
        return subprocess.run([sys.executable, "-I", str(VERIFIER), str(export), "--complete", "--key-file",
                               str(key_file)], capture_output=True, text=True, check=False)

    run = verify()
    assert run.returncode == 0 and "MACs match" in run.stdout, run.stderr
    rows[1]["mac"] = "0" * 64
    run = verify()
    assert run.returncode == 1 and f"row {rows[1]['id']}: its MAC does not match" in run.stderr


# -- the application's role on PostgreSQL may only SELECT and INSERT the audit table ---------------


@pytest.fixture
def app_role(transactional_db):
    role = f"omni_test_app_{os.getpid()}"
    with connection.cursor() as cursor:
        cursor.execute(f"DROP ROLE IF EXISTS {role}")
        cursor.execute(f"CREATE ROLE {role} LOGIN")
    yield role
    with connection.cursor() as cursor:
        cursor.execute(f"DROP OWNED BY {role}")
        cursor.execute(f"DROP ROLE {role}")


def _as_role(role: str):
    """A Django connection to the test database as ``role``, standing in for the default one."""
    owner = connections["default"]
    return owner.__class__({**owner.settings_dict, "USER": role, "PASSWORD": ""}, "default")


@pytest.mark.postgres
def test_the_app_role_appends_but_cannot_rewrite_or_unprotect_the_audit_log(app_role, make_job):
    import psycopg

    call_command("grant_app_role", app_role)
    job = make_job(name="granted")
    owner = connections["default"]
    app = _as_role(app_role)
    connections["default"] = app
    try:
        with transaction.atomic():  # the application's own write path, as the app role
            event = record_event("cordon", job=job, actor="olive")
        with app.cursor() as cursor:
            cursor.execute("SELECT current_user")
            assert cursor.fetchone()[0] == app_role
    finally:
        app.close()
        connections["default"] = owner
    assert verify_chain().ok and ElasticEvent.objects.filter(pk=event.pk).exists()

    params = owner.get_connection_params()
    params.update(user=app_role, password="")
    with psycopg.connect(**{k: v for k, v in params.items() if k != "cursor_factory"}, autocommit=True) as raw:
        for sql in ("UPDATE jobs_elasticevent SET actor = 'mallory'",
                    "DELETE FROM jobs_elasticevent",
                    "TRUNCATE jobs_elasticevent",
                    "ALTER TABLE jobs_elasticevent DISABLE TRIGGER elasticevent_append_only",
                    "SET session_replication_role = replica"):
            # "permission denied" / "must be owner": the privilege refuses it, not the trigger.
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied|must be owner"):
                raw.execute(sql)
        raw.execute("UPDATE jobs_job SET priority = priority WHERE id = %s", [job.pk])
        assert raw.execute("SELECT count(*) FROM jobs_elasticevent").fetchone()[0] >= 2


@pytest.mark.postgres
def test_migrate_regrants_the_app_role(app_role, settings):
    from django.core.management.sql import emit_post_migrate_signal

    with connection.cursor() as cursor:
        partition_functions = ("has_function_privilege(%s, 'omni_telemetry_create_partition(text, timestamptz, "
                               "timestamptz)', 'EXECUTE'), has_function_privilege(%s, "
                               "'omni_telemetry_drop_partition(text)', 'EXECUTE')")
        cursor.execute(f"SELECT has_table_privilege(%s, 'jobs_job', 'UPDATE'), {partition_functions}", [app_role] * 3)
        assert cursor.fetchone() == (False, False, False)
        settings.OMNI_APP_DB_ROLE = app_role
        emit_post_migrate_signal(verbosity=0, interactive=False, db="default")
        settings.OMNI_APP_DB_ROLE = None  # the teardown's flush migrates again, after the role is gone
        cursor.execute("SELECT has_table_privilege(%s, 'jobs_job', 'UPDATE'), "
                       "has_table_privilege(%s, 'jobs_elasticevent', 'INSERT'), "
                       f"has_table_privilege(%s, 'jobs_elasticevent', 'UPDATE'), {partition_functions}",
                       [app_role] * 5)
        assert cursor.fetchone() == (True, True, False, True, True)


@pytest.mark.postgres
@pytest.mark.django_db
def test_grant_app_role_refuses_a_superuser():
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="superuser, which no grant can restrict"):
        call_command("grant_app_role", connection.settings_dict["USER"])



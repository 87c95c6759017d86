"""The audit log is append-only and hash-chained: forgeries and deletions are found."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection, transaction

from jobs.audit import GENESIS_HASH, record_event, verify_chain
from jobs.models import ElasticEvent

pytestmark = pytest.mark.django_db


def _events(n: int) -> list[ElasticEvent]:
    rows = []
    for i in range(n):
        with transaction.atomic():
            rows.append(record_event(
                "cordon", actor="olive", nodes_before=[f"n{i}"],
                reason={"rule": "cordon", "text": f"cordoned n{i}", "inputs": {"ratio": 0.1 * i, "big": 1e3}},
            ))
    return rows


def _forge(sql: str, params: list) -> None:
    """Change rows behind the application's back, as an attacker with SQL access would."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET session_replication_role = replica")  # bypasses the trigger
        cursor.execute(sql, params)
        if connection.vendor == "postgresql":
            cursor.execute("SET session_replication_role = DEFAULT")


def test_rows_chain_from_genesis_and_verify():
    rows = _events(5)
    assert rows[0].prev_hash == GENESIS_HASH
    assert all(b.prev_hash == a.hash for a, b in zip(rows, rows[1:], strict=False))
    report = verify_chain(chunk_size=2)
    assert report.ok and report.rows_checked == 5 and report.last_good_id == rows[-1].id


def test_a_forged_row_is_named_by_verify():
    rows = _events(5)
    _forge("UPDATE jobs_elasticevent SET actor = %s WHERE id = %s", ["mallory", rows[2].id])
    report = verify_chain()
    assert not report.ok
    assert report.first_bad_id == rows[2].id and report.last_good_id == rows[1].id
    assert "contents" in report.problem


def test_a_deleted_row_breaks_the_link_of_the_next():
    rows = _events(4)
    _forge("DELETE FROM jobs_elasticevent WHERE id = %s", [rows[1].id])
    report = verify_chain()
    assert report.first_bad_id == rows[2].id and "prev_hash" in report.problem


def test_verify_audit_command_exit_status(capsys):
    rows = _events(3)
    call_command("verify_audit")
    assert "3 rows verified" in capsys.readouterr().out
    _forge("UPDATE jobs_elasticevent SET reason = %s WHERE id = %s", ['{"rule": "x"}', rows[0].id])
    with pytest.raises(SystemExit) as info:
        call_command("verify_audit")
    assert info.value.code == 1
    assert f"BROKEN at row {rows[0].id}" in capsys.readouterr().err


def test_the_orm_refuses_updates_and_deletes():
    row = _events(1)[0]
    row.actor = "mallory"
    with pytest.raises(PermissionError):
        row.save()
    with pytest.raises(PermissionError):
        row.delete()
    with pytest.raises(PermissionError):
        ElasticEvent.objects.all().update(actor="x")
    with pytest.raises(PermissionError):
        ElasticEvent.objects.all().delete()


def test_record_event_must_run_inside_a_transaction(transactional_db):
    with pytest.raises(RuntimeError, match="inside the action's transaction"):
        record_event("cordon", actor="x")


@pytest.mark.postgres
def test_postgres_trigger_rejects_update_and_delete():
    row = _events(1)[0]
    for sql in ("UPDATE jobs_elasticevent SET actor = 'mallory' WHERE id = %s",
                "DELETE FROM jobs_elasticevent WHERE id = %s"):
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(sql, [row.id])
    assert verify_chain().ok


@pytest.mark.postgres
def test_concurrent_appends_keep_one_chain(transactional_db):
    """Appends from several connections serialise on the advisory lock: no fork in the chain."""
    import threading

    from django.db import connections

    errors: list[BaseException] = []

    def append(k: int) -> None:
        try:
            for i in range(5):
                with transaction.atomic():
                    record_event("cordon", actor=f"t{k}", reason={"i": i})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=append, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    report = verify_chain()
    assert report.ok and report.rows_checked == 20

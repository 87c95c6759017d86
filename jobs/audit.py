"""Writing, anchoring and verifying the hash-chained audit log (docs/audit-log.md).

``record_event`` is the only way a row is written: inside the caller's transaction it takes
the chain lock, reads the previous hash and stores the new row's, and its MAC under the audit
key when one is set. ``verify_chain`` walks the log in order and reports the first row whose
stored hash, link or MAC does not match. The chain alone proves nothing to someone who can write
the database and run ``compute_hash``; two anchors outside the database do: the key, and the
heads ``publish_head`` appends to a file, which ``verify_heads`` checks the chain against.
``grant_app_role`` makes the application's own database role unable to rewrite the table.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection, connections, transaction
from django.utils import timezone

from jobs.models import ElasticEvent, Job

GENESIS_HASH = "0" * 64
# The key of the PostgreSQL advisory lock that serialises appends to the chain.
AUDIT_CHAIN_LOCK_KEY = 0x4F4D4E49  # "OMNI"

HASHED_FIELDS = (
    "at",
    "kind",
    "job_id",
    "job_name",
    "nodes_before",
    "nodes_after",
    "gpus_before",
    "gpus_after",
    "dp_before",
    "dp_after",
    "accum_before",
    "accum_after",
    "global_batch",
    "actor_user_id",
    "actor",
    "planner_run",
    "command",
    "refers_to_id",
    "reason",
    "outcome",
    "prev_hash",
)


def canonical_number(value: int | float) -> int | float:
    """A number as it is hashed: integral values as integers, others as Python's shortest float.

    PostgreSQL's ``jsonb`` keeps numbers as decimals and gives ``1e3`` or ``1e16`` back as the
    integer ``1000`` / ``10000000000000000``; SQLite gives back the float that was stored. Both
    hash the same because an integral float is hashed as the integer its shortest decimal
    spells (``int(float)`` would not do: ``int(1e23)`` is 99999999999999991611392, while jsonb
    gives back 10**23). Non-integral floats round-trip through jsonb's decimal unchanged.
    """
    if isinstance(value, float) and value.is_integer():
        return int(Decimal(repr(value)))
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return canonical_number(value)
    return str(value)  # UUIDs


def canonical_json(event: ElasticEvent) -> str:
    """The bytes that are hashed: the hashed fields, sorted keys, no whitespace."""
    body = {name: _plain(getattr(event, name)) for name in HASHED_FIELDS}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def compute_hash(event: ElasticEvent) -> str:
    return hashlib.sha256((event.prev_hash + canonical_json(event)).encode("utf-8")).hexdigest()


def audit_key() -> bytes | None:
    """The MAC key from ``OMNI_AUDIT_KEY`` (or its ``_FILE``), or None when none is set."""
    return settings.OMNI_AUDIT_KEY.encode("utf-8") if settings.OMNI_AUDIT_KEY else None


def row_mac(key: bytes, row_hash: str) -> str:
    """A row's MAC: HMAC-SHA256 of its hash. The hash covers every field, so this covers them too."""
    return hmac.new(key, row_hash.encode("ascii"), hashlib.sha256).hexdigest()


def _json_roundtrip(value: Any) -> Any:
    # Store exactly what the database will give back (jsonb reorders keys and renders numbers
    # its own way), so the hash computed now is the hash recomputed later.
    return json.loads(json.dumps(value, sort_keys=True, allow_nan=False))


def _lock_chain() -> None:
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [AUDIT_CHAIN_LOCK_KEY])
    # SQLite: transactions begin IMMEDIATE (settings), so writers are already serialised.


def record_event(
    kind: str,
    *,
    job: Job | None = None,
    actor: str,
    actor_user=None,
    reason: dict[str, Any] | None = None,
    outcome: dict[str, Any] | None = None,
    nodes_before: Iterable[str] = (),
    nodes_after: Iterable[str] = (),
    gpus_before: int | None = None,
    gpus_after: int | None = None,
    dp_before: int | None = None,
    dp_after: int | None = None,
    accum_before: int | None = None,
    accum_after: int | None = None,
    global_batch: int | None = None,
    planner_run=None,
    command=None,
    refers_to: ElasticEvent | None = None,
    at: datetime | None = None,
) -> ElasticEvent:
    """Append one row to the audit chain. Must run inside the caller's transaction."""
    if not connection.in_atomic_block:
        raise RuntimeError("record_event must run inside the action's transaction")
    _lock_chain()
    last = ElasticEvent.objects.order_by("-id").values_list("hash", flat=True).first()
    event = ElasticEvent(
        at=at or timezone.now(),
        kind=kind,
        job=job,
        job_name=job.name if job is not None else "",
        nodes_before=sorted(set(nodes_before)),
        nodes_after=sorted(set(nodes_after)),
        gpus_before=gpus_before,
        gpus_after=gpus_after,
        dp_before=dp_before,
        dp_after=dp_after,
        accum_before=accum_before,
        accum_after=accum_after,
        global_batch=global_batch,
        actor_user=actor_user,
        actor=actor,
        planner_run=planner_run,
        command=command,
        refers_to=refers_to,
        reason=_json_roundtrip(reason or {}),
        outcome=_json_roundtrip(outcome or {}),
        prev_hash=last or GENESIS_HASH,
    )
    event.hash = compute_hash(event)
    key = audit_key()
    event.mac = row_mac(key, event.hash) if key else ""
    event.save(force_insert=True)
    return event


def link_problem(event: ElasticEvent, prev_hash: str) -> str:
    """Why ``event`` breaks the chain after a row whose hash is ``prev_hash``; "" if it holds."""
    if event.prev_hash != prev_hash:
        return "its prev_hash does not match the row before it"
    if compute_hash(event) != event.hash:
        return "its contents do not match its stored hash"
    return ""


def mac_problem(event: ElasticEvent, key: bytes, keyed_before: bool) -> str:
    """Why ``event``'s MAC betrays a rewrite; "" if it holds. ``keyed_before``: an earlier row had one."""
    if event.mac:
        if not hmac.compare_digest(event.mac, row_mac(key, event.hash)):
            return "its MAC does not match: rewritten by someone without the audit key"
        return ""
    if keyed_before:
        return "it has no MAC though rows before it do: written or rewritten by someone without the audit key"
    return ""


@dataclass(frozen=True)
class ChainReport:
    """The result of walking the chain: how far it holds, and the first row where it breaks.

    ``macs_checked`` says whether a key was given; ``rows_before_key`` counts the leading rows
    without a MAC (written before the key was set), which are reported, not refused.
    """

    rows_checked: int
    last_good_id: int | None
    first_bad_id: int | None
    problem: str = ""
    last_hash: str = GENESIS_HASH
    macs_checked: bool = False
    rows_before_key: int = 0

    @property
    def ok(self) -> bool:
        return self.first_bad_id is None


def _rows(chunk_size: int) -> Iterator[ElasticEvent]:
    # Keyset pagination keeps memory flat however long the log is.
    last_id = 0
    while True:
        chunk = list(ElasticEvent.objects.filter(id__gt=last_id).order_by("id")[:chunk_size])
        if not chunk:
            return
        yield from chunk
        last_id = chunk[-1].id


@transaction.atomic
def verify_chain(chunk_size: int = 2000, *, key: bytes | None = None) -> ChainReport:
    """Recompute every row's hash in order, and with ``key`` its MAC; stop at the first mismatch."""
    expected_prev = GENESIS_HASH
    checked = 0
    before_key = 0
    last_good: int | None = None
    for event in _rows(chunk_size):
        problem = link_problem(event, expected_prev)
        if not problem and key is not None:
            problem = mac_problem(event, key, keyed_before=checked > before_key)
            if not problem and not event.mac:
                before_key += 1
        if problem:
            return ChainReport(checked, last_good, event.id, problem, expected_prev, key is not None, before_key)
        checked += 1
        last_good = event.id
        expected_prev = event.hash
    return ChainReport(checked, last_good, None, "", expected_prev, key is not None, before_key)


# -- published heads -------------------------------------------------------------------------------
# A head is one JSON line {"id", "hash", "rows", "at", "mac"} appended to a file outside the database.
# Whoever rewrites or deletes rows after a publication cannot make the chain match it again.

HEAD_FIELDS = ("id", "hash", "rows", "at")


def head_mac(key: bytes, head: dict[str, Any]) -> str:
    """HMAC-SHA256 over a head's fields in their canonical JSON (sorted keys, no spaces)."""
    body = json.dumps({name: head[name] for name in HEAD_FIELDS}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode("utf-8"), hashlib.sha256).hexdigest()


def _last_line(path: Path) -> str:
    # The file only grows: read its tail, not all of it, to find the latest head.
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 4096))
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except FileNotFoundError:
        return ""
    return next((line for line in reversed(lines) if line.strip()), "")


def _append_durably(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    created = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    try:
        os.write(fd, line.encode("utf-8"))  # one write with O_APPEND: concurrent lines never interleave
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:  # the new file's name must survive a crash too
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def publish_head(path: Path | None = None, *, key: bytes | None = None) -> dict[str, Any] | None:
    """Append the chain's current head to ``path`` (default ``OMNI_AUDIT_HEADS``) and fsync it.

    Returns the head written, or None when there is nothing new: an empty log, or the same head
    as the file's last line (so a quiet system does not grow the file).
    """
    path = Path(path or settings.OMNI_AUDIT_HEADS)
    with transaction.atomic():  # the head and its row count from one snapshot
        last = ElasticEvent.objects.order_by("-id").values("id", "hash").first()
        if last is None:
            return None
        rows = ElasticEvent.objects.count()
    try:
        previous = json.loads(_last_line(path) or "{}")
    except ValueError:
        previous = {}  # a damaged last line: publish anyway; verify_heads reports the damage
    if isinstance(previous, dict) and previous.get("id") == last["id"] and previous.get("hash") == last["hash"]:
        return None
    head: dict[str, Any] = {
        "id": last["id"], "hash": last["hash"], "rows": rows,
        "at": timezone.now().astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    head["mac"] = head_mac(key, head) if key else ""
    _append_durably(path, json.dumps(head, sort_keys=True) + "\n")
    return head


@dataclass
class HeadsReport:
    """What checking the chain against the published heads found: one sentence per problem."""

    heads: int = 0
    problems: list[str] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def _read_heads(path: Path, key: bytes | None, problems: list[str]) -> list[dict[str, Any]]:
    heads = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                head = json.loads(line)
                if not isinstance(head, dict) or not isinstance(head.get("id"), int) or \
                        not isinstance(head.get("hash"), str):
                    raise ValueError("no integer id and string hash")
            except ValueError as exc:
                problems.append(f"line {number} of {path} is not a head: {exc}")
                continue
            if key is not None:
                mac = head.get("mac")
                if not isinstance(mac, str) or not mac or not all(name in head for name in HEAD_FIELDS) or \
                        not hmac.compare_digest(mac, head_mac(key, head)):
                    problems.append(f"line {number} of {path} (a head published at {head.get('at')} naming row "
                                    f"{head['id']}) has a bad MAC: written by someone without the audit key")
                    continue
            heads.append(head)
    return heads


def verify_heads(path: Path, *, key: bytes | None = None, chunk_size: int = 1000) -> HeadsReport:
    """Check the chain against every head in ``path``: each named row must exist with that hash,
    and the chain must reach at least the latest head. With ``key``, each line's MAC is checked."""
    problems: list[str] = []
    heads = _read_heads(Path(path), key, problems)
    end = ElasticEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0
    beyond = [head for head in heads if head["id"] > end]
    if beyond:
        latest = max(beyond, key=lambda head: head["id"])
        problems.append(f"the chain ends at row {end} but a head published at {latest.get('at')} "
                        f"names row {latest['id']}: rows were deleted from its end")
    within = [head for head in heads if head["id"] <= end]
    for start in range(0, len(within), chunk_size):
        chunk = within[start:start + chunk_size]
        stored = dict(ElasticEvent.objects.filter(id__in={h["id"] for h in chunk}).values_list("id", "hash"))
        for head in chunk:
            if head["id"] not in stored:
                problems.append(f"row {head['id']}, named by the head published at {head.get('at')}, is missing")
            elif stored[head["id"]] != head["hash"]:
                problems.append(f"row {head['id']}'s hash is not the one published at {head.get('at')}: "
                                f"the chain was rewritten after that publication")
    return HeadsReport(len(heads), problems)


# -- the application's database role ---------------------------------------------------------------
AUDIT_TABLE = "jobs_elasticevent"


class RoleError(Exception):
    """The application role cannot be granted as asked; the message says why and what to do."""


def grant_app_role(role: str, using: str = "default") -> None:
    """Give ``role`` normal DML on every table and sequence of the schema, but on the audit table only
    SELECT and INSERT (PostgreSQL; run as the tables' owner, i.e. the role that runs migrations).

    The trigger of migration 0003 refuses UPDATE and DELETE, but a table's owner can disable it, and
    TRUNCATE bypasses it: the role the application runs as must therefore not own the table. The role
    must exist already: creating login roles and their passwords is the database administrator's job.
    Idempotent; ``post_migrate`` re-runs it (jobs.apps) so tables added later are covered too.

    The role gets no CREATE on the schema: it creates and drops telemetry partitions only through
    the SECURITY DEFINER functions of telemetry migration 0002, on which it gets EXECUTE (those
    of them that exist: a ``migrate jobs`` alone has not made them yet).
    """
    connection = connections[using]
    if connection.vendor != "postgresql":
        raise RoleError("grant_app_role needs PostgreSQL: SQLite has no roles")
    with connection.cursor() as cursor:
        cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = %s", [role])
        found = cursor.fetchone()
        if found is None:
            raise RoleError(f"role {role!r} does not exist: create it first, e.g. "
                            f"CREATE ROLE {role} LOGIN PASSWORD '...'")
        if found[0]:
            raise RoleError(f"role {role!r} is a superuser, which no grant can restrict")
        cursor.execute("SELECT tableowner FROM pg_tables WHERE tablename = %s AND schemaname = current_schema()",
                       [AUDIT_TABLE])
        owner = cursor.fetchone()
        if owner is None:
            raise RoleError(f"no table {AUDIT_TABLE} in this schema: run manage.py migrate first")
        cursor.execute("SELECT pg_has_role(%s, %s, 'USAGE')", [role, owner[0]])
        if cursor.fetchone()[0]:
            raise RoleError(f"role {role!r} is, or is a member of, {owner[0]!r}, the audit table's owner, "
                            f"and could disable its trigger: run the application as a separate role")
        quoted = connection.ops.quote_name(role)
        cursor.execute("SELECT current_schema()")
        schema = connection.ops.quote_name(cursor.fetchone()[0])
        for sql in (
            f"GRANT USAGE ON SCHEMA {schema} TO {quoted}",
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {quoted}",
            f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schema} TO {quoted}",
            f"REVOKE UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER ON {AUDIT_TABLE} FROM {quoted}",
        ):
            cursor.execute(sql)
        for function in ("omni_telemetry_create_partition(text, timestamptz, timestamptz)",
                         "omni_telemetry_drop_partition(text)"):
            cursor.execute("SELECT to_regprocedure(%s) IS NOT NULL", [f"{schema}.{function}"])
            if cursor.fetchone()[0]:
                cursor.execute(f"GRANT EXECUTE ON FUNCTION {schema}.{function} TO {quoted}")

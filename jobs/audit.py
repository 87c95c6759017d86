"""Writing and verifying the hash-chained audit log (docs/audit-log.md).

``record_event`` is the only way a row is written: inside the caller's transaction it takes
the chain lock, reads the previous hash and stores the new row's. ``verify_chain`` walks the
log in order and reports the first row whose stored hash or link does not match.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.db import connection, transaction
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
    event.save(force_insert=True)
    return event


def link_problem(event: ElasticEvent, prev_hash: str) -> str:
    """Why ``event`` breaks the chain after a row whose hash is ``prev_hash``; "" if it holds."""
    if event.prev_hash != prev_hash:
        return "its prev_hash does not match the row before it"
    if compute_hash(event) != event.hash:
        return "its contents do not match its stored hash"
    return ""


@dataclass(frozen=True)
class ChainReport:
    """The result of walking the chain: how far it holds, and the first row where it breaks."""

    rows_checked: int
    last_good_id: int | None
    first_bad_id: int | None
    problem: str = ""

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
def verify_chain(chunk_size: int = 2000) -> ChainReport:
    """Recompute every row's hash in order; stop at the first mismatch."""
    expected_prev = GENESIS_HASH
    checked = 0
    last_good: int | None = None
    for event in _rows(chunk_size):
        problem = link_problem(event, expected_prev)
        if problem:
            return ChainReport(checked, last_good, event.id, problem)
        checked += 1
        last_good = event.id
        expected_prev = event.hash
    return ChainReport(checked, last_good, None)

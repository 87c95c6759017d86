"""Ingestion, stage 2: the sequence window, so a batch sent twice is stored once.

Each sender stream (node, source id, kind) has a ``TelemetrySource`` row holding the highest
batch ``seq`` stored and a window of the ``WINDOW_BATCHES`` before it (``accept_sequence``).
``advance_source`` claims the row (locking it, so batches of one source serialise) and decides
whether the batch is new; ``record_batch`` stores the new window and running totals. On
PostgreSQL the claim and, when this process knows the source's committed state, the update
ride in one round trip (psycopg pipeline mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import connection
from django.db.models import F, Value
from django.db.models.functions import Coalesce, Greatest

from jobs.models import Node
from telemetry.ingest.validate import BatchRejected
from telemetry.models import TelemetrySource

WINDOW_BATCHES = 1024  # how many recent sequence numbers per source are remembered


def accept_sequence(high_seq: int, window: int, seq: int) -> tuple[bool, int, int]:
    """Anti-replay window: (is_new, new high_seq, new window bits) for batch ``seq``.

    Bit ``i`` of ``window`` says batch ``high_seq - i`` was stored. A seq further back than the
    window cannot be told apart from a replay and raises BatchRejected.
    """
    if seq > high_seq:
        shift = seq - high_seq
        window = ((window << shift) | 1) & ((1 << WINDOW_BATCHES) - 1) if shift < WINDOW_BATCHES else 1
        return True, seq, window
    offset = high_seq - seq
    if offset >= WINDOW_BATCHES:
        raise BatchRejected({"seq": [
            f"seq {seq} is more than {WINDOW_BATCHES} batches behind this source's latest ({high_seq}); "
            "a restarted sender must continue its sequence or use a new source id"
        ]})
    if window >> offset & 1:
        return False, high_seq, window
    return True, high_seq, window | (1 << offset)


# Creates the source on its first batch and locks its row for this transaction (ON CONFLICT DO
# UPDATE takes the row lock), so batches of one source serialise.
_CLAIM_SOURCE = (
    'INSERT INTO telemetry_telemetrysource (node_id, name, kind, high_seq, "window", batches_total, '
    "samples_total, duplicates_total, created_at) VALUES (%s, %s, %s, -1, %s, 0, 0, 0, %s) "
    "ON CONFLICT (node_id, name, kind) DO UPDATE SET name = excluded.name "
    'RETURNING id, high_seq, "window"'
)
_UPDATE_SOURCE = (
    'UPDATE telemetry_telemetrysource SET high_seq = %s, "window" = %s, batches_total = batches_total + 1, '
    "samples_total = samples_total + %s, last_batch_at = %s, "
    "last_sample_at = GREATEST(COALESCE(last_sample_at, %s), %s), last_lag_s = %s WHERE id = %s"
)
# (node id, source, kind) -> (source id, high_seq, window) as this process last committed them.
# Only a guess that lets the source update ride in the claim's round trip; the UPDATE checks it.
_committed_sources: dict[tuple[int, str, str], tuple[int, int, int]] = {}
MAX_KNOWN_SOURCES = 50_000


@dataclass
class Advance:
    """What ``advance_source`` decided for one batch."""

    source_id: int
    is_new: bool
    high_seq: int
    window: int
    recorded: bool  # the source row already holds the new state and totals


def _window_bytes(window: int) -> bytes:
    return window.to_bytes(WINDOW_BATCHES // 8, "big")


def advance_source(
    node: Node, name: str, kind: str, seq: int, now: datetime, update: list, *, async_commit: bool
) -> Advance:
    """Claim the source row and decide whether ``seq`` is new.

    On PostgreSQL ``SET LOCAL synchronous_commit``, the claim and (when this process knows the
    source's state) the conditional UPDATE recording the batch go out in one round trip through
    psycopg's pipeline mode: per-batch round trips are most of what separates ingestion from
    raw COPY. ``update`` holds the UPDATE's values after high_seq and window.
    """
    claim = [node.pk, name, str(kind), b"", connection.ops.adapt_datetimefield_value(now)]
    if connection.vendor != "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(_CLAIM_SOURCE, claim)
            source_id, high_seq, window_bytes = cursor.fetchone()
        is_new, high_seq, window = accept_sequence(high_seq, int.from_bytes(bytes(window_bytes), "big"), seq)
        return Advance(source_id, is_new, high_seq, window, recorded=False)
    guess = _committed_sources.get((node.pk, name, str(kind)))
    planned: tuple[int, int] | None = None
    if guess is not None:
        try:
            new, high, window = accept_sequence(guess[1], guess[2], seq)
            planned = (high, window) if new else None
        except BatchRejected:
            planned = None
    connection.ensure_connection()
    raw = connection.connection
    with raw.pipeline(), raw.cursor() as claim_cursor, raw.cursor() as update_cursor:
        if async_commit:
            claim_cursor.execute("SET LOCAL synchronous_commit TO off")
        claim_cursor.execute(_CLAIM_SOURCE, claim)
        if planned is not None and guess is not None:
            update_cursor.execute(
                _UPDATE_SOURCE + ' AND high_seq = %s AND "window" = %s',
                [planned[0], _window_bytes(planned[1]), *update, guess[0], guess[1], _window_bytes(guess[2])],
            )
        source_id, high_seq, window_bytes = claim_cursor.fetchone()
        recorded = planned is not None and update_cursor.rowcount == 1
    if recorded and planned is not None:
        return Advance(source_id, True, planned[0], planned[1], recorded=True)
    is_new, high_seq, window = accept_sequence(high_seq, int.from_bytes(bytes(window_bytes), "big"), seq)
    return Advance(source_id, is_new, high_seq, window, recorded=False)


def record_batch(advance: Advance, update: list) -> None:
    """Store the new window and add the batch to the source's totals (``update`` as for
    ``advance_source``: samples, accepted at, newest sample time twice, lag)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(_UPDATE_SOURCE, [advance.high_seq, _window_bytes(advance.window), *update, advance.source_id])
        return
    samples, now, newest, _, lag_s = update
    TelemetrySource.objects.filter(pk=advance.source_id).update(
        high_seq=advance.high_seq,
        window=_window_bytes(advance.window),
        batches_total=F("batches_total") + 1,
        samples_total=F("samples_total") + samples,
        last_batch_at=now,
        last_sample_at=Greatest(Coalesce(F("last_sample_at"), Value(newest)), Value(newest)),
        last_lag_s=lag_s,
    )


def record_duplicate(advance: Advance) -> None:
    """Count a batch that was already stored."""
    TelemetrySource.objects.filter(pk=advance.source_id).update(duplicates_total=F("duplicates_total") + 1)


def remember_committed(node: Node, name: str, kind: str, advance: Advance) -> None:
    """After commit: keep the source's state as the guess for its next batch."""
    key = (node.pk, name, str(kind))
    if len(_committed_sources) >= MAX_KNOWN_SOURCES and key not in _committed_sources:
        _committed_sources.clear()  # restarted senders leave old names behind; stay bounded
    _committed_sources[key] = (advance.source_id, advance.high_seq, advance.window)


def forget_sources() -> None:
    """Drop the committed-state guesses (tests)."""
    _committed_sources.clear()

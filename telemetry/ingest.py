"""Ingestion of telemetry batches: validate whole, de-duplicate, write in bulk, then emit.

One path for every sender: the HTTP endpoints (telemetry.api), the agent protocol handlers
behind the WebSocket (jobs.agent_api, off the event loop) and the dcgm-exporter importer all call
``ingest_gpu_batch(node, batch)`` / ``ingest_step_batch(node, batch)`` with the same shape::

    {"source": "agent-r0s0n0-5f2c", "seq": 41, "samples": [{...}, ...]}

A batch with any bad sample raises ``BatchRejected`` (a ``ValidationError`` whose keys name the
sample and field, e.g. ``samples[3].util_pct``) and nothing of it is stored. A batch whose
``(source, seq)`` was already stored returns ``duplicate=True`` and stores nothing. Otherwise
all rows go in with one binary ``COPY`` (PostgreSQL) or ``bulk_create`` (SQLite) in one
transaction, and a throttled live message follows the commit. Field formats, limits and the
de-duplication window are in docs/telemetry.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from jobs import live
from jobs.models import Allocation, Job, Node
from telemetry import metrics
from telemetry.copy import binary_payload, timestamptz_from_epoch_s
from telemetry.models import BatchKind, GpuSample, StepRecord, TelemetrySource
from telemetry.partitions import ensure_partitions, retention_for

logger = logging.getLogger(__name__)

WINDOW_BATCHES = 1024  # how many recent sequence numbers per source are remembered
MAX_ERRORS_SHOWN = 100
SOURCE_MAX_LENGTH = 128
TOKEN_MODALITIES = ("text", "image", "video", "audio")
MAX_LIVE_POINTS = 4096

GPU_FIELDS = frozenset({"gpu", "at", "util_pct", "mem_used_bytes", "power_w", "temp_c", "xid_errors"})
STEP_FIELDS = frozenset(
    {"job", "rank", "step", "at", "step_s", "data_wait_s", "compute_s", "comm_s", "tokens", "loss"}
)

GPU_COLUMNS: tuple[tuple[str, str], ...] = (
    ("node_id", "bigint"), ("gpu_index", "smallint"), ("at", "timestamptz"), ("util_pct", "real"),
    ("mem_used_bytes", "bigint"), ("power_w", "real"), ("temp_c", "real"), ("xid_errors", "integer"),
)
STEP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("job_id", "bigint"), ("rank", "integer"), ("step", "bigint"), ("at", "timestamptz"), ("node_id", "bigint"),
    ("step_s", "real"), ("data_wait_s", "real"), ("compute_s", "real"), ("comm_s", "real"),
    ("tokens_text", "bigint"), ("tokens_image", "bigint"), ("tokens_video", "bigint"), ("tokens_audio", "bigint"),
    ("loss", "real"),
)

_MISSING = object()
_NUMBER = (int, float)


class BatchRejected(ValidationError):
    """A batch refused whole. ``errors`` maps ``samples[i].field`` (or ``source``, ``seq``,
    ``samples``) to messages; the API answers 400 with exactly that body."""

    def __init__(self, errors: dict[str, list[str]]):
        super().__init__(errors)
        self.errors = errors


@dataclass(frozen=True)
class IngestResult:
    """What happened to one batch."""

    kind: str  # "gpu" or "steps"
    source: str
    seq: int
    accepted: int  # samples stored (0 for a duplicate)
    duplicate: bool
    newest_at: datetime | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind), "source": self.source, "seq": self.seq, "accepted": self.accepted,
            "duplicate": self.duplicate,
        }


# -- validation ------------------------------------------------------------------------------


class _Errors:
    """Collects messages per ``samples[i].field``; shows the first MAX_ERRORS_SHOWN."""

    def __init__(self) -> None:
        self.messages: dict[str, list[str]] = {}
        self.hidden = 0
        self.bad_samples: set[int] = set()

    def add(self, key: str, message: str) -> None:
        if key in self.messages:
            self.messages[key].append(message)
        elif len(self.messages) < MAX_ERRORS_SHOWN:
            self.messages[key] = [message]
        else:
            self.hidden += 1

    def sample(self, index: int, field: str, message: str) -> None:
        self.bad_samples.add(index)
        self.add(f"samples[{index}].{field}", message)

    def __bool__(self) -> bool:
        return bool(self.messages) or bool(self.hidden)

    def reject(self, total: int) -> BatchRejected:
        messages = dict(self.messages)
        if self.hidden:
            messages.setdefault("samples", []).append(f"{self.hidden} more errors not shown")
        bad = f"{len(self.bad_samples)} of {total} samples invalid" if self.bad_samples else "invalid batch"
        messages.setdefault("batch", []).append(f"batch rejected whole ({bad}); nothing was stored")
        return BatchRejected(messages)


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    return type(value).__name__


def _envelope(batch: Any, errors: _Errors) -> tuple[str, int, list]:
    """Check the batch wrapper; returns (source, seq, samples)."""
    if not isinstance(batch, dict):
        raise BatchRejected({"batch": [f"expected an object with source, seq and samples, got {_describe(batch)}"]})
    unknown = set(batch) - {"source", "seq", "samples"}
    for key in sorted(unknown):
        errors.add(key, "unknown field")
    source = batch.get("source", _MISSING)
    if source is _MISSING:
        errors.add("source", "this field is required")
    elif not isinstance(source, str) or not 1 <= len(source) <= SOURCE_MAX_LENGTH or not source.isprintable():
        errors.add("source", f"expected a printable string of 1-{SOURCE_MAX_LENGTH} characters")
    seq = batch.get("seq", _MISSING)
    if seq is _MISSING:
        errors.add("seq", "this field is required")
    elif type(seq) is not int or not 0 <= seq < 2**63:
        errors.add("seq", f"expected a non-negative integer, got {_describe(seq)}")
    samples = batch.get("samples", _MISSING)
    if samples is _MISSING:
        errors.add("samples", "this field is required")
        samples = []
    elif not isinstance(samples, list):
        errors.add("samples", f"expected a list, got {_describe(samples)}")
        samples = []
    elif not samples:
        errors.add("samples", "a batch needs at least one sample")
    elif len(samples) > settings.OMNI_TELEMETRY_MAX_BATCH:
        errors.add("samples", f"oversized batch: {len(samples)} samples, at most {settings.OMNI_TELEMETRY_MAX_BATCH}")
        samples = []
    return source, seq, samples  # type: ignore[return-value]


def _objects(samples: list, fields: frozenset[str], errors: _Errors) -> np.ndarray:
    """Mask of the samples that are objects with only known fields (the others get messages)."""
    ok = np.ones(len(samples), dtype=bool)
    if not all(type(s) is dict for s in samples):
        for i, s in enumerate(samples):
            if type(s) is not dict:
                errors.bad_samples.add(i)
                errors.add(f"samples[{i}]", f"expected an object, got {_describe(s)}")
                ok[i] = False
    used: set[str] = set().union(*(s for s, good in zip(samples, ok, strict=True) if good))
    if not used <= fields:
        for i, s in enumerate(samples):
            if ok[i]:
                for key in sorted(set(s) - fields):
                    errors.sample(i, str(key), "unknown field")
    return ok


def _column(samples: list, ok: np.ndarray, field: str) -> list:
    if ok.all():
        return [s.get(field, _MISSING) for s in samples]
    return [s.get(field, _MISSING) if good else None for s, good in zip(samples, ok, strict=True)]


def _numbers(
    column: list, ok: np.ndarray, field: str, errors: _Errors, *, integer: bool, required: bool,
    default: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Type-check one column and return (float64 values, null mask). Missing optional -> NaN/null."""
    allowed = {int} if integer else {int, float}
    if set(map(type, column)) <= allowed:
        values = np.array(column, dtype=np.float64) if not integer else _int_array(column)
        return values, np.zeros(len(column), dtype=bool)
    values = np.empty(len(column), dtype=np.float64)
    nulls = np.zeros(len(column), dtype=bool)
    expected = "an integer" if integer else "a number"
    for i, value in enumerate(column):
        kind = type(value)
        if kind in allowed:
            values[i] = value
        elif value is _MISSING or value is None:
            if required and ok[i]:
                errors.sample(i, field, "this field is required" if value is _MISSING else "may not be null")
            if default is not None:
                values[i] = default
            else:
                values[i] = np.nan
                nulls[i] = True
        elif ok[i]:
            errors.sample(i, field, f"expected {expected}, got {_describe(value)}")
            values[i] = np.nan
    return values, nulls


def _int_array(column: list) -> np.ndarray:
    try:
        return np.array(column, dtype=np.int64).astype(np.float64)
    except OverflowError:
        return np.array([float(v) for v in column], dtype=np.float64)


def _check_range(
    values: np.ndarray, nulls: np.ndarray, ok: np.ndarray, field: str, errors: _Errors,
    low: float, high: float, what: str,
) -> None:
    bad = ~((values >= low) & (values <= high)) & ~nulls & ok
    for i in np.flatnonzero(bad):
        value = values[i]
        if not math.isfinite(value) and int(i) in errors.bad_samples:
            continue  # already reported as the wrong type
        shown = "not finite" if not math.isfinite(value) else f"{value:g}"
        errors.sample(int(i), field, f"{what}, got {shown}")


def _times(column: list, ok: np.ndarray, errors: _Errors, now_s: float) -> np.ndarray:
    """``at`` as Unix seconds: a number, or an ISO 8601 string with a timezone."""
    kinds = set(map(type, column))
    if kinds <= {int, float}:
        values = np.array(column, dtype=np.float64)
    else:
        values = np.full(len(column), np.nan)
        for i, value in enumerate(column):
            if type(value) in _NUMBER:
                values[i] = value
            elif isinstance(value, str):
                try:
                    parsed = datetime.fromisoformat(value)
                except ValueError:
                    errors.sample(i, "at", "expected Unix seconds or an ISO 8601 time, got an unparsable string")
                    continue
                if parsed.tzinfo is None:
                    errors.sample(i, "at", "an ISO 8601 time needs a timezone (e.g. Z)")
                    continue
                values[i] = parsed.timestamp()
            elif ok[i]:
                errors.sample(i, "at", "this field is required" if value is _MISSING else
                              f"expected Unix seconds or an ISO 8601 time, got {_describe(value)}")
    future_s = settings.OMNI_TELEMETRY_MAX_FUTURE_S
    keep = retention_for("raw")
    oldest_s = now_s - keep.total_seconds() if keep else 0.0
    finite = np.isfinite(values)
    for i in np.flatnonzero(finite & (values > now_s + future_s) & ok):
        errors.sample(int(i), "at", f"{values[i] - now_s:.0f} s in the future (at most {future_s:g} s ahead allowed)")
    for i in np.flatnonzero(finite & (values < oldest_s) & ok):
        errors.sample(int(i), "at", "older than the raw retention; such samples would be dropped at once")
    return values


def _duplicates(keys: Sequence[np.ndarray], ok: np.ndarray, errors: _Errors, field: str) -> None:
    """Reject samples that repeat an earlier sample's key (all of ``keys`` equal) in the batch."""
    order = np.lexsort(tuple(reversed(keys)))
    same = np.ones(len(order) - 1, dtype=bool)
    for key in keys:
        ordered = key[order]
        same &= ordered[1:] == ordered[:-1]
    for position in np.flatnonzero(same) + 1:
        i, first = int(order[position]), int(order[position - 1])
        if ok[i]:
            errors.sample(i, field, f"duplicate of samples[{first}] (same key and time)")


@dataclass
class SampleRows:
    """Validated samples (GPU readings or step records) as columns, ready for COPY."""

    values: dict[str, np.ndarray]
    nulls: dict[str, np.ndarray]
    epoch_s: np.ndarray

    def __len__(self) -> int:
        return len(self.epoch_s)


def validate_gpu_samples(node: Node, samples: list, errors: _Errors, now_s: float) -> SampleRows:
    """Vectorised checks of GPU samples for ``node``; problems go to ``errors``."""
    ok = _objects(samples, GPU_FIELDS, errors)
    gpu, _ = _numbers(_column(samples, ok, "gpu"), ok, "gpu", errors, integer=True, required=True)
    for i in np.flatnonzero(ok & ~((gpu >= 0) & (gpu < node.gpu_count))):
        if math.isfinite(gpu[i]):
            errors.sample(int(i), "gpu", f"unknown GPU {gpu[i]:.0f}: node {node.name} has GPUs 0-{node.gpu_count - 1}")
    epoch_s = _times(_column(samples, ok, "at"), ok, errors, now_s)
    util, util_nulls = _numbers(_column(samples, ok, "util_pct"), ok, "util_pct", errors, integer=False, required=True)
    _check_range(util, util_nulls, ok, "util_pct", errors, 0.0, 100.0, "utilisation must be within 0-100")
    mem, mem_nulls = _numbers(
        _column(samples, ok, "mem_used_bytes"), ok, "mem_used_bytes", errors, integer=True, required=True
    )
    _check_range(mem, mem_nulls, ok, "mem_used_bytes", errors, 0, 2.0**53, "memory must be 0 or more bytes")
    power, power_nulls = _numbers(_column(samples, ok, "power_w"), ok, "power_w", errors, integer=False, required=False)
    _check_range(power, power_nulls, ok, "power_w", errors, 0.0, 100_000.0, "power must be within 0-100000 W")
    temp, temp_nulls = _numbers(_column(samples, ok, "temp_c"), ok, "temp_c", errors, integer=False, required=False)
    _check_range(temp, temp_nulls, ok, "temp_c", errors, -100.0, 300.0, "temperature must be within -100-300 C")
    xid, _ = _numbers(
        _column(samples, ok, "xid_errors"), ok, "xid_errors", errors, integer=True, required=False, default=0.0
    )
    _check_range(xid, np.zeros(len(xid), dtype=bool), ok, "xid_errors", errors, 0, 2**31 - 1,
                 "XID error count must be 0 or more")
    if not errors:
        _duplicates([gpu.astype(np.int64), timestamptz_from_epoch_s(epoch_s)], ok, errors, "at")
    n = len(samples)
    values = {
        "node_id": np.full(n, node.pk, dtype=np.int64),
        "gpu_index": np.nan_to_num(gpu).astype(np.int16),
        "at": timestamptz_from_epoch_s(np.nan_to_num(epoch_s)),
        "util_pct": util.astype(np.float32),
        "mem_used_bytes": np.nan_to_num(mem).astype(np.int64),
        "power_w": power.astype(np.float32),
        "temp_c": temp.astype(np.float32),
        "xid_errors": np.nan_to_num(xid).astype(np.int32),
    }
    return SampleRows(values, {"power_w": power_nulls, "temp_c": temp_nulls}, epoch_s)


def validate_step_samples(node: Node, samples: list, errors: _Errors, now_s: float) -> SampleRows:
    """Checks of step records reported by ``node`` (fewer than GPU samples; plainer code)."""
    ok = _objects(samples, STEP_FIELDS, errors)
    job, _ = _numbers(_column(samples, ok, "job"), ok, "job", errors, integer=True, required=True)
    job_ids = {int(j) for j in job[np.isfinite(job)]}
    known = set(Job.objects.filter(pk__in=job_ids).values_list("pk", flat=True)) if job_ids else set()
    for i in np.flatnonzero(ok & np.isfinite(job)):
        if int(job[i]) not in known:
            errors.sample(int(i), "job", f"unknown job {int(job[i])}")
    rank, rank_nulls = _numbers(_column(samples, ok, "rank"), ok, "rank", errors, integer=True, required=True)
    _check_range(rank, rank_nulls, ok, "rank", errors, 0, 2**31 - 1, "rank must be 0 or more")
    step, step_nulls = _numbers(_column(samples, ok, "step"), ok, "step", errors, integer=True, required=True)
    _check_range(step, step_nulls, ok, "step", errors, 0, 2.0**53, "step must be 0 or more")
    epoch_s = _times(_column(samples, ok, "at"), ok, errors, now_s)
    values: dict[str, np.ndarray] = {}
    nulls: dict[str, np.ndarray] = {}
    for field, required in (("step_s", True), ("data_wait_s", False), ("compute_s", False), ("comm_s", False)):
        seconds, missing = _numbers(_column(samples, ok, field), ok, field, errors, integer=False, required=required)
        _check_range(seconds, missing, ok, field, errors, 0.0, 86_400.0, "seconds must be within 0-86400")
        values[field], nulls[field] = seconds.astype(np.float32), missing
    loss, loss_nulls = _numbers(_column(samples, ok, "loss"), ok, "loss", errors, integer=False, required=False)
    _check_range(loss, loss_nulls, ok, "loss", errors, -1e30, 1e30, "loss must be finite")
    values["loss"], nulls["loss"] = loss.astype(np.float32), loss_nulls
    tokens = {m: np.zeros(len(samples), dtype=np.int64) for m in TOKEN_MODALITIES}
    token_nulls = {m: np.ones(len(samples), dtype=bool) for m in TOKEN_MODALITIES}
    for i, sample in enumerate(samples):
        if not ok[i] or sample.get("tokens") is None:
            continue
        counts = sample["tokens"]
        if not isinstance(counts, dict):
            errors.sample(i, "tokens", f"expected an object of modality -> count, got {_describe(counts)}")
            continue
        for modality, value in counts.items():
            if modality not in tokens:
                errors.sample(i, f"tokens.{modality}", f"unknown modality (one of {', '.join(TOKEN_MODALITIES)})")
            elif type(value) is not int or not 0 <= value < 2**62:
                errors.sample(i, f"tokens.{modality}", "expected a non-negative integer")
            else:
                tokens[modality][i] = value
                token_nulls[modality][i] = False
    for modality in TOKEN_MODALITIES:
        values[f"tokens_{modality}"], nulls[f"tokens_{modality}"] = tokens[modality], token_nulls[modality]
    if not errors:
        keys = [job.astype(np.int64), rank.astype(np.int64), step.astype(np.int64), timestamptz_from_epoch_s(epoch_s)]
        _duplicates(keys, ok, errors, "step")
    n = len(samples)
    values.update(
        job_id=np.nan_to_num(job).astype(np.int64),
        rank=np.nan_to_num(rank).astype(np.int32),
        step=np.nan_to_num(step).astype(np.int64),
        at=timestamptz_from_epoch_s(np.nan_to_num(epoch_s)),
        node_id=np.full(n, node.pk, dtype=np.int64),
    )
    return SampleRows(values, nulls, epoch_s)


# -- de-duplication ----------------------------------------------------------------------------


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


# -- storage -----------------------------------------------------------------------------------


def _copy(table: str, columns: Sequence[tuple[str, str]], rows: SampleRows, *, on_conflict_skip: bool) -> None:
    """One binary COPY into ``table`` (through a staging table when duplicates must be skipped)."""
    payload = binary_payload(columns, rows.values, rows.nulls)
    names = ", ".join(name for name, _ in columns)
    with connection.cursor() as wrapper:
        cursor = wrapper.cursor
        if not on_conflict_skip:
            with cursor.copy(f"COPY {table} ({names}) FROM STDIN (FORMAT BINARY)") as copy:
                copy.write(payload)
            return
        cursor.execute(f"CREATE TEMP TABLE IF NOT EXISTS {table}_stage (LIKE {table}) ON COMMIT DELETE ROWS")
        with cursor.copy(f"COPY {table}_stage ({names}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.write(payload)
        cursor.execute(f"INSERT INTO {table} ({names}) SELECT {names} FROM {table}_stage ON CONFLICT DO NOTHING")


def _bulk_create(model: type, columns: Sequence[tuple[str, str]], rows: SampleRows) -> None:
    """SQLite: the same rows through the ORM (INSERT OR IGNORE for rows already there)."""
    objects = []
    epoch = rows.epoch_s.tolist()
    names = [name for name, _ in columns if name != "at"]
    lists = {name: rows.values[name].tolist() for name in names}
    null_lists = {name: rows.nulls[name].tolist() for name in rows.nulls}
    for i, at_s in enumerate(epoch):
        fields = {
            name: (None if name in null_lists and null_lists[name][i] else lists[name][i]) for name in names
        }
        objects.append(model(at=datetime.fromtimestamp(at_s, tz=UTC), **fields))
    model.objects.bulk_create(objects, batch_size=500, ignore_conflicts=True)


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
class _Advance:
    source_id: int
    is_new: bool
    high_seq: int
    window: int
    recorded: bool  # the source row already holds the new state and totals


def _window_bytes(window: int) -> bytes:
    return window.to_bytes(WINDOW_BATCHES // 8, "big")


def _advance_source(
    node: Node, name: str, kind: str, seq: int, now: datetime, update: list, *, async_commit: bool
) -> _Advance:
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
        return _Advance(source_id, is_new, high_seq, window, recorded=False)
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
        return _Advance(source_id, True, planned[0], planned[1], recorded=True)
    is_new, high_seq, window = accept_sequence(high_seq, int.from_bytes(bytes(window_bytes), "big"), seq)
    return _Advance(source_id, is_new, high_seq, window, recorded=False)


def _store(kind: str, node: Node, source_name: str, seq: int, rows: SampleRows, now: datetime,
           *, on_conflict_skip: bool) -> IngestResult:
    table, columns, model = (
        ("telemetry_gpusample", GPU_COLUMNS, GpuSample) if kind == BatchKind.GPU
        else ("telemetry_steprecord", STEP_COLUMNS, StepRecord)
    )
    first_s, last_s = float(rows.epoch_s.min()), float(rows.epoch_s.max())
    newest = datetime.fromtimestamp(last_s, tz=UTC)
    lag_s = max(0.0, now.timestamp() - last_s)
    postgres = connection.vendor == "postgresql"
    # Inside a caller's transaction the commit is the caller's: its durability is not ours to relax.
    async_commit = settings.OMNI_TELEMETRY_ASYNC_COMMIT and not connection.in_atomic_block
    with transaction.atomic():
        update = [len(rows), now, newest, newest, lag_s]
        advance = _advance_source(node, source_name, kind, seq, now, update, async_commit=async_commit)
        if not advance.is_new:
            TelemetrySource.objects.filter(pk=advance.source_id).update(duplicates_total=F("duplicates_total") + 1)
            metrics.count("omni_telemetry_batches_total", f"{kind},duplicate")
            return IngestResult(kind, source_name, seq, 0, True, None)
        if postgres:
            if not advance.recorded:
                with connection.cursor() as cursor:
                    cursor.execute(
                        _UPDATE_SOURCE,
                        [advance.high_seq, _window_bytes(advance.window), *update, advance.source_id],
                    )
            ensure_partitions(table, datetime.fromtimestamp(first_s, tz=UTC), newest)
            _copy(table, columns, rows, on_conflict_skip=on_conflict_skip)
        else:
            _bulk_create(model, columns, rows)
            TelemetrySource.objects.filter(pk=advance.source_id).update(
                high_seq=advance.high_seq,
                window=_window_bytes(advance.window),
                batches_total=F("batches_total") + 1,
                samples_total=F("samples_total") + len(rows),
                last_batch_at=now,
                last_sample_at=Greatest(Coalesce(F("last_sample_at"), Value(newest)), Value(newest)),
                last_lag_s=lag_s,
            )
        state = (advance.source_id, advance.high_seq, advance.window)
        key = (node.pk, source_name, str(kind))

        def committed() -> None:
            if len(_committed_sources) >= MAX_KNOWN_SOURCES and key not in _committed_sources:
                _committed_sources.clear()  # restarted senders leave old names behind; stay bounded
            _committed_sources[key] = state
            _after_commit(kind, node, rows, lag_s)

        transaction.on_commit(committed)
    return IngestResult(kind, source_name, seq, len(rows), False, newest)


def forget_sources() -> None:
    """Drop the committed-state guesses (tests)."""
    _committed_sources.clear()


def _ingest(kind: str, node: Node, batch: Any, validate: Callable[..., SampleRows]) -> IngestResult:
    now = timezone.now()
    errors = _Errors()
    source, seq, samples = _envelope(batch, errors)
    rows = validate(node, samples, errors, now.timestamp()) if samples else None
    if errors or rows is None:
        metrics.count("omni_telemetry_batches_total", f"{kind},rejected")
        raise errors.reject(len(samples))
    try:
        return _store(kind, node, source, seq, rows, now, on_conflict_skip=False)
    except Exception as exc:
        # A row already stored by another batch (a sender that restarted with a new source id
        # and re-sent): redo this batch skipping such rows. Rare, so the fast path stays COPY.
        if "23505" not in (getattr(exc, "sqlstate", None), getattr(exc.__cause__, "sqlstate", None)):
            raise
        return _store(kind, node, source, seq, rows, now, on_conflict_skip=True)


def ingest_gpu_batch(node: Node, batch: Any) -> IngestResult:
    """Validate, de-duplicate and store one batch of GPU samples from ``node``.

    Raises ``BatchRejected`` (nothing stored) when any sample is invalid. Synchronous and
    database-bound: async callers wrap it in ``database_sync_to_async``.
    """
    return _ingest(BatchKind.GPU, node, batch, validate_gpu_samples)


def ingest_step_batch(node: Node, batch: Any) -> IngestResult:
    """Validate, de-duplicate and store one batch of step records reported by ``node``."""
    return _ingest(BatchKind.STEPS, node, batch, validate_step_samples)


# -- after commit: metrics and throttled live messages ------------------------------------------


class LiveThrottle:
    """Per-stream buffer of new rows, released at most once per ``interval_s`` (AWX's
    ``MAX_WEBSOCKET_EVENT_RATE``). Rows held back ride along with the next message; points are
    built only when a message goes out. A page that (re)connects loads history from
    telemetry.queries."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, list[SampleRows]] = {}
        self._sent_at: dict[str, float] = {}

    def offer(self, key: str, rows: SampleRows, interval_s: float) -> list[SampleRows] | None:
        """Add ``rows``; return everything pending for ``key`` when it may send now."""
        with self._lock:
            pending = self._pending.setdefault(key, [])
            pending.append(rows)
            while len(pending) > 1 and sum(len(chunk) for chunk in pending[1:]) >= MAX_LIVE_POINTS:
                pending.pop(0)
            now = time.monotonic()
            if now - self._sent_at.get(key, -math.inf) < interval_s:
                return None
            self._sent_at[key] = now
            return self._pending.pop(key)


throttle = LiveThrottle()


class LiveSender:
    """Sends telemetry frames to the channel layer from one event-loop thread per process, so
    ingestion never waits on ``async_to_sync`` or the layer. Frames go out after commit and may
    be lost (a full backlog drops them, counted in /metrics): the database stays the truth and a
    page that reconnects reloads it. Messages have jobs.live's shape."""

    MAX_BACKLOG = 256

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._backlog: set[concurrent.futures.Future] = set()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="telemetry-live", daemon=True).start()
            return self._loop

    def send(self, frames: list[tuple[str, str, dict[str, Any]]]) -> None:
        """Queue ``(group, event, payload)`` frames; returns at once."""
        layer = get_channel_layer()
        if layer is None or not frames:
            return
        with self._lock:
            if len(self._backlog) >= self.MAX_BACKLOG:
                metrics.count("omni_telemetry_live_frames_dropped_total", "backlog", len(frames))
                return
        future = asyncio.run_coroutine_threadsafe(self._send_all(layer, frames), self._running_loop())
        with self._lock:
            self._backlog.add(future)
        future.add_done_callback(self._done)

    async def _send_all(self, layer, frames: list[tuple[str, str, dict[str, Any]]]) -> None:
        for group, event, payload in frames:
            await layer.group_send(group, {"type": "live.message", "event": event, "payload": payload})

    def _done(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._backlog.discard(future)
        if not future.cancelled() and future.exception() is not None:
            logger.error("telemetry live frame failed", exc_info=future.exception())

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until every queued frame is sent (tests, shutdown)."""
        with self._lock:
            pending = list(self._backlog)
        concurrent.futures.wait(pending, timeout=timeout_s)


live_sender = LiveSender()


ALLOCATIONS_CACHE_S = 2.0
_allocations: tuple[float, dict[int, dict[int, int]]] = (-math.inf, {})


def _gpu_jobs(node_id: int) -> dict[int, int]:
    """gpu_index -> id of the job holding it, on this node. One query for the whole cluster at
    most every ALLOCATIONS_CACHE_S, so live routing costs no query per batch; a GPU that just
    changed hands may route its points to the old job's page for that long."""
    global _allocations
    fetched_at, by_node = _allocations
    if time.monotonic() - fetched_at > ALLOCATIONS_CACHE_S:
        by_node = {}
        for node, gpu, job in Allocation.objects.values_list("node_id", "gpu_index", "job_id"):
            by_node.setdefault(node, {})[gpu] = job
        _allocations = (time.monotonic(), by_node)
    return by_node.get(node_id, {})


def forget_allocations() -> None:
    """Drop the allocation cache (tests; a process that just moved GPUs)."""
    global _allocations
    _allocations = (-math.inf, {})


def _after_commit(kind: str, node: Node, rows: SampleRows, lag_s: float) -> None:
    metrics.count("omni_telemetry_batches_total", f"{kind},stored")
    metrics.samples_stored(kind, len(rows))
    due = throttle.offer(f"{kind}:{node.pk}", rows, settings.OMNI_TELEMETRY_LIVE_INTERVAL_S)
    if not due:
        return
    frames: list[tuple[str, str, dict[str, Any]]] = []
    if kind == BatchKind.GPU:
        points = _gpu_points(due)
        frames.append(
            (live.node_group(node.pk), "gpu_samples", {"node": node.pk, "node_name": node.name, "points": points})
        )
        gpu_jobs = _gpu_jobs(node.pk)
        by_job: dict[int, list[dict[str, Any]]] = {}
        for point in points:
            job_id = gpu_jobs.get(point["gpu"])
            if job_id is not None:
                by_job.setdefault(job_id, []).append(point)
        for job_id, job_points in by_job.items():
            frames.append((live.job_group(job_id), "gpu_samples",
                           {"job": job_id, "node": node.pk, "node_name": node.name, "points": job_points}))
    else:
        by_job = {}
        for point in _step_points(due):
            by_job.setdefault(point["job"], []).append(point)
        for job_id, job_points in by_job.items():
            frames.append((live.job_group(job_id), "step_records", {"job": job_id, "node": node.pk, "points": job_points}))
    live_sender.send(frames)


def _columns(chunks: list[SampleRows], names: Sequence[str]) -> tuple[dict[str, list], dict[str, list], list[float]]:
    """The newest MAX_LIVE_POINTS rows of ``chunks`` as Python lists per column."""
    def joined(arrays: list[np.ndarray]) -> list:
        return np.concatenate(arrays)[-MAX_LIVE_POINTS:].tolist()

    values = {name: joined([c.values[name] for c in chunks]) for name in names}
    nulls = {name: joined([c.nulls[name] for c in chunks]) for name in names if name in chunks[0].nulls}
    return values, nulls, joined([c.epoch_s for c in chunks])


def _gpu_points(chunks: list[SampleRows]) -> list[dict[str, Any]]:
    values, nulls, at = _columns(chunks, ("gpu_index", "util_pct", "mem_used_bytes", "power_w", "temp_c", "xid_errors"))
    return [
        {"gpu": g, "at": t, "util_pct": u, "mem_used_bytes": m, "power_w": None if pn else p,
         "temp_c": None if tn else c, "xid_errors": x}
        for g, t, u, m, p, pn, c, tn, x in zip(
            values["gpu_index"], at, values["util_pct"], values["mem_used_bytes"], values["power_w"],
            nulls["power_w"], values["temp_c"], nulls["temp_c"], values["xid_errors"], strict=True,
        )
    ]


STEP_POINT_FIELDS = ("step_s", "data_wait_s", "compute_s", "comm_s", "loss")


def _step_points(chunks: list[SampleRows]) -> list[dict[str, Any]]:
    tokens = tuple(f"tokens_{m}" for m in TOKEN_MODALITIES)
    values, nulls, at = _columns(chunks, ("job_id", "rank", "step", *STEP_POINT_FIELDS, *tokens))
    out = []
    for i, at_s in enumerate(at):
        point: dict[str, Any] = {"job": values["job_id"][i], "rank": values["rank"][i], "step": values["step"][i],
                                 "at": at_s}
        for name in STEP_POINT_FIELDS:
            point[name] = None if nulls[name][i] else values[name][i]
        point["tokens"] = {m: values[f"tokens_{m}"][i] for m in TOKEN_MODALITIES if not nulls[f"tokens_{m}"][i]}
        out.append(point)
    return out

"""Ingestion, stage 1: validate a whole batch, column by column, with a message per field.

``envelope`` checks the wrapper (``source``, ``seq``, ``samples``); ``validate_gpu_samples`` and
``validate_step_samples`` check every sample with numpy over whole columns and return the rows
as columns ready for ``COPY`` (``SampleRows``). Problems collect in ``BatchErrors`` under keys
such as ``samples[3].util_pct``; any problem rejects the batch whole (``BatchRejected``).
Field formats and limits are in docs/telemetry.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
from django.conf import settings
from django.core.exceptions import ValidationError

from jobs.models import Allocation, Job, Node
from telemetry.copy import timestamptz_from_epoch_s
from telemetry.partitions import retention_for

MAX_ERRORS_SHOWN = 100
SOURCE_MAX_LENGTH = 128
TOKEN_MODALITIES = ("text", "image", "video", "audio")

GPU_FIELDS = frozenset({"gpu", "at", "util_pct", "mem_used_bytes", "power_w", "temp_c", "xid_errors"})
STEP_FIELDS = frozenset(
    {"job", "rank", "step", "at", "step_s", "data_wait_s", "compute_s", "comm_s", "tokens", "loss"}
)

_MISSING = object()
_NUMBER = (int, float)


class BatchRejected(ValidationError):
    """A batch refused whole. ``errors`` maps ``samples[i].field`` (or ``source``, ``seq``,
    ``samples``) to messages; the API answers 400 with exactly that body."""

    def __init__(self, errors: dict[str, list[str]]):
        super().__init__(errors)
        self.errors = errors

class BatchErrors:
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


def envelope(batch: Any, errors: BatchErrors) -> tuple[str, int, list]:
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


def _objects(samples: list, fields: frozenset[str], errors: BatchErrors) -> np.ndarray:
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
    column: list, ok: np.ndarray, field: str, errors: BatchErrors, *, integer: bool, required: bool,
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
    values: np.ndarray, nulls: np.ndarray, ok: np.ndarray, field: str, errors: BatchErrors,
    low: float, high: float, what: str,
) -> None:
    bad = ~((values >= low) & (values <= high)) & ~nulls & ok
    for i in np.flatnonzero(bad):
        value = values[i]
        if not math.isfinite(value) and int(i) in errors.bad_samples:
            continue  # already reported as the wrong type
        shown = "not finite" if not math.isfinite(value) else f"{value:g}"
        errors.sample(int(i), field, f"{what}, got {shown}")


def _times(column: list, ok: np.ndarray, errors: BatchErrors, now_s: float) -> np.ndarray:
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
    for i in np.flatnonzero(~finite & ok):
        if int(i) not in errors.bad_samples:
            errors.sample(int(i), "at", "expected a finite time")
    for i in np.flatnonzero(finite & (values > now_s + future_s) & ok):
        errors.sample(int(i), "at", f"{values[i] - now_s:.0f} s in the future (at most {future_s:g} s ahead allowed)")
    for i in np.flatnonzero(finite & (values < oldest_s) & ok):
        errors.sample(int(i), "at", "older than the raw retention; such samples would be dropped at once")
    return values


def _duplicates(keys: Sequence[np.ndarray], ok: np.ndarray, errors: BatchErrors, field: str) -> None:
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


def validate_gpu_samples(node: Node, samples: list, errors: BatchErrors, now_s: float) -> SampleRows:
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


def validate_step_samples(node: Node, samples: list, errors: BatchErrors, now_s: float, *,
                          placed_only: bool = False) -> SampleRows:
    """Checks of step records reported by ``node`` (fewer than GPU samples; plainer code).

    ``placed_only``: each record's job must hold GPUs on ``node`` now (an agent reports its own
    jobs' ranks, never another node's: the HTTP endpoint, like the agent socket).
    """
    ok = _objects(samples, STEP_FIELDS, errors)
    job, _ = _numbers(_column(samples, ok, "job"), ok, "job", errors, integer=True, required=True)
    # Ids are exact in float64 up to 2**53, far beyond any job table.
    plausible = (job >= 1) & (job <= 2.0**53)
    _check_range(job, np.zeros(len(job), dtype=bool), ok, "job", errors, 1, 2.0**53, "no job has this id")
    job_ids = {int(j) for j in job[plausible]}
    known = set(Job.objects.filter(pk__in=job_ids).values_list("pk", flat=True)) if job_ids else set()
    placed = set(
        Allocation.objects.filter(node=node, job_id__in=known).values_list("job_id", flat=True)
    ) if placed_only and known else known
    for i in np.flatnonzero(ok & plausible):
        if int(job[i]) not in known:
            errors.sample(int(i), "job", f"unknown job {int(job[i])}")
        elif int(job[i]) not in placed:
            errors.sample(int(i), "job", f"job {int(job[i])} is not placed on node {node.name}: an agent may "
                          "report only its own node's jobs")
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

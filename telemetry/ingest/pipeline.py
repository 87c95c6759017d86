"""The ingestion entry points: one batch through validate, sequence window, store, live.

``ingest_gpu_batch(node, batch)`` and ``ingest_step_batch(node, batch)`` are what every sender
calls (docs/telemetry.md); the stages are ``validate``, ``sequence``, ``store`` and ``live``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from django.utils import timezone

from jobs.models import Node
from telemetry import metrics
from telemetry.ingest.store import IngestResult, store_batch
from telemetry.ingest.validate import (
    BatchErrors,
    SampleRows,
    envelope,
    validate_gpu_samples,
    validate_step_samples,
)
from telemetry.models import BatchKind


def _ingest(kind: str, node: Node, batch: Any, validate: Callable[..., SampleRows]) -> IngestResult:
    now = timezone.now()
    errors = BatchErrors()
    source, seq, samples = envelope(batch, errors)
    rows = validate(node, samples, errors, now.timestamp()) if samples else None
    if errors or rows is None:
        metrics.count("omni_telemetry_batches_total", f"{kind},rejected")
        raise errors.reject(len(samples))
    try:
        return store_batch(kind, node, source, seq, rows, now, on_conflict_skip=False)
    except Exception as exc:
        # A row already stored by another batch (a sender that restarted with a new source id
        # and re-sent): redo this batch skipping such rows. Rare, so the fast path stays COPY.
        if "23505" not in (getattr(exc, "sqlstate", None), getattr(exc.__cause__, "sqlstate", None)):
            raise
        return store_batch(kind, node, source, seq, rows, now, on_conflict_skip=True)


def ingest_gpu_batch(node: Node, batch: Any) -> IngestResult:
    """Validate, de-duplicate and store one batch of GPU samples from ``node``.

    Raises ``BatchRejected`` (nothing stored) when any sample is invalid. Synchronous and
    database-bound: async callers wrap it in ``database_sync_to_async``.
    """
    return _ingest(BatchKind.GPU, node, batch, validate_gpu_samples)


def ingest_step_batch(node: Node, batch: Any, *, placed_only: bool = False) -> IngestResult:
    """Validate, de-duplicate and store one batch of step records reported by ``node``;
    ``placed_only``: every record's job must be placed on ``node`` (what an agent may send)."""
    return _ingest(BatchKind.STEPS, node, batch, partial(validate_step_samples, placed_only=placed_only))

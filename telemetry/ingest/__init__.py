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

One module per stage: ``validate``, ``sequence`` (the de-duplication window), ``store`` and
``live`` (after commit); ``pipeline`` runs a batch through them. This package re-exports the
names callers use.
"""

from telemetry.ingest.live import forget_allocations, throttle
from telemetry.ingest.pipeline import ingest_gpu_batch, ingest_step_batch
from telemetry.ingest.sequence import accept_sequence, forget_sources
from telemetry.ingest.store import GPU_COLUMNS, STEP_COLUMNS, IngestResult
from telemetry.ingest.validate import (
    BatchErrors,
    BatchRejected,
    SampleRows,
    validate_gpu_samples,
    validate_step_samples,
)

# The name bench.ingest imports for the validation error collector.
_Errors = BatchErrors

__all__ = [
    "GPU_COLUMNS",
    "STEP_COLUMNS",
    "BatchErrors",
    "BatchRejected",
    "IngestResult",
    "SampleRows",
    "accept_sequence",
    "forget_allocations",
    "forget_sources",
    "ingest_gpu_batch",
    "ingest_step_batch",
    "throttle",
    "validate_gpu_samples",
    "validate_step_samples",
]

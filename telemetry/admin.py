"""Admin for telemetry: sender streams (de-duplication state and totals) and rollup watermarks,
read-only and never deleted: they are written only by ingestion and the rollup task, and a
deleted stream would forget its anti-replay window and accept re-sent batches again. Samples and
rollups are time series with composite keys: read them through telemetry.queries, the pages and
/metrics, not row by row here."""

from __future__ import annotations

from django.contrib import admin

from jobs.admin import ReadOnlyAdmin
from telemetry.models import RollupWatermark, TelemetrySource


@admin.register(TelemetrySource)
class TelemetrySourceAdmin(ReadOnlyAdmin):
    list_display = ["name", "kind", "node", "high_seq", "batches_total", "samples_total", "duplicates_total",
                    "last_batch_at", "last_lag_s"]
    list_filter = ["kind"]
    list_select_related = ["node"]
    search_fields = ["name", "node__name"]
    exclude = ["window"]


@admin.register(RollupWatermark)
class RollupWatermarkAdmin(ReadOnlyAdmin):
    list_display = ["level", "rolled_until", "updated_at"]

"""Admin for telemetry: sender streams (de-duplication state and totals) and rollup watermarks,
read-only. Samples and rollups are time series with composite keys: read them through
telemetry.queries, the pages and /metrics, not row by row here."""

from __future__ import annotations

from django.contrib import admin

from telemetry.models import RollupWatermark, TelemetrySource


class ReadOnlyAdmin(admin.ModelAdmin):
    """Written only by ingestion and the rollup task."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


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

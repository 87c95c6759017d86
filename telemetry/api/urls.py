"""Routes of the telemetry API, under /api/telemetry/."""

from django.urls import path

from telemetry.api.views import GpuBatchView, StepBatchView

urlpatterns = [
    path("gpu", GpuBatchView.as_view(), name="telemetry-gpu"),
    path("steps", StepBatchView.as_view(), name="telemetry-steps"),
]

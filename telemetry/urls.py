"""Page-level routes of the telemetry app: the Prometheus endpoint."""

from django.urls import path

from telemetry.views import metrics_view

urlpatterns = [
    path("metrics", metrics_view, name="metrics"),
]

"""App config for the telemetry app."""

from django.apps import AppConfig


class TelemetryConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "telemetry"

    def ready(self) -> None:
        # Register the Celery tasks now, so the embedded in-process loop finds them by name
        # without a worker's autodiscovery.
        from telemetry import tasks  # noqa: F401

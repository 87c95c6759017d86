"""App config for the jobs app."""

from django.apps import AppConfig


class JobsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "jobs"
    verbose_name = "Jobs and cluster"

    def ready(self) -> None:
        # Live pages: every committed audit row is broadcast to the groups that show it.
        from jobs import live_events

        live_events.connect()
        # Register the Celery tasks in every process (web, worker, management commands): actions
        # trigger them by name (jobs.actions._common.trigger_plan), never by importing them.
        from jobs import tasks  # noqa: F401

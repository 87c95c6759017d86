"""App config for the jobs app."""

from django.apps import AppConfig
from django.db.models.signals import post_migrate


def regrant_app_role(sender, using: str = "default", **kwargs) -> None:
    """After every migrate, re-grant ``OMNI_APP_DB_ROLE`` so tables added since are covered and the
    audit table stays SELECT/INSERT only for it (jobs.audit.grant_app_role)."""
    from django.conf import settings
    from django.db import connections, transaction

    from jobs.audit import grant_app_role

    if settings.OMNI_APP_DB_ROLE and connections[using].vendor == "postgresql":
        with transaction.atomic(using=using):
            grant_app_role(settings.OMNI_APP_DB_ROLE, using=using)


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

        # Sent once per app after all migrations ran: sender=self makes it run once per migrate.
        post_migrate.connect(regrant_app_role, sender=self, dispatch_uid="jobs.regrant_app_role")

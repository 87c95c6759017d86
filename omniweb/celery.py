"""The Celery app. Queues are named in one enum and the whole beat schedule is in
omniweb.scheduled, so every periodic task is visible in one place (PostHog's convention)."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "omniweb.settings")

app = Celery("omniweb")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.on_after_finalize.connect
def setup_periodic_tasks(sender: Celery, **kwargs) -> None:
    from omniweb.scheduled import setup_periodic_tasks as setup

    setup(sender)

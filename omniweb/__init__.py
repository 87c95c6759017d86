"""Omni's Django project: settings, ASGI routing, the Celery app and root URLs."""

from omniweb.celery import app as celery_app

__all__ = ["celery_app"]

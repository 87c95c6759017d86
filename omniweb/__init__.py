"""Omni's Django project: settings, ASGI routing, the Celery app and root URLs."""

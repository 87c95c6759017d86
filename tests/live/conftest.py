"""Fixtures for the live-page tests: role groups survive transactional tests' table flushes."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def role_groups(request):
    """Transactional tests empty every table between tests, migration-made groups included."""
    if "transactional_db" not in request.fixturenames and not request.node.get_closest_marker("django_db"):
        return
    request.getfixturevalue("db" if "transactional_db" not in request.fixturenames else "transactional_db")
    from django.contrib.auth.models import Group

    from jobs.roles import ROLES

    for name in ROLES:
        Group.objects.get_or_create(name=name)

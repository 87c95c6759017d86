"""Shared fixtures: one user per role plus an outsider, built the way production builds them,
and the rules that turn a missing real server into a visible skip (or, in CI, an error)."""

from __future__ import annotations

import os

import pytest
from django.contrib.auth.models import Group

from jobs.roles import AUDITOR, OPERATOR, RESEARCHER

REQUIRE_SERVICES = os.environ.get("OMNI_REQUIRE_SERVICES") == "1"


def _missing(reason: str) -> None:
    if REQUIRE_SERVICES:
        pytest.fail(f"OMNI_REQUIRE_SERVICES=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("postgres"):
        from django.db import connection

        if connection.vendor != "postgresql":
            _missing("needs PostgreSQL: this run uses the embedded SQLite database")
    if item.get_closest_marker("redis") and not os.environ.get("OMNI_TEST_REDIS_URL"):
        _missing("needs Redis: none answered on 127.0.0.1:6379 and REDIS_URL is unset")


@pytest.fixture(autouse=True)
def _own_audit_heads(settings, tmp_path):
    """Each test publishes and reads audit heads in its own file: the checkout's
    var/audit-heads.jsonl, written by ``make demo``, names rows a test database does not hold."""
    settings.OMNI_AUDIT_HEADS = tmp_path / "audit-heads.jsonl"


@pytest.fixture(autouse=True)
def _fresh_process_state():
    """Process-local caches (known partitions, sequence windows, allocation routing) start empty in
    every test: a cached partition or source state from a rolled-back test would lie to the next."""
    from jobs import live_events
    from jobs.actions import nodes
    from jobs.api import throttles
    from telemetry import ingest, metrics, partitions

    throttles.forget_failures()  # every test client is 127.0.0.1: one test's bad logins are not the next's
    metrics.reset()
    partitions.forget_known_partitions()
    ingest.throttle.reset()
    live_events.reset_summaries()  # the cluster summary's per-process throttle, and its timer
    ingest.forget_allocations()
    ingest.forget_sources()
    nodes.forget_outage()  # a control-plane outage the heartbeat monitor remembers
    yield


def _user(django_user_model, username: str, role: str | None):
    user = django_user_model.objects.create_user(username=username, password=f"{username}-pass-1234")
    if role is not None:
        # A transactional test before this one flushed the tables, the role groups the migration
        # made with them: the role is the group's name (jobs/roles.py), so make it again.
        user.groups.add(Group.objects.get_or_create(name=role)[0])
    return user


@pytest.fixture
def researcher(db, django_user_model):
    return _user(django_user_model, "rita", RESEARCHER)


@pytest.fixture
def other_researcher(db, django_user_model):
    return _user(django_user_model, "rob", RESEARCHER)


@pytest.fixture
def operator(db, django_user_model):
    return _user(django_user_model, "olive", OPERATOR)


@pytest.fixture
def auditor(db, django_user_model):
    return _user(django_user_model, "aud", AUDITOR)


@pytest.fixture
def outsider(db, django_user_model):
    return _user(django_user_model, "otto", None)


def api_client(user=None):
    from rest_framework.test import APIClient

    client = APIClient(enforce_csrf_checks=True)
    if user is not None:
        client.force_authenticate(user)
    return client


@pytest.fixture
def make_job(researcher):
    """Submit a job through the real action; keyword arguments override the defaults."""
    from jobs import actions

    def make(owner=None, **overrides):
        spec = dict(
            name=f"job-{make.counter}", priority="regular", tp=1, pp=1, dp=2, dp_min=1, dp_max=4,
            global_batch=64, micro_batch=4, total_steps=1000, step_s=1.0,
        )
        make.counter += 1
        spec.update(overrides)
        return actions.submit_job(owner or researcher, **spec)

    make.counter = 0
    return make


@pytest.fixture
def make_nodes(db):
    """A small regular cluster named like the scenarios: r{rack}s{switch}n{node}."""
    from jobs.models import Node

    def make(racks=1, switches=2, nodes=2, gpus=8):
        Node.objects.bulk_create(
            Node(name=f"r{r}s{s}n{n}", rack=f"r{r}", switch=f"r{r}s{s}", gpu_count=gpus)
            for r in range(racks) for s in range(switches) for n in range(nodes)
        )
        return list(Node.objects.order_by("name"))

    return make


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Say plainly how many tests the missing servers cost, so a skip is never silent."""
    counts: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if reason.startswith("needs "):
            counts[reason] = counts.get(reason, 0) + 1
    for reason, n in sorted(counts.items()):
        terminalreporter.write_line(f"[omni tests] {n} test(s) SKIPPED: {reason}", yellow=True)

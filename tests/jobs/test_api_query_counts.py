"""Pinned query counts of the API's cluster lists (nodes, reservations, the audit log): the same
number of queries for 3 rows as for 30, so an N+1 cannot slip in."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import actions
from tests.conftest import api_client

pytestmark = pytest.mark.django_db

# The viewer's roles, the page's count, the page; nodes also their allocations (one prefetch).
LISTS = [("/api/nodes/", 4), ("/api/reservations/", 3), ("/api/events/", 3)]


@pytest.fixture
def grow_cluster(operator, researcher, make_job):
    """Add ``n`` nodes, each with a researcher's job on it and a critical job's reservation."""
    from jobs.models import Node

    def grow(n: int) -> None:
        first = Node.objects.count()
        for i in range(first, first + n):
            node = Node.objects.create(name=f"q{i}", rack="r0", switch="r0s0", gpu_count=2)
            job = make_job(name=f"job-{i}", dp=1, dp_min=1, dp_max=1, global_batch=4, micro_batch=4)
            actions.place_job(job, [(node, 0)], actor="test", reason={})
            critical = make_job(owner=operator, name=f"crit-{i}", priority="critical", dp=1, dp_min=1, dp_max=1,
                                global_batch=4, micro_batch=4)
            actions.create_reservation(operator, name=f"window-{i}", job=critical, gpus=1,
                                       start_at=timezone.now() + timedelta(hours=1),
                                       end_at=timezone.now() + timedelta(hours=2))

    return grow


@pytest.mark.parametrize(("url", "queries"), LISTS)
@pytest.mark.parametrize("role", ["researcher", "operator", "auditor"])
def test_cluster_lists_take_the_same_queries_for_3_rows_as_for_30(
    request, url, queries, role, grow_cluster, django_user_model, django_assert_num_queries
):
    user = request.getfixturevalue(role)
    counts = []
    for rows in (3, 27):
        grow_cluster(rows)
        # A fresh user object each time, as each request has: its roles are not cached yet.
        client = api_client(django_user_model.objects.get(pk=user.pk))
        with django_assert_num_queries(queries):
            response = client.get(url)
        assert response.status_code == 200
        counts.append(response.json()["count"])
    assert counts[1] > counts[0] >= 3

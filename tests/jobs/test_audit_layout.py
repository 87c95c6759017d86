"""The audit page's "DP × accum" column: what a row changed, and nothing where it changed nothing.
A hold or a health check read "2×· →" (a layout going to nothing, its accumulation unknown), a
reclaim "2×4 → 0×·"."""

from __future__ import annotations

import pytest
from django.db import transaction

from jobs import actions
from jobs.actions.rhythm import _record_health
from jobs.models import ElasticEvent, EventKind
from jobs.views import _change, _layout

pytestmark = pytest.mark.django_db


def _column(event: ElasticEvent) -> str:
    return _change(_layout(event.dp_before, event.accum_before), _layout(event.dp_after, event.accum_after))


def _last(kind: str) -> ElasticEvent:
    return ElasticEvent.objects.filter(kind=kind).latest("id")


def test_each_row_shows_the_layout_it_changed_or_kept(make_job, make_nodes, researcher):
    (node,) = make_nodes(racks=1, switches=1, nodes=1, gpus=8)
    waiting = make_job()  # dp 2, micro-batch 4, global batch 64: accumulation 8
    assert _column(_last(EventKind.SUBMIT)) == "→ 2×8"
    actions.cancel_job(waiting, researcher)
    assert _column(_last(EventKind.CANCEL)) == ""  # it never ran: no layout went anywhere

    running = make_job()
    actions.place_job(running, [(node, 0), (node, 1)], actor="test", reason={})
    assert _column(_last(EventKind.PLACE)) == "2×8"
    with transaction.atomic():
        _record_health(running, {"healthy": True, "text": "healthy", "step": 10, "kind": "resume"})
    assert _column(_last(EventKind.HEALTH_CHECK)) == "2×8"  # a check changes nothing
    actions.cancel_job(running, researcher)
    assert _column(_last(EventKind.CANCEL)) == "2×8 → 0"


def test_a_stop_reads_to_no_replica_and_an_old_row_keeps_its_unknown_accumulation():
    assert _change(_layout(2, 4), _layout(0, None)) == "2×4 → 0"
    assert _change(_layout(2, None), _layout(None, None)) == "2×· →"

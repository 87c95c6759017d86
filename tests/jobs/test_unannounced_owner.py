"""A pool whose job has not arrived, in production: when the team's critical job arrives and can
start nowhere else, the planner's pass stops a borrower that could not save within the grace
without a checkpoint, through the real actions: a ``kill`` audit row (rule ``harvest.reclaim``,
the steps lost), a kill command to its node, its GPUs back at once. With free GPUs elsewhere the
job starts there and nobody loses work."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import actions
from jobs.models import Command, ElasticEvent, EventKind, Job, JobState, Node
from jobs.snapshot import reservation_pools

pytestmark = pytest.mark.django_db

PLACED = {"rule": "test", "text": "placed by the test", "inputs": {}}


@pytest.mark.parametrize("general_busy", [True, False])
def test_an_unannounced_critical_job_stops_a_slow_saving_borrower_without_a_checkpoint(
        operator, make_job, make_nodes, general_busy):
    make_nodes(racks=1, switches=1, nodes=2, gpus=2)
    Node.objects.update(last_heartbeat_at=timezone.now())  # answering agents
    vision = actions.create_team(operator, name="vision", quota_gpus=2)
    res = actions.create_reservation(operator, name="vision-pool", team=vision, gpus=2,
                                     start_at=timezone.now() - timedelta(hours=1))
    (pool_node,) = reservation_pools([res], list(Node.objects.order_by("name")))["vision-pool"]
    node = Node.objects.get(name=pool_node)
    general = Node.objects.exclude(name=pool_node).get()
    if general_busy:
        other = make_job(owner=operator, name="other", dp=2, dp_min=2, dp_max=2)
        actions.place_job(other, [(general, 0), (general, 1)], actor="planner", reason=PLACED)
    borrower = make_job(owner=operator, name="slow", priority="best_effort", dp=2, dp_min=2, dp_max=2,
                        step_s=1.0, checkpoint_every_steps=50, checkpoint_save_s=120.0)
    actions.place_job(borrower, [(node, 0), (node, 1)], actor="planner", reason=PLACED, borrowed_from=res)
    Job.objects.filter(pk=borrower.pk).update(committed_steps=130, last_checkpoint_step=100)
    actions.run_planner_pass("test")
    assert not ElasticEvent.objects.filter(kind=EventKind.KILL).exists()  # nobody to make room for yet

    crit = make_job(owner=operator, name="crit", priority="critical", team=vision, dp=2, dp_min=2, dp_max=2)
    actions.run_planner_pass("test")
    if not general_busy:
        # It starts on the free node instead: nobody loses work for it.
        assert not ElasticEvent.objects.filter(kind=EventKind.KILL).exists()
        assert {a.node.name for a in crit.allocations.select_related("node")} == {general.name}
        return
    kill = ElasticEvent.objects.get(kind=EventKind.KILL, job_name="slow")
    assert kill.reason["rule"] == "harvest.reclaim" and kill.reason["inputs"]["unsaved"] is True
    assert kill.reason["inputs"]["steps_lost"] == 30 and kill.reason["inputs"]["steps_since_save"] == 30
    assert "stopped without a checkpoint" in kill.reason["text"]
    borrower.refresh_from_db()
    assert borrower.state == JobState.PREEMPTED and borrower.committed_steps == 100
    assert not borrower.allocations.exists()
    assert Command.objects.filter(job=borrower, payload__kill=True).exists()

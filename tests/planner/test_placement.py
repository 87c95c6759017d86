"""Rule 6: placement by topology."""

from __future__ import annotations

from jobs.planner import plan
from jobs.planner.topology import choose_gpus, spread_of, topology_distance
from tests.planner.factory import cluster, gpus_on, job, snapshot


def _free(nodes, busy=()):
    return {n.name: list(range(n.gpus)) for n in nodes if n.name not in busy}


def test_topology_distance_is_node_switch_rack_other() -> None:
    nodes = {n.name: n for n in cluster(racks=2, switches=2, per_switch=2)}
    a = nodes["r0s0n0"]
    assert [topology_distance(a, nodes[b]) for b in ("r0s0n0", "r0s0n1", "r0s1n0", "r1s0n0")] == [0, 1, 2, 3]


def test_a_job_that_fits_one_switch_lands_on_one_switch() -> None:
    nodes = cluster(racks=2, switches=2, per_switch=4)
    by_name = {n.name: n for n in nodes}
    gpus = choose_gpus(_free(nodes), by_name, tp=8, pp=1, replicas=4)
    assert gpus is not None and spread_of(gpus, by_name).switches == 1


def test_the_tightest_switch_that_fits_is_chosen() -> None:
    nodes = cluster(switches=2, per_switch=4)
    by_name = {n.name: n for n in nodes}
    free = _free(nodes, busy=("r0s1n0", "r0s1n1"))  # switch 1 has exactly 2 nodes left
    gpus = choose_gpus(free, by_name, tp=8, pp=1, replicas=2)
    assert gpus is not None and {g.node for g in gpus} == {"r0s1n2", "r0s1n3"}


def test_a_tp_group_is_never_split_across_nodes() -> None:
    nodes = cluster(switches=1, per_switch=2)
    by_name = {n.name: n for n in nodes}
    free = {"r0s0n0": [0, 1, 2, 3, 4, 5], "r0s0n1": [0, 1, 2, 3, 4, 5]}
    assert choose_gpus(free, by_name, tp=8, pp=1, replicas=1) is None
    gpus = choose_gpus(free, by_name, tp=4, pp=1, replicas=2)
    assert gpus is not None
    for i in range(0, 8, 4):
        assert len({g.node for g in gpus[i:i + 4]}) == 1


def test_fewest_racks_when_no_switch_is_big_enough() -> None:
    nodes = cluster(racks=2, switches=2, per_switch=2)
    by_name = {n.name: n for n in nodes}
    gpus = choose_gpus(_free(nodes), by_name, tp=8, pp=1, replicas=4)
    assert gpus is not None
    assert spread_of(gpus, by_name).racks == 1 and spread_of(gpus, by_name).switches == 2


def test_anchor_nodes_pull_the_choice_toward_them() -> None:
    nodes = cluster(racks=2, switches=1, per_switch=4)
    by_name = {n.name: n for n in nodes}
    gpus = choose_gpus(_free(nodes), by_name, tp=8, pp=1, replicas=1, anchor=("r1s0n2",))
    assert gpus is not None and gpus[0].node.startswith("r1")


def test_the_spread_is_reported_in_the_reason() -> None:
    result = plan(snapshot(cluster(), [job("a", dp=4, tp=8)]), 0.0)
    (place,) = result.by_kind("place")
    assert place.reason.inputs["spread_switches"] == 1
    assert "1 switch" in place.reason.text
    assert place.gpus_after == gpus_on("r0s0n0", "r0s0n1", "r0s0n2", "r0s0n3")

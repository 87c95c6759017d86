"""Rule 6, placement by topology, and the mutable view of free GPUs one pass works on.

A job's replicas are packed onto the fewest switches, then the fewest racks: if one switch
can hold the whole request the tightest such switch is used (keeping big holes whole for big
jobs), else one rack, else the roomiest racks first. A TP group (``tp`` GPUs) always sits on
one node; a replica is ``pp`` consecutive TP groups. ``anchor`` nodes (a job's survivors or
previous nodes) pull the choice toward them: nearest in topology first.

Topology distance: same node 0, same switch 1, same rack 2, otherwise 3.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from jobs.planner.kept import KeptById
from jobs.planner.snapshot import Gpu, Job, Node, Reservation, Snapshot, holding_gpus


def topology_distance(a: Node, b: Node) -> int:
    """0 same node, 1 same switch, 2 same rack, 3 otherwise."""
    if a.name == b.name:
        return 0
    if a.rack == b.rack and a.switch == b.switch:
        return 1
    if a.rack == b.rack:
        return 2
    return 3


@dataclass(frozen=True, slots=True)
class Spread:
    """How widely a set of GPUs is spread: the placement score reported in reasons."""

    nodes: int
    switches: int
    racks: int

    def as_inputs(self) -> dict[str, int]:
        """The spread as reason inputs."""
        return {"spread_nodes": self.nodes, "spread_switches": self.switches, "spread_racks": self.racks}

    def describe(self) -> str:
        """e.g. ``4 nodes under 1 switch in 1 rack``."""
        def plural(n: int, word: str) -> str:
            return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('ch') else 's'}"

        return f"{plural(self.nodes, 'node')} under {plural(self.switches, 'switch')} in {plural(self.racks, 'rack')}"


def spread_of(gpus: Iterable[Gpu], nodes: Mapping[str, Node]) -> Spread:
    """The spread of ``gpus`` over nodes, switches and racks."""
    names = {g.node for g in gpus}
    switches = {(nodes[n].rack, nodes[n].switch) for n in names}
    racks = {nodes[n].rack for n in names}
    return Spread(len(names), len(switches), len(racks))


#: (a job's holdings tuple, its GPU indexes per node in holding order), for ``ClusterView``.
_HELD = KeptById()


def held_indexes(job: Job) -> tuple[tuple[str, list[int]], ...]:
    """The GPU indexes ``job`` holds on each node, in holding order (kept per holdings tuple:
    every pass's view of who holds what reads them)."""
    held = job.holdings
    hit = _HELD.get(id(held))
    if hit is None or hit[0] is not held:
        by_node: dict[str, list[int]] = {}
        for h in held:
            by_node.setdefault(h.gpu.node, []).append(h.gpu.index)
        hit = _HELD.keep(held, tuple(by_node.items()))
    return hit[1]


class ClusterView:
    """Who holds which GPU and which GPUs are free, updated as a pass makes decisions.

    Free GPUs are indexed by *zone*: ``None`` for general capacity, a reservation name for
    GPUs in that reservation's pool. Only nodes that take new work (``Node.takes_new_work``:
    a placeable health and enough disk) have free GPUs.
    """

    def __init__(self, snapshot: Snapshot) -> None:
        static = _static_topology(snapshot.nodes)
        self.nodes: dict[str, Node] = static.nodes
        self.switch_of = static.switch_of
        self.nodes_of_switch = static.nodes_of_switch
        #: Each node's zone: the first reservation (by name) that covers it, else None (never mutated).
        self.zone_of_node: Mapping[str, str | None] = _zone_map(static, snapshot.reservations)
        self.owner: dict[Gpu, str] = {}
        self.held_by_node: dict[str, set[int]] = {}
        _HELD.trim(len(snapshot.jobs))
        for job in holding_gpus(snapshot.jobs):
            self.owner.update(dict.fromkeys(job.gpus, job.name))
            for node, idx in held_indexes(job):
                held = self.held_by_node.get(node)
                if held is None:
                    self.held_by_node[node] = set(idx)
                else:
                    held.update(idx)
        self.free: dict[str | None, dict[str, list[int]]] = {}
        self.zone_total: dict[str | None, int] = {}
        self._sw_groups: dict[tuple[str | None, int], dict[tuple[str, str], int]] = {}
        #: Bumped on every change, so callers can cache answers about the free set.
        self.generation = 0
        self._groups: dict[tuple[str | None, int], int] = {}
        self._group_tps: dict[str | None, list[int]] = {}
        self._sw_group_tps: dict[str | None, list[int]] = {}
        for name in static.sorted_names:
            node = self.nodes[name]
            if not node.takes_new_work:
                continue
            held = self.held_by_node.get(name)
            idx = [i for i in range(node.gpus) if i not in held] if held else list(range(node.gpus))
            if idx:
                zone = self.zone_of_node[name]
                self.free.setdefault(zone, {})[name] = idx
                self.zone_total[zone] = self.zone_total.get(zone, 0) + len(idx)

    def _node_free(self, node: str) -> int:
        return len(self.free.get(self.zone_of_node.get(node), {}).get(node, ()))

    def _update_groups(self, before: dict[str, int]) -> None:
        if not self._groups and not self._sw_groups:
            return
        for node, old in before.items():
            zone = self.zone_of_node.get(node)
            new = self._node_free(node)
            # Only the counters of this node's zone (indexed by zone, not scanned).
            for tp in self._group_tps.get(zone, ()):
                self._groups[(zone, tp)] += new // tp - old // tp
            for tp in self._sw_group_tps.get(zone, ()):
                delta = new // tp - old // tp
                if delta:
                    by_switch = self._sw_groups[(zone, tp)]
                    sw = self.switch_of[node]
                    by_switch[sw] = by_switch.get(sw, 0) + delta

    def switch_groups(self, zone: str | None, tp: int) -> dict[tuple[str, str], int]:
        """Free ``tp``-GPU groups per (rack, switch) in a zone (kept up to date incrementally)."""
        key = (zone, tp)
        if key not in self._sw_groups:
            by_switch: dict[tuple[str, str], int] = {}
            for node, idx in self.free.get(zone, {}).items():
                g = len(idx) // tp
                if g:
                    sw = self.switch_of[node]
                    by_switch[sw] = by_switch.get(sw, 0) + g
            self._sw_groups[key] = by_switch
            self._sw_group_tps.setdefault(zone, []).append(tp)
        return self._sw_groups[key]

    def place(
        self,
        zones: Mapping[str | None, int | None],
        tp: int,
        pp: int,
        replicas: int,
        anchor: Sequence[str] = (),
    ) -> tuple[Gpu, ...] | None:
        """``choose_gpus`` over the zones' free GPUs, looking only at the switches that can matter.

        Switch-level group counts are kept incrementally, so a placement reads the nodes of
        the few switches it could use (plus those of anchor switches) instead of every free
        node in the cluster. The choice is the same as ``choose_gpus`` over all of them.
        """
        need = replicas * pp
        caps: dict[tuple[str, str], int] = {}
        limited: dict[str, list[int]] = {}
        for zone, limit in zones.items():
            if limit is None:
                for sw, g in self.switch_groups(zone, tp).items():
                    if g > 0:
                        caps[sw] = caps.get(sw, 0) + g
            else:
                for node, idx in self.candidates({zone: limit}).items():
                    limited.setdefault(node, []).extend(idx)
        for node, idx in limited.items():
            g = len(idx) // tp
            if g:
                sw = self.switch_of[node]
                caps[sw] = caps.get(sw, 0) + g
        if sum(caps.values()) < need:
            return None
        anchor_sw = {self.switch_of[n] for n in anchor if n in self.switch_of}
        fitting = [sw for sw, c in caps.items() if c >= need]
        if fitting:
            best = min(fitting, key=lambda sw: (sw not in anchor_sw, caps[sw], sw))
            wanted = {best} | (anchor_sw & set(fitting))
        else:
            wanted = set(caps)
        free: dict[str, list[int]] = {}
        for zone, limit in zones.items():
            if limit is not None:
                continue
            zone_free = self.free.get(zone, {})
            for sw in wanted:
                for node in self.nodes_of_switch.get(sw, ()):
                    idx = zone_free.get(node)
                    if idx:
                        free.setdefault(node, []).extend(idx)
        for node, idx in limited.items():
            if self.switch_of[node] in wanted:
                free.setdefault(node, []).extend(idx)
        return choose_gpus(free, self.nodes, tp, pp, replicas, anchor)

    def free_groups(self, zone: str | None, tp: int) -> int:
        """How many ``tp``-GPU groups (each on one node) the zone's free GPUs can form now."""
        key = (zone, tp)
        if key not in self._groups:
            self._groups[key] = sum(len(idx) // tp for idx in self.free.get(zone, {}).values())
            self._group_tps.setdefault(zone, []).append(tp)
        return self._groups[key]

    def zone(self, gpu: Gpu) -> str | None:
        """The zone (reservation pool name or None) a GPU belongs to."""
        return self.zone_of_node.get(gpu.node)

    def free_count(self, zone: str | None) -> int:
        """Free GPUs in a zone."""
        return self.zone_total.get(zone, 0)

    def take(self, job: str, gpus: Iterable[Gpu]) -> None:
        """Mark ``gpus`` as held by ``job``."""
        self.generation += 1
        gpus = list(gpus)
        before = {n: self._node_free(n) for n in {g.node for g in gpus}}
        for g in gpus:
            self.owner[g] = job
            self.held_by_node.setdefault(g.node, set()).add(g.index)
            zone_free = self.free.get(self.zone_of_node[g.node])
            if zone_free is None or g.node not in zone_free:
                continue
            lst = zone_free[g.node]
            if g.index in lst:
                lst.remove(g.index)
                zone = self.zone_of_node[g.node]
                self.zone_total[zone] = self.zone_total.get(zone, 0) - 1
            if not lst:
                del zone_free[g.node]
        self._update_groups(before)

    def release(self, gpus: Iterable[Gpu]) -> None:
        """Mark ``gpus`` as free again (only those on nodes that take new work become placeable)."""
        self.generation += 1
        gpus = list(gpus)
        before = {n: self._node_free(n) for n in {g.node for g in gpus}}
        for g in gpus:
            self.owner.pop(g, None)
            held = self.held_by_node.get(g.node)
            if held is not None:
                held.discard(g.index)
            node = self.nodes.get(g.node)
            if node is None or not node.takes_new_work:
                continue
            zone = self.zone_of_node[g.node]
            lst = self.free.setdefault(zone, {}).setdefault(g.node, [])
            if g.index not in lst:
                lst.append(g.index)
                lst.sort()
                self.zone_total[zone] = self.zone_total.get(zone, 0) + 1
        self._update_groups(before)

    def candidates(self, zones: Mapping[str | None, int | None]) -> dict[str, list[int]]:
        """Free GPU indices per node drawn from ``zones`` (zone -> at most this many, None = all)."""
        out: dict[str, list[int]] = {}
        for zone in sorted(zones, key=lambda z: (z is not None, z or "")):
            limit = zones[zone]
            zone_free = self.free.get(zone)
            if not zone_free:
                continue
            if limit is None:
                for node, idx in zone_free.items():
                    out.setdefault(node, []).extend(idx)
                continue
            for node in sorted(zone_free):
                if limit <= 0:
                    break
                take = zone_free[node][:limit]
                out.setdefault(node, []).extend(take)
                limit -= len(take)
        return out


@dataclass(frozen=True, slots=True)
class _StaticTopology:
    nodes: dict[str, Node]
    sorted_names: list[str]
    switch_of: dict[str, tuple[str, str]]
    nodes_of_switch: dict[tuple[str, str], list[str]]


_TOPOLOGY_CACHE: list[tuple[tuple[Node, ...], _StaticTopology]] = []


def _static_topology(nodes: tuple[Node, ...]) -> _StaticTopology:
    """Name and switch indexes of a node tuple, reused while the caller passes the same tuple.

    Callers that rebuild nodes only when health or speed changes (the simulator does) save
    the indexing on every pass; the maps are never mutated.
    """
    if _TOPOLOGY_CACHE and _TOPOLOGY_CACHE[0][0] is nodes:
        return _TOPOLOGY_CACHE[0][1]
    by_name = {n.name: n for n in nodes}
    of_switch: dict[tuple[str, str], list[str]] = {}
    for n in sorted(nodes, key=lambda n: n.name):
        of_switch.setdefault((n.rack, n.switch), []).append(n.name)
    static = _StaticTopology(by_name, sorted(by_name), {n.name: (n.rack, n.switch) for n in nodes}, of_switch)
    _TOPOLOGY_CACHE[:] = [(nodes, static)]
    return static


_ZONE_MAP_CACHE: list[tuple[_StaticTopology, tuple, dict[str, str | None]]] = []


def _zone_map(static: _StaticTopology, reservations: Iterable[Reservation]) -> dict[str, str | None]:
    """Each node's zone: the first reservation, by name, whose nodes include it; else None.

    The same map object while the nodes and the reservations' names and nodes stand (a new
    window of the same reservation changes neither), so what a pass works out of it once may be
    kept by its identity (``victims.victim_pool``); the map is never mutated.
    """
    ordered = sorted(reservations, key=lambda r: r.name)
    key = tuple((r.name, r.nodes) for r in ordered)
    kept = _ZONE_MAP_CACHE[0] if _ZONE_MAP_CACHE else None
    if kept is not None and kept[0] is static and kept[1] == key:
        return kept[2]
    zone_of_node: dict[str, str | None] = dict.fromkeys(static.nodes)
    for res in ordered:
        for node in res.nodes:
            if node in zone_of_node and zone_of_node[node] is None:
                zone_of_node[node] = res.name
    _ZONE_MAP_CACHE[:] = [(static, key, zone_of_node)]
    return zone_of_node


def choose_gpus(
    free: Mapping[str, Sequence[int]],
    nodes: Mapping[str, Node],
    tp: int,
    pp: int,
    replicas: int,
    anchor: Sequence[str] = (),
) -> tuple[Gpu, ...] | None:
    """Pick GPUs for ``replicas`` replicas of ``tp x pp`` from ``free``, or None if they do not fit.

    Packs onto the fewest switches then racks, never splits a TP group across nodes, and
    prefers the switch and rack of ``anchor`` nodes. Returns GPUs in replica order.
    """
    need = replicas * pp
    if need <= 0:
        return ()
    caps: dict[str, int] = {}
    total = 0
    for name, idx in free.items():
        g = len(idx) // tp
        if g:
            caps[name] = g
            total += g
    if total < need:
        return None
    anchor_nodes = set(anchor)
    anchor_switches = {(nodes[n].rack, nodes[n].switch) for n in anchor if n in nodes}
    anchor_racks = {nodes[n].rack for n in anchor if n in nodes}
    by_switch: dict[tuple[str, str], list[str]] = {}
    for name in caps:
        node = nodes[name]
        by_switch.setdefault((node.rack, node.switch), []).append(name)
    switch_cap = {s: sum(caps[n] for n in ns) for s, ns in by_switch.items()}

    chosen_switches: list[tuple[str, str]]
    fitting = [s for s, c in switch_cap.items() if c >= need]
    if fitting:
        fitting.sort(key=lambda s: (s not in anchor_switches, s[0] not in anchor_racks, switch_cap[s], s))
        chosen_switches = [fitting[0]]
    else:
        rack_cap: dict[str, int] = {}
        for s, c in switch_cap.items():
            rack_cap[s[0]] = rack_cap.get(s[0], 0) + c
        racks_fit = [r for r, c in rack_cap.items() if c >= need]
        if racks_fit:
            racks_fit.sort(key=lambda r: (r not in anchor_racks, rack_cap[r], r))
            racks = [racks_fit[0]]
        else:
            racks = sorted(rack_cap, key=lambda r: (r not in anchor_racks, -rack_cap[r], r))
        chosen_switches = []
        got = 0
        for rack in racks:
            in_rack = sorted(
                (s for s in switch_cap if s[0] == rack),
                key=lambda s: (s not in anchor_switches, -switch_cap[s], s),
            )
            for s in in_rack:
                chosen_switches.append(s)
                got += switch_cap[s]
                if got >= need:
                    break
            if got >= need:
                break

    picks: list[tuple[str, int]] = []
    remaining = need
    for s in chosen_switches:
        pool = sorted(by_switch[s], key=lambda n: (n not in anchor_nodes, -caps[n], n))
        while remaining > 0 and pool:
            # Best fit for the tail: the smallest node that finishes the request, so whole
            # nodes stay whole for the next big job.
            fits = [n for n in pool if caps[n] >= remaining and n not in anchor_nodes]
            if any(n in anchor_nodes for n in pool):
                name = pool[0]
            elif fits:
                name = min(fits, key=lambda n: (caps[n], n))
            else:
                name = pool[0]
            pool.remove(name)
            k = min(caps[name], remaining)
            picks.append((name, k))
            remaining -= k
        if remaining <= 0:
            break
    if remaining > 0:
        return None
    out: list[Gpu] = []
    for name, k in picks:
        idx = sorted(free[name])[: k * tp]
        out.extend(Gpu(name, i) for i in idx)
    return tuple(out)

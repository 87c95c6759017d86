"""Teams in a replay: GPUs held per team, decayed fair-share usage, and the quota guarantee.

``TeamLedger`` is what the engine keeps when a scenario has ``teams``: GPUs held per team (its
sub-teams' included, kept current at every GPU assignment), the decayed usage the planner reads
(``Team.usage_gpu_s``, with ``jobs.planner.quota.accrue``), GPU-seconds received and asked for,
and the quota invariant with its ``quota_shortfall`` (docs/simulator.md, "Teams"):

A team below its quota is *kept from* GPUs when one of its waiting jobs (regular or
best-effort; not recovering, not between reservation windows, not owed a lent idle phase)
asks for no more than the team's headroom under its quota at its smallest size, does not fit
in the idle GPUs, and would fit in the idle GPUs plus the GPUs the planner may reclaim for it:
those held by jobs of its class or lower, not protected by ``min_run_s`` (a promoted best-effort
run's, ``starvation.run_protection_s``), of teams outside its
own chain (or of no team), outside every reservation's pool and every lent idle phase (reclaimed,
a pool's GPUs go back to it, a lent phase's to its job), never more from a team than it holds
beyond its quota. Kept for longer than those jobs' save time plus two steps in flight plus
``reclaim_grace_s`` (plus the simulator's planner batching in big replays) is a breach and counts
as quota shortfall.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from jobs.planner.layout import batch_divides
from jobs.planner.quota import accrue
from jobs.planner.snapshot import PRIORITY_RANK, Team
from jobs.planner.starvation import run_protection_s
from jobs.simulator.policies import OMNI_PLANNER_POLICIES
from jobs.simulator.scenario import TeamSpec

if TYPE_CHECKING:
    from jobs.simulator.engine import Simulation
    from jobs.simulator.state import SimJob

NON_PLACEABLE = ("failed", "draining", "cordoned")


class TeamLedger:
    """Per-team accounting of one replay (only built when the scenario has teams)."""

    def __init__(self, teams: Iterable[TeamSpec], half_life_s: float) -> None:
        self.specs: dict[str, TeamSpec] = {t.name: t for t in teams}
        self.half_life_s = half_life_s
        self.chains: dict[str, tuple[str, ...]] = {name: self._chain(name) for name in self.specs}
        self.root: dict[str, str] = {name: chain[-1] for name, chain in self.chains.items()}
        self.children: dict[str, list[str]] = {name: [] for name in self.specs}
        for t in self.specs.values():
            if t.parent is not None:
                self.children[t.parent].append(t.name)
        self.held = dict.fromkeys(self.specs, 0)  # sub-teams included
        # ... of them, against the quota: not those another reservation lends (``quota.charged_gpus``)
        self.charged = dict.fromkeys(self.specs, 0)
        self.direct_held = dict.fromkeys(self.specs, 0)
        self.demand = dict.fromkeys(self.specs, 0)  # preferred GPUs of runnable jobs, sub-teams included
        self.usage_gpu_s = dict.fromkeys(self.specs, 0.0)
        self.received_gpu_s = dict.fromkeys(self.specs, 0.0)
        self.demand_gpu_s = dict.fromkeys(self.specs, 0.0)
        self.owed_gpu_s = dict.fromkeys(self.specs, 0.0)
        self.kept_gpu_s = dict.fromkeys(self.specs, 0.0)
        self.active: dict[str, set[str]] = {name: set() for name in self.specs}  # direct members only
        self.kept_since: dict[str, float | None] = dict.fromkeys(self.specs)
        self._cache_key: tuple[int, float] | None = None
        self._cache: tuple[dict[str, tuple[int, float, str]], set[str]] = ({}, set())

    def _chain(self, name: str) -> tuple[str, ...]:
        out = []
        team: str | None = name
        while team is not None and team not in out:
            out.append(team)
            team = self.specs[team].parent
        return tuple(out)

    # --- kept current by the engine ---------------------------------------------------------------

    def hold(self, team: str | None, gpus: int, charged: bool = True) -> None:
        """``gpus`` more (or fewer) GPUs held by a job of ``team`` (``charged``: against its quota)."""
        if team is None:
            return
        self.direct_held[team] += gpus
        for t in self.chains[team]:
            self.held[t] += gpus
            if charged:
                self.charged[t] += gpus

    def charge(self, team: str, gpus: int) -> None:
        """``gpus`` GPUs the team already holds count (negative: no longer count) against its
        quota from now on: their pool changed hands (``Simulation._own_pools``)."""
        for t in self.chains[team]:
            self.charged[t] += gpus

    def runnable(self, job: SimJob, added: bool) -> None:
        """A job of a team arrived (``added``) or finished: its demand and membership."""
        team = job.spec.team
        if team is None:
            return
        sign = 1 if added else -1
        for t in self.chains[team]:
            self.demand[t] += sign * job.spec.dp * job.rep
        (self.active[team].add if added else self.active[team].discard)(job.spec.name)

    def snapshot_teams(self) -> tuple[Team, ...]:
        """The planner's ``Snapshot.teams``, usage decayed up to now."""
        return tuple(Team(t.name, t.parent, t.quota_gpus, t.borrow_limit_gpus, t.weight, self.usage_gpu_s[t.name])
                     for t in self.specs.values())

    # --- integrated over time -------------------------------------------------------------------

    def advance(self, sim: Simulation, a: float, b: float) -> None:
        """Integrate [a, b) with the state as it is (called before the clock moves)."""
        dt = b - a
        for name in self.specs:
            held = self.held[name]
            self.usage_gpu_s[name] = accrue(self.usage_gpu_s[name], held, dt, self.half_life_s)
            self.received_gpu_s[name] += held * dt
            self.demand_gpu_s[name] += self.demand[name] * dt
        kept, waiting = self.kept(sim, a)
        for name, spec in self.specs.items():
            if name in waiting:
                self.owed_gpu_s[name] += spec.quota_gpus * dt
            if name not in kept:
                self.kept_since[name] = None
                continue
            gpus, bound_s, who = kept[name]
            since = self.kept_since[name]
            if since is None:
                since = self.kept_since[name] = a
            start = max(a, since + bound_s)
            if b > start + 1e-9:
                self.kept_gpu_s[name] += gpus * (b - start)
                if not sim.quota_invariant:
                    continue
                sim._violation(
                    f"team {name} is below its quota ({self.charged[name]} of {spec.quota_gpus} guaranteed GPUs) "
                    f"and {who} waits, but {gpus} GPUs other teams hold beyond their quotas were not reclaimed "
                    f"for it from t={since:.1f}s to t={b:.1f}s (more than save time + steps in flight + "
                    f"reclaim_grace_s = {bound_s:.0f}s)",
                    key=f"quota:{name}:{since}")

    def headroom(self, name: str) -> int:
        """GPUs the team may still take within its guarantee: the least along its chain."""
        return max(0, min(self.specs[t].quota_gpus - self.charged[t] for t in self.chains[name]))

    def kept(self, sim: Simulation, now: float) -> tuple[dict[str, tuple[int, float, str]], set[str]]:
        """Teams kept from over-quota GPUs now: ``{team: (GPUs, bound_s, waiting job)}``, and the
        teams with waiting work at all."""
        waiting_teams: set[str] = set()
        asking: dict[str, list[SimJob]] = {}
        for name in self.specs:
            room = self.headroom(name)
            for jname in sorted(self.active[name]):  # the named waiting job: the same every run
                job = sim.jobs[jname]
                if not _waiting(job):
                    continue
                waiting_teams.add(name)
                if room > 0 and job.spec.dp_min * job.rep <= room:
                    asking.setdefault(name, []).append(job)
        if not asking:
            return {}, waiting_teams
        key = (sim.state_version, now)
        if self._cache_key is not None and self._cache_key[0] == sim.state_version and now < self._cache_key[1]:
            return self._cache[0], waiting_teams
        kept, valid_until = self._kept_detail(sim, now, asking)
        self._cache_key = (key[0], valid_until)
        self._cache = (kept, waiting_teams)
        return kept, waiting_teams

    def _kept_detail(self, sim: Simulation, now: float, asking: dict[str, list[SimJob]]
                     ) -> tuple[dict[str, tuple[int, float, str]], float]:
        valid_until = float("inf")
        # Over-quota GPUs the planner may reclaim, per victim class floor (rank of the asker).
        excess = {n: max(0, self.charged[n] - t.quota_gpus) for n, t in self.specs.items()}
        # The most a victim may give back: its team's excess, and no more than any parent's.
        chain_excess = {n: min(excess[t] for t in chain) for n, chain in self.chains.items()}

        def cap(v: SimJob) -> int:
            return chain_excess[v.spec.team] if v.spec.team is not None else 1 << 30

        eligible: dict[int, dict[str | None, list[SimJob]]] = {1: {}, 2: {}}
        # GPUs each victim holds outside reservations' pools, per node: all a reclaim from it can
        # hand on (a reservation's GPUs on loan go back to its pool, not to a quota; a lent idle
        # phase's to the job that lent them).
        off_pool: dict[str, dict[str, int]] = {}
        off_total: dict[str, int] = {}
        for name in sim.active_names:
            v = sim.jobs[name]
            held = len(v.gpus) + len(v.incoming)
            if not held or v.spec.priority == "critical" or cap(v) <= 0:
                continue
            if v.run_started is not None:
                # The planner's protection: a promoted best-effort run has the regular min run.
                min_run = v.spec.min_run_s
                if sim.policy in OMNI_PLANNER_POLICIES:
                    min_run = run_protection_s(v.spec.priority, min_run, v.run_started - v.queued_since, sim.config)
                if min_run > 0 and now - v.run_started < min_run:
                    valid_until = min(valid_until, v.run_started + min_run)
                    continue
            nodes: dict[str, int] = {}
            for g in v.gpus + v.incoming:
                if sim.pool_zone(g.node) is None:
                    nodes[g.node] = nodes.get(g.node, 0) + 1
            if not nodes:
                continue  # it holds only a reservation's GPUs: reclaimed, they go back to that pool
            off_pool[name], off_total[name] = nodes, sum(nodes.values())
            rank = PRIORITY_RANK[v.spec.priority]
            for floor in (1, 2):
                if rank >= floor:
                    eligible[floor].setdefault(v.spec.team, []).append(v)
        owned_per_node: dict[str, int] = {}
        for g in sim.owner:
            owned_per_node[g.node] = owned_per_node.get(g.node, 0) + 1
        parked: dict[str, int] = {}
        for name in sim.active_names:
            for g in sim.jobs[name].parked:
                parked[g.node] = parked.get(g.node, 0) + 1
        free = {
            n: node.gpus - owned_per_node.get(n, 0) - parked.get(n, 0)
            for n, node in sim.nodes.items()
            if n not in sim.down and sim.health[n] not in NON_PLACEABLE and n not in sim.pool_of_node
        }
        kept: dict[str, tuple[int, float, str]] = {}
        for floor in (1, 2):
            by_team = eligible[floor]
            if not by_team:
                continue
            # What each victim can give back without exceeding its team's excess: the largest
            # shrink (whole replicas, batch-exact) or its preemption that stays within it.
            give = {v.spec.name: min(off_total[v.spec.name], _freeable(v, cap(v)))
                    for jobs in by_team.values() for v in jobs}
            by_team = {t: [v for v in jobs if give[v.spec.name] > 0] for t, jobs in by_team.items()}
            direct = {t: sum(give[v.spec.name] for v in jobs) for t, jobs in by_team.items()}
            # What can be taken from a team (its subtree's victims together) within its excess:
            # victims give back in whole chunks (a shrink by replicas, or a stop), so the best
            # sum of one chunk per victim that stays within the excess, not min(excess, sum of
            # each victim's most): two teams each holding 3 beyond their quota in 2-GPU jobs give
            # back 4, not 6, since the planner may take no more from a team than its excess.
            sums: dict[str, int] = {}

            def reachable(team: str, by_team: dict[str | None, list[SimJob]] = by_team,
                          sums: dict[str, int] = sums) -> int:
                if team not in sums:
                    limit = excess[team]
                    reach = _chunk_sums(([min(n, off_total[v.spec.name]) for n in _give_options(v, cap(v))]
                                         for v in by_team.get(team, ())), limit)
                    for child in self.children[team]:
                        reach = _sumset(reach, reachable(child), limit)
                    sums[team] = reach
                return sums[team]

            roots = {r for r in self.root.values()}
            per_root = {r: reachable(r).bit_length() - 1 for r in roots}
            for team, jobs in asking.items():
                mine = [j for j in jobs if PRIORITY_RANK[j.spec.priority] == floor]
                if not mine:
                    continue
                victims = [v for t, vs in by_team.items() if t is None or self.root[t] != self.root[team]
                           and per_root[self.root[t]] > 0 for v in vs]
                if not victims:
                    continue
                avail = direct.get(None, 0) + sum(n for r, n in per_root.items() if r != self.root[team])
                cand: dict[str, int] = {}
                for v in victims:
                    for node, n in off_pool[v.spec.name].items():
                        cand[node] = cand.get(node, 0) + min(n, give[v.spec.name])
                fits: dict[tuple[int, int], bool] = {}  # by TP and TP groups: most of a queue shares a few shapes
                fitting = []
                for j in mine:
                    shape = (j.spec.tp, j.spec.pp * j.spec.dp_min)
                    if shape not in fits:
                        fits[shape] = _fits(j, free, cand, avail)
                    if fits[shape]:
                        fitting.append(j)
                if not fitting:
                    continue
                slow = max(sim.speed.values())
                # Big replays batch both the arrival and the victims' release into planner slots.
                bound_s = sim.config.reclaim_grace_s + 2.0 * sim.coalesce_s + max(
                    v.spec.checkpoint.save_s + 2.0 * sim._nominal_step_s(v) * slow for v in victims)
                gpus = min(self.headroom(team), avail, sum(j.spec.dp * j.rep for j in fitting))
                prev = kept.get(team)
                if prev is None or gpus > prev[0]:
                    kept[team] = (gpus, bound_s, fitting[0].spec.name)
        return kept, valid_until

    # --- the result ---------------------------------------------------------------------------------

    def result(self, sim: Simulation) -> dict[str, Any]:
        """``teams``, ``jain_index`` and ``quota_shortfall`` for the result dict."""
        rows = []
        for name, spec in self.specs.items():
            members = [j for j in sim.jobs.values() if j.spec.team is not None and name in self.chains[j.spec.team]
                       and j.submitted]
            waits = [(j.start_s if j.start_s is not None else sim.horizon) - j.spec.submit_s for j in members]
            owed = self.owed_gpu_s[name]
            rows.append({
                "name": name,
                "parent": spec.parent,
                "quota_gpus": spec.quota_gpus,
                "received_gpu_s": round(self.received_gpu_s[name], 3),
                "demand_gpu_s": round(self.demand_gpu_s[name], 3),
                "quota_shortfall": round(self.kept_gpu_s[name] / owed, 6) if owed else 0.0,
                "median_queue_s": round(statistics.median(waits), 3) if waits else None,
                "jobs": len(members),
            })
        leaves = [r for r in rows if not self.children[r["name"]] and r["demand_gpu_s"] > 0]
        shares = [r["received_gpu_s"] / r["demand_gpu_s"] for r in leaves]
        jain = (sum(shares) ** 2 / (len(shares) * sum(x * x for x in shares))) if shares and any(shares) else None
        owed = sum(self.owed_gpu_s.values())
        return {
            "teams": rows,
            "jain_index": round(jain, 6) if jain is not None else None,
            "quota_shortfall": round(sum(self.kept_gpu_s.values()) / owed, 6) if owed else 0.0,
        }


def _waiting(job: SimJob) -> bool:
    """Waiting work a quota speaks for: a queued regular or best-effort job holding nothing."""
    return (job.activity == "waiting" and not job.gpus and not job.incoming and not job.recovering
            and not job.dormant and not job.parked and job.spec.priority != "critical")


def _freeable(job: SimJob, cap: int) -> int:
    """The most GPUs ``job`` can give back in one victim option without exceeding ``cap``."""
    from jobs.simulator.engine import _probe_job

    held = len(job.gpus) + len(job.incoming)
    if held <= cap:
        return held
    probe = _probe_job(job.spec)
    d = held // job.rep
    for target in range(job.spec.dp_min, d):
        if (d - target) * job.rep <= cap and batch_divides(probe, target):
            return (d - target) * job.rep
    return 0


def _give_options(job: SimJob, cap: int) -> list[int]:
    """Every amount ``job`` can give back in one victim option (a shrink by whole batch-exact
    replicas, or its preemption) without exceeding ``cap``."""
    from jobs.simulator.engine import _probe_job

    held = len(job.gpus) + len(job.incoming)
    probe = _probe_job(job.spec)
    d = held // job.rep
    out = [(d - target) * job.rep for target in range(max(1, job.spec.dp_min), d) if batch_divides(probe, target)]
    out.append(held)
    return [n for n in out if 0 < n <= cap]


def _chunk_sums(options: Iterable[list[int]], cap: int) -> int:
    """The sums within ``cap`` of at most one amount from each list, as a bit set (bit n: n is
    reachable; bit 0 always is)."""
    mask = (1 << (cap + 1)) - 1
    reach = 1
    for amounts in options:
        if not amounts:
            continue
        add = 0
        for n in set(amounts):
            add |= reach << n
        reach = (reach | add) & mask
        if reach >> cap:
            break  # the whole excess can be taken: nothing can add to it
    return reach


def _sumset(a: int, b: int, cap: int) -> int:
    """Sums within ``cap`` of one element of bit set ``a`` and one of ``b``."""
    mask = (1 << (cap + 1)) - 1
    out = 0
    n = 0
    while b:
        if b & 1:
            out |= a << n
        b >>= 1
        n += 1
    return out & mask


def _fits(job: SimJob, free: dict[str, int], cand: dict[str, int], avail: int) -> bool:
    """Whether the job's smallest layout needs the over-quota GPUs, and fits with them: TP groups
    within a node, ``pp x dp_min`` of them."""
    spec = job.spec
    groups = spec.pp * spec.dp_min
    need = groups * spec.tp
    free_total = sum(max(0, n) for n in free.values())
    if free_total >= need and sum(max(0, n) // spec.tp for n in free.values()) >= groups:
        return False  # it fits in idle GPUs: whatever keeps it waiting, it is not a quota
    if free_total + avail < need:
        return False
    nodes = set(free) | set(cand)
    return sum((max(0, free.get(n, 0)) + cand.get(n, 0)) // spec.tp for n in nodes) >= groups

"""Rule 9, teams: guaranteed quotas, borrowing limits and time-aware fair share.

Every job may belong to a team (``Job.team``); a team has a guaranteed ``quota_gpus``, a
``borrow_limit_gpus`` beyond it (``None``: any idle GPU) and a ``weight``, and may sit inside a
parent (an organisation) whose quota and limit its jobs count against too. A team holding more
than its quota is *borrowing*; what it borrows is idle capacity of the others and is given back
when a team below its quota has waiting work:

- **Order.** After entitled, recovering and critical work, a job whose team stays within its
  quota by starting comes first, whatever its class: a team's quota is its guarantee for all of
  its work (as a Kueue ClusterQueue's nominal quota is), so its best-effort job goes ahead of
  another team's regular job that could only borrow. Then, within a class, the team with the
  least past usage per weight (``usage_gpu_s / weight``, decayed with
  ``fair_share_half_life_s``) first. So idle GPUs go to the team that has had least of late.
- **Guarded.** A regular job takes GPUs from another team's best-effort job (rule 4) only from
  what that team holds beyond its quota (``guarded``), never more: what a team's quota covers
  is not another team's to take. Critical work stands above quotas and may take them.
- **Limit.** A job starts or grows only to what its team (and every ancestor) may still use:
  quota + borrowing limit - what it holds. Beyond that it waits, saying so.
- **Reclaim.** A waiting job whose team is below its quota, and stays within it at the size it
  asks, takes GPUs from jobs of teams above their quota (never more than each holds above it),
  of its class or lower: the borrower with most past usage per weight first, then the victim
  order of rule 4 (cheapest to stop). Exactly the loan mechanics: a graceful shrink or
  preemption with the reclaim lead time, checkpoint first, its reason in words; the minimum-run
  guarantee still protects a recent start.

What a team holds against its quota is its jobs' GPUs outside reservations' pools, and on the
pools of its own reservations (a team's, or its jobs'); GPUs another reservation lends it are not
counted (``charged_gpus``): reclaimed, they go back to that pool, not to any quota, so a team on
them keeps no other team from anything (the simulator's quota invariant counts the same).

``TeamBook`` is the pass's ledger: GPUs held per team against its quota (kept current as actions
are emitted) and the sentences. ``decayed`` and ``accrue`` are the fair-share arithmetic the snapshot builders
(the simulator, jobs/snapshot.py) use to keep ``Team.usage_gpu_s``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from jobs.planner.rhythm import predict
from jobs.planner.snapshot import PRIORITY_RANK, Gpu, Job, Reservation, Team
from jobs.planner.starvation import min_run_of
from jobs.planner.wording import plural

if TYPE_CHECKING:
    from jobs.planner.core import PlanningPass

INFINITY = math.inf


def decayed(usage_gpu_s: float, dt_s: float, half_life_s: float) -> float:
    """``usage_gpu_s`` as it stands ``dt_s`` later with nothing added."""
    if half_life_s <= 0 or dt_s <= 0:
        return usage_gpu_s if half_life_s > 0 else 0.0
    return usage_gpu_s * 0.5 ** (dt_s / half_life_s)


def accrue(usage_gpu_s: float, gpus: float, dt_s: float, half_life_s: float) -> float:
    """Decayed usage after holding ``gpus`` for ``dt_s`` more seconds (exact for a constant hold)."""
    if dt_s <= 0:
        return usage_gpu_s
    if half_life_s <= 0:
        return gpus * dt_s
    rate = math.log(2) / half_life_s
    return decayed(usage_gpu_s, dt_s, half_life_s) + gpus * (1.0 - math.exp(-rate * dt_s)) / rate


def pool_teams(reservations: Iterable[Reservation], jobs: Iterable[Job]) -> dict[str, str | None]:
    """The team each reservation's pool belongs to: its own, or its job's (None: no team)."""
    team_of = {j.name: j.team for j in jobs}
    return {r.name: r.team or team_of.get(r.job) for r in reservations}


def charged_gpus(team: str | None, gpus: Sequence[Gpu], zone_of_node: dict[str, str | None],
                 pool_team: dict[str, str | None]) -> int:
    """How many of ``gpus``, held by a job of ``team``, count against the team's quota: those
    outside every reservation's pool and those on its own reservations' pools."""
    n = 0
    for g in gpus:
        zone = zone_of_node.get(g.node)
        if zone is None or zone not in pool_team or (team is not None and pool_team[zone] == team):
            n += 1
    return n


class TeamBook:
    """The teams of one pass and the GPUs each holds against its quota, its descendants' included.
    ``charge(job, gpus)`` says how many of ``gpus`` count (default: all of them)."""

    def __init__(self, teams: Iterable[Team], jobs: Iterable[Job],
                 charge: Callable[[Job, Sequence[Gpu]], int] | None = None) -> None:
        self.teams: dict[str, Team] = {t.name: t for t in teams}
        self.charge = charge or (lambda job, gpus: len(gpus))
        self.held: dict[str, int] = dict.fromkeys(self.teams, 0)
        self.unteamed = 0  # GPUs held by jobs of no team (which only borrow)
        self._chains: dict[str | None, list[Team]] = {}
        self._victims_key: list | None = None
        self._finishing: list[Job] | None = None    # running jobs about to finish (``finishing_soon``)
        self.promised: set[str] = set()             # ... whose GPUs a waiting job counts on
        self._victims_groups: list[tuple[str | None, list]] = []
        self._names: dict[str | None, frozenset[str]] = {}
        #: ``reclaimable`` per (the job's team, for_team), until the next ``add`` changes a holding.
        self._reclaimable: dict[tuple[str | None, str | None], float] = {}
        for job in jobs if self.teams else ():  # no teams: nothing reads the ledger
            if job.holdings:
                self.add(job.team, self.charge(job, job.gpus))

    def __bool__(self) -> bool:
        return bool(self.teams)

    def chain(self, team: str | None) -> list[Team]:
        """The team and its ancestors, innermost first (a cycle or an unknown name ends it);
        memoised, the teams being fixed for the pass."""
        hit = self._chains.get(team)
        if hit is None:
            hit = self._chains[team] = self._walk(team)
            self._names[team] = frozenset(t.name for t in hit)
        return hit

    def names(self, team: str | None) -> frozenset[str]:
        """The names of ``chain(team)``."""
        if team not in self._names:
            self.chain(team)
        return self._names[team]

    def _walk(self, team: str | None) -> list[Team]:
        out: list[Team] = []
        seen: set[str] = set()
        while team is not None and team in self.teams and team not in seen:
            seen.add(team)
            out.append(self.teams[team])
            team = self.teams[team].parent
        return out

    def add(self, team: str | None, gpus: int) -> None:
        """``gpus`` more (or fewer) held by ``team`` and so by its ancestors."""
        if team is None or team not in self.teams:
            self.unteamed += gpus
            return
        self._reclaimable.clear()
        for t in self.chain(team):
            self.held[t.name] = self.held.get(t.name, 0) + gpus

    # -- what a team may have -------------------------------------------------------------------

    def below_quota_by(self, team: str | None) -> int:
        """GPUs the team may still take within its own guarantee (0 for no team, or one already
        at or above its quota). A parent at its quota because a sibling borrows does not take
        the guarantee away: the sibling's excess is what is reclaimed (``reclaimable``)."""
        if team is None or team not in self.teams:
            return 0
        return max(0, self.teams[team].quota_gpus - self.held.get(team, 0))

    def may_use(self, team: str | None) -> float:
        """GPUs the team may take now in all: quota + borrowing limit - held, the least along its
        chain (``inf`` with no limit anywhere, or for no team)."""
        room = INFINITY
        for t in self.chain(team):
            if t.borrow_limit_gpus is not None:
                room = min(room, t.quota_gpus + t.borrow_limit_gpus - self.held.get(t.name, 0))
        return max(0.0, room)

    def above_quota_by(self, team: str | None) -> int:
        """GPUs the team holds beyond its own quota (what may be reclaimed from it; 0 for no
        team is *not* protected: see ``reclaimable``)."""
        if team is None or team not in self.teams:
            return 0
        t = self.teams[team]
        return max(0, self.held.get(team, 0) - t.quota_gpus)

    def reclaimable(self, job: Job, for_team: str | None = None) -> float:
        """How many of ``job``'s GPUs ``for_team`` (below its quota) may take back: what the job's
        team holds beyond its quota, and so does every enclosing team that does not also enclose
        ``for_team`` (an organisation within its own quota keeps its children's borrowing from
        outsiders; between siblings only the borrower's own excess counts); all of them for a
        job of no team, which has no quota and only borrows."""
        key = (job.team, for_team)
        hit = self._reclaimable.get(key)
        if hit is None:
            chain = self.chain(job.team)
            if not chain:
                return INFINITY
            mine = self.names(for_team)
            hit = self._reclaimable[key] = min(
                (max(0, self.held.get(t.name, 0) - t.quota_gpus) for t in chain if t.name not in mine), default=0)
        return hit

    def victims_by_team(self, entries: list) -> list[tuple[str | None, list]]:
        """The victim pool's entries grouped by team, in victim order within each, the teams with
        most past usage per weight first (jobs of no team before all): cached per pool list."""
        if self._victims_key is not entries:
            groups: dict[str | None, list] = {}
            for entry in entries:
                groups.setdefault(entry.job.team if entry.job.team in self.teams else None, []).append(entry)
            order = sorted(groups, key=lambda t: (t is not None, -self.fair_share(t) if t is not None else 0.0,
                                                  t or ""))
            self._victims_key, self._victims_groups = entries, [(t, groups[t]) for t in order]
        return self._victims_groups

    def anyone_borrowing(self) -> bool:
        """Whether any GPUs are held beyond a quota (or by jobs of no team)."""
        return self.unteamed > 0 or any(self.held.get(n, 0) > t.quota_gpus for n, t in self.teams.items())

    def fair_share(self, team: str | None) -> float:
        """Past usage per weight: lower is owed more of the idle GPUs (no team: last)."""
        t = self.teams.get(team) if team is not None else None
        if t is None:
            return INFINITY
        return t.usage_gpu_s / max(t.weight, 1e-9)

    def related(self, a: str | None, b: str | None) -> bool:
        """Whether two teams are one, or one encloses the other (reclaim never runs between them)."""
        if a is None or b is None:
            return False
        return b in self.names(a) or a in self.names(b)

    # -- words ----------------------------------------------------------------------------------

    def standing_words(self, team: str) -> str:
        """``team vision uses 96 of its 96 guaranteed GPUs and may borrow up to 32 more``."""
        t = self.teams[team]
        held = self.held.get(team, 0)
        text = f"team {team} uses {held} of its {t.quota_gpus} guaranteed GPUs"
        if t.borrow_limit_gpus is None:
            text += " and may borrow any idle GPU beyond them"
        elif t.borrow_limit_gpus == 0:
            text += " and may not borrow beyond them"
        else:
            text += f" and may borrow up to {t.borrow_limit_gpus} more"
        return text

    def limit_words(self, team: str | None) -> str:
        """Why a job of ``team`` can take no more: the first team of its chain at its limit."""
        for t in self.chain(team):
            if t.borrow_limit_gpus is not None and \
                    self.held.get(t.name, 0) >= t.quota_gpus + t.borrow_limit_gpus:
                return self.standing_words(t.name) + "; it has reached that limit"
        chain = self.chain(team)
        return self.standing_words(chain[0].name) if chain else ""


def queue_rank(state: PlanningPass, job: Job) -> tuple[int, float]:
    """Where a waiting job stands: (0 when its team stays within its quota by starting at its
    smallest size, else 1; then, among borrowers, its team's fair share). The first goes ahead of
    the class (``admission._team_key``), the second within it.

    Within their quotas jobs keep the order of their wait (and of rule 8's ageing): each team's
    guarantee is its own, so fair share has nothing to arbitrate there. Ordered by fair share,
    a long waiter that had just stopped its own team's jobs for its GPUs saw them taken, as they
    came back, by a newer job of a team with less past usage, and stopped more (on the Philly
    week with teams one job did so 29 times; 235 such stops in the week, 73 in wait order)."""
    book = state.teams
    if not book:
        return (0, 0.0)
    if covered(book, job):
        return (0, 0.0)
    return (1, book.fair_share(job.team))


def guarded(book: TeamBook, requester: Job, victim: Job) -> bool:
    """Whether rule 4 may not take GPUs from ``victim`` (of a lower class) for ``requester`` (not
    critical: critical work stands above quotas): they are of different teams and the victim's
    team holds nothing beyond its quota that the requester's team may take back
    (``TeamBook.reclaimable``). Without this a team's best-effort job, started within its quota
    ahead of another team's borrowing regular job, was stopped by it at the next pass: on the
    Philly week with teams, 2,518 such stops."""
    return victim.team != requester.team and book.reclaimable(victim, requester.team) <= 0


def failure_key(state: PlanningPass, job: Job, rank: int, forced: bool, aged: bool) -> tuple:
    """What ``PlanningPass.victim_failed_at`` remembers a failed victim search under: the job's
    class, standing, whether it was forced and aged, and with teams its team (what rule 4 may
    take for it depends on its team: ``guarded``, and a long waiter takes nothing from a team
    within its quota)."""
    key = (PRIORITY_RANK[job.priority], rank, forced, aged)
    return key + (job.team,) if state.teams and not forced else key


def covered(book: TeamBook, job: Job) -> bool:
    """Whether ``job``'s team stays within its quota if the job starts at its smallest size."""
    return book.below_quota_by(job.team) >= job.dp_min * job.tp * job.pp


def ages(state: PlanningPass, job: Job) -> bool:
    """Whether rule 8's ageing applies to ``job``: always without teams; with teams, only to a
    job its team's quota covers at its smallest size. A borrower's place among borrowers is
    fair share's: aged, it would jump ahead of work within its quota and take the very GPUs
    just reclaimed from its own team (each round trip a save and a restart for nothing), or
    stop another borrower. It starves no more than its team does: once its team's own jobs
    give GPUs back, its quota covers it and it ages again."""
    return not state.teams or queue_rank(state, job)[0] == 0


def may_reclaim(state: PlanningPass, job: Job, need: int) -> bool:
    """Whether ``job`` may take back borrowed GPUs: its team is below its quota by at least
    ``need`` (its smallest size) and some GPUs are held beyond a quota."""
    book = state.teams
    return bool(book) and job.team is not None and book.below_quota_by(job.team) >= need and book.anyone_borrowing()


def size_cap(state: PlanningPass, job: Job) -> float:
    """The most GPUs ``job`` may hold now, its team's borrowing limit allowing."""
    book = state.teams
    if not book or job.team is None:
        return INFINITY
    return len(job.holdings) + book.may_use(job.team)


def room_before_reclaim(state: PlanningPass, job: Job) -> float:
    """The most GPUs a job its team's quota covers may start with (``inf``: no bound): its
    team's room below its quota while a waiting job of another team below its quota, of its
    class or higher, comes after it in this pass (``PlanningPass.quota_waiters``). What it took
    beyond would be the other's to reclaim, at a save and a restart, and not before the next
    pass: a job placed in a pass is no victim in it, so the other team would be kept from GPUs
    for as long as no event comes."""
    book = state.teams
    if not book or job.team is None:
        return INFINITY
    if not covered(book, job):
        return INFINITY  # a borrower already: its place is fair share's
    room = book.below_quota_by(job.team)
    rank = PRIORITY_RANK[job.priority]
    for other_rank, team, need, name in state.quota_waiters:
        if other_rank > rank:
            break
        if team != job.team and name not in state.acted and book.below_quota_by(team) >= need:
            return room
    return INFINITY


def reclaim_candidates(state: PlanningPass, job: Job, entries: list) -> Iterator:
    """Victim entries a job within its team's quota may take GPUs from: running jobs of its class
    or lower, of teams holding more than their quota (or of no team), unrelated to its own, not
    protected by their minimum run; the borrower with most past usage per weight first, then
    the victim order. ``entries`` is the pass's victim pool (``victims.victim_pool``), grouped by
    team once per pool (``TeamBook.victims_by_team``), so a search looks only at borrowers."""
    book = state.teams
    my_rank = PRIORITY_RANK[job.priority]
    wake = INFINITY
    try:
        for team, members in book.victims_by_team(entries):
            if book.related(job.team, team) or book.reclaimable(members[0].job, job.team) <= 0:
                continue
            for entry in members:
                other = entry.job
                if other.name == job.name or other.name in state.acted or entry.rank < my_rank:
                    continue
                if entry.protected:
                    # Its minimum run ends later: look again then, not at the next unrelated event.
                    if other.run_started_s is not None:
                        wake = min(wake, other.run_started_s + min_run_of(other, state.config))
                    continue
                yield entry
    finally:
        if wake < INFINITY:
            state._wake_at(wake)


def finishing_soon(state: PlanningPass, zones: dict[str | None, int | None], need: int) -> list[Job]:
    """Running jobs that will finish within ``reclaim_grace_s`` on their own (predicted remaining
    steps x mean step), holding GPUs in ``zones``, not yet promised to another waiting job: the
    fewest, soonest first, that give ``need`` GPUs back; empty when they cannot. Waiting for them
    is as quick as a reclaim (which takes a save) and costs nobody a restart."""
    book = state.teams
    if book._finishing is None:
        horizon = state.config.reclaim_grace_s
        soon = []
        for other in state.jobs.values():
            if not other.holdings or other.phase != "running" or other.name in state.busy:
                continue
            left_s = other.remaining_steps * predict(other, state.config).mean_step_s
            if left_s <= horizon:
                soon.append((left_s, other.name, other))
        book._finishing = [j for _, _, j in sorted(soon)]
    picked, gpus = [], 0
    for other in book._finishing:
        if other.name in book.promised or other.name in state.acted:
            continue
        mine = sum(1 for h in other.holdings if state.view.zone(h.gpu) in zones)
        if mine:
            picked.append(other)
            gpus += mine
            if gpus >= need:
                book.promised.update(j.name for j in picked)
                return picked
    return []


def reclaim_words(state: PlanningPass, requester: Job, victim: Job) -> str:
    """``team speech is below its quota (40 of 64 guaranteed GPUs) and reclaims the GPUs team
    vision borrowed beyond its own``."""
    book = state.teams
    t = book.teams[requester.team] if requester.team in book.teams else None
    mine = (f"team {requester.team} is below its quota ({book.held.get(requester.team, 0)} of "
            f"{t.quota_gpus} guaranteed GPUs)" if t is not None else f"{requester.name} is within its quota")
    if victim.team is None:
        theirs = "this job belongs to no team, so it has no quota and only borrows"
    else:
        v = book.teams[victim.team]
        theirs = (f"team {victim.team} holds {plural(book.held.get(victim.team, 0), 'GPU')}, "
                  f"{plural(book.held.get(victim.team, 0) - v.quota_gpus, 'GPU')} beyond its quota of {v.quota_gpus}")
    return f"{mine} and reclaims the GPUs other teams borrowed: {theirs}"

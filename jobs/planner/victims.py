"""Rule 4, victim choice: free GPUs so that the least work is lost.

Lower class first (best-effort, then regular; critical is never a victim of a lower class),
then the fewest GPU-seconds at risk: steps since the last save x predicted step time x GPUs,
plus the save itself. A signal-mode job's checkpoints are invisible to Omni, so stopping it
risks all the work since its current run began (plus the grace it is given to exit), and it is
never shrunk: at equal cost an Omni job goes first. ``min_run_s`` protects a job except when
the need is a reservation, a fault or a drain (``forced``). An elastic job is shrunk by whole
replicas in preference to being stopped.

The pass's part: ``take_from_victims`` searches the running jobs (``victim_pool``, built once
per pass in victim order) for the cheapest set that makes room for a waiting job, and
``emit_victim`` issues each chosen shrink or preemption with its reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import islice
from typing import TYPE_CHECKING

from jobs.planner.config import PlannerConfig
from jobs.planner.decisions import Reason
from jobs.planner.kept import KeptById
from jobs.planner.layout import accum_steps, batch_divides, replicas_of
from jobs.planner.quota import ages, failure_key, guarded, reclaim_candidates, reclaim_words
from jobs.planner.rhythm import predict, stop_time_s
from jobs.planner.snapshot import PRIORITY_RANK, Gpu, Job, holding_gpus
from jobs.planner.starvation import (
    is_aged,
    protected_by_min_run,
    protected_from_long_waiters,
    queue_order_s,
    requeues_behind,
    waited_s,
    waiting_since_s,
)
from jobs.planner.wording import duration_words, plural, returning_sentence, signal_stop_words

if TYPE_CHECKING:
    from jobs.planner.core import PlanningPass


@dataclass(frozen=True, slots=True)
class VictimOption:
    """Freeing GPUs from one job: a shrink to ``kept`` or (``kept`` empty) a preemption."""

    job: Job
    kept: tuple[Gpu, ...]
    freed: tuple[Gpu, ...]
    cost_gpu_s: float

    @property
    def is_shrink(self) -> bool:
        """True when the job keeps running on ``kept``."""
        return bool(self.kept)


def loss_gpu_s(job: Job, config: PlannerConfig, now_s: float | None = None) -> float:
    """GPU-seconds at risk when stopping ``job`` at ``now_s``.

    (steps since last save x predicted step x GPUs) + (predicted save x GPUs); for a signal-mode
    job, whose saves Omni cannot see, (time since its run began + its grace) x GPUs.
    """
    gpus = len(job.holdings)
    if job.signal:
        return (work_since_start_s(job, now_s) + job.grace_s) * gpus
    p = predict(job, config)
    unsaved = max(0, job.committed_steps - job.last_checkpoint_step)
    return unsaved * p.step_s * gpus + p.save_s * gpus


def work_since_start_s(job: Job, now_s: float | None) -> float:
    """Seconds the job's current run has lasted at ``now_s`` (0 when unknown)."""
    if now_s is None or job.run_started_s is None:
        return 0.0
    return max(0.0, now_s - job.run_started_s)


def victim_options(
    job: Job,
    config: PlannerConfig,
    floor_dp: int | None = None,
    drop_first: Callable[[tuple[Gpu, ...]], bool] | None = None,
    now_s: float | None = None,
) -> list[VictimOption]:
    """Ways to free GPUs from ``job``, fewest freed first: shrinks, then a preemption.

    Shrinks go down by whole replicas to a batch-exact DP no lower than ``floor_dp`` (default
    ``dp_min``); replicas for which ``drop_first`` is true are dropped first, then the last. A
    signal-mode job is never shrunk: only its preemption is offered.
    """
    gpus = job.gpus
    if job.signal:
        return [VictimOption(job, (), gpus, loss_gpu_s(job, config, now_s))]
    replicas = replicas_of(job, gpus)
    if drop_first is not None:
        order = sorted(range(len(replicas)), key=lambda i: (not drop_first(replicas[i]), -i))
    else:
        order = list(range(len(replicas) - 1, -1, -1))
    cost = loss_gpu_s(job, config, now_s)
    floor = job.dp_min if floor_dp is None else max(job.dp_min, floor_dp)
    options: list[VictimOption] = []
    d = len(replicas)
    for keep in range(d - 1, floor - 1, -1):
        if keep <= 0 or not batch_divides(job, keep):
            continue
        dropped = set(order[: d - keep])
        kept = tuple(g for i, r in enumerate(replicas) if i not in dropped for g in r)
        freed = tuple(g for i, r in enumerate(replicas) if i in dropped for g in r)
        options.append(VictimOption(job, kept, freed, cost))
    options.append(VictimOption(job, (), gpus, cost))
    return options


def victim_sort_key(job: Job, config: PlannerConfig, now_s: float | None = None) -> tuple:
    """Lower class first, elastic (shrinkable) first, then fewest GPU-seconds lost, Omni jobs
    before signal-mode ones, then name."""
    elastic = job.current_dp > job.dp_min and not job.signal
    return (-PRIORITY_RANK[job.priority], not elastic, loss_gpu_s(job, config, now_s), job.signal, job.name)


def choose_victims(
    candidates: Iterable[Job],
    fits: Callable[[list[Gpu]], bool],
    config: PlannerConfig,
    floor_dp: Callable[[Job], int | None] = lambda job: None,
    drop_first: Callable[[tuple[Gpu, ...]], bool] | None = None,
    fits_split: Callable[[list[Gpu], tuple[Gpu, ...]], bool] | None = None,
    now_s: float | None = None,
    allow: Callable[[VictimOption, list[VictimOption]], bool] | None = None,
    stop_if_short: bool = False,
) -> list[VictimOption] | None:
    """The cheapest set of victim options after which ``fits(freed)`` holds, or None.

    ``fits_split(chosen, extra)``, when given, is asked instead of ``fits(chosen + extra)``
    and must answer the same; ``chosen`` is one list that only grows during the search, so
    the callee can count it incrementally instead of re-reading it on every test.

    ``candidates`` must already be filtered for class and ``min_run_s`` and sorted with
    ``victim_sort_key``; it may be a lazy iterator (it is consumed only as far as needed). For each candidate in turn the smallest option that completes the
    need is taken; otherwise its largest shrink (or its preemption if it cannot shrink).
    ``allow(option, chosen)``, when given, vetoes options (a team's GPUs beyond its quota only).
    An option the others complete the need without is then dropped (``_pruned``).

    With ``stop_if_short``, a search that fails on shrinks alone is run once more taking each
    candidate's largest option (its preemption) where none completes the need: shrinks that
    each free less than the need (a team's excess, replicas off the zone) can fall short where
    two stops would do.
    """
    seen: list[Job] = []
    found = _greedy_victims(_recording(candidates, seen), fits, config, floor_dp, drop_first, fits_split, now_s,
                            allow, prefer_shrink=True)
    if found is None and stop_if_short:
        found = _greedy_victims(iter(seen), fits, config, floor_dp, drop_first, fits_split, now_s, allow,
                                prefer_shrink=False)
    return _pruned(found, fits) if found is not None and len(found) > 1 else found


#: The longest victim choice ``_pruned`` tries to drop each option of.
PRUNE_TRIES = 4


def _pruned(chosen: list[VictimOption], fits: Callable[[list[Gpu]], bool]) -> list[VictimOption]:
    """``chosen`` without the options the rest fit without, earliest first: the greedy search
    takes each candidate's largest option until one completes the need, and the last one taken
    (often the largest) can make an earlier one needless. The last alone is tried first; the
    others one by one only in a short choice (``PRUNE_TRIES``): in a long one of small victims
    each is needed, and every try is a fit test over all their GPUs."""
    last = chosen[-1]
    if fits(list(last.freed)):
        return [last]
    if len(chosen) > PRUNE_TRIES:
        return chosen
    kept = list(chosen)
    for opt in chosen[:-1]:
        rest = [o for o in kept if o is not opt]
        if fits([g for o in rest for g in o.freed]):
            kept = rest
    return kept


def _recording(candidates: Iterable[Job], into: list[Job]) -> Iterator[Job]:
    for job in candidates:
        into.append(job)
        yield job


def _greedy_victims(candidates, fits, config, floor_dp, drop_first, fits_split, now_s, allow,
                    prefer_shrink: bool) -> list[VictimOption] | None:
    chosen: list[VictimOption] = []
    freed: list[Gpu] = []
    for job in candidates:
        options = victim_options(job, config, floor_dp(job), drop_first, now_s)
        if allow is not None:
            options = [o for o in options if allow(o, chosen)]
            if not options:
                continue
        for opt in options:
            if fits_split(freed, opt.freed) if fits_split is not None else fits(freed + list(opt.freed)):
                chosen.append(opt)
                return chosen
        shrinks = [o for o in options if o.is_shrink] if prefer_shrink else []
        pick = shrinks[-1] if shrinks else options[-1]
        chosen.append(pick)
        freed.extend(pick.freed)
    return None


def victim_options_off_pool(job: Job, config: PlannerConfig, pool_nodes: set[str],
                            now_s: float | None = None) -> VictimOption:
    """Give back every GPU ``job`` holds on ``pool_nodes``: its largest shrink off them, else stop."""
    options = victim_options(job, config, drop_first=lambda r: any(g.node in pool_nodes for g in r), now_s=now_s)
    for opt in options:
        if not any(g.node in pool_nodes for g in opt.kept):
            return opt
    return options[-1]


@dataclass(frozen=True, slots=True)
class VictimEntry:
    """A possible victim with the facts every victim search filters on."""

    job: Job
    zones: frozenset[str | None]
    rank: int
    protected: bool
    excess: bool
    aged: bool
    #: A long waiter of its own class may not stop it yet (``starvation.protected_from_long_waiters``).
    turn_protected: bool


def take_from_victims(
    state: PlanningPass,
    job: Job,
    dp: int,
    zones: dict[str | None, int | None],
    rank: int,
    forced: bool,
    kind: str,
    entitled: bool,
    quota: bool = False,
) -> bool:
    """Make room for ``job`` at ``dp`` in ``zones`` by shrinking or stopping cheaper jobs.

    True when victims were found: the job then waits for their GPUs (or, in kill mode, starts
    on them at once). Failures are remembered per (class, standing, forced, aged) and size.
    With ``quota`` (rule 9) the victims are what other teams hold beyond their quotas, of the
    job's class or lower (``quota.reclaim_candidates``), never more than each team's excess.
    """
    aged = job.priority == "regular" and is_aged(job, state.now, state.config) and ages(state, job)
    if rank >= PRIORITY_RANK["best_effort"] and not forced and not quota:
        return False
    key: tuple = failure_key(state, job, rank, forced, aged)
    if quota:
        key = ("quota", job.team, PRIORITY_RANK[job.priority])
    need = dp * job.tp * job.pp
    if state.victim_failed_at.get(key, 1 << 30) <= need:
        return False
    my_rank = PRIORITY_RANK[job.priority]
    standing = queue_order_s(job, waiting_since_s(job), state.config)
    zone_set = set(zones)
    floors: dict[str, int] = {}
    book = state.teams
    # Rule 9: another team's lower-class work within its quota is not this job's to take
    # (``quota.guarded``); critical work stands above quotas.
    guards = bool(book) and not forced and my_rank > 0

    def candidates() -> Iterator[Job]:
        # victim_pool() is in victim order (lower class, elastic, cheapest first), so the
        # search stops at the first set that fits.
        pool = victim_pool(state)
        for entry in islice(pool, state._victims_head, None):
            other = entry.job
            if other.name == job.name or other.name in state.acted or zone_set.isdisjoint(entry.zones):
                continue
            if entry.rank > my_rank:
                if not forced and (entry.protected or (guards and guarded(book, job, other))):
                    continue
            elif entry.rank == my_rank:
                # Same class: a job grown beyond its preferred size, whose shrinks go no lower
                # than that size (where none of them completes the need, its preemption is
                # still offered: docs/simulator.md, "Where omni's rest goes"), or, for a long
                # waiter, a job that has had its min_run_s (rule 8).
                if entry.excess and (forced or not entry.protected):
                    floors[other.name] = other.dp
                elif not (aged and not entry.turn_protected and not entry.aged):
                    continue
                elif not requeues_behind(other, standing, state.now, state.config):
                    # Stopped now, it would wait ahead of this job and take its GPUs back at
                    # once: a save and a restart for nothing.
                    continue
                elif book and not forced and other.team != job.team and book.reclaimable(other, job.team) <= 0:
                    # A long waiter does not take from a team within its quota (rule 9): that
                    # team would only reclaim them back, and both would pay a restart.
                    continue
            else:
                continue
            yield other

    # choose_gpus() finds a placement whenever the free whole TP groups number at least
    # dp * pp (it only fails when they are fewer), so the fit test counts groups: free
    # GPUs per node once per search (whole zones from the view's incrementally kept
    # counts), the victims already chosen incrementally (that list only grows), and per
    # test only the option's own freed GPUs, instead of re-merging every free node and
    # every chosen GPU per call.
    free_now = state._free_total(zones)
    tp = job.tp
    groups_needed = dp * job.pp
    view = state.view
    base: dict[str, int] = {}
    search: dict[str, object] = {}

    def have_free(node: str) -> int:
        z = view.zone_of_node.get(node)
        return len(view.free.get(z, {}).get(node, ())) if zones[z] is None else base.get(node, 0)

    def count(gpus: Sequence[Gpu], into: dict[str, int]) -> None:
        for g in gpus:
            if view.zone(g) in zone_set and state.nodes[g.node].takes_new_work:
                into[g.node] = into.get(g.node, 0) + 1

    def fits_split(chosen: list[Gpu], extra: Sequence[Gpu]) -> bool:
        if free_now + len(chosen) + len(extra) < need:
            return False
        if groups_needed <= 0:
            return True
        if "groups" not in search:
            total = 0
            for z, limit in zones.items():
                if limit is None:
                    total += view.free_groups(z, tp)
                else:
                    # Same counts as view.candidates() for a capped zone.
                    for n, idx in view.candidates({z: limit}).items():
                        base[n] = len(idx)
                        total += len(idx) // tp
            search["groups"] = total
        if search.get("list") is not chosen:
            search["list"], search["seen"], search["added"], search["gain"] = chosen, 0, {}, 0
        added: dict[str, int] = search["added"]  # type: ignore[assignment]
        seen: int = search["seen"]  # type: ignore[assignment]
        if seen < len(chosen):
            more: dict[str, int] = {}
            count(chosen[seen:], more)
            gain: int = search["gain"]  # type: ignore[assignment]
            for node, k in more.items():
                now = have_free(node) + added.get(node, 0)
                gain += (now + k) // tp - now // tp
                added[node] = added.get(node, 0) + k
            search["seen"], search["gain"] = len(chosen), gain
        extra_added: dict[str, int] = {}
        count(extra, extra_added)
        groups: int = search["groups"] + search["gain"]  # type: ignore[operator]
        for node, k in extra_added.items():
            now = have_free(node) + added.get(node, 0)
            groups += (now + k) // tp - now // tp
        return groups >= groups_needed

    def fits(freed: list[Gpu]) -> bool:
        return fits_split([], freed)

    def within_excess(opt: VictimOption, chosen: Iterable[VictimOption]) -> bool:
        # Never more from a team than it holds beyond its quota (nor beyond a parent's),
        # counted as its quota counts them: GPUs another team's reservation lent it are
        # given back to that pool and leave its excess as it was (``quota.charged_gpus``).
        taken = sum(book.charge(o.job, o.freed) for o in chosen if book.related(o.job.team, opt.job.team)
                    or (o.job.team is None and opt.job.team is None))
        return book.charge(opt.job, opt.freed) + taken <= book.reclaimable(opt.job, job.team)

    allow = None
    if quota:

        def quota_candidates() -> Iterator[Job]:
            for entry in reclaim_candidates(state, job, victim_pool(state)):
                if not zone_set.isdisjoint(entry.zones):
                    yield entry.job

        allow = within_excess
    elif guards:

        def across(opt: VictimOption) -> bool:
            return opt.job.team != job.team and PRIORITY_RANK[opt.job.priority] > my_rank

        def allow(opt: VictimOption, chosen: list[VictimOption]) -> bool:
            # Rule 9: from another team's lower-class work, no more than it holds beyond its
            # quota (``quota.guarded``).
            return not across(opt) or within_excess(opt, (o for o in chosen if across(o)))

    options = choose_victims(quota_candidates() if quota else candidates(), fits, state.config,
                             floor_dp=lambda j: floors.get(j.name), fits_split=fits_split, now_s=state.now,
                             allow=allow, stop_if_short=quota)
    if options is None:
        state.victim_failed_at[key] = min(need, state.victim_failed_at.get(key, 1 << 30))
        return False
    names = []
    for opt in options:
        names.append(opt.job.name)
        emit_victim(state, opt, job, forced, aged, quota=quota)
    if state.kill:
        return state._try_place(job, dp, 0, [], [], kind, entitled)
    soon_gpus = sum(len(o.freed) for o in options)
    state._claim_soon_free(zones, soon_gpus)
    state._claim_free(job, zones, need)
    state._hold(job, "waiting_for_release", returning_sentence(soon_gpus, names, job.tp, job.pp, dp),
                gpus_needed=need, victims=names)
    return True


#: (job snapshot, the config, its ``victim_sort_key`` when that reads nothing of the instant (an
#: Omni job's), its nodes in holding order), for ``victim_pool``.
_VICTIM_FACTS = KeptById()
#: (job snapshot, the zone map, the nodes low on disk, the config, the instant, its ``VictimEntry``):
#: an entry is reused while the job, the zones and the config stand and its flags still hold.
_VICTIM_ENTRIES = KeptById()


def victim_pool(state: PlanningPass) -> list[VictimEntry]:
    """Running non-critical jobs that could give GPUs back, in victim order.

    Built once per pass with what the filters need precomputed; entries already acted on
    are dropped from time to time so later searches stay short.
    """
    if state._victims_sorted is None:
        pool = [
            j for j in holding_gpus(state.jobs.values())
            if j.phase in ("running", "checkpointing") and j.name not in state.busy
            and PRIORITY_RANK[j.priority] > 0
        ]
        config, now = state.config, state.now
        _VICTIM_FACTS.trim(len(state.jobs))
        facts: dict[str, tuple[Job, PlannerConfig, tuple | None, tuple[str, ...]]] = {}
        for j in pool:
            hit = _VICTIM_FACTS.get(id(j))
            if hit is None or hit[0] is not j or hit[1] is not config:
                hit = _VICTIM_FACTS.keep(j, config, None if j.signal else victim_sort_key(j, config),
                                         tuple(dict.fromkeys(h.gpu.node for h in j.holdings)))
            facts[j.name] = hit
        pool.sort(key=lambda j: facts[j.name][2] or victim_sort_key(j, config, now))
        zone_of = state.view.zone_of_node
        # GPUs on a node low on disk free nothing anyone may use: they do not count.
        low_disk = frozenset(n for n, node in state.nodes.items() if node.low_disk)
        _VICTIM_ENTRIES.trim(len(state.jobs))
        entries = []
        for j in pool:
            hit = _VICTIM_ENTRIES.get(id(j))
            if hit is not None and hit[0] is j and hit[1] is zone_of and hit[2] == low_disk and hit[3] is config:
                entry = hit[5]
                # A job's minimum run only ends as time goes on: an entry protected by none
                # stays so (and a pool job holds GPUs, so it is never aged).
                if entry.protected or entry.turn_protected or now < hit[4]:
                    protected, turn = protected_by_min_run(j, now, config), protected_from_long_waiters(j, now)
                    if (protected, turn) != (entry.protected, entry.turn_protected):
                        entry = replace(entry, protected=protected, turn_protected=turn)
                        _VICTIM_ENTRIES.keep(j, zone_of, low_disk, config, now, entry)
            else:
                entry = VictimEntry(
                    job=j,
                    zones=frozenset(map(zone_of.get, facts[j.name][3] if not low_disk else
                                        [n for n in facts[j.name][3] if n not in low_disk])),
                    rank=PRIORITY_RANK[j.priority],
                    protected=protected_by_min_run(j, now, config),
                    excess=j.current_dp > j.dp,
                    aged=is_aged(j, now, config),
                    turn_protected=protected_from_long_waiters(j, now),
                )
                _VICTIM_ENTRIES.keep(j, zone_of, low_disk, config, now, entry)
            entries.append(entry)
        state._victims_sorted = entries
        state._victims_acted_seen = len(state.acted)
        state._victims_head = 0
    elif len(state.acted) - state._victims_acted_seen >= max(16, len(state._victims_sorted) // 8):
        state._victims_sorted = [e for e in state._victims_sorted if e.job.name not in state.acted]
        state._victims_acted_seen = len(state.acted)
        state._victims_head = 0
    # The cheapest victims are taken first, so acted-on entries gather at the head: skip
    # that prefix once instead of re-testing it on every search (the searches skip acted
    # entries anyway).
    entries = state._victims_sorted
    head = state._victims_head
    while head < len(entries) and entries[head].job.name in state.acted:
        head += 1
    state._victims_head = head
    return entries


def emit_victim(state: PlanningPass, opt: VictimOption, requester: Job, forced: bool, aged: bool,
                quota: bool = False) -> None:
    """Issue the shrink or preemption ``opt`` describes, saying whom it makes room for."""
    job = opt.job
    p = predict(job, state.config)
    unsaved = max(0, job.committed_steps - job.last_checkpoint_step)
    inputs = {
        "for_job": requester.name,
        "for_priority": requester.priority,
        "victim_priority": job.priority,
        "steps_since_save": unsaved,
        "predicted_step_s": round(p.step_s, 3),
        "predicted_save_s": p.save_s,
        "loss_gpu_s": round(opt.cost_gpu_s, 1),
        "gpus_freed": len(opt.freed),
        "run_s": round(state.now - job.run_started_s, 1) if job.run_started_s is not None else 0.0,
        "min_run_s": job.min_run_s,
    }
    why = (f"{requester.name} ({requester.priority}"
           f"{', waiting ' + duration_words(waited_s(requester, state.now)) if aged else ''}) needs GPUs")
    deadline = state.now + stop_time_s(job, state.config, p) + state.config.reclaim_margin_s
    rule = "victims" if not aged or PRIORITY_RANK[job.priority] > 1 else "starvation"
    if quota:
        rule = "quota.reclaim"
        why = f"{requester.name} needs GPUs: {reclaim_words(state, requester, job)}"
        inputs.update(for_team=requester.team, victim_team=job.team,
                      lead_time_s=round(deadline - state.now, 3),
                      predicted_stop_s=round(p.mean_step_s + p.save_s, 3) if not job.signal else job.grace_s)
    if opt.is_shrink:
        d_after = len(opt.kept) // (job.tp * job.pp)
        text = (f"{why}; this {job.priority} job gives back {plural(len(opt.freed), 'GPU')} by shrinking from dp "
                f"{job.current_dp} to {d_after} (accumulation {accum_steps(job, job.current_dp)} -> "
                f"{accum_steps(job, d_after)}, global batch {job.global_batch} unchanged) rather "
                f"than stopping; it was the cheapest choice ({opt.cost_gpu_s:.0f} GPU-s at risk).")
        state._emit("shrink", job, opt.kept, Reason(rule, text, inputs),
                    deadline_s=deadline, graceful=not state.kill, forced=forced)
    elif job.signal:
        ran_s = work_since_start_s(job, state.now)
        inputs.update(signal=True, work_since_start_s=round(ran_s, 1), grace_s=job.grace_s)
        text = (f"{why}; this {job.priority} {signal_stop_words(ran_s, job.grace_s)} "
                f"({opt.cost_gpu_s:.0f} GPU-s at risk); no cheaper victim.")
        state._emit("preempt", job, (), Reason(rule, text, inputs),
                    deadline_s=deadline, graceful=not state.kill, forced=forced)
    else:
        text = (f"{why}; this {job.priority} job was the cheapest to stop ({unsaved} steps since its "
                f"last save, {opt.cost_gpu_s:.0f} GPU-s at risk)"
                f"{'' if state.kill else ' and saves a checkpoint first'}.")
        state._emit("preempt", job, (), Reason(rule, text, inputs),
                    deadline_s=deadline, graceful=not state.kill, forced=forced)

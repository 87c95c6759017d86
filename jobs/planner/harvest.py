"""Rule 3, harvesting: lend reserved-but-idle GPUs, and plan the reclaim ahead of need.

Each reservation with a node pool is summarised as a ``PoolState``: how many of its GPUs are
free, when the entitlement next needs GPUs (``next_need_s``) and how many must be free then
(``must_be_free``). Free pool GPUs beyond that need (hot spares) may be lent until a fault
asks for them; the rest only into a window that fits start-up + load + some steps + the
reclaim lead time (``rhythm.reclaim_lead_time``), so the borrower has saved before the
entitlement begins. Filling such known-free windows beats preempting later. A borrower that
would not finish in the window takes it only if it takes at least ``loan_share_min`` of the
pool's GPUs (``takes_window``, ``window_taken``): each is stopped at the window's end, and a window cut into many
small loans is as many stops; running jobs grow into what that keeps (``growth``).

A pool whose job has not arrived has no known need: the job may come at any moment. It lends
to borrowers that can save within ``reclaim_grace_s`` of being asked and, with
``lend_past_grace``, to borrowers that checkpoint at least every ``loan_loss_max_s``: if the job
comes, those are stopped without a checkpoint, so the job is never short, and lose at most the
steps since their last periodic save. A recurring reservation's gaps count as such time too
while its job has not arrived (the job may come at a window's start or in the gap), so a
borrower is not sent away at every window for a job that is not there.

The same mechanism lends the GPUs of a job in a known idle phase: they form a pool
``idle:<job>`` whose need begins when the phase ends. The pass's part of the rule is here too:
``review_pools`` (summarise the pools, reclaim loans that are due), ``lend_idle_phases``,
``zones_open_to`` (which pools a job may borrow from) and the wording of loans.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jobs.planner.config import PlannerConfig
from jobs.planner.decisions import Reason
from jobs.planner.entitlements import entitled_gpus, is_active, next_boundary_s, next_start_s
from jobs.planner.rhythm import (
    expected_stop_s,
    lead_words,
    loan_steps,
    min_loan_window_s,
    predict,
    reclaim_lead_time,
    step_time_at,
    stop_time_s,
    widened_words,
)
from jobs.planner.snapshot import WAITING_PHASES, Gpu, Job, Reservation
from jobs.planner.victims import (
    VictimOption,
    choose_victims,
    victim_options_off_pool,
    victim_sort_key,
    work_since_start_s,
)
from jobs.planner.wording import duration_words, gpus_are, plural, pool_label, signal_stop_words, upper_first

if TYPE_CHECKING:
    from jobs.planner.core import PlanningPass

INFINITY = math.inf


@dataclass(frozen=True, slots=True)
class PoolState:
    """One reservation pool as one planning pass sees it."""

    reservation: Reservation
    healthy_gpus: int
    free_gpus: int
    owner_held: int
    need_now: int
    next_need_s: float
    must_be_free: int
    #: False while the pool is active but its job has not arrived: the need may come any time.
    need_predictable: bool = True

    @property
    def spare_lendable(self) -> int:
        """Free pool GPUs not needed at ``next_need_s``: lendable until a fault needs them."""
        return max(0, self.free_gpus - self.must_be_free)

    @property
    def deficit(self) -> int:
        """GPUs that must come back from borrowers before ``next_need_s``."""
        return max(0, self.must_be_free - self.free_gpus)


def pool_state(
    res: Reservation,
    owner: Job | None,
    now_s: float,
    healthy_gpus: int,
    free_gpus: int,
    owner_busy: bool = False,
    gaps_unannounced: bool = False,
) -> PoolState:
    """Summarise a pool: what its entitlement needs now and next, and what is free.

    ``owner`` is None when the reserved job is not (yet) in the snapshot: an active pool then
    has no known need (the job's arrival cannot be predicted) and an inactive one needs its
    full ``gpus`` at its next start; with ``gaps_unannounced``, a recurring reservation that has
    begun has no known need in its gaps either while its job has not arrived.
    """
    cap = res.gpus if owner is None else min(res.gpus, owner.dp_max * owner.tp * owner.pp)
    held = len(owner.holdings) if owner is not None else 0
    need_now = entitled_gpus(res, now_s, owner is not None, cap)
    if need_now > 0:
        deficit_now = 0 if owner_busy else max(0, need_now - held)
        if deficit_now > 0:
            return PoolState(res, healthy_gpus, free_gpus, held, need_now, now_s, deficit_now)
        if res.period_s:
            nxt = next_start_s(res, now_s)
            return PoolState(res, healthy_gpus, free_gpus, held, need_now, nxt, cap if nxt < INFINITY else 0)
        return PoolState(res, healthy_gpus, free_gpus, held, need_now, INFINITY, 0)
    active = is_active(res, now_s)
    nxt = next_start_s(res, now_s) if not active else INFINITY
    if owner is None and (active or (gaps_unannounced and res.period_s and res.start_s <= now_s and nxt < INFINITY)):
        return PoolState(res, healthy_gpus, free_gpus, held, 0, INFINITY, 0, need_predictable=False)
    if nxt == INFINITY:
        return PoolState(res, healthy_gpus, free_gpus, held, 0, INFINITY, 0)
    still_held = 0 if res.period_s else held
    return PoolState(res, healthy_gpus, free_gpus, held, 0, nxt, max(0, cap - still_held))


def lendable_gpus(pool: PoolState, borrower: Job, dp: int, now_s: float, config: PlannerConfig) -> tuple[int, float, float]:
    """How many of the pool's free GPUs ``borrower`` at ``dp`` may borrow, the window, and the minimum.

    Returns ``(gpus, window_s, needed_s)``: all free GPUs when the window to ``next_need_s``
    fits ``min_loan_window_s``, otherwise only the spare ones.
    """
    window_s = pool.next_need_s - now_s
    needed_s = min_loan_window_s(borrower, dp, config)
    if config.reclaim_mode == "kill":
        needed_s = 0.0
    elif not pool.need_predictable and not may_borrow_unannounced(borrower, config):
        # The reserved job may arrive at any moment: lend only to a borrower that can save
        # within reclaim_grace_s of being asked, or lose little if stopped without a save.
        return 0, window_s, needed_s
    if window_s > 0 and window_s >= needed_s and (config.reclaim_mode == "kill"
                                                  or takes_window(borrower, dp, pool, window_s, config)):
        return pool.free_gpus, window_s, needed_s
    return pool.spare_lendable, window_s, needed_s


def finish_window_s(job: Job, dp: int, config: PlannerConfig) -> float:
    """The window ``job`` started now at ``dp`` needs to start up, load, run its remaining steps
    (the planning step, ``safety_factor`` x the declared one) and still have a reclaim's lead time
    left: a loan of at least that ends with the job done, not stopped."""
    p = predict(job, config)
    run_s = job.remaining_steps * step_time_at(job, dp) * config.safety_factor
    return config.startup_s + p.load_s + run_s + reclaim_lead_time(job, config, p)


def takes_window(job: Job, dp: int, pool: PoolState, window_s: float, config: PlannerConfig) -> bool:
    """Whether a job starting at ``dp`` may borrow ``pool``'s window of ``window_s``, which ends
    in a reclaim (``window_taken``). A job already running (growing) is not asked: its reclaim is
    a shrink."""
    if config.loan_share_min <= 0 or job.holdings or window_s >= config.min_run_s:
        return True
    return window_taken(dp * job.tp * job.pp, finish_window_s(job, dp, config), pool, window_s, config)


def window_taken(gpus: int, finish_s: float, pool: PoolState, window_s: float, config: PlannerConfig) -> bool:
    """Whether a borrower of ``gpus`` that needs ``finish_s`` to finish (``finish_window_s``) may
    borrow ``pool``'s window of ``window_s``, which ends in a reclaim: the window is at least
    ``min_run_s`` long (a turn as long as any job is sure of between stops), the borrower finishes
    within it, or it takes at least ``loan_share_min`` of the pool's healthy GPUs, so that a short
    window is stopped in at most 1/share loans."""
    return (config.loan_share_min <= 0 or window_s >= config.min_run_s or finish_s <= window_s
            or gpus >= config.loan_share_min * pool.healthy_gpus)


def fits_in_grace(borrower: Job, config: PlannerConfig) -> bool:
    """Whether ``borrower`` can finish its step and save (or, in signal mode, exit) within
    ``reclaim_grace_s``."""
    return stop_time_s(borrower, config) <= config.reclaim_grace_s


def checkpoint_interval_s(job: Job) -> float:
    """Seconds between the job's periodic saves at its smallest size (declared step time): the
    most work a stop without a checkpoint can lose."""
    return job.checkpoint.every_steps * step_time_at(job, job.dp_min)


def loss_bounded(borrower: Job, config: PlannerConfig) -> bool:
    """Whether ``borrower`` may be stopped without a checkpoint when a need comes unannounced
    (``lend_past_grace``): its periodic saves are seen (not a signal-mode job) and come at least
    every ``loan_loss_max_s``."""
    return (config.lend_past_grace and not borrower.signal and borrower.checkpoint.every_steps > 0
            and checkpoint_interval_s(borrower) <= config.loan_loss_max_s)


def may_borrow_unannounced(borrower: Job, config: PlannerConfig) -> bool:
    """Whether a pool whose need may come at any moment may lend to ``borrower``: it can save
    within the grace (``fits_in_grace``), or it may be stopped without one (``loss_bounded``)."""
    return fits_in_grace(borrower, config) or loss_bounded(borrower, config)


def unannounced_loan_words(state: PlanningPass, pool_name: str, job: Job) -> str:
    """Why a pool whose job may arrive at any moment lends to ``job``: it can save within the
    grace, or it would be stopped without a checkpoint and lose at most its last interval."""
    grace = duration_words(state.config.reclaim_grace_s)
    if fits_in_grace(job, state.config):
        return f"the job of '{pool_name}' has not arrived, and this job can save within the {grace} it would have if it did"
    return (f"the job of '{pool_name}' has not arrived; if it does, this job cannot save within the {grace} grace "
            f"and is stopped without a checkpoint, losing at most the steps since its last periodic save "
            f"(every {duration_words(checkpoint_interval_s(job))} at most)")


def unsaved_refusal_words(job: Job, config: PlannerConfig) -> str:
    """Why ``job`` may not be stopped unsaved either (``loss_bounded`` is false), or nothing if
    ``lend_past_grace`` is off."""
    if not config.lend_past_grace:
        return ""
    if job.signal:
        return ", and its saves are not seen, so it cannot be stopped without one at a known loss"
    return (f", nor stopped without one: it saves only every {duration_words(checkpoint_interval_s(job))} "
            f"at its smallest size, more than the {duration_words(config.loan_loss_max_s)} a loan may put at risk")


def stops_unsaved(borrower: Job, need_s: float, now_s: float, config: PlannerConfig) -> bool:
    """Whether a reclaim of ``borrower`` for a need at ``need_s`` stops it without a checkpoint:
    in ``kill`` mode always; gracefully, when the need has come, the borrower cannot save within
    the grace and may be stopped unsaved (``loss_bounded``; one that may not saves, and the
    pool's job waits)."""
    if config.reclaim_mode == "kill":
        return True
    return need_s <= now_s + 1e-9 and not fits_in_grace(borrower, config) and loss_bounded(borrower, config)


def fits_elsewhere(state: PlanningPass, owner: Job, gpus: int) -> bool:
    """Whether ``gpus`` more GPUs for ``owner`` are free now outside every pool, in whole TP
    groups: a borrower is then not stopped without a checkpoint for it (the owner's admission
    starts it there; its entitlement counts GPUs, not nodes)."""
    replicas = -(-gpus // (owner.tp * owner.pp))
    return state.view.free_groups(None, owner.tp) >= replicas * owner.pp


def reclaim_due_s(borrower: Job, pool: PoolState, config: PlannerConfig) -> float:
    """When ``borrower`` must be told to give the pool's GPUs back.

    ``next_need_s - lead time`` gracefully; at the moment of need in ``kill`` mode.
    """
    if config.reclaim_mode == "kill":
        return pool.next_need_s
    return pool.next_need_s - reclaim_lead_time(borrower, config)


def review_pools(state: PlanningPass) -> None:
    """Summarise every reservation pool, and reclaim the loans whose lead time has come."""
    for res in state.reservations:
        state._wake_at(next_boundary_s(res, state.now))
        if not res.nodes:
            continue
        owner = state.jobs.get(res.job)
        healthy, held = pool_gpus(state, res)
        free = state.view.free_count(res.name)
        pool = pool_state(res, owner, state.now, healthy, free, owner_busy=res.job in state.busy,
                          gaps_unannounced=state.config.lend_past_grace)
        state.pools[res.name] = pool
        if pool.next_need_s < INFINITY:
            state._wake_at(pool.next_need_s)
        # GPUs already on their way back count as returned.
        returning = 0
        borrowers: dict[str, list[Gpu]] = {}
        for g in held:
            holder = state.view.owner[g]
            if holder == res.job:
                continue
            if holder in state.busy:
                returning += 1
                continue
            borrowers.setdefault(holder, []).append(g)
        deficit = pool.must_be_free - pool.free_gpus - returning
        if deficit <= 0 or pool.next_need_s == INFINITY or not borrowers:
            continue
        candidates = sorted(
            (state.jobs[b] for b in borrowers if b in state.jobs and b not in state.acted),
            key=lambda j: victim_sort_key(j, state.config, state.now),
        )
        if not candidates:
            continue
        # Nothing can be due before the longest lead time: just ask to be woken then.
        earliest_due = min(reclaim_due_s(j, pool, state.config) for j in candidates)
        if earliest_due > state.now + 1e-9:
            state._wake_at(earliest_due)
            continue
        pool_nodes = set(res.nodes)
        options = choose_victims(
            candidates,
            lambda freed, nodes=pool_nodes, short=deficit: sum(1 for g in freed if g.node in nodes) >= short,
            state.config,
            drop_first=lambda replica, nodes=pool_nodes: any(g.node in nodes for g in replica),
            now_s=state.now,
        )
        if options is None:
            # Not enough on loan to cover it (e.g. a failed pool node): reclaim them all.
            options = []
            for job in candidates:
                options.append(victim_options_off_pool(job, state.config, pool_nodes, state.now))
        spared = owner is not None and fits_elsewhere(state, owner, deficit)
        for opt in options:
            due = reclaim_due_s(opt.job, pool, state.config)
            if spared and stops_unsaved(opt.job, pool.next_need_s, state.now, state.config):
                continue  # the owner starts on free GPUs elsewhere: nobody loses work for it
            if due <= state.now + 1e-9:
                emit_reclaim(state, opt, res, pool)
            else:
                state._wake_at(due)


def pool_gpus(state: PlanningPass, res: Reservation) -> tuple[int, list[Gpu]]:
    """(healthy GPUs, the held ones among them) on the nodes the pool still owns."""
    healthy = 0
    held: list[Gpu] = []
    for name in res.nodes:
        node = state.nodes.get(name)
        if node is None or not node.takes_new_work:
            continue
        if state.view.zone_of_node.get(name) != res.name:
            continue
        healthy += node.gpus
        gpus = _node_gpus(name, node.gpus)
        for i in sorted(state.view.held_by_node.get(name, ())):
            g = gpus[i] if i < len(gpus) else Gpu(name, i)
            if g in state.view.owner:
                held.append(g)
    return healthy, held


#: Each node's ``Gpu`` values by index, made once (``pool_gpus`` reads every pool's on every pass).
_NODE_GPUS: dict[str, tuple[Gpu, ...]] = {}


def _node_gpus(name: str, count: int) -> tuple[Gpu, ...]:
    hit = _NODE_GPUS.get(name)
    if hit is None or len(hit) < count:
        hit = _NODE_GPUS[name] = tuple(Gpu(name, i) for i in range(count))
    return hit


def emit_reclaim(state: PlanningPass, opt: VictimOption, res: Reservation, pool: PoolState) -> None:
    """Tell a borrower to give the pool's GPUs back: after a save, or without one in kill mode
    and where ``stops_unsaved`` says (the need has come and the borrower could not save within
    the grace)."""
    job = opt.job
    lead_s = reclaim_lead_time(job, state.config)
    need_s = pool.next_need_s
    inputs = {
        "reservation": res.name,
        "need_at_s": need_s,
        "lead_time_s": round(lead_s, 3),
        "predicted_save_s": predict(job, state.config).save_s,
        # What the stop is expected to take, without the safety factor: scored against the outcome.
        "predicted_stop_s": round(expected_stop_s(job, state.config), 3),
        "safety_factor": state.config.safety_factor,
        "gpus_returned": len(opt.freed),
    }
    unsaved = stops_unsaved(job, need_s, state.now, state.config)
    if unsaved:
        del inputs["predicted_stop_s"]  # no stop to score: nothing is saved
    label = upper_first(pool_label(res.name))
    if unsaved and state.kill:
        text = f"{label} needs its GPUs now; the job was stopped without a checkpoint to return {plural(len(opt.freed), 'GPU')} at once."
        deadline = state.now
    elif unsaved:
        at_risk = max(0, job.committed_steps - job.last_checkpoint_step)
        inputs.update(unsaved=True, stop_time_s=round(stop_time_s(job, state.config), 3),
                      grace_s=state.config.reclaim_grace_s, steps_since_save=at_risk,
                      checkpoint_interval_s=round(checkpoint_interval_s(job), 1))
        text = (
            f"{label} needs its GPUs now (its job arrived unannounced or lost GPUs to a fault). This job "
            f"could not save within the {duration_words(state.config.reclaim_grace_s)} grace "
            f"({stop_time_s(job, state.config):.0f}s to finish its step and save), so it is stopped without a "
            f"checkpoint and returns {plural(len(opt.freed), 'GPU')} at once"
            + (f" (and the other {len(job.gpus) - len(opt.freed)} it holds: it restarts from its last save)"
               if len(job.gpus) > len(opt.freed) else "")
            + f"; it loses the {plural(at_risk, 'step')} since its last periodic save, as its loan said it might."
        )
        deadline = state.now
    elif job.signal:
        deadline = max(need_s, state.now + lead_s)
        ran_s = work_since_start_s(job, state.now)
        inputs.update(signal=True, work_since_start_s=round(ran_s, 1), grace_s=job.grace_s)
        when = "now" if need_s <= state.now + 1e-9 else f"at {state._when(need_s)}"
        text = (
            f"{label} needs its GPUs {when}; the loan ends now, so the job returns "
            f"{plural(len(opt.freed), 'GPU')} within {lead_s:.0f}s (its grace + margin). It is a "
            f"{signal_stop_words(ran_s, job.grace_s)}."
        )
    else:
        prediction = predict(job, state.config)
        # A save slower than predicted may run into the grace, never past it: the command's
        # deadline (a preempt not confirmed by then is killed) allows for that.
        slack_s = max(0.0, stop_time_s(job, state.config, prediction) + state.config.reclaim_margin_s - lead_s)
        deadline = max(need_s, state.now + lead_s) + slack_s
        widened = widened_words(prediction, state.config)
        if widened:
            inputs.update(margin_widened=True, step_stdev_s=round(prediction.stdev_step_s, 4))
        how = lead_words(job, state.config, prediction)
        if need_s <= state.now + 1e-9:
            text = (
                f"{label} needs these GPUs now (its job became entitled or lost GPUs to a fault); the job "
                f"saves its checkpoint and returns {plural(len(opt.freed), 'GPU')} within {lead_s + slack_s:.0f}s."
            )
        else:
            text = (
                f"{label} needs its GPUs at {state._when(need_s)}; the loan ends now, {lead_s:.0f}s ahead "
                f"({how}), so the job saves before then."
            )
        text += widened
    state._emit(
        "reclaim",
        job,
        () if unsaved else opt.kept,  # a job stopped unsaved keeps nothing: it restarts from its last save
        Reason("harvest.reclaim", text, inputs),
        deadline_s=deadline,
        graceful=not unsaved,
        forced=True,
    )


def lend_idle_phases(state: PlanningPass) -> None:
    """Lend the GPUs of jobs in a known idle phase to waiting work, for the phase's length."""
    idle = [j for j in state.jobs.values()
            if j.idle_until_s is not None and j.holdings and j.phase == "running" and not j.signal
            and j.name not in state.busy and j.name not in state.acted
            and j.idle_until_s - state.now >= state.config.idle_lend_min_s]
    if not idle:
        return
    waiting = [j for j in state.jobs.values()
               if j.phase in WAITING_PHASES and not j.parked and j.priority != "critical"
               and j.name not in state.busy and state._dormant_between_windows(j) is None]
    if not waiting:
        return
    for job in idle:
        nodes = {g.node for g in job.gpus}
        whole = all(
            state.view.zone_of_node.get(n) is None
            and state.nodes[n].takes_new_work
            and len(state.view.held_by_node.get(n, ())) == state.nodes[n].gpus
            and all(state.view.owner.get(Gpu(n, i)) == job.name for i in range(state.nodes[n].gpus))
            for n in nodes
        )
        if not whole:
            continue
        remaining_s = job.idle_until_s - state.now  # type: ignore[operator]
        p = predict(job, state.config)
        takers = [
            w.name for w in waiting
            if w.dp_min * w.tp * w.pp <= len(job.holdings)
            and min_loan_window_s(w, w.dp_min, state.config) + p.load_s <= remaining_s
        ]
        if not takers:
            continue
        state._emit("lend", job, (),
                    Reason("harvest.idle",
                           f"The job is in a known idle phase for another {remaining_s:.0f}s; its "
                           f"{gpus_are(len(job.holdings), 'lent')} to waiting work ({', '.join(sorted(takers)[:3])}) "
                           f"and reclaimed with a checkpoint before {state._when(job.idle_until_s)}, when it "
                           f"reloads ({p.load_s:.0f}s) and continues.",
                           {"idle_until_s": job.idle_until_s, "idle_remaining_s": round(remaining_s, 1),
                            "gpus_lent": len(job.holdings), "predicted_load_s": p.load_s,
                            "candidates": sorted(takers)[:5]}),
                    deadline_s=job.idle_until_s)


def zones_open_to(state: PlanningPass, job: Job, dp: int) -> dict[str | None, int | None]:
    """Zones ``job`` may draw GPUs from at ``dp``: general, its own pools, pools that may lend to it.

    A zone capped at ``n`` lends only its ``n`` hot spares to this job: the window before the
    pool's next need is too short for it. The pass caches the answer (``_zones_for``).
    """
    zones: dict[str | None, int | None] = {None: None}
    for res in state.res_of_job.get(job.name, ()):
        if res.name in state.pools:
            zones[res.name] = None
    if job.priority == "critical":
        # A critical job outside its own reservation never borrows: it would be reclaimed
        # from, which it must not be.
        return zones
    return open_pools(state, zones, lambda: min_loan_window_s(job, dp, state.config),
                      lambda: may_borrow_unannounced(job, state.config),
                      lambda pool, window: takes_window(job, dp, pool, window, state.config))


def open_pools(
    state: PlanningPass,
    zones: dict[str | None, int | None],
    window_s: Callable[[], float],
    unannounced_ok: Callable[[], bool],
    takes: Callable[[PoolState, float], bool] | None = None,
) -> dict[str | None, int | None]:
    """``zones`` with the pools that may lend to a borrower whose shortest worthwhile loan is
    ``window_s()`` (``min_loan_window_s``), that may borrow a pool whose need may come at any
    moment or not (``unannounced_ok()``: ``may_borrow_unannounced``) and, if ``takes`` is given,
    that may take a given pool's window ending in a reclaim (``takes(pool, window)``:
    ``takes_window``), each capped at what it may lend: ``zones_open_to``'s part for borrowed
    GPUs. Each is asked only if a pool needs it. A smaller window, being allowed unannounced
    pools, or no ``takes``, never opens fewer GPUs."""
    if state._lendable_pools is None:
        state._lendable_pools = [(name, pool) for name, pool in sorted(state.pools.items()) if pool.free_gpus > 0]
    needed_s: float | None = None
    totals = state.view.zone_total
    if any(totals.get(name, 0) <= 0 for name, _ in state._lendable_pools) and not state.kill:
        # Exhausted pools stay exhausted for the rest of a graceful pass (GPUs given back
        # come free only after the borrower has saved): stop looking at them.
        state._lendable_pools = [(n, p) for n, p in state._lendable_pools if totals.get(n, 0) > 0]
    for name, pool in state._lendable_pools:
        if name in zones or totals.get(name, 0) <= 0:
            continue
        if not pool.need_predictable and not state.kill and not unannounced_ok():
            continue
        window = pool.next_need_s - state.now
        if window > 0 and needed_s is None:
            needed_s = 0.0 if state.kill else window_s()
        fits = window > 0 and needed_s is not None and window >= needed_s
        if fits and takes is not None and not state.kill and not takes(pool, window):
            fits = False
        n = pool.free_gpus if fits else pool.spare_lendable
        if n > 0:
            zones[name] = n
    return zones


def loan_notes(state: PlanningPass, job: Job, dp: int, lent: list[str]) -> list[str]:
    """Why each pool in ``lent`` may lend to ``job`` at ``dp`` now, one phrase per pool."""
    notes = []
    for z in lent:
        pool = state.pools[z]
        n, window_s, needed_s = lendable_gpus(pool, job, dp, state.now, state.config)
        if pool.need_now > 0 and (window_s == INFINITY or n < pool.free_gpus or window_s <= 0):
            unsaved = "" if fits_in_grace(job, state.config) or not loss_bounded(job, state.config) else (
                " (if one does, this job cannot save within the grace and is stopped without a checkpoint)")
            notes.append(f"they are hot spares of '{z}', lent until a fault needs them{unsaved}")
        elif not pool.need_predictable:
            notes.append(unannounced_loan_words(state, z, job))
        elif window_s == INFINITY:
            notes.append(f"'{z}' does not need them again")
        elif n < pool.free_gpus or window_s <= 0:
            notes.append(f"they are spares of '{z}' beyond what its next window needs")
        else:
            notes.append(f"{pool_label(z)} needs them in {window_s:.0f}s and this job needs a window "
                         f"of {needed_s:.0f}s (start-up, load, {loan_steps_words(job, state.config)}, save)")
    return notes


def loan_steps_words(job: Job, config: PlannerConfig) -> str:
    """``rhythm.loan_steps`` in words: ``20 steps``, or ``the 3 steps it has left``."""
    steps = loan_steps(job, config)
    return plural(steps, "step") if steps == config.min_loan_steps else f"the {plural(steps, 'step')} it has left"


def refused_loan_notes(state: PlanningPass, job: Job) -> list[str]:
    """Up to three phrases on pools with free GPUs that ``job`` may not borrow, and why."""
    notes: list[str] = []
    zones_min = state._zones_for(job, job.dp_min)
    for name, pool in state._lendable_pools or ():
        if len(notes) >= 3:
            break
        if name in {r.name for r in state.res_of_job.get(job.name, ())} or job.priority == "critical":
            continue
        free_now = state.view.free_count(name)
        if free_now <= 0 or (zones_min.get(name) or 0) >= free_now:
            continue
        n, window_s, needed_s = lendable_gpus(pool, job, job.dp_min, state.now, state.config)
        refused = f"{free_now - min(n, free_now)} free GPUs of {pool_label(name)} cannot be lent to it"
        if not pool.need_predictable:
            notes.append(f"{refused}: their job may arrive at any moment, and this one could not save within "
                         f"the {duration_words(state.config.reclaim_grace_s)} it would then have"
                         + unsaved_refusal_words(job, state.config))
            continue
        if 0 < window_s and needed_s <= window_s:
            share = state.config.loan_share_min
            notes.append(
                f"{refused}: they are needed again in {duration_words(window_s)}, before this job could finish, "
                f"and it would take {job.dp_min * job.tp * job.pp} of the pool's {pool.healthy_gpus} GPUs, "
                f"less than the {share * 100:g}% a loan stopped at the window's end must take"
            )
            continue
        notes.append(
            f"{refused}: they are needed again in {duration_words(max(window_s, 0.0))}, sooner than this job "
            f"could start, load, run {loan_steps_words(job, state.config)} and save ({duration_words(needed_s)})"
        )
    return notes

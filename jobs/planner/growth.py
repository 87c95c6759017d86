"""Rule 5, growth: an elastic job grows into GPUs no waiting job of its class or higher could start on.

Only after ``resize_hysteresis_s`` since its last resize or start, only when no job of equal
or higher class still waiting after the queue could start on the free GPUs it may use
(``PlanningPass.waiter_could_start``; one that could may still be kept from a pool's window that
ends in a reclaim, ``harvest.takes_window``, and the job may then grow into such windows, its
saving counted until the window ends), only to a batch-exact DP (the global batch
never changes: accumulation is recomputed, see ``layout``), within its team's borrowing limit
(rule 9), and only when the predicted saving
over the remaining run beats ``grow_gain_factor`` x (step + save + load). GPUs borrowed from a
pool make it a ``lend`` that ends when the pool needs them. Reasons carry the rule name
``resize``. A job in a periodic save is not resized; if it could grow, the pass asks to be woken
when the save is done. A signal-mode job never grows: it is not elastic.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from jobs.planner.admission import emit_start
from jobs.planner.decisions import Reason
from jobs.planner.layout import accum_steps, batch_divides
from jobs.planner.quota import size_cap
from jobs.planner.rhythm import RhythmPrediction, predict, reclaim_lead_time, step_time_at
from jobs.planner.snapshot import PRIORITY_RANK, Job
from jobs.planner.topology import choose_gpus, spread_of
from jobs.planner.wording import agree, gpus_are, plural

if TYPE_CHECKING:
    from jobs.planner.core import PlanningPass

INFINITY = math.inf
#: A running job may grow; one in a periodic save may once it is done.
GROWING_PHASES = frozenset({"running", "checkpointing"})


def grow_elastic_jobs(state: PlanningPass) -> None:
    """Grow running elastic jobs, higher class first, to the largest DP that pays for itself;
    first, start larger the jobs this pass starts below their ``dp_max`` (``start_larger``)."""
    start_larger(state)
    elastic = [j for j in state.jobs.values()
               if j.phase in GROWING_PHASES and j.name not in state.busy and j.name not in state.acted
               and j.holdings and j.current_dp < j.dp_max and not j.signal]
    growers = sorted((j for j in elastic if j.phase == "running"), key=lambda j: (PRIORITY_RANK[j.priority], j.name))
    for job in elastic:
        # In a periodic save a job cannot be resized; if free GPUs would let it grow, the pass
        # after its save looks again (nothing else might come to wake one before the next tick).
        since = job.last_resize_s if job.last_resize_s is not None else job.run_started_s
        if (job.phase == "checkpointing" and PRIORITY_RANK[job.priority] < state.capacity_blocked_rank
                and (since is None or state.now - since >= state.config.resize_hysteresis_s)
                and state._free_total(state._zones_for(job, job.dp_max)) >= job.tp * job.pp):
            state._wake_at(state.now + predict(job, state.config).save_s)
    for job in growers:
        blocked = PRIORITY_RANK[job.priority] >= state.capacity_blocked_rank
        since = job.last_resize_s if job.last_resize_s is not None else job.run_started_s
        if since is not None and state.now - since < state.config.resize_hysteresis_s:
            # No wake-up for this: growth is opportunistic and the next pass will do.
            continue
        d = job.current_dp
        zones = state._zones_for(job, job.dp_max)
        free = state._free_total(zones)
        if free < job.tp * job.pp:
            continue
        windows_only = blocked and state.waiter_could_start(PRIORITY_RANK[job.priority], free)
        if windows_only:
            # Others of its class wait and one could start on these GPUs. A window that ends in
            # a reclaim may be kept from them (``harvest.takes_window``): the job may grow into
            # such windows only.
            zones = window_zones(state, zones)
            free = state._free_total(zones)
            if free < job.tp * job.pp:
                continue
        cand = state.view.candidates(zones)
        anchor = sorted({g.node for g in job.gpus})
        p = predict(job, state.config)
        cap = size_cap(state, job)  # rule 9: its team's borrowing limit
        for target in range(job.dp_max, d, -1):
            if not batch_divides(job, target) or target * job.tp * job.pp > cap:
                continue
            if (target - d) * job.tp * job.pp > free:
                continue
            now_step = step_time_at(job, d, p.mean_step_s, d)
            new_step = step_time_at(job, target, p.mean_step_s, d)
            saved_s = job.remaining_steps * (now_step - new_step)
            cost_s = p.step_s + p.save_s + p.load_s
            if saved_s < state.config.grow_gain_factor * cost_s:
                continue
            new = choose_gpus(cand, state.nodes, job.tp, job.pp, target - d, anchor)
            if new is None:
                continue
            after = list(job.gpus) + list(new)
            lent = sorted({z for g in new if (z := state.view.zone(g)) is not None})
            loan_end = min((state.pools[z].next_need_s for z in lent), default=INFINITY)
            until = "over the remaining run"
            if blocked and loan_end < INFINITY:
                # Only until the window's end, when it shrinks back.
                window_s, before_s = saving_before_s(state, job, loan_end, p, new_step / now_step)
                saved_s = min(saved_s, before_s)
                until = f"until it gives them back, {window_s:.0f}s from now"
                if saved_s < state.config.grow_gain_factor * cost_s:
                    continue
            if windows_only:
                why = (f"{plural(len(new), 'GPU')} of a pool's window that ends in a reclaim {agree(len(new), 'is', 'are')} free, "
                       f"and the jobs of equal "
                       f"or higher priority that wait are kept off it (each would be stopped at its end)")
            elif blocked:
                why = f"{gpus_are(len(new))} and no job of equal or higher priority that waits could start on them"
            else:
                why = f"{gpus_are(len(new))} and nobody of equal or higher priority is waiting"
            state._emit("lend" if lent else "grow", job, after,
                        Reason("resize",
                               f"{why}: the job grows from dp {d} to {target}; accumulation goes "
                               f"{accum_steps(job, d)} -> {accum_steps(job, target)} so the global batch "
                               f"stays {job.global_batch}. Predicted saving {saved_s:.0f}s {until} "
                               f"against {cost_s:.0f}s to resize.",
                               {"dp_before": d, "dp_after": target, "saved_s": round(saved_s, 1),
                                "resize_cost_s": round(cost_s, 1), "free_gpus": free,
                                **spread_of(after, state.nodes).as_inputs()}),
                        deadline_s=loan_end if loan_end < INFINITY else None)
            break


def saving_before_s(state: PlanningPass, job: Job, need_s: float, p: RhythmPrediction,
                    step_ratio: float) -> tuple[float, float]:
    """(seconds until ``job`` must give back GPUs a pool needs at ``need_s``, a reclaim's lead time
    before it; the time its steps save until then at ``step_ratio`` x the step time it has now)."""
    window_s = need_s - state.now - reclaim_lead_time(job, state.config, p)
    return window_s, max(0.0, window_s) * (1.0 - step_ratio)


def window_zones(state: PlanningPass, zones: dict[str | None, int | None]) -> dict[str | None, int | None]:
    """The zones of ``zones`` that are pools lending a window that ends in a known reclaim."""
    return {z: n for z, n in zones.items()
            if n is not None and z in state.pools and state.pools[z].need_predictable
            and state.pools[z].next_need_s < INFINITY}


def start_larger(state: PlanningPass) -> None:
    """Jobs this pass starts below ``dp_max`` start larger when more GPUs are free and nobody of
    their class or higher waits: at a start the extra replicas cost nothing, where growing the
    job later costs it a restart (save, load). GPUs lent by a pool whose need is known count
    only if the time saved before that need pays ``grow_gain_factor`` x the restart the
    reclaim will then cost. Not with teams: a team's quota and borrowing limit decide its sizes.
    """
    if state.teams:
        return
    starts = [(i, a) for i, a in enumerate(state.actions)
              if a.kind in ("place", "lend") and not a.gpus_before and a.gpus_after]
    starts.sort(key=lambda ia: (PRIORITY_RANK[state.jobs[ia[1].job].priority], ia[1].job))
    replaced: set[int] = set()
    for i, action in starts:
        job = state.jobs[action.job]
        d = action.dp_after
        if job.signal or d >= job.dp_max or PRIORITY_RANK[job.priority] >= state.capacity_blocked_rank:
            continue
        rep = job.tp * job.pp
        zones = state._zones_for(job, job.dp_max)
        free = state._free_total(zones)
        anchor = sorted({g.node for g in action.gpus_after})
        p = predict(job, state.config)
        for target in range(job.dp_max, d, -1):
            if not batch_divides(job, target) or (target - d) * rep > free:
                continue
            new = state.view.place(zones, job.tp, job.pp, target - d, anchor)
            if new is None:
                continue
            lent = {z for g in new if (z := state.view.zone(g)) is not None}
            loan_end = min((state.pools[z].next_need_s for z in lent if z in state.pools), default=INFINITY)
            if loan_end < INFINITY:
                _, saved_s = saving_before_s(state, job, loan_end, p, step_time_at(job, target) / step_time_at(job, d))
                if saved_s < state.config.grow_gain_factor * (p.step_s + p.save_s + p.load_s):
                    continue
            replaced.add(i)
            # Undo the smaller start in the pass's view, then issue the larger one in its place.
            state.view.release(action.gpus_after)
            state.holders[job.priority] -= 1
            after = list(action.gpus_after) + list(new)
            emit_start(state, job, "place", after, target, action.reason.rule == "entitlement",
                       note=f" It starts at dp {target} rather than {d}: {len(new)} more {agree(len(new), 'GPU is', 'GPUs are')} free and nobody "
                            f"of equal or higher priority is waiting, so it need not restart to grow later.")
            break
    if replaced:
        state.actions[:] = [a for k, a in enumerate(state.actions) if k not in replaced]

"""The baseline policies the simulator compares the planner against.

``static``: whole-job allocation. Reserved GPUs are fenced off for their owner (held idle
when it does not use them); every other job runs first-come-first-served at its preferred
size with backfill on the rest; nothing is ever preempted or resized (a drained node is
still evacuated with a checkpoint, because an operator asked, and a job hit by a fault
continues on its survivors or waits for its full size).

``kill_preempt`` is not here: it is the production planner with
``PlannerConfig(reclaim_mode="kill")``: it lends reserved GPUs the same way but takes them
back at the moment of need by killing the borrower without a checkpoint.
"""

from __future__ import annotations

from jobs.planner.config import PlannerConfig
from jobs.planner.core import TIER_OTHER, PlanningPass
from jobs.planner.decisions import Plan
from jobs.planner.snapshot import Job, Snapshot


class StaticPass(PlanningPass):
    """A planning pass restricted to the ``static`` baseline's behaviour."""

    def _zones_for(self, job: Job, dp: int) -> dict[str | None, int | None]:
        zones: dict[str | None, int | None] = {None: None}
        for res in self.res_of_job.get(job.name, ()):
            if res.name in self.pools:
                zones[res.name] = None
        return zones

    def _tier(self, job: Job) -> int:
        tier = super()._tier(job)
        return min(tier, TIER_OTHER)

    def _admit(self, job: Job) -> None:
        # FCFS at the preferred size only; a job that does not fit waits and later jobs
        # that do fit go ahead of it (backfill). Faults may continue on survivors.
        rep = job.tp * job.pp
        if job.holdings:
            super()._admit(job)
            return
        entitled = job.priority == "critical" and self._entitled_now(job)
        kind = "recover" if job.phase == "recovering" else "place"
        anchor = sorted({g.node for g in job.gpus})
        if entitled and self._try_place(job, job.dp, 0, [], anchor, kind, entitled, own_pool_only=True):
            return
        if self._try_place(job, job.dp, 0, [], anchor, kind, entitled):
            return
        self._hold(job, "capacity", f"Static policy: waits for {job.dp * rep} GPUs at its preferred size; "
                   f"{self._free_total(self._zones_for(job, job.dp))} are free.", gpus_needed=job.dp * rep)

    def _try_victims(self, *args: object, **kwargs: object) -> bool:
        return False

    def _reservations(self) -> None:
        # Summarise pools (for zones) but never reclaim: nothing is ever lent.
        saved = list(self.actions)
        super()._reservations()
        self.actions = saved

    def _stragglers(self) -> None:
        return

    def _grow(self) -> None:
        return

    def run(self) -> Plan:
        """Static queue: sort by tier then submit order (no ageing)."""
        return super().run()


def plan_static(snapshot: Snapshot, now_s: float, config: PlannerConfig) -> Plan:
    """One pass of the ``static`` baseline."""
    return StaticPass(snapshot, now_s, config.with_overrides({"ageing_s": 0.0})).run()

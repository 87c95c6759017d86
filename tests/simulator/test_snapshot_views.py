"""The engine's snapshot keeps each waiting job's view between passes and looks again only at the
jobs that hold, lend or stop, and those touched since (``jobs.simulator.views``). Under
``full_check`` every pass compares what it kept with a fresh look at every active job."""

from __future__ import annotations

import pytest

from jobs.simulator import parse_scenario, simulate
from jobs.simulator.engine import Simulation
from tests.simulator.test_quiet_holds import queued_scenario


@pytest.mark.parametrize("policy", ["omni", "slurm", "elastic"])
def test_the_kept_views_are_those_a_fresh_look_at_every_job_gives(policy: str) -> None:
    result = simulate(parse_scenario(queued_scenario(3, jobs_n=120)), policy, full_check=True)
    assert result["planner_calls"] > 50
    assert result["invariant_violations"] == []


def test_a_change_the_snapshot_is_not_told_of_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # A touch that forgets to name the job leaves a waiting job's old view in the snapshot.
    def forgetful_touch(self: Simulation, job) -> None:
        job.version += 1
        self.state_version += 1

    monkeypatch.setattr(Simulation, "_touch", forgetful_touch)
    with pytest.raises(RuntimeError, match="kept views out of date"):
        simulate(parse_scenario(queued_scenario(3, jobs_n=120)), "omni", full_check=True)

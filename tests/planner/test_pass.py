"""The pass's seams: the planner imports no Django, and a policy replaces a rule by overriding it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from jobs.planner import PlannerConfig, plan
from jobs.planner.core import PlanningPass
from tests.planner.factory import cluster, gpus_on, job, snapshot

ROOT = Path(__file__).resolve().parents[2]
NODES = cluster(switches=1, per_switch=4)


def test_planner_package_imports_no_django() -> None:
    code = (
        "import sys, jobs.planner\n"
        "found = sorted(m for m in sys.modules if m.split('.')[0] in {'django', 'channels', 'celery'})\n"
        "print(found)\n"
        "sys.exit(1 if found else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_policy_that_overrides_a_rule_replaces_it_for_the_whole_pass() -> None:
    class NoVictims(PlanningPass):
        def _try_victims(self, *args: object, **kwargs: object) -> bool:
            return False

    snap = snapshot(NODES, [
        job("be", "best_effort", gpus=gpus_on(*[f"r0s0n{i}" for i in range(4)]), dp=4),
        job("crit", "critical", dp=2),
    ])
    assert [(a.job, a.kind) for a in plan(snap, 100.0).actions if a.job == "be"] == [("be", "preempt")]
    held = NoVictims(snap, 100.0, PlannerConfig()).run()
    assert [(a.job, a.kind) for a in held.actions] == [("crit", "hold")]

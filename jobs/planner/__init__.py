"""The elasticity planner: pure Python, no Django, deterministic.

``plan(snapshot, now_s, config) -> Plan`` decides placements, loans, reclaims, preemptions,
resizes, recoveries and migrations from a frozen ``Snapshot``. Production wraps it in a Celery
task; the simulator (``jobs.simulator``) calls the very same function. See docs/planner.md.
"""

from jobs.planner.config import PlannerConfig
from jobs.planner.core import plan
from jobs.planner.decisions import ACTION_KINDS, Action, Plan, Reason
from jobs.planner.snapshot import (
    CheckpointSpec,
    Command,
    Gpu,
    Holding,
    IdlePhase,
    Job,
    Node,
    Reservation,
    Rhythm,
    Snapshot,
    snapshot_from_dict,
    to_dict,
)

__all__ = [
    "ACTION_KINDS",
    "Action",
    "CheckpointSpec",
    "Command",
    "Gpu",
    "Holding",
    "IdlePhase",
    "Job",
    "Node",
    "Plan",
    "PlannerConfig",
    "Reason",
    "Reservation",
    "Rhythm",
    "Snapshot",
    "plan",
    "snapshot_from_dict",
    "to_dict",
]

"""The jobs app's models: the cluster, the work on it, and the audit log of what happened.

The kinds of commands and audit events are the vocabulary of ``jobs.vocab``, re-exported here.
"""

from jobs.models.audit import ElasticEvent
from jobs.models.cluster import Allocation, AllocationSpan, Node, NodeState
from jobs.models.commands import Command, CommandState
from jobs.models.jobs import Job, JobState, Priority
from jobs.models.planner import PlannerControl, PlannerRun
from jobs.models.reservations import Reservation
from jobs.models.states import BatchInvariantError, IllegalTransition
from jobs.vocab import CommandKind, EventKind

__all__ = [
    "Allocation",
    "AllocationSpan",
    "BatchInvariantError",
    "Command",
    "CommandKind",
    "CommandState",
    "ElasticEvent",
    "EventKind",
    "IllegalTransition",
    "Job",
    "JobState",
    "Node",
    "NodeState",
    "PlannerControl",
    "PlannerRun",
    "Priority",
    "Reservation",
]

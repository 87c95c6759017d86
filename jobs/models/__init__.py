"""The jobs app's models: the cluster, the work on it, and the audit log of what happened."""

from jobs.models.audit import ElasticEvent, EventKind
from jobs.models.cluster import Allocation, Node, NodeState
from jobs.models.commands import Command, CommandKind, CommandState
from jobs.models.jobs import Job, JobState, Priority
from jobs.models.planner import PlannerControl, PlannerRun
from jobs.models.reservations import Reservation
from jobs.models.states import BatchInvariantError, IllegalTransition

__all__ = [
    "Allocation",
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

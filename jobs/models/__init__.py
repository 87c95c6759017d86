"""The jobs app's models: the cluster, the work on it, and the audit log of what happened.

The kinds of commands and audit events are the vocabulary of ``jobs.vocab``, re-exported here.
"""

from jobs.models.audit import ElasticEvent
from jobs.models.cluster import Allocation, AllocationSpan, Node, NodeState
from jobs.models.commands import Command, CommandState
from jobs.models.jobs import REFERENCE_ENTRYPOINT, Integration, Job, JobState, Priority
from jobs.models.logs import JobLogLine, LogStream
from jobs.models.planner import PlannerControl, PlannerRun
from jobs.models.reservations import Reservation
from jobs.models.rhythm import JobRhythm
from jobs.models.states import BatchInvariantError, IllegalTransition
from jobs.models.teams import Team, TeamInUse, TeamMembership
from jobs.models.tokens import ApiToken, hash_api_token
from jobs.vocab import CommandKind, EventKind

__all__ = [
    "REFERENCE_ENTRYPOINT",
    "Allocation",
    "ApiToken",
    "AllocationSpan",
    "BatchInvariantError",
    "Command",
    "CommandKind",
    "CommandState",
    "ElasticEvent",
    "EventKind",
    "IllegalTransition",
    "Integration",
    "Job",
    "JobLogLine",
    "JobRhythm",
    "JobState",
    "LogStream",
    "Node",
    "NodeState",
    "PlannerControl",
    "PlannerRun",
    "Priority",
    "Reservation",
    "Team",
    "TeamInUse",
    "TeamMembership",
    "hash_api_token",
]

"""The control plane's vocabulary: planner action kinds, agent command kinds and audit event kinds.

Pure Python (no Django), so the planner may import it too. The stored values are the enum
values, exactly the strings the database has always held; the labels are what pages show
(``ElasticEvent.get_kind_display()``). How the kinds map onto each other lives here as well.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum


class ActionKind(StrEnum):
    """What the planner decides for one job (jobs/planner/decisions.py says what each means)."""

    PLACE = "place"
    LEND = "lend"
    PREEMPT = "preempt"
    SHRINK = "shrink"
    GROW = "grow"
    RECLAIM = "reclaim"
    RECOVER = "recover"
    MIGRATE = "migrate"
    HOLD = "hold"


class CommandKind(StrEnum):
    """What the control plane tells a node's agent to do (docs/control-loop.md)."""

    START = "start"
    PREEMPT = "preempt"
    RESIZE = "resize"
    RESUME = "resume"
    STOP = "stop"
    CLEAN = "clean"


class EventKind(StrEnum):
    """What one audit row records (docs/audit-log.md)."""

    SUBMIT = "submit"
    PLACE = "place"
    LEND = "lend"
    PREEMPT = "preempt"
    SHRINK = "shrink"
    GROW = "grow"
    RECLAIM = "reclaim"
    RECOVER = "recover"
    MIGRATE = "migrate"
    RECONFIGURE = "reconfigure"
    HOLD = "hold"
    CANCEL = "cancel"
    COMPLETE = "complete"
    FAIL = "fail"
    CHECKPOINT = "checkpoint"
    ACK = "ack"
    OUTCOME = "outcome"
    KILL = "kill"
    DRAIN = "drain"
    CORDON = "cordon"
    UNCORDON = "uncordon"
    NODE_SUSPECT = "node_suspect"
    NODE_FAILED = "node_failed"
    NODE_REPAIRED = "node_repaired"
    NODE_REGISTERED = "node_registered"
    NODE_EDITED = "node_edited"
    NODE_REMOVED = "node_removed"
    NODE_SPEED = "node_speed"
    HEALTH_CHECK = "health_check"
    JOB_EDITED = "job_edited"
    RESERVE = "reserve"
    RESERVATION_CHANGE = "reservation_change"
    RESERVATION_CANCEL = "reservation_cancel"
    OVERRIDE = "override"
    RESTART = "restart"
    RUN_DIR_REMOVED = "run_dir_removed"
    TOKEN_ISSUED = "token_issued"
    TOKEN_REVOKED = "token_revoked"
    USER_ADDED = "user_added"
    TEAM_CREATED = "team_created"
    TEAM_EDITED = "team_edited"
    TEAM_DELETED = "team_deleted"
    TEAM_MEMBER_ADDED = "team_member_added"
    TEAM_MEMBER_REMOVED = "team_member_removed"
    TEAM_DEFAULT_SET = "team_default_set"


# The audit row each applied planner action writes. (A preempt that is not graceful is recorded
# as a ``kill`` instead, whatever its action kind: the job lost its unsaved steps.)
DECISION_EVENTS: dict[ActionKind, EventKind] = {
    ActionKind.PLACE: EventKind.PLACE,
    ActionKind.LEND: EventKind.LEND,
    ActionKind.PREEMPT: EventKind.PREEMPT,
    ActionKind.SHRINK: EventKind.SHRINK,
    ActionKind.GROW: EventKind.GROW,
    ActionKind.RECLAIM: EventKind.RECLAIM,
    ActionKind.RECOVER: EventKind.RECOVER,
    ActionKind.MIGRATE: EventKind.MIGRATE,
    ActionKind.HOLD: EventKind.HOLD,
}

# Commands that launch workers: when one expires or fails, the job recovers elsewhere.
LAUNCH_COMMANDS = frozenset({CommandKind.START, CommandKind.RESUME, CommandKind.RESIZE})

COMMAND_KIND_LABELS: dict[CommandKind, str] = {
    CommandKind.START: "Start",
    CommandKind.PREEMPT: "Preempt (checkpoint, then release)",
    CommandKind.RESIZE: "Resize",
    CommandKind.RESUME: "Resume",
    CommandKind.STOP: "Stop",
    CommandKind.CLEAN: "Remove a run dir",
}

EVENT_KIND_LABELS: dict[EventKind, str] = {
    EventKind.SUBMIT: "Submitted",
    EventKind.PLACE: "Placed",
    EventKind.LEND: "Lent reserved GPUs",
    EventKind.PREEMPT: "Preempted",
    EventKind.SHRINK: "Shrunk",
    EventKind.GROW: "Grown",
    EventKind.RECLAIM: "Reclaimed a loan",
    EventKind.RECOVER: "Recovered",
    EventKind.MIGRATE: "Migrated",
    EventKind.RECONFIGURE: "Reconfigured",
    EventKind.HOLD: "Held pending",
    EventKind.CANCEL: "Cancelled",
    EventKind.COMPLETE: "Completed",
    EventKind.FAIL: "Failed",
    EventKind.CHECKPOINT: "Checkpoint saved",
    EventKind.ACK: "Command acknowledged",
    EventKind.OUTCOME: "Command outcome",
    EventKind.KILL: "Killed past deadline",
    EventKind.DRAIN: "Node drained",
    EventKind.CORDON: "Node cordoned",
    EventKind.UNCORDON: "Node uncordoned",
    EventKind.NODE_SUSPECT: "Node suspect",
    EventKind.NODE_FAILED: "Node failed",
    EventKind.NODE_REPAIRED: "Node repaired",
    EventKind.NODE_REGISTERED: "Node registered",
    EventKind.NODE_EDITED: "Node edited",
    EventKind.NODE_REMOVED: "Node removed",
    EventKind.JOB_EDITED: "Job edited",
    EventKind.RESERVE: "Reservation created",
    EventKind.RESERVATION_CHANGE: "Reservation changed",
    EventKind.RESERVATION_CANCEL: "Reservation cancelled",
    EventKind.OVERRIDE: "Planner override",
    EventKind.RESTART: "Restarted after a failure",
    EventKind.RUN_DIR_REMOVED: "Run dir removed",
    EventKind.TOKEN_ISSUED: "API token issued",
    EventKind.TOKEN_REVOKED: "API token revoked",
    EventKind.USER_ADDED: "User added",
    EventKind.TEAM_CREATED: "Team created",
    EventKind.TEAM_EDITED: "Team edited",
    EventKind.TEAM_DELETED: "Team deleted",
    EventKind.TEAM_MEMBER_ADDED: "Team member added",
    EventKind.TEAM_MEMBER_REMOVED: "Team member removed",
    EventKind.TEAM_DEFAULT_SET: "Default team set",
}


def choices(labels: Mapping[StrEnum, str]) -> list[tuple[str, str]]:
    """``(stored value, label)`` pairs in declaration order, for a model or form field."""
    return [(kind.value, label) for kind, label in labels.items()]

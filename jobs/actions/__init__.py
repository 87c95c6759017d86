"""Every write that touches more than one row: atomic, permission-checked, audited.

Views, the API, consumers, tasks and admin actions all call these functions, never the ORM
directly, so each change records its audit event in the same transaction (Zulip's
``zerver/actions``). Illegal state changes raise ``IllegalTransition`` (the API answers 409),
bad input raises ``ValidationError`` (400), the wrong role ``PermissionDenied`` (403).

One module per domain; callers use this package's names (``actions.submit_job``):

- ``jobs``: submit, cancel, edit (an operator's) and place jobs;
- ``accounts``: add a user with a role, issue an API token (the operators' commands);
- ``reservations``: create, edit and cancel reservations;
- ``nodes``: register, edit, remove; cordon, uncordon, drain, repair; heartbeat verdicts (suspect,
  failed);
- ``planner_pass``: the planner pass that applies a plan, and the planner's controls;
- ``commands``: the command outbox: write, claim, send, acknowledge, outcome, expire;
- ``agents``: what agents report: hello, heartbeats, step records, worker exits; fencing;
- ``edits``: what an operator's edit of a node or a job shares (the checked copy, before/after);
- ``logs``: the ranks' log lines agents ship (stored once, sent live) and their pruning;
- ``teams``: create, edit and delete teams; add and remove members, set a member's default team
  (docs/teams.md);
- ``housekeeping``: checkpoint storage hygiene: the run dirs of cancelled and failed jobs
  removed after retention, audited (docs/storage.md).

Actions never import ``jobs.tasks``: a pass they need after commit is triggered by task name.
"""

from jobs.actions._common import describe_changes
from jobs.actions.accounts import add_user, issue_api_token, revoke_api_token
from jobs.actions.agents import (
    fence_stray_workers,
    record_agent_hello,
    record_heartbeat,
    record_step_records,
    record_worker_exit,
)
from jobs.actions.commands import (
    OPEN_COMMAND_STATES,
    UnknownCommand,
    agent_group,
    claim_commands_for_dispatch,
    command_frame,
    expire_overdue_commands,
    record_command_ack,
    record_command_outcome,
    resend_pending_commands,
    send_node_commands,
)
from jobs.actions.housekeeping import record_run_dir_removed, sweep_run_dirs
from jobs.actions.jobs import (
    JOB_EDITABLE_UNTIL_DONE,
    JOB_EDITABLE_WHILE_PENDING,
    cancel_job,
    edit_job,
    job_editable_fields,
    job_with_changes,
    place_job,
    submit_job,
)
from jobs.actions.logs import LogsRefused, prune_logs, record_log_lines
from jobs.actions.nodes import (
    NODE_EDITABLE,
    cordon_node,
    drain_node,
    edit_node,
    heartbeat_verdicts,
    mark_node_failed,
    mark_node_repaired,
    mark_node_suspect,
    monitor_watching_since,
    node_history,
    node_removal_refusal,
    node_with_changes,
    register_node,
    remove_node,
    uncordon_node,
)
from jobs.actions.planner_pass import (
    PLANNER_LOCK_KEY,
    PassResult,
    run_planner_pass,
    set_planner_control,
)
from jobs.actions.reservations import (
    RESERVATION_EDITABLE,
    cancel_reservation,
    create_reservation,
    update_reservation,
)
from jobs.actions.rhythm import observe_step_records
from jobs.actions.teams import (
    TEAM_EDITABLE,
    add_team_member,
    create_team,
    delete_team,
    edit_team,
    remove_team_member,
    set_default_team,
)
from jobs.models.commands import CommandState
from jobs.models.states import IllegalTransition

__all__ = [
    "add_user",
    "issue_api_token",
    "revoke_api_token",
    "JOB_EDITABLE_UNTIL_DONE",
    "JOB_EDITABLE_WHILE_PENDING",
    "NODE_EDITABLE",
    "OPEN_COMMAND_STATES",
    "PLANNER_LOCK_KEY",
    "RESERVATION_EDITABLE",
    "TEAM_EDITABLE",
    "add_team_member",
    "create_team",
    "delete_team",
    "edit_team",
    "remove_team_member",
    "set_default_team",
    "CommandState",
    "IllegalTransition",
    "LogsRefused",
    "PassResult",
    "UnknownCommand",
    "agent_group",
    "cancel_job",
    "cancel_reservation",
    "claim_commands_for_dispatch",
    "command_frame",
    "cordon_node",
    "describe_changes",
    "create_reservation",
    "drain_node",
    "edit_job",
    "edit_node",
    "expire_overdue_commands",
    "fence_stray_workers",
    "heartbeat_verdicts",
    "job_editable_fields",
    "job_with_changes",
    "mark_node_failed",
    "mark_node_repaired",
    "mark_node_suspect",
    "monitor_watching_since",
    "node_history",
    "node_removal_refusal",
    "node_with_changes",
    "place_job",
    "prune_logs",
    "record_agent_hello",
    "record_command_ack",
    "record_command_outcome",
    "record_heartbeat",
    "record_log_lines",
    "record_run_dir_removed",
    "record_step_records",
    "observe_step_records",
    "record_worker_exit",
    "register_node",
    "remove_node",
    "resend_pending_commands",
    "run_planner_pass",
    "send_node_commands",
    "set_planner_control",
    "submit_job",
    "sweep_run_dirs",
    "uncordon_node",
    "update_reservation",
]

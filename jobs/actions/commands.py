"""The command outbox (docs/control-loop.md): writing commands, sending them, and what their
acknowledgement, outcome or expiry does to the job.

A ``Command`` row is written in the transaction of the decision that caused it and handed to
the channel-layer group of its node's agent only after that transaction commits, at least once:
a send lost on the way is retried by ``expire_overdue_commands`` and replayed when the agent
reconnects. ``send_node_commands`` and ``resend_pending_commands`` are the only functions here
that run outside a transaction: the claim commits first, then the frames go out.

``write_commands``, ``write_stop_commands``, ``dispatch_on_commit`` and ``record_job_fault`` are
the building blocks the other action modules use inside their own transaction.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from jobs import live
from jobs.actions._common import (
    agent_actor,
    control_logger,
    job_nodes,
    kill_and_release,
    lose_unsaved_steps,
    lost_facts,
    note_checkpoint,
    release_allocations,
    stopped_layout,
    trigger_plan,
)
from jobs.actions.housekeeping import run_dir_clean_done
from jobs.audit import record_event
from jobs.models import Allocation, Command, ElasticEvent, Job, JobState, Node, NodeState
from jobs.models.commands import CommandState
from jobs.models.jobs import ACTIVE_JOB_STATES, Integration
from jobs.vocab import LAUNCH_COMMANDS, CommandKind, EventKind
from trainer_agent.protocol import ProtocolError

OPEN_COMMAND_STATES = (CommandState.PENDING, CommandState.SENT, CommandState.ACKED)


class UnknownCommand(Exception):
    """An agent named a command id that does not exist or belongs to another node."""


def agent_group(node_id: int) -> str:
    """The channel-layer group an agent's socket joins: ``agent-{node id}``."""
    return f"agent-{node_id}"


# The jobs.live event that carries one command frame to an agent's group (jobs.consumers).
COMMAND_EVENT = "command"


# -- writing commands ------------------------------------------------------------------------


def job_payload(job: Job, gpus: list[tuple[str, int]], node_name: str, leader: str,
                nodes: dict[str, Node] | None = None) -> dict[str, Any]:
    """What an agent needs to run (its share of) a job: the whole placement (every node, its GPU
    indices and address, leader first), batch, steps, the workload, and the GPUs on this node.
    The workload's env values are not stored here: ``command_frame`` adds them when it sends."""
    dp = max(1, len(gpus) // job.replica_gpus)
    order = [leader, *[n for n in nodes_in_order(gpus) if n != leader]]
    placement = [
        {"node": n, "gpus": [i for m, i in gpus if m == n],
         "address": (nodes[n].address if nodes and n in nodes else "") or "127.0.0.1"}
        for n in order
    ]
    # ``nodes`` and ``gpus`` restate the placement for the agent (docs/control-loop.md): the nodes
    # that hold GPUs (a resize's old leader may hold none) and this node's GPUs.
    held = {entry["node"]: entry["gpus"] for entry in placement if entry["gpus"]}
    return {
        "job": job.name,
        "leader": node_name == leader,
        "leader_node": leader,
        "nodes": sorted(held),
        "gpus": list(held.get(node_name, [])),
        "placement": placement,
        "dp": dp,
        "tp": job.tp,
        "pp": job.pp,
        "accum": job.global_batch // (job.micro_batch * dp),
        "global_batch": job.global_batch,
        "micro_batch": job.micro_batch,
        "total_steps": job.total_steps,
        "checkpoint_every": job.checkpoint_every_steps,
        "step_s": job.step_s,
        "resume_step": job.last_checkpoint_step,
        "workload": {
            "entrypoint": list(job.entrypoint), "workdir": job.workdir, "integration": job.integration,
            "grace_s": job.grace_s, "keep_checkpoints": job.keep_checkpoints, "env_names": sorted(job.env),
        },
    }


def rdzv_ports() -> range:
    """The ports the control plane gives jobs' rendezvous (``OMNI_RDZV_PORTS``, "29400-29999")."""
    low, _, high = settings.OMNI_RDZV_PORTS.partition("-")
    return range(int(low), int(high or low) + 1)


def start_run(job: Job) -> list[str]:
    """A new run of the job (every start, resume and relaunch): a fresh rendezvous id, so a
    relaunch never joins an old rendezvous, and a port no other live job holds (chosen at random
    among the free ones, so a port taken outside Omni is not picked again on the retry)."""
    taken = set(
        Job.objects.filter(state__in=ACTIVE_JOB_STATES, rdzv_port__isnull=False).exclude(pk=job.pk)
        .values_list("rdzv_port", flat=True)
    )
    free = [p for p in rdzv_ports() if p not in taken]
    if not free:
        raise RuntimeError(f"no free rendezvous port in OMNI_RDZV_PORTS={settings.OMNI_RDZV_PORTS}")
    job.run_id = f"{job.name}-{uuid.uuid4().hex[:8]}"
    job.rdzv_port = random.choice(free)
    return ["run_id", "rdzv_port"]


def nodes_in_order(gpus: list[tuple[str, int]]) -> list[str]:
    """The nodes of a layout, each once, in layout order (the first is the leader)."""
    seen: list[str] = []
    for name, _ in gpus:
        if name not in seen:
            seen.append(name)
    return seen


def write_commands(
    job: Job,
    kind: CommandKind,
    gpus: list[tuple[str, int]],
    nodes: dict[str, Node],
    *,
    leader: str,
    targets: list[str] | None = None,
    deadline_at: datetime | None = None,
    extra: dict[str, Any] | None = None,
) -> Command:
    """One command per target node (leader first); returns the leader's, which the audit names."""
    targets = targets or nodes_in_order(gpus)
    targets = [leader, *[t for t in targets if t != leader]]
    run: dict[str, Any] = {}
    if kind in (CommandKind.START, CommandKind.RESUME):
        job.save(update_fields=start_run(job))
        address = nodes[leader].address or "127.0.0.1"
        run = {"run_id": job.run_id, "rdzv": {"host": address, "port": job.rdzv_port}}
    elif job.run_id:
        run = {"run_id": job.run_id}
    leader_command: Command | None = None
    for name in targets:
        payload = job_payload(job, gpus, name, leader, nodes)
        payload.update(run)
        payload.update(extra or {})
        command = Command.objects.create(
            node=nodes[name], job=job, kind=kind, payload=payload, deadline_at=deadline_at
        )
        if name == leader:
            leader_command = command
    assert leader_command is not None
    return leader_command


def write_stop_commands(job: Job, nodes: Iterable[Node], *, kill: bool = True) -> list[Command]:
    """A ``stop`` for the job's workers on each node. ``kill`` fences them (they must stop before
    anyone resumes the run, and their outcome changes nothing); without it, a cancel's stop."""
    payload = {"job": job.name, "leader": False, "kill": True} if kill else {"job": job.name}
    return [
        Command.objects.create(node=node, job=job, kind=CommandKind.STOP, payload=dict(payload)) for node in nodes
    ]


def dispatch_on_commit(node_ids: set[int]) -> None:
    """Send the nodes' new commands once the transaction commits.

    The send runs right in the committing process, not through a Celery hop: the outbox rows
    are already durable, so a send lost here is re-sent by ``sweep_commands`` after the ack
    timeout (and replayed on reconnect), while the common case saves a broker round trip.
    """

    def send(node_id: int) -> None:
        try:
            send_node_commands(node_id)
        except Exception:
            control_logger.warning("dispatch to node %s failed; the sweep will resend", node_id, exc_info=True)

    for node_id in sorted(node_ids):
        transaction.on_commit(lambda node_id=node_id: send(node_id))


# -- sending ---------------------------------------------------------------------------------


@transaction.atomic
def claim_commands_for_dispatch(node_id: int, *, include_sent: bool = False,
                                applied: Iterable[str] = ()) -> list[Command]:
    """Move a node's pending commands to ``sent`` (one attempt each) and return what to send.

    ``include_sent`` also returns commands already sent but not acknowledged: a (re)connecting
    agent gets every unacknowledged command again (at-least-once; the agent dedups by id).
    ``applied`` (a hello's: the ids this agent process applied) also returns the node's
    acknowledged commands among them: the agent re-acks a repeated id and sends its ``done``
    again, so an outcome that never arrived (a frame the socket took, dropped with a consumer
    that died on the frame before it) is not left to the done timeout.
    """
    ids = set()
    for value in applied:
        try:
            ids.add(uuid.UUID(str(value)))
        except ValueError:
            continue
    states = [CommandState.PENDING, CommandState.SENT] if include_sent else [CommandState.PENDING]
    wanted = Q(state__in=states) | Q(state=CommandState.ACKED, pk__in=ids) if ids else Q(state__in=states)
    out: list[Command] = []
    for command in (
        Command.objects.select_for_update(of=("self",), no_key=True).filter(wanted, node_id=node_id)
        .select_related("job").order_by("created_at")
    ):
        if command.state == CommandState.PENDING:
            command.save(update_fields=command.transition_to(CommandState.SENT))
        out.append(command)
    return out


def command_frame(command: Command) -> dict[str, Any]:
    """The ``command`` frame for an agent (docs/control-loop.md)."""
    payload = command.payload
    if "workload" in payload and command.job_id:
        # Env values live only on the job row; they travel to the agent, never into the outbox.
        payload = {**payload, "workload": {**payload["workload"], "env": dict(command.job.env)}}
    return {
        "type": "command",
        "id": str(command.id),
        "kind": command.kind,
        "job": command.job.name if command.job_id else None,
        "payload": payload,
        "deadline": command.deadline_at.timestamp() if command.deadline_at else None,
        "attempt": command.attempts,
    }


def send_node_commands(node_id: int) -> None:
    """Send a node's pending commands to its agent's socket (if connected) and mark them sent.

    The row is marked first and the frame sent after that commits: a frame lost on the way is
    retried by ``expire_overdue_commands`` after the ack timeout, and the agent drops duplicates.
    """
    commands = claim_commands_for_dispatch(node_id)
    # jobs.live hands them to the agent's group without waiting; one lost on the way stays in
    # the outbox, and the sweep resends it after the ack timeout.
    live.send_messages(live.message(agent_group(node_id), COMMAND_EVENT, command_frame(c)) for c in commands)


def resend_pending_commands() -> None:
    """Send every command still pending: a dispatch lost with a broker or channel-layer outage
    goes out again from the outbox."""
    pending = Node.objects.filter(commands__state=CommandState.PENDING).values_list("id", flat=True).distinct()
    for node_id in pending:
        send_node_commands(node_id)


# -- acknowledgements and outcomes -----------------------------------------------------------


def decision_of(command: Command) -> ElasticEvent | None:
    """The audit row of the decision that wrote the command (outcomes refer to it)."""
    return ElasticEvent.objects.filter(command=command.id).order_by("id").first()


def _own_command(node: Node, command_id: str) -> Command:
    try:
        key = uuid.UUID(str(command_id))
    except ValueError:
        raise UnknownCommand(f"{command_id!r} is not a command id") from None
    try:
        return Command.objects.select_for_update(of=("self",), no_key=True).select_related("job").get(pk=key, node=node)
    except Command.DoesNotExist:
        raise UnknownCommand(f"no command {command_id} for node {node.name}") from None


def _to_acked(command: Command) -> list[str]:
    """Pending or sent -> acked (an ack or outcome may overtake the dispatch); the fields changed."""
    fields: list[str] = []
    if command.state == CommandState.PENDING:
        fields += command.transition_to(CommandState.SENT)
    if command.state == CommandState.SENT:
        fields += command.transition_to(CommandState.ACKED)
    return fields


@transaction.atomic
def record_command_ack(node: Node, command_id: str) -> Command:
    """The agent received the command. Idempotent: a repeated or late ack changes nothing."""
    command = _own_command(node, command_id)
    if command.state not in (CommandState.PENDING, CommandState.SENT):
        return command
    command.save(update_fields=_to_acked(command))
    decision = decision_of(command)
    if decision is not None and command.payload.get("leader", True):
        record_event(
            EventKind.ACK, job=command.job, actor=agent_actor(node), command=command.id, refers_to=decision,
            outcome={"kind": command.kind, "attempts": command.attempts,
                     "ack_ms": round((command.acked_at - command.created_at).total_seconds() * 1000.0, 1)},
            reason={"rule": "ack", "text": f"{node.name} acknowledged {command.kind} of "
                    f"{command.job.name if command.job_id else '-'}.", "inputs": {}},
        )
    return command


# The fields of a ``done`` outcome that are kept (in the command and its audit row), each with
# what it may hold: (types, lowest, highest) for numbers, (str, -, most characters) for text.
# Anything else is dropped; a kept field outside its bounds refuses the whole outcome, so no
# number a job page, the planner or the audit hash cannot represent is ever stored.
ERROR_TAIL_CHARS = 4000
_SECONDS = ((int, float), 0, 10_000_000)  # about 115 days
_STEP = ((int,), 0, 2**53)
OUTCOME_FIELDS: dict[str, tuple[tuple[type, ...], int, int]] = {
    "checkpoint_step": _STEP,
    "step": _STEP,
    "save_s": _SECONDS,
    "load_s": _SECONDS,
    "exit_s": _SECONDS,
    "grace_s": _SECONDS,
    "pid": ((int,), 0, 2**31 - 1),
    "code": ((int,), -(2**31), 2**31 - 1),
    "bytes_freed": ((int,), 0, 2**63 - 1),
    "killed": ((bool,), 0, 1),
    "removed": ((bool,), 0, 1),
    "error": ((str,), 0, 1 << 20),  # kept to its last ERROR_TAIL_CHARS, where a traceback ends
    "outcome": ((str,), 0, 64),
    "teardown": ((str,), 0, 400),  # a rank that failed after the run ended well (workers.failed_after_finish)
    "run_id": ((str,), 0, 64),
}


def checked_outcome(outcome: dict[str, Any]) -> dict[str, Any]:
    """The kept fields of an agent's outcome; raises ProtocolError (``bad_outcome``) naming the
    first field of the wrong type or out of bounds. ``null`` is allowed for every field."""
    clean: dict[str, Any] = {}
    for key, (kinds, low, high) in OUTCOME_FIELDS.items():
        if key not in outcome:
            continue
        value = outcome[key]
        if value is not None:
            if isinstance(value, bool) != (kinds == (bool,)) or not isinstance(value, kinds):
                raise ProtocolError("bad_outcome", f"outcome field {key!r} must be {kinds[0].__name__}")
            size = len(value) if isinstance(value, str) else value
            if not (isinstance(value, bool) or low <= size <= high):
                what = "characters" if isinstance(value, str) else "a value"
                raise ProtocolError("bad_outcome", f"outcome field {key!r} needs {what} within {low}-{high}")
        clean[key] = value[-ERROR_TAIL_CHARS:] if key == "error" and value else value
    return clean


@transaction.atomic
def record_command_outcome(node: Node, command_id: str, *, ok: bool, outcome: dict[str, Any]) -> Command:
    """The agent finished a command. Applies its effect once; a duplicate ``done`` is ignored.
    An outcome with a field out of bounds (``checked_outcome``) is refused before anything is written."""
    clean = checked_outcome(outcome)
    command = _own_command(node, command_id)
    if command.is_terminal:
        return command
    fields = _to_acked(command)
    command.outcome = clean
    command.error = str(outcome.get("error") or "")[:2000]
    fields += command.transition_to(CommandState.DONE if ok else CommandState.FAILED)
    command.save(update_fields=[*fields, "outcome", "error"])
    if command.job_id is None or not command.payload.get("leader", True):
        return command
    job = Job.objects.select_for_update(no_key=True).get(pk=command.job_id)
    effect = _OUTCOME_EFFECTS.get(command.kind)
    if effect is not None:
        text = f"{command.kind} of {job.name} on {node.name}: " + ("done" if ok else f"failed ({command.error})")
        effect(_Outcome(node=node, command=command, job=job, ok=ok, reported=clean, decision=decision_of(command),
                        text=text, gpus_before=job.allocations.count()))
    trigger_plan("command_done")
    return command


@dataclass
class _Outcome:
    """A leader's ``done`` for one command, being applied to its job."""

    node: Node
    command: Command
    job: Job
    ok: bool
    reported: dict[str, Any]  # the outcome fields the agent sent that we keep
    decision: ElasticEvent | None
    text: str
    gpus_before: int

    @property
    def actor(self) -> str:
        return agent_actor(self.node)

    def audit(self, kind: EventKind = EventKind.OUTCOME, *, rule: str = "outcome", text: str | None = None,
              extra: dict[str, Any] | None = None, **facts: Any) -> None:
        """The audit row of this outcome, referring to the decision; ``facts`` are its columns."""
        outcome = {"kind": self.command.kind, "ok": self.ok, **self.reported, **(extra or {})}
        record_event(kind, job=self.job, actor=self.actor, command=self.command.id, refers_to=self.decision,
                     outcome=outcome, reason={"rule": rule, "text": text or self.text, "inputs": {}}, **facts)


def _preempt_done(o: _Outcome) -> None:
    """A checkpoint before release: saved (GPUs freed, nothing lost) or not (killed). A
    ``signal`` job's ranks either exited within its grace (GPUs freed) or were SIGKILLed, which
    loses, as far as Omni can tell, all the work since the run began."""
    job = o.job
    if job.state != JobState.CHECKPOINTING:
        return
    signal_mode = job.integration == Integration.SIGNAL
    if o.ok:
        fields = note_checkpoint(job, o.reported)
        fields += job.transition_to(JobState.PREEMPTED)
        job.preemptions += 1
        job.save(update_fields=[*fields, "preemptions"])
        nodes = release_allocations(job)
        if signal_mode:
            took, code = o.reported.get("exit_s"), o.reported.get("code")
            how = f" with code {code}" if isinstance(code, int) and code else ""
            text = (o.text + f"; the ranks exited{how} {_seconds(took)} after SIGTERM (grace {job.grace_s:g} s), "
                    "GPUs released")
        else:
            text = o.text + f"; checkpoint at step {job.last_checkpoint_step} saved, GPUs released"
            if o.reported.get("teardown"):
                text += f" ({o.reported['teardown']}: nothing lost)"
        o.audit(text=text, extra={"steps_lost": 0, **_score_stop(o)}, nodes_before=nodes, gpus_before=o.gpus_before,
                gpus_after=0)
        return
    nodes = job_nodes(job)
    lost = kill_and_release(job)
    if signal_mode:
        facts, _ = lost_facts(job, lost)
        text = (f"{job.name}: the ranks did not exit within grace_s {job.grace_s:g} s of SIGTERM; SIGKILL. "
                f"Omni cannot see this job's checkpoints, so all {facts['time_lost_s']:.0f} s of work since its "
                "last start may be lost; GPUs released.")
        o.audit(EventKind.KILL, rule="grace_expired", text=text, extra=facts, nodes_before=nodes,
                gpus_before=o.gpus_before, gpus_after=0)
        return
    o.audit(EventKind.KILL, rule="checkpoint_failed", text=o.text + f"; {lost} steps lost",
            extra={"steps_lost": lost}, nodes_before=nodes, gpus_before=o.gpus_before, gpus_after=0)


def _score_stop(o: _Outcome) -> dict[str, Any]:
    """A stop the planner timed (a reclaim: ``predicted_stop_s`` in its decision) against what it
    took, from the command to the agent's ``done``: into the job's rhythm, and for its audit row."""
    inputs = (o.decision.reason or {}).get("inputs", {}) if o.decision is not None else {}
    predicted, lead = inputs.get("predicted_stop_s"), inputs.get("lead_time_s")
    if not isinstance(predicted, (int, float)) or o.command.finished_at is None:
        return {}
    took = max(0.0, (o.command.finished_at - o.command.created_at).total_seconds())
    lead = float(lead) if isinstance(lead, (int, float)) else float(predicted)
    from jobs.actions.rhythm import observe_reclaim

    observe_reclaim(o.job, predicted_s=float(predicted), lead_s=lead, took_s=took)
    return {"stop_took_s": round(took, 2), "stop_predicted_s": predicted, "lead_time_s": lead,
            "within_lead": took <= lead}


def _seconds(value: Any) -> str:
    return f"{value:.1f} s" if isinstance(value, (int, float)) else "some time"


def _resize_done(o: _Outcome) -> None:
    """Saved for a new layout: the released GPUs go, and the job continues at the new DP (the
    leader relaunches itself, or a ``resume`` goes to the new layout)."""
    job, command = o.job, o.command
    if job.state != JobState.RESIZING:
        return
    if not o.ok:
        record_job_fault(job, o.actor, o.text, command=command, refers_to=o.decision)
        return
    fields = note_checkpoint(job, o.reported)
    release = {(n, i) for n, i in command.payload.get("release", [])}
    Allocation.objects.filter(pk__in=[
        alloc.pk for alloc in job.allocations.select_related("node") if (alloc.node.name, alloc.gpu_index) in release
    ]).release()
    job.set_dp(int(command.payload["dp_after"]))
    fields += ["dp", "accum_steps"]
    if command.payload.get("relaunch"):
        fields += job.transition_to(JobState.RUNNING)
    job.save(update_fields=fields)
    extra: dict[str, Any] = {}
    if not command.payload.get("relaunch"):
        layout = [(n, i) for n, i in command.payload.get("layout", [])]
        nodes = {n.name: n for n in Node.objects.filter(name__in={n for n, _ in layout})}
        resume = write_commands(job, CommandKind.RESUME, layout, nodes, leader=layout[0][0])
        dispatch_on_commit({n.id for n in nodes.values()})
        extra["resume_command"] = str(resume.id)
    extra.update(_score_stop(o))
    o.audit(extra=extra, gpus_before=o.gpus_before, gpus_after=job.allocations.count(), dp_after=job.dp,
            accum_after=job.accum_steps, global_batch=job.global_batch)


def _launch_done(o: _Outcome) -> None:
    """Workers started (or resumed): note the load time and the checkpoint they resumed from; a
    launch that failed sends the job to recovery."""
    job = o.job
    if not o.ok and job.state in (JobState.RUNNING, JobState.RESIZING):
        record_job_fault(job, o.actor, o.text, command=o.command, refers_to=o.decision)
        return
    if o.ok:
        fields = []
        load_s = o.reported.get("load_s")
        if isinstance(load_s, (int, float)) and load_s >= 0:
            job.measured_load_s = float(load_s)
            fields.append("measured_load_s")
            from jobs.actions.rhythm import observe_checkpoint

            observe_checkpoint(job, load_s=job.measured_load_s)
        resumed = o.reported.get("checkpoint_step")
        if isinstance(resumed, int) and job.last_checkpoint_step < resumed <= job.total_steps:
            # A checkpoint newer than the last one a heartbeat reported (saved just before a
            # fault): the run continues from there, so progress does too.
            job.last_checkpoint_step = resumed
            job.committed_steps = max(job.committed_steps, resumed)
            fields += ["last_checkpoint_step", "committed_steps"]
        if job.state == JobState.RESIZING:
            fields += job.transition_to(JobState.RUNNING)
        if fields:
            job.save(update_fields=fields)
    o.audit()


# What a leader's ``done`` does to the job, by command kind (a ``stop``'s changes nothing).
_OUTCOME_EFFECTS: dict[CommandKind, Callable[[_Outcome], None]] = {
    CommandKind.PREEMPT: _preempt_done,
    CommandKind.RESIZE: _resize_done,
    CommandKind.START: _launch_done,
    CommandKind.RESUME: _launch_done,
    CommandKind.CLEAN: run_dir_clean_done,  # a finished job's run dir removed (jobs.actions.housekeeping)
}


@transaction.atomic
def record_job_fault(job: Job, actor: str, text: str, *, command: Command | None = None,
                     refers_to: ElasticEvent | None = None, kind: EventKind = EventKind.FAIL,
                     extra: dict[str, Any] | None = None) -> int:
    """A fault hit the job: back to its last checkpoint, GPUs released, surviving workers fenced;
    the planner recovers it. Returns the steps lost."""
    gpus_before = job.allocations.count()
    lost = lose_unsaved_steps(job)
    facts, clause = lost_facts(job, lost)
    job.save(update_fields=[*job.transition_to(JobState.RECOVERING), "committed_steps"])
    nodes = job_nodes(job)
    survivors = list(Node.objects.filter(name__in=nodes).exclude(state=NodeState.FAILED))
    Allocation.objects.filter(job=job).release()
    write_stop_commands(job, survivors)
    dispatch_on_commit({n.id for n in survivors})
    record_event(kind, job=job, actor=actor, command=command.id if command else None, refers_to=refers_to,
                 nodes_before=nodes, gpus_before=gpus_before, gpus_after=0, **stopped_layout(job),
                 global_batch=job.global_batch,
                 outcome={**facts, **(extra or {})},
                 reason={"rule": "fault", "text": f"{text}; {_recovers(job, lost, clause)}.", "inputs": {}})
    return lost


def _recovers(job: Job, lost: int, clause: str) -> str:
    """How a faulted job goes on, for the fault's sentence (``clause``: ``lost_facts``)."""
    if job.integration == Integration.SIGNAL:
        return f"{job.name} starts again: {clause}"
    return f"{job.name} recovers from step {job.last_checkpoint_step} ({lost} steps lost)"


# -- expiry and retry ------------------------------------------------------------------------


@transaction.atomic
def expire_overdue_commands(now: datetime | None = None) -> dict[str, int]:
    """Retry sent commands not acknowledged in time; expire them after the last attempt; treat a
    preempt past its deadline as a kill; expire a ``start``, ``resume`` or ``resize`` that stays
    acknowledged without a ``done`` for ``OMNI_COMMAND_DONE_TIMEOUT_S`` (and past its deadline,
    if it has one): its job recovers. The planner is told about every expiry."""
    now = now or timezone.now()
    counts = {"retried": 0, "expired": 0, "killed": 0, "stalled": 0}
    timeout = timedelta(seconds=settings.OMNI_COMMAND_ACK_TIMEOUT_S)
    retry_nodes: set[int] = set()
    overdue = Command.objects.select_for_update(of=("self",), no_key=True).filter(state=CommandState.SENT, sent_at__lt=now - timeout)
    for command in overdue.select_related("node", "job"):
        if command.attempts < settings.OMNI_COMMAND_MAX_ATTEMPTS:
            command.save(update_fields=command.transition_to(CommandState.PENDING))
            retry_nodes.add(command.node_id)
            counts["retried"] += 1
        else:
            _expire(command, f"not acknowledged after {command.attempts} attempts")
            counts["expired"] += 1
    late = Command.objects.select_for_update(of=("self",), no_key=True).filter(
        kind=CommandKind.PREEMPT, state__in=OPEN_COMMAND_STATES, deadline_at__lt=now
    )
    for command in late.select_related("node", "job"):
        _expire(command, "checkpoint not confirmed by the deadline")
        counts["killed"] += 1
    # Acknowledged is not done: an agent that acked a command and then died, or lost it (or its
    # `done`), never answers it, and nothing else would ever move the job (docs/control-loop.md).
    # Every kind expires with its reason; a launch's expiry is also its job's fault.
    done_timeout_s = settings.OMNI_COMMAND_DONE_TIMEOUT_S
    stalled = Command.objects.select_for_update(of=("self",), no_key=True).filter(
        Q(deadline_at__isnull=True) | Q(deadline_at__lt=now),
        state=CommandState.ACKED, acked_at__lt=now - timedelta(seconds=done_timeout_s),
    )
    for command in stalled.select_related("node", "job"):
        waited_s = (now - command.acked_at).total_seconds() if command.acked_at else done_timeout_s
        _expire(command, f"acknowledged {waited_s:.0f} s ago but never reported done "
                f"(OMNI_COMMAND_DONE_TIMEOUT_S is {done_timeout_s:g} s)", any_node=True)
        counts["stalled"] += 1
    dispatch_on_commit(retry_nodes)
    if counts["expired"] or counts["killed"] or counts["stalled"]:
        trigger_plan("command_expired")
    return counts


def expire_commands(commands: Iterable[Command], why: str) -> list[Command]:
    """Expire open commands that will never be answered, saying why; what that means for their
    jobs is the caller's to record (inside the caller's transaction)."""
    expired = []
    for command in commands:
        command.error = why
        command.save(update_fields=[*command.transition_to(CommandState.EXPIRED), "error"])
        expired.append(command)
    return expired


@transaction.atomic
def expire_node_commands(node: Node, why: str) -> None:
    """Expire every open command of a node (it failed: none will be answered)."""
    expire_commands(Command.objects.select_for_update(no_key=True).filter(node=node, state__in=OPEN_COMMAND_STATES), why)


def _expire(command: Command, why: str, *, any_node: bool = False) -> None:
    """Expire one command and apply what that means to its job: a leader's (or, with
    ``any_node``, any node's) launch of the job's current run is a fault; a late preempt a kill."""
    expire_commands([command], why)
    control_logger.warning("command %s (%s on %s) expired: %s", command.id, command.kind, command.node.name, why)
    if command.job_id is None or not (any_node or command.payload.get("leader", True)):
        return
    job = Job.objects.select_for_update(no_key=True).get(pk=command.job_id)
    decision = decision_of(command)
    actor = "system"
    # A launch of an older run (the job recovered or resized since) says nothing about this one.
    current_run = command.payload.get("run_id") in (None, "", job.run_id)
    if command.kind == CommandKind.PREEMPT and job.state == JobState.CHECKPOINTING:
        nodes = job_nodes(job)
        gpus_before = job.allocations.count()
        facts, clause = lost_facts(job, kill_and_release(job))
        stopped = list(Node.objects.filter(name__in=nodes))
        write_stop_commands(job, stopped)
        dispatch_on_commit({n.id for n in stopped})
        record_event(EventKind.KILL, job=job, actor=actor, command=command.id, refers_to=decision,
                     nodes_before=nodes, gpus_before=gpus_before, gpus_after=0, outcome=facts,
                     reason={"rule": "deadline", "text": f"{job.name}: {why}; killed, GPUs released, {clause}.",
                             "inputs": {}})
    elif command.kind in LAUNCH_COMMANDS and job.state in (JobState.RUNNING, JobState.RESIZING) and current_run:
        record_job_fault(job, actor, f"{command.kind} of {job.name} on {command.node.name} expired: {why}",
                         command=command, refers_to=decision)

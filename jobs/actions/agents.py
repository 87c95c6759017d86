"""What node agents report (docs/control-loop.md): hello, heartbeats, step records and workers
that exit on their own; fencing the workers a node should no longer run, and on hello the runs
a restarted agent lost."""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from jobs.actions._common import (
    WORKING_JOB_STATES,
    agent_actor,
    control_logger,
    job_nodes,
    lose_unsaved_steps,
    lost_facts,
    note_checkpoint,
    release_allocations,
    stopped_layout,
    trigger_plan,
)
from jobs.actions.commands import (
    OPEN_COMMAND_STATES,
    decision_of,
    dispatch_on_commit,
    expire_commands,
    record_job_fault,
    write_stop_commands,
)
from jobs.audit import record_event
from jobs.models import Allocation, AllocationSpan, Command, Integration, Job, JobState, Node, NodeState
from jobs.models.commands import CommandState
from jobs.vocab import CommandKind, EventKind


def record_agent_hello(node: Node, workers: list[dict[str, Any]], address: str = "",
                       applied: Iterable[Any] = ()) -> list[Command]:
    """An agent (re)connected: note it alive (and where other nodes reach it), fence its stray
    workers, then reconcile what it runs with what is placed on it (``reconcile_lost_runs``).
    Returns the stops written for strays.

    Two transactions, on purpose: fencing locks the node row, reconciling locks job rows, and a
    planner pass locks a job before it references a node; holding both here could deadlock."""
    with transaction.atomic():
        changes: dict[str, Any] = {"last_heartbeat_at": timezone.now()}
        if isinstance(address, str) and 0 < len(address) <= 255:
            changes["address"] = address
        Node.objects.filter(pk=node.pk).update(**changes)
        fenced = fence_stray_workers(node, workers)
    reconcile_lost_runs(node, workers, applied)
    return fenced


@transaction.atomic
def reconcile_lost_runs(node: Node, workers: list[dict[str, Any]], applied: Iterable[Any]) -> list[Job]:
    """Jobs placed on the node whose current run the agent no longer has, each a fault (back to
    its last checkpoint; the planner recovers it), with an audit row that says so.

    A job is lost here when it is running (or resizing) with GPUs on the node, the node was sent
    a ``start`` or ``resume`` for its current run, the agent reports no worker of that run, no
    command of the job is still pending or sent to the node (those are replayed right after the
    hello, so the agent gets them again), and the agent does not list that launch among the
    commands it ``applied``: it is a new process (restarted, its ranks died with the old one), so
    an acknowledged command it forgot will never be answered either (it expires). A launch the
    agent does list is its own: its workers ended while the socket was down, and their ``exit``
    report follows the hello. Returns the jobs sent to recovery.
    """
    known = {a for a in applied if isinstance(a, str)}
    reported: dict[str, set[str]] = {}  # job -> run ids of its workers here ("" for a member, which names none)
    for worker in workers:
        if isinstance(worker.get("job"), str):
            run_id = worker.get("run_id")
            reported.setdefault(worker["job"], set()).add(run_id if isinstance(run_id, str) else "")
    placed = Allocation.objects.filter(node=node).values("job_id")
    lost: list[Job] = []
    for job in (Job.objects.select_for_update(no_key=True).filter(pk__in=placed, state__in=(JobState.RUNNING, JobState.RESIZING))
                .exclude(run_id="").order_by("name")):
        runs = reported.get(job.name, set())
        if job.run_id in runs or "" in runs:
            continue
        open_commands = list(Command.objects.select_for_update(no_key=True).filter(node=node, job=job,
                                                                        state__in=OPEN_COMMAND_STATES))
        if any(c.state in (CommandState.PENDING, CommandState.SENT) for c in open_commands):
            continue
        launch = (Command.objects.filter(node=node, job=job, kind__in=(CommandKind.START, CommandKind.RESUME),
                                         payload__run_id=job.run_id).order_by("-created_at").first())
        if launch is None or str(launch.id) in known:
            continue  # nothing launched here for this run yet (a resize's new node), or the agent's own
        forgotten = [c for c in open_commands if c.state == CommandState.ACKED]
        expire_commands(forgotten, f"{node.name} reconnected without it (the agent restarted)")
        answered = "acknowledged" if launch.state == CommandState.ACKED else f"reported {launch.state}"
        text = (f"{node.name} reconnected without the workers of job {job.name} (run {job.run_id}): its agent no "
                f"longer knows the {launch.kind} it {answered} (it restarted, and its ranks did not survive), "
                "so nothing of this run runs there")
        control_logger.warning("%s", text)
        record_job_fault(job, agent_actor(node), text, command=launch, refers_to=decision_of(launch),
                         extra={"run_id": job.run_id, "lost_on": node.name,
                                "expired_commands": [str(c.id) for c in forgotten]})
        lost.append(job)
    if lost:
        trigger_plan("lost_run")
    return lost


@transaction.atomic
def fence_stray_workers(node: Node, workers: list[dict[str, Any]]) -> list[Command]:
    """Stop any worker the agent runs for a job no longer placed on its node (a node back from a
    failure, or cut off for a while, must not keep training a job that moved on)."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    placed = set(Allocation.objects.filter(node=node).values_list("job__name", flat=True))
    fenced: list[Command] = []
    open_stops = set(
        Command.objects.filter(node=node, kind=CommandKind.STOP, state__in=OPEN_COMMAND_STATES)
        .values_list("job__name", flat=True)
    )
    # Each stray job once, however many times the agent lists it (one hello naming one worker
    # 2,000 times must not write 2,000 stops), and its jobs found in one query.
    strays = {w.get("job") for w in workers if isinstance(w.get("job"), str)} - placed - open_stops
    for job in Job.objects.filter(name__in=strays).order_by("name") if strays else ():
        fenced += write_stop_commands(job, [node])
        control_logger.warning("fencing %s on %s: the job is not placed there", job.name, node.name)
    if fenced:
        dispatch_on_commit({node.id})
    return fenced


def record_heartbeat(node: Node, workers: list[dict[str, Any]], disk: Any = None) -> None:
    """A heartbeat: the node is alive (a suspect node is healthy again; a failed one stays
    failed until repaired), the free space of its runs dir is noted (``disk``: ``{"free_bytes",
    "total_bytes"}``; anything else is ignored), and each worker's newest complete checkpoint.

    Not one transaction, on purpose: each write commits on its own, so a heartbeat never holds
    its node's row lock (taken by fencing) while it waits for a job row that a planner pass has
    locked; the pass, which locks the job first and references the node after, cannot deadlock
    with it.
    """
    now = timezone.now()
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now, **disk_usage_fields(disk))
    # The caller's Node may be stale (a consumer holds it for the whole connection): ask the row.
    if Node.objects.filter(pk=node.pk, state=NodeState.SUSPECT).exists():
        _heartbeat_heals(node)
    placed = set(Allocation.objects.filter(node=node).values_list("job_id", flat=True))
    placed_names = set(Job.objects.filter(id__in=placed).values_list("name", flat=True))
    strays = [w for w in workers if w.get("state") not in ("member", "exited") and isinstance(w.get("job"), str)
              and w["job"] not in placed_names]
    if strays:
        fence_stray_workers(node, strays)
    for worker in workers:
        step = worker.get("checkpoint_step")
        name = worker.get("job")
        if not isinstance(step, int) or not isinstance(name, str) or step < 0:
            continue
        Job.objects.filter(
            name=name, id__in=placed, last_checkpoint_step__lt=step, total_steps__gte=step,
            state__in=WORKING_JOB_STATES,
        ).update(last_checkpoint_step=step, last_checkpoint_at=now)


def disk_usage_fields(disk: Any) -> dict[str, int]:
    """The Node columns a heartbeat's ``disk`` report sets: both byte counts when they are
    plain non-negative integers with free <= total, else none (garbage never reaches the
    planner; the last good report stays)."""
    if not isinstance(disk, dict):
        return {}
    free, total = disk.get("free_bytes"), disk.get("total_bytes")
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63 for v in (free, total)):
        return {}
    if free > total:
        return {}
    return {"disk_free_bytes": free, "disk_total_bytes": total}


@transaction.atomic
def _heartbeat_heals(node: Node) -> None:
    fresh = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    if fresh.state == NodeState.SUSPECT:
        fresh.save(update_fields=fresh.transition_to(NodeState.HEALTHY))
        record_event(EventKind.NODE_REPAIRED, actor=agent_actor(node), nodes_after=[node.name],
                     reason={"rule": "heartbeat", "text": f"{node.name} answered heartbeats again; healthy.",
                             "inputs": {"node": node.name, "from": "suspect"}})


# How long after a job's last GPU on a node left it the node's step records of that job are still
# stored (as history only): a frame held by the agent through an outage, or the last steps before
# a preempt that arrive after its ``done``.
LATE_RECORDS_S = 3600


def record_step_records(node: Node, job_name: str, records: list[dict[str, Any]]) -> tuple[int | None, bool]:
    """Progress from a worker's step records: the job's committed step moves forward (never back
    past a fault's rollback, which resets it). Returns (the job's id, whether they were its
    progress). Records of a job no longer running here, or of another run than its current one
    (a frame held through an outage, sent again after the job moved, or was rolled back and
    relaunched), are history, not progress: the job's id while it held a GPU on this node within
    ``LATE_RECORDS_S``, else ``None`` (the node may not write them). One conditional update, no
    transaction needed."""
    job = Job.objects.filter(name=job_name, allocations__node=node).distinct().first()
    if job is not None and job.state in WORKING_JOB_STATES:
        steps = [r["step"] for r in records if isinstance(r.get("step"), int)
                 and (not job.run_id or r.get("run") in (None, job.run_id))]
        if not steps:
            return job.pk, False
        newest = min(max(steps), job.total_steps)
        Job.objects.filter(pk=job.pk, committed_steps__lt=newest).update(committed_steps=newest)
        return job.pk, True
    since = timezone.now() - timedelta(seconds=LATE_RECORDS_S)
    lately = (AllocationSpan.objects.filter(job__name=job_name, node=node)
              .filter(Q(ended_at__isnull=True) | Q(ended_at__gte=since))
              .values_list("job_id", flat=True).first())
    return lately, False


@transaction.atomic
def record_worker_exit(node: Node, job_name: str, outcome: dict[str, Any]) -> Job | None:
    """A node's ranks of a job exited on their own (no stop asked).

    ``completed`` from the leader: the job is done (GPUs freed). ``failed``: a rank exited
    non-zero; the job keeps the failure (exit code, rank, node, the last lines of its log) and
    restarts from its last checkpoint while ``restarts < max_restarts``, else it fails; the other
    ranks on every node are stopped either way. ``stopped``: an ``omni`` run stopped at a
    checkpoint by a signal from outside Omni; it recovers. Reports of an older run are ignored.
    """
    job = Job.objects.select_for_update(no_key=True).filter(name=job_name).first()
    if job is None:
        return None
    run_id = outcome.get("run_id")
    if isinstance(run_id, str) and run_id and job.run_id and run_id != job.run_id:
        return None
    result = outcome.get("outcome")
    if job.state != JobState.RUNNING or not job.allocations.filter(node=node).exists():
        if result == "failed":
            _keep_first_failure(job, node, outcome)
        return None
    actor = agent_actor(node)
    if result == "completed":
        if outcome.get("leader") is False:
            return None  # the leader's report completes the job
        _complete(job, actor, outcome)
    elif result in ("failed", "crashed"):
        _fail_or_restart(job, node, actor, outcome)
    elif result == "stopped":
        record_job_fault(job, actor, f"{job.name}'s ranks on {node.name} stopped at a checkpoint without a "
                         "command from Omni (a signal from outside)")
    else:
        return None
    trigger_plan("worker_exit")
    return job


def _complete(job: Job, actor: str, outcome: dict[str, Any]) -> None:
    step = outcome.get("step")
    fields = note_checkpoint(job, {"checkpoint_step": step}) if isinstance(step, int) else []
    gpus_before = job.allocations.count()
    job.committed_steps = job.total_steps if not isinstance(step, int) else min(step, job.total_steps)
    fields += job.transition_to(JobState.COMPLETED)
    job.save(update_fields=sorted({*fields, "committed_steps"}))
    nodes = release_allocations(job)
    # An ``omni`` run saves its last step as it ends, so the row names it as a checkpoint (the
    # job page's table, ``live_data.checkpoint_of``); a signal-mode script's saves are its own,
    # which Omni never sees, so its row says only how far it went.
    text = f"{job.name} finished at step {job.committed_steps}."
    if isinstance(after := outcome.get("teardown"), str):
        text += f" ({after[:400]}: nothing lost.)"  # a rank failed after the run ended well
    reached = {"step" if job.integration == Integration.OMNI else "steps": job.committed_steps}
    record_event(EventKind.COMPLETE, job=job, actor=actor, nodes_before=nodes, gpus_before=gpus_before,
                 gpus_after=0, **stopped_layout(job), global_batch=job.global_batch, outcome=reached,
                 reason={"rule": "complete", "text": text,
                         "inputs": {}})


FAILURE_TAIL_CHARS = 4000


def failure_of(node: Node, outcome: dict[str, Any]) -> dict[str, Any]:
    """What the job page, the API and the audit row say about a failed rank."""
    code = outcome.get("code")
    rank = outcome.get("rank")
    return {
        "code": code if isinstance(code, int) else None,
        "rank": rank if isinstance(rank, int) else None,
        "signal": outcome.get("signal") if isinstance(outcome.get("signal"), int) else None,
        "node": node.name,
        "run_id": str(outcome.get("run_id") or ""),
        "at": outcome.get("at") if isinstance(outcome.get("at"), (int, float)) else timezone.now().timestamp(),
        "tail": str(outcome.get("error") or "")[-FAILURE_TAIL_CHARS:],
    }


def failure_words(job: Job, failure: dict[str, Any]) -> str:
    who = f"rank {failure['rank']}" if failure.get("rank") is not None else "torchrun"
    how = f"signal {failure['signal']}" if failure.get("signal") else f"code {failure.get('code')}"
    last = failure_line(failure.get("tail", ""))
    return f"{job.name}: {who} on {failure['node']} exited with {how}" + (f" ({last[:200]})" if last else "")


#: A Python exception's last traceback line: ``RuntimeError: ...``, ``torch.distributed.DistBackendError:
#: ...``, a bare ``KeyboardInterrupt``.
EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(:\s|:$|$)")
#: What torchrun puts before each line a rank prints (``[rank1]: ...``, ``[default0]:...``).
RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]: ?")


def failure_line(tail: str) -> str:
    """The line that says why a rank died: the exception of its last Python traceback when it
    printed one, else its last non-blank line. What a process aborted in teardown prints, such
    as "terminate called without an active exception", is not the cause, whether it comes after
    the traceback or among its lines (an abort can write to stderr while Python still prints the
    frames): the exception is the first unindented line after the traceback's header that reads
    ``Name: message`` (or a bare ``Name``), else the first unindented one. torchrun's
    ``[rank1]:`` prefix on each line of a rank's output is read past and left out."""
    lines = [RANK_PREFIX.sub("", line, count=1) for line in tail.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if starts:
        after = [line.strip() for line in lines[starts[-1] + 1:]
                 if line.strip() and not line.startswith((" ", "\t"))]
        if after:
            return next((line for line in after if EXCEPTION_LINE.match(line)), after[0])
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


def _fail_or_restart(job: Job, node: Node, actor: str, outcome: dict[str, Any]) -> None:
    failure = failure_of(node, outcome)
    job.failure = failure
    words = failure_words(job, failure)
    if job.restarts < job.max_restarts:
        job.restarts += 1
        job.save(update_fields=["failure", "restarts"])
        record_job_fault(job, actor, f"{words}; restart {job.restarts} of {job.max_restarts}",
                         kind=EventKind.RESTART, extra={"failure": failure, "restart": job.restarts})
        return
    gpus_before = job.allocations.count()
    nodes = job_nodes(job)
    lost = lose_unsaved_steps(job)
    job.save(update_fields=[*job.transition_to(JobState.FAILED), "failure", "committed_steps"])
    survivors = list(Node.objects.filter(name__in=nodes).exclude(state=NodeState.FAILED))
    Allocation.objects.filter(job=job).release()
    write_stop_commands(job, survivors)
    dispatch_on_commit({n.id for n in survivors})
    limit = f"no restarts left ({job.max_restarts} allowed)" if job.max_restarts else "max_restarts is 0"
    record_event(EventKind.FAIL, job=job, actor=actor, nodes_before=nodes, gpus_before=gpus_before, gpus_after=0,
                 **stopped_layout(job), global_batch=job.global_batch,
                 outcome={"failure": failure, **lost_facts(job, lost, resumes=False)[0], "restarts": job.restarts},
                 reason={"rule": "script_failed", "text": f"{words}; {limit}: the job failed, the other ranks "
                         "were stopped and its GPUs released.", "inputs": {"max_restarts": job.max_restarts}})


def _keep_first_failure(job: Job, node: Node, outcome: dict[str, Any]) -> None:
    """Another node's report of the same run's failure, after the job already failed: the rank
    that failed first is the cause (the others usually fail because it left)."""
    if job.state not in (JobState.FAILED, JobState.RECOVERING) or not job.failure:
        return
    failure = failure_of(node, outcome)
    if failure["run_id"] == job.failure.get("run_id") and failure["at"] < float(job.failure.get("at") or 0):
        job.failure = failure
        job.save(update_fields=["failure"])

"""Writes on jobs by people (and the seed): submit, cancel, an operator's edit, and place a job
on given GPUs; and the checks on a job's workload (what it runs) that every surface shares."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from jobs.actions._common import (
    actor_name,
    describe_changes,
    release_allocations,
    stopped_layout,
    trigger_plan_with_broker,
)
from jobs.actions.commands import dispatch_on_commit, write_stop_commands
from jobs.actions.edits import FieldErrors, changed_facts, refuse_invalid, wait_for_planner, with_changes
from jobs.actions.teams import default_team, is_member
from jobs.audit import record_event
from jobs.models import (
    Allocation,
    Integration,
    Job,
    JobState,
    Node,
    PlannerControl,
    Priority,
    Reservation,
    Team,
)
from jobs.models.jobs import ACTIVE_JOB_STATES, reference_entrypoint
from jobs.planner.layout import fit_problems
from jobs.planner.wording import plural
from jobs.roles import is_operator, require_job_actor, require_operator
from jobs.vocab import EventKind

# -- the workload: what a job runs (docs/workloads.md) ---------------------------------------------

ENTRYPOINT_MAX_ARGS = 256
ARG_MAX_CHARS = 4096  # one argv word, one environment value
WORKDIR_MAX_CHARS = 1024
ENV_MAX_VARS = 100
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# What torchrun and the agent set for every rank: a job's own value would break its launch.
LAUNCHER_ENV = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
})
LAUNCHER_ENV_PREFIXES = ("OMNI_", "TORCHELASTIC_")
GRACE_S_MAX = 3600.0
MAX_RESTARTS_MAX = 100
KEEP_CHECKPOINTS_MAX = 100


def env_problems(env: Any) -> list[str]:
    """What is wrong with a job's extra environment; names only, never a value, since the
    messages are shown and logged."""
    if not isinstance(env, dict):
        return ['a mapping of names to strings, e.g. {"HF_HOME": "/data/hf"}']
    problems = []
    if len(env) > ENV_MAX_VARS:
        problems.append(f"at most {ENV_MAX_VARS} variables, not {len(env)}")
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            problems.append(f"{str(name)[:64]!r} is not a variable name (letters, digits and _, not first a digit)")
        elif name.startswith(LAUNCHER_ENV_PREFIXES) or name in LAUNCHER_ENV:
            problems.append(f"{name} is set by Omni and torchrun for every rank")
        elif not isinstance(value, str):
            problems.append(f"the value of {name} is not a string")
        elif len(value) > ARG_MAX_CHARS:
            problems.append(f"the value of {name} is longer than {ARG_MAX_CHARS} characters")
        elif "\0" in value:
            problems.append(f"the value of {name} contains a NUL character")
    return problems


def entrypoint_problems(entrypoint: Any) -> list[str]:
    """What is wrong with a job's argv."""
    if not isinstance(entrypoint, list) or not all(isinstance(word, str) for word in entrypoint):
        return ['a list of strings (an argv), e.g. ["train.py", "--lr", "3e-4"] or ["-m", "my_pkg.train"]']
    if not 1 <= len(entrypoint) <= ENTRYPOINT_MAX_ARGS:
        return [f"1 to {ENTRYPOINT_MAX_ARGS} words, not {len(entrypoint)}"]
    problems = []
    for index, word in enumerate(entrypoint):
        if not word:
            problems.append(f"word {index} is empty")
        elif len(word) > ARG_MAX_CHARS:
            problems.append(f"word {index} is longer than {ARG_MAX_CHARS} characters")
        elif "\0" in word:
            problems.append(f"word {index} contains a NUL character")
    return problems


def workload_problems(job: Job) -> FieldErrors:
    """Why ``job``'s workload (entrypoint, workdir, env, integration and its knobs) cannot run, by
    field; {} if it can. Submit and an operator's edit ask it, so the API, the admin and the
    submit form refuse the same things with the same words."""
    errors: FieldErrors = {}
    if problems := entrypoint_problems(job.entrypoint):
        errors["entrypoint"] = problems
    if not isinstance(job.workdir, str) or len(job.workdir) > WORKDIR_MAX_CHARS or "\0" in job.workdir:
        errors["workdir"] = [f"a path of at most {WORKDIR_MAX_CHARS} characters"]
    elif job.workdir and not PurePosixPath(job.workdir).is_absolute():
        errors["workdir"] = ["an absolute path (or empty: the job's run dir)"]
    if problems := env_problems(job.env):
        errors["env"] = problems
    if not 0 < job.grace_s <= GRACE_S_MAX:
        errors["grace_s"] = [f"more than 0 and at most {GRACE_S_MAX:g} seconds"]
    if not 0 <= job.max_restarts <= MAX_RESTARTS_MAX:
        errors["max_restarts"] = [f"0 to {MAX_RESTARTS_MAX}"]
    if not 1 <= job.keep_checkpoints <= KEEP_CHECKPOINTS_MAX:
        errors["keep_checkpoints"] = [f"1 to {KEEP_CHECKPOINTS_MAX}"]
    if job.integration == Integration.SIGNAL:
        # A signal-mode script knows nothing of Omni: it cannot be resized, only stopped.
        for field in ("dp_min", "dp_max"):
            if getattr(job, field) != job.dp:
                errors.setdefault(field, []).append(
                    f"signal-mode jobs are not elastic: {field} must equal dp ({job.dp}), not {getattr(job, field)}"
                )
    return errors


def entrypoint_words(entrypoint: list[str]) -> str:
    """An argv as one shell line, the way audit rows and pages show it."""
    return shlex.join(entrypoint)


def env_names(env: dict[str, str]) -> list[str]:
    """What the audit log and the pages say of a job's environment: its names, never its values."""
    return sorted(env)


class _DefaultTeam:
    """A submit that names no team: it goes to the submitter's default team (docs/teams.md)."""

    def __repr__(self) -> str:
        return "DEFAULT_TEAM"


DEFAULT_TEAM: Any = _DefaultTeam()


def submission_team(owner, team: Team | None | _DefaultTeam, errors: FieldErrors) -> Team | None:
    """The team a job submitted by ``owner`` runs under: the one named (``None``: no team, it only
    borrows), else the owner's default team. A researcher submits only to a team they are in, an
    operator to any; a refusal goes into ``errors`` under ``team``."""
    if isinstance(team, _DefaultTeam):
        return default_team(owner)
    if team is not None and not is_operator(owner) and not is_member(owner, team):
        errors["team"] = [f"you are not in team {team.name}: submit to a team you belong to (or ask an operator)"]
    return team


@dataclass
class SubmissionCheck:
    """What ``check_submission`` found: the job as it would be saved (unsaved), the problems by
    field ({} when it may be submitted) and the GPUs of every node by leaf switch, so that a
    preview can say where it fits by the same rule (``fit_problems``)."""

    job: Job
    errors: FieldErrors
    switch_gpus: dict[str, list[int]]

    @property
    def node_gpus(self) -> list[int]:
        return [gpus for nodes in self.switch_gpus.values() for gpus in nodes]


def check_submission(
    owner,
    *,
    name: str,
    priority: str,
    dp: int,
    global_batch: int,
    micro_batch: int,
    total_steps: int,
    step_s: float,
    tp: int = 1,
    pp: int = 1,
    dp_min: int | None = None,
    dp_max: int | None = None,
    comm_fraction: float = 0.1,
    min_run_s: int | None = None,
    checkpoint_every_steps: int = 500,
    checkpoint_save_s: float = 30.0,
    checkpoint_load_s: float = 60.0,
    entrypoint: list[str] | None = None,
    workdir: str = "",
    env: dict[str, str] | None = None,
    integration: str = Integration.OMNI,
    grace_s: float = 30.0,
    max_restarts: int = 0,
    keep_checkpoints: int = 3,
    team: Team | None = DEFAULT_TEAM,
) -> SubmissionCheck:
    """Every rule ``submit_job`` applies, without writing anything: the submit form's live
    preview asks it, ``submit_job`` asks it and refuses what it finds (docstring there). A
    critical job from a non-operator is a ``priority`` problem here (``submit_job`` refuses it
    with a 403 before asking)."""
    errors: FieldErrors = {}
    if priority == Priority.CRITICAL and not is_operator(owner):
        errors["priority"] = ["only operators may submit critical jobs (they carry reservations and SLAs)"]
    min_field = "dp" if dp_min is None else "dp_min"  # name the field the submitter sent
    dp_min = dp if dp_min is None else dp_min
    dp_max = dp if dp_max is None else dp_max
    if micro_batch and dp and global_batch % (micro_batch * dp):
        errors["global_batch"] = [
            f"global batch {global_batch} is not micro-batch {micro_batch} × dp {dp} × a whole number of "
            f"accumulation steps ({micro_batch * dp} does not divide {global_batch})"
        ]
    if dp_min > dp_max:
        errors["dp_min"] = [f"dp_min {dp_min} is larger than dp_max {dp_max}"]
    elif not dp_min <= dp <= dp_max:
        errors["dp"] = [f"dp {dp} is outside [dp_min {dp_min}, dp_max {dp_max}]"]
    switch_gpus: dict[str, list[int]] = {}
    for switch, gpus in Node.objects.order_by("switch").values_list("switch", "gpu_count"):
        switch_gpus.setdefault(switch, []).append(gpus)
    if tp >= 1 and pp >= 1 and dp_min >= 1:
        node_gpus = [gpus for nodes in switch_gpus.values() for gpus in nodes]
        for problem_field, problem in fit_problems(tp, pp, dp_min, node_gpus).items():
            errors.setdefault(min_field if problem_field == "dp_min" else problem_field, [problem])
    if Job.objects.filter(name=name).exists():
        errors["name"] = [f"a job named {name!r} already exists"]
    if min_run_s is None:
        min_run_s = PlannerControl.load().min_run_s if priority == Priority.REGULAR else 0
    team = submission_team(owner, team, errors)
    job = Job(
        name=name,
        owner=owner,
        team=team,
        priority=priority,
        tp=tp,
        pp=pp,
        dp=dp,
        dp_min=dp_min,
        dp_max=dp_max,
        global_batch=global_batch,
        micro_batch=micro_batch,
        accum_steps=global_batch // (micro_batch * dp) if micro_batch and dp else 0,
        total_steps=total_steps,
        step_s=step_s,
        comm_fraction=comm_fraction,
        min_run_s=min_run_s,
        checkpoint_every_steps=checkpoint_every_steps,
        checkpoint_save_s=checkpoint_save_s,
        checkpoint_load_s=checkpoint_load_s,
        entrypoint=reference_entrypoint() if entrypoint is None else list(entrypoint),
        workdir=workdir,
        env={} if env is None else dict(env),
        integration=integration,
        grace_s=grace_s,
        max_restarts=max_restarts,
        keep_checkpoints=keep_checkpoints,
    )
    for problem_field, problems in workload_problems(job).items():
        errors.setdefault(problem_field, problems)
    return SubmissionCheck(job=job, errors=errors, switch_gpus=switch_gpus)


@transaction.atomic
def submit_job(owner, *, priority: str, **spec: Any) -> Job:
    """Queue a new job at its preferred DP; the planner places it. ``spec``: the keyword
    arguments of ``check_submission`` (name, dp, global_batch, micro_batch, total_steps, step_s
    and the optional layout, estimates and workload).

    Refused with a message per field (the API's 400) when the spec is inconsistent, its workload
    cannot run (``workload_problems``: a signal-mode job is not elastic, so its DP bounds default
    to ``dp`` and must equal it) or the job could never run on this cluster
    (``jobs.planner.layout.fit_problems``: a tensor-parallel group larger than the largest node,
    more replicas at the least than the cluster holds). The audit row names the environment's
    variables, never their values.
    """
    if priority == Priority.CRITICAL:
        require_operator(owner, "submit critical jobs (they carry reservations and SLAs)")
    checked = check_submission(owner, priority=priority, **spec)
    if checked.errors:
        raise ValidationError(checked.errors)
    job = checked.job
    job.full_clean()
    job.save()
    record_event(
        EventKind.SUBMIT,
        job=job,
        actor=actor_name(owner),
        actor_user=owner,
        dp_after=job.dp,
        accum_after=job.accum_steps,
        global_batch=job.global_batch,
        gpus_after=job.gpus_wanted,
        reason={
            "rule": "submit",
            "text": f"{owner.get_username()} submitted {job.name} ({job.get_priority_display().lower()}, "
            f"{job.tp}x{job.pp}x{job.dp} = {plural(job.gpus_wanted, 'GPU')}, global batch {job.global_batch}), running "
            f"{entrypoint_words(job.entrypoint)} ({job.integration})"
            f"{f' for team {job.team.name}' if job.team_id else ''}.",
            "inputs": {
                "team": job.team.name if job.team_id else None,
                "tp": job.tp, "pp": job.pp, "dp": job.dp, "dp_min": job.dp_min, "dp_max": job.dp_max,
                "entrypoint": job.entrypoint, "workdir": job.workdir, "env": env_names(job.env),
                "integration": job.integration, "grace_s": job.grace_s, "max_restarts": job.max_restarts,
                "keep_checkpoints": job.keep_checkpoints,
            },
        },
    )
    trigger_plan_with_broker("job_submitted")
    return job


@transaction.atomic
def cancel_job(job: Job, actor) -> Job:
    """Cancel a job: stop its workers and free its GPUs. Terminal jobs answer 409."""
    job = Job.objects.select_for_update(no_key=True).get(pk=job.pk)
    require_job_actor(actor, job, "cancel")
    was_active = job.state in ACTIVE_JOB_STATES
    gpus_before = job.allocations.count()
    job.save(update_fields=job.transition_to(JobState.CANCELLED))
    nodes = release_allocations(job)
    if was_active:
        stopped = list(Node.objects.filter(name__in=nodes))
        write_stop_commands(job, stopped, kill=False)
        dispatch_on_commit({n.id for n in stopped})
    trigger_plan_with_broker("job_cancelled")
    record_event(
        EventKind.CANCEL,
        job=job,
        actor=actor_name(actor),
        actor_user=actor,
        nodes_before=nodes,
        gpus_before=gpus_before,
        gpus_after=0,
        **(stopped_layout(job) if gpus_before else {}),  # a job cancelled while waiting ran at no layout
        global_batch=job.global_batch,
        reason={"rule": "cancel", "text": f"{actor_name(actor)} cancelled {job.name}.", "inputs": {}},
    )
    return job


# -- an operator's edit ---------------------------------------------------------------------------

# What the control plane reads afresh (the planner on every pass, the restart rule when the code
# fails) and nothing on a node depends on: an operator may change it until the job ends.
JOB_EDITABLE_UNTIL_DONE = ("owner", "priority", "min_run_s", "max_restarts")
# The spec the job's workers are launched with (layout, batch, steps, checkpoint cadence, the
# workload) and the estimates the planner sizes it by: fixed once the job has started, since its
# running workers and its checkpoints would no longer match. DP and accumulation are the
# planner's throughout.
JOB_EDITABLE_WHILE_PENDING = (
    "tp", "pp", "dp_min", "dp_max", "global_batch", "micro_batch", "total_steps", "step_s", "comm_fraction",
    "checkpoint_every_steps", "checkpoint_save_s", "checkpoint_load_s",
    "entrypoint", "workdir", "env", "integration", "grace_s", "keep_checkpoints",
)
WORKLOAD_FIELDS = ("entrypoint", "workdir", "env", "integration", "grace_s", "max_restarts", "keep_checkpoints")


def job_editable_fields(job: Job) -> tuple[str, ...]:
    """The fields an operator may change on ``job`` in its present state."""
    if job.is_terminal:
        return ()
    if job.state == JobState.PENDING:
        return JOB_EDITABLE_UNTIL_DONE + JOB_EDITABLE_WHILE_PENDING
    return JOB_EDITABLE_UNTIL_DONE


def _why_fixed(job: Job, field: str) -> str:
    if job.is_terminal:
        return f"{job.name} is {job.state}: it can no longer change"
    if field in JOB_EDITABLE_WHILE_PENDING:
        return f"only a pending job's {field} can change; {job.name} is {job.state}"
    return "this field cannot be changed here"


def _live_reservations(job: Job) -> list[Reservation]:
    ended = Q(cancelled_at__isnull=False) | Q(end_at__lte=timezone.now())
    return list(job.reservations.exclude(ended))


def job_with_changes(job: Job, changes: dict[str, Any]) -> Job:
    """The job as the edit would leave it, its accumulation recomputed so the global batch holds,
    or a ValidationError naming each refused field. The admin's form asks it; ``edit_job`` asks
    again under its locks."""
    errors = {field: [_why_fixed(job, field)] for field in sorted(set(changes) - set(job_editable_fields(job)))}
    edited = with_changes(job, changes)
    for field in ("tp", "pp", "dp_min", "global_batch", "micro_batch"):
        if getattr(edited, field) < 1:
            errors[field] = [f"{field} is at least 1"]
    if errors:
        raise ValidationError(errors)  # the checks below divide by these
    owner = changes.get("owner")
    if owner is not None and not owner.is_active:
        errors["owner"] = [f"{owner} is a disabled account"]
    reservations = _live_reservations(job) if job.priority == Priority.CRITICAL else []
    if reservations and edited.priority != Priority.CRITICAL:
        held = ", ".join(r.name for r in reservations)
        errors["priority"] = [f"only critical jobs hold reservations: cancel {held} first"]
    for reservation in reservations:
        if reservation.gpus % edited.replica_gpus:
            errors.setdefault("pp" if "pp" in changes else "tp", []).append(
                f"reservation {reservation.name} holds {reservation.gpus} GPUs, not a whole number of "
                f"{edited.tp}x{edited.pp}-GPU replicas"
            )
    if not edited.dp_min <= edited.dp <= edited.dp_max:
        errors["dp_min" if "dp_min" in changes else "dp_max"] = [
            f"{job.name} is at DP {edited.dp}: [dp_min {edited.dp_min}, dp_max {edited.dp_max}] must include it"
        ]
    elif edited.global_batch % (edited.micro_batch * edited.dp):
        errors["global_batch" if "global_batch" in changes else "micro_batch"] = [
            f"global batch {edited.global_batch} does not split into {edited.dp} replicas of micro-batch "
            f"{edited.micro_batch}"
        ]
    else:
        edited.accum_steps = edited.global_batch // (edited.micro_batch * edited.dp)
    if edited.total_steps < edited.committed_steps:
        errors["total_steps"] = [f"{job.name} has already run {edited.committed_steps} steps"]
    if {"tp", "pp", "dp_min"} & set(changes):  # the same "can it ever run here" rule as submit_job
        node_gpus = list(Node.objects.values_list("gpu_count", flat=True))
        for field, problem in fit_problems(edited.tp, edited.pp, edited.dp_min, node_gpus).items():
            errors.setdefault(field, []).append(problem)
    if {*WORKLOAD_FIELDS, "dp_min", "dp_max"} & set(changes):  # the same workload rules as submit_job
        for field, problems in workload_problems(edited).items():
            errors.setdefault(field, []).extend(problems)
    refuse_invalid(edited, errors)
    return edited


def _audit_words(before: dict[str, Any], after: dict[str, Any]) -> None:
    """An edit's before and after as the audit row keeps them: an argv as a shell line, and an
    environment as its names (a replaced value marked, never shown)."""
    for facts in (before, after):
        if "entrypoint" in facts:
            facts["entrypoint"] = entrypoint_words(facts["entrypoint"])
    if "env" in before:
        old, new = before["env"], after["env"]
        before["env"] = ", ".join(env_names(old))
        after["env"] = ", ".join(
            f"{name} (new value)" if name in old and old[name] != new[name] else name for name in env_names(new)
        )


@transaction.atomic
def edit_job(job: Job, actor, **changes: Any) -> Job:
    """Change a job's owner, priority or run guarantee, or a pending job's spec (see
    ``job_editable_fields``); the audit row keeps the before and after. Jobs are never deleted:
    they are cancelled."""
    require_operator(actor, "edit jobs")
    wait_for_planner()
    job = Job.objects.select_for_update(no_key=True).get(pk=job.pk)
    edited = job_with_changes(job, changes)
    before, after = changed_facts(job, edited, [*changes, "accum_steps"])
    if not before:
        return job
    edited.save(update_fields=list(before))
    _audit_words(before, after)
    record_event(
        EventKind.JOB_EDITED,
        job=edited,
        actor=actor_name(actor),
        actor_user=actor,
        dp_before=job.dp,
        dp_after=edited.dp,
        accum_before=job.accum_steps,
        accum_after=edited.accum_steps,
        global_batch=edited.global_batch,
        reason={
            "rule": "job_edited",
            "text": f"{actor_name(actor)} changed job {job.name}: {describe_changes(before, after)}.",
            "inputs": {"job": job.name, "before": before, "after": after},
        },
    )
    trigger_plan_with_broker("job_edited")
    return edited


@transaction.atomic
def place_job(
    job: Job,
    gpus: list[tuple[Node, int]],
    *,
    actor: str,
    reason: dict[str, Any],
    borrowed_from: Reservation | None = None,
    loan_until: datetime | None = None,
    since: datetime | None = None,
) -> Job:
    """Start a pending or preempted job on ``gpus`` (whole replicas), at the DP they make.

    The planner places through its pass (jobs.actions.planner_pass); this seeds a running job
    without agents: ``seed_demo``, the benchmarks and tests. ``since`` (default now) is when the
    job took the GPUs: a seed that also writes past telemetry places the job before it, since a
    job's charts show each GPU only from then on.
    """
    job = Job.objects.select_for_update(no_key=True).get(pk=job.pk)
    if len(gpus) % job.replica_gpus:
        raise ValidationError({"gpus": f"{len(gpus)} GPUs is not a whole number of {job.replica_gpus}-GPU replicas"})
    if any(not node.is_schedulable for node, _ in gpus):
        raise ValidationError({"gpus": "every GPU must be on a healthy node"})
    dp_before, accum_before = job.dp, job.accum_steps
    job.set_dp(len(gpus) // job.replica_gpus)
    fields = job.transition_to(JobState.RUNNING)
    job.pending_reason = ""
    job.save(update_fields=[*fields, "dp", "accum_steps", "pending_reason"])
    since = since or timezone.now()
    Allocation.objects.bulk_create(
        Allocation(job=job, node=node, gpu_index=index, borrowed_from=borrowed_from, loan_until=loan_until,
                   since=since)
        for node, index in gpus
    )
    record_event(
        EventKind.LEND if borrowed_from is not None else EventKind.PLACE,
        job=job,
        actor=actor,
        nodes_after=[node.name for node, _ in gpus],
        gpus_before=0,
        gpus_after=len(gpus),
        dp_before=dp_before,
        dp_after=job.dp,
        accum_before=accum_before,
        accum_after=job.accum_steps,
        global_batch=job.global_batch,
        reason=reason,
    )
    return job
